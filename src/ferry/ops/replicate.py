"""Cross-site replication (`ferry replicate`) and site failover / fail-back (`ferry site`).

The design is JGroups' RELAY on JetStream:

- A **replication** FROM -> TO relays, for every stream of site FROM matching a glob, the
  messages first stored at FROM (those without a ``Ferry-Origin-Site`` header) to the stream
  of the same name at TO (or a mapped name, with an optional subject prefix). Each relayed
  message gets ``Ferry-Origin-Site``, ``-Stream``, ``-Seq`` and ``-Msg-Id`` and is published
  with a deterministic ``Nats-Msg-Id`` (its own, else ``<site>/<stream>:<seq>``). A message
  that already carries an origin is never relayed again, so FROM <-> TO both ways has no cycle.
- The relay is a Spark Structured Streaming query (jetstream source -> jetstream sink).
- Its definition, lease and progress live **at the destination**, key ``relay.FROM.TO`` of
  the ``ferry_ops`` KV bucket. ``ferry replicate run`` may run on several machines: the one
  holding the lease relays, the others stand by and take over once its heartbeat is older
  than the lease (sooner on the same host, where a dead pid is seen at once).
- **Resume point**: a relay that takes over asks the destination which origin sequences it
  holds near its end (the last ``SCAN`` relayed messages at least), starts after the highest,
  and first re-relays the few below it that are missing (a dead relay's unacked publishes).
  Relaying waits until that replay is done. No Spark checkpoint survives a run, so there is
  none to lose or mix up: the destination is the only truth.
- A graceful ``ferry replicate stop`` makes the relay stop its query and write a stop
  **marker** (the exact position per stream); its successor starts there without the scan.
- **Site failover** (``ferry site failover --to sfo``) fences and stops nyc -> sfo, records
  the last nyc sequence sfo holds per stream, and makes sfo the primary. **Fail-back**
  (``ferry site failback --to nyc``) reconciles both sides by origin sequence (Spark
  anti-joins): what nyc acked but never relayed before it failed (the RPO) goes to sfo, what
  was written at sfo meanwhile goes to nyc, each exactly once; then nyc -> sfo is defined again.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import os
import shlex
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ferry.brokers import nats as bnats
from ferry.errors import ConfigError, Conflict, FerryError, NotFound, UsageError, redact
from ferry.ops.journal import Journal, owner_alive, process_start
from ferry.ops.move import paged
from ferry.pipeline import jetstream as js
from ferry.pipeline._common import COUNTS_DDL
from ferry.pipeline.spark import spark_error
from ferry.publish import ORIGIN_SEQ_HDR, ORIGIN_SITE_HDR, ORIGIN_STREAM_HDR
from ferry.subjects import problem, stream_name_problem
from ferry.topology import NatsCluster, Topology

__all__ = ["Relay", "Replication", "failback", "failover", "start", "status", "stop"]

Emit = Callable[..., None]
CONTROL = "ferry-relay"
SCAN = 20_000  # relayed messages read back from the destination's end when resuming
# messages per micro-batch (all streams). Between two micro-batches the relay idles about 0.13 s
# (Spark ends one, plans the next, starts its task): a relay catching up pays that every 5 s or
# so with 500,000 (a 1,000,000 backlog drained at 82,000-102,000 msg/s, median 91,700, against
# 79,000-89,000 with 100,000, bench/RESULTS.md). `status` reports a micro-batch's end as relayed,
# so a relay catching up shows progress every few seconds. When it keeps up, a micro-batch holds
# what arrived since the last one, whatever the bound.
MAX_BATCH = 500_000
TRIGGER = "200 milliseconds"
CHECKPOINT_PREFIX = "ferry-relay-"  # + pid: the relay's Spark checkpoint directory, in the temporary directory
PROGRESS_STALE = 10.0  # seconds: older progress of a live relay shows no current rate in `status`


def _quiet(*_: Any, **__: Any) -> None:
    pass


@dataclass
class Replication:
    """What relays where; stored at the destination with the lease and progress."""

    source: str  # site names
    dest: str
    streams: str = "*"  # glob over the source's stream names
    subject_prefix: str = ""
    stream_name: str = "{stream}"  # destination name template

    @property
    def key(self) -> str:
        return f"relay.{self.source}.{self.dest}"

    def dest_stream(self, stream: str) -> str:
        return self.stream_name.format(stream=stream)

    @property
    def mapped(self) -> bool:
        return bool(self.subject_prefix) or self.stream_name != "{stream}"

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Replication:
        return cls(**{k: state[k] for k in ("source", "dest", "streams", "subject_prefix", "stream_name")})

    def start_command(self) -> str:
        """The ``ferry replicate start`` that defines this replication (its options other than the defaults)."""
        words = ["ferry", "replicate", "start", "--from", self.source, "--to", self.dest]
        for f in fields(self)[2:]:  # streams, subject_prefix, stream_name: options of the same names
            if getattr(self, f.name) != f.default:
                words += ["--" + f.name.replace("_", "-"), getattr(self, f.name)]
        return shlex.join(words)


def _cluster(topo: Topology, site: str) -> NatsCluster:
    try:
        return topo.nats(site)
    except Exception as exc:
        raise UsageError(f"site {site!r}: {exc}") from None


def _session(topo: Topology, site: str, timeout: float = 5.0) -> contextlib.AbstractAsyncContextManager[Any]:
    """A connection to `site`, whose errors name it."""
    return bnats.session(_cluster(topo, site), name=site, client_name=CONTROL, timeout=timeout)


def _check(topo: Topology, rep: Replication) -> None:
    if rep.source == rep.dest:
        raise UsageError("--from and --to must be different sites")
    for site in (rep.source, rep.dest):
        _cluster(topo, site)
    try:
        ok = "{stream}" in rep.stream_name and bool(rep.stream_name.format(stream="S"))
    except (KeyError, IndexError, ValueError):
        ok = False
    if not ok:
        raise UsageError("--stream-name must contain {stream} and no other {...}")
    if why := stream_name_problem(rep.stream_name.format(stream="S")):
        raise UsageError(f"--stream-name {rep.stream_name!r}: {why}")
    if rep.subject_prefix and (why := problem(rep.subject_prefix + "x", literal=True)):
        raise UsageError(f"--subject-prefix {rep.subject_prefix!r} makes no valid subject: {why}")


def replicable(names: list[str], glob: str) -> list[str]:
    """The streams of `names` that `glob` picks: not KV buckets (ferry's journals among them) nor the
    server's own streams ($MQTT_sess, ...), which each site has for itself."""
    return sorted(n for n in names if fnmatch.fnmatchcase(n, glob) and not n.startswith(("KV_", "$")))


async def _streams(cluster: NatsCluster, glob: str, site: str) -> list[str]:
    async with bnats.session(cluster, name=site, client_name=CONTROL) as nc:
        names = [n async for n in paged(nc, "$JS.API.STREAM.NAMES", "streams")]
    found = replicable(names, glob)
    if not found:
        raise NotFound(f"no stream at {site} matches {glob!r}")
    return found


async def _ensure_streams(
    topo: Topology, rep: Replication, streams: list[str]
) -> tuple[list[str], bool, dict[str, str]]:
    """Create the destination streams that are missing, like their sources (allowing fast batch
    publishing): the names created, whether every destination stream allows batches, and the
    server that leads each one (by source stream), for the relay's connections."""
    from nats.js.api import RetentionPolicy
    from nats.js.errors import APIError, NotFoundError

    created, batched, leaders = [], True, {}
    async with (
        _session(topo, rep.source) as snc,
        _session(topo, rep.dest) as dnc,
    ):
        for stream in streams:
            name = rep.dest_stream(stream)
            try:
                info = await dnc.jsm().stream_info(name)
            except NotFoundError:
                config = (await snc.jsm().stream_info(stream)).config
                config.name = name
                config.subjects = [rep.subject_prefix + s for s in config.subjects or []]
                config.placement, config.mirror, config.sources = None, None, None
                config.retention = RetentionPolicy.LIMITS
                config.allow_batched = True  # so that the relay can publish in fast batches
                try:
                    info = await dnc.jsm().add_stream(config)
                except APIError as exc:
                    raise FerryError(f"cannot create {name} at {rep.dest}: {exc.description}") from None
                created.append(name)
            config, leaders[stream] = info.config, bnats.leader_of(info)
            batched = batched and bool(config.allow_batched)  # servers before 2.14 drop the setting
            if config.retention != RetentionPolicy.LIMITS:
                # the resume point is read from what the destination holds: it must not delete on its own
                raise UsageError(f"{name} at {rep.dest} must have limits retention (it has {config.retention})")
    return created, batched, leaders


# -- where the destination is ----------------------------------------------------------------


@dataclass
class Held:
    """Origin sequences of one source stream that the destination holds near its end."""

    seqs: set[int] = field(default_factory=set)
    whole: bool = False  # the scan read the whole destination stream
    floor: int = 0  # relayed for sure (a finished micro-batch's end): no hole at or below it

    @property
    def last(self) -> int:
        return max(self.floor, max(self.seqs, default=0))

    def holes(self) -> tuple[int, int] | None:
        """(lo, hi), the origin range to re-check for holes below `last`; None when there is none."""
        lo = max(self.floor + 1, 1 if self.whole or not self.seqs else min(self.seqs))
        wanted = self.last - lo + 1
        return (lo, self.last) if wanted > 0 and len([x for x in self.seqs if x >= lo]) < wanted else None


async def held(cluster: NatsCluster, site: str, stream: str, origin: str, origin_stream: str) -> Held:
    """Read the destination stream backwards until SCAN messages from (origin, origin_stream) are seen."""
    out = Held()
    async with bnats.session(cluster, name=site, client_name=CONTROL) as nc:
        st = (await nc.jsm().stream_info(stream)).state
    cfg = js.ReadConfig(cluster=cluster.model_dump_json(), name=site, streams=(stream,))
    hi, window = st.last_seq, 5_000
    while hi >= max(st.first_seq, 1) and len(out.seqs) < SCAN:
        lo = max(st.first_seq, 1, hi - window + 1)
        async for batch in js.read_range(cfg, js.Range(stream, lo, hi, 2_000)):
            for headers in batch.column("headers").to_pylist():
                h = dict(headers or ())
                if h.get(ORIGIN_SITE_HDR) == origin and h.get(ORIGIN_STREAM_HDR) == origin_stream:
                    out.seqs.add(int(h[ORIGIN_SEQ_HDR]))
        hi, window = lo - 1, window * 2
    out.whole = hi < max(st.first_seq, 1)
    return out


async def positions(
    topo: Topology, rep: Replication, streams: list[str], floors: dict[str, int] | None = None
) -> dict[str, Held]:
    cluster = _cluster(topo, rep.dest)
    out = {s: await held(cluster, rep.dest, rep.dest_stream(s), rep.source, s) for s in streams}
    for s, h in out.items():
        h.floor = (floors or {}).get(s, 0)
    return out


# -- Spark jobs -------------------------------------------------------------------------------


def _write_cfg(topo: Topology, rep: Replication) -> js.WriteConfig:
    return js.WriteConfig(
        cluster=_cluster(topo, rep.dest).model_dump_json(),
        name=rep.dest,
        origin_site=rep.source,
        origin_headers=False,
        subject_prefix=rep.subject_prefix,
    )


def _source_frame(spark: Any, topo: Topology, rep: Replication, stream: str, lo: int = 0, hi: int = 0) -> Any:
    """The source stream's own messages (no origin header) as a DataFrame."""
    from pyspark.sql import functions as F

    cfg = js.ReadConfig(
        cluster=_cluster(topo, rep.source).model_dump_json(),
        name=rep.source,
        streams=(stream,),
        start_seq=lo or None,
        end_seq=hi or None,
    )
    return js.stream_frame(spark, cfg).where(F.col("headers")[ORIGIN_SITE_HDR].isNull())


def catch_up(spark: Any, topo: Topology, rep: Replication, stream: str, lo: int, hi: int, have: Any) -> int:
    """Relay the source's own messages with lo <= seq <= hi (hi 0: to the end) that are not in
    `have` (a DataFrame of ``source_seq``), in sequence order; the number relayed."""
    cfg = _write_cfg(topo, rep)

    def write(batches: Any) -> Any:
        yield asyncio.run(js.write_batches(cfg, batches)).as_batch()

    todo = _source_frame(spark, topo, rep, stream, lo, hi).join(have, "source_seq", "left_anti")
    rows = todo.orderBy("source_seq").coalesce(1).mapInArrow(write, COUNTS_DDL).collect()
    return sum(r["stored"] + r["duplicates"] for r in rows)


def _held_frame(spark: Any, seqs: set[int]) -> Any:
    return spark.createDataFrame([(s,) for s in sorted(seqs)], "source_seq long")


def held_everywhere(spark: Any, topo: Topology, rep: Replication, stream: str) -> Any:
    """Every origin sequence of `stream` the destination holds (a Spark read of the whole stream)."""
    from pyspark.sql import functions as F

    h = F.col("headers")
    cfg = js.ReadConfig(
        cluster=_cluster(topo, rep.dest).model_dump_json(), name=rep.dest, streams=(rep.dest_stream(stream),)
    )
    return (
        js.stream_frame(spark, cfg)
        .where((h[ORIGIN_SITE_HDR] == rep.source) & (h[ORIGIN_STREAM_HDR] == stream))
        .select(h[ORIGIN_SEQ_HDR].cast("long").alias("source_seq"))
        .distinct()
    )


def _send_missing(spark: Any, topo: Topology, rep: Replication, stream: str) -> int:
    """Relay every message of the source's `stream` the destination does not hold yet."""
    return catch_up(spark, topo, rep, stream, 1, 0, held_everywhere(spark, topo, rep, stream))


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
        .option("cluster", _cluster(topo, rep.source).model_dump_json())
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
        .queryName(f"ferry relay {rep.source} to {rep.dest}")
        .start()
    )


def _offsets(query: Any) -> dict[str, int] | None:
    """The source offsets of the last completed micro-batch."""
    progress = query.lastProgress
    if not progress:
        return None
    end = progress["sources"][0]["endOffset"]
    return {k: int(v) for k, v in (json.loads(end) if isinstance(end, str) else end).items()}


# -- the journal at the destination -----------------------------------------------------------


@contextlib.asynccontextmanager
async def _journal(topo: Topology, site: str, key: str, stale_after: float = 10.0) -> Any:
    async with _session(topo, site) as nc:
        j = Journal(nc, key, stale_after=stale_after)
        await j.open()
        yield j


async def _write_fields(j: Journal, **changes: Any) -> dict[str, Any]:
    """Change fields of the key without taking ownership (a request to its owner); CAS, retried."""
    from nats.js.errors import KeyWrongLastSequenceError

    for _ in range(20):
        state = await j.open()
        if state is None:
            raise NotFound(f"nothing is defined under {j.key!r} (no such replication)")
        state.update(changes)
        try:
            j.revision = await j.kv.update(j.key, json.dumps(state).encode(), last=j.revision)
            return state
        except KeyWrongLastSequenceError:
            continue
    raise Conflict(f"{j.key} keeps changing; try again")


async def start(topo: Topology, rep: Replication, dry_run: bool = False, keep_marker: bool = True) -> dict[str, Any]:
    """Define (or re-enable) a replication at its destination; create missing destination streams.

    A stop marker of the same replication is kept (the relay starts there) unless `keep_marker` is
    False (something else wrote to the destination since: it must be scanned)."""
    _check(topo, rep)
    streams = await _streams(_cluster(topo, rep.source), rep.streams, rep.source)
    dest_streams = {s: rep.dest_stream(s) for s in streams}
    if dry_run:  # read without creating the journal's bucket
        return {
            "dry_run": True,
            **asdict(rep),
            "dest_streams": dest_streams,
            "already": _running(await _peek(topo, rep), rep),
        }
    async with _journal(topo, rep.dest, rep.key) as j:
        state = await j.open()
        if _running(state, rep):
            created = (await _ensure_streams(topo, rep, streams))[0]
            return {**state, "dest_streams": dest_streams, "created": created, "already": True}
        if state and j.owner_alive(state):
            raise Conflict(f"the relay {rep.source} -> {rep.dest} is still stopping; try again in a few seconds")
        created, *_ = await _ensure_streams(topo, rep, streams)
        state = state or {"state": "defined"}
        new = {**state, **asdict(rep), "desired": "running"}
        if "source" in state and Replication.from_state(state) != rep:
            new["marker"], new["progress"] = None, None  # positions in other streams
        elif not keep_marker:
            new["marker"] = None
        j.state = new
        await j.save(release=True)
    return {**new, "dest_streams": dest_streams, "created": created}


def _running(state: dict[str, Any] | None, rep: Replication) -> bool:
    """Whether `state` is `rep` started; raises if another replication between its sites is."""
    if not state or state.get("desired") != "running":
        return False
    if Replication.from_state(state) != rep:
        raise Conflict(f"replication {rep.source} -> {rep.dest} is already running with other settings; stop it first")
    return True


async def _peek(topo: Topology, rep: Replication) -> dict[str, Any] | None:
    """`rep`'s journal state at its destination, read without creating the bucket."""
    async with _session(topo, rep.dest) as nc:
        return await Journal(nc, rep.key).open(create=False)


async def stop(topo: Topology, source: str, dest: str, wait: float = 30.0, force: bool = False) -> dict[str, Any]:
    """Ask the active relay to stop gracefully (it writes a stop marker); without one, mark it stopped."""
    key = Replication(source, dest).key
    async with _journal(topo, dest, key) as j:
        state = await _write_fields(j, desired="stopped")
        deadline = time.monotonic() + wait
        while j.owner_alive(state) and state.get("state") != "stopped":
            if time.monotonic() > deadline:
                if not force:
                    raise FerryError(f"the relay {source} -> {dest} did not stop within {wait:.0f}s")
                break
            await asyncio.sleep(0.3)
            state = await j.open() or {}
        if state.get("state") != "stopped" or j.owner_alive(state):
            # nobody (alive) relays, or forced: fence the owner out; the next start scans
            state = await _write_fields(j, state="stopped", owner=None, marker=None)
        return state


async def status(topo: Topology) -> list[dict[str, Any]]:
    """Every replication defined at any reachable NATS site, with its progress.

    A row keeps the journal's fields: ``desired`` is what the operator asked for ("running" once
    started, "stopped"), ``state`` the last one a relay or command wrote, which may be a dead relay's.
    What actually happens is added: ``live`` (a relay holds the lease with a fresh heartbeat; then
    ``leader`` is it, else None), ``heartbeat_age_s`` (the live leader's), ``relay`` ("running",
    "resuming", "stopping" or "none"), ``intent`` ("started" or "stopped") and ``summary`` (one line
    for people, e.g. ``started, no relay running`` or ``running (leader h:1, heartbeat 0.4 s ago)``).
    Per stream ``rate`` is the live relay's only; without one it is None and the last relay's is
    ``last_rate``, measured ``progress_age_s`` seconds ago (a row field), while the backlog
    (``lag``, ``lag_s``, ``source_last``) is read from the source now (``lag_at``)."""
    out = []
    for site, name, cluster in topo.clusters():
        if not isinstance(cluster, NatsCluster) or name != site:
            continue
        try:
            async with _journal(topo, site, "") as j:
                for key in sorted(await j.keys(["relay.*.*"])):
                    state = await j.get(key) or {}
                    out.append(_status_row(state, time.time()))
        except Exception as exc:  # one unreachable site must not hide the others
            out.append({"dest": site, "unreachable": _first_line(exc)})
    for row in out:
        if row.get("progress") and not any(p.get("rate") is not None for p in row["progress"].values()):
            await _lag_now(topo, row)
    return out


async def _lag_now(topo: Topology, row: dict[str, Any]) -> None:
    """Without a relay reporting, the backlog keeps growing at the source: read it there now
    (``lag_at`` "now"), instead of showing the last relay's figures (left as they were, with
    ``lag_at`` "last relay", when the source does not answer). A graceful stop's marker is the
    exact position (the last progress report may be a second older)."""
    marker = row.get("marker") or {}
    relayed = {s: int(marker.get(s) or p.get("relayed") or 0) for s, p in row["progress"].items()}
    try:
        async with _session(topo, row["source"], timeout=2) as nc:
            fresh = await _lags(nc, relayed)
    except Exception:
        for p in row["progress"].values():
            p["lag_at"] = "last relay"
        return
    for s, p in row["progress"].items():
        p.update(fresh[s], lag_at="now")


def _status_row(state: dict[str, Any], now: float) -> dict[str, Any]:
    """`state` (a journal record) with what is actually happening: see `status`."""
    lease = state.get("lease")
    live = owner_alive(state, max(1.0, float(lease) - 1.0) if lease else 10.0)  # as standbys see it
    started = state.get("desired") == "running"
    row: dict[str, Any] = {**state, "leader": state.get("owner") if live else None, "live": live}
    row["intent"] = "started" if started else "stopped"
    row["heartbeat_age_s"] = round(max(0.0, now - float(state.get("heartbeat") or 0)), 1) if live else None
    recorded = state.get("state")
    if not live:
        row["relay"] = "none"
        if started:
            row["summary"] = "started, no relay running"
            if recorded == "failed" and state.get("error"):
                row["summary"] += f" (the last one failed: {state['error']})"
            elif recorded in ("resuming", "relaying"):
                row["summary"] += " (the last one died or was cut off)"
        else:
            row["summary"] = "stopped" if recorded in ("stopped", "defined", None) else f"stopped ({recorded})"
    else:
        row["relay"] = "stopping" if not started else "running" if recorded == "relaying" else "resuming"
        o = state.get("owner") or {}
        who = f"leader {o.get('host', '?')}:{o.get('pid', '?')}, heartbeat {row['heartbeat_age_s']} s ago"
        row["summary"] = f"started, relay resuming ({who})" if row["relay"] == "resuming" else f"{row['relay']} ({who})"
    at = state.get("progress_at") or (state.get("heartbeat") if live else None)
    row["progress_age_s"] = round(max(0.0, now - float(at)), 1) if at and state.get("progress") else None
    current = live and row["relay"] == "running" and (row["progress_age_s"] or 0) <= PROGRESS_STALE
    if state.get("progress"):  # the last relay's; its rate is a current one only while it relays
        row["progress"] = {s: dict(p or {}) for s, p in state["progress"].items()}
        for p in row["progress"].values():
            if "rate" in p:
                p["last_rate"] = p["rate"]
                p["rate"] = p["rate"] if current else None
    return row


# -- the relay ----------------------------------------------------------------------------------


class _Lease:
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
        emit: Emit = _quiet,
        metrics: Any = None,
    ) -> None:
        self.topo, self.source, self.dest = topo, source, dest
        self.spark_factory, self.lease, self.emit, self.metrics = spark_factory, lease, emit, metrics
        self.spark: Any = None

    async def run(self) -> dict[str, Any]:
        key = Replication(self.source, self.dest).key
        async with _journal(self.topo, self.dest, key, stale_after=max(1.0, self.lease - 1.0)) as j:
            state = await j.open()
            if state is None:
                raise NotFound(f"no replication {self.source} -> {self.dest}; define it with `ferry replicate start`")
            if state.get("desired") != "running":  # stopped before this relay began: nothing to stand by for
                self.emit("stopped", state=state.get("state"), hint=await self._restart_hint(state))
                return state
            self.spark = await asyncio.to_thread(self.spark_factory)  # warm while standing by
            leader, backoff = None, 2.0
            while True:
                try:
                    state = await j.open()
                except Exception as exc:  # the destination is unreachable: keep trying
                    self.emit("error", message=_first_line(exc))
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
                        self.metrics.active.set(0)
                    await asyncio.sleep(0.5)
                    continue
                leader = None
                j.state = state
                try:
                    takeovers = state.get("takeovers", 0) + (owner is not None)
                    await j.save(state="resuming", error=None, takeovers=takeovers, lease=self.lease)
                except Exception:  # taken by another standby first, or the KV did not answer
                    await asyncio.sleep(0.5)
                    continue
                self.emit("active", previous=owner)
                lease = _Lease(j, min(1.0, self.lease / 5))
                beat = asyncio.create_task(lease.beat())
                try:
                    await self._active(lease)  # until stopped or the lease is lost; the loop decides
                    backoff = 2.0
                except Exception as exc:  # a relay keeps trying: the source may come back
                    self.emit("error", message=_first_line(exc))
                    await lease.save(release=True, state="failed", error=_first_line(exc))
                    await asyncio.sleep(backoff)
                    backoff = min(30.0, backoff * 2)
                finally:
                    beat.cancel()

    async def _restart_hint(self, state: dict[str, Any]) -> str:
        """How to relay again: fail back if the destination took over from the source, else start
        the replication again with the same settings (its stop marker then stays)."""
        with contextlib.suppress(Exception):
            if _took_over(await _site_record(self.topo, self.dest), self.dest, self.source):
                back = f"ferry site failback --to {self.source}"
                return f"{self.dest} took over from {self.source}: `{back}` once {self.source} is back"
        rep = Replication.from_state({**asdict(Replication(self.source, self.dest)), **state})
        return f"`{rep.start_command()}` starts it again"

    async def _active(self, lease: _Lease) -> str:
        """Relay until stopped ("stopped") or the lease is lost ("lost")."""
        j = lease.j
        rep = Replication.from_state(j.state)
        streams = await _streams(_cluster(self.topo, rep.source), rep.streams, rep.source)
        created, batched, leaders = await _ensure_streams(self.topo, rep, streams)
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
        await lease.save(state="relaying", marker=None, resumed_after=after, replayed=replayed, since=time.time())
        checkpoint = _checkpoint()
        query = await asyncio.to_thread(start_query, self.spark, self.topo, rep, after, checkpoint, batched, leaders)
        tracker, warm = _Progress(self.topo, rep, after), False
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
                    self.metrics.update(rep, j.state["progress"])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(lease.stop_requested.wait(), 1.0)
            self.emit("lost", owner=(await j.open() or {}).get("owner"))
            return "lost"
        finally:
            if query.isActive:
                await asyncio.to_thread(query.stop)
            shutil.rmtree(checkpoint, ignore_errors=True)
            await tracker.close()

    def _replay(self, rep: Replication, stream: str, holes: tuple[int, int], seqs: set[int]) -> int:
        return catch_up(self.spark, self.topo, rep, stream, *holes, _held_frame(self.spark, seqs))

    async def _stop_marker(self, lease: _Lease, rep: Replication, streams: list[str]) -> None:
        """After a graceful stop: the exact position per stream, unless something is missing below it."""
        await _settle(_cluster(self.topo, rep.dest), rep.dest, [rep.dest_stream(s) for s in streams])
        found = await positions(self.topo, rep, streams, _floors(lease.j.state))
        exact = all(h.holes() is None for h in found.values())
        marker = {s: h.last for s, h in found.items()} if exact else None
        await lease.save(release=True, state="stopped", marker=marker)
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
        self.cluster, self.site = _cluster(topo, rep.source), rep.source
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
            out = await _lags(self.nc, self.relayed)
        except Exception:  # the source is unreachable: lag unknown
            out = {s: {"relayed": r, "source_last": None, "lag": None, "lag_s": None} for s, r in self.relayed.items()}
        for s, row in out.items():
            row["rate"] = round((self.relayed[s] - before.get(s, 0)) / max(now - t0, 1e-6), 1)
        return out


async def _lags(nc: Any, relayed: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Per source stream: the last relayed sequence, the stream's last, and the backlog between
    them in messages and in seconds (the age of the oldest message not relayed yet)."""
    jsm, out = nc.jsm(timeout=2), {}
    for s, r in relayed.items():
        last = (await jsm.stream_info(s)).state.last_seq
        lag_s = 0.0
        if last > r:  # the oldest message not relayed yet (r + 1 itself may be deleted or expired)
            with contextlib.suppress(Exception):
                oldest = await jsm.get_msg(s, r + 1, subject=">", next=True)
                lag_s = max(0.0, time.time() - oldest.time.timestamp())
        out[s] = {"relayed": r, "source_last": last, "lag": last - r, "lag_s": round(lag_s, 3)}
    return out


def _first_line(exc: Any) -> str:
    text = str(exc or "").strip()
    return redact(text.splitlines()[0])[:300] if text else type(exc).__name__ if exc else "stopped"


class Metrics:
    """Prometheus gauges of one relay, served on ``port``."""

    def __init__(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self.registry = CollectorRegistry()
        labels = ["source", "dest", "stream"]
        g = lambda name, doc: Gauge(name, doc, labels, registry=self.registry)  # noqa: E731
        self.relayed = g("ferry_replicate_relayed_seq", "Last source sequence relayed")
        self.lag = g("ferry_replicate_lag_messages", "Source messages not relayed yet")
        self.lag_s = g("ferry_replicate_lag_seconds", "Age of the oldest message not relayed yet")
        self.rate = g("ferry_replicate_rate", "Source sequences relayed per second")
        self.active = Gauge("ferry_replicate_active", "1 when this process holds the lease", registry=self.registry)
        try:
            start_http_server(port, addr="127.0.0.1", registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"--metrics-port {port}: {exc.strerror}") from None

    def update(self, rep: Replication, progress: dict[str, dict[str, Any]]) -> None:
        self.active.set(1)
        for stream, p in progress.items():
            labels = (rep.source, rep.dest, stream)
            self.relayed.labels(*labels).set(p["relayed"])
            self.rate.labels(*labels).set(p["rate"])
            if p["lag"] is not None:
                self.lag.labels(*labels).set(p["lag"])
                self.lag_s.labels(*labels).set(p["lag_s"])


# -- sites ------------------------------------------------------------------------------------


async def _site_record(topo: Topology, site: str) -> dict[str, Any] | None:
    async with _journal(topo, site, "site") as j:
        return await j.get("site")


def _took_over(record: dict[str, Any] | None, site: str, source: str) -> bool:
    """Whether `site`'s own record says it is primary after a failover from `source`."""
    return bool(record) and record.get("primary") == site and (record.get("failover") or {}).get("from") == source


async def _save_site(topo: Topology, site: str, record: dict[str, Any]) -> None:
    async with _journal(topo, site, "site") as j:
        await j.open()
        j.state = record
        await j.save(release=True)


async def _reachable(topo: Topology, site: str) -> bool:
    try:
        async with _session(topo, site, timeout=2):
            return True
    except FerryError:
        return False


async def failover(
    topo: Topology,
    to: str,
    source: str | None = None,
    emit: Emit = _quiet,
    reverse: bool = False,
    wait: float = 600,
    dry_run: bool = False,
) -> dict[str, Any]:
    """Stop SOURCE -> TO (fencing its relay), record what TO holds, make TO the primary; with
    `reverse`, define TO -> SOURCE once SOURCE answers (within `wait` seconds). `dry_run`: what
    TO holds so far and whether a relay still runs; nothing changes."""
    async with _journal(topo, to, "") as j:
        keys = await j.keys([f"relay.*.{to}"])
        defs = {k: await j.get(k) or {} for k in keys}
    sources = sorted({d["source"] for d in defs.values() if d.get("source")} if not source else {source})
    if len(sources) != 1:
        raise UsageError(f"which site fails over to {to}? pass --from (replications into {to}: {sources or 'none'})")
    (src,) = sources
    state = defs.get(Replication(src, to).key)
    if not state:
        raise NotFound(f"no replication {src} -> {to} to fail over")
    rep = Replication.from_state(state)
    if rep.mapped:
        raise UsageError("site failover needs a replication without stream or subject mapping")
    if dry_run:
        found = await positions(topo, rep, await _failover_streams(topo, state, rep))
        return {
            "dry_run": True,
            "from": src,
            "to": to,
            "relay": _status_row(state, time.time())["summary"],
            "replicated": {s: h.last for s, h in found.items()},
            "source_reachable": await _reachable(topo, src),
        }
    stopped = await stop(topo, src, to, wait=10.0, force=True)
    emit("fenced", replication=f"{src} -> {to}", marker=stopped.get("marker"))
    found = await positions(topo, rep, await _failover_streams(topo, stopped, rep))
    replicated = {s: h.last for s, h in found.items()}
    record = {
        "primary": to,
        "failover": {"from": src, "at": time.time(), "replicated": replicated, "streams": rep.streams},
    }
    await _save_site(topo, to, record)
    emit("primary", site=to, replicated=replicated)
    source_up = await _reachable(topo, src)
    deadline = time.monotonic() + (wait if reverse else 0)
    while not source_up and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        source_up = await _reachable(topo, src)
    if source_up:
        await _save_site(topo, src, record)
    result = {**record, "source_reachable": source_up}
    if reverse:
        if not source_up:
            raise FerryError(f"{to} is primary, but {src} did not answer within {wait:.0f}s: no reverse replication")
        result["reverse"] = await start(topo, Replication(to, src, rep.streams), keep_marker=False)
        emit("reverse", replication=f"{to} -> {src}")
    return result


async def _failover_streams(topo: Topology, state: dict[str, Any], rep: Replication) -> list[str]:
    """The streams a failover records: those the last relay reported on, else those at the destination."""
    streams = sorted((state.get("progress") or {}) or (state.get("resumed_after") or {}))
    return streams or await _streams(_cluster(topo, rep.dest), rep.streams, rep.dest)


async def failback(
    topo: Topology, to: str, spark_factory: Callable[[], Any], emit: Emit = _quiet, dry_run: bool = False
) -> dict[str, Any]:
    """Reconcile both sites by origin sequence, make TO the primary again, define TO -> other.

    Run it once clients write to TO again (or not at all): what the old primary stores after its
    stream was read here is not copied."""
    record, primary, silent = await _failed_over_from(topo, to)
    if not record:
        return await _failed_back(topo, to, dry_run, silent)
    if not await _reachable(topo, to):
        raise FerryError(f"site {to} is not reachable; fail back once it is up")
    if dry_run:
        return {
            "dry_run": True,
            "primary": primary,
            "to": to,
            "streams": await _failback_plan(topo, to, primary, record),
        }
    async with _one_failback(topo, to) as lease:
        record, primary, silent = await _failed_over_from(topo, to)  # again: one that just ended changed it
        if not record:
            return await _failed_back(topo, to, dry_run, silent)
        return await _failback(topo, to, spark_factory, emit, record, primary, lease)


async def _failed_back(topo: Topology, to: str, dry_run: bool, silent: list[str]) -> dict[str, Any]:
    """When no reachable site failed over from TO: TO's record of the failback that made it primary
    again (a rerun has nothing to do), else NotFound. A site that does not answer (`silent`) may have
    taken over since (TO's own record is not updated while TO is down): then nothing can be told."""
    if silent:
        raise FerryError(
            f"no reachable site failed over from {to}, and {', '.join(silent)} did not answer; try again once it does"
        )
    record = await _site_record(topo, to) or {}
    if record.get("primary") == to and record.get("failback"):
        return {"already": True, "dry_run": dry_run, "primary": to, "failback": record["failback"]}
    raise NotFound(f"no site failed over from {to} (nothing to fail back)")


async def _failback_plan(topo: Topology, to: str, primary: str, record: dict[str, Any]) -> dict[str, Any]:
    """Per stream, what a failback would start from: how far TO's messages had reached `primary`
    when it took over, TO's last sequence now and the difference (what TO stored past that point:
    the bulk of what is recovered; the failback also fills any gap below it), and what `primary`
    holds (its writes since are brought to TO). Stream infos only: the counts are the failback's
    own work."""
    from nats.js.errors import NotFoundError

    plan: dict[str, Any] = {}
    states: dict[tuple[str, str], Any] = {}
    for site in (to, primary):
        async with _session(topo, site) as nc:
            for s in record["failover"]["replicated"]:
                with contextlib.suppress(NotFoundError):
                    states[site, s] = (await nc.jsm().stream_info(s)).state
    for s, replicated in sorted(record["failover"]["replicated"].items()):
        here, there = states.get((to, s)), states.get((primary, s))
        plan[s] = {
            "replicated": int(replicated),
            "last_seq": here.last_seq if here else None,
            "after_replicated": max(0, here.last_seq - int(replicated)) if here else 0,
            "primary_messages": there.messages if there else None,
        }
    return plan


async def _failed_over_from(topo: Topology, to: str) -> tuple[dict[str, Any] | None, str, list[str]]:
    """The site record of the site that took over from TO and that site, else (None, "", the
    sites that did not answer)."""
    silent = []
    for _, name, cluster in topo.clusters():
        if not isinstance(cluster, NatsCluster) or name == to:
            continue
        if not await _reachable(topo, name):
            silent.append(name)
            continue
        got = await _site_record(topo, name)
        if _took_over(got, name, to):
            return got, name, []
    return None, "", silent


@contextlib.asynccontextmanager
async def _one_failback(topo: Topology, to: str) -> AsyncIterator[_Lease]:
    """Hold ``site-failback`` in TO's journal while a failback to it runs: a second one is refused
    (two at once each count and copy the whole difference, kept single only by the duplicate window)."""
    async with _journal(topo, to, "site-failback") as j:
        held = await j.open()
        if held and j.owner_alive(held):
            o = held["owner"]
            raise Conflict(f"a failback to {to} is already running (ferry pid {o['pid']} on {o['host']})")
        try:
            await j.save(state="running")  # compare-and-set: of two starting at once, one stops here
        except Conflict:
            raise Conflict(f"a failback to {to} is already running") from None
        lease = _Lease(j, 2.0)
        beat = asyncio.create_task(lease.beat())
        try:
            yield lease
        finally:
            beat.cancel()
            if not lease.lost.is_set():  # else it may be another failback's now
                with contextlib.suppress(Exception):
                    await j.delete()


async def _failback(
    topo: Topology,
    to: str,
    spark_factory: Callable[[], Any],
    emit: Emit,
    record: dict[str, Any],
    primary: str,
    lease: _Lease,
) -> dict[str, Any]:
    fo = record["failover"]
    back, forth = Replication(primary, to, fo["streams"]), Replication(to, primary, fo["streams"])
    streams = sorted(fo["replicated"])
    with contextlib.suppress(NotFound):
        await stop(topo, primary, to, wait=10.0, force=True)  # a reverse replication, if one ran
    await _ensure_streams(topo, back, streams)
    spark = await asyncio.to_thread(spark_factory)
    report: dict[str, Any] = {"primary_was": primary, "to": to, "streams": {}}
    for s in streams:
        if lease.lost.is_set():  # its key unsaved too long: another failback may have begun
            raise Conflict(f"the failback to {to} lost its hold on {to}'s journal (no answer); run it again")
        # what TO acked but never relayed before it failed (the RPO), then what was written at `primary`
        rpo = await asyncio.to_thread(_count_after, spark, topo, forth, s, int(fo["replicated"][s]))
        sent_forth = await asyncio.to_thread(_send_missing, spark, topo, forth, s)
        sent_back = await asyncio.to_thread(_send_missing, spark, topo, back, s)
        report["streams"][s] = {"rpo": rpo, "recovered": sent_forth, "brought": sent_back}
        emit("reconciled", stream=s, **report["streams"][s])
    # defined again before the records say TO is primary: a failback cut short between the two
    # finds its record on a rerun, instead of leaving TO -> other undefined
    again = await start(topo, forth, keep_marker=False)  # the reconciliation moved its position
    new = {"primary": to, "failback": {"from": primary, "at": time.time()}}
    for site in (to, primary):
        await _save_site(topo, site, new)
    report["replication"] = (
        f"{forth.source} -> {forth.dest} defined again ({_status_row(again, time.time())['summary']});"
        f" run relays with: ferry replicate run --from {forth.source} --to {forth.dest}"
    )
    return report


def _count_after(spark: Any, topo: Topology, rep: Replication, stream: str, after: int) -> int:
    """The source's own messages after sequence `after`."""
    return int(_source_frame(spark, topo, rep, stream, after + 1).count())
