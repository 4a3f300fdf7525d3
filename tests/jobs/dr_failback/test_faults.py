"""The fail-back's fault matrix on the rabbit-dr lab (`make test-faults`; in `make test`, the
kills of test_dr_failback.py stand for it): the gist's setting failed back again and again with each
engine, ferry SIGKILLed at every event of a fail-back and rerun, a shovel's connection cut, pc1
and ltm killed and restarted mid-transfer and rerun. After each, every federated queue of pc1 is
drained and counted by message id here: none lost, and the duplicates ferry reports are the ones
counted (issue 46)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from typing import Any

import pytest

from ferry import lab
from ferry.brokers.rabbitmq import Management, q
from tests.helpers import FERRY, ferry, killed_at_event, restart_node, started_json, wait_event, wait_for
from tests.jobs.dr_failback.setting import assert_done, counted_on_pc1, depths

pytestmark = [pytest.mark.lab, pytest.mark.spark, pytest.mark.faults]

ARGS = ("failback", "--from", "ltm", "--to", "pc1")


def finished(dr: dict[str, Any], *args: str, earlier: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the fail-back to its end, check what it left, count pc1 by id; the report (that of an
    `earlier` run that finished, when this one finds nothing to do)."""
    result = ferry(*ARGS, *args, "--json", topology=dr["topology"])
    assert result.returncode in (0, 3), result.stderr[-3000:]
    report = json.loads(result.stdout)
    if report["outcome"] == "nothing to do":  # an earlier run finished, or was killed once it had
        report = earlier or report
    assert_done(dr)
    counted = counted_on_pc1(dr)
    assert counted["lost"] == counted["extra"] == 0, counted
    if "queues" in report:
        assert report["outcome"].startswith("complete") and report["total"]["left"] == 0, report["outcome"]
        assert report["unverified_duplicates"] == 0, report["verification"]  # every target was checked
        assert report["duplicates"] == counted["duplicated"], (counted, report["verification"])
    else:  # killed after its journal was gone: its report is lost
        assert counted["duplicated"] == 0, counted
    said = {k: report.get(k) for k in ("outcome", "possible_duplicates", "duplicates")}
    said["already_there"] = report.get("total", {}).get("already_there")
    print(f"fault cell: {json.dumps(said)}; counted on pc1: {json.dumps(counted)}")  # shown by pytest -rP
    return {**report, "counted": counted}


@pytest.mark.connect
@pytest.mark.parametrize(
    ("engine", "max_active", "run"),
    [("spark", 50, i) for i in range(10)] + [("shovel", 50, i) for i in range(10)]
    + [("shovel", 3, i) for i in range(5)],
)  # fmt: skip
def test_every_orphan_arrives_once_run_after_run(dr: dict[str, Any], engine: str, max_active: int, run: int) -> None:
    report = finished(dr, "--engine", engine, "--max-active", str(max_active))
    assert report["outcome"] == "complete" and report["counted"]["duplicated"] == 0, report["verification"]


def killed_at(dr: dict[str, Any], event: str, nth: int, *args: str) -> None:
    killed_at_event(event, nth, *ARGS, *args, topology=dr["topology"])


SHOVEL_EVENTS = [("plan", 1), ("journal", 1), ("upstream-disabled", 1), ("upstream-disabled", 2), ("transfer", 1),
                 ("shovel", 1), ("shovel", 10), ("progress", 4), ("drained", 1), ("drained", 10),
                 ("upstream-restored", 1), ("upstream-restored", 2)]  # fmt: skip
SPARK_EVENTS = [("plan", 1), ("journal", 1), ("upstream-disabled", 1), ("upstream-disabled", 2), ("transfer", 1),
                ("progress", 2), ("progress", 6), ("upstream-restored", 1), ("upstream-restored", 2)]  # fmt: skip


@pytest.mark.parametrize(
    ("engine", "event", "nth"),
    [("shovel", *e) for e in SHOVEL_EVENTS] + [("spark", *e) for e in SPARK_EVENTS],
)  # fmt: skip
def test_killed_at_every_event_a_plain_rerun_finishes(dr: dict[str, Any], engine: str, event: str, nth: int) -> None:
    """SIGKILL at each event of a fail-back, then the same command: it finishes, none lost, and the
    duplicates it reports are the ones counted on pc1 (none with the spark engine)."""
    killed_at(dr, event, nth, "--engine", engine)
    report = finished(dr, "--engine", engine)
    if engine == "spark":  # what the killed run delivered came back with ids pc1 holds: not delivered again
        assert report["counted"]["duplicated"] == 0, report.get("verification")


@pytest.mark.parametrize("dr", [10_000], indirect=True)  # long enough to kill a node midway
@pytest.mark.parametrize(("engine", "node"), [("spark", "ltm"), ("spark", "pc1"), ("shovel", "ltm"), ("shovel", "pc1")])
def test_a_node_killed_mid_transfer_then_a_plain_rerun(
    dr: dict[str, Any], rabbit_dr: lab.LabState, engine: str, node: str
) -> None:
    """The source (ltm) or the target (pc1) SIGKILLed mid-transfer and restarted 5 s later; ferry
    fails or stalls, or rides it out; then the same command finishes with none lost, and the
    duplicates it reports are the ones counted (none with the spark engine)."""
    topo, total = dr["topo"], 10 * dr["per_queue"]
    env = {**os.environ, "FERRY_TOPOLOGY": str(dr["topology"])}
    argv = [*FERRY, *ARGS, "--engine", engine, "--stall-timeout", "20", "--json"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: sum(asyncio.run(depths(topo, "ltm", [])).values()) < total * 0.8, 120, "the transfer")
        restart_node(rabbit_dr, node, 5.0)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    first = json.loads(out) if proc.returncode in (0, 3) else None  # it may ride the restart out
    report = finished(dr, "--engine", engine, earlier=first)
    if engine == "spark":
        assert report["counted"]["duplicated"] == 0, report.get("verification")


@pytest.mark.parametrize("dr", [10_000], indirect=True)
@pytest.mark.parametrize("how", ["connection", "parameter"])
def test_a_shovel_cut_mid_transfer_is_counted(dr: dict[str, Any], how: str) -> None:
    """A shovel's connection closed by the broker (the shovel restarts), or its parameter removed
    while its queue still holds messages, as a shovel hit by rabbitmq-server #14636 removes itself
    (the lab's RabbitMQ 3.10 does not: 2,000 and 20,000 messages, prefetch 1,000 and 5,000, classic
    and quorum, every shovel moved all): ferry shovels the rest and counts what came twice."""
    topo = dr["topo"]
    env = {**os.environ, "FERRY_TOPOLOGY": str(dr["topology"])}
    argv = [*FERRY, *ARGS, "--engine", "shovel", "--max-active", "2", "--json"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    async def cut() -> bool:
        async with Management(topo.rabbitmq("ltm"), name="ltm") as m:
            running = [s for s in await m.get("/shovels") if s["name"].startswith("ferry-failback-")]
            running = [s for s in running if s.get("state") == "running" and s.get("src_queue")]
            for s in running:
                if await m.get(f"/queues/{q(s['vhost'])}/{q(s['src_queue'])}?columns=messages_ready") is None:
                    continue
                if how == "parameter":
                    await m.delete(f"/parameters/shovel/{q(s['vhost'])}/{q(s['name'])}")
                    return True
                async with Management(topo.rabbitmq("pc1"), name="pc1") as target:  # its publishing side
                    conns = [c for c in await target.get("/connections")
                             if (c.get("user_provided_name") or "").startswith("Shovel " + s["name"])]  # fmt: skip
                    for c in conns:
                        await target.delete(f"/connections/{q(c['name'])}")
                return bool(conns)
        return False

    try:
        # from the first running shovel on (waiting for the queues to drain first left CI none to cut)
        wait_for(lambda: asyncio.run(cut()), 120, f"a running shovel to cut ({how})")
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode in (0, 3), err[-3000:]
    report = json.loads(out)
    assert report["total"]["left"] == 0 and report["unverified_duplicates"] == 0, report["verification"]
    assert_done(dr)
    counted = counted_on_pc1(dr)
    assert counted["lost"] == counted["extra"] == 0 and report["duplicates"] == counted["duplicated"], counted


@pytest.mark.parametrize("engine", ["spark", "shovel"])
def test_the_source_killed_as_its_upstreams_come_back(dr: dict[str, Any], rabbit_dr: lab.LabState, engine: str) -> None:
    """ltm SIGKILLed once the transfer is over and the first upstream is back: acks it had not
    stored yet are lost with it, and their messages come back. The same command moves them again
    (upstreams off again first), with the spark engine not to where they already are."""
    proc = started_json(*ARGS, "--engine", engine, topology=dr["topology"])
    try:
        wait_event(proc, "upstream-restored", 1)
        restart_node(rabbit_dr, "ltm", 2.0)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    report = finished(dr, "--engine", engine, earlier=json.loads(out) if proc.returncode in (0, 3) else None)
    if engine == "spark":
        assert report["counted"]["duplicated"] == 0, report.get("verification")
