"""`ferry audit`: reconcile a load ledger with what each tier holds (a Spark job).

For each tier (a snapshot directory, or a ``jetstream://`` / ``rabbitmq://`` URI
read on the fly) and each message id of the ledger:

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
(``Nats-Msg-Id`` / AMQP ``message_id``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ferry.errors import ConfigError, NotFound

__all__ = ["audit", "tier_frame"]


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
            .load()
        )
    raise ConfigError(
        f"tier {value!r}: give a snapshot directory or a jetstream:// URI (snapshot queues first with `ferry snapshot`)"
    )


def audit(
    spark: Any, ledger: str, tiers: dict[str, Any], bucket_s: int = 10, max_listed: int = 10_000
) -> dict[str, Any]:
    """The reconciliation report (plain data, ready for JSON, tables and HTML)."""
    from pyspark import StorageLevel
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if not Path(ledger).exists():
        raise NotFound(f"ledger {ledger!r} does not exist")
    led = (
        spark.read.parquet(ledger)
        .select(
            "id",
            "producer",
            "seq",
            "sent_ns",
            "outcome",
            F.col("hash").alias("l_hash"),
            (F.floor(F.col("sent_ns") / (bucket_s * 1_000_000_000)) * bucket_s).cast("long").alias("bucket"),
        )
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    ledger_totals = (
        led.groupBy()
        .agg(
            F.count("*").alias("sent"),
            F.sum((F.col("outcome") == "acked").cast("long")).alias("acked"),
            F.sum((F.col("outcome") == "error").cast("long")).alias("errors"),
            F.sum((F.col("outcome") == "not_asked").cast("long")).alias("not_asked"),
            F.min("sent_ns").alias("first_ns"),
            F.max("sent_ns").alias("last_ns"),
        )
        .collect()[0]
        .asDict()
    )
    report: dict[str, Any] = {
        "ledger": ledger,
        "bucket_s": bucket_s,
        "sent": {k: int(v or 0) for k, v in ledger_totals.items()},
        "tiers": {},
    }

    for name, frame in tiers.items():
        tier = frame.select(
            F.coalesce(F.col("headers")["Ferry-Id"], F.col("msg_id")).alias("id"),
            "source",
            F.col("source_seq").alias("pos"),
            F.col("subject").alias("t_subject"),
            F.substring(F.sha2(F.col("payload"), 256), 1, 16).alias("t_hash"),
            F.when(F.col("properties").isNull(), F.col("timestamp")).alias("stored_at"),
        )
        tl = tier.join(led.select("id", "l_hash", "producer", "seq", "sent_ns"), "id", "left")
        inversion = (
            Window.partitionBy("source", "t_subject", "producer")
            .orderBy("pos")
            .rowsBetween(Window.unboundedPreceding, -1)
        )
        tl = tl.withColumns(
            {
                "known": F.col("l_hash").isNotNull(),
                "corrupted": F.col("l_hash").isNotNull() & (F.col("t_hash") != F.col("l_hash")),
                "reordered": F.coalesce(F.col("seq") < F.max("seq").over(inversion), F.lit(False)),
                "delay_ms": (F.unix_micros("stored_at") * 1000 - F.col("sent_ns")) / 1e6,
            }
        ).persist(StorageLevel.MEMORY_AND_DISK)
        per_id = (
            tl.where("known")
            .groupBy("id")
            .agg(
                F.count("*").alias("copies"),
                F.max(F.col("corrupted").cast("int")).alias("corrupt"),
                F.max(F.col("reordered").cast("int")).alias("reord"),
            )
        )
        lc = (
            led.join(per_id, "id", "left")
            .withColumns(
                {
                    "present": F.col("copies").isNotNull(),
                    "expected": F.col("outcome").isin("acked", "not_asked"),
                }
            )
            .persist(StorageLevel.MEMORY_AND_DISK)
        )

        def n(cond: Any) -> Any:
            return F.sum(cond.cast("long"))

        buckets = (
            lc.groupBy("bucket")
            .agg(
                F.count("*").alias("sent"),
                n(F.col("outcome") == "acked").alias("acked"),
                n(F.col("present")).alias("present"),
                n(~F.col("present") & (F.col("outcome") == "acked")).alias("lost_acked"),
                n(~F.col("present") & (F.col("outcome") == "not_asked")).alias("lost_not_asked"),
                n(~F.col("present") & (F.col("outcome") == "error")).alias("absent_after_error"),
                n(F.col("copies") > 1).alias("duplicated"),
                F.sum(F.greatest(F.col("copies") - 1, F.lit(0))).alias("extra_copies"),
                n(F.col("corrupt") == 1).alias("corrupted"),
                n(F.col("reord") == 1).alias("reordered"),
            )
            .orderBy("bucket")
            .collect()
        )
        rows = [{k: int(v or 0) for k, v in b.asDict().items()} for b in buckets]
        totals = {k: sum(r[k] for r in rows) for k in rows[0] if k != "bucket"} if rows else {}
        totals["lost"] = totals.get("lost_acked", 0) + totals.get("lost_not_asked", 0)

        extra = (
            tl.groupBy()
            .agg(
                n(~F.col("known")).alias("unexpected"),
                F.count("*").alias("tier_messages"),
                F.percentile_approx("delay_ms", [0.5, 0.9, 0.99], 1000).alias("pcts"),
                F.max("delay_ms").alias("max"),
                F.count("delay_ms").alias("delays"),
            )
            .collect()[0]
        )
        delay = None
        if extra["delays"]:
            p50, p90, p99 = extra["pcts"]
            delay = {
                "p50_ms": round(p50, 2),
                "p90_ms": round(p90, 2),
                "p99_ms": round(p99, 2),
                "max_ms": round(extra["max"], 2),
            }
            delay["histogram"] = [
                {"le_ms": int(r["le"]), "count": int(r["count"])}
                for r in tl.where(F.col("delay_ms").isNotNull())
                .select(F.pow(F.lit(2), F.ceil(F.log2(F.greatest(F.col("delay_ms"), F.lit(1.0))))).alias("le"))
                .groupBy("le")
                .count()
                .orderBy("le")
                .collect()
            ]

        def listed(cond: str, frame: Any = lc) -> list[dict[str, Any]]:
            return [
                r.asDict() for r in frame.where(cond).select("id", "bucket").orderBy("id").limit(max_listed).collect()
            ]

        report["tiers"][name] = {
            **totals,
            "unexpected": int(extra["unexpected"] or 0),
            "tier_messages": int(extra["tier_messages"] or 0),
            "delay": delay,
            "buckets": rows,
            "lost_ids": listed("NOT present AND outcome IN ('acked', 'not_asked')"),
            "duplicated_ids": listed("copies > 1"),
            "corrupted_ids": listed("corrupt = 1"),
            "unexpected_ids": [r["id"] for r in tl.where("NOT known").select("id").limit(100).collect()],
        }
        tl.unpersist()
        lc.unpersist()
    led.unpersist()
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
