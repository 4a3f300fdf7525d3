"""Benchmark: `ferry replicate` against native JetStream sourcing over a gateway, same load, same run.

Lab: the super-cluster (east and west, 3 servers each, joined by gateways). Two R1
streams in east take the same load in turn:

- ferry: `BENCH_F` relayed to west by one `ferry replicate run --from east --to west`
  process (destination `BENCH_F_W`, subjects prefixed `relay.`);
- native: `BENCH_N` in east, and in west a stream `BENCH_N_W` that sources it (the
  server copies over the gateway).

First, capacity: each source is loaded with a backlog of `--backlog` messages (1,000,000:
two of the relay's micro-batches, so its idle time between them counts) before anything
replicates it; then west's sourcing stream is created, and ferry's
relay started, and each drains its backlog alone. Drain rate = backlog over the time
from the first to the last message stored at west (server timestamps): the most each
can move on this machine, without the load generator taking its share of the cores.

Then lag: for each rate (default 2,000 to 50,000 msg/s), `ferry load` publishes for `--seconds`
(JetStream, acked, `--producers` 4) into each source in turn; then both
sides are read back. Lag per message = stored at west - stored at east (server
timestamps); throughput = messages over the time from the first store at east to the
last at west. A rate is sustained when the load generator offered it (97 %), everything arrived
and lag p99 < 1 s; the summary compares the highest rate sustained with every lower rate
sustained too.

Target (issue 7): ferry sustains >= 0.5x the native sourcing rate, with lag p99 < 1 s
at 10,000 msg/s. The ladder cannot find native's ceiling on 2 cores (the load generator
runs out first), so the ratio is the drain rates'.

    .venv/bin/python -m bench.replicate                   # 2k ... 50k msg/s, 20 s each
    .venv/bin/python -m bench.replicate --quick           # 2k, 5k msg/s, 8 s each; a 50,000 backlog
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._util import lab_root, save_rows
from ferry import lab
from ferry.brokers import nats as bnats
from ferry.brokers.nats.jsapi import stream_info, ts_ns
from ferry.brokers.nats.reader import Range, ReadConfig, read_range
from ferry.errors import FerryError
from ferry.topology import Topology, load_topology

FERRY = [sys.executable, "-m", "ferry"]


def run_ferry(topology: Path, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
    return subprocess.run([*FERRY, *args], env=env, capture_output=True, text=True, timeout=900, check=True, **kw)


async def make_streams(topo: Topology) -> None:
    from nats.js.api import Placement, StreamConfig

    async with bnats.session(topo.nats("east")) as nc:
        for name in ("BENCH_F", "BENCH_N"):
            await nc.jsm().add_stream(
                StreamConfig(name=name, subjects=[f"{name.lower()}.>"], num_replicas=1, placement=Placement("east"))
            )


async def source_natively(topo: Topology) -> None:
    """West's stream sourcing BENCH_N over the gateway: the server starts copying at once."""
    from nats.js.api import Placement, StreamConfig, StreamSource

    async with bnats.session(topo.nats("east")) as nc:
        await nc.jsm().add_stream(
            StreamConfig(
                name="BENCH_N_W", num_replicas=1, placement=Placement("west"), sources=[StreamSource(name="BENCH_N")]
            )
        )


def drained(topo: Topology, stream: str, backlog: int, timeout: float = 600) -> float:
    """Once west's `stream` holds the whole backlog: messages per second from its first to its last."""

    async def state() -> dict[str, Any]:
        async with bnats.session(topo.nats("west")) as nc:
            with contextlib.suppress(FerryError):  # not created yet (the relay creates its own)
                return (await stream_info(nc, stream))["state"]
            return {"messages": 0}

    deadline = time.monotonic() + timeout
    while (st := asyncio.run(state()))["messages"] < backlog:
        if time.monotonic() > deadline:
            raise SystemExit(f"{stream} holds {st['messages']:,} of {backlog:,} after {timeout:.0f} s")
        time.sleep(0.5)
    return backlog / max((ts_ns(st["last_ts"]) - ts_ns(st["first_ts"])) / 1e9, 1e-6)


async def times(topo: Topology, cluster: str, stream: str, lo: int) -> dict[str, float]:
    """msg id -> stored time (s) for the stream's messages from sequence `lo`."""
    cfg = ReadConfig(cluster=topo.nats(cluster).model_dump_json(), name=cluster, streams=(stream,))
    async with bnats.session(topo.nats(cluster)) as nc:
        last = (await nc.jsm().stream_info(stream)).state.last_seq
    out: dict[str, float] = {}
    async for batch in read_range(cfg, Range(stream, lo, last, 2000)):
        for mid, ts in zip(batch.column("msg_id").to_pylist(), batch.column("timestamp").to_pylist(), strict=True):
            out[mid] = ts.timestamp()
    return out


def count(topo: Topology, cluster: str, stream: str) -> int:
    async def go() -> int:
        async with bnats.session(topo.nats(cluster)) as nc:
            return int((await nc.jsm().stream_info(stream)).state.last_seq)

    return asyncio.run(go())


def step(
    topo: Topology, topology: Path, who: str, rate: int, seconds: float, tmp: Path, producers: int = 4
) -> dict[str, Any]:
    src, dst = ("BENCH_F", "BENCH_F_W") if who == "ferry" else ("BENCH_N", "BENCH_N_W")
    src_lo, dst_lo = count(topo, "east", src) + 1, count(topo, "west", dst) + 1
    ledger = tmp / f"ledger-{who}-{rate}"
    args = ["load", "jetstream://east", "--subject", f"{src.lower()}.{{n}}", "--rate", str(rate)]
    args += ["--duration", str(seconds), "--producers", str(producers), "--ledger", str(ledger), "--json"]
    acked = json.loads(run_ferry(topology, *args).stdout)["acked"]
    deadline = time.monotonic() + 120
    while count(topo, "west", dst) - dst_lo + 1 < acked and time.monotonic() < deadline:
        time.sleep(0.5)
    sent = asyncio.run(times(topo, "east", src, src_lo))
    got = asyncio.run(times(topo, "west", dst, dst_lo))
    lags = sorted(got[m] - sent[m] for m in got if m in sent)
    row: dict[str, Any] = {"who": who, "rate": rate, "acked": acked, "arrived": len(lags)}
    if lags:
        row |= {
            "lag_p50_s": round(lags[len(lags) // 2], 3),
            "lag_p99_s": round(lags[int(len(lags) * 0.99)], 3),
            "throughput": round(len(lags) / max(max(got.values()) - min(sent.values()), 1e-6)),
        }
    # the load generator shares the machine: a rate it could not offer proves nothing either way
    row["load_bound"] = acked < 0.97 * rate * seconds
    row["sustained"] = len(lags) == acked and row.get("lag_p99_s", 99) < 1.0 and not row["load_bound"]
    return row


def start_relay(topology: Path, log_path: Path, *args: str) -> subprocess.Popen[bytes]:
    """`ferry replicate run ARGS --json` in a session of its own, its events in `log_path`, once it
    relays (its first micro-batch done)."""
    env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
    with log_path.open("w") as log:
        relay = subprocess.Popen(
            [*FERRY, "replicate", "run", *args, "--json"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
    deadline = time.monotonic() + 180
    while '"relaying"' not in log_path.read_text():
        if time.monotonic() > deadline or relay.poll() is not None:
            raise SystemExit(f"the relay did not start: {log_path.read_text()[-2000:]}")
        time.sleep(0.5)
    return relay


def highest_sustained(rows: list[dict[str, Any]]) -> int:
    """The highest rate sustained with every lower rate sustained too."""
    best = 0
    for r in sorted(rows, key=lambda r: r["rate"]):
        if not r["sustained"]:
            break
        best = r["rate"]
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="2000,5000,10000,15000,20000,25000,30000,40000,50000")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--producers", type=int, default=4, help="load generator connections")
    parser.add_argument("--backlog", type=int, default=1_000_000, help="messages each mover drains first")
    parser.add_argument("--quick", action="store_true", help="2,000 and 5,000 msg/s for 8 s; a 50,000 backlog")
    a = parser.parse_args()
    if a.quick:
        a.rates, a.seconds, a.backlog = "2000,5000", 8, 50_000
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the lab below is taken down
    root = lab_root()
    rows: list[dict[str, Any]] = []
    relay = None
    try:
        state = lab.up("supercluster", root, log=lambda _: None)
        topology = state.path / "topology.yaml"
        topo = load_topology(topology)
        asyncio.run(make_streams(topo))
        for src in ("bench_f", "bench_n"):
            load = ["load", "jetstream://east", "--subject", f"{src}.{{n}}", "--count", str(a.backlog)]
            run_ferry(topology, *load, "--producers", str(a.producers), "--ledger", str(root / f"backlog-{src}"))
        asyncio.run(source_natively(topo))
        drain = {"native": drained(topo, "BENCH_N_W", a.backlog)}
        print(f"native sourcing drained {a.backlog:,} at {drain['native']:,.0f} msg/s", flush=True)
        start = ["replicate", "start", "--from", "east", "--to", "west", "--streams", "BENCH_F"]
        run_ferry(topology, *start, "--stream-name", "{stream}_W", "--subject-prefix", "relay.")
        relay = start_relay(topology, root / "relay.log", "--from", "east", "--to", "west")
        drain["ferry"] = drained(topo, "BENCH_F_W", a.backlog)
        print(f"ferry's relay drained {a.backlog:,} at {drain['ferry']:,.0f} msg/s", flush=True)
        for rate in (int(r) for r in a.rates.split(",")):
            for who in ("ferry", "native"):
                rows.append(step(topo, topology, who, rate, a.seconds, root, a.producers))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if relay and relay.poll() is None:
            os.killpg(relay.pid, signal.SIGKILL)
            relay.wait(timeout=30)
        lab.down(root=root, log=lambda _: None)
    print(f"saved {save_rows('replicate', rows)}")
    print(f"\n{'rate':>7} {'who':>7} {'arrived':>8} {'lag p50 s':>9} {'lag p99 s':>9} {'msg/s':>7} sustained")
    for r in rows:
        print(
            f"{r['rate']:>7} {r['who']:>7} {r['arrived']:>8} {r.get('lag_p50_s', '-')!s:>9} "
            f"{r.get('lag_p99_s', '-')!s:>9} {r.get('throughput', '-')!s:>7} {r['sustained']}"
        )
    best = {w: highest_sustained([r for r in rows if r["who"] == w]) for w in ("ferry", "native")}
    ratio = best["ferry"] / best["native"] if best["native"] else float("nan")
    print(f"\nhighest sustained rate: ferry {best['ferry']:,}, native {best['native']:,} msg/s: {ratio:.2f}x")
    print(
        f"backlog of {a.backlog:,} drained: ferry {drain['ferry']:,.0f}, native {drain['native']:,.0f} msg/s: "
        f"{drain['ferry'] / drain['native']:.2f}x"
    )
    for r in rows:
        if r["load_bound"]:
            print(f"{r['who']} at {r['rate']:,}/s: the load generator offered only {r['acked'] / a.seconds:,.0f}/s")


if __name__ == "__main__":
    main()
