"""The move's fault matrix on the lab super-cluster (`make test-faults`; in `make test`, the kill
tests of test_move.py stand for it): `ferry move` SIGKILLed at every step it reports, then

- run again with no `ferry serve` beside it, under JetStream load with retries: every acked
  message is in the stream once (core publishes between the kill and the rerun are not guarded:
  the rerun says how long, `unguarded_s`);
- adopted by a `ferry serve` that kept a standby guard, under core (fire-and-forget) load: every
  message sent is in the stream once, those of the unguarded gap too.

Each cell counts the ids the producers recorded with the audit, and checks that the move is done
on record and left no capture behind (issue 49)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ferry import lab
from ferry.lab.procs import free_ports
from tests.conftest import profile_topology
from tests.helpers import FERRY, RATE, ferry, finish, judge, killed_at_event, make_stream, start_load, wait_for
from tests.jobs.move.test_move import fill_big, move

pytestmark = [pytest.mark.lab, pytest.mark.spark, pytest.mark.faults]

# the steps a move reports, in order, as (event, its nth time): the second "guard" is the reconciliation
STEPS = [("plan", 1), ("guard", 1), ("placement", 1), ("progress", 1), ("leader", 1), ("guard", 2), ("verify", 1)]


def _setting(supercluster: lab.LabState, tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FERRY_STATE_DIR", str(tmp_path / "state"))
    topo = profile_topology(supercluster)
    asyncio.run(make_stream(topo, "east", name, [name.lower() + ".>"], placement="east"))
    fill_big(topo, name, n=20_000)
    return supercluster.path / "topology.yaml"


def _record(topology: Path, stream: str) -> dict[str, Any]:
    return json.loads(ferry("move", "--status", stream, "--json", topology=topology, check=True).stdout)


def _judged(spark: Any, topology: Path, tmp_path: Path, stream: str, subjects: str) -> dict[str, Any]:
    record = _record(topology, stream)
    assert record["phase"] == "done" and record["result"]["outcome"] == "moved", record
    assert record["result"]["verify"]["ok"], record["result"]["verify"]
    assert not list((tmp_path / "state" / "moves").iterdir()), "a capture was left"
    tier = f"jetstream://west/{stream}?subject={subjects}"
    t = judge(spark, topology, tmp_path / "ledger", tier, tmp_path / "audit.html")
    assert t["lost"] == 0 and t["extra_copies"] == 0 and t["sent"] > RATE * 4, t
    print(f"fault cell: {json.dumps({k: t[k] for k in ('sent', 'lost', 'extra_copies')})}")
    return record


@pytest.mark.parametrize(("event", "nth"), STEPS, ids=[f"{e}{n}" for e, n in STEPS])
def test_killed_at_every_step_and_run_again(
    supercluster: lab.LabState, tmp_path: Path, spark: Any, monkeypatch: pytest.MonkeyPatch, event: str, nth: int
) -> None:
    stream = f"MF_R{STEPS.index((event, nth))}"
    topology = _setting(supercluster, tmp_path, stream, monkeypatch)
    subjects = f"{stream.lower()}.js.>"
    load = start_load(topology, "jetstream://east", subjects[:-1] + "{n}", tmp_path / "ledger", 10, "--producers", "2")
    try:
        killed_at_event(event, nth, "move", stream, "--to", "west", topology=topology)
        code, result, _ = move(topology, stream, "--to", "west")
        assert code == 0, result
    finally:
        finish(load)
    _judged(spark, topology, tmp_path, stream, subjects)


@pytest.mark.parametrize(("event", "nth"), STEPS[2:5], ids=[f"{e}{n}" for e, n in STEPS[2:5]])
def test_killed_at_a_step_and_adopted_by_serve(
    supercluster: lab.LabState, tmp_path: Path, spark: Any, monkeypatch: pytest.MonkeyPatch, event: str, nth: int
) -> None:
    stream = f"MF_S{STEPS.index((event, nth))}"
    topology = _setting(supercluster, tmp_path, stream, monkeypatch)
    subjects = f"{stream.lower()}.core.>"
    (port,) = free_ports(1)
    env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
    with (tmp_path / "serve.log").open("w") as log:
        serve = subprocess.Popen([*FERRY, "serve", "--port", str(port)], env=env, stderr=log)
    load = None
    try:
        wait_for(lambda: list((tmp_path / "state" / "serve").glob("*.json")), 60, "ferry serve to announce itself")
        load = start_load(topology, "nats://west", subjects[:-1] + "{n}", tmp_path / "ledger", 10, "--no-msg-id")
        killed_at_event(event, nth, "move", stream, "--to", "west", topology=topology)
        wait_for(lambda: _record(topology, stream)["phase"] == "done", 120, "ferry serve to finish the move")
    finally:
        if load:
            finish(load)
        serve.terminate()
        serve.wait(timeout=30)
    record = _judged(spark, topology, tmp_path, stream, subjects)
    assert record["owner"]["pid"] == serve.pid and record["result"]["unguarded_s"] == 0.0, record
