"""`ferry serve` adopts an operation only on a fresh read of its journal (pure logic)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

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


def test_an_owner_running_on_this_host_is_never_adopted(registry: Registry) -> None:
    import subprocess

    from ferry.ops.journal import _Owned

    late = time.time() - 60  # a heartbeat long overdue
    me = {"owner": _Owned.owner(), "heartbeat": late}
    reused = {"owner": {**_Owned.owner(), "started": "1"}, "heartbeat": late}  # our pid, another process
    zombie = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)
    exited = {"owner": {"host": socket.gethostname(), "pid": zombie.pid}, "heartbeat": time.time()}
    registry.states["east"] = {"a": me, "b": reused, "c": exited}
    registry.read_at["east"] = time.monotonic()
    try:
        assert [key for _, key, _ in registry.orphans()] == ["b", "c"]
    finally:
        zombie.wait()
