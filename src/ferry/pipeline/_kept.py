"""What a long-lived Python process keeps open between Spark's calls into it (private).

A relay calls into Python every micro-batch (every 200 ms or so): Spark's
source process asks for the streams' last sequences, a reused Python worker
relays one range per stream. With ``asyncio.run`` per call, each call opened
its connections and created a consumer, then closed them with its loop: about
20 ms of every micro-batch here, which every message arriving meanwhile waits
for too. Here one event loop per process runs in a daemon thread, and what a
call opens on it (connections, a consumer and where it stands) stays open for
the next call under a key, until it has been idle for ``IDLE`` seconds. An entry is anything with ``async close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Hashable
from typing import Any, TypeVar

T = TypeVar("T")
IDLE = 120.0

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()
_entries: dict[Hashable, tuple[float, Any]] = {}


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on this process's lasting event loop and wait for its result."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="ferry-kept", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(coro, _loop).result()


async def get(key: Hashable, make: Callable[[], Awaitable[T]]) -> T:
    """The entry under `key`, made by `make()` if there is none; entries idle too long are closed."""
    now = time.monotonic()
    for old in [k for k, (used, _) in _entries.items() if now - used > IDLE and k != key]:
        await drop(old)
    entry = _entries[key][1] if key in _entries else await make()
    _entries[key] = (now, entry)
    return entry


async def drop(key: Hashable) -> None:
    """Close and forget the entry under `key` (after a failure, so the next call starts afresh)."""
    _, entry = _entries.pop(key, (0.0, None))
    if entry is not None:
        with contextlib.suppress(Exception):  # closing what may have failed
            await entry.close()
