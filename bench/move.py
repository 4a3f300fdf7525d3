"""Benchmark: a native placement move against `ferry move`, same stream size, same load, same run.

For each rate (3,500 and 12,000 msg/s per producer) and each mover:
an R3 stream in east, prefilled; producers on west publish fire-and-forget core
messages (no msg id) and JetStream messages without retries (a producer that
does not retry), each at the rate; after 3 s the stream is moved to west.

- lost: ledger messages (core, and JetStream ones that were acked) absent from
  the stream afterwards (counted by Ferry-Id, as the audit does)
- failed publishes: JetStream publishes that got an error or no ack
- unavailability window: the longest time publishes arrived and the stream
  stored none (measured from a capture of the stream's subjects; for ferry its
  own guard, for native an identical capture that re-publishes nothing)
- move time: native, from the placement update until the stream is led and
  current on west only; ferry, the whole `move()` call (preflight, guard,
  re-publish, verification included)

Target: ferry 0 lost at both rates, window no longer than native's, total time
<= 1.5x native's.

    .venv/bin/python -m bench.move            # 40,000 prefilled messages, 3 runs per case
    .venv/bin/python -m bench.move --quick    # 5,000, 1 run per case
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import pyarrow.parquet as pq

from bench._util import lab_root, save_rows
from ferry import lab
from ferry.brokers import nats as bnats
from ferry.brokers.nats import jsapi
from ferry.brokers.nats.publish import Publisher
from ferry.brokers.nats.reader import Range, ReadConfig, read_range
from ferry.errors import FerryError
from ferry.jobs import move as mv
from ferry.jobs.move.plan import placed_in
from ferry.jobs.shared.guard import Guard, Stored, measured_window, missing, read_captures
from ferry.topology import Topology, load_topology

LOAD_S = 10
# per producer; as fast as possible is no longer a fair case: `ferry load` now outruns what an R3
# stream takes in on 2 cores, and the server drops the excess itself, moving or not ("Dropping
# messages due to excessive stream ingest rate"), which says nothing about the movers
RATES = (3500, 12000)


async def make(topo: Topology, name: str, prefill: int) -> None:
    async with bnats.session(topo.nats("east")) as nc:
        with contextlib.suppress(Exception):  # not there yet
            await jsapi.api(nc, f"$JS.API.STREAM.DELETE.{name}")
        cfg = {
            "name": name,
            "subjects": [f"{name.lower()}.>"],
            "num_replicas": 3,
            "storage": "file",
            "placement": {"cluster": "east"},
        }
        await jsapi.api(nc, f"$JS.API.STREAM.CREATE.{name}", cfg)
        async with Publisher(nc, window=1024) as pub:
            for i in range(prefill):
                await pub.publish(f"{name.lower()}.fill", i.to_bytes(8, "big") * 125)


def loads(topology: Path, name: str, rate: int, out: Path) -> list[subprocess.Popen]:
    env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
    common = ["--duration", str(LOAD_S), "--rate", str(rate)]
    ferry = [sys.executable, "-m", "ferry", "load"]
    core = [
        *ferry,
        "nats://west",
        "--subject",
        f"{name.lower()}.core.{{n}}",
        "--no-msg-id",
        "--ledger",
        str(out / "core"),
    ]
    js = [
        *ferry,
        "jetstream://west",
        "--subject",
        f"{name.lower()}.js.{{n}}",
        "--no-retry",
        "--ledger",
        str(out / "js"),
    ]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    return [subprocess.Popen([*c, *common], env=env, **quiet) for c in (core, js)]


async def native(topo: Topology, name: str, capture_dir: Path) -> dict[str, Any]:
    async with bnats.session(topo.nats("west")) as nc:
        info = await jsapi.stream_info(nc, name)
        seq0 = info["state"]["last_seq"]
        guard = Guard(topo.nats("west"), info["config"]["subjects"], capture_dir / "capture-native.arrow")
        await guard.start()
        west = {f"west-{i}" for i in (1, 2, 3)}
        t0 = time.monotonic()
        await jsapi.api(nc, f"$JS.API.STREAM.UPDATE.{name}", {**info["config"], "placement": {"cluster": "west"}})
        while True:
            with contextlib.suppress(FerryError):  # a busy stream may not answer within 2 s: ask again
                if placed_in(await jsapi.stream_info(nc, name, timeout=2), west):
                    break
            await asyncio.sleep(0.05)
        took = time.monotonic() - t0
        await asyncio.sleep(1.0)  # as ferry's settle: what is in flight lands
        await guard.stop()
        return {"took_s": took, **await window(topo, nc, name, seq0, capture_dir)}


async def window(topo: Topology, nc: Any, name: str, seq0: int, capture_dir: Path) -> dict[str, Any]:
    last = (await jsapi.stream_info(nc, name))["state"]["last_seq"]
    captured = read_captures(capture_dir)
    async with Stored(topo.nats("west"), name) as reader:
        stored = await reader.since(seq0, last)
    rows, first = missing(captured, stored)
    return {"unavailable_s": measured_window(captured, stored, first), "missed": len(rows)}


async def held_ids(topo: Topology, name: str) -> set[str]:
    cfg = ReadConfig(cluster=topo.nats("west").model_dump_json(), name="west", streams=(name,))
    async with bnats.session(topo.nats("west")) as nc:
        st = (await jsapi.stream_info(nc, name))["state"]
    ids: set[str] = set()
    async for batch in read_range(cfg, Range(name, st["first_seq"], st["last_seq"], 2000)):
        for h in batch.column("headers").to_pylist():
            for k, v in h or []:
                if k == "Ferry-Id":
                    ids.add(v)
    return ids


def tally(topo: Topology, name: str, out: Path) -> dict[str, int]:
    ids = asyncio.run(held_ids(topo, name))
    core = pq.read_table(out / "core").to_pylist()
    js = pq.read_table(out / "js").to_pylist()
    lost = sum(1 for r in core if r["id"] not in ids) + sum(
        1 for r in js if r["outcome"] == "acked" and r["id"] not in ids
    )
    return {"sent": len(core) + len(js), "lost": lost, "failed": sum(1 for r in js if r["outcome"] == "error")}


def one(topo: Topology, topology: Path, who: str, rate: int, prefill: int, work: Path) -> dict[str, Any]:
    name = f"BM_{who.upper()}"
    out = work / f"{who}-{rate}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    asyncio.run(make(topo, name, prefill))
    procs = loads(topology, name, rate, out)
    time.sleep(3)
    if who == "native":
        r = asyncio.run(native(topo, name, out / "capture"))
    else:
        req = mv.MoveRequest(stream=name, to="west", state_dir=out / "state")
        t0 = time.monotonic()
        res = asyncio.run(mv.move(topo.nats("west"), req)).doc()
        r = {"took_s": time.monotonic() - t0, "unavailable_s": res["unavailable_s"], "missed": res["missed"]}
        r |= {k: res[k] for k in ("handoff", "leader_changes", "leaderless_s")}
        assert res["outcome"] == "moved" and res["verify"]["ok"], res
    for p in procs:
        assert p.wait(timeout=120) == 0, f"ferry load exited {p.returncode}"
    return {"who": who, "rate": rate, **r, **tally(topo, name, out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", type=int, default=40_000, help="1 kB messages in the stream before the move")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="5,000 prefilled, one run per case")
    args = parser.parse_args()
    prefill, runs = (5_000, 1) if args.quick else (args.prefill, args.runs)
    root = lab_root()
    rows: list[dict[str, Any]] = []
    try:
        lab.up("supercluster", root, log=lambda _: None)
        topology = root / "topology.yaml"
        topo = load_topology(topology)
        for rate in RATES:
            for _ in range(runs):
                for who in ("native", "ferry"):
                    rows.append(one(topo, topology, who, rate, prefill, root / "work"))
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        lab.down(root=root, log=lambda _: None)
    print()
    print(
        f"{'rate':>6} {'who':7} {'sent':>8} {'lost':>5} {'failed':>6} {'window ms':>9} {'move s':>7} {'time ratio':>10}"
    )
    for rate in RATES:
        case = [r for r in rows if r["rate"] == rate]
        nat = median(r["took_s"] for r in case if r["who"] == "native")
        for who in ("native", "ferry"):
            mine = [r for r in case if r["who"] == who]
            took = median(r["took_s"] for r in mine)
            print(
                f"{rate:>6} {who:7} {sum(r['sent'] for r in mine):>8,} {sum(r['lost'] for r in mine):>5} "
                f"{sum(r['failed'] for r in mine):>6} {max(r['unavailable_s'] for r in mine) * 1000:>9.1f} "
                f"{took:>7.2f} {took / nat:>9.2f}x"
            )
    save_rows("move", rows)


if __name__ == "__main__":
    main()
