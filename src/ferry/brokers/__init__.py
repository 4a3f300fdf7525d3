"""Broker adapters: one module per broker kind behind :mod:`ferry.brokers.base`."""

from __future__ import annotations

import asyncio

from ferry.brokers import nats, rabbitmq
from ferry.brokers.base import Probe
from ferry.topology import NatsCluster, Topology

__all__ = ["Probe", "nats", "probe_all", "rabbitmq"]


async def probe_all(topology: Topology) -> list[Probe]:
    """Probe every endpoint of every broker in the topology, concurrently."""
    tasks = [
        (nats.probe if isinstance(cluster, NatsCluster) else rabbitmq.probe)(name, cluster)  # type: ignore[arg-type]
        for _, name, cluster in topology.clusters()
    ]
    return [p for probes in await asyncio.gather(*tasks) for p in probes]
