"""`ferry snapshot SRC --out DIR`: what a stream or queue holds, as Parquet in the common schema.

- a stream (``jetstream://CLUSTER/STREAM``) is read through the jetstream data
  source; nothing changes on the stream;
- queues (``rabbitmq://CLUSTER/VHOST/QUEUE``; vhost ``*`` for all, the queue a
  glob) are read as ``ferry copy`` reads them without ``--drain``: one task per
  queue consumes every ready message without acking and then closes its
  channels, so the broker requeues them all. The queue holds what it held, but
  those messages now have the redelivered flag set, and a quorum queue counts
  the read as a delivery (``x-delivery-count``): a queue with a delivery limit
  is refused, since a snapshot could dead-letter its messages.

Both are a copy into ``parquet://DIR`` (``ferry.jobs.copy``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ferry.brokers.rabbitmq import queue_path
from ferry.errors import ConfigError, UsageError
from ferry.jobs.copy.plan import CopyOptions, plan_copy
from ferry.jobs.copy.run import run_copy
from ferry.topology import Topology
from ferry.uris import parse_uri

__all__ = ["snapshot"]


def snapshot(
    topology: Topology,
    spark: Callable[[], Any],
    source: str,
    out: Path,
    progress: Callable[[int], AbstractContextManager[Callable[[int], None]]] | None = None,
) -> dict[str, Any]:
    """What a stream or queues hold, into Parquet at `out` (a federated queue too: it is read
    without pulling from its upstream, see queue_io.snapshot_queue). The snapshot is reported
    to what `progress(messages planned)` gives (it is called with the messages read).
    `spark()` gives the session, asked for once the source is known good: bad input is refused
    without starting a JVM."""
    src = parse_uri(source)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"snapshot directory {out} is not empty")
    if src.kind not in ("jetstream", "rabbitmq"):
        raise UsageError(f"{source!r}: snapshot reads a jetstream:// stream or rabbitmq:// queues")
    plan = plan_copy(topology, source, f"parquet://{out.absolute()}", CopyOptions())
    if src.kind == "rabbitmq" and not plan.queues:
        raise ConfigError(f"{source!r}: no queue to snapshot")
    session = spark()  # before the bar: its clock and rate count the copy, not the JVM's start
    with progress(plan.messages) if progress else contextlib.nullcontext() as advance:
        report = run_copy(topology, plan, session, advance)
    result = {"source": source, "out": str(out), "messages": report.read, "seconds": round(report.seconds, 2)}
    if src.kind == "rabbitmq":
        result["queues"] = [queue_path(x["vhost"], x["queue"]) for x in plan.queues]
        result["note"] = "queues were read and requeued: their messages now carry the redelivered flag"
    return result
