"""The audit's HTML report and its events (pure logic; the real report of a move under load is in
tests/api/test_console.py, drawn by a real browser in tests/jobs/proof/test_proof.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from ferry.errors import FerryError, UsageError
from ferry.jobs.proof.audit import read_events
from ferry.jobs.proof.report import render_html

T0 = 1_800_000_000  # 2027-01-15 08:00:00 UTC


def _report(events: list[dict[str, Any]], by_copy: int = 0) -> dict[str, Any]:
    buckets = [
        {"bucket": T0 + 10 * i, "sent": 100, "present": 100 - (i == 2), "lost_acked": int(i == 2), "lost_not_asked": 0}
        | ({"delay_p50_ms": 2.0, "delay_p99_ms": 5.0 + 100 * (i == 1), "delay_max_ms": 200.0} if i != 3 else {})
        for i in range(5)
    ]
    delay = {"count": 496, "by_copy": by_copy, "p50_ms": 2.0, "p99_ms": 90.0, "max_ms": 200.0, "histogram": []}
    tier = {"lost": 1, "lost_acked": 1, "buckets": buckets, "delay": delay, "lost_ids": []}
    sent = {
        "sent": 500,
        "acked": 500,
        "errors": 0,
        "not_asked": 0,
        "first_ns": T0 * 10**9,
        "last_ns": (T0 + 49) * 10**9,
    }
    return {"ledger": "ledger/", "bucket_s": 10, "tiers": {"west": tier}, "sent": sent, "events": events}


def test_the_timeline_has_utc_times_the_delay_and_each_run_of_events(tmp_path: Path) -> None:
    lines = [
        "a warning line that is not JSON",
        json.dumps({"event": "plan", "t": T0 + 3.2, "cluster": "east"}),
        *(json.dumps({"event": "evicted", "t": T0 + 12 + k, "connections": 1}) for k in range(3)),
        json.dumps({"event": "done", "t": T0 + 61.5}),  # after the last send: the axis reaches it
        json.dumps(["not", "an", "event"]),
    ]
    (tmp_path / "evacuation.jsonl").write_text("\n".join(lines) + "\n")
    events = read_events([tmp_path / "evacuation.jsonl"])
    assert [(e["event"], e["source"]) for e in events] == [("plan", "evacuation.jsonl")] + [
        ("evicted", "evacuation.jsonl")
    ] * 3 + [("done", "evacuation.jsonl")]

    page = render_html(_report(events), [])
    assert "sent over 49.0s from 08:00:00 UTC" in page
    svg = re.search(r'<svg role="img" aria-label="sent, stored, delay and events over time".*?</svg>', page, re.S)
    assert svg, page
    # one mark per run of events; the run of three evictions as a band from its first to its last
    assert re.findall(r"<title>([^<]*)</title></line>", svg[0]) == [
        "08:00:03: plan",
        "08:00:12 to 08:00:14: evicted (3 times)",
        "08:01:01: done",
    ]
    assert len(re.findall(r'fill="#8250df" fill-opacity="0.10"', svg[0])) == 1
    # the p99 delay of the four buckets that have delays, its highest at the top of the plot
    points = re.search(r'<polyline points="([^"]+)"', svg[0])[1].split()  # type: ignore[index]
    assert len(points) == 4 and min(float(p.split(",")[1]) for p in points) == float(points[1].split(",")[1])
    times = re.findall(r'text-anchor="middle">(\d\d:\d\d:\d\d)</text>', svg[0])
    assert times[0] == "08:00:00" and times[-1] == "08:01:01"  # the axis spans the load and the events
    assert "08:00:20: 1 lost" in svg[0]
    assert "<td>08:00:12 to 08:00:14</td><td class=l>evacuation.jsonl</td><td class=l>evicted (3 times)</td>" in page


def test_a_delay_is_not_judged_and_a_copys_share_is_said(tmp_path: Path) -> None:
    page = render_html(_report([], by_copy=120), [])
    assert '<div class="card info"><b>2.0 / 90.0</b>sent → stored here, p50 / p99 ms</div>' in page
    assert "120 of its 496 delays are of messages a copy stored" in page
    assert "copy stored" not in render_html(_report([], by_copy=0), [])


def test_an_events_file_without_events_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("nothing here\n")
    with pytest.raises(UsageError) as refused:
        read_events([tmp_path / "empty.jsonl"])
    assert "\n" not in str(refused.value) and "no event in it" in str(refused.value)
    with pytest.raises(FerryError, match="No such file"):
        read_events([tmp_path / "missing.jsonl"])
