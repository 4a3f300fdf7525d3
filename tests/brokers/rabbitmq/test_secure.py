"""ferry on RabbitMQ over TLS: the secure rabbit-dr lab (AMQP and the management API on TLS
ports only, client certificates required, the lab's own CA). Queues are copied between clusters
and from a secure JetStream stream, and failed back with either engine, counted by id; bad TLS
settings get one line and change nothing; no secret reaches any output."""

from __future__ import annotations

import asyncio
import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from ferry import lab
from ferry.brokers.rabbitmq.client import Management, amqp_connect
from ferry.brokers.rabbitmq.wire import raw_connect
from ferry.lab.scenarios import dr_federation
from ferry.topology import load_topology
from tests import helpers
from tests.helpers import (
    acked_ids,
    foreign_client,
    make_queues,
    make_stream,
    other_ca,
    queue_messages,
    read_stream,
)

pytestmark = pytest.mark.lab

OUTPUTS: list[str] = []  # every CLI output of this module, searched for secrets at the end
CMDLINES: set[str] = set()  # every process's command line while one ran (Spark's JVM and workers too)


ferry = functools.partial(helpers.ferry, record=OUTPUTS, watch=CMDLINES)


def held_ids(topology: Path, cluster: str, queue: str) -> list[str]:
    return [r["msg_id"] for r in asyncio.run(queue_messages(load_topology(topology), cluster, "/", queue))]


def load(topology: Path, cluster: str, queue: str, ledger: Path, count: int) -> set[str]:
    r = ferry("load", f"rabbitmq://{cluster}/%2F", "--subject", queue, "--subjects", "1", "--count", str(count),
              "--ledger", str(ledger), topology=topology)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return acked_ids(ledger)


def test_the_secure_rabbitmq_lab_is_tls_only_and_checks_clean(secure_rabbit_dr: lab.LabState) -> None:
    topology = secure_rabbit_dr.path / "topology.yaml"
    clusters = {n: c for s in yaml.safe_load(topology.read_text())["sites"].values() for n, c in s["clusters"].items()}
    assert set(clusters) == {"art", "pc1", "ltm"}
    for c in clusters.values():
        assert set(c["tls"]) == {"ca_file", "cert_file", "key_file"}, c
        assert all(b["url"].startswith("amqps://") and b["management_url"].startswith("https://") for b in c["brokers"])
        assert all(b["mqtt_url"].startswith("mqtts://") for b in c["brokers"])  # no plaintext port left open
    r = ferry("topology", "check", str(topology), "--json", topology=topology)
    assert r.returncode == 0, r.stderr
    probes = json.loads(r.stdout)["probes"]
    assert len(probes) == 3 * 3 and all(p["ok"] for p in probes), probes  # AMQP, the management API, MQTT
    assert all(p["tls"]["version"] == "TLSv1.3" and p["tls"]["subject"] == "CN=127.0.0.1" for p in probes), probes
    assert all(p["identity"] == "user ferry (tags administrator)" for p in probes if p["endpoint"] == "management")
    assert [n for n, c in clusters.items() if c.get("x509_login")] == ["pc1", "ltm"]  # art keeps its password


def test_a_cluster_with_x509_login_is_logged_into_with_the_client_certificate(secure_rabbit_dr: lab.LabState) -> None:
    """ferry's AMQP clients (aio-pika's and its own raw one) log into pc1 with SASL EXTERNAL, as the
    user its certificate names; into art (no x509_login) with the password."""
    topo = load_topology(secure_rabbit_dr.path / "topology.yaml")

    async def logins(cluster: str) -> set[tuple[str, str]]:
        conns = [
            await amqp_connect(topo.rabbitmq(cluster), name="x509-check"),
            await raw_connect(topo.rabbitmq(cluster), "/"),
        ]
        try:
            async with Management(topo.rabbitmq(cluster)) as m:
                for _ in range(50):  # the management API lists a connection within a few seconds
                    rows = [c for c in await m.get("/connections") if c.get("peer_port") and c["user"] == "ferry"]
                    if len(rows) >= 2:
                        return {(c["auth_mechanism"], c["user"]) for c in rows}
                    await asyncio.sleep(0.2)
                raise AssertionError(f"{cluster}: ferry's connections not listed")
        finally:
            for c in conns:
                await c.close()

    assert asyncio.run(logins("pc1")) == {("EXTERNAL", "ferry")}
    assert asyncio.run(logins("art")) == {("PLAIN", "ferry")}


@pytest.mark.spark
@pytest.mark.connect
def test_queues_copied_between_clusters_over_tls_arrive_once(secure_rabbit_dr: lab.LabState, tmp_path: Path) -> None:
    """The queue mover's raw AMQP client (Spark's executors) and the control plane's over amqps."""
    topology = secure_rabbit_dr.path / "topology.yaml"
    queues = {"tls-quorum": True, "tls-classic": False}
    quorum = {q for q, yes in queues.items() if yes}
    asyncio.run(make_queues(load_topology(topology), "pc1", "/", list(queues), quorum))
    acked = {q: load(topology, "pc1", q, tmp_path / q, 2000) for q in queues}
    r = ferry("copy", "rabbitmq://pc1/%2F/tls-*", "rabbitmq://ltm/%2F", "--create", "--json", topology=topology)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["stored"] == 4000
    for q in queues:
        held = held_ids(topology, "ltm", q)
        assert len(held) == len(set(held)) == 2000 and set(held) == acked[q], q
        assert sorted(held_ids(topology, "pc1", q)) == sorted(held), q  # read and requeued: kept


@pytest.mark.spark
@pytest.mark.connect  # four ferry commands: their Spark jobs on the suite's Connect server, not a JVM each
def test_a_stream_goes_into_a_queue_and_a_snapshot_over_tls(
    secure_supercluster: lab.LabState, secure_rabbit_dr: lab.LabState, tmp_path: Path
) -> None:
    """JetStream (operator mode, TLS) into RabbitMQ (TLS), the queue into Parquet (a snapshot, which
    leaves it as it was) and into JetStream again: the RabbitMQ side of every copy over TLS, each
    counted by id (JetStream to Parquet over TLS: test_secure.py of NATS; Parquet into a queue
    touches no broker's TLS but the queue's)."""
    import pyarrow.parquet as pq

    topology = secure_rabbit_dr.path.parent / "topology.yaml"  # both secure profiles
    topo = load_topology(topology)
    asyncio.run(make_stream(topo, "east", "SECURE_TO_Q", ["secure_to_q.>"], placement="east"))
    asyncio.run(make_queues(topo, "ltm", "/", ["from-js"], set()))
    r = ferry("load", "jetstream://east", "--subject", "secure_to_q.{n}", "--count", "3000", "--ledger",
              str(tmp_path / "ledger"), topology=topology)  # fmt: skip
    assert r.returncode == 0, r.stderr
    sent = acked_ids(tmp_path / "ledger")
    r = ferry("copy", "jetstream://east/SECURE_TO_Q", "rabbitmq://ltm/%2F/from-js", "--json", topology=topology)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["stored"] == 3000
    snap = ferry("snapshot", "rabbitmq://ltm/%2F/from-js", "--out", str(tmp_path / "snap"), topology=topology)
    assert snap.returncode == 0, snap.stderr[-2000:]
    snapped = pq.read_table(tmp_path / "snap", columns=["msg_id"])["msg_id"].to_pylist()
    assert len(snapped) == len(set(snapped)) == 3000 and set(snapped) == sent
    asyncio.run(make_stream(topo, "east", "SECURE_FROM_Q", ["from_q.>"], placement="east"))
    r = ferry("copy", "rabbitmq://ltm/%2F/from-js", "jetstream://east/SECURE_FROM_Q", "--subject-prefix", "from_q.",
              "--json", topology=topology)  # fmt: skip
    assert r.returncode == 0 and json.loads(r.stdout)["stored"] == 3000, r.stderr[-2000:]
    from_q = [r["msg_id"] for r in asyncio.run(read_stream(topo, "east", "SECURE_FROM_Q"))]
    assert len(from_q) == len(set(from_q)) == 3000 and set(from_q) == sent


BAD = {
    "another CA": (lambda c, d: c["tls"].update(ca_file=other_ca(d)), "TLS: certificate verify failed: "),
    "a CA file that is not there": (  # said with the node that needed it, before anything is dialled
        lambda c, d: c["tls"].update(ca_file=str(d / "nope.pem")),
        "error: pc1: tls.ca_file {d}/nope.pem does not exist",
    ),
    "a password file that is not there": (
        lambda c, d: c["credentials"].update(password_file=str(d / "nope")),
        "error: pc1: credentials: password file {d}/nope does not exist",
    ),
    "amqp:// to a TLS port": (  # (x509_login off: with it, the topology itself is refused first)
        lambda c, d: [
            c.pop("x509_login", None),
            *(b.update(url=b["url"].replace("amqps://", "amqp://")) for b in c["brokers"]),
        ],
        "hung up before greeting ferry (a TLS port? then amqps://)",
    ),
    "http:// to a TLS port": (
        lambda c, d: [b.update(management_url=b["management_url"].replace("https:", "http:")) for b in c["brokers"]],
        "a TLS port? then https://)",
    ),
    "a client certificate the broker rejects": (
        lambda c, d: c["tls"].update(foreign_client(d)),
        "client certificate",  # another CA's: the broker's alert, or the reset that overtook it
    ),
    "no client certificate": (
        lambda c, d: [c["tls"].pop("cert_file"), c["tls"].pop("key_file")],
        "client certificate",  # the broker's alert, or the reset that overtook it: both say so
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_tls_settings_get_one_line_and_change_nothing(
    secure_rabbit_dr: lab.LabState, tmp_path: Path, case: str
) -> None:
    change, expected = BAD[case]
    good = secure_rabbit_dr.path / "topology.yaml"
    asyncio.run(make_queues(load_topology(good), "pc1", "/", ["tls-bad"], set()))  # the copy gets as far as AMQP
    doc = yaml.safe_load(good.read_text())
    for site in doc["sites"].values():
        for name, cluster in list(site["clusters"].items()):
            site["clusters"][name] = variant = copy.deepcopy(cluster)
            change(variant, tmp_path)
    topology = tmp_path / "topology.yaml"
    topology.write_text(yaml.safe_dump(doc))
    r = ferry("copy", "rabbitmq://pc1/%2F/tls-bad", "rabbitmq://ltm/%2F/tls-bad-copy", "--create", topology=topology)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]
    assert expected.format(d=tmp_path) in r.stderr, r.stderr

    async def absent() -> Any:
        async with Management(load_topology(good).rabbitmq("ltm")) as m:
            return await m.get("/queues/%2F/tls-bad-copy", ok404=True)

    assert asyncio.run(absent()) is None


@pytest.mark.spark
@pytest.mark.connect
def test_a_brokers_own_tls_settings_override_its_clusters(secure_rabbit_dr: lab.LabState, tmp_path: Path) -> None:
    """Every cluster's tls names another CA (refused above) and each broker's own tls the lab's:
    the management API, aio-pika and the queue mover's raw client dial each node with its own."""
    good = secure_rabbit_dr.path / "topology.yaml"
    asyncio.run(make_queues(load_topology(good), "pc1", "/", ["tls-own"], set()))
    sent = load(good, "pc1", "tls-own", tmp_path / "ledger", 1000)
    doc = yaml.safe_load(good.read_text())
    for site in doc["sites"].values():
        for cluster in site["clusters"].values():
            lab_ca = cluster["tls"]["ca_file"]
            cluster["tls"]["ca_file"] = other_ca(tmp_path)
            for b in cluster["brokers"]:
                b["tls"] = {"ca_file": lab_ca}
    topology = tmp_path / "topology.yaml"
    topology.write_text(yaml.safe_dump(doc))
    r = ferry(
        "copy", "rabbitmq://pc1/%2F/tls-own", "rabbitmq://ltm/%2F/tls-own", "--create", "--json", topology=topology
    )
    assert r.returncode == 0 and json.loads(r.stdout)["stored"] == 1000, r.stderr[-2000:]
    held = held_ids(good, "ltm", "tls-own")
    assert len(held) == len(set(held)) == 1000 and set(held) == sent


async def _upstream(topo: Any, cluster: str) -> Any:
    async with Management(topo.rabbitmq(cluster), name=cluster) as m:
        return await m.get("/parameters/federation-upstream/%2F/art")


@pytest.mark.spark
@pytest.mark.connect
@pytest.mark.parametrize("engine", ["shovel", "spark"])
def test_a_failback_over_tls_brings_every_orphan_home_once(
    secure_rabbit_dr: lab.LabState, tmp_path: Path, engine: str
) -> None:
    """Federation links and the fail-back's shovels dial TLS-only brokers with the files of each
    cluster's ``outbound_tls``; the upstreams come back byte-identical, TLS parameters included."""
    topology = secure_rabbit_dr.path / "topology.yaml"
    topo = load_topology(topology)
    queues = [f"tls{engine}-{i}" for i in range(2)]  # classic, quorum
    asyncio.run(dr_federation(topo, ["/"], queues, plain=0, prefix=f"tls{engine}-", upstream_messages=20))
    upstream = asyncio.run(_upstream(topo, "ltm"))
    uri = upstream["value"]["uri"]
    assert uri.startswith("amqps://") and "verify=verify_peer" in uri and "cacertfile=/" in uri and "keyfile=/" in uri
    assert "server_name_indication=localhost" in uri  # the name on the lab's certificate, checked as a DNS name
    sent = {}
    for queue in queues:
        sent[queue] = load(topology, "ltm", queue, tmp_path / queue, 600)

    if engine == "shovel":  # without outbound_tls the shovels could not verify pc1: refused, nothing changed
        doc = yaml.safe_load(topology.read_text())
        del doc["sites"]["ltm"]["clusters"]["ltm"]["outbound_tls"]
        bare = tmp_path / "topology.yaml"
        bare.write_text(yaml.safe_dump(doc))
        r = ferry("failback", "--from", "ltm", "--to", "pc1", "--engine", "shovel", topology=bare)
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "give cluster 'ltm' an outbound_tls block" in r.stderr, r.stderr
        assert asyncio.run(_upstream(topo, "ltm")) == upstream
        assert all(sorted(held_ids(topology, "ltm", q)) == sorted(sent[q]) for q in queues)

    args = ("failback", "--from", "ltm", "--to", "pc1", "--engine", engine, "--json")
    r = ferry(*args, topology=topology)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["outcome"] == "complete" and report["possible_duplicates"] == 0, report
    assert report["upstream_pulled"] == 0 and all(u["identical"] for u in report["upstreams_restored"]), report
    assert [(u["before"], u["after"]) for u in report["upstream_queues"]] == [(20, 20)] * 2, report
    assert asyncio.run(_upstream(topo, "ltm"))["value"] == upstream["value"]  # TLS parameters and all
    for queue in queues:
        home = held_ids(topology, "pc1", queue)
        assert len(home) == len(set(home)) == 600 and set(home) == sent[queue], queue
        assert held_ids(topology, "ltm", queue) == []


def test_no_secret_reaches_any_output(secure_rabbit_dr: lab.LabState) -> None:
    """The RabbitMQ password and the client's private key: in none of this module's outputs, nor in
    any process's command line while its commands ran (copies, fail-backs; the shovels' URIs carry
    the password to RabbitMQ, which keeps it in its own definitions, as the federation upstreams')."""
    secrets = [(secure_rabbit_dr.path / "secrets" / "rabbitmq").read_text().strip()]
    key = (secure_rabbit_dr.path / "tls" / "client-key.pem").read_text()
    secrets += [line for line in key.splitlines() if not line.startswith("-----")][:3]
    assert all(secrets) and len(OUTPUTS) > 10 and any("failback" in c for c in CMDLINES)
    leaked = [s[:6] for s in secrets if any(s in o for o in [*OUTPUTS, *CMDLINES])]
    assert not leaked, f"secrets starting with {leaked} reached an output"
