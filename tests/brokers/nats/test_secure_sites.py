"""`ferry replicate` on the secure sites lab (nyc and sfo in operator mode, TLS everywhere, the
topology's .creds files): a stream of the second account (SALES) is relayed in that account,
through the SIGKILL of its active relay, and every acked message is at sfo exactly once."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ferry import lab
from ferry.topology import load_topology
from tests.helpers import Relay, ferry, load, make_stream, read_stream, stream_count, wait_for

pytestmark = [pytest.mark.lab, pytest.mark.spark, pytest.mark.timeout(600)]

SALES = ("--account", "SALES")


def test_a_second_accounts_stream_is_relayed_through_a_killed_relay(secure_sites: lab.LabState, tmp_path: Path) -> None:
    topology = secure_sites.path / "topology.yaml"
    topo = load_topology(topology).in_account("SALES")
    for site in ("nyc", "sfo"):
        asyncio.run(make_stream(topo, site, "ORD", ["ord.>"], replicas=1, allow_batched=site == "sfo" or None))
    start = ferry("replicate", "start", "--from", "nyc", "--to", "sfo", "--streams", "ORD", *SALES, topology=topology)
    assert start.returncode == 0 and "ferry replicate run --from nyc --to sfo --account SALES" in start.stdout, start
    a = Relay(topology, tmp_path, "nyc", "sfo", *SALES)
    b = None
    try:
        a.event("relaying")
        b = Relay(topology, tmp_path, "nyc", "sfo", *SALES)
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
        ferry("replicate", "stop", "--from", "nyc", "--to", "sfo", *SALES, topology=topology, check=True)
        assert b.proc.wait(timeout=30) == 0
        again = ferry("replicate", "run", "--from", "nyc", "--to", "sfo", *SALES, topology=topology, timeout=60)
        hint = "`ferry replicate start --from nyc --to sfo --streams ORD --account SALES` starts it again"
        assert again.returncode == 0 and hint in again.stderr, again.stderr
    finally:
        for r in (a, b):
            if r:
                r.close()
