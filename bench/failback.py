"""Benchmark: the bash gist's fail-back protocol against `ferry failback`, same data, same run.

The setting is the rabbit-dr lab (`ferry.lab.scenarios.dr_federation`): queues
federated from art on pc1 and ltm, the orphaned messages on ltm. For each data
shape (10 queues x 10,000 messages, 100 queues x 1,000), each contender starts
from the same freshly loaded queues:

- **gist**: ../shared/seeds/003 reproduced faithfully — every 10 s, list the
  federated queues with messages from the management API; if there are any,
  clone each upstream as `<name>-to-restore` and delete it, delete the shovels
  of drained queues, and create shovels (`transfer-<queue>`, ferry's shovel
  definition with RabbitMQ's default prefetch, as the gist leaves it) until 5
  are active; when none is left, delete the shovels and restore the upstreams;
- **ferry shovel** and **ferry spark**: `ferry failback --from ltm --to pc1`
  (the CLI in its own process, start-up and Spark session included).

Time is until every message is on pc1 and the upstreams are restored. Each run
is checked: ltm's federated queues empty, pc1 holding every message, the
upstream restored; then pc1's queues are drained and their messages counted by
message id: `dups` is what arrived more than once. Targets: ferry <= 0.5x the
gist's time; 0 duplicates for both engines in every run.

    .venv/bin/python -m bench.failback            # both shapes, 1 run each
    .venv/bin/python -m bench.failback --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import Counter
from pathlib import Path
from statistics import median
from typing import Any

from bench._util import lab_root, run_ferry, save_rows
from ferry import lab
from ferry.brokers.rabbitmq import Management, amqp_connect, q
from ferry.brokers.rabbitmq.wire import QueueCounts
from ferry.jobs.dr_failback.engines import shovel_definition
from ferry.jobs.dr_failback.plan import FailbackRequest
from ferry.lab.scenarios import dr_federation
from ferry.topology import Topology, load_topology

VHOST = "bench"


async def reset(topo: Topology, queues: list[str]) -> None:
    for name in ("art", "pc1", "ltm"):
        async with Management(topo.rabbitmq(name), name=name) as m:
            await m.delete(f"/vhosts/{VHOST}")
    await dr_federation(topo, [VHOST], queues, plain=0, upstream_messages=10)


def load(topology: Path, queues: int, per_queue: int, ledger: Path) -> None:
    import subprocess
    import sys

    subprocess.run(
        [sys.executable, "-m", "ferry", "load", f"rabbitmq://ltm/{VHOST}", "--subject", "fed-{n}",
         "--subjects", str(queues), "--count", str(queues * per_queue), "--producers", "2", "--ledger", str(ledger)],
        env={**os.environ, "FERRY_TOPOLOGY": str(topology)}, check=True, capture_output=True,
    )  # fmt: skip


async def listed(topo: Topology, queues: list[str], per_queue: int, timeout: float = 60.0) -> None:
    """Until the management API lists every loaded message: its figures lag the queues by up to a
    statistics interval, and the gist reads them (a queue listed empty is taken as drained)."""
    deadline = time.monotonic() + timeout
    async with Management(topo.rabbitmq("ltm"), name="ltm") as m:
        while True:
            shown = {x["name"]: x.get("messages", 0) for x in await m.get(f"/queues/{VHOST}")}
            if all(shown.get(queue) == per_queue for queue in queues):
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"the management API did not list the loaded messages within {timeout:.0f} s")
            await asyncio.sleep(0.5)


async def gist(topo: Topology, max_active: int = 5, poll: float = 10.0) -> float:
    """The gist's `transfer` loop around `_idempotent_transfer`, against the management API."""
    req = FailbackRequest(source="ltm", target="pc1")
    t0 = time.monotonic()
    async with Management(topo.rabbitmq("ltm"), name="ltm") as m:
        while True:
            queues = [
                x
                for x in await m.get(f"/queues/{VHOST}")
                if "federation-upstream" in (x.get("effective_policy_definition") or {}) and x.get("messages", 0) > 0
            ]
            shovels = {s["name"] for s in await m.get(f"/parameters/shovel/{VHOST}", ok404=True) or []}
            if not queues:  # "There are no orphaned messages to transfer"
                for name in shovels:
                    await m.delete(f"/parameters/shovel/{VHOST}/{name}")
                for u in await m.get(f"/parameters/federation-upstream/{VHOST}"):
                    if u["name"].endswith("-to-restore"):
                        original = u["name"].removesuffix("-to-restore")
                        await m.put(f"/parameters/federation-upstream/{VHOST}/{original}", {"value": u["value"]})
                        await m.delete(f"/parameters/federation-upstream/{VHOST}/{q(u['name'])}")
                return time.monotonic() - t0
            for u in await m.get(f"/parameters/federation-upstream/{VHOST}"):  # disable: clone, then delete
                if not u["name"].endswith("-to-restore"):
                    clone = f"{u['name']}-to-restore"
                    await m.put(f"/parameters/federation-upstream/{VHOST}/{clone}", {"value": u["value"]})
                    await m.delete(f"/parameters/federation-upstream/{VHOST}/{q(u['name'])}")
            names = {x["name"] for x in queues}
            for name in list(shovels):  # terminate the transfers of drained queues
                if name.removeprefix("transfer-") not in names:
                    await m.delete(f"/parameters/shovel/{VHOST}/{q(name)}")
                    shovels.discard(name)
            for x in queues:
                if len(shovels) >= max_active:
                    break
                name = f"transfer-{x['name']}"
                if name not in shovels:
                    value = shovel_definition(topo, req, {"vhost": VHOST, "queue": x["name"], "target": x["name"]})
                    del value["src-prefetch-count"]  # the gist's: RabbitMQ's default (1,000)
                    await m.put(f"/parameters/shovel/{VHOST}/{q(name)}", {"value": value})
                    shovels.add(name)
            await asyncio.sleep(poll)


async def check(topo: Topology, queues: list[str], per_queue: int) -> None:
    """Every message on pc1, none left on ltm, the upstream back."""
    ltm, pc1 = QueueCounts(topo.rabbitmq("ltm")), QueueCounts(topo.rabbitmq("pc1"))
    try:
        for queue in queues:
            left, there = await ltm.ready(VHOST, queue), await pc1.ready(VHOST, queue)
            if left or there < per_queue:
                raise SystemExit(f"check failed for {queue}: ltm {left}, pc1 {there}")
    finally:
        await ltm.close()
        await pc1.close()
    async with Management(topo.rabbitmq("ltm"), name="ltm") as m:
        if await m.get(f"/parameters/federation-upstream/{VHOST}/art", ok404=True) is None:
            raise SystemExit("check failed: upstream art not restored")


async def duplicates(topo: Topology, queues: list[str]) -> int:
    """Drain pc1's queues; the messages beyond one per message id."""
    conn = await amqp_connect(topo.rabbitmq("pc1"), vhost=VHOST)
    seen: Counter[str] = Counter()
    try:
        ch = await conn.channel()
        await ch.set_qos(prefetch_count=1000)
        for name in queues:
            queue = await ch.declare_queue(name, passive=True)
            while (m := await queue.get(no_ack=True, fail=False, timeout=10)) is not None:
                seen[m.message_id or ""] += 1
    finally:
        await conn.close()
    return sum(n - 1 for n in seen.values())


def bench(root: Path, runs: int) -> list[dict[str, Any]]:
    state = lab.up("rabbit-dr", root, log=lambda _: None)
    topology = state.path / "topology.yaml"
    topo = load_topology(topology)
    rows = []
    for n_queues, per_queue in ((10, 10_000), (100, 1_000)):
        queues = [f"fed-{i}" for i in range(n_queues)]
        case = f"{n_queues} x {per_queue:,}"
        for run in range(runs):
            for who in ("gist (5 shovels, 10 s polls)", "ferry --engine shovel", "ferry --engine spark"):
                asyncio.run(reset(topo, queues))
                load(topology, n_queues, per_queue, root / f"ledger-{time.monotonic_ns()}")
                asyncio.run(listed(topo, queues, per_queue))
                if who.startswith("gist"):
                    seconds, report = asyncio.run(gist(topo)), None
                else:
                    engine = who.rsplit(" ", 1)[1]
                    got = run_ferry(["failback", "--from", "ltm", "--to", "pc1", "--engine", engine], topology)
                    seconds, report = got["wall"], got["report"]
                asyncio.run(check(topo, queues, per_queue))
                dups = asyncio.run(duplicates(topo, queues))
                rows.append(
                    {
                        "case": case,
                        "who": who,
                        "run": run,
                        "seconds": seconds,
                        "moved": report["total"]["moved"] if report else None,
                        "possible_duplicates": report["possible_duplicates"] if report else None,
                        "duplicates": dups,
                    }
                )
                print(f"{case:12} {who:30} {seconds:7.1f}s {dups:6} duplicates", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    root = lab_root()
    try:
        rows = bench(root, args.runs)
    finally:
        lab.down(root=root, log=lambda _: None)
    print(f"\n{'case':12} {'who':30} {'median s':>9} {'ratio':>6} {'moved (exact)':>14} {'dups per run':>14}")
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        anchor = median(r["seconds"] for r in mine if r["who"].startswith("gist"))
        for who in dict.fromkeys(r["who"] for r in mine):
            runs = [r for r in mine if r["who"] == who]
            secs = median(r["seconds"] for r in runs)
            moved = "-" if runs[-1]["moved"] is None else runs[-1]["moved"]
            dups = ",".join(str(r["duplicates"]) for r in runs)
            print(f"{case:12} {who:30} {secs:9.1f} {secs / anchor:5.2f}x {moved:>14} {dups:>14}")
    save_rows("failback", rows)


if __name__ == "__main__":
    main()
