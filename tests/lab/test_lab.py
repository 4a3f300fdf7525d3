"""Each lab profile comes up healthy and carries messages; down leaves nothing running."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from ferry import lab
from ferry.brokers import probe_all
from ferry.brokers.rabbitmq import Management
from ferry.cli import app
from ferry.errors import AuthError, FerryError
from ferry.jobs.proof import smoke
from ferry.lab import nats as lab_nats
from ferry.lab.procs import group_members
from ferry.lab.rabbitmq import ADMIN_USER
from ferry.topology import load_topology
from tests.conftest import profile_topology
from tests.helpers import FERRY, as_rabbit_user, ferry

pytestmark = pytest.mark.lab


def _all_ok(state: lab.LabState) -> None:
    health = state.health()
    assert set(health) == {p.name for p in state.procs if p.kind != "epmd"}
    assert all(v == "ok" for v in health.values()), health


async def test_supercluster_r3_stream_in_east_written_from_west(supercluster: lab.LabState) -> None:
    _all_ok(supercluster)
    result = await smoke.nats_smoke(profile_topology(supercluster), "east", "west", count=3000, replicas=3)
    assert result["placed_in"] == "east"
    assert result["leader"].startswith("east-")
    assert result["client_server"].startswith("west-")
    assert result["replicas"] == 3
    assert result["published"] == result["read_back"] == 3000


async def test_supercluster_single_meta_leader_over_six_servers(supercluster: lab.LabState) -> None:
    topo = profile_topology(supercluster)
    leaders = set()
    for name in ("east", "west"):
        for b in topo.nats(name).brokers:
            meta = httpx.get(f"{b.monitor_url}/jsz").json()["meta_cluster"]
            assert meta["cluster_size"] == 6
            leaders.add(meta["leader"])
    assert len(leaders) == 1


async def test_every_endpoint_answers(supercluster: lab.LabState, rabbit_dr: lab.LabState) -> None:
    for state in (supercluster, rabbit_dr):
        for _ in range(10):  # a server's MQTT listener answers once its JetStream state is ready (CI once: 3 s)
            probes = await probe_all(profile_topology(state))
            if probes and all(p.ok for p in probes):
                break
            await asyncio.sleep(2)
        assert probes and all(p.ok for p in probes), [p for p in probes if not p.ok]
        assert {p.endpoint for p in probes} >= {"client", "mqtt"}


async def test_sites_are_independent(sites: lab.LabState) -> None:
    _all_ok(sites)
    topo = profile_topology(sites)
    for site in ("nyc", "sfo"):
        mon = topo.nats(site).brokers[0].monitor_url
        varz = httpx.get(f"{mon}/varz").json()
        assert varz["gateway"] == {} or not varz["gateway"].get("name")
        assert httpx.get(f"{mon}/routez").json()["num_routes"] == 0
    result = await smoke.nats_smoke(topo, "nyc", "nyc", count=500, replicas=1)
    assert result["read_back"] == 500


def test_a_stream_the_server_refuses_is_one_line(sites: lab.LabState) -> None:
    topology = sites.path / "topology.yaml"
    args = ("stream", "add", "SINGLE", "--cluster", "nyc", "--subject", "single.>")
    refused = ferry(*args, topology=topology)  # R3 by default, on a server of no cluster
    assert refused.returncode == 2  # a configuration the server refuses
    assert refused.stderr.strip() == "error: stream 'SINGLE': replicas > 1 not supported in non-clustered mode"
    made = ferry(*args, "--replicas", "1", "--json", topology=topology, check=True)
    assert json.loads(made.stdout)["replicas"] == 1
    ferry("stream", "rm", "SINGLE", "--cluster", "nyc", "--yes", topology=topology, check=True)


def test_a_jetstream_load_no_stream_takes_is_refused_at_once(sites: lab.LabState, tmp_path: Path) -> None:
    """Every publish would fail after a minute of retries: it used to take that long, and exit 0."""
    args = ("load", "jetstream://nyc", "--subject", "nostream.{n}", "--count", "10", "--ledger", str(tmp_path / "l"))
    r = ferry(*args, topology=sites.path / "topology.yaml", timeout=60)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no stream in cluster 'nyc' takes 'nostream.0'" in r.stderr, r.stderr
    assert not (tmp_path / "l").exists()


def test_a_load_stopped_before_its_duration_says_so_and_exits_non_zero(sites: lab.LabState, tmp_path: Path) -> None:
    """A script could not tell a load cut short from a whole one: it printed its summary and exited 0."""
    args = ["load", "nats://nyc", "--subject", "cut.{n}", "--rate", "500", "--duration", "60"]
    env = {**os.environ, "FERRY_TOPOLOGY": str(sites.path / "topology.yaml")}
    proc = subprocess.Popen(
        [*FERRY, *args, "--ledger", str(tmp_path / "l"), "--json"],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    time.sleep(3)  # a few seconds of its minute
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped before its --count or --duration" in err
    summary = json.loads(out)
    assert summary["interrupted"] is True and 0 < summary["sent"] < 60 * 500
    assert summary["sent"] == pq.read_table(tmp_path / "l").num_rows  # the ledger holds what was sent


async def test_rabbit_dr_queue_on_ltm_receives_and_delivers(rabbit_dr: lab.LabState) -> None:
    _all_ok(rabbit_dr)
    result = await smoke.rabbit_smoke(profile_topology(rabbit_dr), "ltm", count=2000)
    assert result["published"] == result["read_back"] == 2000


async def test_a_refused_amqp_permission_is_one_line(rabbit_dr: lab.LabState, tmp_path: Path) -> None:
    """aio-pika's ACCESS_REFUSED reaches the CLI as a broker's answer: one line, exit 1, no traceback."""
    as_user = await as_rabbit_user(rabbit_dr, "ltm", "no-configure", "", tmp_path / "topology.yaml", configure="^$")
    r = await asyncio.to_thread(ferry, "topology", "smoke", "--rabbitmq", "ltm", "--count", "10", topology=as_user)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: ACCESS_REFUSED - access to queue 'ferry.smoke."), r.stderr
    assert "refused for user 'no-configure'" in r.stderr, r.stderr


async def test_a_management_refusal_names_the_request_and_what_the_user_lacks(
    rabbit_dr: lab.LabState, tmp_path: Path
) -> None:
    """RabbitMQ answers 401 to a wrong password and to a tag the user lacks alike; its reason tells them apart."""
    as_user = await as_rabbit_user(rabbit_dr, "ltm", "no-admin", "management", tmp_path / "topology.yaml")
    async with Management(load_topology(as_user).rabbitmq("ltm")) as m:
        assert (await m.get("/overview"))["rabbitmq_version"]  # a management user may read this
        with pytest.raises(AuthError) as refused:
            await m.get("/vhosts/%2F")
    said = "ltm: management API refused GET /vhosts/%2F to user 'no-admin': Not administrator user"
    assert str(refused.value) == said


async def test_rabbit_dr_shovel_and_federation_plugins_work(rabbit_dr: lab.LabState) -> None:
    topo = profile_topology(rabbit_dr)
    async with Management(topo.rabbitmq("ltm")) as m:
        assert await m.get("/shovels") == []
        assert await m.get("/federation-links") == []
        upstream = {"value": {"uri": "amqp://127.0.0.1:1", "ack-mode": "on-confirm"}}
        await m.put("/parameters/federation-upstream/%2F/ferry-test", upstream)
        got = await m.get("/parameters/federation-upstream/%2F/ferry-test")
        assert got["value"]["uri"] == "amqp://127.0.0.1:1"
        await m.delete("/parameters/federation-upstream/%2F/ferry-test")
        shovel = {"value": {"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://", "dest-queue": "b"}}
        await m.put("/parameters/shovel/%2F/ferry-test", shovel)
        assert (await m.get("/parameters/shovel/%2F/ferry-test"))["value"]["src-queue"] == "a"
        await m.delete("/parameters/shovel/%2F/ferry-test")
        await m.delete("/queues/%2F/a")
        await m.delete("/queues/%2F/b")
        overview = await m.get("/overview")
    assert overview["cluster_name"] == "ltm"


async def test_rabbit_cluster_reports_three_running_nodes(rabbit_cluster: lab.LabState) -> None:
    _all_ok(rabbit_cluster)
    topo = profile_topology(rabbit_cluster)
    for broker in topo.rabbitmq("rabbits").brokers:
        async with Management(topo.rabbitmq("rabbits"), broker) as m:
            nodes = await m.get("/nodes")
        assert sorted(n["name"] for n in nodes if n["running"]) == [
            "rabbits-1@localhost",
            "rabbits-2@localhost",
            "rabbits-3@localhost",
        ]


def test_up_twice_is_harmless_and_status_reports(supercluster: lab.LabState, lab_dir: Path) -> None:
    pids = [p.pid for p in supercluster.procs]
    again = lab.up("supercluster", lab_dir, log=lambda _: None)
    assert [p.pid for p in again.procs] == pids
    result = CliRunner().invoke(app, ["lab", "status", "--dir", str(lab_dir), "--json"])
    assert result.exit_code == 0, result.output
    rows = [r for r in json.loads(result.output) if r["profile"] == "supercluster"]
    nats = [r for r in rows if r["kind"] == "nats"]
    assert {r["server"] for r in nats} == {f"{c}-{i}" for c in ("east", "west") for i in (1, 2, 3)}
    assert all(r["running"] and r["health"] == "ok" and r["ports"]["client"] > 0 for r in nats)
    health = {r["server"]: r["health"] for r in rows if r["kind"] != "nats"}
    assert health == {"ferry-serve": "ok", "haproxy": "ok", "prometheus": "ok"}
    ports = {r["server"]: r["ports"] for r in rows if r["kind"] != "nats"}
    assert ports["ferry-serve"]["http"] == int(supercluster.lb["serve"].rsplit(":", 1)[1])
    assert ports["prometheus"]["http"] == int(supercluster.lb["prometheus"].rsplit(":", 1)[1])
    assert set(ports["haproxy"]) == {"east_nats", "east_mqtt", "west_nats", "west_mqtt", "stats"}


def test_restarts_a_dead_server(sites: lab.LabState, lab_dir: Path) -> None:
    proc = sites.proc("sfo-1")
    proc.kill()
    assert not proc.alive()
    again = lab.up("sites", lab_dir, log=lambda _: None)
    assert again.proc("sfo-1").alive() and again.proc("sfo-1").pid != proc.pid
    assert again.proc("nyc-1").pid == sites.proc("nyc-1").pid
    sites.procs[:] = again.procs  # the session fixture stops the new pid


def test_failed_start_names_server_and_log_and_down_is_clean(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = Path(tmp_path_factory.mktemp("own-lab"))
    root.chmod(0o755)
    render = lab_nats.render_config

    def broken(server, *args):  # type: ignore[no-untyped-def]
        text = render(server, *args)
        return text.replace(f'"127.0.0.1:{server.client}"', '"127.0.0.1:notaport"') if server.name == "sfo-1" else text

    monkeypatch.setattr(lab_nats, "render_config", broken)
    with pytest.raises(FerryError) as info:
        lab.up("sites", root, timeout=30, log=lambda _: None)
    message = str(info.value)
    assert "sfo-1" in message and "see " in message
    log = Path(message.rsplit("see ", 1)[1])
    assert log.exists() and log.name == "server.log" and "sfo-1" in str(log)
    assert lab.running_profiles(root) == []
    monkeypatch.undo()

    state = lab.up("sites", root, log=lambda _: None)
    pgids = [p.pid for p in state.procs]
    assert all(group_members(g) for g in pgids)
    result = CliRunner().invoke(app, ["lab", "down", "--dir", str(root)])
    assert result.exit_code == 0 and "lab sites: down" in result.output
    assert not any(group_members(g) for g in pgids)
    assert not (root / "sites").exists() and not (root / "topology.yaml").exists()


def test_topology_check_probes_and_reports_wrong_password(rabbit_dr: lab.LabState, tmp_path: Path) -> None:
    path = rabbit_dr.path / "topology.yaml"
    result = CliRunner().invoke(app, ["topology", "check", str(path)])
    assert result.exit_code == 0, result.output
    report = json.loads(CliRunner().invoke(app, ["topology", "check", str(path), "--json"]).output)
    management = [p for p in report["probes"] if p["endpoint"] == "management"]  # who the API says ferry is
    assert management and all(p["identity"] == f"user {ADMIN_USER} (tags administrator)" for p in management)
    wrong = tmp_path / "secret"
    wrong.write_text("not-the-password")
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace(str(rabbit_dr.path / "secrets" / "rabbitmq"), str(wrong), 1))
    result = CliRunner().invoke(app, ["topology", "check", str(bad), "--json"])
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert any("refused" in p and "not-the-password" not in p for p in report["problems"])


def test_amqps_to_a_plaintext_port_is_one_line(rabbit_dr: lab.LabState, tmp_path: Path) -> None:
    """TLS asked of RabbitMQ's plaintext AMQP port: refused in one line naming TLS, nothing moved."""
    path = rabbit_dr.path / "topology.yaml"
    tls = tmp_path / "tls.yaml"
    tls.write_text(path.read_text().replace("amqp://", "amqps://"))
    r = subprocess.run(
        [*FERRY, "copy", "rabbitmq://ltm/%2F/nope-*", "rabbitmq://pc1/%2F"],
        env={**os.environ, "FERRY_TOPOLOGY": str(tls)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "TLS" in r.stderr, r.stderr
