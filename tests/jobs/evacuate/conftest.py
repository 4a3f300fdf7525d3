"""The evacuation tests' fixtures: a node crowded with clients through HAProxy."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ferry import lab
from tests.helpers import wait_for
from tests.jobs.evacuate.test_evacuate import NODES, api, haproxy_up, start_clients


@pytest.fixture()
def crowded(supercluster: lab.LabState) -> Iterator[Callable[[str], None]]:
    """crowd(node): make every other east node unavailable to HAProxy (an evacuation held in its
    health-check wait, started through the API) until `release()`; the fixture releases at the end."""
    held: list[str] = []

    def crowd(node: str) -> None:
        others = [n for n in NODES if n != node]
        for n in others:
            r = api(supercluster, "POST", "/evacuations", json={"node": n, "wait_health_check": 3600})
            assert r.status_code == 202, r.text
            held.append(n)
            listed = api(supercluster, "GET", "/evacuations").json()  # at once: its answer waited for it
            assert n in {e.get("node") for e in listed}, listed
        wait_for(lambda: haproxy_up(supercluster) == {n: n == node for n in NODES}, 15, f"HAProxy to see only {node}")

    def release() -> None:
        while held:
            n = held.pop()
            assert api(supercluster, "DELETE", f"/evacuations/{n}").status_code == 200
        wait_for(lambda: all(haproxy_up(supercluster).values()), 15, "HAProxy to see every node up")

    crowd.release = release  # type: ignore[attr-defined]
    yield crowd
    held.clear()
    for n in NODES:  # whatever is left, held here or by a failed test (404 when none)
        api(supercluster, "DELETE", f"/evacuations/{n}")
    release()


@pytest.fixture
def clients(supercluster: lab.LabState) -> Iterator[Callable[[Path, float, str], subprocess.Popen]]:
    """start_clients on the supercluster; a load still running when the test ends (it failed) is killed."""
    started: list[subprocess.Popen] = []

    def start(ledger: Path, seconds: float, stream: str) -> subprocess.Popen:
        started.append(start_clients(supercluster, ledger, seconds, stream))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
