"""Running a copy on Spark, with its progress polled from the brokers on the driver."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from ferry.brokers import nats as bnats
from ferry.brokers.base import WriteCounts
from ferry.brokers.nats import writer as jetstream_writer
from ferry.brokers.nats.reader import Range, ReadConfig, plan_ranges, read_rows
from ferry.brokers.rabbitmq import Management, q, queue_io
from ferry.brokers.rabbitmq.queue_io import MoveResult, MoveTask
from ferry.brokers.rabbitmq.wire import QueueCounts
from ferry.headers import SOURCE_HDR, SOURCE_SEQ_HDR
from ferry.jobs.copy.plan import CopyPlan
from ferry.schema import SPARK_DDL
from ferry.spark.jetstream import stream_frame
from ferry.spark.options import COUNTS_DDL, iterate, on_executor, per_index
from ferry.spark.session import spark_error
from ferry.spark.tasks import cores, is_connect, per_task, run_moves, write_parquet
from ferry.topology import RabbitCluster, Topology
from ferry.uris import Endpoint


@dataclass
class CopyReport:
    plan: dict[str, Any]
    read: int = 0
    stored: int = 0
    duplicates: int = 0  # already at the destination (duplicate acks): not stored twice
    possible_duplicates: int = 0  # RabbitMQ: came redelivered (an interrupted run, a snapshot, another consumer)
    retries: int = 0
    bytes: int = 0  # payload bytes
    seconds: float = 0.0
    queues: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.read / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rate": round(self.rate)}


# -- execution -------------------------------------------------------------------------------


def run_copy(
    topology: Topology, plan: CopyPlan, spark: Any, progress: Callable[[int], None] | None = None
) -> CopyReport:
    report = CopyReport(plan.as_dict())
    t0 = time.monotonic()
    stop, lock = threading.Event(), threading.Lock()

    def watched(n: int) -> None:  # nothing from a watcher still polling once the copy has ended
        with lock:
            if progress and not stop.is_set():
                progress(n)

    watcher = threading.Thread(target=_watch, args=(topology, plan, watched, stop), daemon=True) if progress else None
    if watcher:
        watcher.start()
    try:
        {"mover": _run_mover, "snapshot": _run_snapshot}.get(plan.engine, _run_stream)(topology, plan, spark, report)
    except Exception as exc:
        raise spark_error(exc) from None
    finally:
        with lock:
            stop.set()
        if watcher:
            watcher.join(timeout=5)
    report.seconds = time.monotonic() - t0
    if progress:  # the watcher polls: its last count may be short of the end
        progress(report.read)
    return report


def _write_options(topology: Topology, dst: Endpoint, plan: CopyPlan, tasks: int) -> dict[str, Any]:
    rate = plan.options.rate / tasks if plan.options.rate else None
    if dst.kind == "jetstream":
        return {
            "kind": "jetstream",
            "cfg": jetstream_writer.WriteConfig(
                cluster=topology.nats(dst.cluster or "", dst.account).model_dump_json(),
                name=dst.cluster or "",
                stream=dst.stream,
                window=plan.options.window,
                ordered=plan.options.mode == "ordered",
                batched=plan.batched,
                subject_prefix=plan.options.subject_prefix,
                rate=rate,
                leader=plan.leader,
                subjects=tuple(plan.subjects) if plan.subjects is not None else None,
            ),
        }

    return {
        "kind": "rabbitmq",
        "cfg": queue_io.WriteConfig(
            cluster=topology.rabbitmq(dst.cluster or "").model_dump_json(),
            vhost=dst.vhost or "/",
            queue=dst.queue if not dst.exchange else None,
            exchange=dst.exchange,
            transfer_id=plan.transfer_id,
            window=plan.options.window,
            rate=rate,
        ),
    }


def _writer_fn(spec: dict[str, Any]) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        with on_executor():
            if spec["kind"] == "jetstream":
                counts = asyncio.run(jetstream_writer.write_batches(spec["cfg"], batches))
            else:
                counts = asyncio.run(queue_io.write_rows(spec["cfg"], batches))
        yield counts.as_batch()

    return write


def _run_stream(topology: Topology, plan: CopyPlan, spark: Any, report: CopyReport) -> None:
    src, dst, opts = plan.source, plan.destination, plan.options
    if src.kind == "jetstream" and dst.kind == "jetstream":
        _run_stream_to_stream(topology, plan, spark, report)
        return
    if src.kind == "jetstream":
        df = stream_frame(spark, _source_cfg(topology, plan))
    else:
        df = spark.read.schema(SPARK_DDL).parquet(src.path)
        if dst.kind != "parquet" and opts.mode == "ordered":  # Spark reads a backup's files largest first
            df = df.orderBy("source", "source_seq")
        if plan.resume_from:
            df = df.filter(df.source_seq >= plan.resume_from)
    if dst.kind == "parquet":  # the plan already refused a non-empty directory
        report.read, report.bytes = write_parquet(df, Path(dst.path or ""), plan.backup_record())
        report.stored = report.read
        return
    if opts.mode == "ordered":  # one writer, into a stream or a queue
        df = df.coalesce(1)
    tasks = df.rdd.getNumPartitions() if not is_connect(spark) else (opts.partitions or 1)
    spec = _write_options(topology, dst, plan, max(1, tasks))
    _add_counts(report, df.mapInArrow(_writer_fn(spec), COUNTS_DDL).collect())


def _add_counts(report: CopyReport, rows: list[Any]) -> None:
    for r in rows:
        report.read += r["rows"]
        report.stored += r["stored"]
        report.duplicates += r["duplicates"]
        report.retries += r["retries"]
        report.bytes += r["bytes"]


def _run_stream_to_stream(topology: Topology, plan: CopyPlan, spark: Any, report: CopyReport) -> None:
    """Each task reads its sequence ranges and publishes them itself: no rows cross the JVM.

    (Measured here: passing rows from the reader's Python worker through the JVM
    to a writer's Python worker alone capped a copy near 25,000 msg/s.)
    """
    opts = plan.options
    rcfg = _source_cfg(topology, plan)
    ranges = plan_ranges(rcfg)
    if not ranges:
        return
    held = _copied_seqs(topology, plan, spark) if plan.anti_join else set()
    groups = [ranges] if opts.mode == "ordered" else [[r] for r in ranges]
    wcfg = _write_options(topology, plan.destination, plan, len(groups))["cfg"]

    def copy(i: int) -> dict[str, Any]:
        return asyncio.run(jetstream_writer.write_rows(wcfg, _read_group(rcfg, groups[i], held))).as_dict()

    _add_counts(report, per_task(spark, len(groups), copy, WriteCounts.arrow_schema()))


def _source_cfg(topology: Topology, plan: CopyPlan) -> ReadConfig:
    """How the copy reads its source stream: the range asked for, from the resume point on."""
    src = plan.source
    return ReadConfig(
        cluster=topology.nats(src.cluster or "", src.account).model_dump_json(),
        name=src.cluster or "",
        streams=(src.stream or "",),
        subject=src.subject,
        start_seq=max(filter(None, (src.start_seq, plan.resume_from)), default=None),
        end_seq=src.end_seq,
        partitions=plan.options.partitions,
    )


async def _read_group(rcfg: ReadConfig, ranges: list[Range], held: set[int]) -> AsyncGenerator[list[tuple[Any, ...]]]:
    """The ranges' messages in order, a list at a time, without the sequences the destination
    already holds."""
    for part in ranges:
        async with contextlib.aclosing(read_rows(rcfg, part)) as lists:
            async for rows in lists:
                if held:
                    rows = [row for row in rows if row[5] not in held]
                if rows:
                    yield rows


def _copied_seqs(topology: Topology, plan: CopyPlan, spark: Any) -> set[int]:
    """The source sequences the destination already holds (from this source), read with Spark."""
    from pyspark.sql import functions as F

    dst = plan.destination
    source_name = f"{plan.source.cluster}/{plan.source.stream}"
    cfg = ReadConfig(
        cluster=topology.nats(dst.cluster or "", dst.account).model_dump_json(),
        name=dst.cluster or "",
        streams=(dst.stream or "",),
    )
    held = (
        stream_frame(spark, cfg)
        .where(F.col("headers")[SOURCE_HDR] == source_name)
        .select(F.col("headers")[SOURCE_SEQ_HDR].cast("long").alias("seq"))
    )
    return {r["seq"] for r in held.collect()}


def _run_mover(topology: Topology, plan: CopyPlan, spark: Any, report: CopyReport) -> None:
    src, dst = plan.source, plan.destination
    cluster_json = topology.rabbitmq(src.cluster or "").model_dump_json()
    if dst.kind == "rabbitmq":
        sink: dict[str, Any] = {
            "kind": "rabbitmq",
            "cluster": topology.rabbitmq(dst.cluster or "").model_dump_json(),
            "exchange": dst.exchange,
        }
    elif dst.kind == "jetstream":
        sink = {
            "kind": "jetstream",
            "cluster": topology.nats(dst.cluster or "", dst.account).model_dump_json(),
            "name": dst.cluster,
            "stream": dst.stream,
            "leader": plan.leader,
            "subject_prefix": plan.options.subject_prefix,
            "subjects": plan.subjects,
        }
    else:
        sink = {"kind": "parquet", "path": str(Path(dst.path or "").absolute())}
    work = [x for x in plan.queues if x["ready"] > 0]
    rate = plan.options.rate / max(1, min(len(work), cores(spark))) if plan.options.rate else None
    tasks = [
        MoveTask(
            cluster_json,
            src.cluster or "",
            x["vhost"],
            x["queue"],
            {**sink, "queue": x.get("target"), "vhost": x["target_vhost"]} if dst.kind == "rabbitmq" else sink,
            plan.transfer_id,
            window=2000 if dst.kind != "parquet" else 20000,
            broker=i,
            rate=rate,
            skip_ids=tuple(x.get("skip_ids", ())),
            all_ids=x.get("all_ids", False),
        )
        for i, x in enumerate(work)
    ]
    for result in run_moves(spark, tasks):
        report.queues.append(asdict(result))
        report.read += result.moved
        report.stored += result.moved - result.duplicates
        report.duplicates += result.duplicates
        report.bytes += result.bytes
        report.possible_duplicates += result.redelivered


def _run_snapshot(topology: Topology, plan: CopyPlan, spark: Any, report: CopyReport) -> None:
    """Each queue read by a task of its own without consuming it (held unacked, then requeued);
    into Parquet through Spark's writer, into a stream or a queue by the reading task itself."""
    src, dst = plan.source, plan.destination
    cluster_json, name = topology.rabbitmq(src.cluster or "").model_dump_json(), src.cluster or ""
    work = [x for x in plan.queues if x["ready"] > 0]
    if not work:
        return

    def read(x: dict[str, Any]) -> Any:
        return queue_io.snapshot_queue(RabbitCluster.model_validate_json(cluster_json), name, x["vhost"], x["queue"])

    if dst.kind == "parquet":
        frame = per_index(spark, len(work), lambda i: iterate(read(work[i])), SPARK_DDL)
        report.read, report.bytes = write_parquet(frame, Path(dst.path or ""), plan.backup_record())
        report.stored = report.read
        return
    specs = [_write_options(topology, dst, plan, len(work)) for _ in work]
    for spec, x in zip(specs, work, strict=True):
        if spec["kind"] == "rabbitmq":
            spec["cfg"] = replace(spec["cfg"], vhost=x["target_vhost"], queue=None if dst.exchange else x["target"])

    def copy(i: int) -> dict[str, Any]:
        async def go() -> dict[str, Any]:
            x, spec = work[i], specs[i]
            t0 = time.monotonic()
            async with contextlib.aclosing(read(x)) as batches:
                if spec["kind"] == "jetstream":
                    counts = await jetstream_writer.write_batches(spec["cfg"], batches)
                else:
                    counts = await queue_io.write_rows(spec["cfg"], batches)
            live = QueueCounts(RabbitCluster.model_validate_json(cluster_json))
            try:
                left = await live.ready(x["vhost"], x["queue"])  # all of it again: requeued
            finally:
                await live.close()
            moved = MoveResult(x["vhost"], x["queue"], x["ready"], counts.rows, counts.bytes, left=left)
            moved.seconds = time.monotonic() - t0
            return {**counts.as_dict(), "queue": json.dumps(asdict(moved))}

        return asyncio.run(go())

    schema = WriteCounts.arrow_schema().append(pa.field("queue", pa.string()))
    rows = per_task(spark, len(work), copy, schema)
    _add_counts(report, rows)
    report.queues += [json.loads(r["queue"]) for r in rows]


# -- progress: what the brokers say, polled on the driver ---------------------------------------------


def _watch(topology: Topology, plan: CopyPlan, progress: Callable[[int], None], stop: threading.Event) -> None:
    """Feed `progress` every half second with what the destination stream holds (or the source
    queues no longer hold) beyond what it did at the start, or else with what the source stream's
    readers delivered, on one connection kept open. A broker that does not answer leaves the bar
    where it is; the copy goes on."""
    with contextlib.suppress(Exception):
        asyncio.run(_observe(topology, plan, progress, stop))


async def _observe(topology: Topology, plan: CopyPlan, progress: Callable[[int], None], stop: threading.Event) -> None:
    src, dst = plan.source, plan.destination
    async with contextlib.AsyncExitStack() as stack:
        if dst.kind == "jetstream":
            cluster = topology.nats(dst.cluster or "", dst.account)
            nc = await stack.enter_async_context(bnats.session(cluster, name=dst.cluster or ""))

            async def count() -> int:
                return int((await nc.jsm().stream_info(dst.stream or "")).state.messages)

        elif src.kind == "rabbitmq":
            m = Management(topology.rabbitmq(src.cluster or ""), name=src.cluster or "")
            await stack.enter_async_context(m)

            async def count() -> int:
                left = 0
                for x in plan.queues:
                    item = await m.get(f"/queues/{q(x['vhost'])}/{q(x['queue'])}?columns=messages_ready")
                    left += int(item.get("messages_ready", 0))
                return -left

        elif src.kind == "jetstream":  # into Parquet or RabbitMQ: count what the copy's readers got
            from ferry.brokers.nats.jsapi import consumers

            cluster = topology.nats(src.cluster or "", src.account)
            nc = await stack.enter_async_context(bnats.session(cluster, name=src.cluster or ""))
            others = set(await consumers(nc, src.stream or ""))
            delivered: dict[str, int] = {}  # reader consumer -> messages it delivered (kept once it is gone)

            async def count() -> int:
                for name, c in (await consumers(nc, src.stream or "")).items():
                    if name not in others and c["config"].get("ack_policy") == "none":
                        delivered[name] = c["delivered"].get("consumer_seq") or 0
                return min(plan.messages, sum(delivered.values()))

        else:
            return
        base = await count()
        while not await asyncio.to_thread(stop.wait, 0.5):
            with contextlib.suppress(Exception):
                progress(max(0, await count() - base))
