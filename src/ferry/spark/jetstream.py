"""The ``jetstream`` data source: read and write JetStream streams from Spark.

Name: ``jetstream``

Options (all strings):

- ``cluster``: a cluster name from the topology (with ``topology`` = file path), or
  the cluster as JSON (what ferry's jobs pass). Credentials are references
  (environment variable or file) resolved where the task runs. ``account``: one of the
  cluster's ``accounts`` in the topology (default: its ``credentials``).
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
import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pyarrow as pa
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

from ferry.brokers import kept
from ferry.brokers.nats.reader import Range, ReadConfig, kept_states, plan_ranges, read_range, split
from ferry.brokers.nats.relay import relay_range
from ferry.brokers.nats.writer import WriteConfig, write_batches
from ferry.errors import ConfigError
from ferry.schema import SPARK_DDL
from ferry.spark.options import (
    COUNTS_DDL,
    Committed,
    cluster_json,
    executor_task,
    iterate,
    on_executor,
    opt_bool,
    opt_int,
    per_index,
)
from ferry.topology import NatsCluster

__all__ = ["JetStreamDataSource", "read_config", "stream_frame", "write_config"]


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
        return JetStreamReader(read_config(dict(self.options)))

    def streamReader(self, schema: Any) -> JetStreamStreamReader:
        options = dict(self.options)
        cfg = read_config(options)
        relay = None
        if options.get("relay_to"):
            to = json.loads(options["relay_to"])
            leaders, base = to.pop("leaders", {}), write_config(to)
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
        return JetStreamWriter(write_config(dict(self.options)))

    def streamWriter(self, schema: Any, overwrite: bool) -> JetStreamStreamWriter:
        return JetStreamStreamWriter(write_config(dict(self.options)))


def _partitions(ranges: list[Range]) -> list[InputPartition]:
    return [InputPartition(r) for r in ranges]


class JetStreamReader(DataSourceReader):
    def __init__(self, cfg: ReadConfig) -> None:
        self.cfg = cfg

    def partitions(self) -> list[InputPartition]:
        return _partitions(plan_ranges(self.cfg) or [Range(self.cfg.streams[0], 1, 0)])

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:  # type: ignore[override]
        part: Range = partition.value
        if part.hi < part.lo:
            return iter(())
        return iterate(read_range(self.cfg, part))


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
        return kept.run(kept_states(self.cfg))

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

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        ranges: list[Range] = []
        for stream in self.cfg.streams:
            lo, hi = int(start.get(stream, 0)) + 1, int(end.get(stream, 0))
            ranges += split(stream, lo, hi, self.parts, self.cfg.fetch or 1000)
        if self.relay and not ranges and not self.warm:  # start the Python workers now, not with the first message
            ranges = [Range(self.cfg.streams[0], 1, 0)] * self.parts
        self.warm = True
        return _partitions(ranges)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:  # type: ignore[override]
        part: Range = partition.value
        if self.relay:
            with on_executor():
                return iter([relay_range(self.cfg, self.relay[part.stream], part).as_batch()])
        return iterate(read_range(self.cfg, part))

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to do: the stream keeps its messages; offsets live in Spark's checkpoint."""


class JetStreamWriter(DataSourceArrowWriter):
    def __init__(self, cfg: WriteConfig) -> None:
        self.cfg = cfg

    @executor_task
    def write(self, iterator: Iterator[pa.RecordBatch]) -> Committed:
        return Committed(asyncio.run(write_batches(self.cfg, iterator)))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Every message was acked by JetStream before its task returned."""


class JetStreamStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, cfg: WriteConfig) -> None:
        self.cfg = cfg

    @executor_task
    def write(self, iterator: Iterator[pa.RecordBatch]) -> Committed:
        return Committed(asyncio.run(write_batches(self.cfg, iterator)))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Every message was acked by JetStream before its task returned."""


def read_config(options: dict[str, str]) -> ReadConfig:
    streams = tuple(s.strip() for s in (options.get("stream") or "").split(",") if s.strip())
    if not streams:
        raise ConfigError("jetstream: option 'stream' is required")
    return ReadConfig(
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


def write_config(options: dict[str, str]) -> WriteConfig:
    try:
        ack_timeout = float(options.get("ack_timeout") or 2.0)
        give_up_after = float(options.get("give_up_after") or 120.0)
    except ValueError:
        raise ConfigError("jetstream: ack_timeout and give_up_after are seconds") from None
    return WriteConfig(
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


def _name(options: dict[str, str]) -> str:
    value = options.get("cluster", "")
    return "nats" if value.lstrip().startswith("{") else value


def stream_frame(spark: Any, cfg: ReadConfig) -> Any:
    """What ``spark.read.format("jetstream")`` reads for `cfg`, as a DataFrame in the common schema:
    one task per sequence range, the ranges planned here. ferry's own jobs read so because Spark
    plans a Python data source in Python processes it starts for the purpose (about 2.7 s of a
    command here); planned on the driver, the read starts on the task workers alone. Call it
    outside a running event loop (it asks the streams' state)."""
    ranges = plan_ranges(cfg)
    return per_index(spark, len(ranges), lambda i: iterate(read_range(cfg, ranges[i])), SPARK_DDL)
