"""The operations console and `/metrics` with the real things around them: a real Prometheus scrapes
`ferry serve` (the supercluster lab's, and one over the sites lab) and a relay's `--metrics-port`
while a move, an evacuation and a relay run; every dashboard panel's query and every alert is
asked of Prometheus's HTTP API; headless Chromium opens the page during the evacuation."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ferry import lab
from ferry.brokers import nats as bnats
from ferry.lab import prometheus as lab_prometheus
from ferry.lab.procs import Proc, free_ports
from tests.conftest import profile_topology
from tests.helpers import (
    FAILBACK_PANELS,
    FERRY,
    ROOT,
    Relay,
    ferry,
    load,
    make_stream,
    panel_queries,
    prom_query,
    wait_for,
)

ALERTS = ROOT / "dashboards" / "alerts.yml"


def test_promtool_accepts_the_alerts_and_every_panel_reads_a_family_serve_exports() -> None:
    got = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and "SUCCESS: 7 rules found" in got.stdout, got.stdout + got.stderr
    from ferry.api.audits import Audits
    from ferry.api.metrics import JournalCollector
    from ferry.api.watch import Registry
    from ferry.jobs.replicate.relay import Metrics
    from ferry.topology import Topology

    exported = {m.name for m in JournalCollector(Registry(Topology(sites={})), Audits(None)).collect()}
    exported |= {m.name for m in Metrics(None).collect()}
    for title, expr in panel_queries().items():
        names = {n.removesuffix("_total") for n in re.findall(r"\bferry_[a-z_]+", expr)}
        assert names and names <= exported, f"{title}: {expr} reads {names - exported}"


async def durable(topo: Any, site: str, stream: str, name: str) -> None:
    from nats.js.api import AckPolicy, ConsumerConfig

    from ferry.brokers import nats as bnats

    async with bnats.session(topo.nats(site)) as nc:
        await nc.jsm().add_consumer(stream, ConsumerConfig(durable_name=name, ack_policy=AckPolicy.EXPLICIT))


def chromium(url: str, out: Path, *mode: str) -> tuple[str, list[str]]:
    """Open `url` headless for about 4 s of page time; (stdout, the page's console messages)."""
    got = subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            f"--user-data-dir={out / f'profile-{time.monotonic_ns()}'}",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=4000",
            "--window-size=1200,1100",
            *mode,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    return got.stdout, [line for line in got.stderr.splitlines() if ":CONSOLE" in line]


def prometheus_ready(prom: Proc, base: str) -> bool:
    """Whether Prometheus answers ready; not listening yet is not ready, an exit fails at once."""
    assert prom.alive(), f"Prometheus exited; see {prom.log}: {Path(prom.log).read_text()[-1500:]}"
    try:
        return httpx.get(f"{base}/-/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def evacuation_on_page(dom: str, node: str) -> tuple[str | None, float | None]:
    """(the node's data-available, the evacuation's progress ratio) as the page rendered them."""
    avail = re.search(rf'data-node="{re.escape(node)}" data-available="(\w+)"', dom)
    row = re.search(rf'data-kind="evacuation" data-id="[^"]*/{re.escape(node)}".*?data-ratio="([0-9.]+)"', dom, re.S)
    return (avail.group(1) if avail else None), (float(row.group(1)) if row else None)


class Clients:
    """`n` NATS connections to one server, held open in a thread of their own."""

    def __init__(self, cluster: Any, url: str, n: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def connect_all() -> list[Any]:
            return await asyncio.gather(
                *(bnats.connect(cluster, urls=[url], client_name=f"crowd-{i}", allow_reconnect=False) for i in range(n))
            )

        self.conns = asyncio.run_coroutine_threadsafe(connect_all(), self.loop).result(60)

    def close(self) -> None:
        async def close_all() -> None:
            await asyncio.gather(*(c.close() for c in self.conns), return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close_all(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.mark.lab
@pytest.mark.spark
@pytest.mark.timeout(480)
def test_prometheus_and_the_console_follow_a_move_an_evacuation_and_a_relay(
    supercluster: lab.LabState, sites: lab.LabState, tmp_path: Path
) -> None:
    sc_topology, sites_topology = supercluster.path / "topology.yaml", sites.path / "topology.yaml"
    sc, st = profile_topology(supercluster), profile_topology(sites)
    token_file = Path(supercluster.lb["token_file"])
    token = token_file.read_text().strip()
    reports = tmp_path / "reports"
    reports.mkdir()
    relay_port, serve_port, prom_port, job_port = free_ports(4)
    procs: list[subprocess.Popen] = []
    prom = relay = clients = None

    # the production rules, but every `for:` one second, so that the test need not wait minutes
    rules = tmp_path / "alerts.yml"
    rules.write_text(re.sub(r"for: \d+m", "for: 1s", ALERTS.read_text()))
    try:
        # a relay nyc -> sfo under load, with its own metrics port, and a serve over the sites lab
        for site in ("nyc", "sfo"):
            asyncio.run(
                make_stream(st, site, "CONSOLE", ["console.>"], replicas=1, allow_batched=site == "sfo" or None)
            )
        ferry(
            "replicate",
            "start",
            "--from",
            "nyc",
            "--to",
            "sfo",
            "--streams",
            "CONSOLE",
            topology=sites_topology,
            check=True,
        )
        asyncio.run(durable(st, "nyc", "CONSOLE", "console-app"))  # for the consumer panels
        relay = Relay(sites_topology, tmp_path, "nyc", "sfo", "--metrics-port", str(relay_port))
        relay.event("relaying")
        procs.append(load(sites_topology, "nyc", "console.{n}", tmp_path / "relay-ledger", 300, None))
        env = {**os.environ, "FERRY_TOPOLOGY": str(sites_topology)}
        serve = [*FERRY, "serve", "--port", str(serve_port), "--public-read", "--reports", str(reports)]
        procs.append(subprocess.Popen(serve, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        sites_serve = f"http://127.0.0.1:{serve_port}"

        lab_serve = supercluster.lb["serve"].removeprefix("http://")
        targets = {
            "ferry-serve": [lab_serve],
            "ferry-serve-sites": [f"127.0.0.1:{serve_port}"],
            "ferry-relay": [f"127.0.0.1:{relay_port}"],
            "ferry-job": [f"127.0.0.1:{job_port}"],  # the evacuation's own --metrics-port, while it runs
        }
        prom = lab_prometheus.proc(tmp_path / "prometheus", prom_port, targets, token_file, [rules])
        prom.start()
        base = f"http://127.0.0.1:{prom_port}"
        wait_for(lambda: prometheus_ready(prom, base), 30, "Prometheus ready")
        wait_for(
            lambda: len(prom_query(base, 'up{job!="ferry-job"} == 1')) == 3,
            30,
            "Prometheus to scrape serve twice and the relay",
        )
        wait_for(lambda: prom_query(base, 'ferry_relay_relayed_total{job="ferry-relay"} > 0'), 20, "relayed")
        wait_for(lambda: prom_query(base, 'ferry_relay_consumer_carried{job="ferry-serve-sites"} == 1'), 30,
                 "the consumer checkpoint on record")  # fmt: skip

        # the relay dies under load: no relay is active, and its lag grows at the source
        relay.kill(signal.SIGKILL)
        relay.close()

        # a move under load
        asyncio.run(make_stream(sc, "east", "CONSOLE", ["console.>"], placement="east"))
        move_load = load(sc_topology, "east", "console.{n}", tmp_path / "move-ledger", 500, 12)
        time.sleep(2)  # the move starts under load (bounded: the load runs 12 s)
        move_run = ferry("move", "CONSOLE", "--to", "west", "--json", topology=sc_topology, check=True)
        moved = json.loads(move_run.stdout)
        (tmp_path / "move-events.jsonl").write_text(move_run.stderr)  # its --json events, for the audit's timeline
        assert moved["outcome"] == "moved", moved
        move_load.communicate(timeout=120)
        assert move_load.returncode == 0

        # an evacuation of east-3 with 30 clients on it, 3 closed a second: the page during it
        east = sc.nats("east")
        (e3,) = [b for b in east.brokers if b.name == "east-3"]
        clients = Clients(east, e3.url, 30)
        args = ["node", "evacuate", "east-3", "--wait-health-check", "2", "--conn-evict-rate", "3"]
        args += ["--wait-takeover", "1", "--metrics-port", str(job_port), "--json"]
        evac = subprocess.Popen(
            [*FERRY, *args], env={**os.environ, "FERRY_TOPOLOGY": str(sc_topology)}, stdout=subprocess.PIPE, text=True
        )
        procs.append(evac)
        page = f"{supercluster.lb['serve']}/#token={token}"
        seen: list[tuple[str | None, float | None]] = []

        def evicting() -> bool:
            dom, errors = chromium(page, tmp_path, "--dump-dom")
            assert not errors, errors
            seen.append(evacuation_on_page(dom, "east-3"))
            return seen[-1][0] == "false" and seen[-1][1] is not None and 0 < seen[-1][1] < 1

        wait_for(evicting, 30, "the page to show east-3 unavailable and its evacuation under way")
        shot = Path(os.environ.get("FERRY_SCREENSHOT") or tmp_path / "console.png")
        _, errors = chromium(page, tmp_path, f"--screenshot={shot}")
        assert not errors and shot.stat().st_size > 10_000, errors
        first = seen[-1][1] or 0.0

        def further_on() -> bool:  # up to done (1.0): a slow page may miss the rest of the evictions
            evicting()
            return seen[-1][0] == "false" and seen[-1][1] is not None and seen[-1][1] > first

        wait_for(further_on, 30, "the page to show the evacuation's progress further on")
        # the evacuation's own figures, scraped from the running process
        evicted = 'max_over_time(ferry_job_event_value{job="ferry-job",kind="evacuation",event="evicted"}[1m])'
        wait_for(lambda: prom_query(base, evicted), 30, "the evacuation's own metrics in Prometheus")
        out, _ = evac.communicate(timeout=120)
        assert json.loads(out)["outcome"] == "evacuated"

        # the audit of the move, in the folder the sites serve lists
        ferry(
            "audit", "--ledger", str(tmp_path / "move-ledger"), "--tier", "west=jetstream://west/CONSOLE",
            "--events", str(tmp_path / "move-events.jsonl"), "--bucket", "1",
            "--html", str(reports / "move.html"), topology=sc_topology, check=True,
        )  # fmt: skip
        listed = httpx.get(f"{sites_serve}/api/console", timeout=10).json()["audits"]
        assert [a["name"] for a in listed] == ["move"] and listed[0]["pass"] and listed[0]["tiers"]["west"]["lost"] == 0
        page = httpx.get(f"{sites_serve}/reports/move.html", timeout=10)
        assert page.status_code == 200
        marks = re.findall(r"<title>\d\d:\d\d:\d\d(?: to \d\d:\d\d:\d\d)?: ([a-z]+)", page.text)
        assert {"plan", "placement", "done"} <= set(marks) and "<polyline points=" in page.text, marks
        assert httpx.get(f"{sites_serve}/reports/..%2Fx.html", timeout=10).status_code == 404

        # every panel's query has series in Prometheus
        queries = {t: e for t, e in panel_queries().items() if t.split(" [")[0] not in FAILBACK_PANELS}
        for title, expr in queries.items():
            wait_for(lambda expr=expr: prom_query(base, expr), 30, f"series for panel {title}: {expr}")
        e3_avail = prom_query(base, 'ferry_node_available{job="ferry-serve",node="east-3"}')
        assert e3_avail[0]["value"][1] == "0", e3_avail
        moved_q = prom_query(base, 'ferry_move_missed_total{stream="CONSOLE"}')
        assert moved_q and float(moved_q[0]["value"][1]) == float(moved.get("missed") or 0), moved_q

        # every rule loaded and evaluating; the relay's lag and its absence fire
        groups = httpx.get(f"{base}/api/v1/rules", timeout=10).json()["data"]["groups"]
        bad = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"] if r["health"] != "ok"]
        assert not bad and sum(len(g["rules"]) for g in groups) == ALERTS.read_text().count("- alert:"), bad

        def firing() -> set[str]:
            alerts = httpx.get(f"{base}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
            return {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}

        wait_for(lambda: {"FerryRelayLagging", "FerryNoActiveRelay"} <= firing(), 90, "the relay alerts to fire")
        assert "FerryAuditFoundLosses" not in firing()

        # the lab's own Prometheus scrapes its serve
        assert prom_query(supercluster.lb["prometheus"], 'up{job="ferry-serve"} == 1')
        # no secret on the page's data or in the metrics
        for text in (
            httpx.get(f"{supercluster.lb['serve']}/metrics", headers={"Authorization": f"Bearer {token}"}).text,
            httpx.get(f"{supercluster.lb['serve']}/api/console", headers={"Authorization": f"Bearer {token}"}).text,
        ):
            assert token not in text and east.credentials.password() not in text  # type: ignore[union-attr]
        assert httpx.get(f"{supercluster.lb['serve']}/metrics", timeout=10).status_code == 401
    finally:
        if clients:
            clients.close()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        if relay:
            relay.close()
        if prom:
            prom.stop()
        ferry("replicate", "stop", "--from", "nyc", "--to", "sfo", "--wait", "0", topology=sites_topology)
        ferry("node", "stop", "east-3", topology=sc_topology)
        shutil.rmtree(tmp_path / "prometheus", ignore_errors=True)
