"""The audit on synthetic ledgers and tiers: injected faults come back as exactly the injected counts."""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferry.jobs.proof.audit import audit, verdict
from ferry.jobs.proof.load import LEDGER_SCHEMA, payload_for, payload_hash
from ferry.schema import ARROW_SCHEMA

pytestmark = pytest.mark.spark
T0 = 1_800_000_000 * 1_000_000_000  # ns


def _ledger(
    producers: int, per: int, subjects: int, outcomes: list[str], run: str = "r", t0: int = T0
) -> list[dict[str, Any]]:
    rows = []
    for p in range(producers):
        for s in range(1, per + 1):
            i = p * per + s - 1
            msg_id = f"{run}-p{p}-{s}"
            rows.append(
                {
                    "id": msg_id,
                    "run": run,
                    "producer": p,
                    "seq": s,
                    "subject": f"s.{(s + p) % subjects}",
                    "sent_ns": t0 + (s * producers + p) * 50_000_000,
                    "outcome": outcomes[i % len(outcomes)],
                    "ack_ns": None,
                    "stored_seq": None,
                    "error": None,
                    "hash": payload_hash(payload_for(msg_id, 32)),
                    "size": 32,
                }
            )
    return rows


def _tier(
    ledger: list[dict[str, Any]],
    drop: set[int],
    dup: dict[int, int],
    corrupt: set[int],
    swaps: list[int],
    strangers: int,
) -> list[dict[str, Any]]:
    order = [i for i in range(len(ledger)) if i not in drop]
    order.sort(key=lambda i: ledger[i]["sent_ns"])
    for k in swaps:  # swap neighbours: a reorder
        if k + 1 < len(order):
            order[k], order[k + 1] = order[k + 1], order[k]
    order += [i for i, times in sorted(dup.items()) if i not in drop for _ in range(times)]
    rows = []
    for pos, i in enumerate(order, 1):
        led = ledger[i]
        payload = payload_for(led["id"], 32)
        if i in corrupt:
            payload = b"X" + payload[1:]
        rows.append(
            {
                "subject": led["subject"],
                "payload": payload,
                "headers": [("Ferry-Id", led["id"]), ("Ferry-Sent", str(led["sent_ns"]))],
                "msg_id": led["id"],
                "source": "t/S",
                "source_seq": pos,
                "timestamp": (led["sent_ns"] + 3_000_000) // 1000,
                "properties": None,
            }
        )
    for k in range(strangers):
        rows.append(
            {
                "subject": "s.0",
                "payload": b"?",
                "headers": None,
                "msg_id": f"stranger-{k}",
                "source": "t/S",
                "source_seq": len(rows) + 1,
                "timestamp": None,
                "properties": None,
            }
        )
    return rows


def _expected(ledger: list[dict[str, Any]], tier: list[dict[str, Any]]) -> dict[str, int]:
    by_id = {r["id"]: r for r in ledger}
    copies = Counter(r["msg_id"] for r in tier)
    corrupted = {
        r["msg_id"]
        for r in tier
        if r["msg_id"] in by_id and hashlib.sha256(r["payload"]).hexdigest()[:16] != by_id[r["msg_id"]]["hash"]
    }
    reordered: set[str] = set()
    seen_max: dict[tuple[str, int], int] = {}
    for r in sorted(tier, key=lambda r: r["source_seq"]):
        led = by_id.get(r["msg_id"])
        if not led:
            continue
        key = (r["subject"], led["run"], led["producer"])
        if key in seen_max and led["seq"] < seen_max[key]:
            reordered.add(r["msg_id"])
        seen_max[key] = max(seen_max.get(key, 0), led["seq"])
    absent = [r for r in ledger if not copies[r["id"]]]
    return {
        "lost_acked": sum(r["outcome"] == "acked" for r in absent),
        "lost_not_asked": sum(r["outcome"] == "not_asked" for r in absent),
        "absent_after_error": sum(r["outcome"] == "error" for r in absent),
        "duplicated": sum(copies[r["id"]] > 1 for r in ledger),
        "extra_copies": sum(max(copies[r["id"]] - 1, 0) for r in ledger),
        "corrupted": len(corrupted),
        "reordered": len(reordered),
        "unexpected": sum(1 for r in tier if r["msg_id"] not in by_id),
    }


def _run(spark: Any, tmp: Path, ledger: list[dict[str, Any]], tier: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    (tmp / "ledger").mkdir()
    pq.write_table(pa.Table.from_pylist(ledger, schema=LEDGER_SCHEMA), tmp / "ledger" / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(tier, schema=ARROW_SCHEMA), tmp / "tier.parquet")
    frame = spark.read.parquet(str(tmp / "tier.parquet"))
    return audit(spark, str(tmp / "ledger"), {"t": frame}, bucket_s=1, **kw)


def test_lost_ids_are_listed_in_send_order(spark: Any, tmp_path: Path) -> None:
    ledger = _ledger(1, 30, 3, ["acked"])
    report = _run(
        spark, tmp_path, ledger, _tier(ledger, drop={1, 9, 10, 19}, dup={}, corrupt=set(), swaps=[], strangers=0)
    )["tiers"]["t"]
    assert [r["id"] for r in report["lost_ids"]] == ["r-p0-2", "r-p0-10", "r-p0-11", "r-p0-20"]


def test_fixed_faults_are_counted_exactly(spark: Any, tmp_path: Path) -> None:
    ledger = _ledger(2, 50, 3, ["acked", "acked", "not_asked", "error"])
    tier = _tier(ledger, drop={0, 1, 2, 3, 40}, dup={10: 2, 11: 1}, corrupt={20, 21}, swaps=[30], strangers=3)
    report = _run(spark, tmp_path, ledger, tier)["tiers"]["t"]
    expected = _expected(ledger, tier)
    assert {k: report[k] for k in expected} == expected
    assert expected["lost_acked"] == 3 and expected["extra_copies"] == 3 and expected["corrupted"] == 2
    assert expected["unexpected"] == 3 and expected["reordered"] >= 1
    sent = {x["id"] for x in ledger}
    assert report["unexpected_ids"] == sorted(r["msg_id"] for r in tier if r["msg_id"] not in sent)
    assert {r["id"] for r in report["lost_ids"]} == {
        ledger[i]["id"] for i in (0, 1, 2, 3, 40) if ledger[i]["outcome"] != "error"
    }
    # every lost id's bucket is its send second
    assert all(
        r["bucket"] == next(x["sent_ns"] for x in ledger if x["id"] == r["id"]) // 10**9 for r in report["lost_ids"]
    )
    assert report["delay"]["p50_ms"] == pytest.approx(3.0, abs=0.01)
    assert sum(b["sent"] for b in report["buckets"]) == len(ledger)
    assert verdict({"tiers": {"t": report}}) == ["t: 4 lost (max 0)", "t: 3 duplicate copies (max 0)"]


def test_clean_tier_passes(spark: Any, tmp_path: Path) -> None:
    ledger = _ledger(3, 30, 4, ["acked"])
    report = _run(spark, tmp_path, ledger, _tier(ledger, set(), {}, set(), [], 0))
    t = report["tiers"]["t"]
    assert t["lost"] == t["extra_copies"] == t["unexpected"] == t["reordered"] == t["corrupted"] == 0
    assert t["tier_messages"] == report["sent"]["sent"] == 90 and verdict(report) == []


def test_producers_of_two_runs_are_not_one(spark: Any, tmp_path: Path) -> None:
    """Two loads on the same subjects, one after the other: the second run's p0 starts again at 1,
    which is no reorder of the first run's p0."""
    first = _ledger(1, 30, 1, ["acked"], run="a")
    ledger = first + _ledger(1, 30, 1, ["acked"], run="b", t0=first[-1]["sent_ns"] + 10**9)
    tier = _tier(ledger, set(), {}, set(), swaps=[40], strangers=0)  # one true reorder, in run b
    t = _run(spark, tmp_path, ledger, tier)["tiers"]["t"]
    assert t["lost"] == t["unexpected"] == 0 and t["tier_messages"] == 60
    assert t["reordered"] == _expected(ledger, tier)["reordered"] == 1


def test_a_tier_named_for_one_ledger_is_judged_on_it_and_copies_delays_are_told_apart(
    spark: Any, tmp_path: Path
) -> None:
    """Two loads, one tier holding the first's messages and one of the second's (an overlap), some
    of them stored by a copy: without `holds` every message of the second load counts as lost
    there; with it, none, and the second load's one message is neither lost nor unexpected. The
    delays of the messages a copy stored are counted apart."""
    a = _ledger(2, 20, 2, ["acked"], run="a")
    b = _ledger(1, 10, 1, ["acked"], run="b", t0=a[-1]["sent_ns"] + 10**9)
    tier = _tier(a + b, drop=set(range(len(a) + 1, len(a) + len(b))), dup={}, corrupt=set(), swaps=[], strangers=2)
    copied = 7
    for row in tier[:copied]:
        row["headers"] = [*row["headers"], ("Ferry-Source", "east/ORIGIN"), ("Ferry-Source-Seq", "1")]
    for name, rows in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        pq.write_table(pa.Table.from_pylist(rows, schema=LEDGER_SCHEMA), tmp_path / name / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(tier, schema=ARROW_SCHEMA), tmp_path / "tier.parquet")
    frame = spark.read.parquet(str(tmp_path / "tier.parquet"))
    ledgers = [str(tmp_path / "a"), str(tmp_path / "b")]
    every = audit(spark, ledgers, {"t": frame}, bucket_s=1)["tiers"]["t"]
    assert (every["lost"], every["unexpected"]) == (len(b) - 1, 2)
    assert every["delay"]["by_copy"] == copied and every["delay"]["count"] == len(a) + 1
    held = audit(spark, ledgers, {"t": frame}, bucket_s=1, holds={"t": [ledgers[0]]})["tiers"]["t"]
    assert (held["lost"], held["unexpected"], held["tier_messages"]) == (0, 2, len(a) + 2)
    assert sum(x["sent"] for x in held["buckets"]) == len(a) and held["delay"]["count"] == len(a)


def test_faults_beyond_the_listed_ones_are_still_counted(spark: Any, tmp_path: Path) -> None:
    ledger = _ledger(1, 60, 1, ["acked"])  # 20 messages a second: 3 buckets
    lost, dup, corrupt = set(range(0, 60, 2)), dict.fromkeys(range(1, 20, 2), 1), set(range(21, 60, 2))
    tier = _tier(ledger, drop=lost, dup=dup, corrupt=corrupt, swaps=[], strangers=5)
    t = _run(spark, tmp_path, ledger, tier, max_listed=1)["tiers"]["t"]  # 4 lost ids a bucket, 1 a delay bin
    expected = _expected(ledger, tier)
    assert {k: t[k] for k in expected} == expected
    assert t["lost"] == 30 and t["extra_copies"] == 10 and t["corrupted"] == 20 and t["unexpected"] == 5
    assert (
        len(t["lost_ids"]) == len(t["duplicated_ids"]) == len(t["corrupted_ids"]) == 1
        and sum(b["lost_acked"] for b in t["buckets"]) == 30
    )


def test_no_corruption_is_claimed_without_a_hash(spark: Any, tmp_path: Path) -> None:
    ledger = _ledger(1, 20, 2, ["acked"])
    for row in ledger[:10]:
        row["hash"] = None  # a ledger that recorded no payload hash for these
    tier = _tier(ledger, set(), {}, corrupt={3, 15}, swaps=[], strangers=0)
    t = _run(spark, tmp_path, ledger, tier)["tiers"]["t"]
    assert t["corrupted"] == 1 and [r["id"] for r in t["corrupted_ids"]] == [ledger[15]["id"]]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_faults_match_brute_force(spark: Any, tmp_path_factory: pytest.TempPathFactory, data: Any) -> None:
    producers = data.draw(st.integers(1, 3))
    per = data.draw(st.integers(3, 30))
    ledger = _ledger(
        producers,
        per,
        data.draw(st.integers(1, 4)),
        data.draw(st.lists(st.sampled_from(["acked", "not_asked", "error"]), min_size=1, max_size=4)),
    )
    n = len(ledger)
    idx = st.integers(0, n - 1)
    tier = _tier(
        ledger,
        drop=data.draw(st.sets(idx, max_size=n // 3)),
        dup=data.draw(st.dictionaries(idx, st.integers(1, 3), max_size=4)),
        corrupt=data.draw(st.sets(idx, max_size=4)),
        swaps=data.draw(st.lists(st.integers(0, n), max_size=4)),
        strangers=data.draw(st.integers(0, 3)),
    )
    random.shuffle(tier)  # the audit must not depend on row order, only on source_seq
    report = _run(spark, tmp_path_factory.mktemp("h"), ledger, tier)["tiers"]["t"]
    expected = _expected(ledger, tier)
    assert {k: report[k] for k in expected} == expected
