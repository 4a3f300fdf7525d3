"""`ferry serve` adopts an operation only on a fresh read of its journal (pure logic)."""

from __future__ import annotations

import os
import socket
import time

import pytest

from ferry.api import READ_FRESH, Registry
from ferry.topology import load_topology
from tests.unit.test_topology import VALID


@pytest.fixture
def registry(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Registry:
    for var in ("FERRY_T_APP", "FERRY_T_SYS", "FERRY_T_LTM"):
        monkeypatch.setenv(var, "secret")
    path = tmp_path / "t.yaml"
    path.write_text(VALID)
    return Registry(load_topology(path))


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
