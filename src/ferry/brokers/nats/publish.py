"""Safe JetStream publishing: pipelined, bounded, with a deadline on every ack.

nats-py's ``publish_async`` futures never time out, and a plain ``publish``
fails the caller during a leader election. :class:`Publisher` keeps a window of
in-flight publishes, re-sends any publish whose ack has not arrived within
``ack_timeout`` under the **same** ``Nats-Msg-Id`` (the stream drops the
duplicate and acks with the original sequence), and gives up only after
``give_up_after`` seconds (twice that for a message whose id the leader says it
holds "in process", see ``_IN_PROCESS``). Applications use :func:`publish` for
one message or :class:`Publisher` for many::

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
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from ferry.brokers.nats.client import refused
from ferry.errors import BrokerUnavailable, ConfigError, FerryError
from ferry.headers import MSG_ID, encode_headers

log = logging.getLogger(__name__)

__all__ = ["Ack", "BatchPublisher", "Pacer", "PublishError", "PublishStats", "Publisher", "publish"]

# "duplicate message id is in process": the leader proposed a message with this id and has not stored it.
# A leader that lost proposals in an election can keep their ids so until the stream's duplicate window
# (2 minutes unless configured) passes (nats-server 2.14-2.15), so such a message is sent again until
# stored or known, for up to twice give_up_after.
_IN_PROCESS = 10158
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
    in_process: int = 0  # messages the leader said it held "in process" (see _IN_PROCESS)
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "errors"} | {"errors": self.errors[:20]}


@dataclass
class _Pending:
    subject: str
    payload: bytes
    headers: dict[str, str] | bytes | None
    ack: Ack
    first_sent: float
    sent: float
    in_process: bool = False  # the leader said it holds the id "in process": wait longer


def _closed(nc: Any) -> str:
    """Why `nc` is closed for good ("" while it is open or reconnecting)."""
    return (getattr(nc, "error", "") or "connection closed") if nc.is_closed else ""


def _tick(ack_timeout: float) -> float:
    """How often a publisher looks for overdue acks."""
    return max(0.02, min(0.2, ack_timeout / 4))


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
        headers: dict[str, str] | bytes | None = None,
        msg_id: str | None = None,
        ctx: Any = None,
    ) -> None:
        """Queue one message (waits while the window is full). `headers` may be a block already
        encoded (ferry's Wire only), which then carries `msg_id` itself."""
        if msg_id and not isinstance(headers, bytes):
            headers = {**(headers or {}), MSG_ID: msg_id}
        await self._slots.acquire()
        now = time.monotonic()
        pending = _Pending(subject, payload, headers or None, Ack(subject, msg_id, ctx=ctx), now, now)
        self.stats.published += 1
        await self._send(pending)

    async def publish_many(
        self, messages: Iterable[tuple[str, bytes, dict[str, str] | bytes | None, str | None]]
    ) -> None:
        """:meth:`publish` of each (subject, payload, headers, msg id)."""
        for subject, payload, headers, msg_id in messages:
            await self.publish(subject, payload, headers=headers, msg_id=msg_id)

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
            if err.get("err_code") == _IN_PROCESS:
                if not self.stats.in_process:
                    log.warning(
                        "%s: the stream's leader holds message ids 'in process' (proposals a "
                        "leader change lost?): sending them again until stored",
                        p.subject,
                    )
                self.stats.in_process += not p.in_process
                p.in_process = True
                return  # the reaper sends it again after ack_timeout
            if err.get("code", 0) in self.retry_codes:
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
        tick = _tick(self.ack_timeout)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            overdue = [(t, p) for t, p in self._pending.items() if now - p.sent >= self.ack_timeout]
            closed = _closed(self.nc)
            for token, p in overdue:
                if self._pending.get(token) is not p:
                    continue
                limit = self.give_up_after * (2 if p.in_process else 1)
                denial = refused(self.nc, p.subject)  # then no ack will ever come
                if now - p.first_sent >= limit or closed or denial:
                    p.ack.error = closed or (denial and str(denial)) or p.ack.error or f"no ack within {limit:.0f}s"
                    self._finish(token, p)
                    continue
                if not self.nc.is_connected:
                    continue  # re-send once reconnected (or give up above)
                del self._pending[token]
                p.ack.attempts += 1
                p.ack.error = None
                self.stats.retries += 1
                await self._send(p)


_FLOW = 500  # acks every N messages at most: the most a stream grants (server/jetstream_batching.go)
_AHEAD = 4  # messages sent past the last flow ack, in multiples of the stream's ack interval
_BATCH_GONE = 10208  # "batch publish ID unknown"
_BATCH_DISABLED = 10205


@dataclass(slots=True)
class _Queued:
    subject: bytes
    header: bytes
    payload: bytes
    first_sent: float


class BatchPublisher:
    """JetStream fast batch publishing: the stream acknowledges every N messages, not each one.

    Needs nats-server 2.14 or later and a stream with ``allow_batched``. In the
    lab's stream-to-stream copies it moved 1.3-1.7x as many messages per second as
    :class:`Publisher`, with less CPU on both sides (bench/RESULTS.md).

    The protocol (nats-server ``server/stream.go``, ``getFastBatch``): each
    message's reply subject is ``<inbox>.<batch id>.<flow>.fail.<batch seq>.<op>.$FI``
    (op 0 starts the batch, 1 appends, 3 commits without a message, 4 pings).
    With gap mode ``fail`` the stream stores a prefix of the batch, in order: it
    sends ``{"type": "ack", "seq": S, "msgs": N}`` once messages 1..S are stored
    (and asks for the next ack after N more), and answers the commit with a PubAck
    whose ``count`` says how many were. A refused or lost message ends the batch
    early, with such a PubAck.

    Recovery: whatever no ack confirmed is published again under its
    ``Nats-Msg-Id`` when the batch ended early, when the stream no longer knows it
    (it forgets a batch idle for 10 s), and when neither a flow ack nor the answer
    to a ping came within ``ack_timeout``; then a new batch goes on. The re-sends
    go one publish each through a :class:`Publisher`, not in the new batch: a
    batch counts a message whose id the leader holds "in process" as stored, and
    a leader that lost proposals in an election can hold their ids so until the
    stream's duplicate window passes (nats-server 2.14-2.15), so in a batch a
    re-sent message could be acked and never stored (the lab saw 76-230 such
    messages when leadership came back within seconds). A single publish is
    refused with 10158 instead and sent again. What this cannot catch: a message
    sent for the first time in a batch whose id the leader holds "in process"
    from an earlier publisher (a retried Spark task, say) whose proposal a leader
    change lost within the duplicate window; the ordered writer notices it by the
    stream's last sequence (and goes on one publish at a time), the others do not.
    As with :class:`Publisher`, a message sent again can be stored after later
    ones (the ordered writer keeps order with ``Nats-Expected-Last-Sequence``).
    The stream drops a re-sent message it already holds, so ``stats.stored``
    counts it as stored (and ``stats.duplicates`` stays 0). A message the stream refuses as the first of a
    batch or when sent again fails; one without an ack for ``give_up_after``
    seconds fails. With ``stop_on_refusal`` a refused message raises
    :class:`PublishError` (its ``err_code`` in ``fields``) from the next ``publish``
    or ``flush`` instead: what a writer that keeps order needs.
    """

    def __init__(
        self,
        nc: Any,  # the data plane's Wire (publish_raw)
        *,
        ack_timeout: float = 2.0,
        give_up_after: float = 120.0,
        retry_codes: frozenset[int] = frozenset({429, 503}),
        stop_on_refusal: bool = False,
    ) -> None:
        self.nc = nc
        self.ack_timeout = ack_timeout
        self.give_up_after = give_up_after
        self.retry_codes = retry_codes
        self.stop_on_refusal = stop_on_refusal
        self.stats = PublishStats()
        self._inbox = ""
        self._sub: Any = None
        self._batch = ""
        self._reply_to = b""
        self._sent = 0  # batch sequences sent
        self._acked = 0  # batch sequences 1.._acked stored
        self._ahead = 32  # how far past the last ack to send: _AHEAD times the stream's ack interval
        self._unacked: deque[_Queued] = deque()  # batch sequences _acked+1.._sent, in order
        self._last_subject = b""
        self._committed = False
        self._ended_at: float | None = None  # the batch is over: start another at this time
        self._fatal: FerryError | None = None  # raised by the next publish or flush
        self._progress = 0.0
        self._pinged = 0.0
        self._changed = asyncio.Event()
        self._tick = _tick(ack_timeout)

    async def __aenter__(self) -> BatchPublisher:
        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(self._inbox + ".>", cb=self._reply)
        self._restart()
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        try:
            if exc_type is None:
                await self.flush()
        finally:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        *,
        headers: dict[str, str] | bytes | None = None,
        msg_id: str | None = None,
    ) -> None:
        """Queue one message (waits while too far ahead of the stream's acks); `headers` as for
        :meth:`Publisher.publish`."""
        await self.publish_many(((subject, payload, headers, msg_id),))

    async def publish_many(
        self, messages: Iterable[tuple[str, bytes, dict[str, str] | bytes | None, str | None]]
    ) -> None:
        """:meth:`publish` of each (subject, payload, headers, msg id), in one coroutine (a copy's or
        a relay's list of messages)."""
        now = time.monotonic()
        for subject, payload, headers, msg_id in messages:
            while self._ended_at is not None or self._sent - self._acked >= self._ahead:
                await self._wait()
                now = time.monotonic()
            if not isinstance(headers, bytes):
                if msg_id:
                    headers = {**(headers or {}), MSG_ID: msg_id}
                headers = encode_headers(headers) if headers else b""
            self.stats.published += 1
            self._send(_Queued(subject.encode(), headers, payload, now))

    async def flush(self) -> PublishStats:
        """Commit the batch; wait until every message is stored or has failed."""
        while self._unacked or self._ended_at is not None:
            if self._ended_at is None and not self._committed:
                self._committed = True
                self._write(self._last_subject, self._sent + 1, 3)
            await self._wait()
        return self.stats

    # -- internals -----------------------------------------------------------------

    def _write(self, subject: bytes, seq: int, op: int, header: bytes = b"", payload: bytes = b"") -> None:
        try:  # noqa: SIM105 (contextlib.suppress costs a context manager per message)
            self.nc.publish_raw(subject, b"%s.%d.%d.$FI" % (self._reply_to, seq, op), header, payload)
        except FerryError:
            pass  # not connected and its buffer full: a gap, which ends the batch and is sent again

    def _send(self, q: _Queued) -> None:
        self._sent += 1
        self._unacked.append(q)
        self._last_subject = q.subject
        self._write(q.subject, self._sent, 0 if self._sent == 1 else 1, q.header, q.payload)

    def _restart(self) -> None:
        """A new batch."""
        self._batch = secrets.token_hex(8)
        self._reply_to = f"{self._inbox}.{self._batch}.{_FLOW}.fail".encode()
        self._sent = self._acked = 0
        self._ahead = 32
        self._committed = False
        self._ended_at = None
        self._progress, self._pinged = time.monotonic(), 0.0

    async def _resend(self, again: deque[_Queued]) -> None:
        """Publish what an ended batch did not confirm again, one publish each, in order."""
        self.stats.retries += len(again)
        give_up = max(self.ack_timeout, self.give_up_after - (time.monotonic() - again[0].first_sent))

        def refused(ack: Ack) -> None:
            if ack.error and self.stop_on_refusal and not self._fatal:
                self._fatal = PublishError(ack.error, subject=ack.subject, err_code=ack.err_code)

        async with Publisher(
            self.nc,
            # all at once: a message held back behind ids "in process" would go out once the window
            # that drops it as a duplicate has passed
            window=len(again),
            ack_timeout=self.ack_timeout,
            give_up_after=give_up,
            on_ack=refused,
            retry_codes=self.retry_codes,
        ) as pub:
            for q in again:
                await pub.publish(q.subject.decode(), q.payload, headers=q.header or None)
        self._progress = time.monotonic()  # the new batch's ack deadline starts now
        self.stats.stored += pub.stats.stored + pub.stats.duplicates
        self.stats.retries += pub.stats.retries
        self.stats.in_process += pub.stats.in_process
        if not self.stop_on_refusal:
            self.stats.failed += pub.stats.failed
            self.stats.errors += pub.stats.errors[: 100 - len(self.stats.errors)]

    def _end(self, delay: float = 0.0) -> None:
        if self._ended_at is None:
            self._ended_at = time.monotonic() + delay
        self._changed.set()

    def _confirm(self, seq: int) -> None:
        n = min(min(seq, self._sent) - self._acked, len(self._unacked))
        if n <= 0:
            return
        for _ in range(n):
            self._unacked.popleft()
        self._acked += n
        self.stats.stored += n
        self._progress, self._pinged = time.monotonic(), 0.0
        self._changed.set()

    def _fail(self, count: int, error: str) -> None:
        for _ in range(min(count, len(self._unacked))):
            q = self._unacked.popleft()
            self.stats.failed += 1
            if len(self.stats.errors) < 100:
                self.stats.errors.append(f"{q.subject.decode()}: {error}")
        self._acked += count  # the failed messages are done with; the batch is restarted anyway
        self._changed.set()

    def _reply(self, msg: Msg) -> None:
        batch, _, rest = msg.subject[len(self._inbox) + 1 :].partition(".")
        if batch != self._batch:
            return  # an earlier batch's: its messages were sent again
        seq, op = (int(t) for t in rest.split(".")[2:4])
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
            self._end(self.ack_timeout / 4)  # no leader now (an election): the message went nowhere
            return
        try:
            resp = json.loads(msg.data)
        except ValueError:
            return
        kind = resp.get("type")
        if kind == "ack":
            self._ahead = max(_AHEAD * int(resp.get("msgs") or 1), 32)
            self._changed.set()  # a wider window wakes a publisher waiting on the first ack (seq 0)
            self._confirm(int(resp.get("seq") or 0))
        elif "batch" in resp:  # the PubAck: the batch is over, 1..count stored
            self._confirm(int(resp.get("count") or 0))
            self._end()
        elif kind is None and "error" in resp:  # the first message refused, or the batch unknown
            err = resp["error"]
            code, err_code = err.get("code", 0), err.get("err_code", 0)
            if err_code == _BATCH_DISABLED:
                self._fatal = ConfigError(
                    f"stream {resp.get('stream', '?')}: batch publish is disabled (allow_batched is off)"
                )
            elif seq == 1 and op == 0 and err_code != _BATCH_GONE and code not in self.retry_codes:
                text = err.get("description", str(err))
                if self.stop_on_refusal:
                    self._fatal = PublishError(text, subject=self._unacked[0].subject.decode(), err_code=err_code)
                else:
                    self._fail(1, text)
            self._end(self.ack_timeout / 4 if code in self.retry_codes else 0.0)
        # "gap" and "err" are informational: the PubAck that ends the batch follows

    async def _wait(self) -> None:
        """Until something changed (or a tick passed); restart an ended or stalled batch."""
        if not self._fatal and (closed := _closed(self.nc)):
            self._fatal = BrokerUnavailable(f"{self.nc.name}: {closed}")
        if self._fatal:
            raise self._fatal
        now = time.monotonic()
        if self._ended_at is not None and now >= self._ended_at:
            again, self._unacked = self._unacked, deque()
            self._restart()  # first: the ended batch's late replies are not this batch's
            if again:
                await self._resend(again)
                if self._fatal:
                    raise self._fatal
            return
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), self._tick)
        now = time.monotonic()
        if self._unacked and now - self._unacked[0].first_sent >= self.give_up_after:
            self._fail(len(self._unacked), f"no ack within {self.give_up_after:.0f}s")
            self._end()
        elif self._ended_at is None and self._unacked and now - self._progress >= self.ack_timeout:
            if denial := refused(self.nc, self._unacked[0].subject.decode()):
                self._fatal = denial  # no ack will ever come
            elif not self._pinged:
                self._pinged = now
                self._write(self._last_subject, self._sent, 4)
            elif now - self._pinged >= self.ack_timeout:
                self._end()


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
