"""Fast batch publishing (`BatchPublisher`) on the lab's R3 streams: every message once, in order,
through refusals and leader changes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import nats.errors
import pyarrow.parquet as pq
import pytest

from ferry import lab
from ferry.brokers import nats as bnats
from ferry.brokers.nats.publish import BatchPublisher, Publisher
from ferry.brokers.nats.wire import wire
from ferry.brokers.nats.writer import WriteConfig, write_rows
from ferry.errors import AuthError, BrokerUnavailable, ConfigError
from ferry.topology import load_topology
from tests.conftest import profile_topology
from tests.helpers import as_nats_user, ferry, make_stream, read_stream

pytestmark = pytest.mark.lab


async def _publish(topo, stream: str, n: int, payload=lambda i: b"x" * 100) -> BatchPublisher:  # type: ignore[no-untyped-def]
    async with wire(topo.nats("east"), "east") as w, BatchPublisher(w, ack_timeout=1.0, give_up_after=60) as pub:
        for i in range(n):
            await pub.publish(f"{stream.lower()}.s{i % 7}", payload(i), msg_id=f"m{i}")
    return pub


def _ids(rows: list[dict]) -> list[int]:
    return [int(dict(r["headers"])["Nats-Msg-Id"][1:]) for r in rows]


async def test_every_message_once_in_order_and_a_second_send_stores_nothing(supercluster: lab.LabState) -> None:
    topo = profile_topology(supercluster)
    await make_stream(topo, "east", "FB1", ["fb1.>"], placement="east", allow_batched=True)
    pub = await _publish(topo, "FB1", 20_000)
    assert (pub.stats.stored, pub.stats.failed, pub.stats.retries) == (20_000, 0, 0)
    again = await _publish(topo, "FB1", 20_000)  # the same ids: the stream drops them all
    assert again.stats.failed == 0
    assert _ids(await read_stream(topo, "east", "FB1")) == list(range(20_000))


async def test_a_refused_message_fails_alone_and_the_rest_is_stored_in_order(supercluster: lab.LabState) -> None:
    topo = profile_topology(supercluster)
    await make_stream(topo, "east", "FB2", ["fb2.>"], placement="east", allow_batched=True, max_msg_size=1000)
    pub = await _publish(topo, "FB2", 5_000, payload=lambda i: b"x" * (2000 if i == 2_500 else 100))
    assert pub.stats.failed == 1 and "exceeds maximum" in pub.stats.errors[0], pub.stats
    assert pub.stats.stored == 4_999
    assert pub.stats.retries > 0  # the batch ended at the refusal; what followed was sent again
    assert _ids(await read_stream(topo, "east", "FB2")) == [i for i in range(5_000) if i != 2_500]


async def test_leader_changes_mid_batch_lose_and_duplicate_nothing(supercluster: lab.LabState) -> None:
    topo = profile_topology(supercluster)
    # ids a leader lost in an election stay "in process" there until the duplicate window passes: a
    # short window keeps the publisher's wait for them short
    await make_stream(topo, "east", "FB3", ["fb3.>"], placement="east", allow_batched=True, duplicate_window=10)

    async def stepdowns() -> int:
        done = 0
        async with bnats.session(topo.nats("east")) as nc:
            for _ in range(3):
                await asyncio.sleep(1.0)
                await nc.request("$JS.API.STREAM.LEADER.STEPDOWN.FB3", b"", timeout=10)
                done += 1
        return done

    stepper = asyncio.create_task(stepdowns())
    n = 0
    async with wire(topo.nats("east"), "east") as w, BatchPublisher(w, ack_timeout=1.0, give_up_after=60) as pub:
        while not stepper.done() or n < 10_000:  # through three leader changes, then some
            await pub.publish(f"fb3.s{n % 7}", b"x" * 100, msg_id=f"m{n}")
            n += 1
            if n % 1000 == 0:
                await asyncio.sleep(0)  # let the stepdowns' requests through
    assert stepper.result() == 3
    assert pub.stats.failed == 0
    assert pub.stats.retries > 0  # batches did end early: what they had not confirmed was sent again
    ids = _ids(await read_stream(topo, "east", "FB3"))
    assert sorted(ids) == list(range(n)), "a message was lost or stored twice"


async def test_the_first_flow_ack_lets_a_new_batch_go_on_at_once(supercluster: lab.LabState) -> None:
    """A batch sends 32 messages, then waits for the stream's first flow ack (seq 0), which widens
    the window. That ack must wake the publisher: waking at its next tick instead cost every new
    batch 200 ms (a relay's micro-batch of 900 messages took 245 ms instead of 45). Here the tick
    is a minute, so only the ack can wake it within the bound."""
    topo = profile_topology(supercluster)
    await make_stream(topo, "east", "FB6", ["fb6.>"], placement="east", allow_batched=True)
    async with wire(topo.nats("east"), "east") as w:
        pub = BatchPublisher(w, ack_timeout=1.0, give_up_after=60)
        pub._tick = 60.0

        async def batch(first: int) -> None:
            async with pub:
                for i in range(first, first + 100):
                    await pub.publish(f"fb6.s{i % 7}", b"x" * 100, msg_id=f"m{i}")

        await asyncio.wait_for(batch(0), 20)
        await asyncio.wait_for(batch(100), 20)  # a second batch on the same publisher too
    assert (pub.stats.stored, pub.stats.failed) == (200, 0)
    assert _ids(await read_stream(topo, "east", "FB6")) == list(range(200))


async def test_messages_larger_than_a_read_are_stored_and_read_back_whole(supercluster: lab.LabState) -> None:
    """Up to the servers' 1 MB limit, between small ones, byte for byte through the data plane's
    connection both ways (it gathers a message larger than one 256 kB read before parsing it)."""
    topo = profile_topology(supercluster)
    await make_stream(topo, "east", "FB6", ["fb6.>"], placement="east", allow_batched=True)
    sizes = [0, 300_000, 7, 1_000_000, 100, 600_000, 1, 262_144]
    body = [bytes([65 + i]) * n for i, n in enumerate(sizes)]
    async with asyncio.timeout(60):  # a parser that lost its place would wait for more bytes
        pub = await _publish(topo, "FB6", len(sizes), payload=lambda i: body[i])
        assert (pub.stats.stored, pub.stats.failed) == (len(sizes), 0)
        rows = await read_stream(topo, "east", "FB6")
    assert [r["payload"] for r in rows] == body
    assert _ids(rows) == list(range(len(sizes)))


async def test_a_stream_that_does_not_allow_batches_is_a_config_error(supercluster: lab.LabState) -> None:
    topo = profile_topology(supercluster)
    await make_stream(topo, "east", "FB4", ["fb4.>"], placement="east")
    with pytest.raises(ConfigError, match="allow_batched"):
        await _publish(topo, "FB4", 100)


async def _stored(nc: Any, stream: str) -> int:
    """The stream's message count; 0 while it does not answer (CI saw a stream info time out in
    the election after a stepdown)."""
    try:
        return (await nc.jsm(timeout=2).stream_info(stream)).state.messages
    except nats.errors.TimeoutError:
        return 0


async def test_an_ordered_batched_write_keeps_sequence_order_through_leader_changes(supercluster: lab.LabState) -> None:
    """The copy's ordered mode in batches: each message expects its predecessor as the stream's
    last (``Nats-Expected-Last-Sequence``), so leader changes cost re-sends but never order."""
    topo = profile_topology(supercluster)
    await make_stream(topo, "east", "FB5", ["fb5.>"], placement="east", allow_batched=True)
    n = 120_000
    cfg = WriteConfig(
        cluster=topo.nats("east").model_dump_json(), name="east", stream="FB5", ordered=True, batched=True
    )

    async def rows():  # type: ignore[no-untyped-def]
        for lo in range(0, n, 1000):
            yield [(f"fb5.s{i % 7}", b"y" * 100, None, f"m{i}", "src/S", i + 1) for i in range(lo, lo + 1000)]
            await asyncio.sleep(0)

    async def stepdowns() -> None:  # mid-write, by the stream's own count (not by the clock)
        async with bnats.session(topo.nats("east")) as nc:
            for stored in (n // 4 + 5000, n // 2 + 5000):  # inside a chunk of 20,000, not at its resync
                async with asyncio.timeout(120):
                    while await _stored(nc, "FB5") < stored:
                        await asyncio.sleep(0.01)
                reply = await nc.request("$JS.API.STREAM.LEADER.STEPDOWN.FB5", b"", timeout=10)
                assert b'"success":true' in reply.data, reply.data

    stepper = asyncio.create_task(stepdowns())
    counts = await write_rows(cfg, rows())
    await stepper
    assert counts.stored == n
    assert counts.retries > 0, counts  # the leader changes did cut batches short
    assert _ids(await read_stream(topo, "east", "FB5")) == list(range(n)), "out of order, lost or stored twice"


async def test_a_failing_message_handler_closes_the_connection_with_its_reason(supercluster: lab.LabState) -> None:
    """A bug in a subscriber's callback must not leave the data plane's connection open and unread
    (a publisher once waited minutes for acks that nobody read)."""
    topo = profile_topology(supercluster)
    async with wire(topo.nats("east"), "east") as w:

        def broken(msg: Any) -> None:
            raise IndexError("pop from an empty deque")

        await w.subscribe("fbx.broken", cb=broken)
        await w.publish("fbx.broken", b"x")  # delivered back to this connection
        async with asyncio.timeout(10):
            while w.is_connected:
                await asyncio.sleep(0.01)
        with pytest.raises(BrokerUnavailable, match="reading failed: IndexError"):
            w.publish_raw(b"fbx.other", b"", b"", b"x")


async def test_a_publish_the_server_refuses_fails_at_its_first_ack_timeout(
    supercluster: lab.LabState, tmp_path: Path
) -> None:
    """The lab's `limited` user may not publish to `denied.>`: the server answers nothing, only a
    permission violation, so without it the publishers would wait out give_up_after (60 s here)."""
    topo = profile_topology(supercluster)
    await make_stream(topo, "east", "DENIED", ["denied.>"], placement="east", allow_batched=True)
    limited = as_nats_user(supercluster, "limited", tmp_path)
    async with wire(load_topology(limited).nats("east"), "east") as w:
        t0 = time.monotonic()
        with pytest.raises(AuthError, match=r"refused ferry's user to publish to denied\.b \(permissions violation"):
            async with BatchPublisher(w, ack_timeout=1.0, give_up_after=60) as pub:
                await pub.publish("denied.b", b"x", msg_id="b1")
        assert time.monotonic() - t0 < 10
        t0 = time.monotonic()
        async with Publisher(w, ack_timeout=1.0, give_up_after=60) as one:
            await one.publish("denied.p", b"x", msg_id="p1")
            stats = await one.flush()
        assert time.monotonic() - t0 < 10
    assert stats.failed == 1 and "publish to denied.p (permissions violation)" in stats.errors[0], stats

    # core publishes the server drops: the load says so, and its ledger still holds every message
    ledger = tmp_path / "ledger"
    args = ("load", "nats://east", "--subject", "denied.c", "--subjects", "1", "--count", "50", "--ledger", str(ledger))
    r = await asyncio.to_thread(ferry, *args, topology=limited)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert 'dropped messages of ferry\'s user: Permissions Violation for Publish to "denied.c"' in r.stderr
    assert pq.read_table(ledger).num_rows == 50
