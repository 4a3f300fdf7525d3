"""The ``jetstream`` data source: read and write JetStream streams from Spark.

Name: ``jetstream``

Options (all strings):

- ``cluster``: a cluster name from the topology (with ``topology`` = file path), or
  the cluster as JSON (what ferry's jobs pass). Credentials are references
  (environment variable or file) resolved where the task runs.
- read: ``stream`` (one name, or several comma-separated for streaming),
  ``subject`` (filter, wildcards allowed), ``start_seq`` / ``end_seq``
  (inclusive; default: the whole stream as it is when the job is planned),
  ``partitions`` (sequence ranges read in parallel, default 1 per 200,000
  messages, at most 16), ``batch_size`` (rows per Arrow batch, 10,000),
  ``fetch`` (messages per pull request; default about 8 MB worth, at most 5,000).
- streaming read: ``starting`` = ``earliest`` | ``latest`` | JSON
  ``{"STREAM": last_seq_already_processed}``; ``max_messages_per_batch``;
  ``relay_to`` (JSON of write options, and ``leaders``: the server leading each
  stream's destination, ``{"STREAM": "server"}``): each read task publishes its
  messages that carry no ``Ferry-Origin-Site`` itself and yields one row of
  counts (schema ``COUNTS_DDL``), so no message crosses the JVM (what ``ferry
  replicate`` runs).
- write: ``stream`` (destination; published with ``Nats-Expected-Stream``),
  ``window`` (in-flight publishes, 512), ``ack_timeout`` (seconds, 2),
  ``give_up_after`` (seconds, 120), ``ordered`` (``true``: keep sequence order
  with ``Nats-Expected-Last-Sequence``; needs a single writer task and exclusive
  writes to the destination), ``batched`` (``true``: fast batch publishing, the
  stream acknowledging every few hundred messages instead of each; needs
  nats-server 2.14+ and a stream with ``allow_batched``; ``window`` does not
  apply, the stream paces it), ``origin_headers`` (``true``: add
  ``Ferry-Source`` and ``Ferry-Source-Seq``), ``subject_prefix``, ``origin_site``
  (a relay's site: a message without ``Ferry-Origin-Site`` gets ``Ferry-Origin-Site``,
  ``-Stream``, ``-Seq`` and ``-Msg-Id`` saying where it was first stored),
  ``leader`` (the ``server_name`` leading the stream: ferry connects to it
  first, so no message takes a hop between servers).

Headers: reads drop the publish-time directives ``Nats-Expected-*`` (the
server stores them with the message, but they are not message data). Writes
add ``Nats-Msg-Id`` when the message had none, and ``Ferry-Source`` /
``Ferry-Source-Seq`` unless ``origin_headers`` is false.

Guarantees:

- Reads are replayable: a partition is a fixed sequence range, read again it
  returns the same messages (unless retention removed some meanwhile).
- Writes are exactly-once in effect within the destination's duplicate window:
  every message carries ``Nats-Msg-Id`` (its own, else ``<source>:<seq>``), an
  ack that does not come within ``ack_timeout`` is re-sent under the same id,
  and a publish that still fails fails the task (nothing is dropped silently).
  Ordered mode is exactly-once and order-preserving regardless of the window:
  a message can only be stored right after its predecessor.

Example::

    spark.read.format("jetstream").option("cluster", "east").option("stream", "ORDERS").load() \\
        .write.format("jetstream").option("cluster", "west").option("stream", "ORDERS_COPY") \\
        .mode("append").save()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError, ServiceUnavailableError
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow

from ferry.brokers import nats as bnats
from ferry.brokers.nats import while_electing
from ferry.errors import ConfigError, FerryError, NotFound
from ferry.pipeline import _kept
from ferry.pipeline._common import (
    COUNTS_DDL,
    WriteCounts,
    cluster_json,
    iterate,
    nats_cluster,
    opt_bool,
    opt_int,
    per_index,
)
from ferry.pipeline._nats import Wire, header_value, parse_headers, wire
from ferry.pipeline.schema import SPARK_DDL, BatchBuilder
from ferry.publish import (
    MSG_ID,
    ORIGIN_MSG_ID_HDR,
    ORIGIN_SEQ_HDR,
    ORIGIN_SITE_HDR,
    ORIGIN_STREAM_HDR,
    SOURCE_HDR,
    SOURCE_SEQ_HDR,
    Ack,
    BatchPublisher,
    Pacer,
    Publisher,
    PublishError,
)
from ferry.topology import NatsCluster

__all__ = [
    "JetStreamDataSource",
    "ReadConfig",
    "Reader",
    "WriteConfig",
    "plan_ranges",
    "read_ahead",
    "read_range",
    "read_rows",
    "stream_frame",
    "stream_states",
    "write_batches",
]

_EXPECTED = (
    "Nats-Expected-Stream",
    "Nats-Expected-Last-Sequence",
    "Nats-Expected-Last-Subject-Sequence",
    "Nats-Expected-Last-Msg-Id",
)
_MSG_ID = MSG_ID.encode()
_ORIGIN_SITE_LINE = f"\r\n{ORIGIN_SITE_HDR}:".encode()  # in an encoded header block
_NO_HEADERS = b"NATS/1.0\r\n\r\n"
_WRONG_LAST_SEQ = 10071


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

    @classmethod
    def from_options(cls, options: dict[str, str]) -> ReadConfig:
        streams = tuple(s.strip() for s in (options.get("stream") or "").split(",") if s.strip())
        if not streams:
            raise ConfigError("jetstream: option 'stream' is required")
        return cls(
            cluster=cluster_json(options, NatsCluster),
            name=options.get("cluster_name") or _name(options),
            streams=streams,
            subject=options.get("subject") or None,
            start_seq=opt_int(options, "start_seq"),
            end_seq=opt_int(options, "end_seq"),
            partitions=opt_int(options, "partitions"),
            batch_size=opt_int(options, "batch_size", 10_000) or 10_000,
            fetch=opt_int(options, "fetch"),
        )

    def nats(self) -> NatsCluster:
        return nats_cluster(self.cluster)


@dataclass(frozen=True)
class WriteConfig:
    cluster: str
    name: str
    stream: str | None = None
    window: int = 512
    ack_timeout: float = 2.0
    give_up_after: float = 120.0
    ordered: bool = False
    batched: bool = False  # fast batch publishing (the stream must allow it)
    origin_headers: bool = True
    subject_prefix: str = ""
    origin_site: str = ""
    rate: float | None = None  # messages per second for this task
    leader: str = ""  # the stream's leader when planned: its server is the one to publish to

    @classmethod
    def from_options(cls, options: dict[str, str]) -> WriteConfig:
        try:
            ack_timeout = float(options.get("ack_timeout") or 2.0)
            give_up_after = float(options.get("give_up_after") or 120.0)
        except ValueError:
            raise ConfigError("jetstream: ack_timeout and give_up_after are seconds") from None
        return cls(
            cluster=cluster_json(options, NatsCluster),
            name=options.get("cluster_name") or _name(options),
            stream=options.get("stream") or None,
            window=opt_int(options, "window", 512) or 512,
            ack_timeout=ack_timeout,
            give_up_after=give_up_after,
            ordered=opt_bool(options, "ordered"),
            batched=opt_bool(options, "batched"),
            origin_headers=opt_bool(options, "origin_headers", True),
            subject_prefix=options.get("subject_prefix") or "",
            origin_site=options.get("origin_site") or "",
            rate=float(options["rate"]) if options.get("rate") else None,
            leader=options.get("leader") or "",
        )

    def nats(self) -> NatsCluster:
        return nats_cluster(self.cluster)


def _name(options: dict[str, str]) -> str:
    value = options.get("cluster", "")
    return "nats" if value.lstrip().startswith("{") else value


# -- planning -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Range(InputPartition):
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


async def _kept_states(cfg: ReadConfig) -> dict[str, dict[str, int]]:
    """:func:`stream_states` of a streaming read's streams, on a connection kept between micro-batches."""
    async with _kept.using(("states", cfg.cluster, cfg.name), lambda: bnats.connect(cfg.nats(), name=cfg.name)) as nc:
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
                        for directive in _EXPECTED:
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


def stream_frame(spark: Any, cfg: ReadConfig) -> Any:
    """What ``spark.read.format("jetstream")`` reads for `cfg`, as a DataFrame in the common schema:
    one task per sequence range, the ranges planned here. ferry's own jobs read so because Spark
    plans a Python data source in Python processes it starts for the purpose (about 2.7 s of a
    command here); planned on the driver, the read starts on the task workers alone. Call it
    outside a running event loop (it asks the streams' state)."""
    ranges = plan_ranges(cfg)
    return per_index(spark, len(ranges), lambda i: iterate(read_range(cfg, ranges[i])), SPARK_DDL)


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


class _RelayLink:
    """A relay's reader on one source stream and its connection to the destination, kept by the
    Python worker from one micro-batch to the next (:mod:`ferry.pipeline._kept`)."""

    def __init__(self, reader: Reader, dest: Wire) -> None:
        self.reader, self.dest = reader, dest

    @classmethod
    async def open(cls, cfg: ReadConfig, to: WriteConfig, stream: str) -> _RelayLink:
        reader = await Reader.open(cfg, stream)
        try:
            return cls(reader, await Wire.open(to.nats(), to.name, timeout=30, prefer=to.leader))
        except BaseException:
            await reader.close()
            raise

    async def close(self) -> None:
        await self.reader.close()
        await self.dest.close()


def relay_range(cfg: ReadConfig, to: WriteConfig, part: Range) -> WriteCounts:
    """Publish to `to` the messages of `part` first stored here (without ``Ferry-Origin-Site``):
    what a relay's read task does, on connections and a consumer kept from its last range."""
    return _kept.run(_relay(cfg, to, part))


async def _relay(cfg: ReadConfig, to: WriteConfig, part: Range) -> WriteCounts:
    key = ("relay", cfg, to, part.stream)
    async with _kept.using(key, lambda: _RelayLink.open(cfg, to, part.stream)) as link:
        lists = read_ahead(link.reader.lists(part, keep=True))
        return await write_rows(to, read_rows(cfg, part, lists, relayed=False), link.dest)


class JetStreamReader(DataSourceReader):
    def __init__(self, cfg: ReadConfig) -> None:
        self.cfg = cfg

    def partitions(self) -> list[Range]:
        return plan_ranges(self.cfg) or [Range(self.cfg.streams[0], 1, 0)]

    def read(self, partition: Range) -> Iterator[pa.RecordBatch]:  # type: ignore[override]
        if partition.hi < partition.lo:
            return iter(())
        return iterate(read_range(self.cfg, partition))


class JetStreamStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets are {stream: last sequence processed}."""

    def __init__(
        self,
        cfg: ReadConfig,
        starting: str,
        max_per_batch: int | None,
        parts: int,
        relay: dict[str, WriteConfig] | None = None,  # by source stream
    ) -> None:
        self.cfg = cfg
        self.starting = starting
        self.max_per_batch = max_per_batch
        self.parts = parts
        self.relay = relay
        self.warm = False
        self.target: dict[str, int] | None = None

    def _states(self) -> dict[str, dict[str, int]]:
        return _kept.run(_kept_states(self.cfg))

    def initialOffset(self) -> dict[str, int]:
        states = self._states()
        if self.starting == "earliest":
            return {s: max(0, st["first_seq"] - 1) for s, st in states.items()}
        if self.starting == "latest":
            return {s: st["last_seq"] for s, st in states.items()}
        try:
            given = json.loads(self.starting)
        except ValueError:
            raise ConfigError("jetstream: 'starting' must be earliest, latest or a JSON object") from None
        return {s: int(given.get(s, max(0, st["first_seq"] - 1))) for s, st in states.items()}

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = {s: st["last_seq"] for s, st in self._states().items()}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_per_batch) if self.max_per_batch else ReadAllAvailable()

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        latest = self.target or {s: st["last_seq"] for s, st in self._states().items()}
        end = {}
        for stream in self.cfg.streams:
            lo = int(start.get(stream, 0))
            hi = max(lo, latest.get(stream, lo))
            if isinstance(limit, ReadMaxRows):
                hi = min(hi, lo + max(1, limit.max_rows // len(self.cfg.streams)))
            end[stream] = hi
        return end

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[Range]:
        ranges: list[Range] = []
        for stream in self.cfg.streams:
            lo, hi = int(start.get(stream, 0)) + 1, int(end.get(stream, 0))
            ranges += split(stream, lo, hi, self.parts, self.cfg.fetch or 1000)
        if self.relay and not ranges and not self.warm:  # start the Python workers now, not with the first message
            ranges = [Range(self.cfg.streams[0], 1, 0)] * self.parts
        self.warm = True
        return ranges

    def read(self, partition: Range) -> Iterator[pa.RecordBatch]:  # type: ignore[override]
        if self.relay:
            return iter([relay_range(self.cfg, self.relay[partition.stream], partition).as_batch()])
        return iterate(read_range(self.cfg, partition))

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to do: the stream keeps its messages; offsets live in Spark's checkpoint."""


# -- writing ------------------------------------------------------------------------------------


def _rows(batch: pa.RecordBatch) -> Iterator[tuple[Any, ...]]:
    cols = [
        batch.column(n).to_pylist() if n in batch.schema.names else [None] * batch.num_rows
        for n in ("subject", "payload", "headers", "msg_id", "source", "source_seq")
    ]
    return zip(*cols, strict=True)


Batches = Iterable[pa.RecordBatch] | AsyncIterable[pa.RecordBatch]


async def _each(batches: Batches) -> AsyncIterator[pa.RecordBatch]:
    if isinstance(batches, AsyncIterable):
        async for batch in batches:
            yield batch
    else:
        for batch in batches:
            yield batch


async def _row_lists(batches: Batches) -> AsyncGenerator[list[tuple[Any, ...]]]:
    async for batch in _each(batches):
        yield list(_rows(batch))


async def write_batches(cfg: WriteConfig, batches: Batches) -> WriteCounts:
    """Publish every row of `batches`; raise if any message could not be stored."""
    return await write_rows(cfg, _row_lists(batches))


async def write_rows(
    cfg: WriteConfig, rows: AsyncGenerator[list[tuple[Any, ...]]], dest: Wire | None = None
) -> WriteCounts:
    """Publish every row (subject, payload, headers as a dict, pairs or an encoded block, msg id,
    source, seq) of `rows`, which come a list at a time, on `dest` if given (else a connection of
    its own); raise if any message could not be stored.

    `rows` is closed before this returns or raises: a reader's read-ahead task and connections
    must not be left to ``asyncio.run``'s teardown, which cancels the connections' own tasks with
    them (a failed copy's reader then waited for ever to delete its consumer)."""
    counts = WriteCounts()
    async with (
        contextlib.aclosing(rows),
        contextlib.nullcontext(dest) if dest else wire(cfg.nats(), cfg.name, prefer=cfg.leader) as w,
    ):
        if cfg.ordered:
            async with bnats.session(cfg.nats(), name=cfg.name, timeout=30) as nc:
                await _write_ordered(nc, w, cfg, rows, counts)
        else:
            pub = _publisher(w, cfg)
            pacer, message = Pacer(cfg.rate), _messages(cfg)
            async with pub:
                async for got in rows:
                    messages = [message(row) for row in got]
                    counts.rows += len(messages)
                    counts.bytes += sum(len(m[1]) for m in messages)
                    if pacer.interval:
                        for subject, payload, headers, msg_id in messages:
                            await pacer.wait()
                            await pub.publish(subject, payload, headers=headers, msg_id=msg_id)
                    else:
                        await pub.publish_many(messages)
            counts.stored, counts.duplicates = pub.stats.stored, pub.stats.duplicates
            counts.retries, counts.errors = pub.stats.retries, pub.stats.errors[:20]
            if pub.stats.failed:
                raise FerryError(
                    f"jetstream write to {cfg.name}/{cfg.stream or '*'}: {pub.stats.failed} of {counts.rows} "
                    f"messages not stored, first: {pub.stats.errors[0] if pub.stats.errors else '?'}"
                )
    return counts


def _publisher(
    w: Wire, cfg: WriteConfig, on_failure: Callable[[Ack], None] | None = None
) -> Publisher | BatchPublisher:
    """The publisher `cfg` asks for. With `on_failure`, a writer that keeps order: each failed
    message is reported (per-message acks), or the first refusal stops the batches (it raises
    :class:`PublishError`)."""
    if cfg.batched:
        return BatchPublisher(
            w, ack_timeout=cfg.ack_timeout, give_up_after=cfg.give_up_after, stop_on_refusal=on_failure is not None
        )
    return Publisher(
        w,
        window=cfg.window,
        ack_timeout=cfg.ack_timeout,
        give_up_after=cfg.give_up_after,
        on_ack=(lambda a: on_failure(a) if a.error else None) if on_failure else None,
    )


_Message = tuple[str, bytes, dict[str, str] | bytes, str]  # subject, payload, headers, msg id


def _messages(cfg: WriteConfig) -> Callable[[tuple[Any, ...]], _Message]:
    """What to publish for a row under `cfg`: (subject, payload, headers, msg id). A row that came
    with a header block that only needs lines added keeps it, with the lines (made once per
    source here) added; else the headers are parsed and encoded again."""
    prefix = cfg.subject_prefix
    expect = f"Nats-Expected-Stream: {cfg.stream}\r\n".encode() if cfg.stream else b""
    lines: dict[str | None, tuple[bytes, bytes]] = {}  # per source: what goes before the sequence
    origin_id, own_id = f"{ORIGIN_MSG_ID_HDR}: %s\r\n".encode(), f"{MSG_ID}: %s\r\n".encode()

    def message(row: tuple[Any, ...]) -> _Message:
        subject, payload, block, msg_id, source, seq = row
        if not isinstance(block, bytes) or seq is None:
            return _parsed(cfg, row)
        # the block publishes what its parsed headers would if its msg id (if any) is one plain line,
        # its keys have no spaces around the ones read here, there are no Ferry-Source lines to
        # replace, and it ends as usual (find, not `in`: on bytes it costs half as much)
        relayed = block.find(b"Ferry-Origin-Site") >= 0
        if (
            not block.endswith(b"\r\n\r\n")
            or msg_id == ""
            or block.count(b"Nats-Msg-Id") != (0 if msg_id is None else 1)
            or (relayed and block.find(_ORIGIN_SITE_LINE) < 0)
            or (cfg.origin_headers and block.find(b"Ferry-Source") >= 0)
        ):
            return _parsed(cfg, row)
        if source not in lines:
            stream = (source or "").partition("/")[2]
            copied = f"{SOURCE_HDR}: {source}\r\n{SOURCE_SEQ_HDR}: "
            relay = f"{ORIGIN_SITE_HDR}: {cfg.origin_site}\r\n{ORIGIN_STREAM_HDR}: {stream}\r\n{ORIGIN_SEQ_HDR}: "
            lines[source] = (
                copied.encode() if cfg.origin_headers and source is not None else b"",
                relay.encode() if cfg.origin_site else b"",
            )
        source_lines, site_lines = lines[source]
        block = block[:-2]
        if source_lines:
            block += b"%s%d\r\n" % (source_lines, seq)
        if site_lines and not relayed:
            block += b"%s%d\r\n" % (site_lines, seq)
            if msg_id:
                block += origin_id % msg_id.encode()
        if not msg_id:
            msg_id = f"{source}:{seq}"
            block += own_id % msg_id.encode()
        return prefix + subject, payload or b"", block + expect + b"\r\n", msg_id

    return message


def _parsed(cfg: WriteConfig, row: tuple[Any, ...]) -> _Message:
    """What :func:`_messages` publishes for a row, from its headers parsed (a dict)."""
    subject, payload, headers, msg_id, source, seq = row
    if isinstance(headers, bytes):
        headers = parse_headers(headers)
        msg_id = headers.get(MSG_ID)
    pairs = headers.items() if isinstance(headers, dict) else headers or ()
    hdrs = {k: v for k, v in pairs if k not in _EXPECTED and k != MSG_ID}
    if cfg.origin_headers and source is not None and seq is not None:
        hdrs[SOURCE_HDR] = source
        hdrs[SOURCE_SEQ_HDR] = str(seq)
    if cfg.origin_site and ORIGIN_SITE_HDR not in hdrs:
        hdrs[ORIGIN_SITE_HDR] = cfg.origin_site
        hdrs[ORIGIN_STREAM_HDR] = (source or "").partition("/")[2]
        hdrs[ORIGIN_SEQ_HDR] = str(seq)
        if msg_id:
            hdrs[ORIGIN_MSG_ID_HDR] = msg_id
    if cfg.stream:
        hdrs["Nats-Expected-Stream"] = cfg.stream
    return cfg.subject_prefix + subject, payload or b"", hdrs, msg_id or f"{source}:{seq}"


def _with(headers: dict[str, str] | bytes, key: str, value: str) -> dict[str, str] | bytes:
    """`headers` (a dict, or an encoded block) and key: value."""
    if isinstance(headers, bytes):
        return headers[:-2] + f"{key}: {value}\r\n\r\n".encode()
    return {**headers, key: value}


async def _write_ordered(
    nc: Any, w: Wire, cfg: WriteConfig, rows: AsyncIterator[list[tuple[Any, ...]]], counts: WriteCounts
) -> None:
    """Pipelined publishes on `w`, each expecting its predecessor as the stream's last message
    (stream info on `nc`).

    A failure (timeout, leader change, another writer) stops the pipeline; the
    stream's last sequence then says exactly which messages are stored, and
    publishing resumes right after them.
    """
    if not cfg.stream:
        raise ConfigError("jetstream: ordered writes need the destination 'stream' option")
    jsm = nc.jsm(timeout=10)

    async def last_seq() -> int:
        return int((await while_electing(lambda: jsm.stream_info(cfg.stream), 60)).state.last_seq)

    pending: list[_Message] = []  # unconfirmed, in order
    base = await last_seq()  # pending[0] expects `base`
    failures: list[Ack] = []

    stalled = 0
    pacer = Pacer(cfg.rate)

    async def drain() -> None:
        nonlocal base, pending, stalled
        while pending:
            failures.clear()
            # after an attempt that stored nothing, one publish at a time: a batch takes an id that the
            # leader holds "in process" (its proposal lost in a leader change) for stored; a publish waits
            pub = _publisher(w, replace(cfg, batched=False) if stalled else cfg, on_failure=failures.append)
            sent = 0
            try:
                async with pub:
                    for subject, payload, hdrs, msg_id in pending:
                        if failures:
                            break
                        await pacer.wait()
                        headers = _with(hdrs, "Nats-Expected-Last-Sequence", str(base + sent))
                        await pub.publish(subject, payload, headers=headers, msg_id=msg_id)
                        sent += 1
            except PublishError as exc:  # batched: the stream refused a message; what it holds decides
                code = int(exc.fields.get("err_code") or 0)  # type: ignore[call-overload]
                failures.append(Ack(str(exc.fields.get("subject", "")), None, error=str(exc), err_code=code))
            now = await last_seq()
            stored = now - base
            if stored and 0 < stored <= len(pending):
                last = await while_electing(functools.partial(jsm.get_msg, cfg.stream, now), 60)
                if (last.headers or {}).get(MSG_ID) != pending[stored - 1][3]:
                    stored = -1
            if stored < 0 or stored > len(pending):
                raise FerryError(
                    f"jetstream ordered write to {cfg.stream}: the stream changed under the copy "
                    f"(last seq {now}, expected {base}..{base + len(pending)}); another writer?"
                )
            counts.stored += stored
            counts.retries += pub.stats.retries + max(0, sent - stored)  # sent, not stored: sent again
            pending, base = pending[stored:], now
            stalled = 0 if stored else stalled + 1
            bad = [a for a in failures if a.err_code != _WRONG_LAST_SEQ]
            if pending and stored == 0 and (bad or stalled >= 10):
                reason = bad[0].error if bad else "no progress after 10 attempts"
                if "expected stream does not match" in reason:  # the subject is another stream's, or none's
                    reason += f" ({bad[0].subject!r} is not one of {cfg.stream}'s subjects: --subject-prefix maps them)"
                raise FerryError(f"jetstream ordered write to {cfg.stream}: {reason}")
            if stalled:  # a leader election refuses quick attempts: back off (5.5 s before the 10th)
                await asyncio.sleep(min(1.0, 0.05 * 2 ** (stalled - 1)))

    make = _messages(cfg)
    async for got in rows:
        for row in got:
            message = make(row)
            counts.rows += 1
            counts.bytes += len(message[1])
            pending.append(message)
            if len(pending) >= max(20_000, 10 * cfg.window):  # a resync point per chunk, not per window
                await drain()
    await drain()


class JetStreamWriter(DataSourceArrowWriter):
    def __init__(self, cfg: WriteConfig) -> None:
        self.cfg = cfg

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteCounts:
        return asyncio.run(write_batches(self.cfg, iterator))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Every message was acked by JetStream before its task returned."""


class JetStreamStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, cfg: WriteConfig) -> None:
        self.cfg = cfg

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteCounts:
        return asyncio.run(write_batches(self.cfg, iterator))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Every message was acked by JetStream before its task returned."""


class JetStreamDataSource(DataSource):
    """Spark data source ``jetstream`` (see the module docstring)."""

    @classmethod
    def name(cls) -> str:
        return "jetstream"

    def schema(self) -> str:
        return COUNTS_DDL if "relay_to" in self.options else SPARK_DDL

    def reader(self, schema: Any) -> JetStreamReader:
        if "relay_to" in self.options:
            raise ConfigError("jetstream: relay_to is an option of streaming reads")
        return JetStreamReader(ReadConfig.from_options(dict(self.options)))

    def streamReader(self, schema: Any) -> JetStreamStreamReader:
        options = dict(self.options)
        cfg = ReadConfig.from_options(options)
        relay = None
        if options.get("relay_to"):
            to = json.loads(options["relay_to"])
            leaders, base = to.pop("leaders", {}), WriteConfig.from_options(to)
            relay = {s: replace(base, leader=leaders.get(s, "")) for s in cfg.streams}
        return JetStreamStreamReader(
            cfg,
            options.get("starting", "earliest"),
            opt_int(options, "max_messages_per_batch"),
            opt_int(options, "partitions", 1) or 1,
            relay,
        )

    def writer(self, schema: Any, overwrite: bool) -> JetStreamWriter:
        if overwrite:
            raise ConfigError("jetstream: overwrite is not supported; use mode('append')")
        return JetStreamWriter(WriteConfig.from_options(dict(self.options)))

    def streamWriter(self, schema: Any, overwrite: bool) -> JetStreamStreamWriter:
        return JetStreamStreamWriter(WriteConfig.from_options(dict(self.options)))
