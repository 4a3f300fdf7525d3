"""`--spark-master spark://…`: ferry's jobs on the ``spark`` lab's standalone cluster, whose two
workers run a Python that has pyspark's dependencies and nothing of ferry's."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import pytest

from ferry import lab
from ferry.lab import spark as lab_spark
from ferry.lab.spark import worker_python
from tests.conftest import profile_topology
from tests.helpers import FERRY, ferry, ferry_killed_when, fill_stream, make_stream, read_stream, stream_count

pytestmark = [pytest.mark.lab, pytest.mark.spark, pytest.mark.cluster]


def events(stderr: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def test_a_copy_runs_on_workers_that_never_saw_ferry(supercluster: lab.LabState, spark_cluster: lab.LabState) -> None:
    bare = spark_cluster.spark["python"]
    assert subprocess.run([bare, "-c", "import ferry"], capture_output=True).returncode == 1
    assert subprocess.run([bare, "-c", "import pyarrow, pandas"], capture_output=True).returncode == 0
    topo = profile_topology(supercluster)
    asyncio.run(make_stream(topo, "east", "SASRC", ["sasrc.>"], placement="east"))
    asyncio.run(fill_stream(topo, "east", 2000, subject=lambda i: f"sasrc.{i % 3}", payload=lambda i: b"s%d" % i))
    asyncio.run(make_stream(topo, "west", "SADST", ["sa.sasrc.>"], placement="west"))
    args = ["jetstream://east/SASRC", "jetstream://west/SADST", "--subject-prefix", "sa.", "--partitions", "2"]
    result = ferry("copy", *args, "--json", topology=supercluster.path / "topology.yaml", check=True)
    assert json.loads(result.stdout)["stored"] == 2000
    rows = asyncio.run(read_stream(topo, "west", "SADST"))
    assert sorted(r["payload"] for r in rows) == sorted(b"s%d" % i for i in range(2000))
    (spark,) = [e for e in events(result.stderr) if e["event"] == "spark"]
    assert spark["master"] == spark_cluster.spark["master"] and spark["app_id"].startswith("app-"), spark
    assert spark["app_name"] == "ferry copy jetstream://east/SASRC -> jetstream://west/SADST"
    shipped = spark["shipped"]
    assert shipped["zip"].endswith(".zip") and shipped["bytes"] > 1_000_000, shipped
    assert [e["executable"] for e in shipped["executors"]] == [bare], shipped  # the bare Python ran ferry's tasks
    status = json.loads(
        ferry("lab", "status", "--json", topology=supercluster.path / "topology.yaml", check=True).stdout
    )
    workers = {r["server"]: r for r in status if r["profile"] == "spark" and r["server"].startswith("spark-worker")}
    assert sorted(workers) == ["spark-worker-1", "spark-worker-2"], status
    assert all(r["health"] == "ok" and isinstance(r["executors"], list) for r in workers.values()), workers


def test_an_executor_whose_python_lacks_pyarrow_is_one_line_naming_its_host(
    supercluster: lab.LabState, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    asyncio.run(make_stream(profile_topology(supercluster), "east", "SANOARROW", ["sanoarrow.>"], placement="east"))
    python = str(worker_python(("numpy",)))  # a Python with numpy only
    monkeypatch.setenv("PYSPARK_PYTHON", python)
    out, topology = tmp_path / "out", supercluster.path / "topology.yaml"
    result = ferry("copy", "jetstream://east/SANOARROW", f"parquet://{out}", topology=topology)
    assert result.returncode == 2, result.stderr  # a setting to change
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith(
        f"error: Spark executor on {socket.gethostname()} cannot run ferry's tasks: its Python {python} lacks pyarrow"
    ), result.stderr
    assert not out.exists()


@pytest.mark.faults  # with the Python without pyarrow in `make test`
def test_an_executor_python_that_does_not_exist_is_one_line(
    supercluster: lab.LabState, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    asyncio.run(make_stream(profile_topology(supercluster), "east", "SANOPY", ["sanopy.>"], placement="east"))
    monkeypatch.setenv("PYSPARK_PYTHON", "/nonexistent/python3")
    topology = supercluster.path / "topology.yaml"
    result = ferry("copy", "jetstream://east/SANOPY", f"parquet://{tmp_path / 'out'}", topology=topology)
    assert result.returncode == 2
    assert "error: Spark executor on 127.0.0.1 cannot start /nonexistent/python3" in result.stderr.splitlines()[-1]


def test_a_copy_through_the_labs_spark_connect_server(
    supercluster: lab.LabState, spark_cluster: lab.LabState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--spark-remote to the lab's Connect server, whose executors are the bare workers: ferry goes
    to them as a session artifact."""
    monkeypatch.delenv("FERRY_SPARK_MASTER")
    topo = profile_topology(supercluster)
    asyncio.run(make_stream(topo, "east", "SACON", ["sacon.>"], placement="east"))
    asyncio.run(fill_stream(topo, "east", 1000, subject=lambda i: f"sacon.{i % 3}", payload=lambda i: b"c%d" % i))
    asyncio.run(make_stream(topo, "west", "SACOND", ["c.sacon.>"], placement="west"))
    remote = spark_cluster.spark["connect"]
    args = ["jetstream://east/SACON", "jetstream://west/SACOND", "--subject-prefix", "c.", "--spark-remote", remote]
    result = ferry("copy", *args, "--json", topology=supercluster.path / "topology.yaml", check=True)
    assert json.loads(result.stdout)["stored"] == 1000
    rows = asyncio.run(read_stream(topo, "west", "SACOND"))
    assert sorted(r["payload"] for r in rows) == sorted(b"c%d" % i for i in range(1000))
    (spark,) = [e for e in events(result.stderr) if e["event"] == "spark"]
    assert spark["remote"] == remote and spark["shipped"]["executors"][0]["executable"] == spark_cluster.spark["python"]


@pytest.mark.faults  # with the copy on the cluster in `make test`
def test_a_worker_killed_during_a_copy_leaves_every_message_once(
    supercluster: lab.LabState, spark_cluster: lab.LabState
) -> None:
    """SIGKILL of a worker (its JVM, its executor, their Python workers) mid-copy: Spark runs the
    lost tasks again on the other worker, and JetStream's de-duplication keeps each message once."""
    topo = profile_topology(supercluster)
    n = 30_000
    asyncio.run(make_stream(topo, "east", "SAKILL", ["sakill.>"], placement="east"))
    asyncio.run(fill_stream(topo, "east", n, subject=lambda i: f"sakill.{i % 3}", payload=lambda i: b"k%d" % i))
    asyncio.run(make_stream(topo, "west", "SAKILLD", ["k.sakill.>"], placement="west"))
    args = ["jetstream://east/SAKILL", "jetstream://west/SAKILLD", "--subject-prefix", "k.", "--partitions", "2"]
    proc = subprocess.Popen(
        [*FERRY, "copy", *args, "--rate", "3000", "--json"],
        env={**os.environ, "FERRY_TOPOLOGY": str(supercluster.path / "topology.yaml")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while stream_count(topo, "west", "SAKILLD") < 3000:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        (worker, *_) = lab_spark.workers_running(spark_cluster.spark, "ferry copy")
        spark_cluster.proc(worker).kill()  # the worker of the copy's executor (the other may be the Connect server's)
        lab.up("spark", spark_cluster.path.parent, log=lambda _: None)  # back, empty: the lost tasks run again
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    report = json.loads(stdout)
    rows = asyncio.run(read_stream(topo, "west", "SAKILLD"))
    payloads = [r["payload"] for r in rows]
    assert len(payloads) == n and set(payloads) == {b"k%d" % i for i in range(n)}  # each once, none missing
    assert report["stored"] + report["duplicates"] >= n, report  # the lost task's messages, written again


@pytest.mark.faults  # with the copy on the cluster in `make test`
def test_a_prepared_environment_goes_to_the_executors_instead_of_the_zip(
    supercluster: lab.LabState, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--spark-archive: a packed environment with ferry in it (here a venv that reaches this one's
    packages) unpacks on each executor as ./ferry_env, whose bin/python runs the tasks."""
    env = tmp_path / "env"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", env], check=True)
    site = subprocess.run(
        [env / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    paths = [sysconfig.get_path("purelib"), str(Path(lab_spark.__file__).parents[2])]  # + ferry's source
    (Path(site) / "ferry-env.pth").write_text("\n".join(paths) + "\n")
    archive = tmp_path / "ferry-env.tar.gz"
    subprocess.run(["tar", "czf", archive, "-C", env, "."], check=True)
    monkeypatch.delenv("PYSPARK_PYTHON")  # ferry's default with an archive: ./ferry_env/bin/python
    asyncio.run(make_stream(profile_topology(supercluster), "east", "SAENV", ["saenv.>"], placement="east"))
    asyncio.run(fill_stream(profile_topology(supercluster), "east", 500, lambda i: f"saenv.{i}", lambda i: b"e%d" % i))
    out = tmp_path / "out"
    result = ferry(
        "copy",
        "jetstream://east/SAENV",
        f"parquet://{out}",
        "--spark-archive",
        str(archive),
        "--json",
        topology=supercluster.path / "topology.yaml",
        check=True,
    )
    assert json.loads(result.stdout)["stored"] == 500
    (spark,) = [e for e in events(result.stderr) if e["event"] == "spark"]
    assert "zip" not in spark["shipped"], spark  # nothing zipped: the environment brought ferry
    assert all(e["executable"].endswith("/ferry_env/bin/python") for e in spark["shipped"]["executors"]), spark


@pytest.mark.faults  # with the copy on the cluster in `make test`
def test_a_worker_killed_during_an_audit_changes_no_count(spark_cluster: lab.LabState, tmp_path: Path) -> None:
    """bench.audit's data (1,000,000 ledger rows; 250 each lost, duplicated, corrupted and
    unexpected): the worker running the audit's executor SIGKILLed once the job runs; Spark runs
    its tasks again and the audit's counts are exact. An audit of Parquet files runs no Python on
    the executors: nothing is shipped to them."""
    from bench.audit import generate

    n = 1_000_000
    generate(tmp_path, n)
    (tmp_path / "tier").mkdir()
    (tmp_path / "tier.parquet").rename(tmp_path / "tier" / "part-0.parquet")
    args = ["audit", "--ledger", str(tmp_path / "ledger"), "--tier", f"t={tmp_path / 'tier'}"]
    args += ["--html", str(tmp_path / "audit.html"), "--max-lost", str(n), "--max-dup", str(n), "--json"]
    proc = subprocess.Popen([*FERRY, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:  # the audit's executor has started (its task has work for seconds yet)
            busy = lab_spark.workers_running(spark_cluster.spark, "ferry audit")
            if busy:
                break
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        time.sleep(3)  # into its first stage
        spark_cluster.proc(busy[0]).kill()
        lab.up("spark", spark_cluster.path.parent, log=lambda _: None)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    (spark,) = [e for e in events(stderr) if e["event"] == "spark"]
    assert spark["app_id"].startswith("app-") and "shipped" not in spark, spark
    t = json.loads(stdout)["tiers"]["t"]
    k = n // 4000
    assert (t["lost"], t["extra_copies"], t["corrupted"], t["unexpected"]) == (k, k, k, k), t


@pytest.mark.faults  # with the copy on the cluster in `make test`
def test_ctrl_c_stops_the_application_on_the_cluster(supercluster: lab.LabState, spark_cluster: lab.LabState) -> None:
    topo = profile_topology(supercluster)
    asyncio.run(make_stream(topo, "east", "SAINT", ["saint.>"], placement="east"))
    asyncio.run(fill_stream(topo, "east", 20_000, subject=lambda i: f"saint.{i % 3}", payload=lambda i: b"i%d" % i))
    asyncio.run(make_stream(topo, "west", "SAINTD", ["i.saint.>"], placement="west"))
    code, stderr = ferry_killed_when(
        lambda: stream_count(topo, "west", "SAINTD") >= 1000,
        *("copy", "jetstream://east/SAINT", "jetstream://west/SAINTD", "--subject-prefix", "i.", "--rate", "1000"),
        topology=supercluster.path / "topology.yaml",
        sig=signal.SIGINT,
    )
    assert code == 130 and stderr.strip().splitlines()[-1] == "interrupted", stderr
    deadline = time.monotonic() + 30  # the master ends the application and takes its executors back
    while lab_spark.workers_running(spark_cluster.spark, "ferry copy"):
        assert time.monotonic() < deadline, lab_spark.executors(spark_cluster.spark)
        time.sleep(0.5)
    stopped = stream_count(topo, "west", "SAINTD")
    time.sleep(3)  # at 1,000 msg/s a task still running would add about 3,000
    assert stream_count(topo, "west", "SAINTD") == stopped < 20_000
