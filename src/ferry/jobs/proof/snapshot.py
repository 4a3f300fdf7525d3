"""`ferry snapshot SRC --out DIR`: what a stream or queue holds, as Parquet in the common schema.

- a stream (``jetstream://CLUSTER/STREAM``) is read through the jetstream data
  source; nothing changes on the stream;
- queues (``rabbitmq://CLUSTER/VHOST/QUEUE``; vhost ``*`` for all, the queue a
  glob) are read by one task per queue that consumes every ready message
  without acking and then closes its channels, so the broker requeues them all. The queue holds what it held,
  but those messages now have the redelivered flag set, and a quorum queue
  counts the read as a delivery (``x-delivery-count``): a queue with a delivery
  limit is refused, since a snapshot could dead-letter its messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pyarrow as pa

from ferry.brokers.rabbitmq import FEDERATION_KEYS, Management, effective_policy, q, queue_path
from ferry.brokers.rabbitmq.queue_io import snapshot_queue
from ferry.errors import ConfigError, UsageError
from ferry.jobs.copy.plan import CopyOptions, plan_copy
from ferry.jobs.copy.run import run_copy
from ferry.schema import SPARK_DDL
from ferry.spark.options import iterate, per_index, rabbit_cluster
from ferry.spark.tasks import write_parquet
from ferry.topology import RabbitCluster, Topology
from ferry.uris import parse_uri

__all__ = ["snapshot"]


def snapshot(
    topology: Topology,
    spark: Callable[[], Any],
    source: str,
    out: Path,
    federated: bool = False,
    progress: Callable[[int], AbstractContextManager[Callable[[int], None]]] | None = None,
) -> dict[str, Any]:
    """What a stream or queues hold, into Parquet at `out`. A federated queue is refused unless
    `federated`: reading it pulls messages from its upstream into it. A stream's snapshot is
    reported to what `progress(messages planned)` gives (it is called with the messages read).
    `spark()` gives the session, asked for once the source is known good: bad input is refused
    without starting a JVM."""
    src = parse_uri(source)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"snapshot directory {out} is not empty")
    if src.kind == "jetstream":
        plan = plan_copy(topology, source, f"parquet://{out.absolute()}", CopyOptions())
        session = spark()  # before the bar: its clock and rate count the copy, not the JVM's start
        with progress(plan.messages) if progress else contextlib.nullcontext() as advance:
            report = run_copy(topology, plan, session, advance)
        return {"source": source, "out": str(out), "messages": report.read, "seconds": round(report.seconds, 2)}
    if src.kind != "rabbitmq":
        raise UsageError(f"{source!r}: snapshot reads a jetstream:// stream or rabbitmq:// queues")
    cluster = topology.rabbitmq(src.cluster or "")
    queues = asyncio.run(_queues(cluster, src.cluster or "", src.vhost or "/", src.queue or "*", federated))
    if not queues:
        raise ConfigError(f"{source!r}: no queue to snapshot")
    cluster_json, name = cluster.model_dump_json(), src.cluster or ""

    def read(i: int) -> Iterator[pa.RecordBatch]:
        vhost, queue = queues[i]
        return iterate(snapshot_queue(rabbit_cluster(cluster_json), name, vhost, queue))

    count, _ = write_parquet(per_index(spark(), len(queues), read, SPARK_DDL), out)
    return {
        "source": source,
        "out": str(out),
        "messages": count,
        "queues": [queue_path(v, qn) for v, qn in queues],
        "note": "queues were read and requeued: their messages now carry the redelivered flag",
    }


async def _queues(
    cluster: RabbitCluster, name: str, vhost: str, queue: str, federated: bool = False
) -> list[tuple[str, str]]:
    async with Management(cluster, name=name) as m:
        vhosts = [v["name"] for v in await m.get("/vhosts")] if vhost == "*" else [vhost]
        policies = await m.get("/policies")
        found = []
        for v in vhosts:
            listed = await m.get(f"/queues/{q(v)}", ok404=True)
            if listed is None:
                raise ConfigError(f"vhost {v!r} does not exist on {name}")
            for item in listed:
                if not fnmatch.fnmatchcase(item["name"], queue):
                    continue
                where = queue_path(v, item["name"])
                limit = (item.get("arguments") or {}).get("x-delivery-limit") or (
                    item.get("effective_policy_definition") or {}
                ).get("delivery-limit")
                if limit:
                    raise ConfigError(
                        f"queue {where} has a delivery limit ({limit}): a snapshot counts "
                        "as a delivery and could dead-letter its messages; refusing"
                    )
                policy = effective_policy(policies, v, item["name"])
                if not federated and policy and any(k in policy["definition"] for k in FEDERATION_KEYS):
                    raise ConfigError(
                        f"queue {where} is federated (policy {policy['name']!r}): reading it would "
                        "pull messages from its upstream into it; --federated to read it all the same"
                    )
                found.append((v, item["name"]))
        if not found and "*" not in queue:
            raise ConfigError(f"queue {queue!r} not found in vhost {vhost!r} of {name}")
    return found
