"""Benchmark: the same ferry jobs on ``local[2]`` and on the lab's standalone Spark cluster, same run.

The cluster is ``ferry lab up spark``: a master and two workers (1 core, 2 GiB each) whose
executors run a Python with pyspark's dependencies and nothing of ferry's, so every run on it
ships ferry (issue 48). Each job runs as a ``ferry`` command in its own process, three ways:
``local[2]`` (the anchor), the cluster with one worker (the other stopped), the cluster with both.

- copy, JetStream: an R3 stream in east to an R3 stream in west that takes batches, ``--partitions 2``;
- copy, RabbitMQ: 10 queues moved from pc1 to ltm (``--drain``);
- audit: a ledger of N rows against a tier of about N rows (bench.audit's data, 0.1 % faults).

Reported per run: wall time, start-up (process start to the ``spark`` event: the driver's JVM,
the executors and, on the cluster, shipping ferry and checking the executors), the job's own
seconds and its rate, and the shipping figures (zip size, ``ship_s``). The ratio is the cluster's
wall time to local's. The copies' counts are checked, the audits' must agree.

    .venv/bin/python -m bench.spark_cluster                  # 1,000,000 messages, audit 10,000,000 rows
    .venv/bin/python -m bench.spark_cluster --quick          # 100,000 and 1,000,000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

from bench import audit as audit_bench
from bench import copy as copy_bench
from bench._util import lab_root, run_ferry, save_rows
from ferry import lab
from ferry.topology import load_topology

PLACES = ("local[2]", "cluster, 1 worker", "cluster, 2 workers")


def _env(spark: lab.LabState, place: str) -> dict[str, str]:
    if place == "local[2]":
        return {"FERRY_SPARK_MASTER": "local[2]"}
    return {"FERRY_SPARK_MASTER": spark.spark["master"], "PYSPARK_PYTHON": spark.spark["python"]}


def _workers(root: Path, n: int) -> None:
    """The cluster with `n` workers alive in its master's eyes (the second stopped, or started again)."""
    from ferry.lab import spark as lab_spark

    state = lab.up("spark", root, log=lambda _: None)  # starts a stopped worker; waits until it is registered
    if n == 1:
        state.proc("spark-worker-2").stop()
        state.save()
    deadline = time.monotonic() + 120  # the master takes a worker for dead after its heartbeat timeout
    while sum(h == "ok" for k, h in lab_spark.health(state.spark).items() if "worker" in k) != n:
        assert time.monotonic() < deadline, lab_spark.health(state.spark)
        time.sleep(1)


def _row(job: str, place: str, run: dict[str, Any], messages: int, seconds: float | None) -> dict[str, Any]:
    event = next(e for e in run["events"] if e["event"] == "spark")
    startup = event["t"] - run["started"]
    job_s = seconds if seconds is not None else run["wall"] - startup
    shipped = event.get("shipped", {})
    return {
        "job": job,
        "place": place,
        "messages": messages,
        "wall": run["wall"],
        "startup": startup,
        "job_s": job_s,
        "rate": messages / job_s,
        "ship_s": shipped.get("ship_s"),
        "zip_mb": shipped.get("bytes", 0) / 1e6 or None,
        "client_cpu": run["cpu"],
    }


def _each_place(root: Path, spark: lab.LabState, job: str, go: Any) -> list[dict[str, Any]]:
    rows = []
    for place in PLACES:
        if place != "local[2]":
            _workers(root, 1 if "1 worker" in place else 2)
        print(f"{job}: {place}", flush=True)
        saved = {k: os.environ.get(k) for k in ("FERRY_SPARK_MASTER", "PYSPARK_PYTHON")}
        os.environ.update(_env(spark, place))
        try:
            rows.append(go(place))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return rows


def bench_jetstream(root: Path, spark: lab.LabState, n: int) -> list[dict[str, Any]]:
    state = lab.up("supercluster", root, log=lambda _: None)
    topo = load_topology(state.path / "topology.yaml")
    print(f"jetstream: filling R3 stream SRC in east with {n:,} messages of 100 bytes", flush=True)

    async def fill() -> None:
        from ferry.brokers import nats as bnats
        from ferry.brokers.nats.publish import Publisher

        await copy_bench._stream(topo, "east", "SRC", subjects=["bench.>"])
        async with bnats.session(topo.nats("east")) as nc, Publisher(nc, window=2048) as pub:
            for i in range(n):
                await pub.publish(f"bench.{i % 100}", b"x" * 100, msg_id=f"m{i}")

    asyncio.run(fill())

    def go(place: str) -> dict[str, Any]:
        asyncio.run(copy_bench._stream(topo, "west", "DST", subjects=["c.bench.>"], allow_batched=True))
        args = ["copy", "jetstream://east/SRC", "jetstream://west/DST", "--subject-prefix", "c.", "--partitions", "2"]
        run = run_ferry(args, state.path / "topology.yaml")
        assert asyncio.run(copy_bench._count(topo, "west", "DST")) == n, f"{place}: the copy is short"
        asyncio.run(copy_bench._delete(topo, "west", "DST"))
        return _row("copy jetstream R3->R3", place, run, n, run["report"]["seconds"])

    rows = _each_place(root, spark, "copy jetstream", go)
    lab.down("supercluster", root, log=lambda _: None)
    return rows


def bench_rabbitmq(root: Path, spark: lab.LabState, n: int) -> list[dict[str, Any]]:
    state = lab.up("rabbit-dr", root, log=lambda _: None)
    topo = load_topology(state.path / "topology.yaml")
    per_queue = n // len(copy_bench.QUEUES)
    total = per_queue * len(copy_bench.QUEUES)

    def go(place: str) -> dict[str, Any]:
        print(f"rabbitmq: filling 10 queues on pc1 with {total:,} messages", flush=True)
        asyncio.run(copy_bench.fill_queues(topo, "pc1", per_queue, 100))
        run = run_ferry(
            ["copy", "rabbitmq://pc1/%2F/bench-*", "rabbitmq://ltm/%2F/*", "--drain"], state.path / "topology.yaml"
        )
        assert run["report"]["read"] == total == asyncio.run(copy_bench._depths(topo, "ltm")), place
        return _row("copy rabbitmq 10 queues", place, run, total, run["report"]["seconds"])

    rows = _each_place(root, spark, "copy rabbitmq", go)
    lab.down("rabbit-dr", root, log=lambda _: None)
    return rows


def bench_audit(root: Path, spark: lab.LabState, n: int) -> list[dict[str, Any]]:
    data = root / "audit"
    data.mkdir()
    print(f"audit: generating a ledger of {n:,} rows and its tier", flush=True)
    audit_bench.generate(data, n)
    (data / "tier").mkdir()
    (data / "tier.parquet").rename(data / "tier" / "part-0.parquet")
    counts: list[dict[str, Any]] = []

    def go(place: str) -> dict[str, Any]:
        html = data / f"{place.replace(' ', '_')}.html"
        args = ["audit", "--ledger", str(data / "ledger"), "--tier", f"t={data / 'tier'}", "--html", str(html)]
        args += ["--max-lost", str(n), "--max-dup", str(n)]
        run = run_ferry(args, root / "topology.yaml")
        t = run["report"]["tiers"]["t"]
        counts.append({k: t[k] for k in audit_bench._KEYS})
        assert counts[-1] == counts[0], f"{place} counted otherwise: {counts}"
        return _row("audit ledger vs tier", place, run, n, None)

    return _each_place(root, spark, "audit", go)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--rows", type=int, default=10_000_000, help="the audit's ledger")
    parser.add_argument("--quick", action="store_true", help="100,000 messages, 1,000,000 rows")
    parser.add_argument("--only", choices=["jetstream", "rabbitmq", "audit"])
    args = parser.parse_args()
    n, rows_n = (100_000, 1_000_000) if args.quick else (args.messages, args.rows)
    root = lab_root()
    rows: list[dict[str, Any]] = []
    try:
        spark = lab.up("spark", root, log=lambda _: None)
        if args.only in (None, "jetstream"):
            rows += bench_jetstream(root, spark, n)
        if args.only in (None, "rabbitmq"):
            rows += bench_rabbitmq(root, spark, n)
        if args.only in (None, "audit"):
            rows += bench_audit(root, spark, rows_n)
    finally:
        lab.down(root=root, log=lambda _: None)
    print(
        f"\n{'job':26} {'where':20} {'messages':>10} {'wall s':>7} {'start s':>7} {'job s':>6} {'msg/s':>8} "
        f"{'ship s':>6} {'zip MB':>6} {'x local':>7}"
    )
    local = {r["job"]: r["wall"] for r in rows if r["place"] == "local[2]"}
    for r in rows:
        r["ratio"] = r["wall"] / local[r["job"]]
        ship = f"{r['ship_s']:.1f}" if r["ship_s"] is not None else "-"
        zipped = f"{r['zip_mb']:.1f}" if r["zip_mb"] else "-"
        print(
            f"{r['job']:26} {r['place']:20} {r['messages']:>10,} {r['wall']:>7.1f} {r['startup']:>7.1f} "
            f"{r['job_s']:>6.1f} {r['rate']:>8,.0f} {ship:>6} {zipped:>6} {r['ratio']:>6.2f}x"
        )
    print(f"rows: {save_rows('spark_cluster', rows)}")


if __name__ == "__main__":
    main()
