"""Benchmark: durable consumers across sites (issue 52): the consumer RPO against the checkpoint
interval, and what consumer checkpoints cost the relay.

Lab: sites (nyc and sfo). For each checkpoint interval (``--intervals``, seconds; 0: no
checkpoints, the relay as before issue 52), a fresh R1 stream ``BENCH_C<n>`` at nyc is
replicated to sfo by one ``ferry replicate run --consumer-interval <interval>``; ten durable
pull consumers at nyc each filter one of its ten subjects; ``ferry load`` publishes ``--rate``
msg/s over the ten subjects for ``--seconds``, and ten applications (one asyncio loop in this
process) fetch and acknowledge all along, each ack sent at once.

At the end of the load, while the applications still acknowledge, nyc "fails": the relay is
SIGKILLed and the applications stop in the same instant, so the consumer copies at sfo stay where
the last checkpoint put them, as when a site dies. Per consumer, against what sfo holds:
**re-delivered** = messages the copy would deliver (from its position on) that the application had
acknowledged; **skipped** = messages before its position it had not acknowledged (must be 0);
**one interval's worth** = the application's acknowledgements in the last `interval` seconds
before the stop, plus those the last checkpoint counted above the ack floor. Relay overhead: the
relay's CPU (driver, JVM and Python workers) over the load, and lag p99 (stored at sfo - stored at
nyc, server times), each interval against the run without checkpoints.

Target (issue 52): re-deliveries <= one checkpoint interval's worth, 0 skipped, relay lag p99
within 10 % of the relay without consumer checkpoints.

    .venv/bin/python -m bench.consumers                          # 0, 1, 3, 10 s; 10,000 msg/s, 30 s
    .venv/bin/python -m bench.consumers --rounds 3               # each three times: medians of lag and CPU
    .venv/bin/python -m bench.consumers --intervals 0,3 --seconds 10 --rate 2000   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import nats
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from bench._util import cpu_seconds, lab_root, save_rows, tree
from bench.replicate import run_ferry, start_relay, times
from ferry import lab
from ferry.brokers import nats as bnats
from ferry.topology import Topology, load_topology

SUBJECTS = 10


class Apps:
    """Ten applications at nyc, one durable consumer each (filter ``<stream>.<k>``), acknowledging
    every message fetched; what each acknowledged and when (time.time())."""

    def __init__(self, topo: Topology, stream: str) -> None:
        self.topo, self.stream = topo, stream
        self.names = [f"app-{k}" for k in range(SUBJECTS)]
        self.acked: dict[str, dict[str, float]] = {n: {} for n in self.names}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def make(self) -> None:
        async with bnats.session(self.topo.nats("nyc")) as nc:
            for k, name in enumerate(self.names):
                config = ConsumerConfig(
                    durable_name=name,
                    ack_policy=AckPolicy.EXPLICIT,
                    filter_subject=f"{self.stream.lower()}.{k}",
                    max_ack_pending=2000,
                )
                await nc.jsm().add_consumer(self.stream, config)

    async def _run(self) -> None:
        async with bnats.session(self.topo.nats("nyc")) as nc:
            await asyncio.gather(*(self._one(nc, name) for name in self.names))
            await nc.flush()  # the acks sent reach the server

    async def _one(self, nc: Any, name: str) -> None:
        sub = await nc.jetstream().pull_subscribe_bind(name, self.stream)
        acked = self.acked[name]
        while not self.stop.is_set():
            try:
                msgs = await sub.fetch(200, timeout=0.5)
            except (TimeoutError, nats.errors.TimeoutError):  # nats-py raises either
                continue
            for m in msgs:
                if self.stop.is_set():
                    return
                await m.ack()
                acked[m.headers["Nats-Msg-Id"]] = time.time()


def define(topology: Path, stream: str) -> None:
    """`stream` replicated nyc -> sfo (alone): the last round's replication stopped (its relay was
    SIGKILLed: no marker, its lease left to lapse), this one started."""
    deadline = time.monotonic() + 60
    with contextlib.suppress(subprocess.CalledProcessError):  # the first round: nothing to stop
        run_ferry(topology, "replicate", "stop", "--from", "nyc", "--to", "sfo", "--wait", "0")
    while True:
        try:
            run_ferry(topology, "replicate", "start", "--from", "nyc", "--to", "sfo", "--streams", stream)
            return
        except subprocess.CalledProcessError as exc:
            if time.monotonic() > deadline or "still stopping" not in exc.stderr:
                raise SystemExit(f"replicate start: {exc.stderr.strip()}") from None
            time.sleep(1.0)


async def copies(topo: Topology, stream: str) -> dict[str, int]:
    """Each copy at sfo: the sequence it delivers from."""
    async with bnats.session(topo.nats("sfo")) as nc:
        return {c.name: c.ack_floor.stream_seq + 1 for c in await nc.jsm().consumers_info(stream)}


async def held(topo: Topology, stream: str) -> list[tuple[int, str, str, Any]]:
    """(sfo sequence, message id, subject, stored time) of everything sfo holds."""
    from ferry.brokers.nats.reader import Range, ReadConfig, read_range

    cfg = ReadConfig(cluster=topo.nats("sfo").model_dump_json(), name="sfo", streams=(stream,))
    async with bnats.session(topo.nats("sfo")) as nc:
        last = (await nc.jsm().stream_info(stream)).state.last_seq
    out = []
    async for b in read_range(cfg, Range(stream, 1, last, 2000)):
        cols = [b.column(c).to_pylist() for c in ("source_seq", "msg_id", "subject", "timestamp")]
        out.extend(zip(*cols, strict=True))
    return out


def checkpoint_rows(topology: Path, stream: str) -> dict[str, dict[str, Any]]:
    rows = json.loads(run_ferry(topology, "replicate", "status", "--json").stdout)
    return {c["consumer"]: c for r in rows for c in r.get("consumers") or [] if c["stream"] == stream}


def one_round(topo: Topology, topology: Path, root: Path, n: int, interval: float, rate: int, seconds: float) -> dict:
    stream = f"BENCH_C{n}"

    async def make() -> None:
        async with bnats.session(topo.nats("nyc")) as nc:
            await nc.jsm().add_stream(StreamConfig(name=stream, subjects=[f"{stream.lower()}.>"], num_replicas=1))

    asyncio.run(make())
    apps = Apps(topo, stream)
    asyncio.run(apps.make())
    define(topology, stream)
    relay = start_relay(topology, root / f"relay-{interval:g}.log", "--from", "nyc", "--to", "sfo",
                        "--consumer-interval", f"{interval:g}")  # fmt: skip
    try:
        apps.thread.start()
        cpu0 = cpu_seconds(tree(relay.pid))
        args = ["load", "jetstream://nyc", "--subject", f"{stream.lower()}.{{n}}", "--subjects", str(SUBJECTS)]
        args += ["--rate", str(rate), "--duration", str(seconds), "--producers", "4", "--json"]
        acked = json.loads(run_ferry(topology, *args, "--ledger", str(root / f"ledger-{n}")).stdout)["acked"]
        cpu = cpu_seconds(tree(relay.pid)) - cpu0
        os.killpg(relay.pid, signal.SIGKILL)  # nyc "fails" as the applications still acknowledge
        stopped = time.time()
        apps.stop.set()
        relay.wait(timeout=30)
        apps.thread.join(timeout=30)
    finally:
        if relay.poll() is None:
            os.killpg(relay.pid, signal.SIGKILL)
            relay.wait(timeout=30)
    sent, stored = asyncio.run(times(topo, "nyc", stream, 1)), asyncio.run(held(topo, stream))
    lags = sorted(ts.timestamp() - sent[mid] for _, mid, _, ts in stored if mid in sent)
    row: dict[str, Any] = {
        "interval_s": interval,
        "rate": rate,
        "acked_by_load": acked,
        "relayed": len(stored),
        "lag_p99_s": round(lags[int(len(lags) * 0.99)], 3) if lags else None,
        "relay_cpu_s": round(cpu, 1),
        "acks": sum(len(a) for a in apps.acked.values()),
    }
    if not interval:
        return row
    at_sfo, rows = asyncio.run(copies(topo, stream)), checkpoint_rows(topology, stream)
    per: dict[str, dict[str, int]] = {}
    for k, name in enumerate(apps.names):
        subject, done, pos = f"{stream.lower()}.{k}", apps.acked[name], at_sfo[name]
        mine = [(seq, mid) for seq, mid, s, _ in stored if s == subject]
        worth = sum(1 for t in done.values() if t >= stopped - interval) + rows[name]["acked_above_floor"]
        per[name] = {
            "redelivered": sum(1 for seq, mid in mine if seq >= pos and mid in done),
            "skipped": sum(1 for seq, mid in mine if seq < pos and mid not in done),
            "interval_worth": worth,
            "checkpoint_age_s": round(stopped - rows[name]["at"], 2),
        }
    row |= {
        "redelivered": sum(p["redelivered"] for p in per.values()),
        "skipped": sum(p["skipped"] for p in per.values()),
        "interval_worth": sum(p["interval_worth"] for p in per.values()),
        "over_bound": [n for n, p in per.items() if p["redelivered"] > p["interval_worth"]],
        "consumers": per,
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--intervals", default="0,1,3,10", help="checkpoint intervals, seconds (0: none)")
    parser.add_argument("--rate", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--rounds", type=int, default=1, help="the intervals, this many times over (interleaved)")
    a = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the lab below is taken down
    root = lab_root()
    rows: list[dict[str, Any]] = []
    intervals = [float(i) for i in a.intervals.split(",")]
    try:
        state = lab.up("sites", root, log=lambda _: None)
        topology = state.path / "topology.yaml"
        topo = load_topology(topology)
        for n, interval in enumerate(intervals * a.rounds):
            rows.append(one_round(topo, topology, root, n, interval, a.rate, a.seconds))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "consumers"}), flush=True)
    finally:
        lab.down(root=root, log=lambda _: None)
    print(f"saved {save_rows('consumers', rows)}")
    heads = ("interval s", "acks", "again", "allowed", "skipped", "lag p99 s", "relay CPU s")
    print("\n" + " ".join(f"{h:>11}" for h in heads))
    for r in rows:
        again, allowed, skipped = (r.get(k, "-") for k in ("redelivered", "interval_worth", "skipped"))
        cells = (f"{r['interval_s']:g}", f"{r['acks']:,}", again, allowed, skipped, r["lag_p99_s"], r["relay_cpu_s"])
        print(" ".join(f"{c!s:>11}" for c in cells))
    by = {i: [r for r in rows if r["interval_s"] == i and r["lag_p99_s"]] for i in intervals}
    if not by.get(0.0):
        return
    lag0, cpu0 = (statistics.median(r[k] for r in by[0.0]) for k in ("lag_p99_s", "relay_cpu_s"))
    for i, rs in by.items():
        if i and rs:
            lag, cpu = (statistics.median(r[k] for r in rs) for k in ("lag_p99_s", "relay_cpu_s"))
            over = sorted({n for r in rs for n in r["over_bound"]})
            print(
                f"interval {i:g} s ({len(rs)} rounds, medians): lag p99 {lag / lag0:.2f}x, relay CPU "
                f"{cpu / max(cpu0, 0.1):.2f}x the relay without checkpoints; re-delivered "
                f"{max(r['redelivered'] / max(r['interval_worth'], 1) for r in rs):.2f}x at most of one "
                f"interval's worth, skipped {sum(r['skipped'] for r in rs)}"
                + (f"; over the bound: {', '.join(over)}" if over else "")
            )


if __name__ == "__main__":
    main()
