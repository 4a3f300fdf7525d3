"""`--spark-remote`: the same copy through a real Spark Connect server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyspark
import pytest

from ferry import lab
from ferry.lab.procs import free_ports, port_open
from tests.conftest import profile_topology
from tests.helpers import ferry, ferry_killed_when, fill_stream, make_stream, read_stream, stream_count

pytestmark = [pytest.mark.lab, pytest.mark.spark]


def test_copy_through_spark_connect(supercluster: lab.LabState, spark_connect: str, tmp_path: Path) -> None:
    topo = profile_topology(supercluster)
    topology = supercluster.path / "topology.yaml"
    asyncio.run(make_stream(topo, "east", "SCSRC", ["scsrc.>"], placement="east"))
    asyncio.run(fill_stream(topo, "east", 3000, subject=lambda i: f"scsrc.{i % 3}", payload=lambda i: b"m%d" % i))
    asyncio.run(make_stream(topo, "west", "SCDST", ["sc.scsrc.>"], placement="west"))
    args = ["--spark-remote", spark_connect, "--json"]
    report = json.loads(
        ferry(
            "copy",
            "jetstream://east/SCSRC",
            "jetstream://west/SCDST",
            "--subject-prefix",
            "sc.",
            *args,
            topology=topology,
            check=True,
        ).stdout
    )
    assert report["stored"] == 3000
    rows = asyncio.run(read_stream(topo, "west", "SCDST"))
    assert [r["payload"] for r in rows] == [b"m%d" % i for i in range(3000)]
    report = json.loads(
        ferry(
            "copy", "jetstream://east/SCSRC", f"parquet://{tmp_path}/out", *args, topology=topology, check=True
        ).stdout
    )
    assert report["stored"] == 3000


def test_ctrl_c_stops_the_job_on_the_connect_server(supercluster: lab.LabState, spark_connect: str) -> None:
    """The job runs on the server: Ctrl-C must stop it there too, not only the client (the
    server would otherwise copy on, unwatched, until it finished)."""
    topo = profile_topology(supercluster)
    topology = supercluster.path / "topology.yaml"
    asyncio.run(make_stream(topo, "east", "SCINT", ["scint.>"], placement="east"))
    asyncio.run(fill_stream(topo, "east", 20_000, subject=lambda i: f"scint.{i % 3}", payload=lambda i: b"m%d" % i))
    asyncio.run(make_stream(topo, "west", "SCINTD", ["sc.scint.>"], placement="west"))
    args = ["copy", "jetstream://east/SCINT", "jetstream://west/SCINTD", "--subject-prefix", "sc.", "--rate", "1000"]
    started = time.monotonic()
    code, stderr = ferry_killed_when(
        lambda: stream_count(topo, "west", "SCINTD") >= 1000,
        *args,
        "--spark-remote",
        spark_connect,
        topology=topology,
        sig=signal.SIGINT,
    )
    assert code == 130 and stderr.strip().splitlines()[-1] == "interrupted", stderr
    assert time.monotonic() - started < 60, "Ctrl-C waited for the job"
    counts = [stream_count(topo, "west", "SCINTD")]
    deadline = time.monotonic() + 15  # the server stops its task (Python worker and all) in a few seconds
    while len(counts) < 3 or counts[-1] != counts[-3]:  # steady for a second
        assert time.monotonic() < deadline, f"the job goes on on the server: {counts}"
        time.sleep(0.5)
        counts.append(stream_count(topo, "west", "SCINTD"))
    time.sleep(4)  # at 1,000 msg/s a job still running would add about 4,000
    assert stream_count(topo, "west", "SCINTD") == counts[-1] < 20_000


def test_unreachable_connect_server_is_one_line(supercluster: lab.LabState) -> None:
    asyncio.run(make_stream(profile_topology(supercluster), "east", "SCEMPTY", ["scempty.>"], placement="east"))
    (port,) = free_ports(1)
    result = ferry(
        "copy",
        "jetstream://east/SCEMPTY",
        "parquet:///tmp/ferry-nope-connect",
        "--spark-remote",
        f"sc://127.0.0.1:{port}",
        topology=supercluster.path / "topology.yaml",
        timeout=60,
    )
    assert result.returncode != 0 and "is not reachable" in result.stderr
    assert len([ln for ln in result.stderr.splitlines() if ln.strip()]) == 1


@pytest.fixture(scope="module")
def standalone_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Spark standalone master and one worker on 127.0.0.1."""
    home = Path(pyspark.__file__).parent
    master_port, master_ui, worker_ui = free_ports(3)
    env = {
        **os.environ,
        "SPARK_HOME": str(home),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_WORKER_DIR": str(tmp_path_factory.mktemp("spark-work")),
    }
    log = tmp_path_factory.mktemp("standalone")
    url = f"spark://127.0.0.1:{master_port}"
    procs = [
        subprocess.Popen(
            [
                str(home / "bin" / "spark-class"),
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(master_port),
                "--webui-port",
                str(master_ui),
            ],
            env=env,
            stdout=(log / "master.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    ]
    deadline = time.monotonic() + 60
    while not port_open(master_port):
        assert time.monotonic() < deadline, (log / "master.log").read_text()[-2000:]
        time.sleep(0.5)
    procs.append(
        subprocess.Popen(
            [
                str(home / "bin" / "spark-class"),
                "org.apache.spark.deploy.worker.Worker",
                "--host",
                "127.0.0.1",
                "--cores",
                "2",
                "--memory",
                "2g",
                "--webui-port",
                str(worker_ui),
                url,
            ],
            env=env,
            stdout=(log / "worker.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    )
    while "Successfully registered with master" not in (log / "worker.log").read_text():
        assert time.monotonic() < deadline, (log / "worker.log").read_text()[-2000:]
        time.sleep(0.5)
    yield url
    for proc in procs:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def test_copy_on_a_standalone_spark_cluster(supercluster: lab.LabState, standalone_cluster: str) -> None:
    topo = profile_topology(supercluster)
    asyncio.run(make_stream(topo, "east", "SASRC", ["sasrc.>"], placement="east"))
    asyncio.run(fill_stream(topo, "east", 2000, subject=lambda i: f"sasrc.{i % 3}", payload=lambda i: b"s%d" % i))
    asyncio.run(make_stream(topo, "west", "SADST", ["sa.sasrc.>"], placement="west"))
    report = json.loads(
        ferry(
            "copy",
            "jetstream://east/SASRC",
            "jetstream://west/SADST",
            "--subject-prefix",
            "sa.",
            "--partitions",
            "2",
            "--spark-master",
            standalone_cluster,
            "--json",
            topology=supercluster.path / "topology.yaml",
            check=True,
        ).stdout
    )
    assert report["stored"] == 2000
    rows = asyncio.run(read_stream(topo, "west", "SADST"))
    assert sorted(r["payload"] for r in rows) == sorted(b"s%d" % i for i in range(2000))
