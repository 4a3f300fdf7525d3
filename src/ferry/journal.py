"""Every job's state, kept in the cluster it concerns and owned by one live ferry at a time.

One interface, :class:`Journal`, two stores: on NATS a key of the JetStream KV bucket
``ferry_ops`` (:class:`KvJournal`), on RabbitMQ a global parameter ``ferry-ops.<key>``
(:class:`ParamJournal`). The contract every job relies on:

- ``open()`` returns the key's state (None when there is none); ``save(**changes)`` writes
  the state with its owner (host, pid, process start) and a heartbeat; ``save(release=True)``
  gives ownership up so another ferry may adopt at once; ``delete()`` and ``stop()`` remove
  the key (a driver's next save then fails with :class:`~ferry.errors.Conflict`: it stops).
- Another ferry may take a key over once its heartbeat is older than ``stale_after`` or its
  owner's process is gone on this host (:func:`owner_alive`).
- On NATS every save is a compare-and-set on the key's revision, so two drivers can never both
  believe they own it; ``request(**changes)`` changes fields without taking ownership (an
  operator's request to the owner, e.g. a relay's ``desired``). RabbitMQ has no compare-and-set:
  a save re-reads the parameter and refuses one deleted or owned by another live ferry (the race
  left is one HTTP round trip, which ``stop()`` closes).
- ``hold()`` is exclusive ownership for as long as a block runs: on NATS a compare-and-set claim
  kept by a heartbeat (:class:`Lease`), on RabbitMQ an exclusive queue the broker drops when
  ferry's connection dies (``<parameter>-lock``).
- :func:`open_bucket` is the one opener of ferry's KV buckets (``ferry_ops``; the partition
  claims' ``ferry_partitions``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from ferry.brokers.nats import while_electing
from ferry.brokers.rabbitmq import Management, amqp_connect, q
from ferry.errors import BrokerUnavailable, Conflict, NotFound

BUCKET = "ferry_ops"


async def open_bucket(
    nc: Client, name: str = BUCKET, *, replicas: int = 1, history: int = 5, create: bool = True
) -> Any:
    """The KV bucket `name`, created on first use with `replicas` and `history` (without `create`,
    None while there is none). Of two ferries creating it at once, the second opens the first's."""
    from nats.js.api import KeyValueConfig
    from nats.js.errors import BucketNotFoundError

    js = nc.jetstream()
    try:
        return await js.key_value(name)
    except BucketNotFoundError:
        if not create:
            return None
    try:
        return await js.create_key_value(KeyValueConfig(bucket=name, history=history, replicas=replicas))
    except Exception as exc:
        with contextlib.suppress(BucketNotFoundError):
            return await js.key_value(name)  # another ferry created it meanwhile
        raise BrokerUnavailable(f"cannot create the KV bucket {name} (R{replicas}): {exc}") from None


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


class Journal:
    """One operation's state under `key`, owned by one live ferry at a time (see the module)."""

    key: str
    state: dict[str, Any]
    stale_after: float

    async def open(self) -> dict[str, Any] | None:
        raise NotImplementedError

    async def get(self, key: str) -> dict[str, Any] | None:
        raise NotImplementedError

    async def keys(self, patterns: list[str]) -> list[str]:
        raise NotImplementedError

    async def all(self) -> dict[str, dict[str, Any]]:
        """Every key's state (deleted keys left out), in one read rather than one per key."""
        raise NotImplementedError

    async def version(self) -> Any:
        """A value that changes whenever any key does, cheaper to read than :meth:`all`: a reader
        keeps what it read while it stays the same. None: not known (read again)."""
        return None

    async def save(self, release: bool = False, **changes: Any) -> None:
        raise NotImplementedError

    async def delete(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        """Delete the key for another ferry's driver: its next save fails, so it stops."""
        await self.delete()

    @staticmethod
    def owner() -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid(), "started": _STARTED}

    def owner_alive(self, state: dict[str, Any]) -> bool:
        return owner_alive(state, self.stale_after)


class KvJournal(Journal):
    """One operation's state under ``key`` in the KV bucket ``ferry_ops`` of a NATS cluster."""

    def __init__(self, nc: Client, key: str, stale_after: float = 10.0, replicas: int = 1) -> None:
        self.nc, self.key, self.stale_after, self.replicas = nc, key, stale_after, replicas
        self.kv: Any = None
        self.revision = 0
        self.state: dict[str, Any] = {}
        self._background: asyncio.Future[None] | None = None
        self._writing = asyncio.Lock()  # one write at a time: each CAS needs the revision of the one before

    async def open(self, create: bool = True) -> dict[str, Any] | None:
        """Open the bucket (a key of '' opens only that); the key's current state, or None. Without
        `create`, a bucket not made yet is not made (a dry run's read): no state."""
        self.kv = await open_bucket(self.nc, replicas=self.replicas, create=create)
        entry = await self._entry(self.key) if self.key and self.kv else None
        if not entry or not entry.value:
            self.revision = 0  # gone (or deleted): the next save creates it
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

    async def version(self) -> tuple[int, int, int]:
        """The bucket stream's first and last sequence and message count: any put or delete moves
        the last, a record aged or purged out the first or the count."""
        state = (await self.nc.jsm().stream_info(f"KV_{BUCKET}")).state
        return state.first_seq, state.last_seq, state.messages

    async def all(self) -> dict[str, dict[str, Any]]:
        """One ordered consumer over the last message of each key, read until every key the
        stream held has arrived: about a quarter of the CPU of a get per key (bench/RESULTS.md,
        the console's /metrics). Ended by the stream's own subject list, not by the consumer's
        pending count (which nats-py was seen to report 0 for a full bucket)."""
        from nats.js.api import DeliverPolicy

        prefix = f"$KV.{BUCKET}."
        left = set(await self.keys([">"]))
        out: dict[str, dict[str, Any]] = {}
        if not left:
            return out
        sub = await self.nc.jetstream().subscribe(
            prefix + ">", ordered_consumer=True, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT
        )
        try:
            while left:
                msg = await sub.next_msg(timeout=5.0)
                key = msg.subject.removeprefix(prefix)
                left.discard(key)
                if msg.data and not (msg.headers or {}).get("KV-Operation"):  # DEL and PURGE carry no state
                    out[key] = json.loads(msg.data)
                else:
                    out.pop(key, None)
        finally:
            await sub.unsubscribe()
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
        async with self._writing:  # a background write (save_soon) may start while a save() writes
            await self._write_now(release, **changes)

    async def _write_now(self, release: bool = False, **changes: Any) -> None:
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

    @contextlib.asynccontextmanager
    async def hold(self, busy: str, interval: float = 2.0) -> AsyncIterator[Lease]:
        """Exclusive ownership of the key while the block runs: claimed by compare-and-set (of two
        ferries starting at once, one stops here), kept by a heartbeat every `interval` seconds
        (the :class:`Lease` yielded says when it was lost), deleted at the end. `busy`: the
        :class:`~ferry.errors.Conflict` message when another live ferry holds it."""
        held = await self.open()
        if held and self.owner_alive(held):
            o = held["owner"]
            raise Conflict(f"{busy} (ferry pid {o['pid']} on {o['host']})")
        self.state = {}
        try:
            await self.save(state="running")
        except Conflict:
            raise Conflict(busy) from None
        lease = Lease(self, interval)
        beat = asyncio.create_task(lease.beat())
        try:
            yield lease
        finally:
            beat.cancel()
            if not lease.lost.is_set():  # else it may be another holder's now
                with contextlib.suppress(Exception):
                    await self.delete()

    async def request(self, **changes: Any) -> dict[str, Any]:
        """Change fields of the key without taking ownership (an operator's request to its owner,
        which reads it at its next save); compare-and-set, tried again while the key changes."""
        from nats.js.errors import KeyWrongLastSequenceError

        for _ in range(20):
            state = await self.open()
            if state is None:
                raise NotFound(f"nothing is on record under {self.key!r}")
            state.update(changes)
            try:
                self.revision = await self.kv.update(self.key, json.dumps(state).encode(), last=self.revision)
                return state
            except KeyWrongLastSequenceError:
                continue
        raise Conflict(f"{self.key} keeps changing; try again")

    async def delete(self) -> None:
        await while_electing(lambda: self.kv.delete(self.key), nc=self.nc, subject=f"$KV.{BUCKET}.{self.key}")
        self.revision = 0

    async def stop(self) -> None:
        """Delete the key for another ferry's driver: its next save's CAS fails, so it stops."""
        await self.delete()


class ParamJournal(Journal):
    """The same contract on a RabbitMQ cluster: the global parameter ``ferry-ops.<key>``, through the
    management API. It has no compare-and-set, so each save re-reads the parameter first and refuses
    when it was deleted (stopped) or another live ferry owns it; the race left is one HTTP round trip,
    which :meth:`stop` closes by deleting again what such a save wrote back."""

    def __init__(self, m: Management, key: str, stale_after: float = 10.0, prefix: str = "ferry-ops.") -> None:
        self.m, self.key, self.stale_after, self.prefix = m, key, stale_after, prefix
        self.saved = False
        self.state: dict[str, Any] = {}

    def _path(self, key: str) -> str:
        return f"/global-parameters/{q(self.prefix + key)}"

    @contextlib.asynccontextmanager
    async def hold(self, vhost: str, busy: str) -> AsyncIterator[None]:
        """Exclusive ownership while the block runs: the queue ``<parameter>-lock`` declared exclusive
        on a connection of ferry's own, which the broker drops with the connection if ferry dies;
        :class:`~ferry.errors.Conflict` with `busy` when another ferry holds it."""
        import aiormq

        conn = await amqp_connect(self.m.cluster, self.m.broker, vhost=vhost, name="ferry-ctl-lock")
        try:
            channel = await conn.channel()
            try:
                await channel.declare_queue(f"{self.prefix}{self.key}-lock", exclusive=True, auto_delete=True)
            except aiormq.exceptions.ChannelLockedResource:
                raise Conflict(f"{self.m.name}: {busy}") from None
            yield
        finally:
            with contextlib.suppress(Exception):
                await conn.close()

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

        found = await self.m.get("/global-parameters") or []
        names = [p["name"].removeprefix(self.prefix) for p in found if p["name"].startswith(self.prefix)]
        return [n for n in names if any(matches(pat, n) for pat in patterns)]

    async def all(self) -> dict[str, dict[str, Any]]:
        """One GET of the global parameters."""
        found = await self.m.get("/global-parameters") or []
        return {
            p["name"].removeprefix(self.prefix): p["value"]
            for p in found
            if p["name"].startswith(self.prefix) and isinstance(p.get("value"), dict) and p["value"]
        }

    async def save(self, release: bool = False, **changes: Any) -> None:
        current = await self.get(self.key)
        mine = self.owner()
        if self.saved and current is None:
            raise Conflict(f"{self.key} was deleted (stopped)")
        if current and current.get("owner") not in (None, mine) and owner_alive(current, self.stale_after):
            raise Conflict(f"{self.key} was taken over by another ferry")
        self.state.update(changes, owner=None if release else mine, heartbeat=time.time())
        await self.m.put(self._path(self.key), {"name": self.prefix + self.key, "value": self.state})
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


class Lease:
    """The relay's hold on its journal key: every save (its own, and a heartbeat every `interval`
    seconds, whatever Spark is doing) goes through here; it notices a stop request or a takeover."""

    def __init__(self, j: Journal, interval: float) -> None:
        self.j, self.interval = j, interval
        self.lock = asyncio.Lock()
        self.stop_requested = asyncio.Event()
        self.lost = asyncio.Event()  # taken over, fenced, released, or unsaved too long: no more relaying
        self.saved_at = time.monotonic()

    async def save(self, release: bool = False, **changes: Any) -> None:
        async with self.lock:
            try:
                await self._save(release, changes)
            except Exception:  # the destination's KV did not answer: a standby may take over soon
                if time.monotonic() - self.saved_at > self.j.stale_after:
                    self.lost.set()

    async def _save(self, release: bool, changes: dict[str, Any]) -> None:
        for _ in range(3):
            if self.lost.is_set():
                return
            try:
                sent = time.monotonic()  # the heartbeat a standby reads is stamped before the write goes out
                await self.j.save(release=release, **changes)
                self.saved_at = sent
                if release:
                    self.lost.set()
                return
            except Conflict:
                fresh = await self.j.open()
            if not fresh or fresh.get("owner") != self.j.owner():
                self.lost.set()
                return
            self.j.state = fresh  # a request to this relay (the owner field is untouched)
            if fresh.get("desired") != "running":
                self.stop_requested.set()

    async def beat(self) -> None:
        """A heartbeat every `interval`; the lease counts as lost once no save went out for 3/4 of
        the time a standby waits, even while a write hangs (it is retried through elections for
        longer than that), so this relay stops before a standby may start."""
        while not self.lost.is_set():
            await asyncio.sleep(self.interval)
            saving = asyncio.ensure_future(self.save())
            while not saving.done():
                await asyncio.wait({saving}, timeout=0.1)
                if time.monotonic() - self.saved_at > 0.75 * self.j.stale_after:
                    self.lost.set()
