"""Shared fixtures: one lab per profile per test run, started on first use.

Lab directories live under a world-traversable temporary directory because the
RabbitMQ nodes run as user ``rabbitmq``. Every fixture checks at teardown that
no process it started is left (by pid and process group).

A session's lab (and the Spark Connect server) stops after the last module that uses it, and the
modules that use the ``sites`` lab (relays, whose delays are timed) run last: by then most other
labs are down and take no CPU from them. ``make test`` runs two workers (pytest-xdist, ``--dist
loadfile --no-loadscope-reorder``): each gets whole modules in collection order, starts the labs
they need in a lab directory of its own, and stops each once no later module uses it.

Marks say what a test needs: ``lab`` (real brokers), ``spark`` (a Spark session).
A test that asks for a lab fixture or the Spark session without its mark is an
error at collection, so ``make test-fast`` (``-m "not lab and not spark"``) can
never start a server or a JVM.

Mark ``connect`` (with ``spark``): the ``ferry`` commands the test runs do their Spark jobs on
the suite's one Spark Connect server (``$FERRY_SPARK_REMOTE``), as on a shared Spark, instead
of starting a JVM each (8 s or more apiece here). A test that kills ferry mid-job, or watches
its local JVM, stays without it: a job on a server outlives its killed client.

Mark ``cluster`` (with ``spark``): they run on the ``spark`` lab's standalone master
(``$FERRY_SPARK_MASTER``), whose two workers' Python has pyspark's dependencies and nothing of
ferry's: each such test proves ferry ships itself. One test of every Spark job has it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ferry import lab
from ferry.lab.procs import free_ports, group_members, port_open
from ferry.topology import Topology, load_topology


def pytest_configure(config: pytest.Config) -> None:
    """xdist's workers ignore SIGINT, and a child inherits an ignored signal: the ferry commands a
    test starts must take Ctrl-C (SIGINT) as a user's would."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def lab_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ferry-test-lab-", dir="/tmp"))
    path.chmod(0o755)
    os.environ["FERRY_LAB_DIR"] = str(path)
    yield path
    leftovers = lab.down(root=path, log=lambda _: None)
    shutil.rmtree(path, ignore_errors=True)
    assert not leftovers, f"profiles left running by a test: {leftovers}"


# session fixture name -> how to stop what it started; `_stop` runs it once, after the fixture's
# last module (pytest_runtest_teardown) or at the fixture's own teardown, whichever comes first
_STOPS: dict[str, Callable[[], None]] = {}
EARLY_STOP = {"supercluster", "sites", "rabbit_dr", "rabbit_cluster", "secure_supercluster", "spark_connect"}
EARLY_STOP |= {"spark_cluster"}


def _stop(fixture: str) -> None:
    stop = _STOPS.pop(fixture, None)
    if stop is not None:
        stop()


def _profile(
    fixture: str, name: str, lab_dir: Path, haproxy: bool = False, secure: bool = False
) -> Iterator[lab.LabState]:
    state = lab.up(name, lab_dir, log=lambda _: None, haproxy=haproxy, secure=secure)

    def down() -> None:
        pgids = [p.pid for p in state.procs]
        lab.down(name, lab_dir, log=lambda _: None)
        left = {pgid: group_members(pgid) for pgid in pgids if group_members(pgid)}
        assert not left, f"lab {name} left processes behind: {left}"

    _STOPS[fixture] = down
    yield state
    _stop(fixture)


@pytest.fixture(scope="session")
def supercluster(lab_dir: Path) -> Iterator[lab.LabState]:
    yield from _profile("supercluster", "supercluster", lab_dir, haproxy=True)


@pytest.fixture(scope="session")
def spark_cluster(lab_dir: Path) -> Iterator[lab.LabState]:
    """The ``spark`` lab: a standalone master, two bare workers, a Spark Connect server on them."""
    yield from _profile("spark_cluster", "spark", lab_dir)


@pytest.fixture(scope="session")
def sites(lab_dir: Path) -> Iterator[lab.LabState]:
    yield from _profile("sites", "sites", lab_dir)


@pytest.fixture(scope="session")
def rabbit_dr(lab_dir: Path) -> Iterator[lab.LabState]:
    yield from _profile("rabbit_dr", "rabbit-dr", lab_dir)


@pytest.fixture(scope="session")
def rabbit_cluster(lab_dir: Path) -> Iterator[lab.LabState]:
    yield from _profile("rabbit_cluster", "rabbit-cluster", lab_dir, haproxy=True)


@pytest.fixture(scope="session")
def secure_supercluster(lab_dir: Path) -> Iterator[lab.LabState]:
    """The supercluster in operator mode with TLS everywhere, behind HAProxy and `ferry serve` (a
    lab root of its own: it runs beside the plain one)."""
    root = lab_dir / "secure"
    root.mkdir(mode=0o755, exist_ok=True)
    yield from _profile("secure_supercluster", "supercluster", root, haproxy=True, secure=True)


@pytest.fixture(scope="module")
def secure_rabbit_dr(lab_dir: Path) -> Iterator[lab.LabState]:
    """rabbit-dr with AMQP and the management API over TLS only, client certificates required (in
    the secure lab root: its topology.yaml holds both secure profiles when both run). Per module:
    left running, its idle nodes took enough CPU from the rest of the suite to fail a timing
    assertion (a relay's p99 delay over 2 s)."""
    root = lab_dir / "secure"
    root.mkdir(mode=0o755, exist_ok=True)
    yield from _profile("secure_rabbit_dr", "rabbit-dr", root, secure=True)


@pytest.fixture(scope="module")
def secure_sites(lab_dir: Path) -> Iterator[lab.LabState]:
    """The sites profile (nyc, sfo) in operator mode with TLS, in the secure lab root; per module."""
    root = lab_dir / "secure"
    root.mkdir(mode=0o755, exist_ok=True)
    yield from _profile("secure_sites", "sites", root, secure=True)


@pytest.fixture(scope="module")
def secure_rabbit_cluster(lab_dir: Path) -> Iterator[lab.LabState]:
    """rabbit-cluster over TLS only, behind HAProxy and `ferry serve`, in the secure lab root; per module."""
    root = lab_dir / "secure"
    root.mkdir(mode=0o755, exist_ok=True)
    yield from _profile("secure_rabbit_cluster", "rabbit-cluster", root, haproxy=True, secure=True)


LAB_FIXTURES = {"lab_dir", "supercluster", "sites", "rabbit_dr", "rabbit_cluster", "secure_supercluster"}
LAB_FIXTURES |= {"secure_rabbit_dr", "secure_sites", "secure_rabbit_cluster", "spark_cluster"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = []
    for item in items:
        needs = set(getattr(item, "fixturenames", ()))
        if needs & LAB_FIXTURES and not item.get_closest_marker("lab"):
            unmarked.append(f"{item.nodeid}: uses {', '.join(sorted(needs & LAB_FIXTURES))} without the lab mark")
        if "spark" in needs and not item.get_closest_marker("spark"):
            unmarked.append(f"{item.nodeid}: uses the spark fixture without the spark mark")
        for mark in ("connect", "cluster"):
            if item.get_closest_marker(mark):
                if not (item.get_closest_marker("spark") and item.get_closest_marker("lab")):
                    unmarked.append(f"{item.nodeid}: has the {mark} mark without the spark and lab marks")
                item.fixturenames.append({"connect": "spark_connect", "cluster": "spark_cluster"}[mark])  # EARLY_STOP
    if unmarked:
        raise pytest.UsageError("tests whose marks do not say what they need:\n" + "\n".join(unmarked))
    # stable: the relays' modules last, the one with most tests first (a worker of `-n 2 --dist
    # loadfile` gets whole modules in collection order: the two should end together)
    relays = Counter(_module(item) for item in items if "sites" in _fixtures(item))
    items.sort(key=lambda item: (_module(item) in relays, -relays[_module(item)]))


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def _fixtures(item: pytest.Item) -> set[str]:
    return set(getattr(item, "fixturenames", ()))


_PLACES = pytest.StashKey[tuple[dict[str, int], dict[str, int]]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Note each test's place in the collection and, for each fixture of EARLY_STOP, the place of
    the end of the module that holds its last user (a module's fixtures are down by then)."""
    items = session.items
    modules = [_module(item) for item in items]
    last = {name: i for i, item in enumerate(items) for name in _fixtures(item) & EARLY_STOP}
    for name, i in last.items():
        while i + 1 < len(items) and modules[i + 1] == modules[i]:
            i += 1
        last[name] = i
    session.config.stash[_PLACES] = ({item.nodeid: i for i, item in enumerate(items)}, last)


def _stop_passed(item: pytest.Item, after: bool) -> None:
    """Stop what no test from here on uses: the fixtures whose last user's module this test ends
    (`after` it ran) or is past. A worker of `-n 2 --dist loadfile` runs whole modules in collection
    order, so one whose modules skip that last user stops the fixture before its next test."""
    places, last = item.config.stash.get(_PLACES, ({}, {}))
    here = places.get(item.nodeid, -1)
    for name, i in last.items():
        if i < here or (after and i == here):
            _stop(name)


def pytest_runtest_setup(item: pytest.Item) -> None:
    _stop_passed(item, after=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    result = yield
    _stop_passed(item, after=True)
    return result


def profile_topology(state: lab.LabState) -> Topology:
    return load_topology(state.path / "topology.yaml")


@pytest.fixture(scope="session")
def spark():  # type: ignore[no-untyped-def]
    from ferry.spark.session import get_session

    session = get_session(master="local[*]", app_name="ferry tests")  # never the Connect server's
    yield session
    session.stop()


@pytest.fixture(scope="session")
def spark_connect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Spark Connect server on this machine (``local[2]``, the suite's own Python for its
    workers), started on first use: its sc:// URL."""
    import pyspark

    home = Path(pyspark.__file__).parent
    (port,) = free_ports(1)
    env = {**os.environ, "SPARK_HOME": str(home), "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    env.pop("FERRY_SPARK_REMOTE", None)
    log = tmp_path_factory.mktemp("connect") / "server.log"
    conf = {
        "spark.connect.grpc.binding.port": port,
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.python.worker.reuse": "true",
    }
    argv = [str(home / "bin" / "spark-submit"), "--master", "local[2]", "--driver-memory", "2g"]
    argv += [a for k, v in conf.items() for a in ("--conf", f"{k}={v}")]
    argv += ["--class", "org.apache.spark.sql.connect.service.SparkConnectServer", "spark-internal"]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def stop() -> None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    _STOPS["spark_connect"] = stop
    try:
        deadline = time.monotonic() + 90
        while not port_open(port):
            assert proc.poll() is None and time.monotonic() < deadline, (
                f"Spark Connect did not start: {log.read_text()[-2000:]}"
            )
            time.sleep(0.5)
        yield f"sc://127.0.0.1:{port}"
    finally:
        _stop("spark_connect")


@pytest.fixture
def spark_at(request: pytest.FixtureRequest) -> str:
    """Where a test of ``helpers.also_on_the_spark_lab`` runs its Spark jobs (its ``cluster`` cell
    has the mark that sends them to the spark lab)."""
    return str(request.param)


@pytest.fixture(autouse=True)
def _spark_jobs_on_the_lab(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests marked ``connect``: their ferry commands find the Connect server in the environment;
    marked ``cluster`` (which wins), the ``spark`` lab, as a user who sourced its spark.env would."""
    if request.node.get_closest_marker("cluster"):
        state = request.getfixturevalue("spark_cluster")
        monkeypatch.delenv("FERRY_SPARK_REMOTE", raising=False)
        monkeypatch.setenv("FERRY_SPARK_MASTER", state.spark["master"])
        monkeypatch.setenv("PYSPARK_PYTHON", state.spark["python"])
    elif request.node.get_closest_marker("connect"):
        monkeypatch.setenv("FERRY_SPARK_REMOTE", request.getfixturevalue("spark_connect"))
