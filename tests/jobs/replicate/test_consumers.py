"""Durable consumers fail over and back with their site (issue 52): applications consume at nyc
through durable pull and push consumers with different filters and ways of acknowledging while the relay
copies the consumers to sfo; nyc is SIGKILLed; `site failover --to sfo`; each application binds
its durable name at sfo and consumes there; more is written at sfo; nyc comes back; `site
failback --to nyc`; each binds at nyc again. At each site the test counts per consumer, by
message id, that nothing it had acknowledged nowhere is skipped, and that what it had
acknowledged comes again at most as the failover's or fail-back's report announced."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy

from ferry.brokers import nats as bnats
from ferry.lab.procs import free_ports
from ferry.topology import load_topology
from tests.helpers import Relay, ferry, load, make_stream, read_stream, stream_count, wait_for
from tests.jobs.replicate.test_replicate import define, finished, topology

__all__ = ["topology"]  # the fixture, shared with test_replicate.py

pytestmark = [pytest.mark.lab, pytest.mark.spark, pytest.mark.timeout(300)]

STREAM = "CONS"


@dataclass
class App:
    """One application at nyc: its durable consumer, how it acknowledges, what it acknowledged."""

    name: str
    filters: list[str]
    how: str  # "in-order" | "reversed" (each batch's acks in reverse) | "late" (every 5th acked on redelivery)
    push: bool = False  # delivered to a subject (in order) instead of fetched
    acked: dict[str, float] = field(default_factory=dict)  # id -> when the server confirmed the ack (nyc)
    unsure: set[str] = field(default_factory=set)  # an ack in flight as nyc died
    acked_sfo: set[str] = field(default_factory=set)
    checkpoint_at: float = 0.0  # the last checkpoint before the failover

    def config(self) -> ConsumerConfig:
        one = self.filters[0] if len(self.filters) == 1 else None
        many = self.filters if len(self.filters) > 1 else None
        return ConsumerConfig(
            durable_name=self.name,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=2.0,
            max_ack_pending=500,
            filter_subject=one,
            filter_subjects=many,
            deliver_subject=f"deliver.{self.name}" if self.push else None,
        )

    async def bind(self, nc: Any) -> Callable[[int, float], Awaitable[list[Any]]]:
        """Its durable at the site `nc` is connected to, as ``take(n, wait)``: up to n messages,
        waiting `wait` s at most (nats-py raises a TimeoutError when none came)."""
        js = nc.jetstream()
        if not self.push:
            sub = await js.pull_subscribe_bind(self.name, STREAM)
            return lambda n, wait: sub.fetch(n, timeout=wait)
        push = await js.subscribe_bind(STREAM, self.config(), self.name, manual_ack=True)

        async def one(_: int, wait: float) -> list[Any]:
            return [await push.next_msg(timeout=wait)]

        return one


APPS = [
    App("all-in-order", [], "in-order"),
    App("all-reversed", [], "reversed"),
    App("all-late", [], "late"),
    App("zero", ["cons.0"], "in-order"),
    App("one-reversed", ["cons.1"], "reversed"),
    App("two-late", ["cons.2"], "late"),
    App("three-pushed", ["cons.3"], "in-order", push=True),
    App("zero-one", ["cons.0", "cons.1"], "reversed"),
    App("two-three-late", ["cons.2", "cons.3"], "late"),
    App("slow", [], "in-order"),
]


async def consume(nc: Any, app: App, stop: threading.Event) -> None:
    """Take and acknowledge (each ack confirmed by the server) until `stop` or the server dies."""
    take = await app.bind(nc)
    seen: set[str] = set()
    while not stop.is_set():
        try:
            msgs = await take(20 if app.name != "slow" else 2, 1.0)
        except (TimeoutError, nats.errors.TimeoutError):  # nats-py raises either
            continue
        except Exception:  # nyc died
            return
        if app.how == "reversed":
            msgs = msgs[::-1]
        for m in msgs:
            mid = m.headers["Nats-Msg-Id"]
            if app.how == "late" and hash(mid) % 5 == 0 and mid not in seen:
                seen.add(mid)  # left pending: delivered again after ack_wait, acknowledged then
                continue
            try:
                await m.ack_sync(timeout=2)
            except Exception:
                app.unsure.add(mid)
                return
            app.acked[mid] = time.time()
        if app.name == "slow":
            await asyncio.sleep(0.2)


async def drain(nc: Any, app: App) -> list[str]:
    """Everything the application's durable delivers until it has nothing more for 1 s (3 s for a
    push consumer: what it pushed before the subscription came is pushed again after its 2 s
    ack wait), each acknowledged (confirmed)."""
    take, got = await app.bind(nc), []
    while True:
        try:
            msgs = await take(500, 3.0 if app.push else 1.0)
        except (TimeoutError, nats.errors.TimeoutError):  # nats-py raises either
            return got
        for m in msgs:
            got.append(m.headers["Nats-Msg-Id"])
            await m.ack_sync(timeout=5)


def judged(app: App, held: list[dict[str, Any]], got: list[str], done: set[str], allowed: int) -> dict[str, int]:
    """Nothing of `held` the application has not acknowledged (`done`) is missing from `got`, and
    at most `allowed` of the messages it had acknowledged come again (counted once each: a message
    the new site delivers twice, its ack wait passed on a busy machine, is that site's own
    redelivery, not the failover's)."""
    mine = {r["msg_id"] for r in held if not app.filters or r["subject"] in app.filters}
    skipped = mine - done - app.unsure - set(got)
    assert not skipped, f"{app.name}: {len(skipped)} messages it had not acknowledged never came"
    again = set(got) & done
    assert len(again) <= allowed, (app.name, len(again), allowed)
    return {"got": len(got), "again": len(again), "allowed": allowed}


def test_durable_consumers_fail_over_and_back_where_they_were(sites: Any, topology: Path, tmp_path: Path) -> None:
    topo = load_topology(topology)
    define(topology, STREAM)
    nyc = sites.proc("nyc-1")

    async def make() -> None:
        async with bnats.session(topo.nats("nyc")) as nc:
            for app in APPS:
                await nc.jsm().add_consumer(STREAM, app.config())

    asyncio.run(make())
    relay = Relay(topology, tmp_path, "nyc", "sfo", "--consumer-interval", "1")
    stop_apps = threading.Event()

    async def run_apps() -> None:
        async with bnats.session(topo.nats("nyc")) as nc:
            await asyncio.gather(*(consume(nc, app, stop_apps) for app in APPS))

    async def drained(site: str) -> dict[str, list[str]]:
        async with bnats.session(topo.nats(site)) as nc:
            got = await asyncio.gather(*(drain(nc, app) for app in APPS))
            return {app.name: g for app, g in zip(APPS, got, strict=True)}

    failed_back = False
    try:
        relay.event("relaying")
        producers = load(topology, "nyc", "cons.{n}", tmp_path / "ledger", 400, None)
        wait_for(lambda: stream_count(topo, "sfo", STREAM) > 1000, 60, "relaying")
        apps = threading.Thread(target=lambda: asyncio.run(run_apps()), daemon=True)
        apps.start()
        time.sleep(5.0)  # consuming at nyc, the relay checkpointing every second
        rows = json.loads(ferry("replicate", "status", "--json", topology=topology, check=True).stdout)
        (row,) = [r for r in rows if (r["source"], r["dest"]) == ("nyc", "sfo")]
        shown = {c["consumer"]: c for c in row["consumers"] if c["stream"] == STREAM}
        # a checkpoint every second, slower on two busy cores (CI saw ages past 5 s)
        assert set(shown) == {a.name for a in APPS} and all(c["age_s"] < 20 for c in shown.values()), shown
        assert "delivers from (dest)" in ferry("replicate", "status", topology=topology, check=True).stdout
        nyc.signal(signal.SIGKILL)  # the site fails mid-stream, its applications with it
        wait_for(lambda: not nyc.alive(), 10, "nyc to die")
        killed_at = time.time()
        stop_apps.set()
        apps.join(timeout=30)
        producers.send_signal(signal.SIGTERM)
        finished(producers)

        fo = json.loads(ferry("site", "failover", "--to", "sfo", "--json", topology=topology, check=True).stdout)
        rows = {r["consumer"]: r for r in fo["failover"]["consumers"]}
        assert set(rows) == {a.name for a in APPS}, rows
        assert all(r["checkpoint_at"] > killed_at - 20.0 for r in rows.values()), rows  # (every second, unloaded)
        held = asyncio.run(read_stream(topo, "sfo", STREAM))
        delivered, report = asyncio.run(drained("sfo")), {}
        for app in APPS:
            row = rows[app.name]
            after_checkpoint = sum(1 for t in app.acked.values() if t >= row["checkpoint_at"] - 0.05)
            allowed = row["redelivered_at_least"] + after_checkpoint
            report[app.name] = judged(app, held, delivered[app.name], set(app.acked), allowed)
            app.acked_sfo, app.checkpoint_at = set(delivered[app.name]), row["checkpoint_at"]
        assert sum(len(a.acked) for a in APPS) > 2000, report
        print(f"consumers at sfo: {json.dumps(report)}")

        finished(load(topology, "sfo", "cons.{n}", tmp_path / "ledger-sfo", 400, 3))  # not consumed at sfo
        nyc.start()
        sites.save()
        wait_for(lambda: sites.health().get("nyc-1") == "ok", 30, "nyc to answer again")
        fb = json.loads(ferry("site", "failback", "--to", "nyc", "--json", topology=topology, check=True).stdout)
        failed_back = True
        rows = {r["consumer"]: r for r in fb["streams"][STREAM]["consumers"]}
        assert set(rows) == {a.name for a in APPS}, rows
        held = asyncio.run(read_stream(topo, "nyc", STREAM))
        delivered, report = asyncio.run(drained("nyc")), {}
        for app in APPS:
            done = set(app.acked) | app.acked_sfo
            # and again what it acknowledged at nyc after the failover's checkpoint, as announced then
            since = sum(1 for t in app.acked.values() if t >= app.checkpoint_at - 0.05)
            allowed = rows[app.name]["redelivered_at_least"] + since
            report[app.name] = judged(app, held, delivered[app.name], done, allowed)
        assert all(r["got"] >= 1 for r in report.values()), report  # what sfo took meanwhile, at least
        print(f"consumers at nyc: {json.dumps(report)}")
    finally:
        stop_apps.set()
        relay.close()
        if not nyc.alive():
            nyc.start()
            sites.save()
            wait_for(lambda: sites.health().get("nyc-1") == "ok", 30, "nyc to answer again")
        if not failed_back:  # the other tests of the lab expect nyc primary
            ferry("site", "failback", "--to", "nyc", topology=topology)


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
