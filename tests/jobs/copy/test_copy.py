"""`ferry copy` on real brokers and real Spark: exact counts, order, properties, kill and resume."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import nats.js.errors
import pytest

from ferry import lab
from ferry.brokers import nats as bnats
from ferry.brokers.nats.reader import ReadConfig, plan_ranges, read_rows
from ferry.brokers.nats.writer import WriteConfig, write_rows
from ferry.errors import FerryError
from ferry.lab.scenarios import fill_queue
from ferry.topology import Topology
from tests.conftest import profile_topology
from tests.helpers import (
    FERRY,
    ferry,
    ferry_killed_when,
    fill_stream,
    killed_at_event,
    make_queues,
    make_stream,
    queue_depth,
    queue_messages,
    read_stream,
    restart_node,
    served,
    stream_count,
    stream_leader,
    wait_for,
)

pytestmark = [pytest.mark.lab, pytest.mark.spark]

N = 20_000


def _payload(i: int) -> bytes:
    return f"payload-{i}-".encode() * 4 + bytes([i % 256])


# besides its name, subjects and placement: what a restore with --create must give the new stream
CSRC_CONFIG = {"description": "the copy tests' source", "max_msgs_per_subject": 5_000, "max_age": 7 * 86_400.0}


@pytest.fixture(scope="module")
def source_stream(supercluster: lab.LabState) -> str:
    topo = profile_topology(supercluster)
    asyncio.run(make_stream(topo, "east", "CSRC", ["csrc.>"], placement="east", **CSRC_CONFIG))
    asyncio.run(
        fill_stream(
            topo,
            "east",
            N,
            subject=lambda i: f"csrc.s{i % 20}",
            payload=_payload,
            headers=lambda i: {"k": str(i), "kind": "test"},
        )
    )
    return "CSRC"


def _check_copy(supercluster: lab.LabState, dest: str, prefix: str, ordered: bool) -> None:
    topo = profile_topology(supercluster)
    src = asyncio.run(read_stream(topo, "east", "CSRC"))
    dst = asyncio.run(read_stream(topo, "west", dest))
    seqs = [int(r["headers"]["Ferry-Source-Seq"]) for r in map(_hdict, dst)]
    assert len(dst) == len(src) == N
    assert len(set(seqs)) == N, "a source message was stored twice"
    by_seq = {r["source_seq"]: r for r in src}
    for row in map(_hdict, dst):
        orig = by_seq[int(row["headers"]["Ferry-Source-Seq"])]
        assert row["payload"] == orig["payload"]
        assert row["subject"] == prefix + orig["subject"]
        assert row["headers"]["k"] == dict(orig["headers"])["k"]
        assert row["headers"]["Ferry-Source"] == "east/CSRC"
    per_subject: dict[str, list[int]] = {}
    for s in seqs:
        per_subject.setdefault(by_seq[s]["subject"], []).append(s)
    if ordered:
        assert seqs == sorted(seqs), "ordered copy changed the sequence order"
        assert all(v == sorted(v) for v in per_subject.values())


async def stream_config(topo: Topology, cluster: str, stream: str) -> dict[str, Any]:
    """The stream's configuration (durations in seconds) and the cluster it is in; {} for none."""
    async with bnats.session(topo.nats(cluster)) as nc:
        try:
            info = await nc.jsm().stream_info(stream)
        except nats.js.errors.NotFoundError:
            return {}
    config = info.config
    return {**{k: getattr(config, k) for k in config.__dataclass_fields__}, "cluster": info.cluster.name}


def _hdict(row: dict) -> dict:
    return {**row, "headers": dict(row["headers"] or [])}


def test_pulls_cut_short_by_their_timeout_lose_no_message(supercluster: lab.LabState, source_stream: str) -> None:
    """The reader's pull requests, each given 2 ms for up to 5,000 messages (more than this client parses in
    2 ms): most are cut short (part of their batch or none), and the rest arrives while the reader is busy
    with what it got. Every message must still come, in order. (A CI audit once missed 2,888 messages the
    stream held: the rest of a request was dropped. With batches of 1,000 a fast moment once cut none short.)"""
    from nats.js.api import AckPolicy, ConsumerConfig

    from ferry.brokers.nats.reader import _ack_fields, _Puller
    from ferry.brokers.nats.wire import wire

    cluster = profile_topology(supercluster).nats("east")

    async def read() -> tuple[list[int], int]:
        async with bnats.session(cluster) as nc, wire(cluster) as w:
            info = await nc.jsm().add_consumer(source_stream, ConsumerConfig(ack_policy=AckPolicy.NONE))
            puller, seqs, cut = _Puller(w, source_stream, info.name), [], 0
            await puller.start()
            deadline = asyncio.get_running_loop().time() + 120
            while len(seqs) < N and asyncio.get_running_loop().time() < deadline:
                try:
                    msgs = await puller.pull(min(5000, N - len(seqs)), timeout=0.002)
                except TimeoutError:  # cut short before anything came (a loaded machine): all of it comes late
                    cut += 1
                    continue
                cut += 0 < len(msgs) < min(5000, N - len(seqs))
                seqs += [_ack_fields(m.reply)[0] for m in msgs]
                await asyncio.sleep(0.003)  # the reader's own work: the rest of a request arrives meanwhile
            await puller.stop()
            await nc.jsm().delete_consumer(source_stream, info.name)
            return seqs, cut

    seqs, cut = asyncio.run(read())
    assert cut > 0, "no pull was cut short: the test did not test anything"
    gap = next((a for a, b in itertools.pairwise(seqs) if b != a + 1), None)
    assert seqs == list(range(1, N + 1)), f"{len(seqs)} messages, the first gap after seq {gap}"


def test_a_connection_dropped_mid_batch_loses_no_message(
    supercluster: lab.LabState, source_stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader's connection drops with most of a pull's batch still in flight (as when `ferry
    node evacuate` kicks it): it reconnects, and the consumer, which acks nothing, goes on after
    the lost messages. Every message must still come, in order. (A CI audit once missed 299.)"""
    from ferry.brokers.nats import reader as nats_reader

    real, drops, dead = nats_reader._Puller._on_msg, [0], [None]

    def on_msg(self: nats_reader._Puller, msg: object) -> None:
        if self.nc._writer is dead[0]:
            return  # read before the connection went: lost with it
        if not drops[0] and len(self.got) == 100:  # the connection goes with the rest of the batch
            drops[0] += 1
            dead[0] = self.nc._writer
            self.nc._writer.transport.abort()
            return
        real(self, msg)

    async def start(self: nats_reader._Puller) -> None:
        self.sub = await self.nc.subscribe(self.inbox, cb=lambda m: on_msg(self, m))

    monkeypatch.setattr(nats_reader._Puller, "start", start)
    cluster = profile_topology(supercluster).nats("east").model_dump_json()
    cfg = nats_reader.ReadConfig(cluster=cluster, name="east", streams=(source_stream,))

    async def read() -> list[int]:
        return [
            seq
            async for got in nats_reader.pulled(cfg, nats_reader.Range(source_stream, 1, N, fetch=2000))
            for _, seq, _ in got
        ]

    seqs = asyncio.run(read())
    assert drops[0] == 1, "no connection was dropped: the test did not test anything"
    gap = next((a for a, b in itertools.pairwise(seqs) if b != a + 1), None)
    assert seqs == list(range(1, N + 1)), f"{len(seqs)} messages, the first gap after seq {gap}"


def _relay_configs(
    topo: Topology, source: str, dest: str, prefix: str, subject: str | None = None
) -> tuple[ReadConfig, WriteConfig]:
    """A relay's read (east `source`) and write configs, into a new R1 stream `dest` in west (its
    server named as the leader, as `ferry replicate` names it)."""
    asyncio.run(make_stream(topo, "west", dest, [f"{prefix}csrc.>"], replicas=1, placement="west"))
    cfg = ReadConfig(cluster=topo.nats("east").model_dump_json(), name="east", streams=(source,), subject=subject)
    to = WriteConfig(
        cluster=topo.nats("west").model_dump_json(),
        name="west",
        origin_site="east",
        origin_headers=False,
        subject_prefix=prefix,
        leader=asyncio.run(stream_leader(topo, "west", dest)),
    )
    return cfg, to


def test_a_relay_task_goes_on_with_the_consumer_its_last_range_left(
    supercluster: lab.LabState, source_stream: str
) -> None:
    """A relay's read task keeps its connections and consumer for its next micro-batch: the next
    range goes on with the same consumer, a range elsewhere gets a fresh one (the old one deleted).
    Either way each message reaches the destination once, in order."""
    from ferry.brokers import kept
    from ferry.brokers.nats import reader as nats_reader
    from ferry.brokers.nats.relay import relay_range

    topo = profile_topology(supercluster)
    cfg, to = _relay_configs(topo, source_stream, "CRELAY", "relay.")

    def relay(lo: int, hi: int) -> tuple[int, int, str | None]:
        counts = relay_range(cfg, to, nats_reader.Range(source_stream, lo, hi, fetch=1000))
        return counts.stored, counts.duplicates, _link(cfg, to, source_stream).reader.consumer

    async def consumer_leader(name: str) -> str:
        async with bnats.session(topo.nats("east")) as nc:
            return bnats.leader_of(await nc.jsm().consumer_info(source_stream, name))

    first = relay(1, 5_000)
    assert first[:2] == (5_000, 0) and first[2]
    # messages come straight from the server that leads the consumer, not through another one, and
    # go straight to the one that leads the destination stream
    assert _link(cfg, to, source_stream).reader.w.server_name == asyncio.run(consumer_leader(first[2]))
    assert to.leader and _link(cfg, to, source_stream).dest.server_name == to.leader
    assert relay(5_001, 12_500) == (7_500, 0, first[2]), "the next range did not go on with the consumer"
    again = relay(2_001, 3_000)
    assert again[:2] == (0, 1_000), "a range relayed again was stored again"
    assert again[2] not in (None, first[2])
    assert relay(12_501, N)[:2] == (N - 12_500, 0)

    async def gone() -> bool:
        async with bnats.session(topo.nats("east")) as nc:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await nc.jsm().consumer_info(source_stream, first[2])
                return False
            return True

    assert asyncio.run(gone()), "a consumer left behind when a range started elsewhere"
    kept.run(kept._drop(("relay", cfg, to, source_stream)))
    seqs = [int(dict(r["headers"])["Ferry-Origin-Seq"]) for r in asyncio.run(read_stream(topo, "west", "CRELAY"))]
    assert seqs == list(range(1, N + 1))


def _link(cfg: ReadConfig, to: WriteConfig, stream: str):
    from ferry.brokers import kept

    return kept._entries[("relay", cfg, to, stream)][1]


def test_a_filtered_relay_goes_on_with_its_consumer_and_keeps_what_it_read_past_a_range(
    supercluster: lab.LabState, source_stream: str
) -> None:
    """With a subject filter, a range ends at the first match past it: that message (and the
    rest of its pull) waits for the next range, which goes on with the same consumer."""
    from ferry.brokers import kept
    from ferry.brokers.nats import reader as nats_reader
    from ferry.brokers.nats.relay import relay_range

    topo = profile_topology(supercluster)
    cfg, to = _relay_configs(topo, source_stream, "CRELAYF", "relayf.", subject="csrc.s3")
    key = ("relay", cfg, to, source_stream)
    consumers = []
    for lo, hi in [(1, 4_990), (4_991, 4_999), (5_000, 15_000), (15_001, N)]:
        counts = relay_range(cfg, to, nats_reader.Range(source_stream, lo, hi, fetch=500))
        assert counts.duplicates == 0
        consumers.append(_link(cfg, to, source_stream).reader.consumer)
    kept.run(kept._drop(key))
    assert consumers[0] and len(set(consumers)) == 1, "a filtered range did not go on with the consumer"
    rows = asyncio.run(read_stream(topo, "west", "CRELAYF"))
    assert {r["subject"] for r in rows} == {"relayf.csrc.s3"}
    seqs = [int(dict(r["headers"])["Ferry-Origin-Seq"]) for r in rows]
    assert seqs == [
        r["source_seq"] for r in asyncio.run(read_stream(topo, "east", source_stream)) if r["subject"] == "csrc.s3"
    ]


def test_ranges_read_as_the_stream_grows_get_every_message_up_to_their_end(
    supercluster: lab.LabState, tmp_path: Path
) -> None:
    """A relay reads up to the last sequence the stream's leader reported a moment ago. The consumer's
    server may not have that message yet (a follower stores after the leader), or not have counted
    it as pending (the server counts after storing): its "no messages" must not end the range early.
    Under 12,000 msg/s, ranges read right after the stream info, on one kept consumer: every one
    holds every sequence up to its end. (Before the fix, 101 and 104 of 7,000-8,600 ranges here ended
    early: a relay would have skipped their last messages.)"""
    from ferry.brokers.nats.reader import Range, Reader

    topo = profile_topology(supercluster)
    asyncio.run(make_stream(topo, "east", "CTAIL", ["ctail.>"], placement="east"))
    env = {**os.environ, "FERRY_TOPOLOGY": str(supercluster.path / "topology.yaml")}
    args = ["load", "nats://east", "--subject", "ctail.{n}", "--rate", "12000", "--duration", "25"]
    args += ["--no-msg-id", "--ledger", str(tmp_path / "ledger")]
    load = subprocess.Popen([*FERRY, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    cfg = ReadConfig(cluster=topo.nats("east").model_dump_json(), name="east", streams=("CTAIL",))

    async def read() -> tuple[int, list[str]]:
        reads, short = 0, []
        reader = await Reader.open(cfg, "CTAIL")
        try:
            async with bnats.session(topo.nats("east")) as nc:
                lo = 1
                while load.poll() is None:
                    hi = (await nc.jsm().stream_info("CTAIL")).state.last_seq
                    if hi < lo:
                        await asyncio.sleep(0.01)
                        continue
                    seqs = [
                        seq
                        async for got in reader.lists(Range("CTAIL", lo, hi, fetch=1000), keep=True)
                        for _, seq, _ in got
                    ]
                    if seqs != list(range(lo, hi + 1)):
                        short.append(f"{lo}-{hi}: {len(seqs)} messages, the last {seqs[-1] if seqs else None}")
                    reads, lo = reads + 1, hi + 1
        finally:
            await reader.close()
        return reads, short

    try:
        reads, short = asyncio.run(read())
    finally:
        _, stderr = load.communicate(timeout=120)
    assert load.returncode == 0, stderr[-2000:]
    assert reads > 500, f"only {reads} ranges read: the test did not test much"
    assert not short, f"{len(short)} of {reads} ranges ended early: {short[:3]}"


@pytest.mark.connect
def test_a_sequence_range_copies_exactly_it_and_the_plan_counts_it(
    supercluster: lab.LabState, source_stream: str
) -> None:
    topo, topology = profile_topology(supercluster), supercluster.path / "topology.yaml"
    asyncio.run(make_stream(topo, "west", "CRANGE", ["range.csrc.>"], placement="west"))
    args = ["copy", f"jetstream://east/{source_stream}?start_seq=101&end_seq=350", "jetstream://west/CRANGE"]
    args += ["--subject-prefix", "range."]
    plan = json.loads(ferry(*args, "--dry-run", "--json", topology=topology, check=True).stdout)["plan"]
    assert plan["messages"] == 250 and 0 < plan["bytes"] < 250 * 100, plan
    report = json.loads(ferry(*args, "--json", topology=topology, check=True).stdout)
    assert report["stored"] == 250
    rows = asyncio.run(read_stream(topo, "west", "CRANGE"))
    assert [int(dict(r["headers"])["Ferry-Source-Seq"]) for r in rows] == list(range(101, 351))
    again = json.loads(ferry(*args, "--dry-run", "--json", topology=topology, check=True).stdout)["plan"]
    assert again["messages"] == 0 and "resuming after source sequence 350 (the destination's last)" in again["notes"]


# every event a stream copy emits with --json ("progress": once a second at most)
COPY_EVENTS = [("plan", 1), ("spark", 1), ("progress", 1), ("progress", 3)]


# cells of the fault matrix (make test-faults); `make test` kills a queue copy (across vhosts) instead
@pytest.mark.parametrize(("event", "nth"), COPY_EVENTS)
@pytest.mark.parametrize("mode", ["ordered", "parallel", "ordered-batched"])
@pytest.mark.faults
def test_a_stream_copy_killed_at_every_event_then_run_again(
    supercluster: lab.LabState, source_stream: str, mode: str, event: str, nth: int
) -> None:
    """ferry's process group SIGKILLed at each event of a copy, then the same command: every message
    once, in order where the mode keeps it; a third run stores nothing. ordered-batched: into a
    stream that allows fast batch publishing, which the copy then uses."""
    topo = profile_topology(supercluster)
    dest = f"CDST_{mode.upper().replace('-', '_')}"
    prefix = f"{mode}."
    batched = mode.endswith("batched")
    asyncio.run(make_stream(topo, "west", dest, [f"{prefix}csrc.>"], placement="west", allow_batched=batched))
    topology = supercluster.path / "topology.yaml"
    extra = ["--partitions", "2"] if mode == "parallel" else []
    args = ["copy", "jetstream://east/CSRC", f"jetstream://west/{dest}", "--subject-prefix", prefix, *extra]
    killed_at_event(event, nth, *args, "--rate", "4000", topology=topology)
    partial = stream_count(topo, "west", dest)
    assert partial < N
    op_id = f"jetstream://east/CSRC -> jetstream://west/{dest}"
    if event == "progress":  # on record by then: interrupted, its ferry gone
        (killed,) = [o for o in served(topo, "west") if o["kind"] == "copy" and o["id"] == op_id]
        assert killed["state"] == "interrupted" and not killed["driven"], killed
        assert killed["detail"].endswith(f"of {N:,} message(s)")
    report = json.loads(ferry(*args, "--json", topology=topology, check=True).stdout)
    (done,) = [o for o in served(topo, "west") if o["kind"] == "copy" and o["id"] == op_id]
    assert done["state"] == "done" and done["progress"] == 1.0, done
    assert done["detail"] == f"{report['read']:,} of {report['plan']['messages']:,} message(s)", done
    assert report["plan"]["batched"] == batched
    assert 0 < report["stored"] <= N - partial, (report, partial)
    _check_copy(supercluster, dest, prefix, ordered=mode.startswith("ordered"))
    again = json.loads(ferry(*args, "--json", topology=topology, check=True).stdout)
    assert again["stored"] == 0 and stream_count(topo, "west", dest) == N
    print(f"fault cell: {json.dumps({'killed_at': f'{event} {nth}', 'partial': partial, 'rerun': report['stored']})}")


def test_a_copy_stopped_with_ctrl_c_is_on_record_as_stopped(supercluster: lab.LabState, source_stream: str) -> None:
    topo = profile_topology(supercluster)
    asyncio.run(make_stream(topo, "west", "CDST_STOPPED", ["stopped.csrc.>"], placement="west"))
    topology = supercluster.path / "topology.yaml"
    args = ["copy", "jetstream://east/CSRC", "jetstream://west/CDST_STOPPED", "--subject-prefix", "stopped."]
    args += ["--rate", "2000"]
    op_id = "jetstream://east/CSRC -> jetstream://west/CDST_STOPPED"

    def on_record() -> dict[str, Any]:
        (op,) = [o for o in served(topo, "west") if o["kind"] == "copy" and o["id"] == op_id] or [{}]
        return op

    def running_with_progress() -> bool:  # its count saved (every 2 s) while it runs
        op = on_record()
        return op.get("state") == "running" and not op["detail"].startswith("0 of")

    ferry_killed_when(running_with_progress, *args, topology=topology, sig=signal.SIGINT)
    stopped = on_record()
    assert stopped["state"] == "stopped" and not stopped["driven"], stopped  # what the user asked for: no alert
    copied = int(stopped["detail"].split(" of ")[0].replace(",", ""))
    assert 0 < copied <= stream_count(topo, "west", "CDST_STOPPED") < N, stopped


@pytest.mark.faults  # make test-faults: make test's 25 minutes
@pytest.mark.parametrize("batched", [False, True])
def test_stream_copy_rides_out_the_kill_of_a_destination_server(
    supercluster: lab.LabState, source_stream: str, batched: bool
) -> None:
    """The west server that the writers are connected to (the stream's leader) is SIGKILLed
    mid-copy: the writers' connections move to another server, publishes left without an ack are
    re-sent under their ids (in a new batch, when batched), and the copy ends with every message
    exactly once."""
    topo = profile_topology(supercluster)
    dest, prefix = f"CDST_KILL{int(batched)}", f"kill{int(batched)}."
    asyncio.run(make_stream(topo, "west", dest, [f"{prefix}csrc.>"], placement="west", allow_batched=batched))
    leader = asyncio.run(stream_leader(topo, "west", dest))
    args = ["copy", "jetstream://east/CSRC", f"jetstream://west/{dest}", "--subject-prefix", prefix]
    args += ["--partitions", "2", "--rate", "4000", "--json"]
    env = {**os.environ, "FERRY_TOPOLOGY": str(supercluster.path / "topology.yaml")}
    proc = subprocess.Popen([*FERRY, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = None
    try:
        wait_for(lambda: proc.poll() is not None or stream_count(topo, "west", dest) >= N // 3, 120, "a third copied")
        assert proc.poll() is None, "the copy ended before the kill"
        writing_to = wait_for(lambda: _writing_to(topo), 10, "a writer's connection in west")
        assert writing_to == {leader}, "the writers publish through a server that does not lead the stream"
        victim = supercluster.proc(leader)
        victim.signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-2000:]
        assert json.loads(out)["plan"]["batched"] == batched
        assert json.loads(out)["retries"] > 0  # it did have something to ride out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if victim and not victim.alive():
            victim.start()
            supercluster.save()
            wait_for(lambda: supercluster.health().get(victim.name) == "ok", 60, f"{victim.name} to answer again")
    _check_copy(supercluster, dest, prefix, ordered=False)


def _writing_to(topo: Topology) -> set[str]:
    """The west servers with one of the data plane's connections."""
    found = set()
    for b in topo.nats("west").brokers:
        conns = httpx.get(f"{b.monitor_url}/connz", params={"limit": 100000}, timeout=5).json()["connections"] or []
        if any(c.get("name") == "ferry-data" for c in conns):
            found.add(b.name)
    return found


@pytest.fixture(scope="module")
def csrc_backup(supercluster: lab.LabState, source_stream: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CSRC backed up into Parquet by `ferry copy`; the summary and the plan count payload bytes
    (the plan estimates them from the stream's size)."""
    folder = tmp_path_factory.mktemp("backup") / "csrc"
    folder.mkdir()  # an empty directory will do
    copy = ("copy", "jetstream://east/CSRC", f"parquet://{folder}", "--json")
    backup = json.loads(ferry(*copy, topology=supercluster.path / "topology.yaml", check=True).stdout)
    payload = sum(len(_payload(i)) for i in range(N))
    assert backup["read"] == backup["stored"] == N and backup["bytes"] == payload
    assert abs(backup["plan"]["bytes"] - payload) < payload * 0.05, backup["plan"]
    return folder


@pytest.mark.connect
def test_parquet_round_trip_is_byte_identical(
    supercluster: lab.LabState, csrc_backup: Path, tmp_path: Path, spark
) -> None:
    """Restored with --create into a new stream, which gets the source stream's configuration
    from the backup's record (only its subjects mapped)."""
    import pyarrow.parquet as pq

    from ferry.schema import BACKUP_RECORD

    topo = profile_topology(supercluster)
    topology = supercluster.path / "topology.yaml"
    payload = sum(len(_payload(i)) for i in range(N))
    # the backup again as two files, the later sequences in the larger one (Spark reads the larger first)
    rows = spark.read.parquet(str(csrc_backup))
    for part in (rows.source_seq <= N // 4, rows.source_seq > N // 4):
        rows.filter(part).coalesce(1).write.mode("append").parquet(str(tmp_path / "a2"))
    assert len(list((tmp_path / "a2").glob("*.parquet"))) == 2
    args = ("copy", f"parquet://{tmp_path}/a2", "jetstream://west/CRESTORED", "--subject-prefix", "restored.")
    args += ("--create",)
    refused = ferry(*args, topology=topology)  # files without the backup's record: no configuration to create from
    assert refused.returncode != 0 and "records no stream configuration" in refused.stderr.strip().splitlines()[-1]
    assert not asyncio.run(stream_config(topo, "west", "CRESTORED"))
    (tmp_path / "a2" / BACKUP_RECORD).write_bytes((csrc_backup / BACKUP_RECORD).read_bytes())
    plan = json.loads(ferry(*args, "--dry-run", "--json", topology=topology, check=True).stdout)["plan"]
    assert (plan["messages"], plan["bytes"]) == (N, payload)  # a Parquet source's rows and payload bytes
    assert "would create stream CRESTORED in west" in plan["notes"], plan["notes"]
    restore = json.loads(ferry(*args, "--json", topology=topology, check=True).stdout)
    assert (restore["stored"], restore["bytes"]) == (N, payload)
    source, restored = (asyncio.run(stream_config(topo, c, n)) for c, n in (("east", "CSRC"), ("west", "CRESTORED")))
    assert restored["cluster"] == "west" and restored["subjects"] == ["restored.csrc.>"], restored
    assert {k: restored[k] for k in CSRC_CONFIG} == CSRC_CONFIG
    kept = ("retention", "storage", "num_replicas", "discard", "duplicate_window", "max_msgs", "max_bytes")
    assert {k: restored[k] for k in kept} == {k: source[k] for k in kept}
    plan = json.loads(ferry(*args, "--dry-run", "--json", topology=topology, check=True).stdout)["plan"]
    assert plan["resume_from"] == N + 1  # a rerun resumes after the last restored message
    again = json.loads(ferry(*args, "--json", topology=topology, check=True).stdout)
    assert again["stored"] == again["duplicates"] == 0 and stream_count(topo, "west", "CRESTORED") == N
    ferry("copy", "jetstream://west/CRESTORED", f"parquet://{tmp_path}/b", topology=topology, check=True)
    a = pq.read_table(csrc_backup).sort_by("source_seq").to_pylist()
    b = pq.read_table(tmp_path / "b").sort_by("source_seq").to_pylist()
    assert len(a) == len(b) == N
    # restored in the source's order, whatever the order in which Spark reads the backup's files
    assert [int(dict(r["headers"])["Ferry-Source-Seq"]) for r in b] == [r["source_seq"] for r in a]

    def core(r: dict) -> tuple:
        # the copy adds Nats-Msg-Id and Ferry-Source*: everything else must be identical
        added = {"Nats-Msg-Id", "Ferry-Source", "Ferry-Source-Seq"}
        headers = tuple(sorted((k, v) for k, v in r["headers"] if k not in added))
        return r["subject"].removeprefix("restored."), r["payload"], headers

    assert [core(r) for r in a] == [core(r) for r in b]


@pytest.mark.connect
def test_a_backup_restored_into_a_queue_and_back_into_a_stream_keeps_its_order(
    supercluster: lab.LabState, rabbit_dr: lab.LabState, lab_dir: Path, csrc_backup: Path
) -> None:
    """Parquet -> RabbitMQ -> JetStream, mode ordered (the default): the messages come back in the
    stream's order. (Spark reads a backup's files largest first, and wrote a queue from several
    tasks at once: a round trip came back with half its messages out of order.)"""
    import pyarrow.parquet as pq

    topology = lab_dir / "topology.yaml"  # both labs' clusters
    sc, dr = profile_topology(supercluster), profile_topology(rabbit_dr)
    expected = [dict(h)["k"] for h in pq.read_table(csrc_backup).sort_by("source_seq").column("headers").to_pylist()]
    into_queue = ("copy", f"parquet://{csrc_backup}", "rabbitmq://pc1/%2F/restored-order", "--create", "--json")
    assert json.loads(ferry(*into_queue, topology=topology, check=True).stdout)["stored"] == N
    queued = asyncio.run(queue_messages(dr, "pc1", "/", "restored-order"))
    assert [dict(r["headers"])["k"] for r in queued] == expected
    asyncio.run(make_stream(sc, "east", "BACKFROMQ", ["back.>"], placement="east"))
    back = ("copy", "rabbitmq://pc1/%2F/restored-order", "jetstream://east/BACKFROMQ", "--subject-prefix", "back.")
    assert json.loads(ferry(*back, "--json", topology=topology, check=True).stdout)["stored"] == N
    assert [dict(r["headers"])["k"] for r in asyncio.run(read_stream(sc, "east", "BACKFROMQ"))] == expected


@pytest.mark.faults  # make test-faults (make test's 25 minutes); a copy's Ctrl-C stays in make test
def test_an_interrupted_backup_leaves_nothing_and_runs_again(
    supercluster: lab.LabState, source_stream: str, tmp_path: Path
) -> None:
    """Ctrl-C (SIGINT to the whole process group) while Spark writes the Parquet files: one line,
    exit 130, the directory as it was (absent), and the same command then succeeds."""
    topology = supercluster.path / "topology.yaml"
    args = ("copy", "jetstream://east/CSRC", f"parquet://{tmp_path}/backup")
    code, stderr = ferry_killed_when(
        lambda: (tmp_path / ".backup.ferry-partial").exists(),
        *args,
        "--rate",
        "4000",
        topology=topology,
        sig=signal.SIGINT,
    )
    assert code == 130 and stderr.strip().splitlines()[-1] == "interrupted" and "Traceback" not in stderr, stderr
    assert not (tmp_path / "backup").exists() and not (tmp_path / ".backup.ferry-partial").exists()
    assert json.loads(ferry(*args, "--json", topology=topology, check=True).stdout)["stored"] == N


@pytest.mark.connect
def test_a_backup_to_parquet_reports_progress(
    supercluster: lab.LabState, source_stream: str, tmp_path: Path, spark
) -> None:
    """The progress of a stream -> Parquet copy comes from the source's readers, and ends at the count."""
    from ferry.jobs.copy.plan import CopyOptions, plan_copy
    from ferry.jobs.copy.run import run_copy

    topo = profile_topology(supercluster)
    plan = plan_copy(topo, "jetstream://east/CSRC", f"parquet://{tmp_path}/p", CopyOptions(partitions=4))
    seen: list[int] = []
    report = run_copy(topo, plan, spark, progress=seen.append)
    assert report.read == N and seen[-1] == N
    assert seen == sorted(seen) and all(0 <= n <= N for n in seen)


@pytest.mark.connect
def test_progress_into_parquet_counts_what_the_source_readers_delivered(
    supercluster: lab.LabState, source_stream: str, tmp_path: Path
) -> None:
    """A stream -> Parquet copy's live progress: the messages the readers' consumers delivered
    (a reader of its own here, keeping its consumer while the watcher looks)."""
    import threading

    from nats.js.api import AckPolicy, ConsumerConfig

    from ferry.jobs.copy.plan import CopyOptions, plan_copy
    from ferry.jobs.copy.run import _watch

    topo = profile_topology(supercluster)
    plan = plan_copy(topo, "jetstream://east/CSRC", f"parquet://{tmp_path}/p", CopyOptions())
    seen = [-1]
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(topo, plan, seen.append, stop), daemon=True)
    watcher.start()

    async def read(n: int) -> None:
        async with bnats.session(topo.nats("east"), name="east") as nc:
            sub = await nc.jetstream().pull_subscribe(
                "csrc.>", stream="CSRC", config=ConsumerConfig(ack_policy=AckPolicy.NONE)
            )
            got, tries = 0, 0
            while got < n:
                try:
                    got += len(await sub.fetch(n - got, timeout=5))
                except nats.js.errors.ServiceUnavailableError:  # the new consumer's server not listening yet
                    tries += 1
                    assert tries < 50, "the consumer never answered a pull"
                    await asyncio.sleep(0.1)
            for _ in range(50):  # at most 10 s
                if seen[-1] == n:
                    break
                await asyncio.sleep(0.2)

    try:
        wait_for(lambda: seen[-1] == 0, 10, "the watcher to take stock of the consumers already there")
        asyncio.run(read(1000))
        assert seen[-1] == 1000
    finally:
        stop.set()
        watcher.join(timeout=5)


QUEUES = [f"q{i}" for i in range(5)]
PER_QUEUE = 3000


def _amqp(vhost: str, queue: str, i: int) -> aio_pika.Message:
    return aio_pika.Message(
        f"{vhost}|{queue}|{i}".encode(),
        message_id=f"{vhost}|{queue}|{i}",
        content_type="application/json",
        priority=i % 5,
        correlation_id=f"c{i}",
        app_id="test",
        type="t",
        headers={"n": i, "f": 0.5, "bin": bytearray(b"\x00\xff"), "nested": {"a": [1, "x"]}, "flag": True},
    )


def test_queue_copy_across_vhosts_survives_kill(rabbit_dr: lab.LabState) -> None:
    topo = profile_topology(rabbit_dr)
    topology = rabbit_dr.path / "topology.yaml"
    for vhost in ("/", "cv"):
        for cluster in ("ltm", "pc1"):
            asyncio.run(make_queues(topo, cluster, vhost, QUEUES, quorum={"q1", "q3"}))
        for queue in QUEUES:
            asyncio.run(fill_queue(topo, "ltm", vhost, queue, PER_QUEUE, lambda i, v=vhost, q=queue: _amqp(v, q, i)))
    total = 2 * len(QUEUES) * PER_QUEUE

    def moved() -> int:
        return sum(asyncio.run(queue_depth(topo, "pc1", v, qn)) for v in ("/", "cv") for qn in QUEUES)

    args = ["copy", "rabbitmq://ltm/*/q*", "rabbitmq://pc1/*/*", "--drain"]  # only this test's queues
    ferry_killed_when(lambda: moved() >= total // 3, *args, "--rate", "3000", topology=topology)
    first = moved()
    assert total // 3 <= first < total
    report = json.loads(ferry(*args, "--json", topology=topology, check=True).stdout)
    assert all(q["left"] == 0 for q in report["queues"])

    ids: Counter[str] = Counter()
    for vhost in ("/", "cv"):
        for queue in QUEUES:
            assert asyncio.run(queue_depth(topo, "ltm", vhost, queue)) == 0
            for row in asyncio.run(queue_messages(topo, "pc1", vhost, queue)):
                ids[row["msg_id"]] += 1
                props = row["properties"]
                i = int(row["msg_id"].rsplit("|", 1)[1])
                assert props["content_type"] == "application/json" and props["priority"] == i % 5
                assert props["correlation_id"] == f"c{i}" and props["app_id"] == "test" and props["type"] == "t"
                typed = json.loads(props["headers"])["$m"]
                assert (
                    typed["n"] == i and typed["f"] == 0.5 and typed["bin"] == {"$b": "AP8="} and typed["flag"] is True
                )
                assert typed["nested"] == {"$m": {"a": [1, "x"]}}
                assert "x-ferry-transfer" in typed
    expected = {f"{v}|{qn}|{i}" for v in ("/", "cv") for qn in QUEUES for i in range(PER_QUEUE)}
    assert set(ids) == expected, "a message was lost"
    duplicates = sum(c - 1 for c in ids.values())
    assert duplicates <= report["possible_duplicates"], "a duplicate was not counted in the summary"


@pytest.mark.faults
@pytest.mark.parametrize("node", ["ltm", "pc1"], ids=["source", "destination"])
def test_a_queue_copy_whose_node_is_killed_and_restarted_copies_each_message(
    rabbit_dr: lab.LabState, node: str
) -> None:
    """The source's (ltm) or the destination's (pc1) RabbitMQ node SIGKILLed once a third of 4
    durable queues' persistent messages are copied, and started again 3 s later: the copy goes on
    or fails saying why, and the same command run again copies the rest; every message is at pc1,
    none twice beyond the copies the runs reported as possible duplicates."""
    topo, topology = profile_topology(rabbit_dr), rabbit_dr.path / "topology.yaml"
    queues = [f"nk{node}{i}" for i in range(4)]
    for cluster in ("ltm", "pc1"):
        asyncio.run(make_queues(topo, cluster, "/", queues, quorum=set(queues[:2])))
    for queue in queues:
        message = lambda i, qn=queue: aio_pika.Message(f"{qn}|{i}".encode(), message_id=f"{qn}|{i}", delivery_mode=2)  # noqa: E731
        asyncio.run(fill_queue(topo, "ltm", "/", queue, PER_QUEUE, message))
    total = len(queues) * PER_QUEUE

    def moved() -> int:
        return sum(asyncio.run(queue_depth(topo, "pc1", "/", qn)) for qn in queues)

    args = ["copy", f"rabbitmq://ltm/%2F/nk{node}*", "rabbitmq://pc1/%2F", "--drain", "--rate", "3000", "--json"]
    env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
    proc = subprocess.Popen([*FERRY, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: proc.poll() is not None or moved() >= total // 3, 120, "a third copied")
        assert proc.poll() is None, "the copy ended before the kill"
        restart_node(rabbit_dr, node, 3.0)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    reports = [json.loads(out)] if proc.returncode == 0 else []
    print(f"fault cell: the first run ended {proc.returncode}: {err.strip().splitlines()[-1:]}")
    if proc.returncode:  # it says which node
        assert f"{node}" in err.strip().splitlines()[-1], err[-1000:]
        reports.append(json.loads(ferry(*args, topology=topology, check=True).stdout))
    assert all(q["left"] == 0 for q in reports[-1]["queues"]), reports[-1]
    ids = Counter(r["msg_id"] for qn in queues for r in asyncio.run(queue_messages(topo, "pc1", "/", qn)))
    assert set(ids) == {f"{qn}|{i}" for qn in queues for i in range(PER_QUEUE)}, "a message was lost"
    twice = sum(c - 1 for c in ids.values())
    assert twice <= sum(r["possible_duplicates"] for r in reports), (twice, reports)
    print(f"fault cell: {json.dumps({'copied': total, 'twice': twice, 'runs': len(reports)})}")


@pytest.mark.connect
@pytest.mark.parametrize(
    ("src", "dst", "message"),
    [
        ("kafka://x/y", "parquet:///tmp/x", "unknown scheme kafka://"),
        ("jetstream://east/NOPE", "parquet:///tmp/ferry-nope", "stream 'NOPE' not found"),
        ("jetstream://mars/CSRC", "parquet:///tmp/ferry-nope", "unknown cluster 'mars'"),
        ("jetstream://east/CSRC", "jetstream://west/NOPE", "stream 'NOPE' does not exist (pass --create"),
        ("jetstream://east/CSRC", "jetstream://west", "expected jetstream://CLUSTER/STREAM"),
        ("jetstream://east/CSRC?colour=red", "parquet:///tmp/ferry-nope", "unknown option 'colour'"),
    ],
)
def test_bad_input_is_one_line_and_moves_nothing(
    supercluster: lab.LabState, source_stream: str, src: str, dst: str, message: str
) -> None:
    result = ferry("copy", src, dst, topology=supercluster.path / "topology.yaml")
    assert result.returncode != 0
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not Path("/tmp/ferry-nope").exists()


@pytest.mark.connect
def test_create_with_subjects_taken_is_one_line_and_creates_nothing(
    supercluster: lab.LabState, source_stream: str
) -> None:
    topology = supercluster.path / "topology.yaml"
    result = ferry("copy", "jetstream://east/CSRC", "jetstream://east/CTAKEN", "--create", topology=topology)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "subjects overlap" in lines[0] and "--subject-prefix" in lines[0]

    async def exists() -> bool:
        async with bnats.session(profile_topology(supercluster).nats("east")) as nc:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await nc.jsm().stream_info("CTAKEN")
                return True
        return False

    assert not asyncio.run(exists())
    # a dry run with --create says what it would create, and creates nothing
    args = ("copy", "jetstream://east/CSRC", "jetstream://east/CTAKEN", "--subject-prefix", "t.", "--create")
    plan = json.loads(ferry(*args, "--dry-run", "--json", topology=topology, check=True).stdout)["plan"]
    assert "would create stream CTAKEN in east" in plan["notes"]
    assert not asyncio.run(exists())


@pytest.mark.connect
def test_a_copy_into_a_stream_of_other_subjects_says_to_map_them_and_stores_nothing(
    supercluster: lab.LabState, source_stream: str
) -> None:
    """CSRC's subjects are CSRC's own: written as they are to a stream that takes others, the
    server refuses every message (expected stream does not match), and the error names the way out."""
    topo = profile_topology(supercluster)
    asyncio.run(make_stream(topo, "west", "COTHER", ["cother.>"], placement="west"))
    result = ferry(
        "copy", "jetstream://east/CSRC", "jetstream://west/COTHER", topology=supercluster.path / "topology.yaml"
    )
    said = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and "is not one of COTHER's subjects: --subject-prefix maps them" in said, said

    async def counts() -> list[int]:
        async with bnats.session(topo.nats("east")) as nc:
            return [(await nc.jsm().stream_info(name)).state.messages for name in ("COTHER", "CSRC")]

    assert asyncio.run(counts()) == [0, N]


@pytest.mark.connect
def test_a_queue_copied_into_a_stream_keeps_its_messages_unless_drained_and_takes_the_prefix(
    supercluster: lab.LabState, rabbit_dr: lab.LabState, lab_dir: Path
) -> None:
    """Into a stream on ``rmq.>``, read and requeued by default, moved out with --drain: without
    --subject-prefix the routing key ``rq-js`` is no subject of the stream, refused at once (the
    queue keeps every message); with ``--subject-prefix rmq.`` every message arrives once, on
    ``rmq.rq-js``, and the queue still holds them all until a copy with --drain empties it."""
    topology = lab_dir / "topology.yaml"  # both labs' clusters
    sc, dr = profile_topology(supercluster), profile_topology(rabbit_dr)
    n = 3_000
    asyncio.run(make_stream(sc, "east", "FROMRMQ", ["rmq.>"], placement="east"))
    asyncio.run(make_queues(dr, "pc1", "/", ["rq-js"], quorum=set()))
    asyncio.run(fill_queue(dr, "pc1", "/", "rq-js", n, lambda i: aio_pika.Message(b"m", message_id=f"rq-{i}")))
    copy = ["copy", "rabbitmq://pc1/%2F/rq-js", "jetstream://east/FROMRMQ"]
    expected = Counter(f"rq-{i}" for i in range(n))

    def held() -> tuple[Counter[str], set[str], int]:
        rows = asyncio.run(read_stream(sc, "east", "FROMRMQ")) if stream_count(sc, "east", "FROMRMQ") else []
        left = asyncio.run(queue_depth(dr, "pc1", "/", "rq-js"))
        return Counter(r["msg_id"] for r in rows), {r["subject"] for r in rows}, left

    for drain in ([], ["--drain"]):
        refused = ferry(*copy, *drain, topology=topology, timeout=120)
        said = refused.stderr.strip().splitlines()[-1]
        assert refused.returncode == 1, refused.stderr[-2000:]
        assert "'rq-js'" in said and "is not one of FROMRMQ's subjects" in said and "--subject-prefix" in said, said
        assert held() == (Counter(), set(), n), drain

    kept = json.loads(ferry(*copy, "--subject-prefix", "rmq.", "--json", topology=topology, check=True).stdout)
    assert held() == (expected, {"rmq.rq-js"}, n)
    assert kept["stored"] == n and [(x["before"], x["moved"], x["left"]) for x in kept["queues"]] == [(n, n, n)]

    drained = ferry(*copy, "--subject-prefix", "rmq.", "--drain", "--json", topology=topology, check=True)
    assert held() == (expected, {"rmq.rq-js"}, 0)  # the same ids again: the stream stored none twice
    assert json.loads(drained.stdout)["duplicates"] == n


def test_a_failed_write_has_closed_its_reader_when_it_raises(supercluster: lab.LabState, source_stream: str) -> None:
    """What a copy task runs: its rows' read-ahead task and connections are gone when the write
    raises, not left to asyncio.run's teardown, which cancels nats-py's own tasks with them (a
    reader left to it waited for ever to delete its consumer: a CI run's copy hung 300 s)."""
    topo = profile_topology(supercluster)
    asyncio.run(make_stream(topo, "west", "COTHER", ["cother.>"], placement="west"))
    read = ReadConfig(cluster=topo.nats("east").model_dump_json(), name="east", streams=(source_stream,))
    write = WriteConfig(cluster=topo.nats("west").model_dump_json(), name="west", stream="COTHER", ordered=True)
    part = plan_ranges(read)[0]

    async def left_running() -> list[str]:
        with pytest.raises(FerryError, match="expected stream does not match"):
            await write_rows(write, read_rows(read, part))
        return [t.get_coro().__qualname__ for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    loop = asyncio.new_event_loop()  # not asyncio.run: its teardown is what waited for ever
    try:
        assert loop.run_until_complete(left_running()) == []
    finally:
        loop.close()


@pytest.mark.connect
def test_unknown_queue_and_wrong_credentials(rabbit_dr: lab.LabState, tmp_path: Path) -> None:
    topology = rabbit_dr.path / "topology.yaml"
    result = ferry("copy", "rabbitmq://ltm/%2F/no-such-queue", "rabbitmq://pc1/%2F/q0", topology=topology)
    assert result.returncode != 0 and "queue 'no-such-queue' not found" in result.stderr
    secret = tmp_path / "wrong"
    secret.write_text("wrong-password")
    bad = tmp_path / "bad.yaml"
    bad.write_text(topology.read_text().replace(str(rabbit_dr.path / "secrets" / "rabbitmq"), str(secret)))
    before = asyncio.run(queue_depth(profile_topology(rabbit_dr), "pc1", "/", "q0"))
    result = ferry("copy", "rabbitmq://ltm/%2F/q0", "rabbitmq://pc1/%2F/q0", topology=bad)
    assert result.returncode != 0
    assert "refused the credentials" in result.stderr and "wrong-password" not in result.stderr
    assert len([ln for ln in result.stderr.splitlines() if ln.strip()]) == 1
    assert asyncio.run(queue_depth(profile_topology(rabbit_dr), "pc1", "/", "q0")) == before
