"""Reading JetStream streams fast, without Spark: sequence ranges pulled in order, replayable.

Features: a stream's state per stream (first and last sequence, messages), a
range split into contiguous parts, a pull consumer per range on ferry's lean
connection (:mod:`ferry.brokers.nats.wire`) with a read-ahead task, and the
messages as Arrow batches in the common schema or as rows ready to publish.

Guarantees: a range is a fixed sequence range; read again it returns the same
messages (unless retention removed some meanwhile). The publish-time directives
``Nats-Expected-*`` the server stores with a message are not message data and
are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError, ServiceUnavailableError

from ferry.brokers import kept
from ferry.brokers import nats as bnats
from ferry.brokers.nats import while_electing
from ferry.brokers.nats.wire import Wire
from ferry.errors import FerryError, NotFound
from ferry.headers import (
    EXPECTED,
    MSG_ID,
    ORIGIN_SITE_HDR,
    header_value,
)
from ferry.schema import BatchBuilder
from ferry.topology import NatsCluster

_MSG_ID = MSG_ID.encode()
_NO_HEADERS = b"NATS/1.0\r\n\r\n"


# -- configuration (parsed once, on the driver) ---------------------------------------------


@dataclass(frozen=True)
class ReadConfig:
    cluster: str  # JSON
    name: str  # cluster name, for the `source` column
    streams: tuple[str, ...]
    subject: str | None = None
    start_seq: int | None = None
    end_seq: int | None = None
    partitions: int | None = None
    batch_size: int = 10_000
    fetch: int | None = None

    def nats(self) -> NatsCluster:
        return NatsCluster.model_validate_json(self.cluster)


# -- planning -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    stream: str
    lo: int
    hi: int  # inclusive
    fetch: int = 1000  # messages per pull request


async def stream_states(
    cluster: NatsCluster, streams: Iterable[str], subject: str | None = None, name: str = "", nc: Any = None
) -> dict[str, dict[str, int]]:
    """first_seq, last_seq and messages (matching `subject` when given) per stream (on `nc` if given)."""
    out = {}
    async with contextlib.nullcontext(nc) if nc else bnats.session(cluster, name=name) as nc:
        jsm = nc.jsm()
        for stream in streams:
            try:
                info = await jsm.stream_info(stream, subjects_filter=subject)
            except NotFoundError:
                raise NotFound(f"stream {stream!r} not found in cluster {name or '?'}", stream=stream) from None
            st = info.state
            count = sum((st.subjects or {}).values()) if subject else st.messages
            out[stream] = {
                "first_seq": st.first_seq,
                "last_seq": st.last_seq,
                "messages": count,
                "bytes": st.bytes,
                "all_messages": st.messages,
            }
    return out


async def kept_states(cfg: ReadConfig) -> dict[str, dict[str, int]]:
    """:func:`stream_states` of a streaming read's streams, on a connection kept between micro-batches."""
    async with kept.using(("states", cfg.cluster, cfg.name), lambda: bnats.connect(cfg.nats(), name=cfg.name)) as nc:
        return await stream_states(cfg.nats(), cfg.streams, None, cfg.name, nc)


def _fetch_size(st: dict[str, int], given: int | None) -> int:
    avg = st.get("bytes", 0) / max(1, st.get("all_messages", 0)) or 100
    return given or int(max(10, min(5000, 8_000_000 // max(avg, 1))))


def split(stream: str, lo: int, hi: int, parts: int, fetch: int = 1000) -> list[Range]:
    """Split [lo, hi] into at most `parts` contiguous ranges."""
    if hi < lo:
        return []
    parts = max(1, min(parts, hi - lo + 1))
    size, extra = divmod(hi - lo + 1, parts)
    ranges, start = [], lo
    for i in range(parts):
        end = start + size - 1 + (1 if i < extra else 0)
        ranges.append(Range(stream, start, end, fetch))
        start = end + 1
    return ranges


def plan_ranges(cfg: ReadConfig) -> list[Range]:
    states = asyncio.run(stream_states(cfg.nats(), cfg.streams, cfg.subject, cfg.name))
    ranges: list[Range] = []
    for stream, st in states.items():
        lo = max(cfg.start_seq or st["first_seq"], st["first_seq"], 1)
        hi = min(cfg.end_seq or st["last_seq"], st["last_seq"])
        parts = cfg.partitions or min(16, 1 + st["messages"] // 200_000)
        ranges += split(stream, lo, hi, parts, _fetch_size(st, cfg.fetch))
    return ranges


# -- reading ------------------------------------------------------------------------------------


def _ack_fields(reply: str) -> tuple[int, int, int]:
    """(stream sequence, consumer sequence, timestamp ns) from a JetStream ack subject (v1 or v2
    form). Not its pending count: see :meth:`Reader._ends_at`."""
    t = reply.split(".")
    if len(t) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return int(t[5]), int(t[6]), int(t[7])
    # $JS.ACK.<domain>.<acc hash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>[.<token>]
    return int(t[7]), int(t[8]), int(t[9])


class _Puller:
    """Pull requests on one inbox subscription of a :class:`Wire`; messages collected by a callback.

    nats-py's ``fetch`` spends most of its time in per-message ``wait_for``; a
    callback that appends to a list and one event per request is several times
    faster. Each request asks for up to ``batch`` messages with ``no_wait``: the
    server sends what it has, then a status message (404/408) if it had fewer.

    One request is open at a time. A request that times out part-way returns what
    came; the rest of it may still arrive, and lands in the list the next :meth:`pull`
    returns, so no message the server sent is ever dropped. :meth:`ask` can ask for
    the next messages before anyone pulls them (a relay, between its micro-batches).
    """

    def __init__(self, nc: Wire, stream: str, consumer: str) -> None:
        self.nc = nc
        self.subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}".encode()
        self.inbox = nc.new_inbox()
        self.sub: Any = None
        self.got: list[Any] = []  # received, not yet returned
        self.left = 0  # what the open request may still bring
        self.asked_at = 0.0  # when the last request was sent
        self.status = ""  # how the server ended it, if it did
        self.done = asyncio.Event()

    async def start(self) -> None:
        self.sub = await self.nc.subscribe(self.inbox, cb=self._on_msg)

    def _on_msg(self, msg: Any) -> None:
        if not msg.reply:  # a status message: no more for this request
            self.left, self.status = 0, (msg.headers or {}).get("Status", "")
            self.done.set()
            return
        self.got.append(msg)
        self.left -= 1
        if self.left <= 0:
            self.done.set()

    def ask(self, batch: int) -> None:
        """Ask for up to `batch` messages (not waiting for them), unless a request is open."""
        if self.left <= 0:
            self.nc.publish_raw(self.subject, self.inbox.encode(), b"", b'{"batch":%d,"no_wait":true}' % batch)
            self.left, self.asked_at, self.status = batch, time.monotonic(), ""
            self.done.clear()

    async def pull(self, batch: int, timeout: float = 5.0) -> list[Any]:
        """The next messages in order: what came already, else up to `batch` new ones (an empty
        list when a status ends the request first; TimeoutError when nothing came)."""
        if not self.got:
            self.ask(batch)
            try:
                await asyncio.wait_for(self.done.wait(), timeout)
            except TimeoutError:
                if not self.got:  # (the caller drops this consumer) else the rest may still come
                    raise
        got, self.got = self.got, []
        return got

    def put_back(self, msgs: list[Any]) -> None:
        """Messages pulled but not used, for the next :meth:`pull` (they come before any later one)."""
        self.got[:0] = msgs

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.sub.unsubscribe()


def pulled(cfg: ReadConfig, part: Range) -> AsyncIterator[list[tuple[Any, int, int]]]:
    """Every message of `part.stream` with lo <= seq <= hi (matching cfg.subject), in order, in
    the lists the server sent: (message, sequence, stored time in ns); publish-time directives
    (``Nats-Expected-*``) dropped from the headers. The next pulls are on the wire while the
    caller works on a list (or waits: a writer for its acks)."""
    return read_ahead(_pulled(cfg, part))


async def _pulled(cfg: ReadConfig, part: Range) -> AsyncIterator[list[tuple[Any, int, int]]]:
    reader = await Reader.open(cfg, part.stream)
    try:
        async for got in reader.lists(part):
            yield got
    finally:
        await reader.close()


class Reader:
    """Reads ranges of one stream through an ephemeral consumer (no acks) it creates where a
    range starts. With ``keep``, the consumer stays after a range that ended cleanly, and the
    next range that starts right after it goes on with it (a relay's micro-batches).

    Messages come on a :class:`Wire` to the server that leads the consumer (opened with the
    consumer, again when a new consumer is led by another server): then no message crosses from
    one server to another on its way to ferry."""

    def __init__(self, cfg: ReadConfig, stream: str, nc: Any) -> None:
        self.cfg, self.stream, self.nc = cfg, stream, nc
        self.w: Wire | None = None
        self.source = f"{cfg.name}/{stream}"
        self.consumer: str | None = None
        self.puller: _Puller | None = None
        self.delivered = 0  # the consumer's own numbering: a gap is a lost part of a batch
        self.next_seq = 0  # where the kept consumer stands

    @classmethod
    async def open(cls, cfg: ReadConfig, stream: str) -> Reader:
        return cls(cfg, stream, await bnats.connect(cfg.nats(), name=cfg.name, timeout=30))

    async def close(self) -> None:
        await self._drop()
        if self.w:
            await self.w.close()
        with contextlib.suppress(Exception):
            await self.nc.close()

    async def _drop(self) -> None:
        if self.puller:
            await self.puller.stop()
        if self.consumer:
            with contextlib.suppress(Exception):
                await self.nc.jsm(timeout=10).delete_consumer(self.stream, self.consumer)
        self.consumer, self.puller = None, None

    async def _create(self, seq: int, deadline: float) -> bool:
        """A consumer from `seq` on (False: nothing there yet)."""
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=seq,
            ack_policy=AckPolicy.NONE,
            filter_subject=self.cfg.subject,
            inactive_threshold=60.0,
            mem_storage=True,
            num_replicas=1,
        )
        while True:
            try:
                info = await self.nc.jsm(timeout=10).add_consumer(self.stream, config)
                break
            except (ServiceUnavailableError, NatsTimeout, TimeoutError):
                if time.monotonic() > deadline:
                    raise FerryError(f"jetstream: cannot create a reader on {self.source} (no leader?)") from None
                await asyncio.sleep(0.5)
            except NotFoundError:
                raise NotFound(
                    f"stream {self.stream!r} not found in cluster {self.cfg.name}", stream=self.stream
                ) from None
        self.consumer, self.delivered = info.name, 0
        if info.num_pending == 0:
            await self._drop()
            return False
        leader = bnats.leader_of(info)
        if self.w and leader and self.w.server_name != leader:  # this consumer is led elsewhere
            await self.w.close()
            self.w = None
        if self.w is None:
            self.w = await Wire.open(self.cfg.nats(), self.cfg.name, timeout=30, prefer=leader)
        self.puller = _Puller(self.w, self.stream, info.name)
        await self.puller.start()
        return True

    async def _ends_at(self, seq: int, hi: int, deadline: float) -> bool:
        """The consumer has nothing from `seq` on: whether the read from `seq` to `hi` is done, as
        the stream's leader says (else wait 20 ms to pull again, until `deadline`). A consumer's
        "no messages" is not enough: a follower stores a message after the leader, and a server
        counts what is pending for a consumer after storing, not at once. Measured at 12,000 msg/s,
        ranges read right after the stream info said where they end: 26 of 2,000 ended early on a
        follower's consumer, 9 of 2,000 on the leader's."""

        def ask() -> Awaitable[Any]:
            return self.nc.jsm(timeout=5).get_msg(self.stream, seq=seq, subject=self.cfg.subject or ">", next=True)

        try:
            got = await while_electing(ask, 30, self.nc, f"$JS.API.STREAM.MSG.GET.{self.stream}")
        except NotFoundError:  # nothing from seq on
            return True
        except NatsError:
            raise FerryError(
                f"jetstream: {self.source}: no answer to $JS.API.STREAM.MSG.GET.{self.stream} in 30 s, which ferry "
                "asks where a read ends (no stream leader, or the user may not publish to it)"
            ) from None
        if (got.seq or 0) > hi:
            return True
        if time.monotonic() > deadline:
            raise FerryError(f"jetstream: {self.source} holds messages from seq {seq} that its reader is not given")
        await asyncio.sleep(0.02)  # its server counts or stores them within milliseconds
        return False

    async def lists(self, part: Range, keep: bool = False) -> AsyncIterator[list[tuple[Any, int, int]]]:
        """The messages of `part` in order, in the lists the server sent (see :func:`pulled`)."""
        if self.consumer and part.lo != self.next_seq:
            await self._drop()
        next_seq, clean = part.lo, False
        since = time.monotonic()
        deadline = since + 120
        try:
            while next_seq <= part.hi:
                if not self.consumer and not await self._create(next_seq, deadline):
                    if await self._ends_at(next_seq, part.hi, deadline):
                        break
                    continue
                assert self.puller is not None
                try:
                    msgs = await self.puller.pull(min(part.fetch, part.hi - next_seq + 1))
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise FerryError(f"jetstream: {self.source} stopped answering at seq {next_seq}") from None
                    await self._drop()  # recreate the consumer from next_seq
                    continue
                if not msgs:
                    if self.puller.asked_at < since:  # asked before the range was planned (prefetched): ask again
                        continue
                    if self.puller.status == "404":  # no messages: the range is done, if the stream agrees
                        if await self._ends_at(next_seq, part.hi, deadline):
                            next_seq = part.hi + 1
                            break
                        continue
                    await self._drop()  # nothing now: the consumer may have been lost; recreate, check again
                    continue
                deadline = time.monotonic() + 120
                got, stop = [], False
                for i, m in enumerate(msgs):
                    seq, cseq, ts_ns = _ack_fields(m.reply)
                    if cseq != self.delivered + 1:  # the rest of a batch lost with a dropped connection:
                        await self._drop()  # the consumer, acking nothing, went on; read again from next_seq
                        break
                    if seq > part.hi:  # done (with a subject filter, the next match is past the range)
                        self.puller.put_back(msgs[i:])
                        stop = True
                        break
                    self.delivered = cseq
                    if seq < next_seq:
                        continue
                    if m.raw is not None and m.raw.find(b"Nats-Expected-") >= 0:  # publish-time checks, not data
                        headers = m.headers or {}
                        for directive in EXPECTED:
                            headers.pop(directive, None)
                        m.raw = None
                    got.append((m, seq, ts_ns))
                    next_seq = seq + 1
                    if seq == part.hi:
                        self.puller.put_back(msgs[i + 1 :])
                        stop = True
                        break
                if got:
                    yield got
                if stop:  # nothing more up to part.hi
                    next_seq = part.hi + 1
                    break
            clean = True
        finally:
            self.next_seq = next_seq
            if not (keep and clean):
                await self._drop()
            elif self.puller:  # the next range's first messages, while Spark plans it (only a head start)
                with contextlib.suppress(FerryError):
                    self.puller.ask(part.fetch)


async def read_ahead(
    lists: AsyncIterator[list[tuple[Any, int, int]]], depth: int = 2
) -> AsyncIterator[list[tuple[Any, int, int]]]:
    """`lists` pulled up to `depth` lists ahead by a task of their own.

    Closing it stops that task by a cancel, and by a flag the task reads before each put: a cancel
    can be swallowed (Python 3.11's ``wait_for`` returns a result that came with it, as in a
    reader's connect), and the task then went on into a full queue that no one read."""
    queue: asyncio.Queue[Any] = asyncio.Queue(depth)
    end = object()
    closing = False

    async def pull() -> None:
        try:
            async for got in lists:
                if closing:
                    return
                await queue.put(got)
            if not closing:
                await queue.put(end)
        except Exception as exc:
            if not closing:
                await queue.put(exc)
        finally:
            await lists.aclose()  # type: ignore[attr-defined]

    task = asyncio.create_task(pull())
    try:
        while (got := await queue.get()) is not end:
            if isinstance(got, Exception):
                raise got
            yield got
    finally:
        closing = True
        task.cancel()
        await asyncio.wait({task})  # not `await task`, whose CancelledError hides a cancel of this caller


async def read_range(cfg: ReadConfig, part: Range) -> AsyncIterator[pa.RecordBatch]:
    """Every message of `part.stream` with lo <= seq <= hi (matching cfg.subject), in order."""
    source = f"{cfg.name}/{part.stream}"
    builder = BatchBuilder()
    async with contextlib.aclosing(pulled(cfg, part)) as lists:
        async for got in lists:
            for m, seq, ts_ns in got:
                builder.add(m.subject, m.data, m.headers, (m.headers or {}).get(MSG_ID), source, seq, ts_ns // 1000)
            if len(builder) >= cfg.batch_size:
                yield builder.flush()
    if len(builder):
        yield builder.flush()


async def read_rows(
    cfg: ReadConfig,
    part: Range,
    lists: AsyncGenerator[list[tuple[Any, int, int]]] | None = None,
    relayed: bool = True,
) -> AsyncGenerator[list[tuple[Any, ...]]]:
    """The messages of `part` (pulled, or from `lists`), a list at a time, as the rows :func:`write_rows`
    publishes (subject, payload, headers, msg id, source, seq), without building Arrow batches: what
    tasks that read and write at once (a copy between streams, a relay) use. Headers are the block
    as received, unparsed (bytes), when the message came with one. Without `relayed`, the messages
    a relay wrote here (with ``Ferry-Origin-Site``) are left out. Closing it closes `lists`."""
    source = f"{cfg.name}/{part.stream}"
    async with contextlib.aclosing(lists or pulled(cfg, part)) as source_lists:
        async for got in source_lists:
            rows = []
            for m, seq, _ in got:
                raw = m.raw if m.raw is not None or m.headers else _NO_HEADERS  # edited headers: a dict
                if raw is not None:
                    if relayed or raw.find(b"Ferry-Origin-Site") < 0 or ORIGIN_SITE_HDR not in (m.headers or {}):
                        rows.append((m.subject, m.data, raw, header_value(raw, _MSG_ID), source, seq))
                else:
                    headers = m.headers or {}
                    if relayed or ORIGIN_SITE_HDR not in headers:
                        rows.append((m.subject, m.data, headers, headers.get(MSG_ID), source, seq))
            if rows:
                yield rows
