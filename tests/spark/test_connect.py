"""`--spark-remote`: the same copy through a real Spark Connect server."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import pytest

from ferry import lab
from ferry.lab.procs import free_ports
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
