"""Prepared situations on lab brokers, shared by tests, benchmarks and demos.

- :func:`dr_federation`: the fail-back setting on the ``rabbit-dr`` profile.
  Upstream ``art`` holds queues with messages; ``pc1`` and ``ltm`` each have, in
  every vhost, an upstream ``art`` pointing at art's vhost, a policy federating
  the queues named ``<prefix>*`` and those queues (classic and quorum
  alternately), plus unfederated queues ``plain-*``. Messages for ``ltm`` are
  published by the caller (``ferry load`` writes the ledger the audit needs).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aio_pika

from ferry.brokers.rabbitmq import Management, amqp_connect, amqp_uri, q
from ferry.topology import Topology

__all__ = ["dr_federation", "fill_queue"]


async def dr_federation(
    topo: Topology,
    vhosts: list[str],
    queues: list[str],
    *,
    plain: int = 1,
    prefix: str = "fed",
    upstream_messages: int = 100,
) -> dict[str, Any]:
    """Create the setting (idempotent); returns the names, per vhost."""
    for name in ("art", "pc1", "ltm"):
        creds = topo.rabbitmq(name).credentials
        user = creds.user if creds else "guest"
        async with Management(topo.rabbitmq(name), name=name) as m:
            for vhost in vhosts:
                await m.put(f"/vhosts/{q(vhost)}", {})
                await m.put(f"/permissions/{q(vhost)}/{q(user)}", {"configure": ".*", "write": ".*", "read": ".*"})
                for i, queue in enumerate(queues):
                    args = {"x-queue-type": "quorum"} if i % 2 else {}
                    await m.put(f"/queues/{q(vhost)}/{q(queue)}", {"durable": True, "arguments": args})
                if name == "art":
                    continue
                for i in range(plain):
                    await m.put(f"/queues/{q(vhost)}/plain-{i}", {"durable": True})
                await m.put(
                    f"/parameters/federation-upstream/{q(vhost)}/art",
                    {
                        "value": {
                            "uri": amqp_uri(topo, "art", vhost, dialer=name),
                            "ack-mode": "on-confirm",
                            "expires": 3600000,
                        }
                    },
                )
                await m.put(
                    f"/policies/{q(vhost)}/federate-with-art",
                    {"pattern": f"^{prefix}", "definition": {"federation-upstream": "art"}, "apply-to": "queues"},
                )
    for vhost in vhosts:
        for queue in queues:
            await fill_queue(topo, "art", vhost, queue, upstream_messages)
    return {"vhosts": vhosts, "queues": queues, "plain": [f"plain-{i}" for i in range(plain)]}


async def fill_queue(
    topo: Topology,
    cluster: str,
    vhost: str,
    queue: str,
    n: int,
    message: Callable[[int], aio_pika.Message] | None = None,
) -> None:
    """Publish `n` messages to `queue` with confirms, 500 in flight; by default persistent `<queue>:<i>`."""

    def default(i: int) -> aio_pika.Message:
        return aio_pika.Message(f"{queue}:{i}".encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT)

    make = message or default
    conn = await amqp_connect(topo.rabbitmq(cluster), vhost=vhost)
    async with conn:
        ch = await conn.channel(publisher_confirms=True)
        for start in range(0, n, 500):
            await asyncio.gather(
                *(ch.default_exchange.publish(make(i), routing_key=queue) for i in range(start, min(n, start + 500)))
            )
