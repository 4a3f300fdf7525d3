"""Lab port planning: no port handed out twice before any server listens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ferry import lab
from ferry.lab import procs
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


@pytest.mark.parametrize("profile", ["supercluster", "sites"])
def test_a_profile_plans_every_port_once(profile: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every plan draws the same ports here (a seeded generator, made anew for each draw), so a
    profile that plans its servers in two draws hands the same port to two servers. (A CI run
    once started the sites profile with nyc-1 and sfo-1 on one monitor port.)"""
    monkeypatch.setattr(procs.random, "SystemRandom", lambda: random.Random(7))
    state = lab.LabState(profile=profile, dir=str(tmp_path))
    (tmp_path / "secrets").mkdir()
    lab._build(profile, state, tmp_path, lambda name: "secret")
    fields = ("client", "monitor", "route", "gateway", "mqtt")
    ports = [srv[k] for servers in state.nats for srv in servers for k in fields]
    assert len(ports) == len(set(ports)) == 5 * (6 if profile == "supercluster" else 2)
