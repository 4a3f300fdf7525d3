"""`ferry failback` on the rabbit-dr lab: art feeds pc1 and ltm by queue federation;
the messages left on ltm come back to pc1 and none is pulled from art."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import pyarrow.parquet as pq
import pytest

from ferry import lab
from ferry.brokers.rabbitmq import Management, amqp_connect, q
from ferry.headers import TRANSFER_HDR
from ferry.jobs.dr_failback.plan import GUARANTEES, PREFETCH
from ferry.jobs.dr_failback.verify import verify
from ferry.lab import prometheus as lab_prometheus
from ferry.lab import rabbitmq as lab_rabbit
from ferry.lab.procs import free_ports
from ferry.lab.scenarios import dr_federation, fill_queue
from ferry.topology import Topology
from tests.conftest import profile_topology
from tests.helpers import (
    FAILBACK_PANELS,
    FERRY,
    also_on_the_spark_lab,
    ferry,
    ferry_killed_when,
    panel_queries,
    prom_query,
    queue_depth,
    wait_for,
)
from tests.jobs.dr_failback.setting import (
    VHOSTS,
    assert_done,
    audit_pc1,
    counted_on_pc1,
    delete_shovel,
    depths,
    expected_in,
    leftovers,
    upstream_defs,
)

pytestmark = [pytest.mark.lab, pytest.mark.spark]


@pytest.mark.connect
@pytest.mark.parametrize(
    "engine",
    [
        "shovel",
        "spark",
        pytest.param("spark", id="spark-on-the-spark-lab", marks=[pytest.mark.cluster, pytest.mark.faults]),
    ],
)
def test_failback_moves_every_orphaned_message_and_restores_federation(
    dr: dict[str, Any], tmp_path: Path, engine: str, spark: Any
) -> None:
    topology, topo = dr["topology"], dr["topo"]
    before = asyncio.run(depths(topo, "ltm", ["plain-0"]))

    dry = ferry("failback", "--from", "ltm", "--to", "pc1", "--dry-run", "--json", topology=topology, check=True)
    plan = json.loads(dry.stdout)["plan"]
    assert (plan["engine"], plan["guarantee"]) == ("spark", GUARANTEES["spark"])  # the default, and what it promises
    mine = [x for x in plan["queues"] if x["vhost"] in VHOSTS]
    assert len(mine) == 10 and all(x["before"] == expected_in(dr, x["vhost"], x["queue"]) for x in mine)
    assert {(u["vhost"], u["name"]) for u in plan["upstreams"]} >= {(v, "art") for v in VHOSTS}
    assert dr["password"] not in dry.stdout + dry.stderr  # upstream URIs carry the password
    assert asyncio.run(depths(topo, "ltm", ["plain-0"])) == before  # the dry run changed nothing
    assert asyncio.run(upstream_defs(topo, "ltm")) == dr["upstreams"]

    result = ferry(
        "failback", "--from", "ltm", "--to", "pc1", "--engine", engine, "--max-active", "4", "--json",
        topology=topology,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["outcome"] == "complete" and report["possible_duplicates"] == report["duplicates"] == 0, report
    # verified from pc1's own counts: each target holds what it held plus what moved, no more
    checks = [c for c in report["verification"] if c["vhost"] in VHOSTS]
    assert len(checks) == 10 and all(c["verdict"] == "ok" and c["held"] == c["expected"] for c in checks), checks
    rows = [r for r in report["queues"] if r["vhost"] in VHOSTS]
    assert [r["moved"] for r in rows] == [expected_in(dr, r["vhost"], r["queue"]) for r in rows]
    assert all(r["possible_duplicates"] == r["arrived"] == 0 for r in rows), rows
    assert len(rows) == 10 and all(r["left"] == 0 for r in rows)
    assert all(u["identical"] for u in report["upstreams_restored"])
    assert report["upstream_pulled"] == 0
    assert all(u["before"] == u["after"] == 50 for u in report["upstream_queues"] if u["vhost"] in VHOSTS)
    assert dr["password"] not in result.stdout + result.stderr
    assert_done(dr)
    # progress starts as the move starts (a progress bar's clock starts there): the rate is the
    # messages moved over the seconds of the move
    events = [json.loads(x) for x in result.stderr.splitlines() if x.startswith('{"event": ')]
    names = [e["event"] for e in events]
    assert names.index("journal") < names.index("upstream-disabled"), names  # on record before anything changes
    progress = [e for e in events if e["event"] == "progress"]
    first, last = progress[0], progress[-1]
    assert first["moved"] == 0 and last["moved"] == last["total"] == report["total"]["moved"]
    expected = last["moved"] / (last["t"] - first["t"])
    assert abs(last["rate"] - expected) < 0.2 * expected, (last, first)

    tier = audit_pc1(spark, dr, tmp_path)  # every message once, counted by id (quorum queues too: issue 46)
    assert tier["lost"] == tier["extra_copies"] == 0 and tier["tier_messages"] >= 10 * dr["per_queue"]

    again = ferry("failback", "--from", "ltm", "--to", "pc1", "--json", topology=topology, check=True)
    assert json.loads(again.stdout)["outcome"] == "nothing to do"


async def _linger(topo: Topology, ltm: Any, vhost: str, upstream: dict[str, Any]) -> None:
    """What a DELETE of an upstream cut short leaves (issue 46, F1): the upstream gone from the
    broker's records, its links still running. The broker removes the record first, then stops
    the links inside the request; here the record is removed without the request."""
    async with Management(topo.rabbitmq("ltm"), name="ltm") as m:
        path = f"/parameters/federation-upstream/{q(vhost)}/art"
        await m.put(path, {"value": upstream["value"]})

        async def running() -> int:
            conns = {c["name"] for c in await m.get("/connections?columns=name")}
            rows = [x for x in await m.get("/federation-links") if (x["vhost"], x["upstream"]) == (vhost, "art")]
            return sum(x.get("status") == "running" and x.get("local_connection") in conns for x in rows)

        deadline = time.monotonic() + 30
        while await running() < len(VHOSTS[vhost]):
            assert time.monotonic() < deadline, "the links of the restored upstream never ran"
            await asyncio.sleep(0.2)
        key = f'{{<<"{vhost}">>, <<"federation-upstream">>, <<"art">>}}'
        lab_rabbit.tool(ltm, "rabbitmqctl", "eval", f"mnesia:dirty_delete(rabbit_runtime_parameters, {key}).")
        assert await m.get(path, ok404=True) is None
        await asyncio.sleep(1.0)
        assert await running() == len(VHOSTS[vhost]), "the links stopped with their record: no F1 to test"


@pytest.mark.parametrize("dr", [5_000], indirect=True)  # killed mid-transfer
@pytest.mark.faults  # `make test` kills the shovel engine's fail-back mid-transfer (serve adopts its shovels)
def test_failback_resumes_after_being_killed_twice(dr: dict[str, Any], rabbit_dr: lab.LabState, tmp_path: Path) -> None:
    """Killed with the upstreams disabled, then mid-transfer: a plain rerun finishes. Between the
    two, links left running by an upstream's DELETE cut short are restarted away (issue 46, F1:
    every rerun used to wait for them and fail)."""
    topology, topo = dr["topology"], dr["topo"]
    args = ("failback", "--from", "ltm", "--to", "pc1", "--engine", "spark")

    def upstreams_gone() -> bool:
        return not any(asyncio.run(upstream_defs(topo, "ltm")).values())

    def transfer_under_way() -> bool:
        left = sum(asyncio.run(depths(topo, "ltm", [])).values())
        return left < 7 * dr["per_queue"]

    ferry_killed_when(upstreams_gone, *args, topology=topology)
    journal = asyncio.run(leftovers(topo))["journal"]
    assert journal is not None and journal["value"]["phase"] in ("disabling", "transferring")
    assert not any(asyncio.run(upstream_defs(topo, "ltm")).values())  # still disabled, definitions in the journal
    asyncio.run(_linger(topo, rabbit_dr.proc("ltm"), "fb-a", dr["upstreams"]["fb-a"]))

    ferry_killed_when(transfer_under_way, *args, topology=topology)
    assert sum(asyncio.run(depths(topo, "ltm", [])).values()) > 0  # killed before the end

    elsewhere = tmp_path / "another-machine"
    elsewhere.mkdir()
    result = ferry(*args, "--json", topology=topology, cwd=elsewhere)
    report = json.loads(result.stdout)
    assert result.returncode == 0, result.stderr[-3000:]
    assert report["outcome"] == "complete" and report["total"]["left"] == 0
    # what the killed transfer delivered came back with ids pc1 holds: acked, not delivered again
    assert report["duplicates"] == report["unverified_duplicates"] == 0, report["verification"]
    assert report["possible_duplicates"] == sum(r["possible_duplicates"] for r in report["queues"])
    assert report["total"]["before"] == 10 * dr["per_queue"] + 1  # from the journal: the counts before the first run
    assert_done(dr)
    counted = counted_on_pc1(dr)  # by id, in the test itself
    assert counted == {"lost": 0, "duplicated": report["duplicates"], "extra": 0}, (counted, report["verification"])


@pytest.mark.faults  # make test-faults: make test's 25 minutes
@pytest.mark.parametrize("dr", [10_000], indirect=True)  # its shovels must outlive the kill by seconds
def test_shovel_failback_killed_mid_transfer_adopts_its_shovels(dr: dict[str, Any], tmp_path: Path) -> None:
    topology, topo = dr["topology"], dr["topo"]
    args = ("failback", "--from", "ltm", "--to", "pc1", "--engine", "shovel", "--max-active", "2")

    def transfer_under_way() -> bool:  # early, so the two shovels still have most of their queues
        return sum(asyncio.run(depths(topo, "ltm", [])).values()) < 10 * dr["per_queue"] - 500

    ferry_killed_when(transfer_under_way, *args, topology=topology)
    # the broker keeps shovelling without ferry; the rerun adopts the shovels still running. One
    # shovel ends while ferry is down (deleted here): the messages it held unacked come back to its
    # queue after they may have reached the target, so the rerun counts its queue as possible duplicates
    left = asyncio.run(leftovers(topo))
    assert left["journal"]["value"]["phase"] == "transferring"

    def still_to_move(shovel: dict[str, Any]) -> int:
        return asyncio.run(queue_depth(topo, "ltm", shovel["vhost"], shovel["value"]["src-queue"]))

    ended = max(left["shovels"], key=still_to_move)  # the first listed had sometimes drained its queue already
    queue = ended["value"]["src-queue"]
    asyncio.run(delete_shovel(topo, ended["vhost"], ended["name"], queue))
    requeued = asyncio.run(queue_depth(topo, "ltm", ended["vhost"], queue))
    assert requeued > 0
    _serve_shows_the_failback(topology, topo, tmp_path, 10 * dr["per_queue"])  # still on record, with queues left
    result = ferry(*args, "--json", topology=topology, cwd=tmp_path)
    report = json.loads(result.stdout)
    assert result.returncode == (3 if report["duplicates"] else 0), result.stderr[-3000:]
    assert report["outcome"].startswith("complete") and report["total"]["left"] == 0
    # at most what the deleted shovel held unacked (its prefetch) may have reached pc1 before
    (row,) = [r for r in report["queues"] if (r["vhost"], r["queue"]) == (ended["vhost"], queue)]
    assert 0 < row["possible_duplicates"] <= PREFETCH, row
    assert report["possible_duplicates"] == sum(r["possible_duplicates"] for r in report["queues"])
    assert_done(dr)
    counted = counted_on_pc1(dr)
    assert counted == {"lost": 0, "duplicated": report["duplicates"], "extra": 0}, (counted, report["verification"])


def _serve_shows_the_failback(topology: Path, topo: Any, tmp_path: Path, total: int) -> None:
    """`ferry serve` on the real brokers shows the fail-back on record: its phase, the messages left
    in each queue and its progress, and never the upstreams' passwords its record holds; a real
    Prometheus scraping it answers the dashboard's fail-back panels."""
    serve_port, prom_port = free_ports(2)
    env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
    argv = [*FERRY, "serve", "--port", str(serve_port), "--public-read"]
    serve = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    prom = lab_prometheus.proc(
        tmp_path / "prometheus", prom_port, {"ferry-serve": [f"127.0.0.1:{serve_port}"]}, None, []
    )
    prom.start()
    url, base = f"http://127.0.0.1:{serve_port}", f"http://127.0.0.1:{prom_port}"
    try:

        def left_in(text: str) -> list[float]:
            rows = [x for x in text.splitlines() if x.startswith("ferry_failback_messages_left{")]
            return [float(x.rsplit(" ", 1)[1]) for x in rows]

        def shown() -> str | None:
            # serve's counts are the management API's, up to a statistics interval old (5 s here): a
            # CI run read the counts from before the transfer began right after the kill
            with contextlib.suppress(httpx.HTTPError):
                text = httpx.get(f"{url}/metrics", timeout=5).text
                if 'ferry_operations{kind="dr_failback",state="transferring"} 1.0' in text:
                    left = left_in(text)
                    return text if left and sum(left) < total else None
            return None

        text = wait_for(shown, 60, "serve's /metrics to show the fail-back under way")
        left = left_in(text)
        assert len(left) == 10 and 0 < sum(left) < total, left
        assert 'ferry_operation_progress_ratio{id="ltm->pc1",kind="dr_failback"}' in text
        console = httpx.get(f"{url}/api/console", timeout=10)
        (op,) = [o for o in console.json()["operations"] if o["kind"] == "dr_failback"]
        assert op["state"] == "transferring" and "message(s) left" in op["detail"], op
        for cluster in ("ltm", "pc1"):
            password = topo.rabbitmq(cluster).credentials.password()
            assert password not in text and password not in console.text
        for title, expr in panel_queries().items():
            if title.split(" [")[0] in FAILBACK_PANELS:
                wait_for(lambda expr=expr: prom_query(base, expr), 30, f"series for panel {title}: {expr}")
    finally:
        serve.terminate()
        serve.communicate(timeout=30)
        prom.stop()


@pytest.mark.connect
def test_failback_refusals_change_nothing(dr: dict[str, Any], tmp_path: Path) -> None:
    topology, topo = dr["topology"], dr["topo"]
    before = asyncio.run(depths(topo, "ltm", ["plain-0"]))
    upstream = asyncio.run(depths(topo, "art", []))
    text = topology.read_text()
    bad_password = tmp_path / "wrong"
    bad_password.write_text("not-the-password")
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(text.replace("password_file: ", f"password_file: {bad_password} #"))
    dead = tmp_path / "dead.yaml"
    dead.write_text(text.replace(topo.rabbitmq("ltm").brokers[0].management_url, "http://127.0.0.1:1"))
    cases = [
        (wrong, ["--from", "ltm", "--to", "pc1"], "refused the credentials"),
        (dead, ["--from", "ltm", "--to", "pc1"], "not answering"),
        (topology, ["--from", "ltm", "--to", "nowhere"], "nowhere"),
        (topology, ["--from", "ltm", "--to", "ltm"], "--target-queue"),
        (topology, ["--from", "ltm", "--to", "pc1", "--vhost", "no-such-vhost"], "no-such-vhost"),
    ]
    for path, args, text in cases:
        result = ferry("failback", *args, topology=path)
        assert result.returncode != 0, args
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and text in lines[0], (args, result.stderr)
    # a snapshot of federated queues pulls nothing from their upstream (art's counts, below)
    snap = ferry("snapshot", "rabbitmq://ltm/fb-a/fed-*", "--out", str(tmp_path / "snap"), topology=topology)
    assert snap.returncode == 0, snap.stderr
    assert asyncio.run(depths(topo, "art", [])) == upstream
    assert asyncio.run(depths(topo, "ltm", ["plain-0"])) == before
    assert asyncio.run(upstream_defs(topo, "ltm")) == dr["upstreams"]
    assert asyncio.run(leftovers(topo)) == {"shovels": [], "journal": None}


@pytest.mark.faults  # with the shovel cuts of test_faults.py; `make test` kills a shovel fail-back mid-transfer
def test_a_shovel_that_moves_nothing_stops_the_failback_and_a_rerun_finishes(
    dr: dict[str, Any], rabbit_dr: lab.LabState
) -> None:
    """A shovel that moves nothing stops the failback after --stall-timeout with one line, the
    upstreams still disabled: first pc1 refuses the shovels' publishes (its user may not write to
    a vhost), then a rerun adopts them while a memory alarm blocks every publisher on pc1 (they
    run, and move nothing). Once pc1 takes messages again, the same command finishes it."""
    topo, topology = dr["topo"], dr["topology"]
    user = topo.rabbitmq("pc1").credentials.user  # type: ignore[union-attr]
    vhost = next(iter(VHOSTS))
    pc1 = rabbit_dr.proc("pc1")

    async def write(allowed: str) -> None:
        async with Management(topo.rabbitmq("pc1"), name="pc1") as m:
            perms = {"configure": ".*", "write": allowed, "read": ".*"}
            await m.request("PUT", f"/permissions/{q(vhost)}/{q(user)}", json=perms)

    def stalls(states: str) -> None:
        stalled = ferry(*args, "--stall-timeout", "10", topology=topology, timeout=120)
        assert stalled.returncode != 0, stalled.stderr
        last = stalled.stderr.strip().splitlines()[-1]  # one line, the shovel's Erlang reason too
        assert re.search(rf"moved no message for 10s \(({states})", last), last
        assert "rerun to continue, or --abort" in last and dr["password"] not in stalled.stderr, last
        assert not any(asyncio.run(upstream_defs(topo, "ltm")).values())  # still disabled: nothing pulls

    async def running() -> bool:
        async with Management(topo.rabbitmq("ltm"), name="ltm") as m:
            shovels = [s for s in await m.get("/shovels") if s["vhost"] in VHOSTS]
        return bool(shovels) and all(s["state"] == "running" for s in shovels)

    args = ["failback", "--from", "ltm", "--to", "pc1", "--engine", "shovel"]
    asyncio.run(write("^$"))
    try:
        stalls("terminated|starting|running")  # refused, it restarts over and over
        lab_rabbit.tool(pc1, "rabbitmqctl", "set_vm_memory_high_watermark", "0")
        try:
            asyncio.run(write(".*"))
            wait_for(lambda: asyncio.run(running()), 60, "the shovels to run again")  # blocked, moving nothing
            stalls("running")
        finally:
            lab_rabbit.tool(pc1, "rabbitmqctl", "set_vm_memory_high_watermark", str(lab_rabbit.MEMORY_WATERMARK))
    finally:
        asyncio.run(write(".*"))
    finished = ferry(*args, "--json", topology=topology)
    report = json.loads(finished.stdout)
    assert finished.returncode == (3 if report["duplicates"] else 0), finished.stderr  # shovels restarted
    assert_done(dr)
    counted = counted_on_pc1(dr)
    assert counted == {"lost": 0, "duplicated": report["duplicates"], "extra": 0}, (counted, report["verification"])


def test_failback_refuses_a_source_without_the_shovel_plugin(dr: dict[str, Any], rabbit_dr: lab.LabState) -> None:
    ltm = rabbit_dr.proc("ltm")
    lab_rabbit.tool(ltm, "rabbitmq-plugins", "disable", "--online", "rabbitmq_shovel_management")
    try:
        result = ferry("failback", "--from", "ltm", "--to", "pc1", "--engine", "shovel", topology=dr["topology"])
        assert result.returncode != 0
        assert result.stderr.strip() == "error: ltm: the shovel plugin is not enabled (rabbitmq_shovel_management)"
        assert asyncio.run(upstream_defs(dr["topo"], "ltm")) == dr["upstreams"]
        assert asyncio.run(leftovers(dr["topo"]))["journal"] is None
    finally:
        lab_rabbit.tool(ltm, "rabbitmq-plugins", "enable", "--online", "rabbitmq_shovel_management")
    assert lab_rabbit.health([lab_rabbit.RabbitNode(**n) for n in rabbit_dr.rabbit if n["name"] == "ltm"],
                             dr["password"])["ltm"] == "ok"  # fmt: skip


def test_one_failback_at_a_time_and_abort_restores(dr: dict[str, Any]) -> None:
    topology, topo = dr["topology"], dr["topo"]
    before = asyncio.run(depths(topo, "ltm", ["plain-0"]))

    async def while_locked() -> Any:  # another ferry holds the lock queue
        conn = await amqp_connect(topo.rabbitmq("ltm"), vhost="/")
        try:
            ch = await conn.channel()
            await ch.declare_queue("ferry-failback-lock", exclusive=True, auto_delete=True)
            return await asyncio.to_thread(ferry, "failback", "--from", "ltm", "--to", "pc1", topology=topology)
        finally:
            await conn.close()

    locked = asyncio.run(while_locked())
    assert locked.returncode != 0 and "another ferry failback is running" in locked.stderr
    assert asyncio.run(upstream_defs(topo, "ltm")) == dr["upstreams"]

    def upstreams_gone() -> bool:
        return not any(asyncio.run(upstream_defs(topo, "ltm")).values())

    base = ("failback", "--from", "ltm", "--to", "pc1")
    code, said = ferry_killed_when(upstreams_gone, *base, "--engine", "spark", topology=topology, sig=signal.SIGINT)
    assert code == 130 and "is on record, unfinished" in said and "Run the same command again" in said, said  # Ctrl-C
    # all gone at the broker, but the last delete's answer may not have reached ferry before the signal
    assert re.search(r"ltm's federation upstreams (stay off|may be partly off)\. ", said), said
    view = json.loads(ferry(*base, "--dry-run", "--json", topology=topology, check=True).stdout)
    assert view["resuming"]["phase"] in ("disabling", "transferring") and dr["password"] not in json.dumps(view)
    would = ferry(*base, "--abort", "--dry-run", topology=topology, check=True).stdout
    assert "--abort would remove ferry's shovels and restore the upstream(s)" in would, would
    status = json.loads(ferry(*base, "--status", "--json", topology=topology, check=True).stdout)
    assert status["resuming"]["id"] == view["resuming"]["id"] and set(status["left"]) == set(view["left"])
    assert not any(asyncio.run(upstream_defs(topo, "ltm")).values())  # the dry run restored nothing
    moved_to = ferry("failback", "--from", "ltm", "--to", "ltm", "--target-queue", "x", topology=topology)
    assert moved_to.returncode != 0 and "rerun it with --to pc1" in moved_to.stderr  # the journal's target wins

    aborted = ferry("failback", "--from", "ltm", "--to", "pc1", "--abort", "--json", topology=topology, check=True)
    report = json.loads(aborted.stdout)
    assert report["outcome"] == "aborted" and all(u["identical"] for u in report["upstreams_restored"])
    assert asyncio.run(upstream_defs(topo, "ltm")) == dr["upstreams"]
    assert asyncio.run(leftovers(topo)) == {"shovels": [], "journal": None}
    nothing = ferry(*base, "--status", topology=topology)
    assert nothing.returncode == 1 and "no failback from ltm is on record" in nothing.stderr
    assert asyncio.run(depths(topo, "ltm", ["plain-0"])) == before  # killed before the transfer began
    for dry in ((), ("--dry-run",)):
        nothing = ferry(*base, "--abort", *dry, "--json", topology=topology, check=True)
        assert json.loads(nothing.stdout)["outcome"] == "nothing to abort"


@pytest.mark.connect
def test_the_lab_failback_setting_gives_a_failback_to_run(rabbit_dr: lab.LabState) -> None:
    """`ferry lab failback-setting`, as the README gives it to a new user: the dry run lists its
    queues, and the fail-back brings every message home."""
    topology, topo = rabbit_dr.path / "topology.yaml", profile_topology(rabbit_dr)
    try:
        ferry("lab", "failback-setting", "--queues", "2", "--messages", "30", topology=topology, check=True)
        args = ("failback", "--from", "ltm", "--to", "pc1", "--vhost", "/", "--json")
        plan = json.loads(ferry(*args, "--dry-run", topology=topology, check=True).stdout)["plan"]
        assert sorted((x["queue"], x["before"]) for x in plan["queues"]) == [("fed-0", 30), ("fed-1", 30)]
        report = json.loads(ferry(*args, topology=topology, check=True).stdout)
        assert report["total"]["moved"] == 60 and report["upstream_pulled"] == 0
    finally:

        async def drop() -> None:
            for name in ("art", "pc1", "ltm"):
                async with Management(topo.rabbitmq(name), name=name) as m:
                    for queue in ("fed-0", "fed-1", "plain-0"):
                        await m.delete(f"/queues/%2F/{queue}")
                    if name != "art":
                        await m.delete("/policies/%2F/federate-with-art")
                        await m.delete("/parameters/federation-upstream/%2F/art")

        asyncio.run(drop())


@also_on_the_spark_lab
@pytest.mark.connect
def test_a_federated_queue_snapshot_keeps_queue_order_and_what_the_queue_held(
    rabbit_dr: lab.LabState, tmp_path: Path
) -> None:
    """A classic queue of more than one channel's 50,000 messages on pc1, federated from art: a
    snapshot (without --federated, no longer needed) gives exactly the messages the queue held
    when it began, in the queue's order, and pulls none from art. Its
    consumers used to take turns (two snapshots of one idle classic queue agreed on 8,146 of
    51,700 places) and had room for twice the queue, so messages federation pulled from art took
    the place of ones the queue held (the audit after a failback counted 400 as lost)."""
    topo, topology = profile_topology(rabbit_dr), rabbit_dr.path / "topology.yaml"
    n = 52_000
    try:
        asyncio.run(dr_federation(topo, ["snap"], ["snap-0"], prefix="snap", upstream_messages=50))
        asyncio.run(fill_queue(topo, "pc1", "snap", "snap-0", n))
        args = ("snapshot", "rabbitmq://pc1/snap/snap-0", "--out", str(tmp_path / "s"))
        r = ferry(*args, topology=topology)
        assert r.returncode == 0, r.stderr[-2000:]
        rows = pq.read_table(tmp_path / "s", columns=["source_seq", "payload"]).sort_by("source_seq")
        assert rows.column("payload").to_pylist() == [f"snap-0:{i}".encode() for i in range(n)]
        # and nothing was pulled from art (a consumer of priority 0 pulled all of a queue's upstream)
        depth = {c: asyncio.run(queue_depth(topo, c, "snap", "snap-0")) for c in ("art", "pc1")}
        assert depth == {"art": 50, "pc1": n}, depth
    finally:  # the lab's other tests expect no federation link of it

        async def drop() -> None:
            for name in ("art", "pc1", "ltm"):
                async with Management(topo.rabbitmq(name), name=name) as m:
                    await m.delete("/vhosts/snap")

        asyncio.run(drop())


@pytest.mark.connect
def test_the_check_after_a_transfer_counts_from_the_broker_and_names_duplicated_ids(rabbit_dr: lab.LabState) -> None:
    """The verification step on pc1's real queues: a target holding more than it held before plus
    what moved has its duplicated ids named (by message id, or by the spark engine's mark where
    messages have none); one holding fewer, or read by a consumer, is said so; nothing is consumed."""
    topo, vhost = profile_topology(rabbit_dr), "fb-verify"
    cluster = topo.rabbitmq("pc1")
    ids = [f"m-{i}" for i in range(100)] + ["m-3", "m-7", "m-7"]

    def with_id(i: int) -> aio_pika.Message:
        return aio_pika.Message(b"x", message_id=ids[i], delivery_mode=2)

    async def run() -> None:
        async with Management(cluster, name="pc1") as m:
            await m.put(f"/vhosts/{q(vhost)}", {})
            perms = {"configure": ".*", "write": ".*", "read": ".*"}
            await m.put(f"/permissions/{q(vhost)}/{q(cluster.credentials.user)}", perms)  # type: ignore[union-attr]
            for name, kind in (("twice", "quorum"), ("marked", "classic"), ("fewer", "classic"), ("read", "classic")):
                await m.put(f"/queues/{q(vhost)}/{name}", {"durable": True, "arguments": {"x-queue-type": kind}})
            for i in range(15):  # 12 marked for 10 moved, 3 from before; no message_id (aio-pika sets one)
                props = {"headers": {TRANSFER_HDR: "t-1" if i < 12 else "t-0"}}
                body = {"routing_key": "marked", "payload": str(i), "payload_encoding": "string", "properties": props}
                await m.request("POST", f"/exchanges/{q(vhost)}/amq.default/publish", json=body)
        await fill_queue(topo, "pc1", vhost, "twice", len(ids), with_id)
        await fill_queue(topo, "pc1", vhost, "fewer", 5)
        await fill_queue(topo, "pc1", vhost, "read", 3)
        rows = [
            {"vhost": vhost, "queue": "twice", "target": "twice", "target_before": 0, "moved": 100},
            {"vhost": vhost, "queue": "marked", "target": "marked", "target_before": 3, "moved": 10},
            {"vhost": vhost, "queue": "fewer", "target": "fewer", "target_before": 0, "moved": 8},
            {"vhost": vhost, "queue": "read", "target": "read", "target_before": 0, "moved": 3},
        ]
        conn = await amqp_connect(cluster, vhost=vhost)
        try:
            ch = await conn.channel()
            await (await ch.get_queue("read", ensure=False)).consume(_hold)  # holds them unacked
            checks = {c["queue"]: c for c in await verify(cluster, "pc1", "t-1", rows)}
        finally:
            await conn.close()
        twice = checks["twice"]
        assert (twice["extra"], twice["duplicates"], twice["duplicate_ids"]) == (3, 3, ["m-3", "m-7"]), twice
        assert twice["sampled"] == 103 and "3 held twice by message id (103 read)" in twice["verdict"]
        mark = checks["marked"]
        assert (mark["extra"], mark["marked"], mark["duplicates"]) == (2, 12, 2), mark
        assert checks["fewer"]["duplicates"] is None and checks["fewer"]["verdict"].startswith("3 fewer than expected")
        assert checks["read"]["extra"] is None and checks["read"]["verdict"].startswith("not checked: 1 consumer")
        after = {name: await queue_depth(topo, "pc1", vhost, name) for name in checks}
        assert after == {"twice": 103, "marked": 15, "fewer": 5, "read": 3}, after  # consumed none

    try:
        asyncio.run(run())
    finally:

        async def drop() -> None:
            async with Management(cluster, name="pc1") as m:
                await m.delete(f"/vhosts/{q(vhost)}")

        asyncio.run(drop())


async def _hold(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    """A consumer that never acks."""
