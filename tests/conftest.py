"""Shared fixtures: one lab per profile per test run, started on first use.

Lab directories live under a world-traversable temporary directory because the
RabbitMQ nodes run as user ``rabbitmq``. Every fixture checks at teardown that
no process it started is left (by pid and process group).

Marks say what a test needs: ``lab`` (real brokers), ``spark`` (a Spark session).
A test that asks for a lab fixture or the Spark session without its mark is an
error at collection, so ``make test-fast`` (``-m "not lab and not spark"``) can
never start a server or a JVM.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferry import lab
from ferry.lab.procs import group_members
from ferry.topology import Topology, load_topology


@pytest.fixture(scope="session")
def lab_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ferry-test-lab-", dir="/tmp"))
    path.chmod(0o755)
    os.environ["FERRY_LAB_DIR"] = str(path)
    yield path
    leftovers = lab.down(root=path, log=lambda _: None)
    shutil.rmtree(path, ignore_errors=True)
    assert not leftovers, f"profiles left running by a test: {leftovers}"


def _profile(name: str, lab_dir: Path, haproxy: bool = False, secure: bool = False) -> Iterator[lab.LabState]:
    state = lab.up(name, lab_dir, log=lambda _: None, haproxy=haproxy, secure=secure)
    yield state
    pgids = [p.pid for p in state.procs]
    lab.down(name, lab_dir, log=lambda _: None)
    left = {pgid: group_members(pgid) for pgid in pgids if group_members(pgid)}
    assert not left, f"lab {name} left processes behind: {left}"


@pytest.fixture(scope="session")
def supercluster(lab_dir: Path) -> Iterator[lab.LabState]:
    yield from _profile("supercluster", lab_dir, haproxy=True)


@pytest.fixture(scope="session")
def sites(lab_dir: Path) -> Iterator[lab.LabState]:
    yield from _profile("sites", lab_dir)


@pytest.fixture(scope="session")
def rabbit_dr(lab_dir: Path) -> Iterator[lab.LabState]:
    yield from _profile("rabbit-dr", lab_dir)


@pytest.fixture(scope="session")
def rabbit_cluster(lab_dir: Path) -> Iterator[lab.LabState]:
    yield from _profile("rabbit-cluster", lab_dir, haproxy=True)


@pytest.fixture(scope="session")
def secure_supercluster(lab_dir: Path) -> Iterator[lab.LabState]:
    """The supercluster in operator mode with TLS everywhere (a lab root of its own: it runs beside
    the plain one)."""
    root = lab_dir / "secure"
    root.mkdir(mode=0o755, exist_ok=True)
    yield from _profile("supercluster", root, secure=True)


@pytest.fixture(scope="module")
def secure_rabbit_dr(lab_dir: Path) -> Iterator[lab.LabState]:
    """rabbit-dr with AMQP and the management API over TLS only, client certificates required (in
    the secure lab root: its topology.yaml holds both secure profiles when both run). Per module:
    left running, its idle nodes took enough CPU from the rest of the suite to fail a timing
    assertion (a relay's p99 delay over 2 s)."""
    root = lab_dir / "secure"
    root.mkdir(mode=0o755, exist_ok=True)
    yield from _profile("rabbit-dr", root, secure=True)


LAB_FIXTURES = {"lab_dir", "supercluster", "sites", "rabbit_dr", "rabbit_cluster", "secure_supercluster"}
LAB_FIXTURES |= {"secure_rabbit_dr"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = []
    for item in items:
        needs = set(getattr(item, "fixturenames", ()))
        if needs & LAB_FIXTURES and not item.get_closest_marker("lab"):
            unmarked.append(f"{item.nodeid}: uses {', '.join(sorted(needs & LAB_FIXTURES))} without the lab mark")
        if "spark" in needs and not item.get_closest_marker("spark"):
            unmarked.append(f"{item.nodeid}: uses the spark fixture without the spark mark")
    if unmarked:
        raise pytest.UsageError("tests whose marks do not say what they need:\n" + "\n".join(unmarked))


def profile_topology(state: lab.LabState) -> Topology:
    return load_topology(state.path / "topology.yaml")


@pytest.fixture(scope="session")
def spark():  # type: ignore[no-untyped-def]
    from ferry.spark.session import get_session

    session = get_session(app_name="ferry tests")
    yield session
    session.stop()
