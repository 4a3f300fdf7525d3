"""Benchmark: `ferry serve`'s ``/metrics`` with 100 operations on record and a replication of 1,000
streams, scraped once a second, against its anchor in the same run.

A real one-server NATS deployment (the lab's ``sites`` profile, site nyc) holds, in its
``ferry_ops`` journal, 99 moves with their results and one replication nyc -> sfo whose live relay
(this process, beating its heartbeat every second) reports progress for 1,000 streams. `ferry
serve --public-read` reads it as it reads any journal. Measured:

- the latency of each ``GET /metrics`` at one scrape a second (p50, p99, max);
- serve's CPU per scrape: its CPU time while scraped, less its CPU time over as long unscraped
  (it reads the journal twice a second either way), per scrape;
- the anchor: the same series (names, labels and values) served by ``prometheus_client``'s own
  HTTP server from a plain registry, scraped the same way: what exposing that many series costs
  anyway. The ratio is serve's p99 to the anchor's.

Target: p99 < 100 ms and < 5 % of one core at 1 scrape/s.

    .venv/bin/python -m bench.console            # 60 scrapes
    .venv/bin/python -m bench.console --quick    # 15 scrapes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench._util import cpu_seconds, lab_root, save_rows, tree
from ferry import lab
from ferry.brokers import nats as bnats
from ferry.journal import Journal, open_bucket
from ferry.lab.procs import free_ports
from ferry.topology import load_topology

OPERATIONS, STREAMS = 100, 1000


def records() -> dict[str, dict[str, Any]]:
    now = time.time()
    out: dict[str, dict[str, Any]] = {}
    for i in range(OPERATIONS - 1):
        out[f"move.S{i}"] = {
            "phase": "done",
            "started": now - 60,
            "owner": None,
            "heartbeat": now - 50,
            "result": {
                "stream": f"S{i}",
                "outcome": "moved",
                "missed": i % 7,
                "reinjected": i % 7,
                "unavailable_s": 0.02,
            },
        }
    return out


def relay_record() -> dict[str, Any]:
    now = time.time()
    progress = {
        f"STREAM_{i:04d}": {"relayed": 1000 + i, "source_last": 1010 + i, "lag": 10, "lag_s": 0.5, "rate": 100.0}
        for i in range(STREAMS)
    }
    return {
        "source": "nyc",
        "dest": "sfo",
        "streams": "*",
        "subject_prefix": "",
        "stream_name": "{stream}",
        "desired": "running",
        "state": "relaying",
        "lease": 5.0,
        "owner": Journal.owner(),
        "heartbeat": now,
        "progress": progress,
        "progress_at": now,
        "since": now - 600,
    }


async def write(topology: Path, stop: threading.Event) -> None:
    """The records once, then the relay's heartbeat every second until `stop`."""
    async with bnats.session(load_topology(topology).nats("nyc"), name="nyc") as nc:
        kv = await open_bucket(nc)
        for key, value in records().items():
            await kv.put(key, json.dumps(value).encode())
        while not stop.is_set():
            await kv.put("relay.nyc.sfo", json.dumps(relay_record()).encode())
            await asyncio.sleep(1.0)


def scrape(url: str, n: int) -> list[float]:
    """`n` GETs of `url`, one a second; their latencies in ms."""
    out = []
    with httpx.Client(timeout=10) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            r = client.get(url)
            out.append((time.perf_counter() - t0) * 1000)
            assert r.status_code == 200 and "ferry_relay_lag_messages" in r.text, r.text[:300]
            time.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))
    return out


def anchor(text: str, port: int) -> Any:
    """prometheus_client's own server, exposing the series of `text` from a plain registry."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.parser import text_string_to_metric_families

    families = []
    for fam in text_string_to_metric_families(text):
        names = sorted({k for s in fam.samples for k in s.labels})
        g = GaugeMetricFamily(fam.name, fam.documentation, labels=names)
        for s in fam.samples:
            g.add_metric([s.labels.get(k, "") for k in names], s.value)
        families.append(g)

    class Static:
        def collect(self) -> Any:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Static())  # type: ignore[arg-type]
    return start_http_server(port, addr="127.0.0.1", registry=registry)


def stats(name: str, lat: list[float], cpu_per_scrape: float | None) -> dict[str, Any]:
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return {
        "server": name,
        "scrapes": len(lat),
        "p50_ms": round(statistics.median(lat), 2),
        "p99_ms": round(q[98], 2),
        "max_ms": round(max(lat), 2),
        "cpu_ms_per_scrape": None if cpu_per_scrape is None else round(cpu_per_scrape * 1000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scrapes", type=int, default=60)
    parser.add_argument("--quick", action="store_true", help="15 scrapes")
    args = parser.parse_args()
    n = 15 if args.quick else args.scrapes
    root = lab_root()
    stop = threading.Event()
    serve = None
    try:
        lab.up("sites", root, log=lambda _: None)
        topology = root / "topology.yaml"
        writer = threading.Thread(target=lambda: asyncio.run(write(topology, stop)), daemon=True)
        writer.start()
        serve_port, anchor_port = free_ports(2)
        env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
        argv = [sys.executable, "-m", "ferry", "serve", "--port", str(serve_port), "--public-read"]
        serve = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{serve_port}/metrics"
        deadline = time.monotonic() + 60
        while True:  # until serve has read the journal: every move and the relay's streams on /metrics
            try:
                text = httpx.get(url, timeout=5).text
                if (
                    text.count("ferry_relay_lag_messages{") == STREAMS
                    and text.count("ferry_move_missed_total{") == OPERATIONS - 1
                ):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve did not show the journal within 60 s"
            time.sleep(0.5)
        pids = tree(serve.pid)
        c0 = cpu_seconds(pids)
        time.sleep(n)
        idle = cpu_seconds(pids) - c0
        c0 = cpu_seconds(pids)
        lat = scrape(url, n)
        busy = cpu_seconds(pids) - c0
        mine = stats("ferry serve", lat, max(0.0, busy - idle) / n)
        server, _ = anchor(text, anchor_port)
        theirs = stats("prometheus_client (anchor)", scrape(f"http://127.0.0.1:{anchor_port}/metrics", n), None)
        server.shutdown()
    finally:
        stop.set()
        if serve:
            serve.terminate()
            serve.wait(30)
        lab.down(root=root, log=lambda _: None)
    rows = [mine, theirs]
    series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    print(
        f"\n{OPERATIONS} operations on record, a relay of {STREAMS} streams: "
        f"{series:,} series, {len(text) / 1024:.0f} KiB"
    )
    print(f"{'server':28} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'CPU ms/scrape':>13}")
    for r in rows:
        cpu = "-" if r["cpu_ms_per_scrape"] is None else f"{r['cpu_ms_per_scrape']:.1f}"
        print(f"{r['server']:28} {r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f} {r['max_ms']:>7.1f} {cpu:>13}")
    print(
        f"p99 ratio ferry/anchor: {mine['p99_ms'] / theirs['p99_ms']:.2f}x; "
        f"serve's CPU at 1 scrape/s: {mine['cpu_ms_per_scrape'] / 10:.1f} % of one core (target < 5 %, p99 < 100 ms)"
    )
    save_rows("console", rows)


if __name__ == "__main__":
    main()
