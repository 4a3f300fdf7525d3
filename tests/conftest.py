"""Shared fixtures: one lab per profile per test run, started on first use.

Lab directories live under a world-traversable temporary directory because the
RabbitMQ nodes run as user ``rabbitmq``. Every fixture checks at teardown that
no process it started is left (by pid and process group).
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


def _profile(name: str, lab_dir: Path, haproxy: bool = False) -> Iterator[lab.LabState]:
    state = lab.up(name, lab_dir, log=lambda _: None, haproxy=haproxy)
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


def profile_topology(state: lab.LabState) -> Topology:
    return load_topology(state.path / "topology.yaml")


@pytest.fixture(scope="session")
def spark():  # type: ignore[no-untyped-def]
    from ferry.pipeline.spark import get_session

    session = get_session(app_name="ferry tests")
    yield session
    session.stop()
