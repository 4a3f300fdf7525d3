"""The relay (``ferry replicate run``): stands by, takes the lease at the destination, resumes from
what the destination holds, and relays with a Spark Structured Streaming query until stopped or
fenced; plus the Spark jobs that relay a range exactly once (a resume's replay, a fail-back's
reconciliation) and the relay's Prometheus gauges."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ferry.brokers import nats as bnats
from ferry.brokers import transient
from ferry.brokers.nats.reader import ReadConfig
from ferry.brokers.nats.writer import WriteConfig, write_batches
from ferry.errors import FerryError, NotFound
from ferry.headers import ORIGIN_SEQ_HDR, ORIGIN_SITE_HDR, ORIGIN_STREAM_HDR
from ferry.jobs.replicate.consumers import Checkpointer
from ferry.jobs.replicate.plan import (
    CONTROL,
    RELAY,
    Replication,
    account_flag,
    ensure_streams,
    first_line,
    in_account,
    lags,
    positions,
    site_cluster,
    site_journal,
    site_record,
    streams_at,
    took_over,
)
from ferry.jobs.shared.events import Emit, no_emit
from ferry.jobs.shared.metrics import serve_metrics
from ferry.journal import Lease, process_start
from ferry.spark.jetstream import stream_frame
from ferry.spark.options import COUNTS_DDL, on_executor
from ferry.spark.session import spark_error
from ferry.topology import NatsCluster, Topology

# messages per micro-batch (all streams). Between two micro-batches the relay idles about 0.13 s
# (Spark ends one, plans the next, starts its task): a relay catching up pays that every 5 s or
# so with 500,000 (a 1,000,000 backlog drained at 82,000-102,000 msg/s, median 91,700, against
# 79,000-89,000 with 100,000, bench/RESULTS.md). `status` reports a micro-batch's end as relayed,
# so a relay catching up shows progress every few seconds. When it keeps up, a micro-batch holds
# what arrived since the last one, whatever the bound.
MAX_BATCH = 500_000
TRIGGER = "200 milliseconds"
CHECKPOINT_PREFIX = "ferry-relay-"  # + pid: the relay's Spark checkpoint directory, in the temporary directory


# -- Spark jobs -------------------------------------------------------------------------------


def _write_cfg(topo: Topology, rep: Replication) -> WriteConfig:
    return WriteConfig(
        cluster=site_cluster(topo, rep.dest).model_dump_json(),
        name=rep.dest,
        origin_site=rep.source,
        origin_headers=False,
        subject_prefix=rep.subject_prefix,
    )


def _source_frame(spark: Any, topo: Topology, rep: Replication, stream: str, lo: int = 0, hi: int = 0) -> Any:
    """The source stream's own messages (no origin header) as a DataFrame."""
    from pyspark.sql import functions as F

    cfg = ReadConfig(
        cluster=site_cluster(topo, rep.source).model_dump_json(),
        name=rep.source,
        streams=(stream,),
        start_seq=lo or None,
        end_seq=hi or None,
    )
    return stream_frame(spark, cfg).where(F.col("headers")[ORIGIN_SITE_HDR].isNull())


def catch_up(spark: Any, topo: Topology, rep: Replication, stream: str, lo: int, hi: int, have: Any) -> int:
    """Relay the source's own messages with lo <= seq <= hi (hi 0: to the end) that are not in
    `have` (a DataFrame of ``source_seq``), in sequence order; the number relayed."""
    cfg = _write_cfg(topo, rep)

    def write(batches: Any) -> Any:
        with on_executor():
            counts = asyncio.run(write_batches(cfg, batches))
        yield counts.as_batch()

    todo = _source_frame(spark, topo, rep, stream, lo, hi).join(have, "source_seq", "left_anti")
    rows = todo.orderBy("source_seq").coalesce(1).mapInArrow(write, COUNTS_DDL).collect()
    return sum(r["stored"] + r["duplicates"] for r in rows)


def _held_frame(spark: Any, seqs: set[int]) -> Any:
    return spark.createDataFrame([(s,) for s in sorted(seqs)], "source_seq long")


def held_everywhere(spark: Any, topo: Topology, rep: Replication, stream: str) -> Any:
    """Every origin sequence of `stream` the destination holds (a Spark read of the whole stream)."""
    from pyspark.sql import functions as F

    h = F.col("headers")
    cfg = ReadConfig(
        cluster=site_cluster(topo, rep.dest).model_dump_json(), name=rep.dest, streams=(rep.dest_stream(stream),)
    )
    return (
        stream_frame(spark, cfg)
        .where((h[ORIGIN_SITE_HDR] == rep.source) & (h[ORIGIN_STREAM_HDR] == stream))
        .select(h[ORIGIN_SEQ_HDR].cast("long").alias("source_seq"))
        .distinct()
    )


def send_missing(spark: Any, topo: Topology, rep: Replication, stream: str) -> int:
    """Relay every message of the source's `stream` the destination does not hold yet."""
    return catch_up(spark, topo, rep, stream, 1, 0, held_everywhere(spark, topo, rep, stream))


_STARTS = itertools.count(1)


def start_query(
    spark: Any,
    topo: Topology,
    rep: Replication,
    after: dict[str, int],
    checkpoint: str,
    batched: bool = False,
    leaders: dict[str, str] | None = None,
) -> Any:
    """The relay: a streaming query over the source streams after `after`, one read task per stream
    per micro-batch, so each stream is relayed in its order (two tasks made a 10,000 msg/s cycle
    0.8 s instead of 1.5 s, but interleaved their ranges at the destination). Each read task publishes
    its range to the destination itself (``relay_to``) and yields only counts, so no message
    crosses the JVM. Measured here at 5,000 msg/s against a jetstream source -> jetstream sink
    pair: the JVM went from 40 % to 12 % of a core and the sink's Python worker (40 %) is gone.

    Spark writes its offset and commit logs asynchronously (``asyncProgressTrackingEnabled``,
    which the noop sink supports): written in line they took about 125 ms of every micro-batch
    and were the lag's floor (p99 1.08 s at 10,000 msg/s, 0.27 s without them). Async logs may
    lag the data after a crash, which costs nothing here: a relay never restarts from them.

    `batched`: every destination stream allows fast batch publishing (ferry creates them so).
    `leaders`: the server leading each source stream's destination stream, which its read task
    publishes to (no hop between servers for every message)."""
    name = f"ferry relay {rep.source} to {rep.dest}"
    for old in spark.streams.active:  # a lost lease's, still winding down (seen once the destination died)
        if (old.name or "").startswith(name):
            old.stop()
    # each start has a name of its own: a query stopped after its lease was lost could stay listed as
    # active (the name taken for the session's life; CI saw every later start refused for it)
    name += f" #{next(_STARTS)}"
    # an idle relay reports its progress every second (Spark's default: 10 s), so that `relaying`
    # and the lag figures come as soon as it waits for messages
    spark.conf.set("spark.sql.streaming.noDataProgressEventInterval", "1s")
    cfg = _write_cfg(topo, rep)
    relay_to = {
        "cluster": cfg.cluster,
        "cluster_name": rep.dest,
        "origin_site": rep.source,
        "origin_headers": "false",
        "subject_prefix": rep.subject_prefix,
        "batched": str(batched).lower(),
        "leaders": leaders or {},
    }
    return (
        spark.readStream.format("jetstream")
        .option("cluster", site_cluster(topo, rep.source).model_dump_json())
        .option("cluster_name", rep.source)
        .option("stream", ",".join(after))
        .option("starting", json.dumps(after))
        .option("max_messages_per_batch", MAX_BATCH)
        .option("relay_to", json.dumps(relay_to))
        .load()
        .writeStream.format("noop")
        .option("checkpointLocation", checkpoint)
        .option("asyncProgressTrackingEnabled", "true")
        .trigger(processingTime=TRIGGER)
        .queryName(name)
        .start()
    )


def _offsets(query: Any) -> dict[str, int] | None:
    """The source offsets of the last completed micro-batch."""
    progress = query.lastProgress
    if not progress:
        return None
    end = progress["sources"][0]["endOffset"]
    return {k: int(v) for k, v in (json.loads(end) if isinstance(end, str) else end).items()}


def _checkpoint() -> str:
    """A new directory for the relay's Spark checkpoint (no relay restarts from it), named by
    this process: one that a killed relay on this host left behind is removed first."""
    for old in Path(tempfile.gettempdir()).glob(f"{CHECKPOINT_PREFIX}*-*"):
        pid = old.name[len(CHECKPOINT_PREFIX) :].split("-")[0]
        if pid.isdigit() and process_start(int(pid)) is None:
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{CHECKPOINT_PREFIX}{os.getpid()}-")


class Relay:
    """One `ferry replicate run` process: stands by, takes the lease, resumes, relays."""

    def __init__(
        self,
        topo: Topology,
        source: str,
        dest: str,
        spark_factory: Callable[[], Any],
        lease: float = 5.0,
        emit: Emit = no_emit,
        metrics: Any = None,
        consumers: float = 3.0,
    ) -> None:
        self.topo, self.source, self.dest = topo, source, dest
        self.spark_factory, self.lease, self.emit, self.metrics = spark_factory, lease, emit, metrics
        self.consumers = consumers  # seconds between consumer checkpoints; 0: none
        self.spark: Any = None

    async def run(self) -> dict[str, Any]:
        key = Replication(self.source, self.dest).key
        async with site_journal(self.topo, self.dest, key, stale_after=max(1.0, self.lease - 1.0)) as j:
            state = await j.open()
            if state is None:
                raise NotFound(
                    f"no replication {self.source} -> {self.dest}{in_account(self.topo)}; "
                    "define it with `ferry replicate start`"
                )
            if state.get("desired") != "running":  # stopped before this relay began: nothing to stand by for
                self.emit("stopped", state=state.get("state"), hint=await self._restart_hint(state))
                return state
            self.spark = await asyncio.to_thread(self.spark_factory)  # warm while standing by
            leader, backoff = None, 2.0
            while True:
                try:
                    state = await j.open()
                except Exception as exc:  # the destination is unreachable: keep trying (not when refused)
                    if not transient(exc):
                        raise
                    self.emit("error", message=first_line(exc))
                    await asyncio.sleep(backoff)
                    backoff = min(30.0, backoff * 2)
                    continue
                if state is None or state.get("desired") != "running":
                    self.emit("stopped", state=(state or {}).get("state"))
                    return state or {}
                owner = state.get("owner")
                if owner and owner != j.owner() and j.owner_alive(state):
                    if owner != leader:
                        self.emit("standby", leader=owner)
                        leader = owner
                    if self.metrics:
                        self.metrics.active = False
                    await asyncio.sleep(0.5)
                    continue
                leader = None
                j.state = state
                resuming = RELAY.step(state.get("state"), "resuming")  # a state on record that cannot resume stops here
                try:
                    takeovers = state.get("takeovers", 0) + (owner is not None)
                    await j.save(state=resuming, error=None, takeovers=takeovers, lease=self.lease)
                except Exception:  # taken by another standby first, or the KV did not answer
                    await asyncio.sleep(0.5)
                    continue
                self.emit("active", previous=owner)
                lease = Lease(j, min(1.0, self.lease / 5))
                beat = asyncio.create_task(lease.beat())
                try:
                    await self._active(lease)  # until stopped or the lease is lost; the loop decides
                    backoff = 2.0
                except Exception as exc:  # a relay keeps trying: the source may come back
                    self.emit("error", message=first_line(exc))
                    failed = RELAY.step(j.state.get("state"), "failed")
                    await lease.save(release=True, state=failed, error=first_line(exc))
                    await asyncio.sleep(backoff)
                    backoff = min(30.0, backoff * 2)
                finally:
                    beat.cancel()

    async def _restart_hint(self, state: dict[str, Any]) -> str:
        """How to relay again: fail back if the destination took over from the source, else start
        the replication again with the same settings (its stop marker then stays)."""
        with contextlib.suppress(Exception):
            if took_over(await site_record(self.topo, self.dest), self.dest, self.source):
                back = f"ferry site failback --to {self.source}{account_flag(self.topo.account)}"
                return f"{self.dest} took over from {self.source}: `{back}` once {self.source} is back"
        rep = Replication.from_state({**asdict(Replication(self.source, self.dest)), **state})
        return f"`{rep.start_command(self.topo.account)}` starts it again"

    async def _active(self, lease: Lease) -> str:
        """Relay until stopped ("stopped") or the lease is lost ("lost")."""
        j = lease.j
        rep = Replication.from_state(j.state)
        streams = await streams_at(site_cluster(self.topo, rep.source), rep.streams, rep.source)
        created, batched, leaders = await ensure_streams(self.topo, rep, streams)
        marker = j.state.get("marker") or {}
        if set(streams) <= set(marker):
            after, replayed, how = {s: int(marker[s]) for s in streams}, 0, "marker"
        else:
            t0 = time.monotonic()
            found = await positions(self.topo, rep, streams, _floors(j.state))
            after, replayed, how = {s: h.last for s, h in found.items()}, 0, "destination"
            for s, h in found.items():
                if (holes := h.holes()) and not lease.lost.is_set():
                    replayed += await asyncio.to_thread(self._replay, rep, s, holes, h.seqs)
            self.emit("replayed", messages=replayed, seconds=round(time.monotonic() - t0, 2))
        if lease.lost.is_set():
            return "lost"
        self.emit("resume", source=how, after=after, created=created, batched=batched)
        j.state["progress"] = {s: {"relayed": n} for s, n in after.items()}
        j.state["progress_at"] = time.time()
        relaying = RELAY.step(j.state.get("state"), "relaying")
        await lease.save(state=relaying, marker=None, resumed_after=after, replayed=replayed, since=time.time())
        checkpoint = _checkpoint()
        query = await asyncio.to_thread(start_query, self.spark, self.topo, rep, after, checkpoint, batched, leaders)
        tracker, warm = _Progress(self.topo, rep, after), False
        checkpoints = asyncio.create_task(self._checkpoints(j, rep, tracker, streams)) if self.consumers else None
        try:
            while not lease.lost.is_set():
                if lease.stop_requested.is_set():
                    await asyncio.to_thread(query.stop)
                    await self._stop_marker(lease, rep, streams)
                    return "stopped"
                if not query.isActive:
                    failed = query.exception()  # its first line is Spark's, the cause is the task's last
                    raise FerryError(
                        f"the relay's Spark query failed: {spark_error(failed) if failed else 'it stopped'}"
                    )
                offsets = _offsets(query)
                if offsets is not None and not warm:
                    warm = True
                    self.emit("relaying")  # the first micro-batch is done: Spark's workers are up
                j.state["progress"] = await tracker.update(offsets)
                j.state["progress_at"] = time.time()  # saved with the next heartbeat
                if self.metrics:
                    self.metrics.update(rep, j.state["progress"], j.state.get("consumers"))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(lease.stop_requested.wait(), 1.0)
            self.emit("lost", owner=(await j.open() or {}).get("owner"))
            return "lost"
        finally:
            if checkpoints:
                checkpoints.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await checkpoints
            if query.isActive:
                await asyncio.to_thread(query.stop)
            shutil.rmtree(checkpoint, ignore_errors=True)
            await tracker.close()

    async def _checkpoints(self, j: Any, rep: Replication, tracker: _Progress, streams: list[str]) -> None:
        """Consumer checkpoints while the relay relays, each started early by twice the last one's
        duration, so that the one on record is never older than the interval (its consumers' acks
        since then are what a failover delivers again)."""
        checkpoint = Checkpointer(rep.source, site_cluster(self.topo, rep.dest), rep.dest, rep.dest_stream,
                                  rep.subject_prefix)  # fmt: skip
        error = ""
        while not tracker.nc:  # the source's connection, made by the relay's first progress update
            await asyncio.sleep(0.1)
        while True:
            t0 = time.monotonic()
            try:
                j.state["consumers"] = await checkpoint(tracker.nc, j.nc, streams)
                j.state["consumers_at"], error = time.time(), ""
            except Exception as exc:  # relaying goes on; the copies stay where they were
                if first_line(exc) != error:  # said once while it fails the same way
                    error = first_line(exc)
                    self.emit("error", message=f"consumer checkpoint: {error}")
            took = time.monotonic() - t0
            await asyncio.sleep(max(0.0, self.consumers - 2 * took))

    def _replay(self, rep: Replication, stream: str, holes: tuple[int, int], seqs: set[int]) -> int:
        return catch_up(self.spark, self.topo, rep, stream, *holes, _held_frame(self.spark, seqs))

    async def _stop_marker(self, lease: Lease, rep: Replication, streams: list[str]) -> None:
        """After a graceful stop: the exact position per stream, unless something is missing below it."""
        await _settle(site_cluster(self.topo, rep.dest), rep.dest, [rep.dest_stream(s) for s in streams])
        found = await positions(self.topo, rep, streams, _floors(lease.j.state))
        exact = all(h.holes() is None for h in found.values())
        marker = {s: h.last for s, h in found.items()} if exact else None
        stopped = RELAY.step(lease.j.state.get("state"), "stopped")
        await lease.save(release=True, state=stopped, marker=marker)
        self.emit("stopped", marker=marker)


def _floors(state: dict[str, Any]) -> dict[str, int]:
    """Per stream, the end of the last micro-batch a relay finished (all of it acked downstream)."""
    return {s: int(p["relayed"]) for s, p in (state.get("progress") or {}).items() if p.get("relayed")}


async def _settle(cluster: NatsCluster, site: str, streams: list[str], quiet: float = 0.5, limit: float = 5.0) -> None:
    """Wait until the streams' last sequences stop moving (late publishes of a stopped query)."""
    async with bnats.session(cluster, name=site, client_name=CONTROL) as nc:
        jsm, last, deadline = nc.jsm(), None, time.monotonic() + limit
        while time.monotonic() < deadline:
            now = [(await jsm.stream_info(s)).state.last_seq for s in streams]
            if now == last:
                return
            last = now
            await asyncio.sleep(quiet)


class _Progress:
    """Per stream: last relayed origin sequence, lag in messages and seconds, rate."""

    def __init__(self, topo: Topology, rep: Replication, after: dict[str, int]) -> None:
        self.cluster, self.site = site_cluster(topo, rep.source), rep.source
        self.relayed = dict(after)
        self.then = (time.monotonic(), dict(after))
        self.nc: Any = None  # one connection to the source for the relay's life (it reconnects by itself)

    async def close(self) -> None:
        if self.nc:
            with contextlib.suppress(Exception):
                await self.nc.close()

    async def update(self, offsets: dict[str, int] | None) -> dict[str, dict[str, Any]]:
        if offsets:
            self.relayed.update(offsets)
        t0, before = self.then
        now = time.monotonic()
        self.then = (now, dict(self.relayed))
        out: dict[str, dict[str, Any]] = {}
        try:
            self.nc = self.nc or await bnats.connect(self.cluster, name=self.site, client_name=CONTROL, timeout=2)
            out = await lags(self.nc, self.relayed)
        except Exception:  # the source is unreachable: lag unknown
            out = {s: {"relayed": r, "source_last": None, "lag": None, "lag_s": None} for s, r in self.relayed.items()}
        for s, row in out.items():
            row["rate"] = round((self.relayed[s] - before.get(s, 0)) / max(now - t0, 1e-6), 1)
        return out


class Metrics:
    """The relay's own Prometheus families, served on ``port``: the live figures only the running
    relay knows, under the names ``ferry serve``'s ``/metrics`` uses for what it reads from the
    journal (``dashboards/ferry.json`` relies on them)."""

    def __init__(self, port: int | None, account: str | None = None) -> None:
        self.rep: Replication | None = None
        self.account = account or ""  # the label of a replication in another NATS account
        self.progress: dict[str, dict[str, Any]] = {}
        self.consumers: list[dict[str, Any]] = []
        self.active = False
        if port is not None:  # None: the families only (their names are checked against the dashboard)
            serve_metrics(self, port)

    def update(
        self, rep: Replication, progress: dict[str, dict[str, Any]], consumers: list[dict[str, Any]] | None = None
    ) -> None:
        self.rep, self.progress, self.active = rep, dict(progress), True
        self.consumers = consumers or []

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        fams = RelayFamilies()
        rate = GaugeMetricFamily("ferry_relay_rate", "Source sequences relayed per second", labels=fams.LABELS)
        if self.rep:
            at = [self.account, self.rep.source, self.rep.dest]
            fams.active.add_metric(at, 1.0 if self.active else 0.0)
            for stream, p in sorted(self.progress.items()):
                fams.add(at, stream, p)
                rate.add_metric([*at, stream], float(p["rate"]))
            fams.add_consumers(at, self.consumers, time.time())
        yield from (*fams, rate)


class RelayFamilies:
    """The ``ferry_relay_*`` families, as a relay serves them and as ``ferry serve`` does from the
    journals (one definition of their names and help). ``account``: the NATS account of a
    replication of another account than the default (empty, which Prometheus reads as absent, for
    the default's)."""

    LABELS = ["account", "from", "to", "stream"]

    def __init__(self) -> None:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.relayed = CounterMetricFamily("ferry_relay_relayed", "Last source sequence relayed", labels=self.LABELS)
        self.lag = GaugeMetricFamily(
            "ferry_relay_lag_messages", "Source messages the relay has yet to relay", labels=self.LABELS
        )
        self.lag_s = GaugeMetricFamily(
            "ferry_relay_lag_seconds", "Age of the oldest message the relay has yet to relay", labels=self.LABELS
        )
        self.active = GaugeMetricFamily(
            "ferry_relay_active", "1 while a live relay holds the replication's lease", labels=self.LABELS[:3]
        )
        by_consumer = [*self.LABELS, "consumer"]
        self.consumer_floor = GaugeMetricFamily(
            "ferry_relay_consumer_ack_floor", "A durable consumer's ack floor at the source", labels=by_consumer
        )
        self.consumer_position = GaugeMetricFamily(
            "ferry_relay_consumer_position",
            "The destination sequence the consumer's copy delivers from (its translated ack floor + 1)",
            labels=by_consumer,
        )
        self.consumer_age = GaugeMetricFamily(
            "ferry_relay_consumer_checkpoint_age_seconds",
            "Age of the consumer's last checkpoint (what a failover may deliver again is this long of its acks)",
            labels=by_consumer,
        )
        self.consumer_carried = GaugeMetricFamily(
            "ferry_relay_consumer_carried",
            "1 while the consumer's copy follows it; 0 when the destination refused the copy or its filter "
            "matches none of the stream's subjects (replicate status says why)",
            labels=by_consumer,
        )

    def add(self, replication: list[str], stream: str, p: dict[str, Any]) -> None:
        """One stream's progress (``relayed``, ``lag``, ``lag_s``; a lag None is unknown: left out)
        in `replication` (its account, source and destination)."""
        at = [*replication, stream]
        self.relayed.add_metric(at, float(p.get("relayed") or 0))
        if p.get("lag") is not None:
            self.lag.add_metric(at, float(p["lag"]))
            self.lag_s.add_metric(at, float(p.get("lag_s") or 0))

    def add_consumers(self, replication: list[str], rows: list[dict[str, Any]], now: float) -> None:
        """The consumers of the last checkpoint (a relay journal's ``consumers``)."""
        for c in rows:
            at = [*replication, c["stream"], c["consumer"]]
            self.consumer_floor.add_metric(at, float(c["ack_floor"]))
            if "refused" not in c:
                self.consumer_position.add_metric(at, float(c["position"]))
            self.consumer_age.add_metric(at, max(0.0, now - float(c["at"])))
            self.consumer_carried.add_metric(at, 0.0 if "refused" in c or "unmatched" in c else 1.0)

    def __iter__(self) -> Any:
        consumers = (self.consumer_floor, self.consumer_position, self.consumer_age, self.consumer_carried)
        return iter((self.relayed, self.lag, self.lag_s, self.active, *consumers))


def count_after(spark: Any, topo: Topology, rep: Replication, stream: str, after: int) -> int:
    """The source's own messages after sequence `after`."""
    return int(_source_frame(spark, topo, rep, stream, after + 1).count())
