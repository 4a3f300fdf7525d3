"""The relay's fault cells beyond a SIGKILL (`make test-faults`; in `make test`, the standby taking
over a killed relay stands for them): the active relay's host stops answering for longer than
its lease (its process group SIGSTOPped, as a host that loses its network or freezes), the
standby takes over, and then the first comes back (SIGCONT) with a micro-batch in flight. Every
acked id is counted at sfo here: each once (issue 49)."""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import pytest

from ferry.topology import load_topology
from tests.helpers import Relay, load, stream_count, wait_for
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
