"""Benchmark: emptying a NATS node that holds 1,000 client connections, `ferry node evacuate`
against the naive anchor (restart the node: every client dropped at once), in the same run.

Lab: the super-cluster's east cluster behind HAProxy (leastconn, health-checked against
`ferry serve`). Load: `ferry load` with 1,000 JetStream producers (one connection each,
retries on) through HAProxy, 1,000 msg/s in total, into an R3 stream. Before each case every
client is herded onto east-1 (the other nodes held unavailable through the API).

- ferry: `ferry node evacuate east-1 --conn-evict-rate R` (default 100/s) after a 3 s
  health-check wait; afterwards `ferry node stop east-1`.
- anchor: east-1's nats-server is stopped (SIGTERM) and started again.

Measured for each: the eviction rate asked and achieved; the time until east-1 held no
client; the time until every client was connected again (for the restart, east-1 may take some
back); the peak rate of connections arriving on any node (the reconnect storm, per 1 s
window, sampled every 0.1 s from connz); the load's client-visible errors and retries; messages lost (the audit of
the load's ledger against the stream).

    .venv/bin/python -m bench.evacuate              # 1,000 clients, 100 conn/s
    .venv/bin/python -m bench.evacuate --clients 300 --rate 30
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench._util import lab_root, save_rows
from ferry import lab
from ferry.brokers import nats as bnats
from ferry.topology import Topology, load_topology

FERRY = [sys.executable, "-m", "ferry"]
NODES = ("east-1", "east-2", "east-3")


def run_ferry(topology: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
    return subprocess.run([*FERRY, *args], env=env, capture_output=True, text=True, timeout=900)


def wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


class Lab:
    def __init__(self, state: lab.LabState) -> None:
        self.state, self.topology = state, state.path / "topology.yaml"
        self.topo: Topology = load_topology(self.topology)
        self.token = Path(state.lb["token_file"]).read_text().strip()
        self.monitors = {b.name: b.monitor_url for b in self.topo.nats("east").brokers}

    def api(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"}
        return httpx.request(method, self.state.lb["serve"] + path, headers=headers, timeout=30, **kw)

    def in_rotation(self) -> dict[str, bool]:
        text = httpx.get(self.state.lb["stats"] + ";csv", timeout=5).text.lstrip("# ")
        rows = csv.DictReader(io.StringIO(text))
        return {
            r["svname"]: r["status"].startswith("UP")
            for r in rows
            if r["pxname"] == "nats_east" and r["svname"] in NODES
        }

    def clients(self) -> dict[str, int]:
        """Client connections per east node (ferry's control connections excluded); -1 when down."""
        out = {}
        for name, url in self.monitors.items():
            try:
                conns = httpx.get(f"{url}/connz", params={"limit": 100000}, timeout=2).json()["connections"] or []
            except (httpx.HTTPError, ValueError):
                out[name] = -1
                continue
            out[name] = sum(1 for c in conns if not str(c.get("name", "")).startswith("ferry-ctl"))
        return out

    def herd(self, node: str, clients: int, seconds: float, stream: str, ledger: Path) -> subprocess.Popen[str]:
        """The load's clients, all on `node`; returns the running load."""
        others = [n for n in NODES if n != node]
        for n in others:
            r = self.api("POST", "/evacuations", json={"node": n, "wait_health_check": 3600})
            assert r.status_code == 202, r.text
        wait_for(lambda: self.in_rotation() == {n: n == node for n in NODES}, 30, f"HAProxy to send all to {node}")
        args = ["load", "jetstream://east", "--url", self.state.lb["clusters"]["east"]["nats"]]
        args += ["--producers", str(clients), "--rate", str(clients), "--duration", str(seconds)]
        args += ["--subject", f"{stream.lower()}.{{n}}", "--ledger", str(ledger), "--json"]
        env = {**os.environ, "FERRY_TOPOLOGY": str(self.topology)}
        load = subprocess.Popen([*FERRY, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: self.clients()[node] >= clients, 180, f"{clients} clients on {node}")
        for n in others:
            assert self.api("DELETE", f"/evacuations/{n}").status_code == 200
        wait_for(lambda: all(self.in_rotation().values()), 30, "HAProxy to see every node")
        return load


class Sampler(threading.Thread):
    """Client counts per node every 0.1 s."""

    def __init__(self, lab_: Lab) -> None:
        super().__init__(daemon=True)
        self.lab, self.samples, self.done = lab_, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.time(), self.lab.clients()))
            time.sleep(0.1)

    def stop(self) -> list[tuple[float, dict[str, int]]]:
        self.done.set()
        self.join()
        return self.samples


def storm(samples: list[tuple[float, dict[str, int]]]) -> float:
    """Peak client connections arriving (on any node) within any 1 s window. A node that did not
    answer (-1) keeps its last known count, so a missed sample is not taken for a burst."""
    known = {n: max(0, samples[0][1][n]) for n in NODES} if samples else {}
    arrivals = []
    for t, c in samples[1:]:
        arrivals.append((t, sum(max(0, c[n] - known[n]) for n in NODES if c[n] >= 0)))
        known |= {n: c[n] for n in NODES if c[n] >= 0}
    peak, j, total = 0, 0, 0
    for t, a in arrivals:
        total += a
        while arrivals[j][0] <= t - 1.0:
            total -= arrivals[j][1]
            j += 1
        peak = max(peak, total)
    return float(peak)


def reconnected(samples: list[tuple[float, dict[str, int]]], clients: int, after: float, who: str) -> float | None:
    """Seconds until every client was connected again: for ferry, none left on east-1; for the
    restart, after the drop."""
    dropped = who == "ferry"
    for t, c in samples:
        if t < after:
            continue
        total = sum(max(0, x) for x in c.values())
        if not dropped:
            dropped = total < clients
        elif total >= clients and (who != "ferry" or c["east-1"] <= 0):
            return t - after
    return None


def first_time(samples: list[tuple[float, dict[str, int]]], cond: Any, after: float) -> float | None:
    return next((t - after for t, c in samples if t >= after and cond(c)), None)


async def make_stream(topo: Topology, name: str) -> None:
    async with bnats.session(topo.nats("east")) as nc:
        js = nc.jetstream()
        from nats.js.api import Placement, StreamConfig

        await js.add_stream(
            StreamConfig(name=name, subjects=[f"{name.lower()}.>"], num_replicas=3, placement=Placement(cluster="east"))
        )


def case(lb: Lab, who: str, clients: int, rate: int, tmp: Path) -> dict[str, Any]:
    stream = f"EVAC_{who.upper()}"
    asyncio.run(make_stream(lb.topo, stream))
    ledger = tmp / f"ledger-{who}"
    load = lb.herd("east-1", clients, 90, stream, ledger)
    sampler = Sampler(lb)
    sampler.start()
    time.sleep(1.0)
    t0 = time.time()
    row: dict[str, Any] = {"who": who, "clients": clients}
    if who == "ferry":
        args = ["node", "evacuate", "east-1", "--wait-health-check", "3", "--conn-evict-rate", str(rate)]
        r = run_ferry(lb.topology, *args, "--wait-takeover", "1", "--json")
        if r.returncode:
            raise SystemExit(f"ferry node evacuate failed: {r.stderr[-2000:]}")
        ev = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
        t = {e["state"]: e["t"] for e in ev if e["event"] == "state"}
        evicted = json.loads(r.stdout)["evicted"]["connections"]
        start = t["evicting_conns"]
        row |= {"asked_rate": rate, "achieved_rate": round((evicted - 1) / max(t["waiting_takeover"] - start, 1e-9), 1)}
    else:
        proc = lb.state.proc("east-1")
        start = time.time()
        proc.stop()
        row["to_empty_s"] = time.time() - start  # every client dropped when the server exits
        proc.start()
        lb.state.save()
        wait_for(lambda: lb.clients()["east-1"] >= 0, 60, "east-1 to answer again")
        row |= {"asked_rate": None, "achieved_rate": None}
    wait_for(lambda: sum(max(0, c) for c in lb.clients().values()) >= clients, 120, "every client connected again")
    time.sleep(1.0)
    samples = sampler.stop()
    if who == "ferry":
        row["to_empty_s"] = first_time(samples, lambda c: c["east-1"] <= 0, start)
    row["to_reconnected_s"] = reconnected(samples, clients, start, who)
    row["storm_conn_per_s"] = storm([s for s in samples if s[0] >= start - 0.5])
    row["evacuation_s"] = round(time.time() - t0, 1)
    if who == "ferry":
        run_ferry(lb.topology, "node", "stop", "east-1")
    load.terminate()
    out, _ = load.communicate(timeout=120)
    summary = json.loads(out) if out.strip() else {}
    row |= {"sent": summary.get("sent"), "client_errors": summary.get("errors"), "retries": summary.get("retries")}
    r = run_ferry(lb.topology, "audit", "--ledger", str(ledger), "--tier", f"t=jetstream://east/{stream}", "--json")
    row["lost"] = json.loads(r.stdout)["tiers"]["t"]["lost"] if r.stdout.strip() else f"audit failed: {r.stderr[-300:]}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rate", type=int, default=100, help="ferry's --conn-evict-rate")
    parser.add_argument("--quick", action="store_true", help="300 clients at 30/s")
    a = parser.parse_args()
    if a.quick:
        a.clients, a.rate = 300, 30
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the lab below is taken down
    root = lab_root()
    rows = []
    try:
        lb = Lab(lab.up("supercluster", root, log=lambda _: None, haproxy=True))
        for who in ("ferry", "restart"):
            rows.append(case(lb, who, a.clients, a.rate, root))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        lab.down(root=root, log=lambda _: None)
    print(f"saved {save_rows('evacuate', rows)}")
    ferry, anchor = rows
    print(
        f"\n{'':10} {'asked/s':>8} {'achieved/s':>10} {'empty s':>8} {'all back s':>10} {'storm/s':>8} "
        f"{'errors':>6} {'retries':>7} {'lost':>5}"
    )
    for r in rows:
        print(
            f"{r['who']:10} {r['asked_rate'] or '-':>8} {r['achieved_rate'] or '-':>10} {r['to_empty_s'] or 0:>8.1f} "
            f"{r['to_reconnected_s'] or 0:>10.1f} {r['storm_conn_per_s']:>8.0f} {r['client_errors']!s:>6} "
            f"{r['retries']!s:>7} {r['lost']!s:>5}"
        )
    if ferry["storm_conn_per_s"]:
        ratio = anchor["storm_conn_per_s"] / ferry["storm_conn_per_s"]
        print(f"\nreconnect storm: restart {ratio:.1f}x ferry's peak arrival rate")


if __name__ == "__main__":
    main()
