"""The fail-back setting on the rabbit-dr lab, as the gist demonstrates it (the `dr` fixture): art
feeds pc1 and ltm by queue federation in two vhosts, one with a space and odd characters; five
queues each, odd ones quorum, even ones classic; numbered messages left on ltm, an unfederated
queue that must stay, and messages on art that must not be pulled. Shared by the fail-back tests
and their fault matrix."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pyarrow.parquet as pq
import pytest

from ferry import lab
from ferry.brokers.rabbitmq import Management, amqp_connect, q
from ferry.brokers.rabbitmq.queue_io import headers_from_json
from ferry.lab.scenarios import dr_federation, fill_queue
from ferry.topology import Topology
from tests.conftest import profile_topology
from tests.helpers import acked_ids, ferry, judge, queue_depth, snapshot_here

VHOSTS = {"fb-a": [f"fed-{i}" for i in range(5)], "fb /#%ü": [f"fed q/{i}#ü" for i in range(5)]}
# messages per federated queue: enough to watch a fail-back move, small enough for the suite's time; a
# test that kills a transfer midway asks for more (`@pytest.mark.parametrize("dr", [N], indirect=True)`)
PER_QUEUE = 2_000
PLAIN = 100


async def depths(topo: Topology, cluster: str, names: list[str]) -> dict[str, int]:
    out = {}
    for vhost, queues in VHOSTS.items():
        for queue in [*queues, *names]:
            out[f"{vhost}|{queue}"] = await queue_depth(topo, cluster, vhost, queue)
    return out


async def upstream_defs(topo: Topology, cluster: str) -> dict[str, Any]:
    async with Management(topo.rabbitmq(cluster), name=cluster) as m:
        return {v: await m.get(f"/parameters/federation-upstream/{q(v)}/art", ok404=True) for v in VHOSTS}


async def leftovers(topo: Topology) -> dict[str, Any]:
    async with Management(topo.rabbitmq("ltm"), name="ltm") as m:
        return {
            "shovels": [p for p in await m.get("/parameters/shovel") if p["vhost"] in VHOSTS],
            "journal": await m.get("/global-parameters/ferry-failback", ok404=True),
        }


async def delete_shovel(topo: Topology, vhost: str, name: str, queue: str) -> None:
    """Delete a shovel and wait until its queue has no consumer (its unacked messages are back)."""
    async with Management(topo.rabbitmq("ltm"), name="ltm") as m:
        await m.delete(f"/parameters/shovel/{q(vhost)}/{q(name)}")
        deadline = time.monotonic() + 30
        # a queue whose stats were not emitted yet has no "consumers" key: not known yet, not 0
        while (await m.get(f"/queues/{q(vhost)}/{q(queue)}")).get("consumers", 1):
            assert time.monotonic() < deadline, f"shovel {name} still consumes from {queue}"
            await asyncio.sleep(0.2)


@pytest.fixture
def dr(rabbit_dr: lab.LabState, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The setting with 10 x PER_QUEUE messages on ltm (ledger in tmp_path/ledger; a test may ask
    for another number) and 100 in each plain queue."""
    per_queue = getattr(request, "param", PER_QUEUE)
    topo = profile_topology(rabbit_dr)
    topology = rabbit_dr.path / "topology.yaml"
    for vhost, queues in VHOSTS.items():
        asyncio.run(dr_federation(topo, [vhost], queues, upstream_messages=50))
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    for i, vhost in enumerate(VHOSTS):
        part = tmp_path / f"ledger-{i}"
        pattern = VHOSTS[vhost][0].replace("0", "{n}")
        ferry(
            "load",
            f"rabbitmq://ltm/{q(vhost)}",
            "--subject",
            pattern,
            "--subjects",
            "5",
            "--count",
            str(5 * per_queue),
            "--producers",
            "2",
            "--ledger",
            str(part),
            topology=topology,
            check=True,
        )
        for f in part.glob("*.parquet"):
            shutil.copy(f, ledger / f"{i}-{f.name}")
        asyncio.run(fill_queue(topo, "ltm", vhost, "plain-0", PLAIN))
    asyncio.run(publish_rich(topo))
    yield {
        "per_queue": per_queue,
        "topo": topo,
        "topology": topology,
        "ledger": ledger,
        "password": topo.rabbitmq("ltm").credentials.password(),  # type: ignore[union-attr]
        "art": asyncio.run(depths(topo, "art", [])),
        "upstreams": asyncio.run(upstream_defs(topo, "ltm")),
    }

    async def drop() -> None:
        for name in ("art", "pc1", "ltm"):
            async with Management(topo.rabbitmq(name), name=name) as m:
                for vhost in VHOSTS:
                    await m.delete(f"/vhosts/{q(vhost)}")
                await m.delete("/global-parameters/ferry-failback")

    asyncio.run(drop())


RICH = {
    "content_type": "application/json",
    "correlation_id": "corr-1",
    "priority": 3,
    "message_id": "rich-1",
    "app_id": "ferry-test",
    "type": "order",
}
RICH_HEADERS = {"tenant": "eu", "n": 7, "nested": {"k": [1, "two"]}, "ü": True}


async def publish_rich(topo: Topology) -> None:
    """One message with properties and nested headers, on fb-a/fed-4 (which then holds one more)."""
    conn = await amqp_connect(topo.rabbitmq("ltm"), vhost="fb-a")
    try:
        ch = await conn.channel(publisher_confirms=True)
        msg = aio_pika.Message(b'{"rich": 1}', headers=RICH_HEADERS, delivery_mode=2, **RICH)  # type: ignore[arg-type]
        await ch.default_exchange.publish(msg, routing_key="fed-4")
    finally:
        await conn.close()


def expected_in(dr: dict[str, Any], vhost: str, queue: str) -> int:
    return dr["per_queue"] + (vhost == "fb-a" and queue == "fed-4")


def assert_rich_preserved(snapshot: Path) -> None:
    rows = pq.read_table(snapshot).to_pylist()
    (rich,) = [r for r in rows if r["properties"]["message_id"] == "rich-1"]
    props = rich["properties"]
    assert {k: props[k] for k in RICH} == RICH and props["delivery_mode"] == 2
    headers = headers_from_json(props["headers"])
    assert headers["tenant"] == "eu" and headers["n"] == 7 and headers["ü"] is True
    assert headers["nested"] == {"k": [1, "two"]}
    assert rich["payload"] == b'{"rich": 1}'


def audit_pc1(spark: Any, dr: dict[str, Any], tmp_path: Path, max_dup: int = 0) -> dict[str, Any]:
    snap = tmp_path / "pc1-snap"
    snapshot_here(spark, dr["topology"], "rabbitmq://pc1/*/fed*", snap)
    assert_rich_preserved(snap)
    return judge(spark, dr["topology"], dr["ledger"], str(snap), tmp_path / "audit.html", max_dup=max_dup)


def assert_done(dr: dict[str, Any]) -> None:
    topo = dr["topo"]
    ltm = asyncio.run(depths(topo, "ltm", ["plain-0"]))
    pc1 = asyncio.run(depths(topo, "pc1", []))
    for key, n in ltm.items():
        assert n == (PLAIN if key.endswith("plain-0") else 0), key  # drained; unfederated untouched
    assert all(n >= expected_in(dr, *key.split("|")) for key, n in pc1.items()), pc1
    assert asyncio.run(depths(topo, "art", [])) == dr["art"]  # nothing pulled from upstream
    assert asyncio.run(upstream_defs(topo, "ltm")) == dr["upstreams"]  # restored exactly
    assert asyncio.run(leftovers(topo)) == {"shovels": [], "journal": None}


async def _drain(topo: Topology, vhost: str, queue: str, n: int) -> list[str]:
    """Consume and ack the `n` messages of one pc1 queue; their message ids."""
    conn = await amqp_connect(topo.rabbitmq("pc1"), vhost=vhost)
    ids: list[str] = []
    try:
        ch = await conn.channel()
        await ch.set_qos(prefetch_count=1_000)
        source = await ch.get_queue(queue, ensure=False)
        async with source.iterator(arguments={"x-priority": -1}) as messages:  # pulls nothing from art
            async for m in messages:
                ids.append(m.message_id or "")
                await m.ack()
                if len(ids) == n:
                    break
    finally:
        await conn.close()
    return ids


def counted_on_pc1(dr: dict[str, Any]) -> dict[str, int]:
    """Every federated queue of the setting on pc1 drained and counted by message id, against the
    ids the loads recorded as acked on ltm: {"lost": .., "duplicated": .., "extra": ..} (extra:
    ids nobody sent). Drains pc1's queues: the last look at them."""
    topo = dr["topo"]
    held = asyncio.run(depths(topo, "pc1", []))
    got: Counter[str] = Counter()
    for key, n in held.items():
        vhost, queue = key.split("|")
        got.update(asyncio.run(asyncio.wait_for(_drain(topo, vhost, queue, n), 60)) if n else [])
    sent = acked_ids(dr["ledger"]) | {RICH["message_id"]}
    return {
        "lost": len(sent - set(got)),
        "duplicated": sum(n - 1 for n in got.values()),
        "extra": len(set(got) - sent),
    }
