"""The NATS evacuation's and rebalance's fault matrices on the lab super-cluster (`make test-faults`;
in `make test`, the evacuation with guarded step-downs, serve's adoption of a CLI evacuation and a
rebalance through HAProxy stand for them): `ferry node evacuate` SIGKILLed at every state it enters
and once its step-down guard has reconciled; the lab's `ferry serve` (which shares the CLI's state
directory here) adopts it. Under core (fire-and-forget) load on the streams the node leads, every
message sent is in its stream once, and no capture is left. `ferry cluster rebalance` SIGKILLed at
every step, then run again; the node under evacuation, and a rebalance's donor or recipient,
SIGKILLed and restarted (issue 49)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from ferry import lab
from tests.conftest import profile_topology
from tests.helpers import (
    RATE,
    ferry,
    finish,
    judge,
    killed_at_event,
    make_stream,
    restart_node,
    start_load,
    started_json,
    stream_leader,
    wait_event,
    wait_for,
)
from tests.jobs.evacuate.test_evacuate import api, connections, crowd_of, haproxy_up

pytestmark = [pytest.mark.lab, pytest.mark.spark, pytest.mark.faults]

STATES = ["waiting_health_check", "evicting_conns", "waiting_takeover", "evicting_sessions", "prohibiting"]
STEPS = [("state", n) for n in range(1, len(STATES) + 1)] + [("guard", 1)]


@pytest.mark.parametrize(("event", "nth"), STEPS, ids=[STATES[n - 1] if e == "state" else e for e, n in STEPS])
def test_killed_at_every_step_and_adopted_by_serve(
    supercluster: lab.LabState, tmp_path: Path, spark: Any, monkeypatch: pytest.MonkeyPatch, event: str, nth: int
) -> None:
    state = Path(supercluster.lb["state_dir"])
    monkeypatch.setenv("FERRY_STATE_DIR", str(state))  # serve's: the step-down captures a kill leaves are its to find
    topology, topo = supercluster.path / "topology.yaml", profile_topology(supercluster)
    stream = f"EVF_{STEPS.index((event, nth))}"
    asyncio.run(make_stream(topo, "east", stream, [f"{stream.lower()}.>"], placement="east"))
    node = asyncio.run(stream_leader(topo, "east", stream))
    other = next(b.url for b in topo.nats("east").brokers if b.name != node)
    subjects = f"{stream.lower()}.{{n}}"
    load = start_load(topology, "nats://east", subjects, tmp_path / "ledger", 10, "--no-msg-id", "--url", other)
    try:
        args = ["node", "evacuate", node, "--wait-health-check", "1", "--wait-takeover", "1"]
        killed_at_event(event, nth, *args, topology=topology)

        def prohibiting() -> bool:
            rows = json.loads(ferry("node", "status", node, "--json", topology=topology, check=True).stdout)
            return bool(rows) and rows[0]["state"] == "prohibiting"

        wait_for(prohibiting, 90, f"ferry serve to take the evacuation of {node} to prohibiting")
        assert asyncio.run(stream_leader(topo, "east", stream)) != node
        finish(load)
        load = None
        wait_for(lambda: not list((state / "step-downs").glob("*/*/*")), 30, "the step-down captures to be reconciled")
    finally:
        if load:
            finish(load)
        ferry("node", "stop", node, topology=topology)
    t = judge(spark, topology, tmp_path / "ledger", f"jetstream://east/{stream}", tmp_path / "audit.html")
    assert t["lost"] == 0 and t["extra_copies"] == 0 and t["sent"] > RATE * 4, t
    print(f"fault cell: {json.dumps({k: t[k] for k in ('sent', 'lost', 'extra_copies')})}")


# a rebalance's events up to its last state (waiting_health_check, evicting_conns, waiting_takeover,
# evicting_sessions), its first connections evicted among them
REBALANCE_STEPS = [("plan", 1), ("state", 1), ("state", 2), ("evicted", 1), ("state", 3), ("state", 4)]


@pytest.mark.parametrize(("event", "nth"), REBALANCE_STEPS, ids=[f"{e}-{n}" for e, n in REBALANCE_STEPS])
def test_a_rebalance_killed_at_every_step_is_finished_by_a_rerun_or_serve(
    supercluster: lab.LabState,
    crowded: Any,
    clients: Any,
    tmp_path: Path,
    spark: Any,
    monkeypatch: pytest.MonkeyPatch,
    event: str,
    nth: int,
) -> None:
    """300 JetStream clients crowded on east-2 through HAProxy; `cluster rebalance east --execute`
    SIGKILLed at each of its steps, then the same command (the lab's `ferry serve` may have adopted
    it first): the rebalance ends, east-2 is no longer crowded, every acked message is held once,
    and nothing of it stays on record."""
    monkeypatch.setenv("FERRY_STATE_DIR", supercluster.lb["state_dir"])  # serve's, as in the lab
    stream = f"RBF_{REBALANCE_STEPS.index((event, nth))}"
    load = crowd_east_2(supercluster, crowded, clients, tmp_path, stream)
    killed_at_event(event, nth, *REBALANCE, topology=supercluster.path / "topology.yaml")
    rerun_rebalance(supercluster)  # resumes it, unless serve adopted it first
    balanced_and_held(supercluster, load, stream, spark, tmp_path)


REBALANCE = ["cluster", "rebalance", "east", "--abs-conn-threshold", "20", "--wait-health-check", "3"]
REBALANCE += ["--wait-takeover", "1", "--conn-evict-rate", "100", "--execute"]


def crowd_east_2(supercluster: lab.LabState, crowded: Any, clients: Any, tmp_path: Path, stream: str) -> Any:
    """300 JetStream clients writing to `stream` (ledger `tmp_path/ledger`), crowded on east-2
    through HAProxy: the load, for :func:`balanced_and_held`."""
    crowded("east-2")
    load = clients(tmp_path / "ledger", 40, stream)
    crowd_of(supercluster, load, "east-2")
    crowded.release()
    return load


def rerun_rebalance(supercluster: lab.LabState) -> None:
    """The same rebalance again: it finishes (or the lab's serve, which adopted it, does)."""
    r = ferry(*REBALANCE, "--json", topology=supercluster.path / "topology.yaml")
    adopted = ("already running", "was taken over by another ferry")
    assert r.returncode == 0 or any(a in r.stderr for a in adopted), r.stderr[-3000:]


def balanced_and_held(supercluster: lab.LabState, load: Any, stream: str, spark: Any, tmp_path: Path) -> None:
    """The rebalance off the record, HAProxy with every node, east-2 no longer crowded; the load
    stopped, every message it had acked held once."""
    wait_for(lambda: api(supercluster, "GET", "/rebalances").json() == [], 120, "the rebalance to end")
    wait_for(lambda: all(haproxy_up(supercluster).values()), 30, "HAProxy to have every east node in rotation")
    now = connections(supercluster)
    assert now["east-2"] < (now["east-1"] + now["east-3"]) / 2 + 25, now  # (clients still reconnecting: +5)
    finish(load)
    topology = supercluster.path / "topology.yaml"
    t = judge(spark, topology, tmp_path / "ledger", f"jetstream://east/{stream}", tmp_path / "audit.html")
    assert t["lost"] == 0 and t["extra_copies"] == 0 and t["sent"] > 0, t
    print(f"fault cell: {json.dumps({k: t[k] for k in ('sent', 'lost', 'extra_copies')} | {'now': now})}")


def test_the_node_killed_under_its_own_evacuation_is_waited_for_then_evacuated(
    supercluster: lab.LabState, tmp_path: Path, spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node under evacuation SIGKILLed once the evacuation moves its leaders, started again 3 s
    later, under JetStream load (retries under the same msg id) through another server: the same
    `ferry node evacuate` waits for the node, moves off what it leads again and ends prohibiting;
    every acked message is held once."""
    monkeypatch.setenv("FERRY_STATE_DIR", supercluster.lb["state_dir"])  # serve's, as in the lab
    topology, topo = supercluster.path / "topology.yaml", profile_topology(supercluster)
    stream = "EVF_NODE"
    asyncio.run(make_stream(topo, "east", stream, [f"{stream.lower()}.>"], placement="east"))
    node = asyncio.run(stream_leader(topo, "east", stream))
    other = next(b.url for b in topo.nats("east").brokers if b.name != node)
    load = start_load(topology, "jetstream://east", f"{stream.lower()}.{{n}}", tmp_path / "ledger", 20, "--url", other)
    proc = started_json(
        "node", "evacuate", node, "--wait-health-check", "1", "--wait-takeover", "1", "--sess-evict-rate", "1",
        topology=topology,
    )  # fmt: skip
    try:
        wait_event(proc, "state", 4)  # evicting_sessions
        restart_node(supercluster, node, 3.0)
        assert proc.wait(timeout=180) == 0
        result = json.loads(proc.stdout.read())  # type: ignore[union-attr]
        assert asyncio.run(stream_leader(topo, "east", stream)) != node  # led elsewhere once it came back
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        finish(load)
        ferry("node", "stop", node, topology=topology)
    assert result["outcome"] == "evacuated" and result["state"] == "prohibiting", result
    t = judge(spark, topology, tmp_path / "ledger", f"jetstream://east/{stream}", tmp_path / "audit.html")
    assert t["lost"] == 0 and t["extra_copies"] == 0 and t["sent"] > RATE * 10, t
    print(f"fault cell: {json.dumps({k: t[k] for k in ('sent', 'lost', 'extra_copies')})}")


@pytest.mark.parametrize("node", ["east-2", "east-1"], ids=["donor", "recipient"])
def test_a_node_of_a_rebalance_killed_while_it_evicts(
    supercluster: lab.LabState, crowded: Any, clients: Any, tmp_path: Path, spark: Any, monkeypatch: pytest.MonkeyPatch,
    node: str,
) -> None:  # fmt: skip
    """300 JetStream clients crowded on east-2 through HAProxy; the donor (east-2) or a recipient
    (east-1) SIGKILLed at the rebalance's first eviction and started again 3 s later: the rebalance
    aborts saying which node stopped answering, the same command run again ends it, east-2 is no
    longer crowded, every acked message is held once, nothing of it stays on record, and HAProxy
    has every node back."""
    monkeypatch.setenv("FERRY_STATE_DIR", supercluster.lb["state_dir"])
    stream = f"RBN_{node[-1]}"
    load = crowd_east_2(supercluster, crowded, clients, tmp_path, stream)
    proc = started_json(*REBALANCE, topology=supercluster.path / "topology.yaml")
    try:
        wait_event(proc, "evicted")
        restart_node(supercluster, node, 3.0)
        code = proc.wait(timeout=180)
        first = json.loads(proc.stdout.read())  # type: ignore[union-attr]
        print(f"fault cell: the first run ended {code}: {first['outcome']}")
        if code != 0:  # it stops, saying which node, and leaves nothing on record that holds a node back
            assert first["outcome"] == f"aborted: node {node} stopped answering", first
            rerun_rebalance(supercluster)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    balanced_and_held(supercluster, load, stream, spark, tmp_path)
