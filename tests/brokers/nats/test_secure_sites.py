"""`ferry replicate` and `ferry site` on the secure sites lab (nyc and sfo in operator mode, TLS
everywhere, the topology's .creds files): a stream of the second account (SALES) is relayed in
that account, through the SIGKILL of its active relay, and every acked message is at sfo exactly
once; then that account's sites fail over and back, apart from the default account's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from nats.js.errors import NoKeysError

from ferry import lab
from ferry.brokers import nats as bnats
from ferry.lab.procs import free_ports
from ferry.topology import load_topology
from tests import helpers
from tests.helpers import Relay, load, make_stream, read_stream, served, stream_count, wait_for

pytestmark = [pytest.mark.lab, pytest.mark.spark, pytest.mark.timeout(600)]

SALES = ("--account", "SALES")
OUTPUTS: list[str] = []  # every command's stdout and stderr, searched for secrets at the end
RELAYS: list[Relay] = []  # their logs too


def ferry(*args: str, **kw: Any) -> Any:
    return helpers.ferry(*args, record=OUTPUTS, **kw)


def relay(topology: Path, tmp: Path, *args: str) -> Relay:
    RELAYS.append(r := Relay(topology, tmp, *args))
    return r


@pytest.mark.faults  # in `make test`: the second account's failover here, a killed relay in test_replicate.py
def test_a_second_accounts_stream_is_relayed_through_a_killed_relay(secure_sites: lab.LabState, tmp_path: Path) -> None:
    topology = secure_sites.path / "topology.yaml"
    topo = load_topology(topology).in_account("SALES")
    for site in ("nyc", "sfo"):
        asyncio.run(make_stream(topo, site, "ORD", ["ord.>"], replicas=1, allow_batched=site == "sfo" or None))
    start = ferry("replicate", "start", "--from", "nyc", "--to", "sfo", "--streams", "ORD", *SALES, topology=topology)
    assert start.returncode == 0 and "ferry replicate run --from nyc --to sfo --account SALES" in start.stdout, start
    a = relay(topology, tmp_path, "nyc", "sfo", *SALES)
    b = None
    try:
        a.event("relaying")
        (port,) = free_ports(1)
        b = relay(topology, tmp_path, "nyc", "sfo", *SALES, "--metrics-port", str(port))
        assert b.event("standby")["leader"]["pid"] == a.proc.pid
        producers = load(topology, "nyc?account=SALES", "ord.{n}", tmp_path / "ledger", 1000, 8)
        wait_for(lambda: stream_count(topo, "sfo", "ORD") > 1500, 60, "relaying")
        a.kill()  # SIGKILL: the standby asks sfo (in SALES) where to resume
        killed = time.time()
        assert b.event("active", timeout=30)["t"] - killed < 5.0
        assert b.event("resume")["source"] == "destination"
        out, errs = producers.communicate(timeout=120)
        assert producers.returncode == 0, errs[-2000:]
        acked = {r["id"] for r in pq.read_table(tmp_path / "ledger").to_pylist() if r["outcome"] == "acked"}
        assert len(acked) == json.loads(out)["acked"] > 4000
        wait_for(lambda: stream_count(topo, "sfo", "ORD") >= len(acked), 60, "sfo to hold every acked message")
        held = [r["msg_id"] for r in asyncio.run(read_stream(topo, "sfo", "ORD"))]
        assert len(held) == len(set(held)) == len(acked) and set(held) == acked

        rows = json.loads(ferry("replicate", "status", "--json", *SALES, topology=topology, check=True).stdout)
        (row,) = [r for r in rows if r.get("source") == "nyc"]
        assert row["leader"]["pid"] == b.proc.pid and row["takeovers"] == 1, row
        default = json.loads(ferry("replicate", "status", "--json", topology=topology, check=True).stdout)
        assert not [r for r in default if r.get("source")], default  # kept in SALES, apart from APP's
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text  # the relay's own, labelled
        assert 'ferry_relay_active{account="SALES",from="nyc",to="sfo"} 1.0' in metrics, metrics
        # ferry serve reads SALES's journal too, and names its operations apart
        ops = served(load_topology(topology), "sfo", "sfo@SALES")
        assert [(o["id"], o["state"]) for o in ops if o["kind"] == "relay"] == [("nyc->sfo@SALES", "relaying")], ops
        ferry("replicate", "stop", "--from", "nyc", "--to", "sfo", *SALES, topology=topology, check=True)
        assert b.proc.wait(timeout=30) == 0
        again = ferry("replicate", "run", "--from", "nyc", "--to", "sfo", *SALES, topology=topology, timeout=60)
        hint = "`ferry replicate start --from nyc --to sfo --streams ORD --account SALES` starts it again"
        assert again.returncode == 0 and hint in again.stderr, again.stderr
    finally:
        for r in (a, b):
            if r:
                r.close()


def _ledger_ids(*ledgers: Path) -> set[str]:
    return {r["id"] for p in ledgers for r in pq.read_table(p).to_pylist() if r["outcome"] == "acked"}


def _held(topo: Any, site: str, stream: str) -> list[str]:
    return [r["msg_id"] for r in asyncio.run(read_stream(topo, site, stream))]


def test_a_second_accounts_sites_fail_over_and_back_apart(secure_sites: lab.LabState, tmp_path: Path) -> None:
    """SALES's replication fails over to sfo while its relay lags (what nyc acked then is the RPO),
    sfo takes writes, and the fail-back brings each acked message to both sites once; the default
    account's site records never change."""
    topology = secure_sites.path / "topology.yaml"
    topo = load_topology(topology).in_account("SALES")
    for site in ("nyc", "sfo"):
        asyncio.run(make_stream(topo, site, "INV", ["inv.>"], replicas=1, allow_batched=site == "sfo" or None))
    pair = ("--from", "nyc", "--to", "sfo")
    ferry("replicate", "start", *pair, "--streams", "INV", *SALES, topology=topology, check=True)
    the_relay = relay(topology, tmp_path, "nyc", "sfo", *SALES)
    try:
        the_relay.event("relaying")
        before = load(topology, "nyc?account=SALES", "inv.a.{n}", tmp_path / "nyc-a", 500, 2)
        assert before.wait(timeout=60) == 0
        wait_for(lambda: stream_count(topo, "sfo", "INV") >= len(_ledger_ids(tmp_path / "nyc-a")), 60, "relaying")
        the_relay.kill(signal.SIGSTOP)  # lagging: what nyc acks now is not at sfo when it takes over
        lagged = load(topology, "nyc?account=SALES", "inv.b.{n}", tmp_path / "nyc-b", 500, 2)
        assert lagged.wait(timeout=60) == 0

        fo = ferry("site", "failover", "--to", "sfo", "--json", *SALES, topology=topology, check=True)
        fo = json.loads(fo.stdout)
        assert fo["primary"] == "sfo" and fo["source_reachable"], fo
        the_relay.kill(signal.SIGCONT)  # fenced: it stops
        assert the_relay.proc.wait(timeout=60) == 0
        again = ferry("replicate", "run", "--from", "nyc", "--to", "sfo", *SALES, topology=topology, timeout=60)
        assert "`ferry site failback --to nyc --account SALES` once nyc is back" in again.stderr, again.stderr
        status = json.loads(ferry("site", "status", "--json", *SALES, topology=topology, check=True).stdout)
        assert {r["site"]: r["primary"] for r in status} == {"nyc": "sfo", "sfo": "sfo"}, status
        default = json.loads(ferry("site", "status", "--json", topology=topology, check=True).stdout)
        assert {r["site"]: r["primary"] for r in default} == {"nyc": None, "sfo": None}, default

        at_sfo = load(topology, "sfo?account=SALES", "inv.c.{n}", tmp_path / "sfo-c", 500, 2)
        assert at_sfo.wait(timeout=60) == 0
        fb = ferry("site", "failback", "--to", "nyc", "--json", *SALES, topology=topology, timeout=300)
        assert fb.returncode == 0, fb.stderr[-2000:]
        report = json.loads(fb.stdout)
        # the RPO: what nyc acked while its relay lagged; the fenced relay, woken, may have written
        # some of it to sfo before its heartbeat failed (then "already there", not recovered again)
        inv = report["streams"]["INV"]
        assert inv["rpo"] == len(_ledger_ids(tmp_path / "nyc-b")) > 0 and 0 <= inv["recovered"] <= inv["rpo"], report
        assert inv["brought"] == len(_ledger_ids(tmp_path / "sfo-c")), report
        assert "ferry replicate run --from nyc --to sfo --account SALES" in report["replication"], report
        acked = _ledger_ids(tmp_path / "nyc-a", tmp_path / "nyc-b", tmp_path / "sfo-c")
        for site in ("nyc", "sfo"):
            held = _held(topo, site, "INV")
            assert len(held) == len(set(held)) and set(held) >= acked, (site, len(held), len(acked))
        status = json.loads(ferry("site", "status", "--json", *SALES, topology=topology, check=True).stdout)
        assert {r["site"]: r["primary"] for r in status} == {"nyc": "nyc", "sfo": "nyc"}, status
    finally:
        the_relay.close()
        ferry("replicate", "stop", "--from", "nyc", "--to", "sfo", "--wait", "0", *SALES, topology=topology)


def test_no_secret_reaches_the_relays_or_the_site_commands(secure_sites: lab.LabState) -> None:
    """The users' JWTs and seeds and the client's private key: in none of this module's outputs,
    its relays' logs, nor any key-value bucket (the journals) of either account at either site."""
    secrets = []
    for creds in (secure_sites.path / "secrets").glob("*.creds"):
        secrets += [line for line in creds.read_text().splitlines() if line and not line.startswith("---")]
    key = (secure_sites.path / "tls" / "client-key.pem").read_text()
    secrets += [line for line in key.splitlines() if not line.startswith("-----")][:3]
    # relays: the failover's; and the killed relay's two when its cell runs too (make test-faults)
    assert len(secrets) >= 2 * 3 + 2 and len(OUTPUTS) > 10 and len(RELAYS) >= 1

    async def journals() -> list[str]:
        values = []
        for account in (None, "SALES"):
            for site in ("nyc", "sfo"):
                async with bnats.session(load_topology(secure_sites.path / "topology.yaml").nats(site, account)) as nc:
                    js = nc.jetstream()
                    for info in await nc.jsm().streams_info():
                        if info.config.name.startswith("KV_"):
                            kv = await js.key_value(info.config.name.removeprefix("KV_"))
                            with contextlib.suppress(NoKeysError):  # a bucket whose keys were all deleted
                                keys = await kv.keys()
                                values += [(await kv.get(k)).value.decode(errors="replace") for k in keys]
        return values

    kept = asyncio.run(journals())
    assert any('"relay' in v or "source" in v for v in kept), "no relay record was read"
    for text in OUTPUTS + kept + [r.log.read_text(errors="replace") for r in RELAYS]:
        leaked = [i for i, s in enumerate(secrets) if s in text]
        assert not leaked, f"secrets number {leaked} in: {' '.join(text.split())[:300]}"
