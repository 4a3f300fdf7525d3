"""Smoke checks: prove a cluster carries messages end to end, then clean up.

- NATS: a temporary R-n stream placed in one cluster, written and read back by a
  client connected to another cluster of the super-cluster (through gateways).
- RabbitMQ: a temporary queue, published with confirms and consumed back.

Every message is checked (order and payload); the temporary stream or queue is
deleted even when the check fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import uuid
from typing import Any

import aio_pika
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, Placement, StorageType, StreamConfig
from nats.js.errors import ServiceUnavailableError

from ferry.brokers import nats as bnats
from ferry.brokers import rabbitmq as brabbit
from ferry.brokers.nats.publish import Publisher
from ferry.errors import FerryError
from ferry.topology import Topology


def _payload(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * 3 + i.to_bytes(4, "big")


async def nats_smoke(
    topology: Topology, stream_cluster: str, client_cluster: str, count: int = 5000, replicas: int = 3
) -> dict[str, Any]:
    topology.nats(stream_cluster)
    client = topology.nats(client_cluster)
    tag = uuid.uuid4().hex[:8]
    stream = f"FERRY_SMOKE_{tag}"
    subject = f"ferry.smoke.{tag}"
    t0 = time.perf_counter()
    async with bnats.session(client, name=client_cluster) as nc:
        js = nc.jetstream(timeout=10)
        await js.add_stream(
            StreamConfig(
                name=stream,
                subjects=[subject],
                num_replicas=replicas,
                storage=StorageType.FILE,
                placement=Placement(cluster=stream_cluster),
            )
        )
        try:
            info = await js.stream_info(stream)
            async with Publisher(nc, window=256) as pub:
                for i in range(count):
                    await pub.publish(subject, _payload(i), msg_id=f"{tag}-{i}")
            t_pub = time.perf_counter()
            sub = await js.pull_subscribe(
                subject, durable=None, stream=stream, config=ConsumerConfig(ack_policy=AckPolicy.ALL)
            )
            got = 0
            deadline = time.monotonic() + 60
            while got < count:
                try:
                    msgs = await sub.fetch(min(500, count - got), timeout=5)
                except (ServiceUnavailableError, NatsTimeoutError):
                    if time.monotonic() > deadline:
                        raise FerryError(f"smoke: read back only {got} of {count} messages within 60s") from None
                    continue  # a new consumer may still be electing its leader
                for m in msgs:
                    if m.data != _payload(got):
                        raise FerryError(f"smoke: message {got} came back different from what was sent")
                    got += 1
                await msgs[-1].ack()
            t_read = time.perf_counter()
            await sub.unsubscribe()
        finally:
            with contextlib.suppress(Exception):
                await js.delete_stream(stream)
    return {
        "kind": "nats",
        "stream": stream,
        "placed_in": info.cluster.name if info.cluster else None,
        "leader": info.cluster.leader if info.cluster else None,
        "replicas": 1 + len(info.cluster.replicas or []) if info.cluster else 1,
        "client_cluster": client_cluster,
        "client_server": nc._server_info.get("server_name") if nc._server_info else None,
        "published": pub.stats.stored,
        "read_back": got,
        "retries": pub.stats.retries,
        "publish_rate": round(count / (t_pub - t0)),
        "read_rate": round(count / (t_read - t_pub)),
    }


async def rabbit_smoke(topology: Topology, cluster_name: str, count: int = 5000) -> dict[str, Any]:
    cluster = topology.rabbitmq(cluster_name)
    queue_name = f"ferry.smoke.{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    conn = await brabbit.amqp_connect(cluster)
    async with conn:
        ch = await conn.channel(publisher_confirms=True)
        queue = await ch.declare_queue(queue_name, durable=True)
        try:
            for start in range(0, count, 500):
                await asyncio.gather(
                    *(
                        ch.default_exchange.publish(aio_pika.Message(_payload(i)), routing_key=queue_name)
                        for i in range(start, min(count, start + 500))
                    )
                )
            t_pub = time.perf_counter()
            got = 0
            await ch.set_qos(prefetch_count=500)
            async with queue.iterator() as it:
                async for message in it:
                    if message.body != _payload(got):
                        raise FerryError(f"smoke: message {got} came back different from what was sent")
                    got += 1
                    await message.ack()
                    if got == count:
                        break
            t_read = time.perf_counter()
        finally:
            with contextlib.suppress(Exception):
                await queue.delete(if_unused=False, if_empty=False)
    return {
        "kind": "rabbitmq",
        "queue": queue_name,
        "cluster": cluster_name,
        "published": count,
        "read_back": got,
        "publish_rate": round(count / (t_pub - t0)),
        "read_rate": round(count / (t_read - t_pub)),
    }
