"""`ferry audit`: reconcile a load ledger with what each tier holds (a Spark job).

For each tier (a snapshot directory, or a ``jetstream://`` URI read on the fly;
queues are snapshotted first) and each message id of the ledger:

- lost: expected (acked, or sent fire-and-forget) but absent; reported as
  ``lost_acked`` and ``lost_not_asked``; ``absent_after_error`` (the producer
  was told the publish failed) is shown but is not a loss;
- duplicated: an id present more than once (``duplicated`` ids, ``extra_copies``);
- unexpected: present but never sent in this ledger;
- reordered: per subject and producer, a message stored after one its producer
  sent later (order inversions in the tier's own order: stream sequence, or
  queue position);
- corrupted: payload hash differs from the one sent;
- delay percentiles: from send to stored in this tier (stream time minus send
  time; JetStream tiers only: a queue keeps no arrival time). End-to-end for
  what producers and relays stored; for what a copy stored (a ``Ferry-Source``
  or ``x-ferry-transfer`` header: ``ferry copy``, a fail-back, a repartition) it
  is when the copy ran, so those are counted apart (``delay.by_copy``);
- all of it per time bucket of send time (default 10 s).

A tier must hold every ledger's messages unless it is given the ledgers it holds
(``holds``): then the others' messages are left out of its counts, neither lost
nor unexpected there.

The tier's message id is the ``Ferry-Id`` header, else the message id
(``Nats-Msg-Id`` / AMQP ``message_id``); ids are ferry load's
``<run>-p<producer>-<seq>``, which gives the producer (``<run>-p<producer>``) and
its sequence for the reorder check. Delays use the ``Ferry-Sent`` header (``x-ferry-sent``).
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import Any

from ferry.errors import ConfigError, NotFound, UsageError
from ferry.headers import SOURCE_HDR, TRANSFER_HDR

__all__ = ["FULL_JVM_ROWS", "audit", "check_inputs", "read_events", "tier_frame", "verdict"]

_DELAY_BINS = 21  # delay histogram: <= 1, 2, 4, ... 2**20 ms, then beyond
_DELAY_STEPS = 32  # delays are counted in bins of 1/32 of a doubling (2.2 %) for the percentiles
_DELAY_FLOOR = 2.0**-10  # ms; shorter delays (and negative ones, clock skew) count as this


# From about this many rows (ledgers and tiers together) the audit is faster in a JVM that compiles
# with C2 (10M-row bench: half the time); below it, C1 alone starts sooner (50,000 rows: 9.8 s
# against 12.2 s for the whole command; at 500,000 the two are even).
FULL_JVM_ROWS = 1_000_000


_COLUMNS = {  # what the audit cannot do without (a tier's other columns are read as null when absent)
    "ledger": ("id", "sent_ns", "outcome", "hash"),
    "tier": ("payload", "source_seq"),
}


def check_inputs(
    topology: Any, ledgers: list[str], tiers: dict[str, str], holds: dict[str, list[str]] | None = None
) -> tuple[int, list[str]]:
    """Refuse a missing ledger or snapshot, a bad URI or an unknown stream before Spark starts.
    Returns the rows to reconcile, from the files' metadata and the streams' state, and a warning
    for each stream tier that captures none, or not all, of the subjects of a ledger it must hold
    (`holds`: a tier's ledgers, when not all)."""
    import asyncio

    import pyarrow as pa
    import pyarrow.dataset as ds

    from ferry.uris import parse_uri

    def opened(what: str, path: str) -> tuple[Any, int]:
        """The Parquet dataset at `path`, checked to be a `what` (ledger or tier), and its rows."""
        try:
            data = ds.dataset(path, format="parquet")
            rows = data.count_rows()
        except (pa.ArrowInvalid, OSError) as exc:
            raise ConfigError(f"{what} {path!r} is not Parquet ({str(exc).splitlines()[0]})") from None
        if not data.files:
            raise ConfigError(f"{what} {path!r} holds no Parquet file")
        missing = [c for c in _COLUMNS[what] if c not in data.schema.names]
        if missing:
            kind = "a ledger (`ferry load --ledger`)" if what == "ledger" else "a snapshot (`ferry snapshot`)"
            raise ConfigError(f"{what} {path!r} is not {kind}: it has no column {', '.join(missing)}")
        return data, rows

    rows, runs, subjects = 0, {}, {}
    for path in ledgers:
        if not Path(path).exists():
            raise NotFound(f"ledger {path!r} does not exist")
        data, n = opened("ledger", path)
        rows += n
        if "subject" in data.schema.names:
            subjects[path] = data.to_table(columns=["subject"]).column("subject").unique().drop_null().to_pylist()
        these = data.to_table(columns=["run"]).column("run").unique().to_pylist() if "run" in data.schema.names else []
        for run in these:  # a load given twice (a copy, or a directory and one inside it): each message counts twice
            if run in runs:
                raise UsageError(f"ledgers {runs[run]!r} and {path!r} both hold load {run}")
            runs[run] = path
    warnings = []
    for name, value in tiers.items():
        if "://" not in value or value.startswith("parquet://"):
            path = value.removeprefix("parquet://")
            if not Path(path).exists():
                raise NotFound(f"tier {value!r}: no such snapshot directory")
            rows += opened("tier", path)[1]
            continue
        src = parse_uri(value)
        if src.kind != "jetstream":
            raise ConfigError(
                f"tier {value!r}: give a snapshot directory or a jetstream:// URI "
                "(snapshot queues first with `ferry snapshot`)"
            )
        messages, captures = asyncio.run(_stream_tier(topology.nats(src.cluster, src.account), src))
        rows += messages
        for path in (holds or {}).get(name) or ledgers:
            if captures and (line := _uncaptured(name, src, captures, path, subjects.get(path) or [])):
                warnings.append(line)
    return rows, warnings


def read_events(paths: list[Path]) -> list[dict[str, Any]]:
    """The events a job printed with ``--json`` (JSON lines with ``event`` and ``t``, on stderr;
    other lines are skipped), for the report's timeline: each one's time, name and file."""
    import json

    out = []
    for path in paths:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError as exc:
            raise NotFound(f"--events {str(path)!r}: {exc.strerror or exc}") from None
        found = 0
        for line in lines:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if isinstance(e, dict) and isinstance(e.get("event"), str) and isinstance(e.get("t"), int | float):
                out.append({"t": float(e["t"]), "event": e["event"], "source": path.name})
                found += 1
        if not found:
            raise UsageError(
                f"--events {str(path)!r}: no event in it (the JSON lines a ferry job prints on stderr with --json)"
            )
    return sorted(out, key=lambda e: e["t"])


async def _stream_tier(cluster: Any, src: Any) -> tuple[int, list[str]]:
    """A stream tier's messages (matching its filter) and the subjects its stream captures."""
    from ferry.brokers import nats as bnats
    from ferry.brokers.nats.reader import stream_states

    stream, where = src.stream or "", src.cluster or ""
    async with bnats.session(cluster, name=where) as nc:
        states = await stream_states(cluster, [stream], src.subject, where, nc)
        return states[stream]["messages"], (await nc.jsm().stream_info(stream)).config.subjects or []


def _uncaptured(tier: str, src: Any, captures: list[str], ledger: str, sent: list[str]) -> str | None:
    """A warning when stream tier `tier` cannot hold some of the subjects ledger `ledger` sent on."""
    from ferry.subjects import Capture, matches

    capture = Capture(captures)
    missed = [x for x in sent if not (capture(x) and (not src.subject or matches(src.subject, x)))]
    if not missed:
        return None
    held = f"{src.stream} ({', '.join(captures)}{f'; read for {src.subject}' if src.subject else ''})"
    some = "none" if len(missed) == len(sent) else f"{len(missed):,} of the {len(sent):,}"
    return (
        f"tier {tier}: stream {held} captures {some} of the subjects ledger {ledger} sent on (e.g. {missed[0]}): "
        f"their messages count as lost there; --holds {tier}=LEDGER names the ledgers a tier must hold"
    )


def tier_frame(spark: Any, topology: Any, value: str) -> Any:
    """A tier (checked by :func:`check_inputs`) as a DataFrame in the common schema: a Parquet
    directory or a stream URI."""
    from ferry.schema import SPARK_DDL

    if "://" not in value or value.startswith("parquet://"):
        return spark.read.schema(SPARK_DDL).parquet(value.removeprefix("parquet://"))
    from ferry.brokers.nats.reader import ReadConfig
    from ferry.spark.jetstream import stream_frame
    from ferry.uris import parse_uri

    src = parse_uri(value)
    cfg = ReadConfig(
        cluster=topology.nats(src.cluster, src.account).model_dump_json(),
        name=src.cluster or "",
        streams=(src.stream or "",),
        subject=src.subject,
    )
    return stream_frame(spark, cfg)


def audit(
    spark: Any,
    ledger: str | list[str],
    tiers: dict[str, Any],
    bucket_s: int = 10,
    max_listed: int = 10_000,
    holds: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """The reconciliation report (plain data, ready for JSON, tables and HTML). Several ledgers
    (loads at several sites) are reconciled as one; `holds` gives a tier the ledgers it must hold
    (by default all of them).

    Plan per tier: the tier alone gives each copy's reorder flag (a window per
    source, subject and producer; producer and sequence are part of every ferry
    message id) and its delay (the ``Ferry-Sent`` header); copies are then
    aggregated per id and joined once with the ledger (a shuffled hash join);
    one aggregation per send-time bucket and fine delay bin reads the result,
    a bounded sample of the faulty ids included, without caching it.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    ledgers = [ledger] if isinstance(ledger, str) else ledger
    holds = holds or {}
    if holds:  # which ledger each message is of
        read = functools.reduce(
            lambda a, b: a.unionByName(b), (spark.read.parquet(p).withColumn("ledger", F.lit(p)) for p in ledgers)
        )
    else:
        read = spark.read.parquet(*ledgers).withColumn("ledger", F.lit(None).cast("string"))
    led = read.select(
        "id",
        "ledger",
        "sent_ns",
        "outcome",
        _hash64(F.col("hash")).alias("l_hash"),
        (F.floor(F.col("sent_ns") / (bucket_s * 1_000_000_000)) * bucket_s).cast("long").alias("bucket"),
    )
    report: dict[str, Any] = {"ledger": ledger, "bucket_s": bucket_s, "tiers": {}}

    def n(cond: Any) -> Any:
        return F.sum(cond.cast("long"))

    for name, frame in tiers.items():
        ident = F.coalesce(F.col("headers")["Ferry-Id"], F.col("msg_id"))
        sent = F.coalesce(F.col("headers")["Ferry-Sent"], F.col("headers")["x-ferry-sent"]).try_cast("long")
        stored_us = F.unix_micros(F.when(F.col("properties").isNull(), F.col("timestamp")))
        by_copy = F.coalesce(F.col("headers")[SOURCE_HDR], F.col("headers")[TRANSFER_HDR]).isNotNull()
        producer_seq = F.regexp_extract(ident, r"-p(\d+-\d+)$", 1)  # "" for an id not ferry load's
        seq = F.substring_index(producer_seq, "-", -1)
        # the producer is "<run>-p<n>": each run's producers count from 1 again
        producer = F.when(producer_seq != "", F.substring(ident, F.lit(1), F.length(ident) - F.length(seq) - 1))
        copies = frame.select(
            ident.alias("id"),
            "source",
            F.col("source_seq").alias("pos"),
            F.col("subject").alias("t_subject"),
            _hash64(F.substring(F.sha2(F.col("payload"), 256), 1, 16)).alias("t_hash"),
            producer.alias("producer"),
            seq.try_cast("long").alias("seq"),
            ((stored_us * 1000 - sent) / 1e6).alias("delay_ms"),
            by_copy.alias("by_copy"),
        )
        earlier = Window.partitionBy("source", "t_subject", "producer").orderBy("pos")
        earlier = earlier.rowsBetween(Window.unboundedPreceding, -1)
        copies = copies.withColumn("reordered", F.coalesce(F.col("seq") < F.max("seq").over(earlier), F.lit(False)))
        per_id = copies.groupBy("id").agg(
            F.count("*").alias("copies"),
            F.min("t_hash").alias("h_min"),
            F.max("t_hash").alias("h_max"),
            F.max(F.col("reordered").cast("int")).alias("reord"),
            F.min("delay_ms").alias("delay_ms"),  # the first arrival
            F.max(F.col("by_copy").cast("int")).alias("by_copy"),
        )
        corrupt = (F.col("h_min") != F.col("l_hash")) | (F.col("h_max") != F.col("l_hash"))
        joined = led.join(per_id.hint("shuffle_hash"), "id", "full_outer").withColumns(
            {"known": F.col("outcome").isNotNull(), "present": F.col("copies").isNotNull(), "corrupt": corrupt}
        )
        if name in holds:  # another ledger's messages: neither expected here nor unexpected
            joined = joined.filter(F.col("ledger").isNull() | F.col("ledger").isin(holds[name]))
        lost = ~F.col("present") & F.col("outcome").isin("acked", "not_asked")
        faulty = ~F.col("known") | lost | (F.col("copies") > 1) | F.col("corrupt")
        d_ms = F.col("delay_ms")  # greatest() skips a null: keep the bin null without a delay
        fine = F.when(d_ms.isNotNull(), F.ceil(F.log2(F.greatest(d_ms, F.lit(_DELAY_FLOOR))) * _DELAY_STEPS))
        known = F.col("known")
        fault = F.struct("id", "known", lost.alias("lost"), (F.col("copies") > 1).alias("dup"), "corrupt")
        # one pass, per send-time bucket, fine delay bin and faulty id (null for the rest): a faulty
        # id is a group of its own, so the job lists them without collecting lists (which would
        # take Spark's slow object aggregation for every row). Ids never sent have no bucket, and
        # the per-bucket counters are read only from rows with one.
        grouped = joined.groupBy("bucket", fine.alias("dbin"), F.when(faulty, fault).alias("fault")).agg(
            n(known).alias("sent"),
            n(F.col("outcome") == "acked").alias("acked"),
            n(F.col("present")).alias("present"),
            n(~F.col("present") & (F.col("outcome") == "acked")).alias("lost_acked"),
            n(~F.col("present") & (F.col("outcome") == "not_asked")).alias("lost_not_asked"),
            n(~F.col("present") & (F.col("outcome") == "error")).alias("absent_after_error"),
            n(F.col("copies") > 1).alias("duplicated"),
            F.sum(F.greatest(F.col("copies") - 1, F.lit(0))).alias("extra_copies"),
            n(F.col("corrupt")).alias("corrupted"),
            n(F.col("reord") == 1).alias("reordered"),
            F.sum(F.coalesce(F.col("copies"), F.lit(0))).alias("copies_held"),
            F.sum(F.when(~known, F.col("copies"))).alias("unexpected"),
            F.count("delay_ms").alias("delays"),
            n(F.col("delay_ms").isNotNull() & (F.col("by_copy") == 1)).alias("copied_delays"),
            F.min("delay_ms").alias("dmin"),
            F.max("delay_ms").alias("dmax"),
        )
        # a bounded sample of the faulty ids: lost ids have no delay, so all of a bucket's share one
        # bin; a bin with delays is one of up to hundreds per bucket (duplicated, corrupted, unexpected).
        # The faulty ids beyond it are folded into their bin's unlisted group: counted, not listed.
        in_bin = Window.partitionBy("bucket", "dbin").orderBy(
            F.col("fault").isNull(),
            F.length("fault.id"),
            F.col("fault.id"),  # r-p0-2 before r-p0-10
        )
        limit = F.when(F.col("dbin").isNull(), 4 * max_listed).otherwise(max(1, max_listed // 16))
        summed = [c for c in grouped.columns if c not in ("bucket", "dbin", "fault", "dmin", "dmax")]
        groups = (
            grouped.withColumn("fault", F.when(F.row_number().over(in_bin) <= limit, F.col("fault")))
            .groupBy("bucket", "dbin", "fault")
            .agg(*[F.sum(c).alias(c) for c in summed], F.min("dmin").alias("dmin"), F.max("dmax").alias("dmax"))
            .collect()
        )
        counters = [c for c in summed if c not in ("unexpected", "delays", "copied_delays")] if groups else []
        per_bucket: dict[int, dict[str, int]] = {}
        for g in groups:
            if g["bucket"] is not None:
                row = per_bucket.setdefault(g["bucket"], {"bucket": g["bucket"]} | dict.fromkeys(counters, 0))
                for k in counters:
                    row[k] += int(g[k] or 0)
        rows = [per_bucket[b] for b in sorted(per_bucket)]
        delays_of: dict[int, list[Any]] = {}
        for g in groups:
            if g["bucket"] is not None and g["delays"]:
                delays_of.setdefault(g["bucket"], []).append(g)
        for row in rows:  # the bucket's delays, for the report's timeline
            if d := _delay_summary(delays_of.get(row["bucket"], [])):
                row |= {"delay_p50_ms": d["p50_ms"], "delay_p99_ms": d["p99_ms"], "delay_max_ms": d["max_ms"]}
        totals = {k: sum(r[k] for r in rows) for k in counters}
        totals["lost"] = totals.get("lost_acked", 0) + totals.get("lost_not_asked", 0)
        unexpected = sum(int(g["unexpected"] or 0) for g in groups)
        delay = _delay_summary([g for g in groups if g["delays"]])
        if delay:
            delay["by_copy"] = sum(int(g["copied_delays"] or 0) for g in groups)
        faults = sorted(
            ({**g["fault"].asDict(), "bucket": g["bucket"]} for g in groups if g["fault"]),
            key=lambda f: _natural(f["id"]),
        )

        def listed(flag: str, rows: list[dict[str, Any]] = faults) -> list[dict[str, Any]]:
            return [{"id": r["id"], "bucket": r["bucket"]} for r in rows if r[flag] and r["known"]][:max_listed]

        report["tiers"][name] = {
            **totals,
            "unexpected": unexpected,
            "tier_messages": totals.get("copies_held", 0) + unexpected,
            "delay": delay,
            "buckets": rows,
            "lost_ids": listed("lost"),
            "duplicated_ids": listed("dup"),
            "corrupted_ids": listed("corrupt"),
            "unexpected_ids": [r["id"] or "(no Ferry-Id)" for r in faults if not r["known"]][:100],
        }
    totals = (
        led.groupBy()
        .agg(
            F.count("*").alias("sent"),
            n(F.col("outcome") == "acked").alias("acked"),
            n(F.col("outcome") == "error").alias("errors"),
            n(F.col("outcome") == "not_asked").alias("not_asked"),
            F.min("sent_ns").alias("first_ns"),
            F.max("sent_ns").alias("last_ns"),
        )
        .collect()[0]
    )
    report["sent"] = {k: int(v or 0) for k, v in totals.asDict().items()}
    return report


def _hash64(hex_digest: Any) -> Any:
    """A ledger's payload hash (16 hex digits of sha256) as a long, for the comparison per id: a
    fixed-width value lets Spark aggregate copies in a hash map (a string's minimum makes it sort
    them). xxhash64 is as collision-proof as the 64-bit hash it stands for, and cheaper than
    parsing the digits (`conv`). No hash stays null (xxhash64 would give its seed)."""
    from pyspark.sql import functions as F

    return F.when(hex_digest.isNotNull(), F.xxhash64(hex_digest))


def _natural(text: str | None) -> list[Any]:
    """`text` split so that its numbers compare as numbers: run-p0-2 before run-p0-10."""
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", text or "")]


def verdict(report: dict[str, Any], max_lost: int = 0, max_dup: int = 0) -> list[str]:
    """One line per tier that fails the gate (empty when every tier passes)."""
    failures = []
    for name, t in report["tiers"].items():
        if t.get("lost", 0) > max_lost:
            failures.append(f"{name}: {t['lost']} lost (max {max_lost})")
        if t.get("extra_copies", 0) > max_dup:
            failures.append(f"{name}: {t['extra_copies']} duplicate copies (max {max_dup})")
    return failures


def _delay_summary(bins: list[Any]) -> dict[str, Any] | None:
    """Percentiles, maximum and the doubling histogram from the fine delay bins (each with its
    count, smallest and largest delay): a percentile is interpolated within its bin, between the
    delays the bin really holds, so it is off by less than the bin's 2.2 %. Groups of the same bin
    (from several buckets, or faulty ids) are merged first."""
    if not bins:
        return None
    merged: dict[int, dict[str, Any]] = {}
    for b in bins:
        m = merged.setdefault(b["dbin"], {"dbin": b["dbin"], "delays": 0, "dmin": b["dmin"], "dmax": b["dmax"]})
        m["delays"] += b["delays"]
        m["dmin"], m["dmax"] = min(m["dmin"], b["dmin"]), max(m["dmax"], b["dmax"])
    bins = [merged[k] for k in sorted(merged)]
    total = sum(b["delays"] for b in bins)

    def pct(p: float) -> float:
        rank, seen = p * total, 0
        for b in bins:
            if seen + b["delays"] >= rank:
                frac = (rank - seen) / b["delays"]
                return b["dmin"] + (b["dmax"] - b["dmin"]) * frac
            seen += b["delays"]
        return bins[-1]["dmax"]

    hist = [0] * (_DELAY_BINS + 1)  # <= 2**k ms for k < _DELAY_BINS, then beyond
    for b in bins:
        k = max(0, math.ceil(b["dbin"] / _DELAY_STEPS))  # (2**((dbin-1)/STEPS), 2**(dbin/STEPS)] is within <= 2**k
        hist[min(k, _DELAY_BINS)] += b["delays"]
    histogram = [{"le_ms": 2**k, "count": hist[k]} for k in range(_DELAY_BINS)]
    dmax = max(b["dmax"] for b in bins)
    histogram.append({"le_ms": int(dmax) + 1, "count": hist[_DELAY_BINS]})
    while histogram and histogram[-1]["count"] == 0:
        histogram.pop()
    return {
        "measures": "sent -> stored in this tier",
        "count": total,
        "p50_ms": round(pct(0.5), 2),
        "p90_ms": round(pct(0.9), 2),
        "p99_ms": round(pct(0.99), 2),
        "max_ms": round(dmax, 2),
        "histogram": histogram,
    }
