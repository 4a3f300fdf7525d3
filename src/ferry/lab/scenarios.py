"""Prepared situations on lab brokers, shared by tests, benchmarks and demos.

- :func:`dr_federation`: the fail-back setting on the ``rabbit-dr`` profile.
  Upstream ``art`` holds queues with messages; ``pc1`` and ``ltm`` each have, in
  every vhost, an upstream ``art`` pointing at art's vhost, a policy federating
  the queues named ``<prefix>*`` and those queues (classic and quorum
  alternately), plus unfederated queues ``plain-*``. Messages for ``ltm`` are
  published by the caller (``ferry load`` writes the ledger the audit needs).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlsplit

import aio_pika

from ferry.brokers.rabbitmq import Management, amqp_connect, q
from ferry.topology import Topology

__all__ = ["dr_federation", "fill"]


def _uri(topo: Topology, cluster: str, vhost: str) -> str:
    c = topo.rabbitmq(cluster)
    parts = urlsplit(c.brokers[0].url)
    creds = c.credentials
    user, pw = (creds.user, creds.password() or "") if creds else ("guest", "guest")
    return f"amqp://{quote(user, safe='')}:{quote(pw, safe='')}@{parts.hostname}:{parts.port}/{q(vhost)}"


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
                    {"value": {"uri": _uri(topo, "art", vhost), "ack-mode": "on-confirm", "expires": 3600000}},
                )
                await m.put(
                    f"/policies/{q(vhost)}/federate-with-art",
                    {"pattern": f"^{prefix}", "definition": {"federation-upstream": "art"}, "apply-to": "queues"},
                )
    for vhost in vhosts:
        await fill(topo, "art", vhost, queues, upstream_messages)
    return {"vhosts": vhosts, "queues": queues, "plain": [f"plain-{i}" for i in range(plain)]}


async def fill(topo: Topology, cluster: str, vhost: str, queues: list[str], per_queue: int) -> None:
    """Publish `per_queue` persistent messages to each queue, with confirms."""
    conn = await amqp_connect(topo.rabbitmq(cluster), vhost=vhost)
    try:
        ch = await conn.channel(publisher_confirms=True)
        for queue in queues:
            for n in range(per_queue):
                await ch.default_exchange.publish(
                    aio_pika.Message(f"{queue}:{n}".encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                    routing_key=queue,
                )
    finally:
        await conn.close()
