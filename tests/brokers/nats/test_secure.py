"""ferry on secured NATS: the secure lab (operator mode, .creds files, TLS on every port, client
certificates required; behind HAProxy) and single servers taking an nkey user and a token. Moves,
an evacuation, a repartition and copies, every message counted by id; bad settings get one line
and change nothing; no secret reaches any output."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import functools
import json
import os
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nkeys
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import trustme
import yaml

from ferry import lab
from ferry.brokers import nats as bnats
from ferry.lab.nats import nats_server_binary
from ferry.lab.procs import free_ports, port_open
from ferry.lab.secure import client_context
from ferry.topology import load_topology
from tests import helpers
from tests.helpers import (
    acked_ids,
    also_on_the_spark_lab,
    finish,
    foreign_client,
    judge,
    make_stream,
    other_ca,
    read_stream,
    start_load,
    stream_leader,
)

pytestmark = pytest.mark.lab

OUTPUTS: list[str] = []  # every CLI output of this module, searched for secrets at the end
CMDLINES: set[str] = set()  # every process's command line while one ran (Spark's JVM and workers too)
NODES = ("east-1", "east-2", "east-3")


ferry = functools.partial(helpers.ferry, record=OUTPUTS, watch=CMDLINES)


@pytest.fixture
def secure(secure_supercluster: lab.LabState) -> lab.LabState:
    return secure_supercluster


def held_ids(topology: Path, cluster: str, stream: str) -> list[str]:
    rows = asyncio.run(read_stream(load_topology(topology), cluster, stream))
    return [r["msg_id"] for r in rows]


def test_the_secure_lab_writes_a_production_topology_that_checks_clean(secure: lab.LabState) -> None:
    topology = secure.path / "topology.yaml"
    east = yaml.safe_load(topology.read_text())["sites"]["sc"]["clusters"]["east"]
    assert set(east["credentials"]) == {"creds_file"} and set(east["system_credentials"]) == {"creds_file"}
    assert set(east["tls"]) == {"ca_file", "cert_file", "key_file"}
    assert all(b["url"].startswith("tls://") and b["monitor_url"].startswith("https://") for b in east["brokers"])
    r = ferry("topology", "check", str(topology), "--json", topology=topology)
    assert r.returncode == 0, r.stderr
    assert set(east["mqtt_credentials"]) == {"token_file"} and all(
        b["mqtt_url"].startswith("mqtts://") for b in east["brokers"]
    )
    rows = json.loads(r.stdout)["probes"]
    assert len(rows) == 6 * 4 and all(p["ok"] for p in rows), rows  # client, system account, HTTPS monitor, MQTT
    # every endpoint over TLS with the lab's server certificate; who ferry is, as the servers say
    assert all(p["tls"]["version"] == "TLSv1.3" and p["tls"]["subject"] == "CN=127.0.0.1" for p in rows), rows
    accounts = {
        "client": "user ferry in account APP",
        "system": "user ferry in account SYS",
        "monitor": None,
        "mqtt": None,
    }
    assert all(p["identity"] == accounts[p["endpoint"]] for p in rows), rows


@pytest.mark.spark
def test_move_under_load_on_the_secure_lab_loses_nothing(secure: lab.LabState, tmp_path: Path, spark: Any) -> None:
    """The capture guard, the journal and the move's control plane over TLS with .creds; producers
    publish to the stream with acks all the while; every acked id is held once at the end."""
    topology = secure.path / "topology.yaml"
    asyncio.run(make_stream(load_topology(topology), "east", "SECURE_MOVE", ["secure_move.>"], placement="east"))
    load = start_load(topology, "jetstream://east", "secure_move.{n}", tmp_path / "ledger", 8, "--producers", "2")
    time.sleep(2)
    r = ferry("move", "SECURE_MOVE", "--to", "west", "--json", topology=topology)
    finish(load)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["outcome"] == "moved" and result["verify"]["ok"] and result["cluster"] == "west", result
    held, acked = held_ids(topology, "west", "SECURE_MOVE"), acked_ids(tmp_path / "ledger")
    assert len(held) == len(set(held)) and acked <= set(held) and len(acked) > 1000, (len(held), len(acked))
    t = judge(spark, topology, tmp_path / "ledger", "jetstream://west/SECURE_MOVE", tmp_path / "audit.html")
    assert t["lost"] == 0 and t["extra_copies"] == 0 and t["unexpected"] == 0, t


@also_on_the_spark_lab  # on bare workers: they read the .creds and TLS files themselves
@pytest.mark.connect
@pytest.mark.spark
def test_a_stream_of_the_second_account_is_moved_under_load_copied_and_audited(
    secure: lab.LabState, tmp_path: Path, spark: Any
) -> None:
    """SALES, the lab's second application account, named in the topology's `accounts`: its stream
    is made, loaded, moved under load and audited there, and copied into APP under the same name."""
    topology = secure.path / "topology.yaml"
    add = ferry("stream", "add", "ACCOUNTS", "--cluster", "east", "--account", "SALES", "--subject", "accounts.>",
                topology=topology)  # fmt: skip
    assert add.returncode == 0, add.stderr
    other = ferry("stream", "info", "ACCOUNTS", "--cluster", "east", topology=topology)  # APP, the default
    assert other.returncode != 0 and other.stderr.strip() == "error: stream 'ACCOUNTS' not found", other.stderr
    nope = ferry("stream", "info", "ACCOUNTS", "--cluster", "east", "--account", "NOPE", topology=topology)
    assert nope.stderr.strip() == "error: cluster 'east' has no account 'NOPE' in the topology (accounts: SALES)"
    sales = "jetstream://east?account=SALES"
    load = start_load(topology, sales, "accounts.{n}", tmp_path / "ledger", 8, "--producers", "2")
    time.sleep(2)
    r = ferry("move", "ACCOUNTS", "--to", "west", "--account", "SALES", "--json", topology=topology)
    finish(load)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["outcome"] == "moved" and result["verify"]["ok"] and result["cluster"] == "west", result
    moved = "jetstream://west/ACCOUNTS?account=SALES"
    t = judge(spark, topology, tmp_path / "ledger", moved, tmp_path / "audit.html")
    assert t["lost"] == 0 and t["extra_copies"] == 0 and t["unexpected"] == 0 and t["tier_messages"] > 1000, t
    copied = ferry("copy", moved, "jetstream://west/ACCOUNTS", "--create", "--json", topology=topology)
    assert copied.returncode == 0, copied.stderr[-2000:]  # the same name, in another account: not itself
    assert json.loads(copied.stdout)["stored"] == t["tier_messages"]
    held = held_ids(topology, "west", "ACCOUNTS")
    assert len(held) == len(set(held)) == t["tier_messages"] and acked_ids(tmp_path / "ledger") <= set(held)


@pytest.mark.spark
@pytest.mark.connect
def test_a_spark_copy_on_the_secure_lab_copies_every_message_once(secure: lab.LabState, tmp_path: Path) -> None:
    """The data plane's own NATS client, in Spark's executors, over TLS with a .creds file."""
    topology = secure.path / "topology.yaml"
    asyncio.run(make_stream(load_topology(topology), "east", "SECURE_SRC", ["secure_src.>"], placement="east"))
    load = ferry("load", "jetstream://east", "--subject", "secure_src.{n}", "--count", "5000", "--ledger",
                 str(tmp_path / "ledger"), topology=topology)  # fmt: skip
    assert load.returncode == 0, load.stderr
    r = ferry("copy", "jetstream://east/SECURE_SRC", "jetstream://west/SECURE_DST", "--create", "--json",
              "--subject-prefix", "copy.", topology=topology)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["stored"] == 5000
    held = held_ids(topology, "west", "SECURE_DST")
    assert len(held) == len(set(held)) == 5000 and set(held) == acked_ids(tmp_path / "ledger")


def _variant(topology: Path, out: Path, change: Any) -> Path:
    doc = yaml.safe_load(topology.read_text())
    west = copy.deepcopy(doc)["sites"]["sc"]["clusters"]["west"]
    change(west, out.parent)
    doc["sites"]["sc"]["clusters"]["west"] = west
    out.write_text(yaml.safe_dump(doc))
    return out


def _malformed(d: Path) -> str:
    (d / "bad.creds").write_text("-----BEGIN NATS USER JWT-----\n")
    return str(d / "bad.creds")


BAD = {
    "a creds file that is not there": (
        lambda c, d: c["credentials"].update(creds_file=str(d / "nope.creds")),
        "error: cluster 'west' (west-1): credentials: creds file {d}/nope.creds does not exist",
    ),
    "an nkey seed file that is not there": (
        lambda c, d: c.update(credentials={"nkey_seed_file": str(d / "nope.nk")}),
        "error: cluster 'west' (west-1): credentials: nkey seed file {d}/nope.nk does not exist",
    ),
    "a malformed nkey seed": (
        lambda c, d: [
            (d / "bad.nk").write_text("SUnotaseed"),
            c.update(credentials={"nkey_seed_file": str(d / "bad.nk")}),
        ],
        "error: cluster 'west' (west-1): credentials: nkey seed file {d}/bad.nk holds no valid nkey seed",
    ),
    "a malformed creds file": (
        lambda c, d: c["credentials"].update(creds_file=_malformed(d)),
        "error: cluster 'west' (west-1): credentials: creds file {d}/bad.creds is not a NATS .creds file (a user JWT "
        "and an nkey seed)",
    ),
    "another CA": (
        lambda c, d: c["tls"].update(ca_file=other_ca(d)),
        "TLS: certificate verify failed: unable to get local issuer certificate",
    ),
    "a name the certificate does not carry": (
        lambda c, d: c["tls"].update(server_name="nats-a"),
        "TLS: certificate verify failed: Hostname mismatch, certificate is not valid for 'nats-a'.",
    ),
    "plaintext URLs and no CA": (
        lambda c, d: [c.pop("tls"), *(b.update(url=b["url"].replace("tls://", "nats://")) for b in c["brokers"])],
        "TLS: certificate verify failed",  # the server asks for TLS; the system's CAs do not know the lab's
    ),
    "no client certificate": (
        lambda c, d: [c["tls"].pop("cert_file"), c["tls"].pop("key_file")],
        "TLS: the server requires a client certificate (tls.cert_file and tls.key_file;",
    ),
    "a client certificate the server rejects": (
        lambda c, d: c["tls"].update(foreign_client(d)),
        "TLS: the server rejected the client certificate (tls.cert_file; tlsv1 alert unknown ca)",
    ),
    "an account without JetStream": (
        lambda c, d: c["credentials"].update(c["system_credentials"]),
        "cluster 'west' as creds file {sys}: JetStream is not enabled for this account (err_code 10039)",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_security_settings_get_one_line_and_change_nothing(secure: lab.LabState, tmp_path: Path, case: str) -> None:
    change, expected = BAD[case]
    topology = _variant(secure.path / "topology.yaml", tmp_path / "topology.yaml", change)
    for args in (["stream", "info", "SECURE_ANY", "--cluster", "west"],  # the control plane
                 ["copy", "jetstream://west/SECURE_ANY", "jetstream://west/SECURE_NEW", "--create",
                  "--subject-prefix", "copy."]):  # fmt: skip
        r = ferry(*args, topology=topology, timeout=120)
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]
        assert expected.format(d=tmp_path, sys=secure.path / "secrets" / "sys.creds") in r.stderr, r.stderr
    names = asyncio.run(_streams(secure.path / "topology.yaml"))
    assert "SECURE_NEW" not in names


@pytest.mark.spark
@pytest.mark.connect
def test_a_brokers_own_tls_settings_override_its_clusters(secure: lab.LabState, tmp_path: Path) -> None:
    """West's tls names a server its certificates do not carry (refused above); each west broker's
    own tls names the one they do: the control plane, the probes and Spark's data plane dial every
    server with its own settings. With only west-1's set, ferry reaches west through west-1."""
    good = secure.path / "topology.yaml"
    asyncio.run(make_stream(load_topology(good), "west", "PERB", ["perb.>"], placement="west"))
    r = ferry("load", "jetstream://west", "--subject", "perb.{n}", "--count", "2000", "--ledger",
              str(tmp_path / "ledger"), topology=good)  # fmt: skip
    assert r.returncode == 0, r.stderr

    def every(c: dict[str, Any], d: Path) -> None:
        c["tls"]["server_name"] = "nats-a"
        for b in c["brokers"]:
            b["tls"] = {"server_name": "localhost"}

    topology = _variant(good, tmp_path / "every.yaml", every)
    check = ferry("topology", "check", str(topology), "--json", topology=topology)
    assert check.returncode == 0 and all(p["ok"] for p in json.loads(check.stdout)["probes"]), check.stdout[-2000:]
    args = ["copy", "jetstream://west/PERB", "jetstream://west/PERB_COPY", "--create", "--subject-prefix", "copy."]
    r = ferry(*args, "--json", topology=topology)
    assert r.returncode == 0 and json.loads(r.stdout)["stored"] == 2000, r.stderr[-2000:]
    held = held_ids(good, "west", "PERB_COPY")
    assert len(held) == len(set(held)) == 2000 and set(held) == acked_ids(tmp_path / "ledger")

    def first_only(c: dict[str, Any], d: Path) -> None:
        c["tls"]["server_name"] = "nats-a"
        c["brokers"][0]["tls"] = {"server_name": "localhost"}

    topology = _variant(good, tmp_path / "first.yaml", first_only)
    info = ferry("stream", "info", "PERB", "--cluster", "west", topology=topology)
    assert info.returncode == 0 and "2,000 messages" in info.stdout, info.stderr
    check = ferry("topology", "check", str(topology), "--json", topology=topology)
    rows = {(p["broker"], p["endpoint"]): p for p in json.loads(check.stdout)["probes"] if p["cluster"] == "west"}
    assert check.returncode != 0 and rows[("west-1", "client")]["ok"], rows
    assert not rows[("west-2", "client")]["ok"] and "Hostname mismatch" in rows[("west-2", "client")]["detail"], rows


async def _streams(topology: Path) -> list[str]:
    async with bnats.session(load_topology(topology).nats("west")) as nc:
        return [i.config.name for i in await nc.jsm().streams_info()]


# -- an nkey user and a token, on servers of their own ------------------------------------------


@pytest.fixture(scope="module")
def plain_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Single servers with JetStream: one whose user is an nkey, one that takes a token, one whose
    TLS certificate expires in 10 days and one whose certificate has expired."""
    d = tmp_path_factory.mktemp("auth")
    user = nkeys.from_seed(bytearray(_user_seed()))
    (d / "user.nk").write_text(user.seed.decode())
    (d / "token").write_text(token := base64.b32encode(os.urandom(15)).decode())
    ca, now = trustme.CA(), datetime.datetime.now(datetime.UTC)
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    for name, days in (("short", 10), ("old", -1), ("client-short", 5), ("client-old", -1)):
        cert = ca.issue_cert("127.0.0.1", common_name="127.0.0.1", not_before=now - datetime.timedelta(days=20),
                             not_after=now + datetime.timedelta(days=days, hours=1))  # fmt: skip
        cert.cert_chain_pems[0].write_to_path(str(d / f"{name}.pem"))
        cert.private_key_pem.write_to_path(str(d / f"{name}.key"))
    ports = dict(zip(("nkey", "token", "short", "old"), free_ports(4), strict=True))
    confs = {
        "nkey": {"accounts": {"A": {"jetstream": "enabled", "users": [{"nkey": user.public_key.decode()}]}}},
        "token": {"authorization": {"token": token}},
        "short": {"tls": {"cert_file": str(d / "short.pem"), "key_file": str(d / "short.key")}},
        "old": {"tls": {"cert_file": str(d / "old.pem"), "key_file": str(d / "old.key")}},
    }
    procs = []
    try:
        for name, auth in confs.items():
            conf = d / f"{name}.conf"
            base = {"listen": f"127.0.0.1:{ports[name]}", "jetstream": {"store_dir": str(d / f"{name}-js")}}
            conf.write_text(json.dumps(base | auth))
            with (d / f"{name}.log").open("w") as log:
                procs.append(subprocess.Popen([nats_server_binary(), "-c", str(conf)], stderr=log))
        deadline = time.monotonic() + 20
        while down := [n for n, p in ports.items() if not port_open(p)]:
            assert time.monotonic() < deadline, f"not listening: {down} (see {d}/*.log)"
            time.sleep(0.1)
        yield {
            "dir": d,
            "nkey_port": ports["nkey"],
            "token_port": ports["token"],
            "ports": ports,
            "user": user.public_key.decode(),
            "secrets": [user.seed.decode(), token],
        }
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)


def _user_seed() -> bytes:
    from nats_jwt.nkeys_ext.nkeys2 import create_user_pair

    return create_user_pair().seed


@pytest.mark.spark
@pytest.mark.connect
def test_an_nkey_user_and_a_token_reach_the_control_and_data_planes(plain_auth: dict[str, Any]) -> None:
    d = plain_auth["dir"]
    doc = {"version": 1, "sites": {"s": {"clusters": {
        "nk": {"kind": "nats", "credentials": {"nkey_seed_file": str(d / "user.nk")},
               "brokers": [{"name": "nk-1", "url": f"nats://127.0.0.1:{plain_auth['nkey_port']}"}]},
        "tok": {"kind": "nats", "credentials": {"token_file": str(d / "token")},
                "brokers": [{"name": "tok-1", "url": f"nats://127.0.0.1:{plain_auth['token_port']}"}]},
    }}}}  # fmt: skip
    topology = d / "topology.yaml"
    topology.write_text(yaml.safe_dump(doc))
    for cluster in ("nk", "tok"):
        add = ferry("stream", "add", "AUTH", "--cluster", cluster, "--subject", "auth.>", "--replicas", "1",
                    topology=topology)  # fmt: skip
        assert add.returncode == 0, add.stderr
        load = ferry("load", f"jetstream://{cluster}", "--subject", "auth.{n}", "--count", "500", "--ledger",
                     str(d / f"ledger-{cluster}"), topology=topology)  # fmt: skip
        assert load.returncode == 0, load.stderr
    r = ferry("copy", "jetstream://nk/AUTH", "jetstream://tok/AUTH", "--json", topology=topology)  # the wire client
    # (nk's AUTH into tok's: the same name and subjects, in another deployment)
    assert r.returncode == 0, r.stderr[-2000:]
    held = held_ids(topology, "tok", "AUTH")
    assert len(held) == len(set(held)) == 1000
    assert set(held) == acked_ids(d / "ledger-nk") | acked_ids(d / "ledger-tok")
    wrong = d / "wrong.yaml"
    (d / "wrong-token").write_text("not-the-token")
    wrong.write_text(topology.read_text().replace(str(d / "token"), str(d / "wrong-token")))
    r = ferry("stream", "info", "AUTH", "--cluster", "tok", topology=wrong)
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [
        f"error: cluster 'tok': authorization violation for token in {d / 'wrong-token'}"
    ], r.stderr
    # TLS asked of a plaintext server: refused before ferry sends its credentials (nats-py would
    # have sent them in plaintext: it starts TLS only when the server requires it)
    tls = d / "tls.yaml"
    tok = f"tls://127.0.0.1:{plain_auth['token_port']}"
    tls.write_text(topology.read_text().replace(f"nats://127.0.0.1:{plain_auth['token_port']}", tok))
    for args in (
        ["stream", "info", "AUTH", "--cluster", "tok"],
        ["load", "jetstream://tok", "--subject", "auth.x{n}", "--count", "1", "--ledger", str(d / "ledger-x")],
    ):
        r = ferry(*args, topology=tls)
        assert r.returncode != 0 and r.stderr.strip().splitlines() == [
            f"error: cluster 'tok': {tok}: TLS asked for, but the server does not speak TLS; nothing was sent"
        ], r.stderr[-2000:]


def test_topology_check_shows_tls_and_identity_and_warns_before_certificates_expire(
    plain_auth: dict[str, Any],
) -> None:
    d, ports = plain_auth["dir"], plain_auth["ports"]

    def cluster(name: str, **extra: Any) -> dict[str, Any]:
        scheme = "tls" if "tls" in extra else "nats"
        return {
            "kind": "nats",
            "brokers": [{"name": f"{name}-1", "url": f"{scheme}://127.0.0.1:{ports[name]}"}],
        } | extra

    def tls(client: str) -> dict[str, str]:
        return {
            "ca_file": str(d / "ca.pem"),
            "cert_file": str(d / f"{client}.pem"),
            "key_file": str(d / f"{client}.key"),
        }

    clusters = {
        "nkey": cluster("nkey", credentials={"nkey_seed_file": str(d / "user.nk")}),
        "token": cluster("token", credentials={"token_file": str(d / "token")}),
        "short": cluster("short", tls=tls("client-short")),
    }
    topology = d / "check.yaml"
    topology.write_text(yaml.safe_dump({"version": 1, "sites": {"s": {"clusters": clusters}}}))
    r = ferry("topology", "check", str(topology), "--json", topology=topology)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    probes = {p["cluster"]: p for p in report["probes"]}
    assert probes["nkey"]["identity"] == f"user {plain_auth['user']} in account A" and probes["nkey"]["tls"] is None
    assert probes["token"]["identity"].endswith("in account $G"), probes["token"]
    short = probes["short"]["tls"]
    assert short["version"] in ("TLSv1.2", "TLSv1.3") and short["subject"] == "CN=127.0.0.1", short
    assert short["days_left"] == 10, short
    assert report["warnings"] == [
        f"cluster short: the client certificate {d / 'client-short.pem'} expires in 5 days"
        f" ({(datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=5, hours=1)):%Y-%m-%d})",
        f"short/short-1 client: the server's certificate expires in 10 days ({short['expires']})",
    ], report["warnings"]
    human = ferry("topology", "check", str(topology), topology=topology)
    assert human.returncode == 0 and human.stderr.count("warning: ") == 2, human.stderr
    # expired: the client's certificate (found before anything is dialled; here a broker's own
    # tls block names it, over its cluster's), the server's
    old = {k: v for k, v in tls("client-old").items() if k != "ca_file"}
    clusters["short"]["brokers"][0]["tls"] = old
    topology.write_text(yaml.safe_dump({"version": 1, "sites": {"s": {"clusters": clusters}}}))
    r = ferry("topology", "check", str(topology), topology=topology)
    assert r.returncode == 1 and f"the client certificate {d / 'client-old.pem'} expired on " in r.stderr, r.stderr
    clusters["short"] = cluster("old", tls={"ca_file": str(d / "ca.pem")})
    topology.write_text(yaml.safe_dump({"version": 1, "sites": {"s": {"clusters": clusters}}}))
    r = ferry("topology", "check", str(topology), topology=topology)
    assert r.returncode == 1, r.stderr
    assert "problem: short/old-1 client tls://127.0.0.1:" in r.stderr and "certificate has expired" in r.stderr


def test_a_user_jwt_that_expires_soon_is_a_warning_and_an_expired_or_revoked_one_one_line(tmp_path: Path) -> None:
    from nats_jwt.nkeys_ext.nkeys2 import create_operator_pair
    from nats_jwt.v2.operator_claims import OperatorClaims
    from nats_jwt.v2.snippets import Operator

    pair = create_operator_pair()
    operator = Operator(claims=OperatorClaims(pair.public_key.decode(), "t"), seed=pair.seed)
    system = operator.create_account("SYS")
    operator.claims.nats.system_account = system.claims.sub
    app = operator.create_account("APP")
    expires: dict[str, int] = {}
    users = {name: app.create_user(name) for name in ("soon", "gone", "revoked")} | {"sys": system.create_user("sys")}
    for name, seconds in (("soon", 10 * 86400 + 3600), ("gone", -3600)):
        users[name].claims.exp = expires[name] = int(time.time()) + seconds
    # the account revokes its user "revoked" (every JWT of it issued until a minute from now)
    revoked_at = int(time.time()) + 60
    app.claims.nats.revocations = {users["revoked"].key_pair.public_key.decode(): revoked_at}
    for name, user in users.items():
        (tmp_path / f"{name}.creds").write_text(
            f"-----BEGIN NATS USER JWT-----\n{user.jwt}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{user.key_pair.seed.decode()}\n------END USER NKEY SEED------\n"
        )
    (tmp_path / "operator.jwt").write_text(operator.jwt)
    (port,) = free_ports(1)
    accounts = {app.claims.sub: app.jwt, system.claims.sub: system.jwt}
    conf = {"listen": f"127.0.0.1:{port}", "operator": str(tmp_path / "operator.jwt"), "resolver": "MEMORY",
            "system_account": system.claims.sub, "resolver_preload": accounts}  # fmt: skip
    (tmp_path / "s.conf").write_text(json.dumps(conf))
    server = subprocess.Popen([nats_server_binary(), "-c", str(tmp_path / "s.conf")], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not port_open(port):
            assert time.monotonic() < deadline and server.poll() is None, "the server did not listen"
            time.sleep(0.1)
        for name in ("soon", "gone", "revoked"):
            broker = {"name": "c-1", "url": f"nats://127.0.0.1:{port}"}
            cluster = {
                "kind": "nats",
                "credentials": {"creds_file": str(tmp_path / f"{name}.creds")},
                "system_credentials": {"creds_file": str(tmp_path / "sys.creds")},
                "brokers": [broker],
            }
            (tmp_path / f"{name}.yaml").write_text(
                yaml.safe_dump({"version": 1, "sites": {"s": {"clusters": {"c": cluster}}}})
            )
        r = ferry("topology", "check", str(tmp_path / "soon.yaml"), "--json", topology=tmp_path / "soon.yaml")
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        assert report["probes"][0]["identity"] == "user soon in account APP", report
        assert report["warnings"] == [
            f"c/c-1 client: the JWT of user soon in account APP expires in 10 days ({report['warnings'][0][-11:-1]})"
        ], report
        r = ferry("stream", "info", "ANY", "--cluster", "c", topology=tmp_path / "gone.yaml")
        gone = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expires["gone"]))
        assert r.returncode != 0 and r.stderr.strip().splitlines() == [
            f"error: cluster 'c': the user JWT in creds file {tmp_path / 'gone.creds'} expired on {gone}"
        ], r.stderr
        # the server says "authorization violation" only; the account's JWT, read through the
        # system account, says why
        r = ferry("stream", "info", "ANY", "--cluster", "c", topology=tmp_path / "revoked.yaml")
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(revoked_at))
        assert r.returncode != 0 and r.stderr.strip().splitlines() == [
            f"error: cluster 'c': the user JWT in creds file {tmp_path / 'revoked.creds'} "
            f"was revoked by account APP at {when}"
        ], r.stderr
    finally:
        server.terminate()
        server.wait(timeout=30)


# -- last: no secret anywhere ---------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.connect
def test_a_repartition_under_load_on_the_secure_lab_moves_each_message_once(
    secure: lab.LabState, tmp_path: Path
) -> None:
    """partition apply --execute: claims in the account's KV, the capture guard and the history's
    copy (Spark) over TLS with .creds; every acked id ends in its new owner once, none in the old."""
    topology = secure.path / "topology.yaml"

    def write_map(name: str, partitions: list[tuple[str, list[str]]]) -> str:
        doc = {
            "name": "secp",
            "partitions": [{"name": s.lower(), "stream": s, "cluster": "east", "patterns": p} for s, p in partitions],
        }
        (tmp_path / name).write_text(yaml.safe_dump(doc))
        return str(tmp_path / name)

    ferry(
        "partition", "apply", write_map("v1.yaml", [("SECP", ["secp.a.>", "secp.b.>"])]), topology=topology, check=True
    )
    loads = {k: start_load(topology, "jetstream://east", f"secp.{k}.{{n}}", tmp_path / k, 8) for k in "ab"}
    time.sleep(3)
    v2 = write_map("v2.yaml", [("SECP", ["secp.a.>"]), ("SECP_B", ["secp.b.>"])])
    r = ferry("partition", "apply", v2, "--execute", "--json", topology=topology, timeout=240)
    for load in loads.values():
        finish(load)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert result["purged"] == result["copied"] > 1000, result
    sent = {k: set(pq.read_table(tmp_path / k, columns=["id"]).column("id").to_pylist()) for k in "ab"}
    for stream, k, other in (("SECP", "a", "b"), ("SECP_B", "b", "a")):
        held, acked = held_ids(topology, "east", stream), acked_ids(tmp_path / k)
        assert len(held) == len(set(held)) and acked <= set(held) and len(acked) > 1000, (stream, len(held), len(acked))
        assert not set(held) & sent[other], f"{stream} holds messages of secp.{other}.>"


def test_a_partition_map_of_the_second_account_is_kept_in_that_account(secure: lab.LabState, tmp_path: Path) -> None:
    """partition apply --account SALES: the streams and the record of claims are SALES's; APP's
    record does not list the map."""
    topology = secure.path / "topology.yaml"
    doc = {
        "name": "salesmap",
        "partitions": [{"name": "p", "stream": "SALESP", "cluster": "east", "patterns": ["salesp.>"]}],
    }
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(doc))
    ferry("partition", "apply", str(tmp_path / "m.yaml"), "--account", "SALES", topology=topology, check=True)
    r = ferry("load", "jetstream://east?account=SALES", "--subject", "salesp.{n}", "--count", "100", "--ledger",
              str(tmp_path / "ledger"), topology=topology)  # fmt: skip
    assert r.returncode == 0, r.stderr
    sales = load_topology(topology).in_account("SALES")
    held = [row["msg_id"] for row in asyncio.run(read_stream(sales, "east", "SALESP"))]
    assert len(held) == len(set(held)) == 100 and set(held) == acked_ids(tmp_path / "ledger")
    maps = {m["map"] for m in json.loads(ferry("partition", "status", "--json", "--account", "SALES",
                                               topology=topology, check=True).stdout)}  # fmt: skip
    assert "salesmap" in maps
    app = {m["map"] for m in json.loads(ferry("partition", "status", "--json", topology=topology, check=True).stdout)}
    assert "salesmap" not in app


def _haproxy(state: lab.LabState) -> dict[str, dict[str, str]]:
    """HAProxy's own view of nats_east's servers: status and current client sessions."""
    return helpers.haproxy_servers(state, "nats_east")


async def _lead_from(topo: Any, stream: str, server: str) -> None:
    """Make `server` the leader of `stream` (a preferred step-down, asked until it holds)."""
    async with bnats.session(topo.nats("east")) as nc:
        for _ in range(20):
            if bnats.leader_of(await nc.jsm().stream_info(stream)) == server:
                return
            body = json.dumps({"placement": {"preferred": server}}).encode()
            with contextlib.suppress(Exception):
                await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", body, timeout=3)
            await asyncio.sleep(0.5)
    raise AssertionError(f"{server} never led {stream}")


def _mqtt_clients(state: lab.LabState, n: int) -> list[Any]:
    """`n` MQTT clients (persistent sessions) through HAProxy over TLS, each showing the lab's client
    certificate and logging in with the bearer JWT (operator mode), reconnecting when cut off."""
    import paho.mqtt.client as mqtt

    jwt = (state.path / "secrets" / "mqtt.jwt").read_text().strip()
    url = urllib.parse.urlsplit(state.lb["clusters"]["east"]["mqtt"])
    assert url.scheme == "mqtts"
    clients = []
    for i in range(n):
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"sec-mq-{i}", clean_session=False)
        c.tls_set_context(client_context(str(state.path / "tls")))  # type: ignore[arg-type]
        c.username_pw_set("mqtt", jwt)
        c.reconnect_delay_set(1, 2)
        c.connect_async(url.hostname, url.port, keepalive=30)
        c.loop_start()
        clients.append(c)
    return clients


def _mqtt_where(state: lab.LabState) -> dict[str, str]:
    """client id -> east server, for the MQTT clients of :func:`_mqtt_clients` (connz over HTTPS)."""
    where, ctx = {}, client_context(str(state.path / "tls"))
    for b in load_topology(state.path / "topology.yaml").nats("east").brokers:
        conns = httpx.get(f"{b.monitor_url}/connz", params={"limit": 10000}, timeout=5, verify=ctx).json()
        where |= {
            c["mqtt_client"]: b.name
            for c in conns["connections"] or []
            if c.get("mqtt_client", "").startswith("sec-mq")
        }
    return where


def test_an_evacuation_behind_haproxy_checked_over_tls_loses_nothing(secure: lab.LabState, tmp_path: Path) -> None:
    """HAProxy passes the clients' TLS through and checks each node's HTTPS monitoring port with the
    lab's CA and client certificate (plaintext is closed: a check that did not speak TLS fails),
    then ferry serve's availability; the evacuation's clients reconnect through it, none lost, and
    so do MQTT clients over TLS (bearer JWT logins), none left on the node."""
    topology = secure.path / "topology.yaml"
    asyncio.run(make_stream(load_topology(topology), "east", "EVS", ["evs.>"], placement="east"))
    sales = load_topology(topology).in_account("SALES")  # a leader of the second account on east-1
    asyncio.run(make_stream(sales, "east", "EVSALES", ["evsales.>"], placement="east"))
    asyncio.run(_lead_from(sales, "EVSALES", "east-1"))
    checks = lambda: {n: r["check_status"] for n, r in _haproxy(secure).items()}  # noqa: E731
    helpers.wait_for(lambda: checks() == dict.fromkeys(NODES, "L7OK"), 20, "HAProxy's checks over TLS to pass")
    mqtt_clients = _mqtt_clients(secure, 9)
    load = start_load(topology, "jetstream://east", "evs.{n}", tmp_path / "ledger", 12, "--producers", "30",
                      "--url", secure.lb["clusters"]["east"]["nats"])  # fmt: skip
    try:
        helpers.wait_for(lambda: int(_haproxy(secure)["east-1"]["scur"]) >= 5, 30, "clients on east-1 through HAProxy")
        helpers.wait_for(lambda: len(_mqtt_where(secure)) == 9, 30, "the MQTT clients connected over TLS")
        on_east_1 = sum(1 for node in _mqtt_where(secure).values() if node == "east-1")
        args = ["node", "evacuate", "east-1", "--wait-health-check", "3", "--conn-evict-rate", "50"]
        r = ferry(*args, "--wait-takeover", "1", "--json", topology=topology)
        assert r.returncode == 0, r.stderr[-2000:]
        result = json.loads(r.stdout)
        assert result["outcome"] == "evacuated" and result["now"]["connections"] == 0, result
        assert on_east_1 > 0 and result["initial"]["mqtt"] == on_east_1, (on_east_1, result["initial"])

        def elsewhere() -> bool:
            where = _mqtt_where(secure)
            return len(where) == 9 and "east-1" not in where.values()

        helpers.wait_for(elsewhere, 30, "every MQTT client reconnected through HAProxy to another node")
        # ferry serve, reading the secured cluster's journal, shows it (its answers join the secret grep)
        token = Path(secure.lb["token_file"]).read_text().strip()

        def shown() -> bool:
            r = httpx.get(secure.lb["serve"] + "/api/console", headers={"Authorization": f"Bearer {token}"}, timeout=10)
            OUTPUTS.append(r.text)
            ops = r.json()["operations"]
            return any(
                o["kind"] == "evacuation" and o["id"] == "east/east-1" and o["state"] == "prohibiting" for o in ops
            )

        helpers.wait_for(shown, 15, "ferry serve to show the evacuation")
        # the second account's leader moved too, asked as ferry's user in that account (its replica stays: no spare)
        assert asyncio.run(stream_leader(sales, "east", "EVSALES")) != "east-1", result
        assert _haproxy(secure)["east-1"]["status"].startswith("DOWN") and _haproxy(secure)["east-1"]["scur"] == "0"
        finish(load)
    finally:  # a failed assertion leaves no load or client running after the test
        if load.poll() is None:
            load.kill()
            load.wait(timeout=30)
        for c in mqtt_clients:
            c.disconnect()
            c.loop_stop()
    held, acked = held_ids(topology, "east", "EVS"), acked_ids(tmp_path / "ledger")
    assert len(held) == len(set(held)) and acked <= set(held) and len(acked) > 2000, (len(held), len(acked))
    ferry("node", "stop", "east-1", topology=topology, check=True)
    helpers.wait_for(lambda: _haproxy(secure)["east-1"]["status"] == "UP", 15, "HAProxy to take east-1 back")


@pytest.mark.spark
def test_no_secret_reaches_any_output_or_the_journal(
    secure: lab.LabState, plain_auth: dict[str, Any], tmp_path: Path
) -> None:
    """The users' JWTs and seeds, the client's private key, the token: in none of this module's
    outputs, nor in any key-value bucket (the journal) of the secure lab's account, nor in the
    logs of its `ferry serve` and HAProxy, nor in any process's command line while any of the
    module's commands ran (Spark's JVM and workers included); nor, for a snapshot and an audit run
    here, in its Spark log, its Spark event log (plans, job and task descriptions, properties) or
    the audit's HTML report."""
    topology = secure.path / "topology.yaml"
    ledger = tmp_path / "ledger"
    asyncio.run(make_stream(load_topology(topology), "west", "SNAPSEC", ["snapsec.>"], placement="west"))
    r = ferry("load", "jetstream://west", "--subject", "snapsec.{n}", "--count", "50", "--ledger", str(ledger),
              topology=topology)  # fmt: skip
    assert r.returncode == 0, r.stderr
    # Spark's event log, as a user who keeps one would have it: the plans, the jobs' and tasks'
    # descriptions, the JVM's properties and command line
    conf_dir, events = tmp_path / "spark-conf", tmp_path / "spark-events"
    conf_dir.mkdir()
    events.mkdir()
    (conf_dir / "spark-defaults.conf").write_text(f"spark.eventLog.enabled true\nspark.eventLog.dir file://{events}\n")
    env = {**os.environ, "FERRY_TOPOLOGY": str(topology), "SPARK_CONF_DIR": str(conf_dir)}
    args = ["snapshot", "jetstream://west/SNAPSEC", "--out", str(tmp_path / "snap")]
    snap = subprocess.Popen([*helpers.FERRY, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cmdlines = helpers.cmdlines_while(snap, 300)
    out, err = snap.communicate()
    assert snap.returncode == 0, err[-2000:]
    assert any("org.apache.spark" in c for c in cmdlines) and any("pyspark" in c for c in cmdlines)  # seen running
    html = tmp_path / "audit.html"
    r = ferry("audit", "--ledger", str(ledger), "--tier", f"w={tmp_path / 'snap'}", "--html", str(html),
              topology=topology, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    spark = Path(tempfile.gettempdir()) / f"ferry-spark-{os.getuid()}" / f"{snap.pid}.log"
    logged = [  # eventlog_v2_*/events_*, compressed as Spark writes them by default
        (pa.input_stream(str(f), compression="zstd").read() if f.suffix == ".zstd" else f.read_bytes()).decode(
            errors="replace"
        )
        for f in events.rglob("events_*")
    ]
    assert any("SparkListenerSQLExecutionStart" in t and "SparkListenerTaskEnd" in t for t in logged), "no event log"
    job = [*cmdlines, out, err, spark.read_text(errors="replace"), html.read_text(), *logged]

    secrets = list(plain_auth["secrets"])
    for creds in (secure.path / "secrets").glob("*.creds"):
        secrets += [line for line in creds.read_text().splitlines() if line and not line.startswith("---")]
    secrets.append((secure.path / "secrets" / "mqtt.jwt").read_text().strip())  # MQTT's bearer JWT
    key = (secure.path / "tls" / "client-key.pem").read_text()
    secrets += [line for line in key.splitlines() if not line.startswith("-----")][:3]
    assert len(secrets) >= 2 * 3 + 2 and len(OUTPUTS) > 20

    async def journal() -> list[str]:
        async with bnats.session(load_topology(secure.path / "topology.yaml").nats("east")) as nc:
            js, values = nc.jetstream(), []
            for info in await nc.jsm().streams_info():
                if info.config.name.startswith("KV_"):
                    kv = await js.key_value(info.config.name.removeprefix("KV_"))
                    for k in await kv.keys():
                        values.append((await kv.get(k)).value.decode(errors="replace"))
            return values

    kept = asyncio.run(journal())
    assert kept, "the move kept no journal record"
    logs = [Path(secure.proc(name).log).read_text(errors="replace") for name in ("ferry-serve", "haproxy")]
    # every command of the module was watched: moves, copies, the repartition, the evacuation
    assert any(" move " in c for c in CMDLINES) and any(" partition apply " in c for c in CMDLINES)
    for text in OUTPUTS + kept + logs + job + sorted(CMDLINES):
        leaked = [i for i, s in enumerate(secrets) if s in text]
        assert not leaked, f"secrets number {leaked} in: {' '.join(text.split())[:300]}"
