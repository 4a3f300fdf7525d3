"""The proof on real brokers: load with a ledger, snapshot, audit; injected losses are named exactly."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

from ferry import lab
from ferry.brokers import nats as bnats
from tests.conftest import profile_topology
from tests.helpers import ferry, make_queues, make_stream, queue_depth

pytestmark = pytest.mark.lab

N = 20_000


def chromium(page: Path, png: Path) -> list[str]:
    """Render `page` headless; return the page's console messages."""
    result = subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={png.parent / 'chromium-profile'}",
            "--enable-logging=stderr",
            "--v=0",
            f"--screenshot={png}",
            "--window-size=1000,1400",
            f"file://{page}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert png.exists(), result.stderr[-2000:]
    return [line for line in result.stderr.splitlines() if ":CONSOLE" in line]


def test_console_check_catches_a_broken_page(tmp_path: Path) -> None:
    page = tmp_path / "bad.html"
    page.write_text("<html><body><script>missingFunction();</script></body></html>")
    assert any("missingFunction" in line for line in chromium(page, tmp_path / "bad.png"))


@pytest.mark.spark
@pytest.mark.connect
def test_load_snapshot_audit_and_named_losses(
    supercluster: lab.LabState, rabbit_dr: lab.LabState, tmp_path: Path
) -> None:
    nats_topo, rabbit_topo = profile_topology(supercluster), profile_topology(rabbit_dr)
    asyncio.run(make_stream(nats_topo, "east", "PROOF", ["proof.>"], placement="east"))
    asyncio.run(make_queues(rabbit_topo, "ltm", "/", ["proof-q"], quorum=set()))
    topology = supercluster.path.parent / "topology.yaml"  # both profiles

    js = ferry(
        "load",
        "jetstream://east",
        "--ledger",
        str(tmp_path / "js-ledger"),
        "--subject",
        "proof.{n}",
        "--count",
        str(N),
        "--producers",
        "2",
        "--json",
        topology=topology,
        check=True,
    )
    assert json.loads(js.stdout)["acked"] == N
    mq = ferry(
        "load",
        "rabbitmq://ltm/%2F",
        "--ledger",
        str(tmp_path / "mq-ledger"),
        "--subject",
        "proof-q",
        "--subjects",
        "1",
        "--count",
        str(N),
        "--json",
        topology=topology,
        check=True,
    )
    assert json.loads(mq.stdout)["acked"] == N

    js_snap = ferry("snapshot", "jetstream://east/PROOF", "--out", str(tmp_path / "js-snap"), topology=topology)
    assert js_snap.returncode == 0 and f"{N}/{N}" in js_snap.stderr, js_snap.stderr  # its progress bar, at the end
    ferry("snapshot", "rabbitmq://ltm/%2F/proof-q", "--out", str(tmp_path / "mq-snap"), topology=topology, check=True)
    assert asyncio.run(queue_depth(rabbit_topo, "ltm", "/", "proof-q")) == N  # the snapshot left the queue as it was

    for ledger, snap in (("js-ledger", "js-snap"), ("mq-ledger", "mq-snap")):
        report = json.loads(
            ferry(
                "audit",
                "--ledger",
                str(tmp_path / ledger),
                "--tier",
                f"t={tmp_path / snap}",
                "--html",
                str(tmp_path / f"{ledger}.html"),
                "--json",
                topology=topology,
                check=True,
            ).stdout
        )
        t = report["tiers"]["t"]
        assert report["pass"] and t["tier_messages"] == N
        assert t["lost"] == t["extra_copies"] == t["unexpected"] == t["corrupted"] == 0

    # faults: three messages deleted by sequence, one subject purged
    async def inject() -> set[int]:
        async with bnats.session(nats_topo.nats("east")) as nc:
            jsm = nc.jsm()
            for seq in (7, 12_345, 19_000):
                await jsm.delete_msg("PROOF", seq)
            await jsm.purge_stream("PROOF", subject="proof.3")
        return {7, 12_345, 19_000}

    deleted = asyncio.run(inject())
    ledger_rows = pq.read_table(tmp_path / "js-ledger").to_pylist()
    by_seq = {r["stored_seq"]: r for r in ledger_rows}
    expected = {by_seq[s]["id"] for s in deleted} | {r["id"] for r in ledger_rows if r["subject"] == "proof.3"}
    html = tmp_path / "faults.html"
    # both loads, and a stream that can hold only the first: said before Spark starts (here refused
    # by the --html that follows), and named with --holds
    both = ("audit", "--ledger", str(tmp_path / "js-ledger"), "--ledger", str(tmp_path / "mq-ledger"))
    warned = ferry(*both, "--tier", "live=jetstream://east/PROOF", "--html", "/nonexistent/x.html", topology=topology)
    lines = warned.stderr.strip().splitlines()
    assert warned.returncode == 2 and lines[-1].startswith("error: --html"), warned.stderr
    assert lines[:-1] == [
        f"warning: tier live: stream PROOF (proof.>) captures none of the subjects ledger {tmp_path / 'mq-ledger'} "
        "sent on (e.g. proof-q): their messages count as lost there; --holds live=LEDGER names the ledgers a tier "
        "must hold"
    ], warned.stderr
    unknown = ferry(*both, "--tier", "live=jetstream://east/PROOF", "--holds", "nope=x", topology=topology)
    assert unknown.returncode == 2 and unknown.stderr.strip().splitlines()[-1].startswith("error: --holds 'nope=x'")
    result = ferry(
        *both,
        "--holds",
        f"live={tmp_path / 'js-ledger'}",
        "--tier",
        "live=jetstream://east/PROOF",
        "--html",
        str(html),
        "--json",
        topology=topology,
    )
    assert result.returncode == 3 and "warning" not in result.stderr, result.stderr
    t = json.loads(result.stdout)["tiers"]["live"]
    assert {r["id"] for r in t["lost_ids"]} == expected and t["lost_acked"] == len(expected)
    buckets = {r["id"]: r["bucket"] for r in t["lost_ids"]}
    assert all(buckets[r["id"]] == r["sent_ns"] // 10**10 * 10 for r in ledger_rows if r["id"] in expected)
    assert sum(b["lost_acked"] for b in t["buckets"]) == len(expected)
    # a tier that does not exist: one line, as every error
    nope = ferry(
        "audit", "--ledger", str(tmp_path / "js-ledger"), "--tier", "t=jetstream://east/NOPE", topology=topology
    )
    assert nope.returncode == 1 and nope.stderr.strip() == "error: stream 'NOPE' not found in cluster east", nope.stderr

    console = chromium(html, tmp_path / "report.png")
    assert console == [], console
    image = Image.open(tmp_path / "report.png").convert("RGB")
    colours = image.getcolors(maxcolors=1_000_000) or []
    non_white = sum(count for count, rgb in colours if rgb != (255, 255, 255))
    assert len(colours) > 20 and non_white > 0.02 * image.width * image.height, "the report rendered blank"
