"""Benchmark: `ferry copy` against each system's native mover, same run, same machine.

- RabbitMQ, 10 queues: dynamic shovels (ack-mode on-confirm, src-delete-after
  queue-length, dest-queue, one per queue) from ltm to pc1, then ferry moves the
  same messages back from pc1 to ltm. Target: ferry >= 1.0x shovels.
- JetStream, R3 stream in east -> R3 stream in west: server-side stream sourcing
  (a stream in west with `sources: [SRC]`) against ferry ordered (one task) and
  ferry parallel with 1, 2 and 4 partitions, each into a plain stream (an ack per
  message) and into one with `allow_batched` (fast batch publishing). Target:
  ferry >= 0.5x sourcing.

Rates are messages / seconds of movement (ferry: the copy job, without the
Spark session start-up, which is reported separately as wall time). CPU: the
client process tree (ferry's driver, JVM and Python workers), and the brokers'
own processes, measured over the same interval; a second table gives the CPU-µs per
message of each (issue 51: the machine-independent figure).

    .venv/bin/python -m bench.copy                 # 1,000,000 messages of 100 bytes
    .venv/bin/python -m bench.copy --quick         # 100,000
    .venv/bin/python -m bench.copy --only jetstream --partitions 2 --batched-only --runs 3
                                                   # medians of three rounds, each against its own anchor
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

from bench._util import PeakRss, lab_root, mb, run_ferry, save_rows, tree
from ferry import lab
from ferry.brokers import nats as bnats
from ferry.brokers.nats.publish import Publisher
from ferry.brokers.rabbitmq import Management, q
from ferry.brokers.rabbitmq.queue_io import row_header
from ferry.brokers.rabbitmq.wire import Connection, raw_connect
from ferry.topology import Topology, load_topology

QUEUES = [f"bench-{i}" for i in range(10)]


def _pids(state: lab.LabState, kind: str) -> list[int]:
    return [p.pid for p in state.procs if p.kind == kind]


def _beam_pids(state: lab.LabState) -> list[int]:
    """The Erlang VMs (children of the rabbitmq-server wrapper shells)."""
    return [pid for p in state.procs if p.kind == "rabbitmq" for pid in tree(p.pid)]


async def _connect(topo: Topology, cluster: str) -> Connection:
    return await raw_connect(topo.rabbitmq(cluster), "/")


async def _depths(topo: Topology, cluster: str) -> int:
    conn = await _connect(topo, cluster)
    ch = await conn.channel()
    total = sum([await ch.declare_passive(name) for name in QUEUES])
    await conn.close()
    return total


async def fill_queues(topo: Topology, cluster: str, per_queue: int, size: int) -> None:
    for c in ("ltm", "pc1"):
        async with Management(topo.rabbitmq(c)) as m:
            for name in QUEUES:
                await m.delete(f"/queues/%2F/{q(name)}")
                await m.put(f"/queues/%2F/{q(name)}", {"durable": True, "arguments": {}})
    conn = await _connect(topo, cluster)
    ch = await conn.channel()
    await ch.confirm_select()
    confirmed = 0

    def on_confirm(seq: int, multiple: bool, ok: bool) -> None:
        nonlocal confirmed
        confirmed = seq

    ch.on_confirm = on_confirm
    body = b"x" * size
    header = row_header({"properties": {"delivery_mode": 2}}, None, size)
    sent = 0
    for name in QUEUES:
        for _ in range(per_queue):
            sent = ch.publish("", name, header, body)
            if sent - confirmed > 5000:
                await conn.drain()
                while sent - confirmed > 2000:
                    await asyncio.sleep(0.001)
    while confirmed < sent:
        await asyncio.sleep(0.01)
    await conn.close()


def _anchor_row(case: str, who: str, n: int, seconds: float, broker: PeakRss, round_: int) -> dict[str, Any]:
    """A native mover's row: it runs inside the brokers, so no client of its own."""
    return {
        "case": case,
        "who": who,
        "messages": n,
        "seconds": seconds,
        "rate": n / seconds,
        "wall": seconds,
        "client_cpu": 0.0,
        "broker_cpu": broker.cpu,
        "client_rss": 0,
        "broker_rss": broker.peak,
        "round": round_,
    }


def _ferry_row(case: str, who: str, run: dict[str, Any], broker: PeakRss, round_: int) -> dict[str, Any]:
    """A `ferry copy` row from :func:`run_ferry`'s result (rate over the copy job's own seconds)."""
    report = run["report"]
    return {
        "case": case,
        "who": who,
        "messages": report["read"],
        "seconds": report["seconds"],
        "rate": report["read"] / report["seconds"],
        "wall": run["wall"],
        "client_cpu": run["cpu"],
        "client_cpu_by_role": run["cpu_by_role"],
        "broker_cpu": broker.cpu,
        "client_rss": run["peak_rss"],
        "broker_rss": broker.peak,
        "round": round_,
    }


def bench_rabbitmq(root: Path, n: int, size: int, extra: list[str], runs: int = 1) -> list[dict[str, Any]]:
    state = lab.up("rabbit-dr", root, log=lambda _: None)
    topo = load_topology(state.path / "topology.yaml")
    per_queue = n // len(QUEUES)
    total = per_queue * len(QUEUES)
    beams = _beam_pids(state)

    # anchor: dynamic shovels ltm -> pc1
    ltm, pc1 = topo.rabbitmq("ltm"), topo.rabbitmq("pc1")
    pw = ltm.credentials.password()  # type: ignore[union-attr]
    src_uri = ltm.brokers[0].url.replace("amqp://", f"amqp://ferry:{pw}@")
    dst_uri = pc1.brokers[0].url.replace("amqp://", f"amqp://ferry:{pw}@")

    async def shovel() -> float:
        async with Management(ltm) as m:
            t0 = time.monotonic()
            for name in QUEUES:
                await m.put(
                    f"/parameters/shovel/%2F/bench-{name}",
                    {
                        "value": {
                            "src-uri": src_uri,
                            "src-queue": name,
                            "dest-uri": dst_uri,
                            "dest-queue": name,
                            "ack-mode": "on-confirm",
                            "src-delete-after": "queue-length",
                        }
                    },
                )
            while await _depths(topo, "pc1") < total:
                await asyncio.sleep(0.05)
            elapsed = time.monotonic() - t0
            for name in QUEUES:
                await m.delete(f"/parameters/shovel/%2F/bench-{name}")
        return elapsed

    rows: list[dict[str, Any]] = []
    for round_ in range(1, runs + 1):  # each round: fresh queues, shovels to pc1, ferry back to ltm
        print(f"rabbitmq (round {round_}): filling {len(QUEUES)} queues on ltm with {total:,} messages", flush=True)
        asyncio.run(fill_queues(topo, "ltm", per_queue, size))
        print(f"rabbitmq (round {round_}): shovels ltm -> pc1", flush=True)
        with PeakRss(pids=beams) as broker:
            seconds = asyncio.run(shovel())
        rows.append(_anchor_row("rabbitmq 10 queues", "shovels (anchor)", total, seconds, broker, round_))

        print(f"rabbitmq (round {round_}): ferry copy pc1 -> ltm", flush=True)
        with PeakRss(pids=beams) as broker:
            run = run_ferry(
                ["copy", "rabbitmq://pc1/%2F/*", "rabbitmq://ltm/%2F/*", "--drain", *extra],
                state.path / "topology.yaml",
            )
        report = run["report"]
        landed = asyncio.run(_depths(topo, "ltm"))
        assert report["read"] == landed == total, f"ferry moved {report['read']:,}, ltm holds {landed:,} of {total:,}"
        rows.append(_ferry_row("rabbitmq 10 queues", "ferry copy", run, broker, round_))
    lab.down("rabbit-dr", root, log=lambda _: None)
    return rows


async def _stream(topo: Topology, cluster: str, name: str, **config: Any) -> None:
    from nats.js.api import Placement, StreamConfig

    async with bnats.session(topo.nats(cluster)) as nc:
        jsm = nc.jsm()
        with contextlib.suppress(Exception):
            await jsm.delete_stream(name)
        await jsm.add_stream(StreamConfig(name=name, num_replicas=3, placement=Placement(cluster=cluster), **config))


async def _count(topo: Topology, cluster: str, name: str) -> int:
    async with bnats.session(topo.nats(cluster)) as nc:
        return int((await nc.jsm().stream_info(name)).state.messages)


async def _delete(topo: Topology, cluster: str, name: str) -> None:
    async with bnats.session(topo.nats(cluster)) as nc:
        await nc.jsm().delete_stream(name)


def bench_jetstream(
    root: Path, n: int, size: int, partitions: list[int], extra: list[str], runs: int = 1, batched_only: bool = False
) -> list[dict[str, Any]]:
    state = lab.up("supercluster", root, log=lambda _: None)
    topo = load_topology(state.path / "topology.yaml")
    print(f"jetstream: filling R3 stream SRC in east with {n:,} messages of {size} bytes", flush=True)

    async def fill() -> None:
        await _stream(topo, "east", "SRC", subjects=["bench.>"])
        body = b"x" * size
        async with bnats.session(topo.nats("east")) as nc, Publisher(nc, window=2048) as pub:
            for i in range(n):
                await pub.publish(f"bench.{i % 100}", body, msg_id=f"m{i}")

    asyncio.run(fill())
    rows: list[dict[str, Any]] = []
    for round_ in range(1, runs + 1):
        rows += _jetstream_round(state, topo, n, partitions, extra, batched_only, round_)
    lab.down("supercluster", root, log=lambda _: None)
    return rows


def _jetstream_round(
    state: lab.LabState,
    topo: Topology,
    n: int,
    partitions: list[int],
    extra: list[str],
    batched_only: bool,
    round_: int,
) -> list[dict[str, Any]]:
    """Sourcing, then each ferry case, on the filled stream SRC; each row tagged with the round."""
    servers = _pids(state, "nats")

    async def sourcing() -> float:
        from nats.js.api import StreamSource

        t0 = time.monotonic()
        await _stream(topo, "west", "NATIVE", sources=[StreamSource(name="SRC")])
        while await _count(topo, "west", "NATIVE") < n:
            await asyncio.sleep(0.05)
        return time.monotonic() - t0

    print(f"jetstream (round {round_}): server-side sourcing east -> west", flush=True)
    with PeakRss(pids=servers) as broker:
        seconds = asyncio.run(sourcing())
    rows = [_anchor_row("jetstream R3 east->west", "stream sourcing (anchor)", n, seconds, broker, round_)]
    asyncio.run(_delete(topo, "west", "NATIVE"))

    cases = [("ordered", [], False), ("ordered, batched", [], True)]
    for k in partitions:
        flags = ["--mode", "parallel", "--partitions", str(k)]
        cases += [(f"{k} partitions", flags, False), (f"{k} partitions, batched", flags, True)]
    cases = [c for c in cases if c[2] or not batched_only]
    for i, (label, flags, batched) in enumerate(cases):
        dest = f"COPY{i}"
        asyncio.run(_stream(topo, "west", dest, subjects=[f"c{i}.bench.>"], allow_batched=batched))
        print(f"jetstream (round {round_}): ferry copy {label}", flush=True)
        with PeakRss(pids=servers) as broker:
            run = run_ferry(
                [
                    "copy",
                    "jetstream://east/SRC",
                    f"jetstream://west/{dest}",
                    "--subject-prefix",
                    f"c{i}.",
                    *flags,
                    *extra,
                ],
                state.path / "topology.yaml",
            )
        assert asyncio.run(_count(topo, "west", dest)) == n, f"ferry {label} did not copy everything"
        rows.append(_ferry_row("jetstream R3 east->west", f"ferry copy {label}", run, broker, round_))
        asyncio.run(_delete(topo, "west", dest))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="100,000 messages")
    parser.add_argument("--only", choices=["rabbitmq", "jetstream"])
    parser.add_argument("--partitions", default="1,2,4", help="the parallel cases")
    parser.add_argument("--ferry-args", default="", help="extra arguments for every `ferry copy`")
    parser.add_argument("--runs", type=int, default=1, help="rounds of each anchor and every ferry case")
    parser.add_argument("--batched-only", action="store_true", help="JetStream: only the cases that batch")
    args = parser.parse_args()
    n = 100_000 if args.quick else args.messages
    root = lab_root()
    rows: list[dict[str, Any]] = []
    try:
        if args.only in (None, "rabbitmq"):
            rows += bench_rabbitmq(root, n, args.size, args.ferry_args.split(), args.runs)
        if args.only in (None, "jetstream"):
            partitions = [int(k) for k in args.partitions.split(",")]
            rows += bench_jetstream(
                root, n, args.size, partitions, args.ferry_args.split(), args.runs, args.batched_only
            )
    finally:
        lab.down(root=root, log=lambda _: None)
    print()
    header = (
        f"{'case':26} {'who':28} {'msgs':>9} {'msg/s':>8} {'ratio':>6} {'move s':>7} {'wall s':>7} "
        f"{'client cpu':>10} {'broker cpu':>10} {'client rss':>10} {'broker rss':>10}"
    )
    print(header)
    anchors = {(r["case"], r.get("round")): r["rate"] for r in rows if "anchor" in r["who"]}
    for r in rows:
        r["ratio"] = r["rate"] / anchors[r["case"], r.get("round")]
        print(
            f"{r['case']:26} {r['who']:28} {r['messages']:>9,} {r['rate']:>8,.0f} {r['ratio']:>5.2f}x "
            f"{r['seconds']:>7.1f} {r['wall']:>7.1f} {r['client_cpu']:>9.1f}s {r['broker_cpu']:>9.1f}s "
            f"{mb(r['client_rss']):>10} {mb(r['broker_rss']):>10}"
        )
    print("\nCPU-µs per message moved: ferry's driver, JVM and Python workers apart, and the brokers'")
    roles = ("driver", "jvm", "python workers", "other")
    print(f"{'case':26} {'who':28} " + " ".join(f"{r:>14}" for r in (*roles, "brokers", "all")))
    for r in rows:
        by = r.get("client_cpu_by_role") or {}
        per = [by.get(x, 0.0) for x in roles] + [r["broker_cpu"], r["client_cpu"] + r["broker_cpu"]]
        print(f"{r['case']:26} {r['who']:28} " + " ".join(f"{v / r['messages'] * 1e6:>14.1f}" for v in per))
    ratios: dict[str, list[float]] = {}
    for r in rows:
        if "anchor" not in r["who"]:
            ratios.setdefault(f"{r['case']}: {r['who']}", []).append(r["ratio"])
    if any(len(v) > 1 for v in ratios.values()):
        print("\nmedian ratio over the rounds (each against its own round's anchor)")
        for who, v in ratios.items():
            print(f"  {who:60} {statistics.median(v):.2f}x  ({', '.join(f'{x:.2f}' for x in v)})")
    save_rows("copy", rows)


if __name__ == "__main__":
    main()
