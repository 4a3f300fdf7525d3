"""Lab port planning: no port handed out twice before any server listens."""

from __future__ import annotations

from ferry.lab.nats import plan_servers
from ferry.lab.rabbitmq import plan_nodes


def test_planned_nats_ports_are_all_distinct() -> None:
    # 300 ports drawn from about 12,000: without the exclusion a repeat is nearly certain (~97 %)
    servers = plan_servers({"a": 30, "b": 30})
    ports = [p for s in servers for p in (s.client, s.monitor, s.route, s.gateway, s.mqtt)]
    assert len(ports) == len(set(ports)) == 300


def test_planned_rabbitmq_ports_are_all_distinct() -> None:
    nodes = plan_nodes({"x": [f"x-{i}" for i in range(60)]})
    ports = [p for n in nodes for p in (n.amqp, n.management, n.mqtt, n.dist)]
    assert len(ports) == len(set(ports)) == 240
