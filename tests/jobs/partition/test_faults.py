"""The repartition's fault matrix on the lab super-cluster (`make test-faults`; in `make test`, the
kill at the switch of test_partition.py stands for it): `ferry
partition apply --execute` SIGKILLed at every event it emits, then the same command; killed again
while it resumes; and the server of the old or the new owner killed while it copies. After each,
every id is counted in both streams here: none lost, none held twice, each in its owner; the claim
ends and the journal says done (issue 49)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from ferry import lab
from tests.helpers import killed_at_event, restart_node, started_json, stream_leader, wait_event
from tests.jobs.partition.setting import Setting

pytestmark = [pytest.mark.lab, pytest.mark.spark, pytest.mark.faults]

# every event of a repartition, in order ("copying": the history's first progress report)
EVENTS = ["plan", "claimed", "copying", "copied", "caught-up", "switched", "guard", "purged"]


def finished(s: Setting) -> dict:
    r = s.apply("--json")
    assert r.returncode == 0, r.stderr[-3000:]
    s.stop_load()
    counted = s.counted()
    assert counted["lost"] == counted["twice"] == counted["misplaced"] == 0, counted
    record = s.on_record()
    assert record["claim"].get("pending") is None and record["journal"]["phase"] == "done", record
    print(f"fault cell: {json.dumps(counted)}")  # shown by pytest -rP
    return json.loads(r.stdout)


@pytest.mark.parametrize("event", EVENTS)
def test_killed_at_every_event_the_same_command_finishes(
    supercluster: lab.LabState, tmp_path: Path, event: str
) -> None:
    s = Setting(supercluster, tmp_path, f"pf{EVENTS.index(event)}")
    s.start_load()
    try:
        killed_at_event(event, 1, "partition", "apply", str(s.v2), "--execute", topology=s.topology)
        result = finished(s)
        # the purge comes after the guards' reconciliation: killed before it, this run purges all
        purged_here = result["copied"] if EVENTS.index(event) < EVENTS.index("guard") else result["purged"]
        assert result["purged"] == purged_here and result["copied"] > 1000, result
        # killed once its journal was on record (from "claimed" on: it is written first), resumed from it
        assert result["resumed"] or event == "plan", result
    finally:
        s.stop_load()
        s.forget()


@pytest.mark.parametrize("event", ["switched", "guard"])
def test_killed_again_while_it_resumes(supercluster: lab.LabState, tmp_path: Path, event: str) -> None:
    s = Setting(supercluster, tmp_path, f"pr{event[0]}")
    s.start_load()
    try:
        args = ("partition", "apply", str(s.v2), "--execute")
        killed_at_event("caught-up", 1, *args, topology=s.topology)
        killed_at_event(event, 1, *args, topology=s.topology)
        assert finished(s)["resumed"]
    finally:
        s.stop_load()
        s.forget()


@pytest.mark.parametrize("whose", ["old", "new"])
def test_the_server_of_a_stream_killed_while_it_copies(supercluster: lab.LabState, tmp_path: Path, whose: str) -> None:
    """The server holding the old owner (R1), or the new owner, SIGKILLed at the copy's first
    progress report and started again 3 s later, under acked load: the repartition finishes, by
    itself or by the same command run again; every id once, in its owner."""
    s = Setting(supercluster, tmp_path, f"pn{whose[0]}")
    s.start_load()
    proc = started_json("partition", "apply", str(s.v2), "--execute", topology=s.topology)
    try:
        wait_event(proc, "copying")
        stream = s.old if whose == "old" else s.new
        node = asyncio.run(stream_leader(s.topo, "east", stream))
        assert proc.poll() is None, "the repartition ended before the kill"
        restart_node(supercluster, node, 3.0)
        code = proc.wait(timeout=300)
        print(f"fault cell: the first run ended {code}: {(proc.stdout.read() if proc.stdout else '')[-1500:]}")
        finished(s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        s.stop_load()
        s.forget()
