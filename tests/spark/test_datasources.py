"""The public Spark data sources, used as a Spark user would: `jetstream` (batch and streaming read
and write) and the `rabbitmq` sink, on real servers. ferry's own jobs read streams with
`stream_frame`, so these are the tests that keep the data sources honest."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

from ferry import lab
from ferry.brokers.nats.reader import ReadConfig
from ferry.errors import Unreadable
from ferry.spark.jetstream import stream_frame
from ferry.spark.session import spark_error
from ferry.topology import Credentials
from tests.conftest import profile_topology
from tests.helpers import fill_stream, make_queues, make_stream, queue_messages, read_stream, stream_count

pytestmark = [pytest.mark.lab, pytest.mark.spark]

N = 3_000


@pytest.fixture(scope="module")
def dsrc(supercluster: lab.LabState) -> str:
    topo = profile_topology(supercluster)
    asyncio.run(make_stream(topo, "east", "DSRC", ["dsrc.>"], placement="east"))
    asyncio.run(
        fill_stream(
            topo,
            "east",
            N,
            subject=lambda i: f"dsrc.{'ab'[i % 2]}",
            payload=lambda i: f"m{i}".encode(),
            headers=lambda i: {"i": str(i)},
        )
    )
    return "DSRC"


def _cluster(state: lab.LabState, name: str, kind: str = "nats") -> str:
    topo = profile_topology(state)
    return (topo.nats(name) if kind == "nats" else topo.rabbitmq(name)).model_dump_json()


def _rows(df: Any) -> list[tuple[str, bytes, int]]:
    return sorted(((r["subject"], bytes(r["payload"]), r["source_seq"]) for r in df.collect()), key=lambda r: r[2])


def test_batch_read_is_a_range_of_the_stream_and_batch_write_stores_it_once(
    supercluster: lab.LabState, dsrc: str, spark: Any
) -> None:
    topo = profile_topology(supercluster)
    east, west = _cluster(supercluster, "east"), _cluster(supercluster, "west")
    df = (
        spark.read.format("jetstream")
        .option("cluster", east)
        .option("cluster_name", "east")
        .option("stream", dsrc)
        .option("subject", "dsrc.a")
        .option("start_seq", "101")
        .option("end_seq", "2000")
        .load()
    )
    # sequence i + 1 holds message i: dsrc.a are the odd sequences
    expected = [("dsrc.a", f"m{s - 1}".encode(), s) for s in range(101, 2001, 2)]
    assert _rows(df) == expected
    cfg = ReadConfig(cluster=east, name="east", streams=(dsrc,), subject="dsrc.a", start_seq=101, end_seq=2000)
    assert _rows(stream_frame(spark, cfg)) == expected  # what ferry's own jobs read: the same

    asyncio.run(make_stream(topo, "west", "DDST", ["ddst.>"], placement="west"))
    write = (
        df.write.format("jetstream")
        .option("cluster", west)
        .option("cluster_name", "west")
        .option("stream", "DDST")
        .option("subject_prefix", "ddst.")
        .mode("append")
    )
    write.save()
    write.save()  # again: every message carries its Nats-Msg-Id, so nothing is stored twice
    stored = asyncio.run(read_stream(topo, "west", "DDST"))
    assert len(stored) == len(expected)
    got = sorted(
        ((r["subject"], r["payload"], int(dict(r["headers"])["Ferry-Source-Seq"])) for r in stored), key=lambda r: r[2]
    )
    assert got == [("ddst." + s, p, seq) for s, p, seq in expected]
    assert all(dict(r["headers"])["Ferry-Source"] == "east/DSRC" for r in stored)
    with pytest.raises(Exception, match="overwrite is not supported"):
        df.write.format("jetstream").option("cluster", west).option("stream", "DDST").mode("overwrite").save()


def test_streaming_read_and_write_carry_the_whole_stream_in_order(
    supercluster: lab.LabState, dsrc: str, spark: Any, tmp_path: Path
) -> None:
    topo = profile_topology(supercluster)
    asyncio.run(make_stream(topo, "west", "DSTREAM", ["dstream.>"], placement="west"))
    query = (
        spark.readStream.format("jetstream")
        .option("topology", str(supercluster.path / "topology.yaml"))  # clusters by name, as a user writes them
        .option("cluster", "east")
        .option("stream", dsrc)
        .option("starting", "earliest")
        .option("max_messages_per_batch", "1000")
        .load()
        .writeStream.format("jetstream")
        .option("topology", str(supercluster.path / "topology.yaml"))
        .option("cluster", "west")
        .option("stream", "DSTREAM")
        .option("subject_prefix", "dstream.")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(180), "the streaming query did not finish within 180 s"
    assert query.exception() is None
    assert len(query.recentProgress) >= 3  # at most 1,000 messages per micro-batch
    stored = asyncio.run(read_stream(topo, "west", "DSTREAM"))
    assert [int(dict(r["headers"])["Ferry-Source-Seq"]) for r in stored] == list(range(1, N + 1))
    assert [r["payload"] for r in stored] == [f"m{i}".encode() for i in range(N)]
    assert stream_count(topo, "east", dsrc) == N  # reading changed nothing


def test_rabbitmq_sink_publishes_with_confirms_and_refuses_unroutable_rows(
    supercluster: lab.LabState, rabbit_dr: lab.LabState, dsrc: str, spark: Any
) -> None:
    topo = profile_topology(rabbit_dr)
    asyncio.run(make_queues(topo, "ltm", "/", ["ds-sink"], quorum=set()))
    cfg = ReadConfig(cluster=_cluster(supercluster, "east"), name="east", streams=(dsrc,), end_seq=500)
    df = stream_frame(spark, cfg)
    ltm = _cluster(rabbit_dr, "ltm", "rabbitmq")
    df.write.format("rabbitmq").option("cluster", ltm).option("queue", "ds-sink").option("transfer_id", "t-42").mode(
        "append"
    ).save()
    held = asyncio.run(queue_messages(topo, "ltm", "/", "ds-sink"))
    assert sorted(r["payload"] for r in held) == sorted(f"m{i}".encode() for i in range(500))
    assert all(dict(r["headers"])["x-ferry-transfer"] == "t-42" for r in held)
    # through an exchange, each row's subject is its routing key: nothing is bound to dsrc.a
    with pytest.raises(Exception, match="unroutable"):
        df.write.format("rabbitmq").option("cluster", ltm).option("exchange", "amq.direct").mode("append").save()
    with pytest.raises(Exception, match="exactly one of the options 'queue' or 'exchange'"):
        df.write.format("rabbitmq").option("cluster", ltm).mode("append").save()


def test_a_credential_an_executor_cannot_read_names_its_host(
    supercluster: lab.LabState, dsrc: str, spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver plans with a password from an environment variable the executors were started
    without (set here, after Spark's JVM and workers began): the read fails in one line that names
    the variable and the executor's host, as on a cluster whose workers lack the topology's files."""
    east = profile_topology(supercluster).nats("east")
    monkeypatch.setenv("FERRY_T_LATE", east.credentials.password())  # type: ignore[union-attr]
    late = east.model_copy(update={"credentials": Credentials(user=east.credentials.user, password_env="FERRY_T_LATE")})  # type: ignore[union-attr]
    cfg = ReadConfig(cluster=late.model_dump_json(), name="east", streams=(dsrc,), end_seq=10)
    with pytest.raises(Exception) as info:
        stream_frame(spark, cfg).count()
    err = spark_error(info.value)
    assert isinstance(err, Unreadable), err
    assert str(err) == (  # the cluster and broker that needed it, and where the task ran
        "cluster 'east' (east-1): credentials: environment variable FERRY_T_LATE is not set "
        f"(on Spark executor host {socket.gethostname()})"
    )
