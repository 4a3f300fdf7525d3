"""The check after a fail-back's transfer: each target queue holds what it held before plus what
moved, counted from the broker (passive declares: the management API lags by seconds); where it
holds more, a bounded read that consumes nothing names the message ids it holds twice."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

from ferry.brokers.rabbitmq.queue_io import snapshot_queue
from ferry.brokers.rabbitmq.wire import QueueCounts
from ferry.headers import TRANSFER_HDR
from ferry.topology import RabbitCluster

SAMPLE = 100_000  # messages read at most per target queue to name its duplicated ids
NAMED = 10  # duplicated ids named per queue


async def verify(
    cluster: RabbitCluster, name: str, transfer_id: str, rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One check per target queue of `rows` (the report's queue rows; several rows share a target
    with --target-queue). A target with consumers is not checked: what they took is not counted."""
    targets: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        targets.setdefault((r["vhost"], r["target"]), []).append(r)
    checks = []
    counts = QueueCounts(cluster, name)
    try:
        for (vhost, queue), group in targets.items():
            held, consumers = await counts.state(vhost, queue)
            # before: from the plan; a killed run's messages that came back already there moved once
            delivered = sum(r["moved"] - r.get("already_there", 0) for r in group)
            expected = group[0]["target_before"] + delivered
            check: dict[str, Any] = {
                "vhost": vhost,
                "queue": queue,
                "sources": [r["queue"] for r in group],
                "moved": delivered,
                "expected": expected,
                "held": held,
                "consumers": consumers,
                "extra": None if consumers else held - expected,
                "duplicates": None,  # messages held more than once, where known
                "duplicate_ids": [],
                "sampled": 0,
                "marked": None,  # messages carrying this fail-back's x-ferry-transfer (spark engine)
            }
            if consumers:
                check["verdict"] = f"not checked: {consumers} consumer(s) on the target"
            elif held == expected:
                check["duplicates"], check["verdict"] = 0, "ok"
            elif held < expected:
                check["verdict"] = f"{expected - held:,} fewer than expected: consumed on the target meanwhile?"
            else:
                await _sample(cluster, name, check, transfer_id)
            checks.append(check)
    finally:
        await counts.close()
    return checks


async def read_target(
    cluster: RabbitCluster, name: str, vhost: str, queue: str, transfer_id: str
) -> tuple[list[tuple[str, bool]], bool]:
    """Up to SAMPLE messages of a target queue, none consumed (they are requeued, flagged
    redelivered): each one's message id ("" without one) and whether it carries `transfer_id`'s
    mark; and whether the read ended before SAMPLE."""
    rows: list[tuple[str, bool]] = []
    reader = snapshot_queue(cluster, name, vhost, queue, batch_size=5_000)
    async with contextlib.aclosing(reader):
        async for batch in reader:
            columns = batch.column("msg_id").to_pylist(), batch.column("headers").to_pylist()
            for msg_id, headers in zip(*columns, strict=True):
                rows.append((msg_id or "", bool(headers) and dict(headers).get(TRANSFER_HDR) == transfer_id))
            if len(rows) >= SAMPLE:
                return rows, False
    return rows, True


async def _sample(cluster: RabbitCluster, name: str, check: dict[str, Any], transfer_id: str) -> None:
    """Read up to SAMPLE messages of the target queue and count the ids held more than once."""
    rows, _ = await read_target(cluster, name, check["vhost"], check["queue"], transfer_id)
    ids = Counter(i for i, _ in rows if i)
    marked = sum(m for _, m in rows)
    check["sampled"] = len(rows)
    whole = check["sampled"] >= check["held"]
    twice = sorted(i for i, n in ids.items() if n > 1)
    check["marked"] = marked or None
    check["duplicate_ids"] = twice[:NAMED]
    extra = f"{check['extra']:,} more than expected"
    of = f"{check['sampled']:,} read" + ("" if whole else f" of {check['held']:,}")
    if ids:
        check["duplicates"] = sum(ids[i] - 1 for i in twice)
        check["verdict"] = f"{extra}; {check['duplicates']:,} held twice by message id ({of})"
    elif marked and whole:  # the spark engine's mark: what it published beyond what left the source
        check["duplicates"] = max(0, marked - check["moved"])
        check["verdict"] = f"{extra}; {marked:,} carry this fail-back's mark for {check['moved']:,} moved"
    else:
        check["verdict"] = f"{extra}; no message ids to name duplicates by ({of})"
