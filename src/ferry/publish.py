"""Safe JetStream publishing: pipelined, bounded, with a deadline on every ack.

nats-py's ``publish_async`` futures never time out, and a plain ``publish``
fails the caller during a leader election. :class:`Publisher` keeps a window of
in-flight publishes, re-sends any publish whose ack has not arrived within
``ack_timeout`` under the **same** ``Nats-Msg-Id`` (the stream drops the
duplicate and acks with the original sequence), and gives up only after
``give_up_after`` seconds. Applications use :func:`publish` for one message or
:class:`Publisher` for many::

    async with Publisher(nc) as pub:
        for i in range(10_000):
            await pub.publish("orders.eu", b"...", msg_id=f"order-{i}")
    print(pub.stats)   # stored, duplicates, retries, failed

Ordering: without faults a window on one connection is stored in order. A
retry can store a message after later ones; callers that must keep sequence
order set ``Nats-Expected-Last-Sequence`` per message and resync on failure
(see the jetstream sink's ordered mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from ferry.errors import FerryError

__all__ = ["Ack", "Pacer", "PublishError", "PublishStats", "Publisher", "publish"]

MSG_ID = "Nats-Msg-Id"
SOURCE_HDR = "Ferry-Source"  # what ferry's data plane adds to a copy: where it came from
SOURCE_SEQ_HDR = "Ferry-Source-Seq"
# what a replication relay adds (ferry replicate): the site, stream and sequence a message was first stored at
ORIGIN_SITE_HDR = "Ferry-Origin-Site"
ORIGIN_STREAM_HDR = "Ferry-Origin-Stream"
ORIGIN_SEQ_HDR = "Ferry-Origin-Seq"
ORIGIN_MSG_ID_HDR = "Ferry-Origin-Msg-Id"
_NO_RESPONDERS = "503"


class PublishError(FerryError):
    """A publish that JetStream refused (not a timeout: those are retried)."""


@dataclass
class Ack:
    """The outcome of one message: stored at `seq`, or refused with `error`."""

    subject: str
    msg_id: str | None
    seq: int = 0
    stream: str = ""
    duplicate: bool = False
    attempts: int = 1
    error: str | None = None
    err_code: int = 0
    ctx: Any = None
    acked_at: float = 0.0


@dataclass
class PublishStats:
    published: int = 0
    stored: int = 0
    duplicates: int = 0  # duplicate ack on the first attempt: the stream already had it
    retries: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "errors"} | {"errors": self.errors[:20]}


@dataclass
class _Pending:
    subject: str
    payload: bytes
    headers: dict[str, str] | None
    ack: Ack
    first_sent: float
    sent: float


class Publisher:
    """Pipelined JetStream publisher with a bounded window and per-attempt ack deadlines."""

    def __init__(
        self,
        nc: Client | Any,  # nats-py's Client, or the data plane's faster Wire
        *,
        window: int = 512,
        ack_timeout: float = 2.0,
        give_up_after: float = 120.0,
        on_ack: Callable[[Ack], None] | None = None,
        retry_codes: frozenset[int] = frozenset({503}),
    ) -> None:
        self.nc = nc
        self.window = window
        self.ack_timeout = ack_timeout
        self.give_up_after = give_up_after
        self.on_ack = on_ack
        self.retry_codes = retry_codes
        self.stats = PublishStats()
        self._pending: dict[str, _Pending] = {}
        self._slots = asyncio.Semaphore(window)
        self._idle = asyncio.Event()
        self._idle.set()
        self._prefix = ""
        self._counter = 0
        self._sub: Any = None
        self._reaper: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Publisher:
        await self.start()
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            await self.flush()
        await self.close()

    async def start(self) -> None:
        self._prefix = self.nc.new_inbox() + "."
        cb = self._reply if getattr(self.nc, "sync_callbacks", False) else self._on_reply  # ferry's own Wire
        self._sub = await self.nc.subscribe(self._prefix + "*", cb=cb)
        self._reaper = asyncio.create_task(self._reap())

    async def close(self) -> None:
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self._sub:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        *,
        headers: dict[str, str] | None = None,
        msg_id: str | None = None,
        ctx: Any = None,
    ) -> None:
        """Queue one message (waits while the window is full)."""
        if msg_id:
            headers = {**(headers or {}), MSG_ID: msg_id}
        await self._slots.acquire()
        now = time.monotonic()
        pending = _Pending(subject, payload, headers or None, Ack(subject, msg_id, ctx=ctx), now, now)
        self.stats.published += 1
        await self._send(pending)

    async def flush(self, timeout: float | None = None) -> PublishStats:
        """Wait until every queued message is acked or has failed."""
        await asyncio.wait_for(self._idle.wait(), timeout)
        return self.stats

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    # -- internals -----------------------------------------------------------------

    async def _send(self, p: _Pending) -> None:
        self._counter += 1
        token = str(self._counter)
        self._pending[token] = p
        self._idle.clear()
        p.sent = time.monotonic()
        if not self.nc.is_connected:  # nats-py would buffer (and then block): the reaper re-sends or gives up
            p.ack.error = "not connected"
            return
        try:
            await self.nc.publish(p.subject, p.payload, reply=self._prefix + token, headers=p.headers)
        except Exception as exc:  # closed/draining connection: let the reaper retry or fail it
            p.ack.error = f"{type(exc).__name__}: {exc}"

    def _finish(self, token: str, p: _Pending) -> None:
        self._pending.pop(token, None)
        p.ack.acked_at = time.time()
        if p.ack.error:
            self.stats.failed += 1
            if len(self.stats.errors) < 100:
                self.stats.errors.append(f"{p.subject} {p.ack.msg_id or ''}: {p.ack.error}".strip())
        elif p.ack.duplicate and p.ack.attempts == 1:
            self.stats.duplicates += 1
        else:
            self.stats.stored += 1
        self._slots.release()
        if not self._pending:
            self._idle.set()
        if self.on_ack:
            self.on_ack(p.ack)

    async def _on_reply(self, msg: Msg) -> None:
        self._reply(msg)

    def _reply(self, msg: Msg) -> None:
        token = msg.subject[len(self._prefix) :]
        p = self._pending.get(token)
        if p is None:
            return  # a late ack for an attempt already re-sent; the re-send's ack counts
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
            return  # stream unavailable (election): the reaper re-sends after ack_timeout
        try:
            resp = json.loads(msg.data)
        except ValueError:
            return
        err = resp.get("error")
        if err:
            code = err.get("code", 0)
            if code in self.retry_codes:
                return
            p.ack.error = err.get("description", str(err))
            p.ack.err_code = err.get("err_code", 0)
        else:
            p.ack.seq = resp.get("seq", 0)
            p.ack.stream = resp.get("stream", "")
            p.ack.duplicate = bool(resp.get("duplicate"))
            p.ack.error = None
        self._finish(token, p)

    async def _reap(self) -> None:
        tick = max(0.02, min(0.2, self.ack_timeout / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            overdue = [(t, p) for t, p in self._pending.items() if now - p.sent >= self.ack_timeout]
            for token, p in overdue:
                if self._pending.get(token) is not p:
                    continue
                if now - p.first_sent >= self.give_up_after:
                    p.ack.error = p.ack.error or f"no ack within {self.give_up_after:.0f}s"
                    self._finish(token, p)
                    continue
                if not self.nc.is_connected:
                    continue  # re-send once reconnected (or give up above)
                del self._pending[token]
                p.ack.attempts += 1
                p.ack.error = None
                self.stats.retries += 1
                await self._send(p)


async def publish(
    nc: Client,
    subject: str,
    payload: bytes = b"",
    *,
    msg_id: str,
    headers: dict[str, str] | None = None,
    ack_timeout: float = 2.0,
    give_up_after: float = 60.0,
) -> Ack:
    """Publish one message to JetStream safely: raises :class:`PublishError` only
    when the stream refuses it or no ack came within `give_up_after` seconds."""
    result: list[Ack] = []
    async with Publisher(
        nc, window=1, ack_timeout=ack_timeout, give_up_after=give_up_after, on_ack=result.append
    ) as pub:
        await pub.publish(subject, payload, headers=headers, msg_id=msg_id)
    ack = result[0]
    if ack.error:
        raise PublishError(f"publish to {subject} (msg id {msg_id}) failed: {ack.error}", subject=subject)
    return ack


class Pacer:
    """Paces a loop to `rate` iterations per second (None or 0: no limit)."""

    def __init__(self, rate: float | None) -> None:
        self.interval = 1.0 / rate if rate else 0.0
        self.next = time.monotonic()

    async def wait(self) -> None:
        if not self.interval:
            return
        self.next += self.interval
        delay = self.next - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        elif delay < -1.0:
            self.next = time.monotonic()  # fell far behind: don't burst to catch up
