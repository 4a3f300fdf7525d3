"""RabbitMQ in the data plane: the queue mover, the ``rabbitmq`` sink, queue snapshots.

Queues are destructive, so reading one is not a Spark data source (a retried
task would read different messages). Instead:

- :func:`move_queue` is one Spark task per queue (or per share of a large
  queue): it consumes with manual ack, publishes each message to the sink
  (RabbitMQ with publisher confirms, JetStream with acks, or Parquet files
  written and fsynced), and acks the source only after the sink confirmed it.
  At-least-once: a task killed between the sink's confirm and the source ack
  leaves those messages in the queue, and a rerun moves them again; each moved
  message carries ``x-ferry-transfer`` (the transfer id) and the rerun counts
  redelivered messages as possible duplicates.
- :func:`snapshot_queue` reads every ready message without acking and closes
  the channel, so the broker requeues them all: the queue holds what it held
  (the redelivered flag of those messages becomes true).

Data source name: ``rabbitmq`` (write only).

Options: ``cluster`` (name from ``topology``, or JSON), ``vhost`` (default
``/``), ``queue`` (publish to this queue through the default exchange) or
``exchange`` (publish there with each row's ``subject`` as routing key),
``transfer_id`` (added as ``x-ferry-transfer``), ``window`` (unconfirmed
publishes in flight, 512).

Guarantees: every row is published mandatory with publisher confirms; a nack
or an unroutable message fails the task. At-least-once.

Example::

    df.write.format("rabbitmq").option("cluster", "pc1").option("queue", "orders").mode("append").save()
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import aio_pika
import pyarrow as pa
import pyarrow.parquet as pq
from aio_pika.abc import AbstractIncomingMessage
from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage

from ferry.brokers import nats as bnats
from ferry.brokers.rabbitmq import amqp_connect, q
from ferry.errors import ConfigError, FerryError, NotFound
from ferry.pipeline._common import WriteCounts, cluster_json, nats_cluster, opt_int, rabbit_cluster
from ferry.pipeline.schema import ARROW_SCHEMA, SPARK_DDL, BatchBuilder
from ferry.publish import Pacer, Publisher
from ferry.topology import RabbitCluster

__all__ = [
    "TRANSFER_HDR",
    "MoveTask",
    "RabbitMQDataSource",
    "headers_from_json",
    "headers_to_json",
    "move_queue",
    "snapshot_queue",
]

TRANSFER_HDR = "x-ferry-transfer"
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


def row_message(row: dict[str, Any], transfer_id: str | None) -> aio_pika.Message:
    """An AMQP message from a common-schema row: typed headers and properties when present."""
    props = row.get("properties") or {}
    headers = headers_from_json(props.get("headers")) if props.get("headers") else dict(row.get("headers") or [])
    if transfer_id:
        headers[TRANSFER_HDR] = transfer_id
    expiration = props.get("expiration")
    return aio_pika.Message(
        row.get("payload") or b"",
        headers=headers or None,
        content_type=props.get("content_type"),
        content_encoding=props.get("content_encoding"),
        delivery_mode=props.get("delivery_mode") or aio_pika.DeliveryMode.PERSISTENT,
        priority=props.get("priority"),
        correlation_id=props.get("correlation_id"),
        reply_to=props.get("reply_to"),
        expiration=int(expiration) / 1000 if expiration else None,
        message_id=props.get("message_id") or row.get("msg_id"),
        timestamp=props.get("timestamp") or row.get("timestamp"),
        type=props.get("type"),
        user_id=props.get("user_id"),
        app_id=props.get("app_id"),
    )


def _amqp_value(v: Any) -> Any:
    """A decoded header value that pamqp can encode again (it encodes bytes only as bytearray)."""
    if isinstance(v, bytes):
        return bytearray(v)
    if isinstance(v, dict):
        return {k: _amqp_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_amqp_value(x) for x in v]
    return v


def _republish(m: AbstractIncomingMessage, transfer_id: str) -> aio_pika.Message:
    """The same message (body, properties, typed headers) plus x-ferry-transfer."""
    headers = {k: _amqp_value(v) for k, v in (m.headers or {}).items()}
    headers[TRANSFER_HDR] = transfer_id
    return aio_pika.Message(
        m.body,
        headers=headers,
        content_type=m.content_type,
        content_encoding=m.content_encoding,
        delivery_mode=m.delivery_mode,
        priority=m.priority,
        correlation_id=m.correlation_id,
        reply_to=m.reply_to,
        expiration=m.expiration,
        message_id=m.message_id,
        timestamp=m.timestamp,
        type=m.type,
        user_id=m.user_id,
        app_id=m.app_id,
    )


# -- sinks: where the mover puts messages -----------------------------------------------------


class _Sink:
    """Puts messages somewhere durable and reports each one as confirmed."""

    def __init__(self) -> None:
        self.confirmed: set[int] = set()
        self.error: str | None = None

    async def open(self) -> None: ...

    async def put(self, m: AbstractIncomingMessage, tag: int, source: str, index: int) -> None: ...

    async def flush(self) -> None: ...

    async def close(self) -> None: ...


class _RabbitSink(_Sink):
    def __init__(self, spec: dict[str, Any], transfer_id: str) -> None:
        super().__init__()
        self.spec, self.transfer_id = spec, transfer_id
        self.inflight: set[asyncio.Future[Any]] = set()

    async def open(self) -> None:
        cluster = rabbit_cluster(self.spec["cluster"])
        self.conn = await amqp_connect(cluster, vhost=self.spec.get("vhost", "/"))
        self.channel = await self.conn.channel(publisher_confirms=True, on_return_raises=True)
        if self.spec.get("exchange"):
            self.exchange = await self.channel.get_exchange(self.spec["exchange"], ensure=True)
        else:
            self.exchange = self.channel.default_exchange

    def _routing_key(self, original: str) -> str:
        return original if self.spec.get("exchange") else self.spec["queue"]

    async def send(self, message: aio_pika.Message, routing_key: str, tag: int) -> None:
        fut = asyncio.ensure_future(self.exchange.publish(message, routing_key, mandatory=True))
        self.inflight.add(fut)

        def done(f: asyncio.Future[Any]) -> None:
            self.inflight.discard(f)
            if f.cancelled() or f.exception():
                exc = f.exception() if not f.cancelled() else "cancelled"
                self.error = self.error or f"publish to {self.spec.get('queue') or self.spec.get('exchange')}: {exc}"
            else:
                self.confirmed.add(tag)

        fut.add_done_callback(done)

    async def put(self, m: AbstractIncomingMessage, tag: int, source: str, index: int) -> None:
        await self.send(_republish(m, self.transfer_id), self._routing_key(m.routing_key or ""), tag)

    async def flush(self) -> None:
        if self.inflight:
            await asyncio.gather(*list(self.inflight), return_exceptions=True)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.conn.close()


class _JetStreamSink(_Sink):
    def __init__(self, spec: dict[str, Any], transfer_id: str) -> None:
        super().__init__()
        self.spec, self.transfer_id = spec, transfer_id

    async def open(self) -> None:
        self.nc = await bnats.connect(nats_cluster(self.spec["cluster"]), name=self.spec.get("name", ""))
        self.pub = Publisher(self.nc, window=512, on_ack=self._on_ack)
        await self.pub.start()

    def _on_ack(self, ack: Any) -> None:
        if ack.error:
            self.error = self.error or f"publish to {ack.subject}: {ack.error}"
        else:
            self.confirmed.add(ack.ctx)

    async def put(self, m: AbstractIncomingMessage, tag: int, source: str, index: int) -> None:
        headers = {k: _text(v) for k, v in (m.headers or {}).items()}
        headers[TRANSFER_HDR] = self.transfer_id
        if self.spec.get("stream"):
            headers["Nats-Expected-Stream"] = self.spec["stream"]
        subject = self.spec.get("subject") or m.routing_key or ""
        await self.pub.publish(subject, m.body, headers=headers, msg_id=m.message_id, ctx=tag)

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

    async def put(self, m: AbstractIncomingMessage, tag: int, source: str, index: int) -> None:
        self.builder.add(*message_row(m, source, index))
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
    limit: int | None = None  # this task's share; None = until the queue is empty
    window: int = 1000
    idle: float = 1.0
    broker: int = 0  # which broker of the source cluster to consume from
    rate: float | None = None  # messages per second for this task


@dataclass
class MoveResult:
    vhost: str
    queue: str
    before: int = 0
    moved: int = 0
    bytes: int = 0
    redelivered: int = 0
    left: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


class _Consumer:
    """A manual-ack consumer whose messages are awaited with a timeout (None when idle)."""

    def __init__(self, queue: Any, inbox: asyncio.Queue[AbstractIncomingMessage] | None = None) -> None:
        self.queue = queue
        self.inbox: asyncio.Queue[AbstractIncomingMessage] = inbox or asyncio.Queue()

    async def __aenter__(self) -> _Consumer:
        async def deliver(m: AbstractIncomingMessage) -> None:
            self.inbox.put_nowait(m)

        self.tag = await self.queue.consume(deliver, no_ack=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            await self.queue.cancel(self.tag)

    async def get(self, timeout: float) -> AbstractIncomingMessage | None:
        try:
            return await asyncio.wait_for(self.inbox.get(), timeout)
        except TimeoutError:
            return None


async def _ready(channel: Any, queue: str) -> int:
    """The live ready count (a passive declare; the management API lags)."""
    declared = await channel.declare_queue(queue, passive=True)
    return int(declared.declaration_result.message_count)


async def move_queue(task: MoveTask) -> MoveResult:
    """Move messages from one queue to the sink: ack each only after the sink confirmed it."""
    t0 = time.monotonic()
    result = MoveResult(task.vhost, task.queue)
    cluster = rabbit_cluster(task.cluster)
    source = f"{task.name}/{q(task.vhost)}/{task.queue}"
    conn = await amqp_connect(cluster, cluster.brokers[task.broker % len(cluster.brokers)], vhost=task.vhost)
    sink = _sink({**task.sink, "queue": task.sink.get("queue") or task.queue}, task.transfer_id, task.window)
    async with conn:
        channel = await conn.channel()
        try:
            result.before = await _ready(channel, task.queue)
        except aio_pika.exceptions.ChannelClosed:
            raise NotFound(f"queue {task.queue!r} not found in vhost {task.vhost!r} of {task.name}") from None
        limit = result.before if task.limit is None else min(task.limit, result.before)
        await channel.set_qos(prefetch_count=task.window)
        queue = await channel.get_queue(task.queue, ensure=False)
        await sink.open()
        unacked: deque[AbstractIncomingMessage] = deque()
        pacer = Pacer(task.rate)

        async def ack_confirmed() -> None:
            last = None
            while unacked and unacked[0].delivery_tag in sink.confirmed:
                last = unacked.popleft()
                sink.confirmed.discard(last.delivery_tag)
            if last is not None:
                await last.ack(multiple=True)
            if sink.error:
                raise FerryError(f"moving {source}: {sink.error}")

        try:
            if limit > 0:
                async with _Consumer(queue) as consumer:
                    while result.moved < limit:
                        m = await consumer.get(task.idle)
                        if m is None:
                            await sink.flush()
                            await ack_confirmed()
                            if await _ready(channel, task.queue) == 0:
                                break  # someone else took the rest
                            continue
                        await pacer.wait()
                        unacked.append(m)
                        result.redelivered += int(m.redelivered)
                        result.bytes += len(m.body)
                        await sink.put(m, m.delivery_tag, source, result.moved)
                        result.moved += 1
                        if len(unacked) >= task.window // 2:
                            await ack_confirmed()
                    await sink.flush()
                    await ack_confirmed()
            result.left = await _ready(channel, task.queue)
        finally:
            await sink.close()
    result.seconds = time.monotonic() - t0
    return result


# -- non-destructive snapshot ---------------------------------------------------------------


async def snapshot_queue(
    cluster: RabbitCluster, name: str, vhost: str, queue: str, batch_size: int = 10_000, idle: float = 2.0
) -> Any:
    """Yield Arrow batches of every ready message; unacked, they are requeued when the channels close.

    A channel holds at most 65,535 unacked messages (and a quorum queue stops
    at 2,000 without an explicit prefetch), so large queues are read through
    several channels at once.
    """
    per_channel = 50_000
    source = f"{name}/{q(vhost)}/{queue}"
    conn = await amqp_connect(cluster, vhost=vhost)
    async with conn:
        first = await conn.channel()
        try:
            total = await _ready(first, queue)
        except aio_pika.exceptions.ChannelClosed:
            raise NotFound(f"queue {queue!r} not found in vhost {vhost!r} of {name}") from None
        builder, index = BatchBuilder(), 0
        channels = [first] + [await conn.channel() for _ in range(max(0, -(-total // per_channel) - 1))]
        async with contextlib.AsyncExitStack() as stack:
            inbox: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
            for channel in channels if total else []:
                await channel.set_qos(prefetch_count=min(per_channel, total))
                consumer = _Consumer(await channel.get_queue(queue, ensure=False), inbox)
                await stack.enter_async_context(consumer)
            while index < total:
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

    @classmethod
    def from_options(cls, options: dict[str, str]) -> WriteConfig:
        cfg = cls(
            cluster=cluster_json(options, RabbitCluster),
            vhost=options.get("vhost") or "/",
            queue=options.get("queue") or None,
            exchange=options.get("exchange") or None,
            transfer_id=options.get("transfer_id") or None,
            window=opt_int(options, "window", 512) or 512,
            rate=float(options["rate"]) if options.get("rate") else None,
        )
        if bool(cfg.queue) == bool(cfg.exchange):
            raise ConfigError("rabbitmq: give exactly one of the options 'queue' or 'exchange'")
        return cfg


async def write_rows(cfg: WriteConfig, batches: Any) -> WriteCounts:
    """Publish rows mandatory with confirms; fail on any nack or unroutable message."""
    counts = WriteCounts()
    sink = _RabbitSink(
        {"cluster": cfg.cluster, "vhost": cfg.vhost, "queue": cfg.queue, "exchange": cfg.exchange},
        cfg.transfer_id or "",
    )
    await sink.open()
    pacer = Pacer(cfg.rate)
    try:
        for batch in batches:
            for row in batch.to_pylist():
                await pacer.wait()
                counts.rows += 1
                counts.bytes += len(row.get("payload") or b"")
                key = cfg.queue or row.get("subject") or ""
                await sink.send(row_message(row, cfg.transfer_id), key, counts.rows)
                while len(sink.inflight) >= cfg.window:
                    await asyncio.wait(list(sink.inflight), return_when=asyncio.FIRST_COMPLETED)
                if sink.error:
                    break
        await sink.flush()
    finally:
        await sink.close()
    if sink.error:
        raise FerryError(f"rabbitmq write: {sink.error}")
    counts.stored = len(sink.confirmed)
    return counts


class _Writer(DataSourceArrowWriter):
    def __init__(self, cfg: WriteConfig) -> None:
        self.cfg = cfg

    def write(self, iterator: Any) -> WriteCounts:
        return asyncio.run(write_rows(self.cfg, iterator))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Every message was confirmed by the broker before its task returned."""


class _StreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, cfg: WriteConfig) -> None:
        self.cfg = cfg

    def write(self, iterator: Any) -> WriteCounts:
        return asyncio.run(write_rows(self.cfg, iterator))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Every message was confirmed by the broker before its task returned."""


class RabbitMQDataSource(DataSource):
    """Spark data source ``rabbitmq`` (write only; see the module docstring)."""

    @classmethod
    def name(cls) -> str:
        return "rabbitmq"

    def schema(self) -> str:
        return SPARK_DDL

    def writer(self, schema: Any, overwrite: bool) -> _Writer:
        return _Writer(WriteConfig.from_options(dict(self.options)))

    def streamWriter(self, schema: Any, overwrite: bool) -> _StreamWriter:
        return _StreamWriter(WriteConfig.from_options(dict(self.options)))
