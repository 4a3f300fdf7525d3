"""Durable consumers carried by the relay (issue 52): copies at the other site that follow their
consumers, made and deleted with them, through a relay killed mid-checkpoint, never copied back;
what is refused and said; a floor translated among messages of other origins. The consumers'
failover and fail-back with their site: test_replicate.py's site failover test (:mod:`.apps`)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy

from ferry.brokers import nats as bnats
from ferry.jobs.replicate import consumers
from ferry.lab.procs import free_ports
from ferry.topology import load_topology
from tests.helpers import Relay, ferry, make_stream, wait_for
from tests.jobs.replicate.test_replicate import define, topology

__all__ = ["topology"]  # the fixture, shared with test_replicate.py

pytestmark = [pytest.mark.lab, pytest.mark.spark, pytest.mark.timeout(300)]


def test_copies_follow_their_consumers_through_a_relay_killed_and_never_cycle(topology: Path, tmp_path: Path) -> None:
    """The copies at sfo follow nyc's consumers, pull and push: made paused, moved as the consumer
    acknowledges, deleted with it; the relay SIGKILLed while a checkpoint makes 120 copies (some
    made, not all) and started again finishes them and goes on from the copies it finds; the relay
    back (sfo -> nyc, both ways at once) never copies a copy. An application's own consumer of the
    same name at the other site is left alone and said refused; a consumer whose filter matches
    none of its stream's subjects any more is said so (in status and the relay's metrics)."""
    topo = load_topology(topology)
    stream = "CONS2"
    define(topology, stream)
    define(topology, stream, source="sfo", dest="nyc")

    async def at(site: str) -> dict[str, Any]:
        async with bnats.session(topo.nats(site)) as nc:
            return {c.name: c for c in await nc.jsm().consumers_info(stream) if c.config.durable_name}  # not a relay's

    async def setup() -> None:
        async with bnats.session(topo.nats("nyc")) as nc:
            js = nc.jetstream()
            for i in range(300):
                await js.publish(f"cons2.{i % 3}", b"x", headers={"Nats-Msg-Id": f"c2-{i}"})
            for name in ("keep", "gone", "theirs"):
                await nc.jsm().add_consumer(stream, ConsumerConfig(durable_name=name, ack_policy=AckPolicy.EXPLICIT))
            explicit = AckPolicy.EXPLICIT
            await nc.jsm().add_consumer(stream, ConsumerConfig(durable_name="pushed", ack_policy=explicit,
                                                               deliver_subject="deliver.pushed"))  # fmt: skip
            await nc.jsm().add_consumer(stream, ConsumerConfig(durable_name="stale", filter_subject="cons2.2"))
            info = await nc.jsm().stream_info(stream)  # cons2.2 is not the stream's any more
            info.config.subjects = ["cons2.0", "cons2.1"]
            await nc.jsm().update_stream(info.config)
        async with bnats.session(topo.nats("sfo")) as nc:  # sfo's application has a "theirs" of its own
            await nc.jsm().add_consumer(stream, ConsumerConfig(durable_name="theirs", ack_policy=AckPolicy.EXPLICIT))

    async def consume(n: int, name: str = "keep") -> int:
        """Acknowledge `n` more messages with `name` (pull, or push: "pushed") at nyc; its ack floor."""
        async with bnats.session(topo.nats("nyc")) as nc:
            js = nc.jetstream()
            if name == "pushed":
                sub = await js.subscribe_bind(stream, (await js.consumer_info(stream, name)).config, name,
                                              manual_ack=True)  # fmt: skip
                msgs = [await sub.next_msg(timeout=5) for _ in range(n)]
            else:
                msgs = await (await js.pull_subscribe_bind(name, stream)).fetch(n, timeout=5)
            for m in msgs:
                await m.ack_sync()
            return (await nc.jsm().consumer_info(stream, name)).ack_floor.stream_seq

    asyncio.run(setup())
    (port,) = free_ports(1)
    forth = Relay(topology, tmp_path, "nyc", "sfo", "--consumer-interval", "1", "--metrics-port", str(port))
    back = Relay(topology, tmp_path, "sfo", "nyc", "--consumer-interval", "1")
    try:
        forth.event("relaying")
        back.event("relaying")
        ours = {"keep", "gone", "pushed", "stale"}
        copies = wait_for(lambda: (c := asyncio.run(at("sfo"))) and ours <= set(c) and c, 60, "copies")
        copies = {name: c for name, c in copies.items() if name in ours}
        assert all(c.paused and c.config.metadata["ferry.origin"] == "nyc" for c in copies.values()), copies
        assert copies["pushed"].config.deliver_subject == "deliver.pushed", copies["pushed"]
        assert "ferry.origin" not in asyncio.run(at("sfo"))["theirs"].config.metadata, "sfo's own was changed"

        def moved_to(floor: int, name: str = "keep") -> bool:  # delivers from the message after the floor
            c = asyncio.run(at("sfo"))[name]
            return c.ack_floor.stream_seq == floor

        floor = asyncio.run(consume(50))
        wait_for(lambda: moved_to(floor), 30, "the copy to follow 50 acks")
        pushed = asyncio.run(consume(40, "pushed"))
        wait_for(lambda: moved_to(pushed, "pushed"), 30, "the push consumer's copy to follow 40 acks")
        rows = json.loads(ferry("replicate", "status", "--json", topology=topology, check=True).stdout)
        (row,) = [r for r in rows if (r["source"], r["dest"]) == ("nyc", "sfo")]
        said = {c["consumer"]: c for c in row["consumers"] if c["stream"] == stream}
        assert "of its own" in said["theirs"]["refused"] and "refused" not in said["keep"], said
        assert "cons2.2 matches none of CONS2's subjects" in said["stale"]["unmatched"], said
        assert "unmatched" not in said["keep"] and "unmatched" not in said["pushed"], said
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        carried = 'ferry_relay_consumer_carried{{account="",consumer="{}",from="nyc",stream="CONS2",to="sfo"}} {}'
        for name, value in (("keep", 1.0), ("pushed", 1.0), ("stale", 0.0), ("theirs", 0.0)):
            assert carried.format(name, value) in metrics, (name, metrics)
        bulk = [f"bulk-{i:03d}" for i in range(120)]

        async def kill_mid_checkpoint() -> int:
            """120 new consumers at nyc; the relay SIGKILLed while a checkpoint makes their copies
            (some made, not all): how many it had made."""
            async with bnats.session(topo.nats("sfo")) as nc:
                count = nc.jsm().stream_info
                base = (await count(stream)).state.consumer_count
                async with bnats.session(topo.nats("nyc")) as src:
                    for name in bulk:
                        config = ConsumerConfig(durable_name=name, ack_policy=AckPolicy.EXPLICIT)
                        await src.jsm().add_consumer(stream, config)
                deadline = time.monotonic() + 60
                while (await count(stream)).state.consumer_count - base < 2:  # (a reader may come and go)
                    assert time.monotonic() < deadline, "no checkpoint began to copy the new consumers"
                    await asyncio.sleep(0.002)
                forth.kill()
                return sum(1 for c in await nc.jsm().consumers_info(stream) if c.name in bulk)

        made = asyncio.run(kill_mid_checkpoint())
        assert 0 < made < len(bulk), made
        forth.close()
        floor = asyncio.run(consume(70))
        forth = Relay(topology, tmp_path, "nyc", "sfo", "--consumer-interval", "1")
        forth.event("relaying")
        wait_for(lambda: moved_to(floor), 30, "the new relay to move the copy on")

        def all_copied() -> bool:
            copies = asyncio.run(at("sfo"))
            return all(n in copies and copies[n].paused and copies[n].ack_floor.stream_seq == 0 for n in bulk)

        wait_for(all_copied, 30, "the new relay to finish the killed checkpoint's copies")

        async def drop() -> None:
            async with bnats.session(topo.nats("nyc")) as nc:
                for name in ["gone", *bulk]:
                    await nc.jsm().delete_consumer(stream, name)

        asyncio.run(drop())
        wait_for(lambda: not {"gone", *bulk} & set(asyncio.run(at("sfo"))), 30, "the copies of deleted consumers to go")
        time.sleep(2.0)  # the relay back has checkpointed sfo's consumers (the copies) a few times
        assert set(asyncio.run(at("nyc"))) == {"keep", "pushed", "stale", "theirs"}, "a copy was copied back"
        assert not any((c.config.metadata or {}).get("ferry.origin") for c in asyncio.run(at("nyc")).values())
        rows = json.loads(ferry("replicate", "status", "--json", topology=topology, check=True).stdout)
        (row,) = [r for r in rows if (r["source"], r["dest"]) == ("sfo", "nyc")]
        back_copied = [c for c in row["consumers"] if c["stream"] == stream]  # sfo's own "theirs" only, refused
        assert row["live"] and [c["consumer"] for c in back_copied] == ["theirs"], back_copied
        assert "of its own" in back_copied[0]["refused"], back_copied
    finally:
        for r in (forth, back):
            r.close()


def test_a_work_queue_stream_is_refused_and_nothing_changes(topology: Path) -> None:
    """A relay reads without consuming, which a work-queue stream allows no one: `replicate start`
    (and its dry run) refuses it in one line, creating nothing at sfo and defining nothing."""
    topo = load_topology(topology)
    asyncio.run(make_stream(topo, "nyc", "JOBS", ["jobs.>"], replicas=1, retention=RetentionPolicy.WORK_QUEUE))

    def defined() -> list[tuple[str, str, str, str]]:
        rows = json.loads(ferry("replicate", "status", "--json", topology=topology, check=True).stdout)
        return sorted((r["source"], r["dest"], r["streams"], r["intent"]) for r in rows)

    before = defined()
    for dry in ([], ["--dry-run"]):
        run = ferry("replicate", "start", "--from", "nyc", "--to", "sfo", "--streams", "J*", *dry, topology=topology)
        said = run.stderr.strip().splitlines()
        assert run.returncode == 2 and said == [
            "error: JOBS at nyc is a work-queue stream: a relay reads a stream without consuming it, which a "
            "work-queue stream allows no one; leave it out with --streams"
        ], (run.returncode, said)
    assert defined() == before

    async def at_sfo() -> bool:
        async with bnats.session(topo.nats("sfo")) as nc:
            return "JOBS" in [s.config.name for s in await nc.jsm().streams_info()]

    assert not asyncio.run(at_sfo()), "JOBS was created at sfo"


def test_a_checkpoint_leaves_a_copy_a_failover_resumed_alone(topology: Path) -> None:
    """A relay frozen through a failover wakes up in the middle of a checkpoint: the copy the
    failover resumed is the applications' now, and the checkpoint leaves it where they stand
    (moving it back to the source's stale position delivered thousands of messages again)."""
    topo = load_topology(topology)
    stream = "RESUMED"
    for site in ("nyc", "sfo"):
        asyncio.run(make_stream(topo, site, stream, ["resumed.>"], replicas=1))

    async def go() -> tuple[str | None, str | None, Any]:
        async with bnats.session(topo.nats("nyc")) as src, bnats.session(topo.nats("sfo")) as dest:
            for nc in (src, dest):
                for i in range(10):
                    await nc.jetstream().publish("resumed.x", str(i).encode())
            await src.jsm().add_consumer(stream, ConsumerConfig(durable_name="app", ack_policy=AckPolicy.EXPLICIT))
            (p,) = await consumers.positions(src, [stream])
            jsm = dest.jsm()
            made = await consumers.place(jsm, stream, p, 3, "nyc")
            await jsm.resume_consumer(stream, "app")  # the failover: the applications come to sfo
            await jsm.reset_consumer(stream, "app", 8)  # and consume there
            again = await consumers.place(jsm, stream, p, 3, "nyc")  # the frozen relay's checkpoint
            return made, again, await jsm.consumer_info(stream, "app")

    made, again, info = asyncio.run(go())
    assert made is None and again == f"its copy in {stream} delivers (a failover resumed it)", (made, again)
    assert not info.paused and info.delivered.stream_seq == 7, info  # delivers from 8, as the applications left it


def test_a_floor_translates_among_foreign_local_and_deleted_messages(topology: Path) -> None:
    """A position is the first message relayed from the consumer's stream above its ack floor,
    found by binary search, however the destination interleaves it: runs of sfo's own messages
    longer than the search gets one by one, another origin stream's, deleted ones, a purged start.
    Checked against a scan for every floor, with and without an earlier answer as a hint, right
    or wrong."""
    from ferry.jobs.replicate.consumers import GETS, Translator

    topo = load_topology(topology)
    stream, origin = "MIX", ("nyc", "MIX")
    asyncio.run(make_stream(topo, "sfo", stream, ["mix.>"], replicas=1))

    async def build_and_check() -> list[tuple[int, int, int]]:
        async with bnats.session(topo.nats("sfo")) as nc:
            js, jsm, seqs = nc.jetstream(), nc.jsm(), {}  # destination seq -> (origin site, stream, seq)
            for i in range(1, 61):
                run = GETS * 2 if i in (10, 40) else i % 3  # two runs that need the window read
                for _ in range(run):
                    which = ("nyc", "OTHER", 1000 + i) if i % 2 else None
                    headers = {} if which is None else {"Ferry-Origin-Site": "nyc", "Ferry-Origin-Stream": "OTHER",
                                                        "Ferry-Origin-Seq": str(which[2])}  # fmt: skip
                    seqs[(await js.publish("mix.local", b"x", headers=headers or None)).seq] = which
                h = {"Ferry-Origin-Site": "nyc", "Ferry-Origin-Stream": "MIX", "Ferry-Origin-Seq": str(i * 2)}
                seqs[(await js.publish("mix.relayed", b"x", headers=h)).seq] = (*origin, i * 2)
            for seq in [s for s, w in seqs.items() if w and w[:2] == origin][5::7]:  # some relayed ones deleted
                await jsm.delete_msg(stream, seq)
                del seqs[seq]
            await jsm.purge_stream(stream, seq=4)  # the start gone
            seqs = {s: w for s, w in seqs.items() if s >= 4}
            last = max(seqs)
            translate, wrong, answers = Translator(topo.nats("sfo"), "sfo", "nyc"), [], {}
            for floor in range(0, 124):
                want = answers[floor] = min(
                    (s for s, w in seqs.items() if w and w[:2] == origin and w[2] > floor), default=last + 1
                )
                earlier = (max(0, floor - 7), answers[max(0, floor - 7)])  # a checkpoint's hint
                for hint in (None, earlier, (earlier[0], earlier[1] + 3), (floor, 1)):  # right or wrong
                    got = await translate.seq_after(nc, stream, "MIX", floor, hint)
                    if got != want:
                        wrong.append((floor, hint, got, want))
            return wrong

    assert asyncio.run(build_and_check()) == []
