"""Moving and reading RabbitMQ queues without Spark: the queue mover, its sinks, queue snapshots.

Queues are destructive, so reading one is not a Spark data source (a retried
task would read different messages). Instead:

- :func:`move_queue` (one Spark task per queue, or per share of a large queue):
  consumes with manual ack, publishes each message to the sink (RabbitMQ with
  publisher confirms, JetStream with acks, or Parquet files written and
  fsynced), and acks the source only after the sink confirmed it. At-least-once:
  a task killed between the sink's confirm and the source ack leaves those
  messages in the queue, and a rerun moves them again; each moved message
  carries ``x-ferry-transfer`` (the transfer id) and the rerun counts
  redelivered messages as possible duplicates.
- :func:`snapshot_queue` reads every ready message without acking and closes
  the channel, so the broker requeues them all: the queue holds what it held
  (the redelivered flag of those messages becomes true).
- :func:`write_rows` publishes rows of the common schema mandatory with
  publisher confirms (what the ``rabbitmq`` data source's tasks run).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import aio_pika
import pyarrow as pa
import pyarrow.parquet as pq
from aio_pika.abc import AbstractIncomingMessage
from pamqp import commands
from pamqp.header import ContentHeader

from ferry import subjects
from ferry.brokers.base import Batches, WriteCounts, each_batch
from ferry.brokers.nats.publish import Pacer, Publisher
from ferry.brokers.nats.wire import Wire
from ferry.brokers.rabbitmq import amqp_connect, q
from ferry.brokers.rabbitmq.wire import Delivery, raw_connect, with_header
from ferry.errors import BrokerUnavailable, FerryError, NotFound
from ferry.headers import TRANSFER_HDR
from ferry.schema import ARROW_SCHEMA, BatchBuilder
from ferry.topology import NatsCluster, RabbitCluster

_PROPS = (
    "content_type",
    "content_encoding",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "timestamp",
    "type",
    "user_id",
    "app_id",
)


# -- AMQP headers <-> exact JSON ------------------------------------------------------------


def _enc(v: Any) -> Any:
    if isinstance(v, bytes | bytearray | memoryview):
        return {"$b": base64.b64encode(bytes(v)).decode()}
    if isinstance(v, Decimal):
        return {"$d": str(v)}
    if isinstance(v, datetime):
        return {"$t": v.isoformat()}
    if isinstance(v, dict):
        return {"$m": {str(k): _enc(x) for k, x in v.items()}}
    if isinstance(v, list | tuple):
        return [_enc(x) for x in v]
    return v


def _dec(v: Any) -> Any:
    if isinstance(v, dict):
        if "$b" in v:
            return bytearray(base64.b64decode(v["$b"]))  # pamqp encodes byte arrays from bytearray
        if "$d" in v:
            return Decimal(v["$d"])
        if "$t" in v:
            return datetime.fromisoformat(v["$t"])
        return {k: _dec(x) for k, x in v["$m"].items()}
    if isinstance(v, list):
        return [_dec(x) for x in v]
    return v


def headers_to_json(headers: dict[str, Any] | None) -> str | None:
    """An AMQP headers table as JSON that decodes back to the same types."""
    return json.dumps(_enc(dict(headers)), separators=(",", ":")) if headers else None


def headers_from_json(text: str | None) -> dict[str, Any]:
    return _dec(json.loads(text)) if text else {}


def _text(v: Any) -> str:
    """A header value as text: strings as they are, bytes decoded, containers as JSON."""
    if isinstance(v, str):
        return v
    if isinstance(v, bytes | bytearray):
        return bytes(v).decode("utf-8", "replace")
    if isinstance(v, dict | list):
        return json.dumps(v, separators=(",", ":"), default=_text)
    return str(v)


def message_row(m: AbstractIncomingMessage, source: str, index: int) -> tuple[Any, ...]:
    """(subject, payload, headers, msg_id, source, seq, ts_us, properties) in the common schema."""
    props: dict[str, Any] = {k: getattr(m, k, None) for k in _PROPS}
    if isinstance(props["expiration"], int | float):
        props["expiration"] = str(int(props["expiration"] * 1000))
    if props["delivery_mode"] is not None:
        props["delivery_mode"] = int(props["delivery_mode"])
    props["headers"] = headers_to_json(m.headers)
    ts = props["timestamp"]
    text_headers = {k: _text(v) for k, v in (m.headers or {}).items()}
    return (
        m.routing_key or "",
        m.body,
        text_headers or None,
        m.message_id,
        source,
        index,
        ts.astimezone(UTC) if ts else None,
        props,
    )


def row_header(row: dict[str, Any], transfer_id: str | None, body_size: int) -> bytes:
    """A raw AMQP content header from a common-schema row (typed headers and properties when present)."""
    props = row.get("properties") or {}
    headers = headers_from_json(props.get("headers")) if props.get("headers") else dict(row.get("headers") or [])
    if transfer_id:
        headers[TRANSFER_HDR] = transfer_id
    timestamp = props.get("timestamp") or row.get("timestamp")
    properties = commands.Basic.Properties(
        content_type=props.get("content_type"),
        content_encoding=props.get("content_encoding"),
        headers=headers or None,
        delivery_mode=props.get("delivery_mode") or 2,
        priority=props.get("priority"),
        correlation_id=props.get("correlation_id"),
        reply_to=props.get("reply_to"),
        expiration=props.get("expiration"),
        message_id=props.get("message_id") or row.get("msg_id"),
        timestamp=timestamp.replace(microsecond=0) if timestamp else None,
        message_type=props.get("type"),
        user_id=props.get("user_id"),
        app_id=props.get("app_id"),
    )
    return ContentHeader(0, body_size, properties).marshal()


# -- sinks: where the mover puts messages -----------------------------------------------------


class _Sink:
    """Puts messages somewhere durable and reports each one as confirmed (then calls `notify`)."""

    def __init__(self) -> None:
        self.confirmed: set[int] = set()
        self.duplicates = 0  # confirmed as already held (a stream's duplicate window), not stored again
        self.error: str | None = None
        self.notify: Callable[[], None] = lambda: None

    async def open(self) -> None: ...

    async def put(self, d: Delivery, tag: int, source: str, index: int) -> None: ...

    async def flush(self) -> None: ...

    async def close(self) -> None: ...


class _RabbitSink(_Sink):
    """Publishes raw frames with confirms; a message is confirmed when the broker acks its sequence."""

    def __init__(self, spec: dict[str, Any], transfer_id: str) -> None:
        super().__init__()
        self.spec, self.transfer_id = spec, transfer_id
        self.order: deque[int] = deque()
        self.tags: dict[int, int] = {}  # publish sequence -> source delivery tag
        self.space = asyncio.Event()
        self.exchange = spec.get("exchange") or ""

    async def open(self) -> None:
        self.conn = await raw_connect(
            RabbitCluster.model_validate_json(self.spec["cluster"]),
            self.spec.get("vhost") or "/",
            self.spec.get("broker", 0),  # which of the cluster's brokers to publish through
            name=self.spec.get("name", ""),
        )
        self.ch = await self.conn.channel()
        await self.ch.confirm_select()
        self.ch.on_confirm = self._confirm
        self.ch.on_return = self._returned

    def _confirm(self, seq: int, multiple: bool, ok: bool) -> None:
        if not ok:
            self.error = self.error or f"the broker refused (nack) message {seq}"
        if multiple:
            while self.order and self.order[0] <= seq:
                tag = self.tags.pop(self.order.popleft(), None)
                if tag is not None and ok:
                    self.confirmed.add(tag)
        else:
            tag = self.tags.pop(seq, None)
            if tag is not None and ok:
                self.confirmed.add(tag)
        self.space.set()
        self.notify()

    def _returned(self, reply: str) -> None:
        where = self.spec.get("queue") or self.exchange
        self.error = self.error or f"unroutable at {where} ({reply})"

    @property
    def inflight(self) -> int:
        return len(self.tags)

    def publish(self, header: bytes, body: bytes, routing_key: str, tag: int) -> None:
        seq = self.ch.publish(self.exchange, routing_key, header, body)
        self.order.append(seq)
        self.tags[seq] = tag

    async def put(self, d: Delivery, tag: int, source: str, index: int) -> None:
        key = d.routing_key if self.exchange else self.spec["queue"]
        self.publish(with_header(d.header, TRANSFER_HDR, self.transfer_id), d.body, key, tag)
        if len(self.tags) % 256 == 0:
            await self.conn.drain()

    async def wait_below(self, n: int, timeout: float = 60.0) -> None:
        while len(self.tags) >= n and not self.error:
            self.space.clear()
            if self.conn.closed:
                raise BrokerUnavailable(f"publishing to {self.spec.get('queue') or self.exchange}: {self.conn.closed}")
            try:
                await asyncio.wait_for(self.space.wait(), timeout)
            except TimeoutError:
                raise BrokerUnavailable(f"no publisher confirm within {timeout:.0f}s") from None

    async def flush(self) -> None:
        await self.conn.drain()
        await self.wait_below(1)

    async def close(self) -> None:
        await self.conn.close()


class _JetStreamSink(_Sink):
    """Publishes each message on ``subject_prefix`` + its routing key (or the spec's ``subject``),
    once the subject is found among the destination stream's ``subjects``: a subject no stream
    captures is refused before its first publish, not left to time out unacknowledged."""

    def __init__(self, spec: dict[str, Any], transfer_id: str) -> None:
        super().__init__()
        self.spec, self.transfer_id = spec, transfer_id
        patterns = spec.get("subjects")
        self.captured = subjects.Capture(patterns) if patterns is not None else None

    async def open(self) -> None:
        cluster = NatsCluster.model_validate_json(self.spec["cluster"])
        self.nc = await Wire.open(cluster, self.spec.get("name", ""), prefer=self.spec.get("leader", ""))
        self.pub = Publisher(self.nc, window=512, on_ack=self._on_ack)
        await self.pub.start()

    def _on_ack(self, ack: Any) -> None:
        if ack.error:
            self.error = self.error or f"publish to {ack.subject}: {ack.error}"
        else:
            self.confirmed.add(ack.ctx)
            self.duplicates += ack.duplicate
        self.notify()

    async def put(self, d: Delivery, tag: int, source: str, index: int) -> None:
        headers = {k: _text(v) for k, v in (d.headers or {}).items()}
        headers[TRANSFER_HDR] = self.transfer_id
        if self.spec.get("stream"):
            headers["Nats-Expected-Stream"] = self.spec["stream"]
        subject = self.spec.get("subject_prefix", "") + (self.spec.get("subject") or d.routing_key or "")
        if self.captured and not self.captured(subject):
            raise FerryError(
                f"moving {source}: subject {subject!r} (routing key {d.routing_key!r}) is not one of "
                f"{self.spec.get('stream')}'s subjects: --subject-prefix maps them (it takes {self.captured.text})"
            )
        await self.pub.publish(subject, d.body, headers=headers, msg_id=d.message_id, ctx=tag)

    async def flush(self) -> None:
        await self.pub.flush()

    async def close(self) -> None:
        await self.pub.close()
        with contextlib.suppress(Exception):
            await self.nc.close()


class _ParquetSink(_Sink):
    """Rows in the common schema, one file per chunk, fsynced before the source is acked."""

    def __init__(self, spec: dict[str, Any], transfer_id: str, chunk: int = 50_000) -> None:
        super().__init__()
        self.dir = Path(spec["path"])
        self.chunk = chunk
        self.builder = BatchBuilder()
        self.tags: list[int] = []
        self.prefix = f"part-{spec.get('queue', 'q')}-{uuid.uuid4().hex[:8]}"
        self.files = 0

    async def open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    async def put(self, d: Delivery, tag: int, source: str, index: int) -> None:
        self.builder.add(*message_row(d, source, index))
        self.tags.append(tag)
        if len(self.tags) >= self.chunk:
            await self.flush()

    async def flush(self) -> None:
        if not self.tags:
            return
        table = pa.Table.from_batches([self.builder.flush()], schema=ARROW_SCHEMA)
        final = self.dir / f"{self.prefix}-{self.files:05d}.parquet"
        tmp = final.with_suffix(".tmp")
        pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        tmp.replace(final)
        self.files += 1
        self.confirmed.update(self.tags)
        self.tags = []
        self.notify()


def _sink(spec: dict[str, Any], transfer_id: str, window: int) -> _Sink:
    if spec["kind"] == "parquet":
        return _ParquetSink(spec, transfer_id, chunk=max(1, window // 2))  # confirmed before the window fills
    kinds = {"rabbitmq": _RabbitSink, "jetstream": _JetStreamSink}
    return kinds[spec["kind"]](spec, transfer_id)


# -- the mover ------------------------------------------------------------------------------------


@dataclass
class MoveTask:
    cluster: str  # JSON of the source RabbitCluster
    name: str  # source cluster name
    vhost: str
    queue: str
    sink: dict[str, Any]
    transfer_id: str
    limit: int | None = None  # this task's share; None = what the queue holds when the task starts
    window: int = 1000
    idle: float = 1.0
    broker: int = 0  # which broker of the source cluster to consume from
    rate: float | None = None  # messages per second for this task
    # message ids the destination already holds from this transfer (a killed run's, confirmed
    # there but never acked here): a message with one is acked, not published again
    skip_ids: tuple[str, ...] = ()
    all_ids: bool = False  # skip_ids are all there are: a redelivered message with another id is no duplicate
    # the source queue's node may die meanwhile (an evacuation's relocation): then the task ends with
    # what the sink confirmed and "source lost: ..." in its errors, instead of failing uncounted
    source_may_die: bool = False


@dataclass
class MoveResult:
    vhost: str
    queue: str
    before: int = 0
    moved: int = 0
    bytes: int = 0
    redelivered: int = 0
    duplicates: int = 0  # moved, but already held by the destination stream: not stored twice
    skipped: int = 0  # with one of the task's skip_ids: acked, not published again
    left: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


class _Consumer:
    """An aio-pika manual-ack consumer whose messages are awaited with a timeout (None when idle)."""

    def __init__(
        self, queue: Any, inbox: asyncio.Queue[AbstractIncomingMessage] | None = None, priority: int | None = None
    ) -> None:
        self.queue, self.priority = queue, priority
        self.inbox: asyncio.Queue[AbstractIncomingMessage] = inbox or asyncio.Queue()

    async def __aenter__(self) -> _Consumer:
        async def deliver(m: AbstractIncomingMessage) -> None:
            self.inbox.put_nowait(m)

        arguments = {"x-priority": self.priority} if self.priority is not None else None
        self.tag = await self.queue.consume(deliver, no_ack=False, arguments=arguments)
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            await self.queue.cancel(self.tag)


_UNDER_FEDERATION = -1  # a consumer priority for which no federation link runs


async def _ready(channel: Any, queue: str) -> int:
    """The live ready count (a passive declare; the management API lags)."""
    declared = await channel.declare_queue(queue, passive=True)
    return int(declared.declaration_result.message_count)


async def move_queue(task: MoveTask) -> MoveResult:
    """Move messages from one queue to the sink: ack each only after the sink confirmed it.

    Source acks are sent from the sink's confirmation callback (multiple=True up
    to the last contiguous confirmed delivery), so the prefetch window refills
    as fast as the sink confirms.
    """
    t0 = time.monotonic()
    result = MoveResult(task.vhost, task.queue)
    source = f"{task.name}/{q(task.vhost)}/{task.queue}"
    conn = await raw_connect(RabbitCluster.model_validate_json(task.cluster), task.vhost, task.broker, task.name)
    sink = _sink({**task.sink, "queue": task.sink.get("queue") or task.queue}, task.transfer_id, task.window)
    try:
        ch = await conn.channel()
        try:
            try:
                result.before = await ch.declare_passive(task.queue)
            except NotFound:
                raise NotFound(f"queue {task.queue!r} not found in vhost {task.vhost!r} of {task.name}") from None
            limit = result.before if task.limit is None else min(task.limit, result.before)
            await _move_until(task, ch, sink, source, limit, result)
        except FerryError as exc:
            if not task.source_may_die or sink.error:
                raise
            if result.moved:  # the sink's node lives: what reached it is confirmed, and counted
                await sink.flush()
            if sink.error:
                raise FerryError(f"moving {source}: {sink.error}") from None
            result.errors.append(f"source lost: {exc}")
            result.left = -1
        result.duplicates = sink.duplicates + result.skipped
    finally:
        await _close_quietly(sink)
        await conn.close()
    result.seconds = time.monotonic() - t0
    return result


async def _move_until(task: MoveTask, ch: Any, sink: _Sink, source: str, limit: int, result: MoveResult) -> None:
    """The body of :func:`move_queue`: `limit` messages (or until the queue is empty) into `sink`."""
    if limit > 0:
        await ch.qos(task.window)
        await sink.open()
        unacked: deque[int] = deque()

        def ack_confirmed() -> None:
            if sink.error:
                return
            last = None
            while unacked and unacked[0] in sink.confirmed:
                last = unacked.popleft()
                sink.confirmed.discard(last)
            if last is not None and not ch.closed:
                ch.ack(last, multiple=True)

        sink.notify = ack_confirmed
        inbox: asyncio.Queue[Delivery | None] = asyncio.Queue()
        ch.on_cancel = lambda: inbox.put_nowait(None)
        consumer = await ch.consume(task.queue, inbox.put_nowait)
        pacer = Pacer(task.rate)
        skip = Counter(task.skip_ids)
        while result.moved < limit:
            if sink.error:
                raise FerryError(f"moving {source}: {sink.error}")
            if inbox.empty():
                try:
                    d = await asyncio.wait_for(inbox.get(), task.idle)
                except TimeoutError:
                    await sink.flush()
                    ack_confirmed()
                    if await ch.declare_passive(task.queue) == 0:
                        break  # someone else took the rest
                    continue
            else:
                d = inbox.get_nowait()
            if d is None:
                break  # the broker cancelled the consumer (queue deleted)
            unacked.append(d.tag)
            if skip and skip[d.message_id] > 0:  # already at the destination (flagged redelivered or
                # not: a node that crashed before it stored the acks sends them again as new)
                skip[d.message_id] -= 1
                sink.confirmed.add(d.tag)
                ack_confirmed()
                result.moved += 1
                result.skipped += 1
                continue
            await pacer.wait()
            result.redelivered += d.redelivered and not (task.all_ids and d.message_id)
            result.bytes += len(d.body)
            await sink.put(d, d.tag, source, result.moved)
            result.moved += 1
        await ch.cancel(consumer)
        await sink.flush()
        ack_confirmed()
        if sink.error:
            raise FerryError(f"moving {source}: {sink.error}")
    result.left = await ch.declare_passive(task.queue)


async def _close_quietly(sink: _Sink) -> None:
    with contextlib.suppress(Exception):
        await sink.close()


# -- non-destructive snapshot ---------------------------------------------------------------


async def snapshot_queue(
    cluster: RabbitCluster, name: str, vhost: str, queue: str, batch_size: int = 10_000, idle: float = 2.0
) -> Any:
    """Yield Arrow batches of every ready message, in queue order; unacked, they are requeued when
    the channels close.

    A channel holds at most 65,535 unacked messages (and a quorum queue stops at 2,000 without an
    explicit prefetch), so a large queue is read through several channels, one after the other:
    each consumer starts once the one before holds all it may (consumers at once take turns, and
    the rows lose the queue's order), and each may hold no more than the count read at the start.
    They consume with a negative priority: a federated queue's link pulls from its upstream only
    for consumers of priority 0 or more (rabbit_federation_queue: ``active_unfederated``), so
    reading a federated queue pulls nothing into it, and the applications' consumers go first.
    """
    per_channel = 50_000
    source = f"{name}/{q(vhost)}/{queue}"
    conn = await amqp_connect(cluster, vhost=vhost)
    async with conn:
        channel = await conn.channel()
        try:
            total = await _ready(channel, queue)
        except aio_pika.exceptions.ChannelClosed:
            raise NotFound(f"queue {queue!r} not found in vhost {vhost!r} of {name}") from None
        builder, index, granted, channels = BatchBuilder(), 0, 0, []
        async with contextlib.AsyncExitStack() as stack:
            inbox: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
            while index < total:
                if index == granted:  # the consumers so far hold all they may: the next one takes over
                    channel = channel if not channels else await conn.channel()
                    channels.append(channel)
                    await channel.set_qos(prefetch_count=min(per_channel, total - granted))
                    granted += min(per_channel, total - granted)
                    reader = _Consumer(await channel.get_queue(queue, ensure=False), inbox, priority=_UNDER_FEDERATION)
                    await stack.enter_async_context(reader)
                try:
                    m = await asyncio.wait_for(inbox.get(), idle)
                except TimeoutError:
                    break  # fewer than counted: consumed by someone else meanwhile
                builder.add(*message_row(m, source, index))
                index += 1
                if len(builder) >= batch_size:
                    yield builder.flush()
        if len(builder):
            yield builder.flush()
        for channel in channels:
            await channel.close()  # requeues everything we held


# -- the rabbitmq sink data source ----------------------------------------------------------------


@dataclass(frozen=True)
class WriteConfig:
    cluster: str
    vhost: str = "/"
    queue: str | None = None
    exchange: str | None = None
    transfer_id: str | None = None
    window: int = 512
    rate: float | None = None


async def write_rows(cfg: WriteConfig, batches: Batches) -> WriteCounts:
    """Publish rows mandatory with confirms; fail on any nack or unroutable message."""
    counts = WriteCounts()
    sink = _RabbitSink(
        {"cluster": cfg.cluster, "vhost": cfg.vhost, "queue": cfg.queue, "exchange": cfg.exchange},
        cfg.transfer_id or "",
    )
    await sink.open()
    pacer = Pacer(cfg.rate)
    try:
        async for batch in each_batch(batches):
            for row in batch.to_pylist():
                await pacer.wait()
                body = row.get("payload") or b""
                counts.rows += 1
                counts.bytes += len(body)
                key = cfg.queue or row.get("subject") or ""
                sink.publish(row_header(row, cfg.transfer_id, len(body)), body, key, counts.rows)
                if sink.inflight >= cfg.window:
                    await sink.conn.drain()
                    await sink.wait_below(cfg.window)
                if sink.error:
                    break
        await sink.flush()
    finally:
        await sink.close()
    if sink.error:
        raise FerryError(f"rabbitmq write: {sink.error}")
    counts.stored = len(sink.confirmed)
    return counts
