"""Benchmark: ferry on a secured super-cluster against the same on a plaintext one, same run.

Two labs side by side: `supercluster` (users and passwords, plaintext) and `supercluster --secure`
(operator mode, .creds files, TLS on every port with client certificates). In each, alternately:

- copy: `ferry copy` of an R3 stream of 1 kB messages in east into a new stream in west (Spark,
  the data plane's own client); the rate is messages / seconds of the copy job;
- move: `ferry move` of an R3 stream (prefilled) from east to west while producers on west publish
  at 3,500 msg/s core and 3,500 msg/s JetStream (bench/move.py's case); lost counted by Ferry-Id.

Then two rabbit-dr labs side by side, plaintext and `--secure` (AMQP and the management API on TLS
only, client certificates required), alternately:

- rabbitmq copy: `ferry copy rabbitmq://pc1/%2F/bench-* rabbitmq://ltm/%2F/* --drain` of 10 queues
  of 1 kB messages (the queue mover's own AMQP client); the rate is messages / seconds of the copy.

Target: secure >= 0.8x plaintext throughput (each broker's copy, and the move: plaintext's time over
secure's); move 0 lost on both.

    .venv/bin/python -m bench.secure            # 100,000 messages copied, 3 rounds
    .venv/bin/python -m bench.secure --quick    # 20,000, 1 round
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

from bench._util import lab_root, run_ferry, save_rows
from bench.copy import QUEUES, fill_queues
from bench.move import make, one
from ferry import lab
from ferry.topology import load_topology

LABS = ("plain", "secure")


def copy_round(topology: Path, n: int, i: int) -> dict[str, Any]:
    asyncio.run(make(load_topology(topology), "CP_SRC", n))
    args = ["copy", "jetstream://east/CP_SRC", f"jetstream://west/CP_DST_{i}", "--create", "--subject-prefix", f"c{i}."]
    r = run_ferry(args, topology)
    report = r["report"]
    assert report["stored"] == n, report
    return {"copied": n, "rate": n / report["seconds"], "wall_s": r["wall"], "cpu_s": r["cpu"]}


def rabbit_round(topology: Path, n: int) -> dict[str, Any]:
    asyncio.run(fill_queues(load_topology(topology), "pc1", n // len(QUEUES), 1000))
    r = run_ferry(["copy", "rabbitmq://pc1/%2F/bench-*", "rabbitmq://ltm/%2F/*", "--drain"], topology)
    report = r["report"]
    assert report["stored"] == n // len(QUEUES) * len(QUEUES), report
    return {"copied": report["stored"], "rate": report["stored"] / report["seconds"], "wall_s": r["wall"]}


def _labs(root: Path, profile: str) -> dict[str, Path]:
    roots = {name: root / f"{profile}-{name}" for name in LABS}
    for name, where in roots.items():
        where.mkdir(mode=0o755)
        lab.up(profile, where, log=lambda _: None, secure=name == "secure")
    return roots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="20,000 messages, one round")
    args = parser.parse_args()
    n, runs = (20_000, 1) if args.quick else (args.messages, args.runs)
    root = lab_root()
    rows: list[dict[str, Any]] = []
    roots: dict[str, Path] = {}
    try:
        roots = _labs(root, "supercluster")
        for i in range(runs):
            for name, where in roots.items():
                topology = where / "topology.yaml"
                row = {"broker": "jetstream", "lab": name, "round": i, **copy_round(topology, n, i)}
                moved = one(load_topology(topology), topology, "ferry", 3500, 5_000, where / "work")
                row |= {"move_" + k: moved[k] for k in ("sent", "lost", "took_s", "unavailable_s")}
                rows.append(row)
                print(json.dumps(row), flush=True)
        for where in roots.values():
            lab.down(root=where, log=lambda _: None)
        roots = _labs(root, "rabbit-dr")
        for i in range(runs):
            for name, where in roots.items():
                rows.append({"broker": "rabbitmq", "lab": name, "round": i, **rabbit_round(where / "topology.yaml", n)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for where in roots.values():
            lab.down(root=where, log=lambda _: None)
    print()
    print(
        f"{'copy':10} {'lab':7} {'msg/s':>8} {'ratio':>6} {'move sent':>9} {'lost':>5} {'move s':>7} "
        f"{'ratio':>6} {'window ms':>9}"
    )

    def median(broker: str, lab_name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if (r["broker"], r["lab"]) == (broker, lab_name))

    for broker in ("jetstream", "rabbitmq"):
        for name in LABS:
            mine = [r for r in rows if (r["broker"], r["lab"]) == (broker, name)]
            rate = median(broker, name, "rate")
            move = ""
            if broker == "jetstream":  # the move's ratio: plaintext's time over this lab's (its throughput)
                took = median(broker, name, "move_took_s")
                move = (
                    f" {sum(r['move_sent'] for r in mine):>9,} {sum(r['move_lost'] for r in mine):>5} {took:>7.2f} "
                    f"{median(broker, 'plain', 'move_took_s') / took:>5.2f}x "
                    f"{max(r['move_unavailable_s'] for r in mine) * 1000:>9.1f}"
                )
            print(f"{broker:10} {name:7} {rate:>8,.0f} {rate / median(broker, 'plain', 'rate'):>5.2f}x{move}")
    save_rows("secure", rows)


if __name__ == "__main__":
    main()
