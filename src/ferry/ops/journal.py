"""Operation state kept in the cluster it concerns, owned by one live ferry at a time.

Every operation (move, evacuation, rebalance) journals its state under one key:
on NATS in the JetStream KV bucket ``ferry_ops`` (``Journal``), on RabbitMQ in a
global parameter (``ParamJournal``). The owner (host, pid) refreshes a heartbeat
with each save; another ferry may take the key over once the heartbeat is older
than ``stale_after`` or the owner's process is gone on this host. On NATS every save
is a compare-and-set on the key's revision, so two drivers can never both
believe they own it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from ferry.brokers.nats import while_electing
from ferry.errors import Conflict

BUCKET = "ferry_ops"


async def bucket(nc: Client, replicas: int, create: bool = True) -> Any:
    """The ``ferry_ops`` KV bucket, created on first use (without `create`, None while there is none)."""
    from nats.js.api import KeyValueConfig
    from nats.js.errors import BucketNotFoundError

    js = nc.jetstream()
    try:
        return await js.key_value(BUCKET)
    except BucketNotFoundError:
        if not create:
            return None
        return await js.create_key_value(KeyValueConfig(bucket=BUCKET, history=5, replicas=replicas))


def process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, from /proc), so a reused pid is told
    apart; None when it is gone or a zombie. Without /proc, "?" for any live pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


_STARTED = process_start(os.getpid())


def running_here(state: dict[str, Any]) -> bool:
    """Whether the ferry that owns `state` is a process still running on this host."""
    o = state.get("owner") or {}
    if o.get("host") != socket.gethostname():
        return False
    try:
        started = process_start(int(o["pid"]))
    except (KeyError, ValueError, TypeError):
        return False
    return started is not None and o.get("started", started) in (started, "?")


def owner_alive(state: dict[str, Any], stale_after: float = 10.0) -> bool:
    """Whether the ferry that owns `state` is alive: a fresh heartbeat, and its process running if on this host."""
    o = state.get("owner") or {}
    if not o or time.time() - state.get("heartbeat", 0) > stale_after:
        return False
    return o.get("host") != socket.gethostname() or running_here(state)


class _Owned:
    """Who owns a journal key, for both kinds of journal."""

    stale_after: float

    @staticmethod
    def owner() -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid(), "started": _STARTED}

    def owner_alive(self, state: dict[str, Any]) -> bool:
        return owner_alive(state, self.stale_after)


class Journal(_Owned):
    """One operation's state under ``key`` in ``ferry_ops``."""

    def __init__(self, nc: Client, key: str, stale_after: float = 10.0, replicas: int = 1) -> None:
        self.nc, self.key, self.stale_after, self.replicas = nc, key, stale_after, replicas
        self.kv: Any = None
        self.revision = 0
        self.state: dict[str, Any] = {}
        self._background: asyncio.Future[None] | None = None

    async def open(self, create: bool = True) -> dict[str, Any] | None:
        """Open the bucket (a key of '' opens only that); the key's current state, or None. Without
        `create`, a bucket not made yet is not made (a dry run's read): no state."""
        self.kv = await bucket(self.nc, self.replicas, create)
        entry = await self._entry(self.key) if self.key and self.kv else None
        if not entry or not entry.value:
            return None
        self.revision = entry.revision
        return json.loads(entry.value)

    async def get(self, key: str) -> dict[str, Any] | None:
        """Another key's state (the bucket is open)."""
        entry = await self._entry(key)
        return json.loads(entry.value) if entry and entry.value else None

    async def _entry(self, key: str) -> Any:
        from nats.js.errors import KeyNotFoundError

        try:
            return await self.kv.get(key)
        except KeyNotFoundError:
            return None

    async def keys(self, patterns: list[str]) -> list[str]:
        """Keys matching NATS subject patterns, from the stream's own per-subject counts: nats-py's
        `kv.keys()` can end before its entries arrive (seen with a key updated every second)."""
        prefix = f"$KV.{BUCKET}."
        out: list[str] = []
        for pattern in patterns:
            info = await self.nc.jsm().stream_info(f"KV_{BUCKET}", subjects_filter=prefix + pattern)
            out += [subject.removeprefix(prefix) for subject in info.state.subjects or {}]
        return out

    async def save(self, release: bool = False, **changes: Any) -> None:
        """Write the state (CAS); ``release`` gives up ownership so another ferry may adopt at once."""
        if self._background:  # writes stay in order: each CAS needs the revision of the one before
            await self._background
        await self._write(release, **changes)

    def save_soon(self, **changes: Any) -> None:
        """Write the state in the background, unless a write is still under way (that one is the
        heartbeat): for loops that must not wait on the bucket, whose writes take seconds under
        load. The next :meth:`save` waits for it; a failure surfaces at the next call."""
        self.state.update(changes)
        if self._background and self._background.done():
            self._background, done = None, self._background
            done.result()
        if not self._background:
            self._background = asyncio.ensure_future(self._write())

    async def _write(self, release: bool = False, **changes: Any) -> None:
        from nats.js.errors import KeyWrongLastSequenceError

        self.state.update(changes, owner=None if release else self.owner(), heartbeat=time.time())
        data = json.dumps(self.state).encode()
        if self.revision:
            write = functools.partial(self.kv.update, self.key, data, last=self.revision)
        else:
            write = functools.partial(self.kv.create, self.key, data)
        try:
            self.revision = await while_electing(write, nc=self.nc, subject=f"$KV.{BUCKET}.{self.key}")
        except KeyWrongLastSequenceError:
            entry = await self._entry(self.key)  # a retried write whose first try was stored after all
            if not entry or entry.value != data:
                raise Conflict(f"{self.key} was changed by another ferry (taken over or stopped)") from None
            self.revision = entry.revision

    async def delete(self) -> None:
        await while_electing(lambda: self.kv.delete(self.key), nc=self.nc, subject=f"$KV.{BUCKET}.{self.key}")
        self.revision = 0

    async def stop(self) -> None:
        """Delete the key for another ferry's driver: its next save's CAS fails, so it stops."""
        await self.delete()


class ParamJournal(_Owned):
    """The same contract on a RabbitMQ cluster: the global parameter ``ferry-ops.<key>``, through the
    management API. It has no compare-and-set, so each save re-reads the parameter first and refuses
    when it was deleted (stopped) or another live ferry owns it; the race left is one HTTP round trip,
    which :meth:`stop` closes by deleting again what such a save wrote back."""

    PREFIX = "ferry-ops."

    def __init__(self, m: Any, key: str, stale_after: float = 10.0) -> None:
        self.m, self.key, self.stale_after = m, key, stale_after
        self.saved = False
        self.state: dict[str, Any] = {}

    def _path(self, key: str) -> str:
        from urllib.parse import quote

        return f"/global-parameters/{quote(self.PREFIX + key, safe='')}"

    async def open(self) -> dict[str, Any] | None:
        state = await self.get(self.key) if self.key else None
        self.saved = state is not None  # adopted: a later deletion means stopped, never "create it again"
        return state

    async def get(self, key: str) -> dict[str, Any] | None:
        got = await self.m.get(self._path(key), ok404=True)
        value = (got or {}).get("value")
        return value if isinstance(value, dict) and value else None

    async def keys(self, patterns: list[str]) -> list[str]:
        """Keys matching NATS-style patterns (``*`` one token, ``>`` the rest)."""
        from ferry.subjects import matches

        names = [p["name"].removeprefix(self.PREFIX) for p in await self.m.get("/global-parameters") or []]
        return [n for n in names if any(matches(pat, n) for pat in patterns)]

    async def save(self, release: bool = False, **changes: Any) -> None:
        current = await self.get(self.key)
        mine = self.owner()
        if self.saved and current is None:
            raise Conflict(f"{self.key} was deleted (stopped)")
        if current and current.get("owner") not in (None, mine) and owner_alive(current, self.stale_after):
            raise Conflict(f"{self.key} was taken over by another ferry")
        self.state.update(changes, owner=None if release else mine, heartbeat=time.time())
        await self.m.put(self._path(self.key), {"name": self.PREFIX + self.key, "value": self.state})
        self.saved = True

    async def delete(self) -> None:
        await self.m.delete(self._path(self.key))
        self.saved = False

    async def stop(self, settle: float = 1.5) -> None:
        """Delete the key for another ferry's driver, and keep it deleted: a save that read the
        parameter just before the delete writes it back one round trip later (CI saw a stopped
        evacuation live on so), so watch for `settle` seconds after the last delete."""
        await self.delete()
        quiet_until = time.monotonic() + settle
        while time.monotonic() < quiet_until:
            await asyncio.sleep(0.25)
            if await self.get(self.key):
                await self.delete()
                quiet_until = time.monotonic() + settle
