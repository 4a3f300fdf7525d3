"""`ferry serve` decides by what it has read of the journals: adoption only on a fresh read, and
no node taken out of the balancer by a journal it cannot read."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ferry.api import READ_FRESH, Registry
from ferry.topology import Topology
from tests.helpers import UNREACHABLE, VALID


@pytest.fixture
def registry(topology_of: Callable[[str], Topology]) -> Registry:
    return Registry(topology_of(VALID))


def test_only_a_fresh_read_of_a_dead_owner_is_adopted(registry: Registry) -> None:
    # a ferry on another host, silent for 60 s; one on this host, alive and beating
    dead = {"owner": {"host": "elsewhere", "pid": 1}, "heartbeat": time.time() - 60, "kind": "evacuation"}
    alive = {"owner": {"host": socket.gethostname(), "pid": os.getpid()}, "heartbeat": time.time()}
    registry.states["east"] = {"evacuation.east.east-1": dead, "evacuation.east.east-2": alive}
    assert registry.orphans() == []  # never read: nothing to go by
    registry.read_at["east"] = time.monotonic()
    assert registry.orphans() == [("east", "evacuation.east.east-1", dead)]
    registry.read_at["east"] = time.monotonic() - READ_FRESH - 1  # the journal stopped answering
    assert registry.orphans() == []


def test_an_owner_running_on_this_host_is_never_adopted(registry: Registry) -> None:
    import subprocess

    from ferry.journal import Journal

    late = time.time() - 60  # a heartbeat long overdue
    me = {"owner": Journal.owner(), "heartbeat": late, "kind": "evacuation"}
    reused = {
        "owner": {**Journal.owner(), "started": "1"},
        "heartbeat": late,
        "kind": "evacuation",
    }  # our pid, another process
    zombie = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)
    exited = {"owner": {"host": socket.gethostname(), "pid": zombie.pid}, "heartbeat": time.time(), "kind": "rebalance"}
    registry.states["east"] = {"a": me, "b": reused, "c": exited}
    registry.read_at["east"] = time.monotonic()
    try:
        assert [key for _, key, _ in registry.orphans()] == ["b", "c"]
    finally:
        zombie.wait()


def test_a_journal_not_read_yet_leaves_every_node_available(topology_of: Callable[[str], Topology]) -> None:
    """Fail open: a cluster whose journal serve cannot read (here: nothing listens) would else have
    every node answer 503, and the load balancer would take the whole cluster out."""
    from fastapi.testclient import TestClient

    from ferry.api import create_app

    with TestClient(create_app(topology_of(UNREACHABLE), None)) as client:
        for node in ("east-1", "ltm-1"):
            got = client.get(f"/availability_check?node={node}")
            assert got.status_code == 200 and got.json()["reason"] == "journal not read yet", got.text
        assert client.get("/availability_check?node=nope").status_code == 404
