"""The relay's and the site switches' fault cells (`make test-faults`; in `make test`, the standby
taking over a killed relay and the failover/failback under load stand for them): the active relay's
host stops answering for longer than its lease (its process group SIGSTOPped, as a host that
freezes), the standby takes over, and then the first comes back (SIGCONT) with a micro-batch in
flight; the same with the relay's host cut off from the destination by a network split (its process
runs on); the source's or the destination's server killed under the relay; `site failover` and `site
failback` SIGKILLed at each step they report, then run again; the relay's executor lost with its
worker on the spark lab's cluster (issue 48). Every acked id is counted here: each once (issue 49)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from pathlib import Path

import pytest
import yaml

from ferry import lab
from ferry.topology import load_topology
from tests.helpers import (
    NetSplit,
    Relay,
    ferry,
    killed_at_event,
    load,
    make_stream,
    restart_node,
    stream_count,
    wait_for,
)
from tests.jobs.replicate.test_replicate import (
    active_and_standby,
    define,
    exactly_once,
    finished,
    same_count,
    topology,
)

__all__ = ["topology"]  # the fixture, shared with test_replicate.py

pytestmark = [pytest.mark.lab, pytest.mark.spark, pytest.mark.timeout(600), pytest.mark.faults]


def test_a_relay_frozen_past_its_lease_gives_way_and_nothing_arrives_twice(topology: Path, tmp_path: Path) -> None:
    topo = load_topology(topology)
    define(topology, "FROZEN")
    with active_and_standby(topology, tmp_path, "FROZEN", 15) as (a, b, producers):
        a.kill(signal.SIGSTOP)  # alive to its host (its pid runs), silent to everyone: only the lease tells
        frozen = time.time()
        took_over = b.event("active", timeout=60)["t"] - frozen
        # once the heartbeat (every 1 s) is older than the lease less a second (5 s - 1 s): not at once
        assert 3.0 <= took_over < 15.0, f"the standby took over {took_over:.1f}s after the freeze"
        b.event("relaying")
        a.kill(signal.SIGCONT)  # back, its micro-batch still in flight: it must find its lease taken
        standby = a.event("standby", timeout=60)
        assert standby["leader"]["pid"] == b.proc.pid, standby
        summary = finished(producers)
        n = same_count(topo, "FROZEN")
        exactly_once(topo, "sfo", "FROZEN", [tmp_path / "ledger"])
        assert n >= summary["acked"], (n, summary)
        time.sleep(2.0)  # a relay still writing would add copies now
        assert stream_count(topo, "sfo", "FROZEN") == n


def test_a_relay_split_from_its_destination_past_its_lease_gives_way(topology: Path, tmp_path: Path) -> None:
    """The active relay's every connection to the destination goes through a network split held
    for three leases (its process runs on; what it sends waits in the split, as TCP's retransmits
    do): the standby takes over, and when the split heals, the first relay's writes arrive late
    and it finds its lease taken. Every acked id is at sfo once."""
    topo = load_topology(topology)
    define(topology, "SPLIT")
    raw = yaml.safe_load(topology.read_text())
    with contextlib.ExitStack() as closing:
        splits = []
        for site in raw["sites"].values():
            for b in site["clusters"].get("sfo", {}).get("brokers", []):
                splits.append(closing.enter_context(contextlib.closing(NetSplit(b["url"].split("://", 1)[1]))))
                b["url"] = f"nats://127.0.0.1:{splits[-1].port}"
        assert splits, raw
        behind = tmp_path / "topology-behind-a-split.yaml"
        behind.write_text(yaml.safe_dump(raw))
        a, b, producers = closing.enter_context(active_and_standby(topology, tmp_path, "SPLIT", 20, behind))
        for s in splits:
            s.split()
        split_at = time.time()
        took_over = b.event("active", timeout=60)["t"] - split_at
        assert 3.0 <= took_over < 15.0, f"the standby took over {took_over:.1f}s after the split"
        b.event("relaying")
        wait_for(lambda: time.time() > split_at + 15, 20, "three leases of split")
        for s in splits:
            s.heal()
        standby = a.event("standby", timeout=60)  # back: it must find its lease taken
        assert standby["leader"]["pid"] == b.proc.pid, standby
        summary = finished(producers)
        n = same_count(topo, "SPLIT")
        exactly_once(topo, "sfo", "SPLIT", [tmp_path / "ledger"])
        assert n >= summary["acked"], (n, summary)
        print(f"fault cell: {json.dumps({'acked': summary['acked'], 'held': n, 'took_over_s': round(took_over, 1)})}")


@pytest.mark.parametrize("site", [pytest.param("nyc", id="source"), pytest.param("sfo", id="destination")])
def test_a_site_server_killed_under_the_relay_is_ridden_out(
    sites: lab.LabState, topology: Path, tmp_path: Path, site: str
) -> None:
    """The source's or the destination's server SIGKILLed while the relay relays under load, and
    started again 3 s later: the same relay goes on (or stands by and takes its lease again), and
    every acked id is at sfo once."""
    topo = load_topology(topology)
    stream = f"RNODE_{site.upper()}"
    define(topology, stream)
    relay = Relay(topology, tmp_path, "nyc", "sfo")
    try:
        relay.event("relaying")
        producers = load(topology, "nyc", f"{stream.lower()}.{{n}}", tmp_path / "ledger", 2000, 15)
        wait_for(lambda: stream_count(topo, "sfo", stream) > 3000, 60, "relaying")
        restart_node(sites, f"{site}-1", 3.0)
        summary = finished(producers)
        try:
            n = same_count(topo, stream, timeout=120)
        except AssertionError as exc:
            counts = {site: stream_count(topo, site, stream) for site in ("nyc", "sfo")}
            raise AssertionError(f"{exc}: {counts}; the relay said {relay.log.read_text()[-3000:]}") from None
        exactly_once(topo, "sfo", stream, [tmp_path / "ledger"])
        assert n >= summary["acked"] > 10_000, (n, summary)
        assert relay.proc.poll() is None, relay.log.read_text()[-2000:]  # it rode it out
    finally:
        relay.close()
    print(f"fault cell: {json.dumps({'killed': site, 'held': n, 'acked': summary['acked']})}")


STREAMS = ("SWA", "SWB")


def test_site_failover_and_failback_killed_at_each_step_then_run_again(
    sites: lab.LabState, topology: Path, tmp_path: Path
) -> None:
    """Two streams relayed nyc -> sfo, the relay behind when nyc dies. `site failover --to sfo` is
    SIGKILLed once it has fenced the replication, then once it has made sfo primary, and run again;
    sfo takes writes; nyc comes back; `site failback --to nyc` is SIGKILLed once each stream is
    reconciled, then run again. Every acked id is at both sites, once."""
    topo = load_topology(topology)
    for site in ("nyc", "sfo"):
        for s in STREAMS:
            asyncio.run(make_stream(topo, site, s, [f"{s.lower()}.>"], replicas=1, allow_batched=site == "sfo" or None))
    ferry("replicate", "start", "--from", "nyc", "--to", "sfo", "--streams", "SW?", topology=topology, check=True)
    relay, nyc = Relay(topology, tmp_path, "nyc", "sfo"), sites.proc("nyc-1")
    ledgers = [tmp_path / f"ledger-{s}" for s in ("nyc-a", "nyc-b", "sfo-a", "sfo-b")]
    try:
        relay.event("resume")
        at_nyc = [load(topology, "nyc", f"{s.lower()}.{{n}}", ledgers[i], 1000, None) for i, s in enumerate(STREAMS)]
        wait_for(lambda: all(stream_count(topo, "sfo", s) > 1000 for s in STREAMS), 60, "relaying")
        relay.kill(signal.SIGSTOP)  # replication lags behind nyc's acks
        time.sleep(1.0)
        nyc.signal(signal.SIGKILL)
        wait_for(lambda: not nyc.alive(), 10, "nyc to die")
        for p in at_nyc:
            p.send_signal(signal.SIGTERM)
            finished(p)

        for event in ("fenced", "primary"):
            killed_at_event(event, 1, "site", "failover", "--to", "sfo", topology=topology)
        fo = json.loads(ferry("site", "failover", "--to", "sfo", "--json", topology=topology, check=True).stdout)
        assert fo["primary"] == "sfo", fo
        relay.kill(signal.SIGCONT)  # the old relay wakes up fenced: it stops, relaying nothing
        assert relay.proc.wait(timeout=60) == 0
        for i, s in enumerate(STREAMS):
            finished(load(topology, "sfo", f"{s.lower()}.sfo.{{n}}", ledgers[2 + i], 500, 3))

        nyc.start()
        sites.save()
        wait_for(lambda: sites.health().get("nyc-1") == "ok", 30, "nyc to answer again")
        args = ("site", "failback", "--to", "nyc")
        for nth in range(1, len(STREAMS) + 1):
            killed_at_event("reconciled", nth, *args, topology=topology)
        fb = json.loads(ferry(*args, "--json", topology=topology, check=True).stdout)
        assert fb.get("already") or fb["streams"], fb
        rows = {r["site"]: r for r in json.loads(ferry("site", "status", "--json", topology=topology).stdout)}
        assert rows["nyc"]["primary"] == rows["sfo"]["primary"] == "nyc" and not rows["nyc"]["failback_running"], rows
        for s, mine in zip(STREAMS, ((ledgers[0], ledgers[2]), (ledgers[1], ledgers[3])), strict=True):
            for site in ("nyc", "sfo"):
                exactly_once(topo, site, s, list(mine))
            assert stream_count(topo, "nyc", s) == stream_count(topo, "sfo", s), s
    finally:
        with contextlib.suppress(ProcessLookupError):
            relay.kill(signal.SIGCONT)
        relay.close()
        if not nyc.alive():
            nyc.start()
            sites.save()
        ferry("replicate", "stop", "--from", "nyc", "--to", "sfo", "--wait", "0", topology=topology)


@pytest.mark.cluster
def test_a_relay_whose_executor_dies_with_its_worker_relays_each_message_once(
    topology: Path, tmp_path: Path, spark_cluster: lab.LabState
) -> None:
    """The relay on the spark lab's cluster; the worker running its executor SIGKILLed (JVM,
    executor, Python workers) and started again: the micro-batch in flight runs again elsewhere,
    and what it had written already is not written twice."""
    from ferry.lab import spark as lab_spark

    topo = load_topology(topology)
    define(topology, "EXECKILL")
    relay = Relay(topology, tmp_path, "nyc", "sfo")
    try:
        relay.event("relaying")
        producers = load(topology, "nyc", "execkill.{n}", tmp_path / "ledger", 2000, 15)
        wait_for(lambda: stream_count(topo, "sfo", "EXECKILL") > 5000, 60, "relaying")
        (worker, *_) = lab_spark.workers_running(spark_cluster.spark, "ferry relay")
        spark_cluster.proc(worker).kill()
        lab.up("spark", spark_cluster.path.parent, log=lambda _: None)  # back, empty
        summary = finished(producers)
        n = same_count(topo, "EXECKILL")
        exactly_once(topo, "sfo", "EXECKILL", [tmp_path / "ledger"])
        assert n >= summary["acked"] > 20_000, (n, summary)
    finally:
        relay.close()


# a relay's events up to its steady state: it takes the lease, resumes from the destination, relays
RELAY_EVENTS = [("active", 1), ("resume", 1), ("relaying", 1)]


@pytest.mark.parametrize(("event", "nth"), RELAY_EVENTS, ids=[e for e, _ in RELAY_EVENTS])
def test_a_relay_killed_at_every_event_then_run_again_relays_each_message_once(
    topology: Path, tmp_path: Path, event: str, nth: int
) -> None:
    """`replicate run` SIGKILLed (driver, JVM, Python workers) at each event on its way to relaying,
    under load, then started again: the new relay takes the dead one's lease and resumes from what
    sfo holds; each acked message once."""
    topo = load_topology(topology)
    stream = f"RKILL{RELAY_EVENTS.index((event, nth))}"
    define(topology, stream)
    producers = load(topology, "nyc", f"{stream.lower()}.{{n}}", tmp_path / "ledger", 2000, 15)
    killed_at_event(event, nth, "replicate", "run", "--from", "nyc", "--to", "sfo", topology=topology)
    relay = Relay(topology, tmp_path, "nyc", "sfo")
    try:
        relay.event("relaying", timeout=120)
        summary = finished(producers)
        n = same_count(topo, stream)
        exactly_once(topo, "sfo", stream, [tmp_path / "ledger"])
        assert n >= summary["acked"] > 20_000, (n, summary)
    finally:
        relay.close()
    print(f"fault cell: {json.dumps({'killed_at': event, 'held': n, 'acked': summary['acked']})}")
