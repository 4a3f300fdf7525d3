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
- delay percentiles: stream time minus send time (JetStream tiers only: a
  queue keeps no arrival time);
- all of it per time bucket of send time (default 10 s).

The tier's message id is the ``Ferry-Id`` header, else the message id
(``Nats-Msg-Id`` / AMQP ``message_id``); ids are ferry load's
``<run>-p<producer>-<seq>``, which gives the producer and its sequence for the
reorder check. Delays use the ``Ferry-Sent`` header (``x-ferry-sent``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ferry.errors import ConfigError, NotFound

__all__ = ["audit", "tier_frame", "verdict"]

_DELAY_BINS = 21  # delay histogram: <= 1, 2, 4, ... 2**20 ms, then beyond


def tier_frame(spark: Any, topology: Any, value: str) -> Any:
    """A tier as a DataFrame in the common schema: a Parquet directory or a stream/queue URI."""
    from ferry.pipeline.schema import SPARK_DDL

    if "://" not in value or value.startswith("parquet://"):
        path = value.removeprefix("parquet://")
        if not Path(path).exists():
            raise NotFound(f"tier {value!r}: no such snapshot directory")
        return spark.read.schema(SPARK_DDL).parquet(path)
    from ferry.pipeline.uris import parse_uri

    src = parse_uri(value)
    if src.kind == "jetstream":
        return (
            spark.read.format("jetstream")
            .option("cluster", topology.nats(src.cluster).model_dump_json())
            .option("cluster_name", src.cluster)
            .option("stream", src.stream)
            .option("subject", src.subject or "")
            .load()
        )
    raise ConfigError(
        f"tier {value!r}: give a snapshot directory or a jetstream:// URI (snapshot queues first with `ferry snapshot`)"
    )


def audit(
    spark: Any, ledger: str | list[str], tiers: dict[str, Any], bucket_s: int = 10, max_listed: int = 10_000
) -> dict[str, Any]:
    """The reconciliation report (plain data, ready for JSON, tables and HTML). Several ledgers
    (loads at several sites) are reconciled as one.

    Plan per tier: the tier alone gives each copy's reorder flag (a window per
    source, subject and producer; producer and sequence are part of every ferry
    message id) and its delay (the ``Ferry-Sent`` header); copies are then
    aggregated per id and joined once with the ledger (a shuffled hash join);
    three small collects read the result (per bucket, overall statistics and
    the delay histogram, the faulty ids).
    """
    from pyspark import StorageLevel
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    ledgers = [ledger] if isinstance(ledger, str) else ledger
    for path in ledgers:
        if not Path(path).exists():
            raise NotFound(f"ledger {path!r} does not exist")
    led = spark.read.parquet(*ledgers).select(
        "id",
        "sent_ns",
        "outcome",
        F.col("hash").alias("l_hash"),
        (F.floor(F.col("sent_ns") / (bucket_s * 1_000_000_000)) * bucket_s).cast("long").alias("bucket"),
    )
    report: dict[str, Any] = {"ledger": ledger, "bucket_s": bucket_s, "tiers": {}}

    def n(cond: Any) -> Any:
        return F.sum(cond.cast("long"))

    for name, frame in tiers.items():
        ident = F.coalesce(F.col("headers")["Ferry-Id"], F.col("msg_id"))
        sent = F.coalesce(F.col("headers")["Ferry-Sent"], F.col("headers")["x-ferry-sent"]).try_cast("long")
        stored_us = F.unix_micros(F.when(F.col("properties").isNull(), F.col("timestamp")))
        copies = frame.select(
            ident.alias("id"),
            "source",
            F.col("source_seq").alias("pos"),
            F.col("subject").alias("t_subject"),
            F.substring(F.sha2(F.col("payload"), 256), 1, 16).alias("t_hash"),
            F.regexp_extract(ident, r"-p(\d+)-\d+$", 1).alias("producer"),
            F.regexp_extract(ident, r"-p\d+-(\d+)$", 1).try_cast("long").alias("seq"),
            ((stored_us * 1000 - sent) / 1e6).alias("delay_ms"),
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
        )
        corrupt = (F.col("h_min") != F.col("l_hash")) | (F.col("h_max") != F.col("l_hash"))
        joined = led.join(per_id.hint("shuffle_hash"), "id", "full_outer").withColumns(
            {"known": F.col("outcome").isNotNull(), "present": F.col("copies").isNotNull(), "corrupt": corrupt}
        )
        joined = joined.persist(StorageLevel.MEMORY_AND_DISK)

        buckets = (
            joined.where("known")
            .groupBy("bucket")
            .agg(
                F.count("*").alias("sent"),
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
            )
            .orderBy("bucket")
            .collect()
        )
        rows = [{k: int(v or 0) for k, v in b.asDict().items()} for b in buckets]
        totals = {k: sum(r[k] for r in rows) for k in rows[0] if k != "bucket"} if rows else {}
        totals["lost"] = totals.get("lost_acked", 0) + totals.get("lost_not_asked", 0)

        bins = F.pow(F.lit(2), F.ceil(F.log2(F.greatest(F.col("delay_ms"), F.lit(1.0)))))
        stats = (
            joined.groupBy()
            .agg(
                F.sum(F.when(~F.col("known"), F.col("copies"))).alias("unexpected"),
                F.percentile_approx("delay_ms", [0.5, 0.9, 0.99], 1000).alias("pcts"),
                F.max("delay_ms").alias("max"),
                F.count("delay_ms").alias("delays"),
                *(n(bins == 2**k).alias(f"le{2**k}") for k in range(_DELAY_BINS)),
                n(bins > 2 ** (_DELAY_BINS - 1)).alias("beyond"),
            )
            .collect()[0]
        )
        delay = None
        if stats["delays"]:
            p50, p90, p99 = stats["pcts"]
            hist = [{"le_ms": 2**k, "count": int(stats[f"le{2**k}"] or 0)} for k in range(_DELAY_BINS)]
            hist.append({"le_ms": int(stats["max"]) + 1, "count": int(stats["beyond"] or 0)})
            while hist and hist[-1]["count"] == 0:
                hist.pop()
            delay = {
                "p50_ms": round(p50, 2),
                "p90_ms": round(p90, 2),
                "p99_ms": round(p99, 2),
                "max_ms": round(stats["max"], 2),
                "histogram": hist,
            }

        lost = ~F.col("present") & F.col("outcome").isin("acked", "not_asked")
        faulty = (
            joined.where(~F.col("known") | lost | (F.col("copies") > 1) | F.col("corrupt"))
            .select("id", "bucket", "known", lost.alias("lost"), (F.col("copies") > 1).alias("dup"), "corrupt")
            .limit(4 * max_listed)
            .collect()
        )
        faulty.sort(key=lambda r: r["id"] or "")

        def listed(flag: str, rows: list[Any] = faulty) -> list[dict[str, Any]]:
            return [{"id": r["id"], "bucket": r["bucket"]} for r in rows if r[flag] and r["known"]][:max_listed]

        report["tiers"][name] = {
            **totals,
            "unexpected": int(stats["unexpected"] or 0),
            "tier_messages": totals.get("copies_held", 0) + int(stats["unexpected"] or 0),
            "delay": delay,
            "buckets": rows,
            "lost_ids": listed("lost"),
            "duplicated_ids": listed("dup"),
            "corrupted_ids": listed("corrupt"),
            "unexpected_ids": [r["id"] or "(no Ferry-Id)" for r in faulty if not r["known"]][:100],
        }
        joined.unpersist()
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


def verdict(report: dict[str, Any], max_lost: int = 0, max_dup: int = 0) -> list[str]:
    """One line per tier that fails the gate (empty when every tier passes)."""
    failures = []
    for name, t in report["tiers"].items():
        if t.get("lost", 0) > max_lost:
            failures.append(f"{name}: {t['lost']} lost (max {max_lost})")
        if t.get("extra_copies", 0) > max_dup:
            failures.append(f"{name}: {t['extra_copies']} duplicate copies (max {max_dup})")
    return failures
