"""What both node backends share: a node's view (connections, Raft groups or queues) and the base
the NATS and RabbitMQ backends implement."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ferry.brokers.rabbitmq import queue_path
from ferry.errors import NotFound
from ferry.jobs.shared.events import Emit, no_emit
from ferry.topology import NatsCluster, RabbitCluster

RELOCATE_PREFIX = "ferry.relocate."  # the holding queue of a classic queue being relocated
CONTROL = "ferry-ctl"  # connection-name prefix of ferry's own control connections: never evicted
STALE_AFTER = 5.0  # seconds without a heartbeat before another ferry adopts an operation


@dataclass
class Asset:
    """A JetStream stream or consumer (a Raft group) as one server sees it."""

    account: str
    stream: str
    consumer: str | None
    leader: str
    peers: list[str]
    kind: str = ""  # RabbitMQ: "classic" for a classic queue ferry can relocate

    @property
    def label(self) -> str:
        """ACCOUNT/STREAM[/CONSUMER], or a RabbitMQ queue's VHOST/QUEUE (its `queue_path`)."""
        return queue_path(self.account, self.stream) + (f"/{self.consumer}" if self.consumer else "")


@dataclass
class NodeView:
    name: str
    up: bool = False
    error: str = ""
    server_id: str = ""
    conns: list[dict] = field(default_factory=list)
    assets: list[Asset] = field(default_factory=list)

    @property
    def leaders(self) -> list[Asset]:
        return [a for a in self.assets if a.leader == self.name]

    def summary(self) -> dict[str, Any]:
        return {
            "node": self.name,
            "up": self.up,
            "connections": len(self.conns),
            "mqtt": sum(1 for c in self.conns if c.get("mqtt_client")),
            "sessions": len(self.leaders),
            "replicas": len(self.assets) - len(self.leaders),
            **({"error": self.error} if self.error else {}),
        }


class Nodes:
    """A cluster's nodes as one backend sees them (NATS: :class:`NatsNodes`, RabbitMQ: :class:`RabbitNodes`)."""

    name: str
    brokers: dict[str, Any]

    cluster: NatsCluster | RabbitCluster
    avoid: list[str]

    async def view(self, node: str, jetstream: bool = True) -> NodeView:
        raise NotImplementedError

    async def step_down_many(
        self, moves: list[tuple[Asset, str | None]], guard: bool = False, emit: Emit = no_emit
    ) -> list[str]:
        raise NotImplementedError

    async def recover(self, emit: Emit) -> None:
        """Finish what a killed ferry left on this host (NATS: step-down captures); nothing by default."""

    def reach_order(self) -> list[Any]:
        """The brokers to connect through: the nodes being emptied last, so ferry's own connections avoid them."""
        brokers = self.cluster.brokers
        return [b for b in brokers if b.name not in self.avoid] + [b for b in brokers if b.name in self.avoid]

    def check(self, names: list[str], what: str) -> None:
        unknown = [n for n in names if n not in self.brokers]
        if unknown:
            raise NotFound(
                f"{what}: no node {', '.join(unknown)} in cluster {self.name!r} (has {', '.join(self.brokers)})"
            )

    async def views(self, nodes: list[str], jetstream: bool = True) -> dict[str, NodeView]:
        got = await asyncio.gather(*(self.view(n, jetstream) for n in nodes))
        return {v.name: v for v in got}
