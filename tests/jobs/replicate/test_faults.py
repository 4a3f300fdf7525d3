"""The relay's and the site switches' fault cells (`make test-faults`; in `make test`, the standby
taking over a killed relay and the failover/failback under load stand for them): the active
relay's host stops answering for longer than its lease (its process group SIGSTOPped, as a host
that loses its network or freezes), the standby takes over, and then the first comes back
(SIGCONT) with a micro-batch in flight; `site failover` and `site failback` SIGKILLed at each
step they report, then run again; the relay's executor lost with its worker on the spark lab's
cluster (issue 48). Every acked id is counted here: each once (issue 49)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from pathlib import Path

import pytest

from ferry import lab
from ferry.topology import load_topology
from tests.helpers import Relay, ferry, killed_at_event, load, make_stream, stream_count, wait_for
from tests.jobs.replicate.test_replicate import define, exactly_once, finished, same_count, topology

__all__ = ["topology"]  # the fixture, shared with test_replicate.py

pytestmark = [pytest.mark.lab, pytest.mark.spark, pytest.mark.faults, pytest.mark.timeout(600)]


def test_a_relay_frozen_past_its_lease_gives_way_and_nothing_arrives_twice(topology: Path, tmp_path: Path) -> None:
    topo = load_topology(topology)
    define(topology, "FROZEN")
    a, b = Relay(topology, tmp_path, "nyc", "sfo"), None
    try:
        a.event("resume")
        b = Relay(topology, tmp_path, "nyc", "sfo")
        assert b.event("standby")["leader"]["pid"] == a.proc.pid
        producers = load(topology, "nyc", "frozen.{n}", tmp_path / "ledger", 2000, 15)
        wait_for(lambda: stream_count(topo, "sfo", "FROZEN") > 3000, 60, "relaying")
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
    finally:
        for r in (a, b):
            if r:
                with contextlib.suppress(ProcessLookupError):
                    r.kill(signal.SIGCONT)
                r.close()


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
