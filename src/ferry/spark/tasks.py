"""ferry's Spark jobs' building blocks: one task per index, the queue mover's tasks, a Parquet
write that leaves its directory as it was when it fails, and async reads driven from Spark's
synchronous calls."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa

from ferry.brokers.rabbitmq.queue_io import MoveResult, MoveTask, move_queue
from ferry.schema import BACKUP_RECORD
from ferry.spark.options import executor_task, per_index
from ferry.spark.session import no_job_after_interrupt

_MOVE_SCHEMA = pa.schema(
    [("vhost", pa.string()), ("queue", pa.string())]
    + [(name, pa.int64()) for name in ("before", "moved", "bytes", "redelivered", "duplicates", "left")]
    + [("seconds", pa.float64()), ("errors", pa.list_(pa.string()))]
)


def write_parquet(df: Any, out: Path, record: dict[str, Any] | None = None) -> tuple[int, int]:
    """Write `df` (the common schema) as Parquet into `out`, a new or empty directory, all at once:
    Spark writes beside it and the result is renamed into place, so a failed or interrupted write
    leaves `out` as it was (a rerun starts clean). `record` goes with the files, as JSON in
    BACKUP_RECORD (a name Spark and Arrow skip when they read the directory). Returns the rows and
    payload bytes written, counted as they were written (no second job reads them back)."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    out = out.absolute()
    partial = out.with_name(f".{out.name}.ferry-partial")
    shutil.rmtree(partial, ignore_errors=True)  # a write interrupted before
    written = Observation("written")
    try:
        counted = df.observe(written, F.count(F.lit(1)).alias("rows"), F.sum(F.length("payload")).alias("bytes"))
        counted.write.mode("error").parquet(str(partial))
        if record is not None:
            (partial / BACKUP_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        if out.exists():
            out.rmdir()
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    got = written.get
    return int(got["rows"]), int(got["bytes"] or 0)


def run_moves(spark: Any, tasks: list[MoveTask]) -> list[MoveResult]:
    """The data plane's queue mover: one Spark task per queue, each source message acked only
    after the sink confirmed it."""
    if not tasks:
        return []

    def move(i: int) -> dict[str, Any]:
        return asdict(asyncio.run(move_queue(tasks[i])))

    return [MoveResult(**r) for r in per_task(spark, len(tasks), move, _MOVE_SCHEMA)]


def per_task(spark: Any, n: int, fn: Callable[[int], dict[str, Any]], schema: pa.Schema) -> list[dict[str, Any]]:
    """fn(0), ..., fn(n - 1), each in a Spark task of its own: the rows (of `schema`) they return.
    None begins once Ctrl-C came."""
    no_job_after_interrupt()
    fn = executor_task(fn)
    if is_connect(spark):  # Spark Connect has no RDDs
        from pyspark.sql.pandas.types import from_arrow_schema

        rows = per_index(spark, n, lambda i: [pa.RecordBatch.from_pylist([fn(i)], schema)], from_arrow_schema(schema))
        return [r.asDict() for r in rows.collect()]
    # an RDD job needs none of Spark SQL's planning: its first task starts about a second sooner
    return spark.sparkContext.parallelize(range(n), n).map(fn).collect()


def cores(spark: Any) -> int:
    with contextlib.suppress(Exception):
        return int(spark.sparkContext.defaultParallelism)
    return 2


def is_connect(spark: Any) -> bool:
    return type(spark).__module__.startswith("pyspark.sql.connect")
