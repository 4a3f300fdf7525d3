"""What a long-lived Python process keeps open between Spark's calls into it (private).

A relay calls into Python every micro-batch (every 200 ms or so): Spark's
source process asks for the streams' last sequences, a reused Python worker
relays one range per stream. With ``asyncio.run`` per call, each call opened
its connections and created a consumer, then closed them with its loop: about
20 ms of every micro-batch here, which every message arriving meanwhile waits
for too. Here one event loop per process runs in a daemon thread, and what a
call opens on it (connections, a consumer and where it stands) stays open for
the next call under a key, until it has been idle for ``IDLE`` seconds (less
than the 60 s after which the server deletes an idle reader's consumer). An
entry is anything with ``async close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Hashable
from typing import Any, TypeVar

T = TypeVar("T")
IDLE = 50.0

_loop: asyncio.AbstractEventLoop | None = None
_sweeper: Any = None
_lock = threading.Lock()
_entries: dict[Hashable, tuple[float, Any]] = {}


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on this process's lasting event loop and wait for its result."""
    global _loop, _sweeper
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="ferry-kept", daemon=True).start()
            _sweeper = asyncio.run_coroutine_threadsafe(_sweep(), _loop)
    return asyncio.run_coroutine_threadsafe(coro, _loop).result()


@contextlib.asynccontextmanager
async def using(key: Hashable, make: Callable[[], Awaitable[T]]) -> AsyncIterator[T]:
    """The entry under `key` (made by `make()` if there is none) for the block; closed and
    forgotten if the block fails, so that the next call starts afresh."""
    entry = _entries[key][1] if key in _entries else await make()
    _entries[key] = (math.inf, entry)  # in use: never idle
    try:
        yield entry
    except BaseException:
        await _drop(key)
        raise
    _entries[key] = (time.monotonic(), entry)


async def _drop(key: Hashable) -> None:
    _, entry = _entries.pop(key, (0.0, None))
    if entry is not None:
        with contextlib.suppress(Exception):  # closing what may have failed
            await entry.close()


async def _sweep() -> None:
    """Close the entries left idle (a stopped relay's)."""
    while True:
        await asyncio.sleep(IDLE / 2)
        now = time.monotonic()
        for key in [k for k, (used, _) in _entries.items() if now - used > IDLE]:
            await _drop(key)


def _forget() -> None:
    """In a forked child: the loop's thread was not forked with it."""
    global _loop
    _loop = None
    _entries.clear()


os.register_at_fork(after_in_child=_forget)
