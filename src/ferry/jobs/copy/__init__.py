"""`ferry copy SRC DST`: the general copy job on Spark.

Plan (on the driver, nothing changes): resolve names, check that sources exist
and count them, check the destination, decide the mode and the resume point.
Execute (on Spark), one of:

- JetStream -> JetStream: each task reads its sequence ranges and publishes
  them itself, so no message crosses the JVM (:func:`per_task`);
- stream or Parquet -> anything else: read with the jetstream data source (or
  Spark's Parquet reader) and write each partition with ``mapInArrow`` so every
  task's counts come back to the driver;
- RabbitMQ queues -> anything: one mover task per queue (``move_queue``).

JetStream -> JetStream modes:

- ``ordered`` (default): one writer; every publish expects its predecessor as
  the destination's last message, so sequence order is kept exactly; a rerun
  resumes after the source sequence of the destination's last message
  (``Ferry-Source-Seq``).
- ``parallel`` (``--partitions N``): N sequence ranges copied at once; order is
  kept within each range only. A rerun first reads which source sequences the
  destination already holds and copies only the others (an anti-join), so it
  stores nothing twice even after the duplicate window has passed.
"""

from ferry.jobs.copy.plan import CopyOptions, CopyPlan, plan_copy
from ferry.jobs.copy.run import CopyReport, run_copy

__all__ = ["CopyOptions", "CopyPlan", "CopyReport", "plan_copy", "run_copy"]
