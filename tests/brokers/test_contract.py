"""The broker adapter contract, run against each real broker kind (NATS on the supercluster lab,
RabbitMQ on the rabbit-dr lab): what every kind declares, how it probes, how its errors read, and
that a message written through its data path reads back the same in the common schema."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from ferry import brokers, lab
from ferry.brokers import nats as bnats
from ferry.brokers.nats import reader as nats_reader
from ferry.brokers.nats import writer as nats_writer
from ferry.brokers.rabbitmq import Management, amqp_connect, queue_io
from ferry.brokers.rabbitmq import probe as rabbit_probe
from ferry.errors import AuthError, BrokerUnavailable
from ferry.schema import ARROW_SCHEMA, BatchBuilder
from ferry.topology import Topology, load_topology
from tests.conftest import profile_topology
from tests.helpers import make_stream

KindLab = tuple[Topology, str, lab.LabState]
KINDS = {"nats": ("supercluster", "east"), "rabbitmq": ("rabbit_dr", "pc1")}


@pytest.fixture
def kind_lab(kind: str, request: pytest.FixtureRequest) -> KindLab:
    """The kind's lab, started here (a plain fixture) and not from inside a test's event loop."""
    fixture, cluster = KINDS[kind]
    state = request.getfixturevalue(fixture)
    return profile_topology(state), cluster, state


def with_password(state: lab.LabState, tmp_path: Path, password: str) -> Topology:
    """The lab's topology with every credential's password file holding `password`."""
    wrong = tmp_path / "wrong-password"
    wrong.write_text(password)
    text = (state.path / "topology.yaml").read_text()
    for line in text.splitlines():
        if "password_file:" in line:
            text = text.replace(line.split("password_file:")[1].split("}")[0].strip(), str(wrong))
    path = tmp_path / "topology.yaml"
    path.write_text(text)
    return load_topology(path)


def test_every_kind_declares_what_it_can_do_and_what_is_worth_retrying() -> None:
    assert set(brokers.KINDS) == {"nats", "rabbitmq"} and brokers.kind("jetstream") is brokers.KINDS["nats"]
    for name, k in brokers.KINDS.items():
        assert k.kind == name
        # a source is either read again (exactly-once copies) or consumed (one mover per queue)
        assert ("replay" in k.capabilities) != ("destructive-read" in k.capabilities), k.capabilities
        assert BrokerUnavailable in k.retryable
    assert brokers.transient(BrokerUnavailable("x")) and not brokers.transient(AuthError("x"))
    assert brokers.translate(ValueError("not a broker's")) is None
    from nats.js.errors import ServiceUnavailableError

    unavailable = brokers.translate(ServiceUnavailableError())  # a 503 says nothing of itself
    assert isinstance(unavailable, BrokerUnavailable) and "503: no responders" in str(unavailable)


@pytest.mark.lab
@pytest.mark.parametrize("kind", KINDS)
async def test_a_probe_answers_for_every_endpoint(kind: str, kind_lab: KindLab) -> None:
    topo, cluster, _ = kind_lab
    probe = brokers.KINDS[kind]
    probes = await (bnats.probe if kind == "nats" else rabbit_probe)(cluster, topo.cluster(cluster))
    assert probes and all(p.ok for p in probes), [(p.endpoint, p.detail) for p in probes if not p.ok]
    endpoints = {p.endpoint for p in probes}
    assert {"client", "mqtt"} <= endpoints and (
        {"monitor", "system"} if kind == "nats" else {"management"}
    ) <= endpoints
    assert probe.kind == kind


@pytest.mark.lab
@pytest.mark.parametrize("kind", KINDS)
async def test_wrong_credentials_are_an_authorization_error_not_worth_retrying(
    kind: str, kind_lab: KindLab, tmp_path: Path
) -> None:
    _, cluster, state = kind_lab
    topo = with_password(state, tmp_path, "not-the-password")
    connect: Callable[[], Awaitable[Any]] = (
        (lambda: bnats.connect(topo.nats(cluster), name=cluster, timeout=3))
        if kind == "nats"
        else (lambda: amqp_connect(topo.rabbitmq(cluster), timeout=3))
    )
    with pytest.raises(AuthError) as refused:
        await connect()
    assert not brokers.transient(refused.value)
    assert "not-the-password" not in str(refused.value)
    probes = await (bnats.probe if kind == "nats" else rabbit_probe)(cluster, topo.cluster(cluster))
    client = next(p for p in probes if p.endpoint == "client")
    assert not client.ok and ("authorization" in client.detail.lower() or "refused" in client.detail.lower())


@pytest.mark.lab
@pytest.mark.parametrize("kind", KINDS)
async def test_a_broker_that_does_not_answer_is_unavailable_and_worth_retrying(kind: str, kind_lab: KindLab) -> None:
    topo, cluster, _ = kind_lab
    c = topo.cluster(cluster)
    dead = c.model_copy(
        update={"brokers": [b.model_copy(update={"url": b.url.rsplit(":", 1)[0] + ":9"}) for b in c.brokers[:1]]}
    )
    with pytest.raises(BrokerUnavailable) as gone:
        await (bnats.connect(dead, name=cluster, timeout=2) if kind == "nats" else amqp_connect(dead, timeout=2))
    assert brokers.transient(gone.value)


def _messages(n: int) -> pa.RecordBatch:
    b = BatchBuilder()
    for i in range(n):
        headers = {"Nats-Msg-Id": f"contract-{i}", "x-app": f"ü-{i}"}
        b.add(f"contract.{i % 3}", f"payload {i}".encode() + bytes([0, 255]), headers, f"contract-{i}", "test", i, None)
    return b.flush()


@pytest.mark.lab
@pytest.mark.parametrize("kind", KINDS)
async def test_what_is_written_reads_back_the_same_in_the_common_schema(kind: str, kind_lab: KindLab) -> None:
    topo, cluster, _ = kind_lab
    sent = _messages(50)
    got: list[pa.RecordBatch] = []
    if kind == "nats":
        stream = f"CONTRACT_{uuid.uuid4().hex[:6].upper()}"
        await make_stream(topo, cluster, stream, ["contract.>"], replicas=1, placement=cluster)
        cfg = nats_writer.WriteConfig(cluster=topo.nats(cluster).model_dump_json(), name=cluster, stream=stream)
        counts = await nats_writer.write_batches(cfg, [sent])
        read = nats_reader.ReadConfig(cluster=cfg.cluster, name=cluster, streams=(stream,))
        got = [b async for b in nats_reader.read_range(read, nats_reader.Range(stream, 1, 50))]
        async with bnats.session(topo.nats(cluster)) as nc:
            await nc.jsm().delete_stream(stream)
    else:
        queue = f"contract-{uuid.uuid4().hex[:6]}"
        async with Management(topo.rabbitmq(cluster)) as m:
            await m.put(f"/queues/%2F/{queue}", {"durable": True})
            cfg = queue_io.WriteConfig(cluster=topo.rabbitmq(cluster).model_dump_json(), queue=queue)
            counts = await queue_io.write_rows(cfg, [sent])
            got = [b async for b in queue_io.snapshot_queue(topo.rabbitmq(cluster), cluster, "/", queue)]
            await m.delete(f"/queues/%2F/{queue}")
    assert counts.rows == 50 and counts.stored == 50
    back = pa.Table.from_batches(got, schema=ARROW_SCHEMA).to_pylist()
    assert len(back) == 50
    for i, row in enumerate(back):
        headers = dict(row["headers"] or [])
        assert row["subject"] == f"contract.{i % 3}" or kind == "rabbitmq"  # a queue keeps the routing key
        assert row["payload"] == f"payload {i}".encode() + bytes([0, 255])
        assert headers["x-app"] == f"ü-{i}" and row["msg_id"] == f"contract-{i}"
