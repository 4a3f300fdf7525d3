"""`ferry partition` on the lab super-cluster: exact ownership, safe concurrent claims, a split under load."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from nats.js.errors import NoStreamResponseError

from ferry import lab
from ferry.brokers import nats as bnats
from ferry.brokers.nats import jsapi
from ferry.errors import Conflict
from ferry.jobs import partition as pt
from ferry.jobs.partition.claims import claim, open_claims
from ferry.jobs.partition.map import Partition
from ferry.jobs.partition.plan import list_streams
from tests.helpers import (
    FERRY,
    also_on_the_spark_lab,
    as_nats_user,
    ferry,
    finish,
    judge,
    killed_at_event,
    served,
    start_load,
)
from tests.jobs.partition.setting import Setting, forget

pytestmark = [pytest.mark.lab, pytest.mark.spark, pytest.mark.connect]


def write_map(path: Path, name: str, partitions: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"name": name, "partitions": partitions}))
    return path


async def per_subject(nc: Any, stream: str) -> dict[str, int]:
    info = await jsapi.stream_info(nc, stream, subjects_filter=">")
    return info["state"].get("subjects") or {}


FOUR = [
    {"name": "eu", "stream": "PT_EU", "cluster": "east", "replicas": 3, "patterns": ["pt.eu.>"]},
    {"name": "us", "stream": "PT_US", "cluster": "west", "replicas": 3, "patterns": ["pt.us.>"]},
    {"name": "orders", "stream": "PT_ORDERS", "cluster": "east", "patterns": ["pt.ap.*", "pt.sa.*.orders"]},
    {"name": "audit", "stream": "PT_AUDIT", "cluster": "west", "patterns": ["pt.audit"]},
]


def test_four_partitions_each_message_lands_in_its_owner(supercluster: lab.LabState, tmp_path: Path) -> None:
    topology = supercluster.path / "topology.yaml"
    bad = write_map(tmp_path / "bad.yaml", "pt4", [*FOUR[:2], {**FOUR[2], "patterns": ["pt.*.orders"]}, FOUR[3]])
    r = ferry("partition", "apply", str(bad), topology=topology)
    assert r.returncode == 2 and "overlaps partition 'orders' 'pt.*.orders'" in r.stderr, r.stderr
    r = ferry("partition", "check", str(bad), "--json", topology=topology)
    assert r.returncode == 1
    witnesses = {o["witness"] for o in json.loads(r.stdout)["overlaps"]}
    assert witnesses == {"pt.eu.orders", "pt.us.orders"}
    four = write_map(tmp_path / "four.yaml", "pt4", FOUR)
    ferry("partition", "check", str(four), topology=topology, check=True)
    ferry("partition", "apply", str(four), topology=topology, check=True)
    on_record = {r["map"]: r for r in json.loads(ferry("partition", "status", "--json", topology=topology).stdout)}
    assert on_record["pt4"]["partitions"]["eu"] == {"stream": "PT_EU", "patterns": ["pt.eu.>"]}
    assert not on_record["pt4"]["pending"]
    served_ops = served(supercluster_topology(supercluster), "west")  # what `ferry serve` reads of it
    (op,) = [o for o in served_ops if o["kind"] == "partition" and o["id"].endswith("/pt4")]
    assert op["state"] == "applied" and op["detail"] == "4 partition(s)", op
    pmap = pt.load_map(four)
    index = pmap.index()
    regions = ["eu", "us", "ap", "sa", "audit", "xx"]
    subjects = [f"pt.{regions[i % 6]}.{i}" if i % 6 != 3 else f"pt.sa.{i}.orders" for i in range(1000)]
    subjects = [s if not s.startswith("pt.audit.") else "pt.audit" for s in subjects]

    async def go() -> None:
        async with bnats.session(supercluster_topology(supercluster).nats("west")) as nc:
            js = nc.jetstream()
            expected: dict[str, dict[str, int]] = {p.stream: {} for p in pmap.partitions}
            unowned = 0
            for s in subjects:
                owner = index.route(s)
                if owner is None:
                    t0 = time.monotonic()
                    with pytest.raises(NoStreamResponseError):
                        await js.publish(s, b"x", timeout=5)
                    assert time.monotonic() - t0 < 1  # no stream: refused at once, not a time-out
                    unowned += 1
                    continue
                ack = await js.publish(s, b"x", timeout=5)
                part = owner[0]
                assert ack.stream == part.stream, (s, ack.stream, part.stream)
                expected[part.stream][s] = expected[part.stream].get(s, 0) + 1
            assert unowned > 100
            for stream, want in expected.items():
                assert await per_subject(nc, stream) == want, stream
            await forget(nc, ["pt4"], [p.stream for p in pmap.partitions])

    asyncio.run(go())
    r = ferry("partition", "route", "--map", str(four), "pt.eu.1", "pt.xx.1", "pt.*", topology=topology)
    assert r.returncode == 1
    assert "pt.eu.1 -> eu (stream PT_EU in east" in r.stdout
    assert "no partition owns 'pt.xx.1'" in r.stderr and "literal subject is required" in r.stderr


def supercluster_topology(state: lab.LabState):  # type: ignore[no-untyped-def]
    from ferry.topology import load_topology

    return load_topology(state.path / "topology.yaml")


def test_concurrent_conflicting_claims_exactly_one_wins(supercluster: lab.LabState, tmp_path: Path) -> None:
    topo = supercluster_topology(supercluster)
    rivals = [
        pt.PartitionMap(name=f"rival{i}", partitions=[Partition(name=f"r{i}", stream=f"RIVAL{i}", patterns=[pattern])])
        for i, pattern in enumerate(["cc.*.orders", "cc.eu.*", "cc.>", "cc.eu.orders", "cc.*.*"])
    ]

    async def race() -> list[Any]:
        async with bnats.session(topo.nats("east")) as nc:
            kv = await open_claims(nc)
            return await asyncio.gather(*(claim(kv, m, None) for m in rivals), return_exceptions=True)

    for _ in range(3):  # the same race, three times
        results = asyncio.run(race())
        winners = [r for r in results if isinstance(r, dict)]
        losers = [r for r in results if isinstance(r, Exception)]
        assert len(winners) == 1, results
        assert all(isinstance(e, Conflict) and "overlaps" in str(e) and "owned by partition" in str(e) for e in losers)

        async def cleanup() -> None:
            async with bnats.session(topo.nats("east")) as nc:
                await forget(nc, [m.name for m in rivals], [])

        asyncio.run(cleanup())

    # two `ferry partition apply` processes started together: one applies, the other is refused cleanly
    a = write_map(tmp_path / "a.yaml", "proc-a", [{"name": "a", "stream": "CC_A", "patterns": ["cc.*.orders"]}])
    b = write_map(tmp_path / "b.yaml", "proc-b", [{"name": "b", "stream": "CC_B", "patterns": ["cc.eu.>"]}])
    env = {"FERRY_TOPOLOGY": str(supercluster.path / "topology.yaml")}
    procs = [
        subprocess.Popen(
            [*FERRY, "partition", "apply", str(m)],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for m in (a, b)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 1], outs
    loser = outs[[p.returncode for p in procs].index(1)][1]
    assert "both would own 'cc.eu.orders'" in loser, loser

    async def check_streams() -> None:
        async with bnats.session(topo.nats("east")) as nc:
            streams = await list_streams(nc)
            won = "CC_A" if procs[0].returncode == 0 else "CC_B"
            lost = "CC_B" if won == "CC_A" else "CC_A"
            assert won in streams and lost not in streams  # the loser changed nothing
            await forget(nc, ["proc-a", "proc-b"], [won])

    asyncio.run(check_streams())


def test_split_a_partition_under_load_loses_nothing(supercluster: lab.LabState, tmp_path: Path, spark: Any) -> None:
    topology = supercluster.path / "topology.yaml"
    v1 = write_map(
        tmp_path / "v1.yaml",
        "split",
        [
            {
                "name": "orders",
                "stream": "SPLIT",
                "cluster": "east",
                "replicas": 3,
                "patterns": ["split.eu.>", "split.us.>"],
            }
        ],
    )
    v2 = write_map(
        tmp_path / "v2.yaml",
        "split",
        [
            {"name": "orders", "stream": "SPLIT", "cluster": "east", "replicas": 3, "patterns": ["split.eu.>"]},
            {"name": "orders-us", "stream": "SPLIT_US", "cluster": "east", "replicas": 3, "patterns": ["split.us.>"]},
        ],
    )
    ferry("partition", "apply", str(v1), topology=topology, check=True)
    led = tmp_path / "ledger"

    # 900 msg/s in all, until the repartition is over: the moving subjects get fire-and-forget
    # (core) and acked JetStream publishes
    def until(rate: int) -> tuple[str, ...]:  # stopped by the signal below
        return ("--rate", str(rate), "--until-signal")

    loads = [
        start_load(topology, "nats://west", "split.us.c{n}", led / "us" / "kind=core", 600, "--no-msg-id", *until(300)),
        start_load(topology, "jetstream://east", "split.us.j{n}", led / "us" / "kind=js", 600, *until(300)),
        start_load(topology, "jetstream://west", "split.eu.{n}", led / "eu" / "kind=js", 600, *until(300)),
    ]
    try:
        time.sleep(4)
        r = ferry("partition", "apply", str(v2), topology=topology)
        assert r.returncode == 2 and "--execute" in r.stderr  # a repartition is never implicit
        plan = json.loads(ferry("partition", "plan", str(v2), "--json", topology=topology, check=True).stdout)
        assert [(m["from"], m["to"], m["pattern"]) for m in plan["moves"]] == [("SPLIT", "SPLIT_US", "split.us.>")]
        assert plan["messages_to_move"] > 2000
        r = ferry("partition", "apply", str(v2), "--execute", "--json", topology=topology, timeout=240)
        time.sleep(2)
    finally:
        for p in loads:
            p.send_signal(signal.SIGTERM)
    for p in loads:
        finish(p)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert result["purged"] == result["copied"] > 2000
    assert result["guard"]["SPLIT_US"]["captured"] > 0  # the switch happened under load
    events = [json.loads(x) for x in r.stderr.splitlines() if x.startswith('{"event": ')]
    (copied,) = [e for e in events if e["event"] == "copied"]
    last = [e for e in events if e["event"] == "copying"][-1]  # the history's copy reports its progress
    # (its total is the plan's estimate: the stream's count in proportion to the copied range)
    assert last["messages"] == copied["messages"] > 2000 and last["total"] > 2000, json.dumps([last, copied])
    us = judge(spark, topology, led / "us", "jetstream://east/SPLIT_US", tmp_path / "us.html")
    eu = judge(spark, topology, led / "eu", "jetstream://east/SPLIT", tmp_path / "eu.html")
    for t in (us, eu):
        assert t["lost"] == 0 and t["duplicated"] == 0 and t["unexpected"] == 0, t

    async def after() -> None:
        async with bnats.session(supercluster_topology(supercluster).nats("east")) as nc:
            assert not [s for s in await per_subject(nc, "SPLIT") if s.startswith("split.us.")]
            streams = await list_streams(nc)
            assert streams["SPLIT"]["config"]["subjects"] == ["split.eu.>"]
            assert streams["SPLIT_US"]["config"]["subjects"] == ["split.us.>"]
            assert not streams["SPLIT_US"]["config"].get("subject_transform")
            record = await pt.read_claims(nc)
            assert record["maps"]["split"].get("pending") is None
            assert [p["stream"] for p in record["maps"]["split"]["map"]["partitions"]] == ["SPLIT", "SPLIT_US"]
            await forget(nc, ["split"], ["SPLIT", "SPLIT_US"])

    asyncio.run(after())


def test_a_repartition_whose_guard_may_not_listen_is_refused_before_anything_is_staged(
    supercluster: lab.LabState, tmp_path: Path
) -> None:
    """The lab user `limited` may not subscribe to `limited.>`: a repartition of such subjects
    would have copied their history into the new owner, and only then found that its capture
    guard may not listen. It is refused first, with the server's words, and changes nothing."""
    topology = supercluster.path / "topology.yaml"
    both = {"name": "lim", "stream": "PT_LIM", "cluster": "east", "patterns": ["limited.pt.a.>", "limited.pt.b.>"]}
    v1 = write_map(tmp_path / "v1.yaml", "lim", [both])
    v2 = write_map(
        tmp_path / "v2.yaml",
        "lim",
        [
            {**both, "patterns": ["limited.pt.a.>"]},
            {"name": "lim-b", "stream": "PT_LIM_B", "cluster": "east", "patterns": ["limited.pt.b.>"]},
        ],
    )
    ferry("partition", "apply", str(v1), topology=topology, check=True)

    async def publish() -> None:
        async with bnats.session(supercluster_topology(supercluster).nats("east")) as nc:
            js = nc.jetstream()
            for i in range(50):
                await js.publish(f"limited.pt.b.{i % 5}", b"x", timeout=5)

    asyncio.run(publish())
    limited = as_nats_user(supercluster, "limited", tmp_path)
    r = ferry("partition", "apply", str(v2), "--execute", topology=limited)
    assert r.returncode == 1, r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "may not listen" in r.stderr and "limited.pt.b.>" in r.stderr

    async def unchanged() -> None:
        async with bnats.session(supercluster_topology(supercluster).nats("east")) as nc:
            streams = await list_streams(nc)
            assert "PT_LIM_B" not in streams  # nothing staged
            assert streams["PT_LIM"]["config"]["subjects"] == ["limited.pt.a.>", "limited.pt.b.>"]
            assert sum((await per_subject(nc, "PT_LIM")).values()) == 50
            record = await pt.read_claims(nc)
            assert record["maps"]["lim"].get("pending") is None
            await forget(nc, ["lim"], ["PT_LIM", "PT_LIM_B"])

    asyncio.run(unchanged())


@also_on_the_spark_lab
def test_a_repartition_back_within_the_duplicate_window_is_undone_before_the_switch(
    supercluster: lab.LabState, tmp_path: Path
) -> None:
    """PT_MB owns ptm.>; ptm.eu.> is split off to PT_MA, and at once merged back. PT_MB's duplicate
    window still holds the msg ids of the eu messages it held a moment ago, so it drops every
    copy. The merge finds that out before it switches owners, purges the copies it staged (and
    nothing of PT_MB's own us messages), puts the claim back and says when to run the same command again. It
    used to switch, leaving the eu messages outside every stream's subjects."""
    topology = supercluster.path / "topology.yaml"
    a = {"name": "a", "stream": "PT_MA", "cluster": "east", "replicas": 1}
    b = {"name": "b", "stream": "PT_MB", "cluster": "west", "replicas": 1}
    merged = write_map(tmp_path / "merged.yaml", "pm", [{**b, "patterns": ["ptm.>"]}])
    split = write_map(tmp_path / "split.yaml", "pm", [{**a, "patterns": ["ptm.eu.>"]}, {**b, "patterns": ["ptm.us.>"]}])
    ferry("partition", "apply", str(merged), topology=topology, check=True)

    async def publish() -> None:
        async with bnats.session(supercluster_topology(supercluster).nats("east")) as nc:
            js = nc.jetstream()
            for i in range(500):
                region = "eu" if i % 2 else "us"
                await js.publish(f"ptm.{region}.{i % 5}", b"x", headers={"Nats-Msg-Id": f"pm-{i}"}, timeout=5)

    asyncio.run(publish())
    ferry("partition", "apply", str(split), "--execute", topology=topology, check=True)
    r = ferry("partition", "apply", str(merged), "--execute", topology=topology)
    assert r.returncode == 1, r.stderr[-3000:]
    said = r.stderr.strip().splitlines()[-1]  # after the progress lines
    assert said.startswith("error: PT_MB dropped 250 of the copies of ptm.> as duplicates"), said
    assert "Undone: PT_MA still owns ptm.eu.> and holds every message; run the same command again after" in said, said

    async def as_before() -> None:
        async with bnats.session(supercluster_topology(supercluster).nats("east")) as nc:
            streams = await list_streams(nc)
            assert streams["PT_MA"]["config"]["subjects"] == ["ptm.eu.>"]
            assert streams["PT_MB"]["config"]["subjects"] == ["ptm.us.>"]  # no staging subject left
            assert set(await per_subject(nc, "PT_MA")) == {f"ptm.eu.{i}" for i in range(5)}
            assert sum((await per_subject(nc, "PT_MA")).values()) == 250
            assert set(await per_subject(nc, "PT_MB")) == {f"ptm.us.{i}" for i in range(5)}  # its own, no copy
            assert sum((await per_subject(nc, "PT_MB")).values()) == 250
            entry = (await pt.read_claims(nc))["maps"]["pm"]
            assert entry.get("pending") is None and entry["map"] == pt.load_map(split).model_dump()
            await forget(nc, ["pm"], ["PT_MA", "PT_MB"])

    asyncio.run(as_before())


def test_a_map_whose_stream_cannot_be_made_withdraws_its_claim(supercluster: lab.LabState, tmp_path: Path) -> None:
    """A partition placed in a cluster the super-cluster does not have is refused before anything
    changes, naming the clusters it has. One whose stream the server will not make (five replicas
    in a cluster of three): the claim ferry recorded first is withdrawn, so no route names a stream
    that does not exist and another map may claim the subjects."""
    topology = supercluster.path / "topology.yaml"
    kept = {"name": "k", "stream": "PT_KEPT", "cluster": "east", "patterns": ["ptk.>"]}
    north = write_map(
        tmp_path / "north.yaml",
        "pn",
        [kept, {"name": "n", "stream": "PT_NORTH", "cluster": "north", "patterns": ["ptn.>"]}],
    )
    r = ferry("partition", "apply", str(north), topology=topology)
    said = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(said) == 1, r.stderr[-3000:]
    assert said[0] == (
        "error: partition 'n' is placed in cluster 'north', which the super-cluster does not have (known: east, west)"
    ), said
    five = write_map(
        tmp_path / "five.yaml",
        "pn",
        [kept, {"name": "n", "stream": "PT_NORTH", "cluster": "west", "replicas": 5, "patterns": ["ptn.>"]}],
    )

    async def streams() -> set[str]:
        async with bnats.session(supercluster_topology(supercluster).nats("east")) as nc:
            return {info.config.name for info in await nc.jsm().streams_info()}

    assert asyncio.run(streams()) & {"PT_KEPT", "PT_NORTH"} == set()  # the refusal made nothing
    r = ferry("partition", "apply", str(five), topology=topology)
    assert r.returncode == 1, r.stderr[-3000:]
    said = r.stderr.strip().splitlines()[-1]
    assert said.startswith("error: map 'pn' not applied, its claim withdrawn") and "PT_NORTH" in said, said
    assert said.endswith("; done before that, and kept: created PT_KEPT (a corrected map applied again takes it over)")
    r = ferry("partition", "route", "ptn.1", topology=topology)
    assert r.returncode == 1 and "ptn.1" in r.stderr, (r.stdout, r.stderr)
    east = write_map(
        tmp_path / "east.yaml", "pe", [{"name": "e", "stream": "PT_EASTN", "cluster": "east", "patterns": ["ptn.>"]}]
    )
    ferry("partition", "apply", str(east), topology=topology, check=True)
    said = ferry("partition", "route", "ptn.1", topology=topology, check=True).stdout
    assert "stream PT_EASTN" in said

    async def clean() -> None:
        async with bnats.session(supercluster_topology(supercluster).nats("east")) as nc:
            assert "pn" not in (await pt.read_claims(nc))["maps"]
            await forget(nc, ["pe"], ["PT_EASTN", "PT_NORTH", "PT_KEPT"])

    asyncio.run(clean())


def test_a_repartition_killed_at_its_switch_is_finished_by_the_same_command(
    supercluster: lab.LabState, tmp_path: Path
) -> None:
    """Issue 49: SIGKILLed right after the switch, a repartition left the old owner holding every
    moved message, and a rerun found nothing to do. Its journal now tells the same command where
    it stopped: the rerun forwards what the new owner lacks, purges the old owner once each moved
    message is counted in the new one, and ends the claim; every id once, in its owner."""
    s = Setting(supercluster, tmp_path, "pk")
    s.start_load()
    try:
        events = killed_at_event("switched", 1, "partition", "apply", str(s.v2), "--execute", topology=s.topology)
        assert [e["event"] for e in events][:2] == ["plan", "claimed"], events
        record = s.on_record()
        phase = record["journal"]["phase"]  # killed as it journaled the switch, or just before
        assert record["claim"]["pending"] and phase in ("switching", "switched"), record
        plan = json.loads(ferry("partition", "plan", str(s.v2), "--json", topology=s.topology, check=True).stdout)
        assert plan["unfinished"]["phase"] == phase and plan["moves"] == [], plan  # owners already switched
        r = ferry("partition", "apply", str(s.v2), topology=s.topology)
        assert r.returncode == 2 and f"did not finish (phase {phase}" in r.stderr and "--execute" in r.stderr
        r = s.apply("--json")
        assert r.returncode == 0, r.stderr[-3000:]
        result = json.loads(r.stdout)
        assert result["resumed"] and result["outcome"] == "applied" and result["purged"] == result["copied"] > 1000
        resumed = [json.loads(x) for x in r.stderr.splitlines() if x.startswith('{"event": "resume"')]
        assert resumed and resumed[0]["phase"] == phase, r.stderr[-2000:]
    finally:
        s.stop_load()
    counted = s.counted()
    assert counted["lost"] == counted["twice"] == counted["misplaced"] == 0, counted
    record = s.on_record()
    assert record["claim"].get("pending") is None and record["journal"]["phase"] == "done", record
    again = ferry("partition", "apply", str(s.v2), "--execute", "--json", topology=s.topology)
    assert again.returncode == 0 and "resumed" not in json.loads(again.stdout), again.stderr[-2000:]
    s.forget()
