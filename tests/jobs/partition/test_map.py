"""Partition maps without a broker: check, route and the claims conflict rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferry.errors import ConfigError
from ferry.jobs import partition as pt
from ferry.jobs.partition import claims
from ferry.jobs.partition.map import Partition


def pmap(name: str, *parts: tuple[str, str, list[str]]) -> pt.PartitionMap:
    return pt.PartitionMap(name=name, partitions=[Partition(name=n, stream=s, patterns=list(p)) for n, s, p in parts])


def test_check_reports_every_problem_with_a_witness() -> None:
    m = pmap(
        "m",
        ("a", "A", ["orders.*", "foo*"]),
        ("b", "B", ["orders.eu", "audit.*", "audit.>"]),
        ("c", "A", ["ferry.stage.x"]),
        ("a", "C", ["x.>.y"]),
    )
    report = pt.check(m)
    assert not report["ok"]
    assert [o["witness"] for o in report["overlaps"]] == ["orders.eu", "audit.x"]  # the second within b
    problems = " | ".join(report["problems"])
    for expected in (
        "name 'a' is used by more than one partition",
        "stream 'A' is used by more than one partition",
        "'foo*': token 1 'foo*' mixes a wildcard",
        "ferry reserves for staging",
        "'>' must be the last token",
    ):
        assert expected in problems


@pytest.mark.parametrize(
    ("pattern", "refused"),
    [
        ("$JS.API.>", "overlaps '$JS.>', which JetStream keeps"),
        ("$JSC.x", "overlaps '$JSC.>', which JetStream keeps"),
        ("$NRG.>", "overlaps '$NRG.>', which JetStream keeps"),
        ("$SYS.REQ.x", "overlaps '$SYS.>', which JetStream keeps"),
        (">", "which ferry reserves"),
        ("*.eu", "overlaps '$JS.>', which JetStream keeps"),  # nats-server 2.11+ refuses it (measured on 2.15.1)
        ("$JS.EVENT.x", None),
        ("$SYS.ACCOUNT.>", None),
        ("$KV.x", None),
    ],
)
def test_check_refuses_what_jetstream_keeps_for_its_api(pattern: str, refused: str | None) -> None:
    report = pt.check(pmap("m", ("a", "A", [pattern])))
    if refused is None:
        assert report["ok"], report["problems"]
    else:
        (problem,) = report["problems"]
        assert refused in problem


def test_check_refuses_stream_names_the_server_would() -> None:
    for name in ("P\nX", "P\rX", "P\fX", "x" * 256):
        (problem,) = pt.check(pmap("m", ("a", name, ["a"])))["problems"]
        assert "may not contain" in problem
    assert pt.check(pmap("m", ("a", "x" * 255, ["a"])))["ok"]


def test_the_same_partition_is_told_by_its_place_not_its_name() -> None:
    report = pt.check(pmap("m", ("eu", "A", ["x.>"]), ("eu", "B", ["x.a"]), ("us", "C", ["y.>", "y.a"])))
    assert [o["same_partition"] for o in report["overlaps"]] == [False, True]
    assert sum("(the same partition" in p for p in report["problems"]) == 1


def test_a_subject_with_a_wildcard_inside_a_token_is_a_literal() -> None:
    m = pmap("m", ("eu", "EU", ["shop.eu.>"]))
    rows = pt.route([m], ["shop.eu.v2*", "shop.eu.a>b", "shop.*x"])
    assert [r.get("owner") for r in rows] == ["eu", "eu", None]
    assert rows[2]["error"] == "no partition owns 'shop.*x'"


def test_route_by_map_and_unowned() -> None:
    m = pmap("m", ("eu", "EU", ["shop.eu.>"]), ("ap", "AP", ["shop.ap.*"]))
    rows = pt.route([m], ["shop.eu.1.x", "shop.ap.1", "shop.ap.1.x", "shop.*"])
    assert [r.get("owner") for r in rows] == ["eu", "ap", None, None]
    assert rows[2]["error"] == "no partition owns 'shop.ap.1.x'"
    assert "literal subject is required" in rows[3]["error"]


def test_foreign_conflicts_cover_patterns_and_stream_names() -> None:
    record = {"maps": {"other": {"map": pmap("other", ("o", "S", ["b.>"])).model_dump(), "by": {"pid": 7}}}}
    assert claims.foreign_conflicts(record, pmap("mine", ("x", "T", ["a.>"]))) == []
    (taken,) = claims.foreign_conflicts(record, pmap("mine", ("x", "S", ["a.>"])))
    assert "stream 'S' of partition 'x' belongs to partition 'o'" in taken
    (overlap,) = claims.foreign_conflicts(record, pmap("mine", ("x", "T", ["*.y"])))
    assert "both would own 'b.y'" in overlap and "pid 7" in overlap


def test_load_map_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "m.yaml"
    bad.write_text("name: m\npartitions:\n  - {name: a, stream: A, replicas: 9, patterns: [a]}\n")
    with pytest.raises(ConfigError, match=r"partitions.0.replicas: Input should be less than or equal to 5"):
        pt.load_map(bad)
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        pt.load_map(bad)


def test_traffic_subjects_nobody_owns(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ferry.schema import ARROW_SCHEMA

    subjects = ["shop.eu.1"] * 3 + ["shop.xx.1"] * 2 + ["other"]
    rows = {n: [None] * len(subjects) for n in ARROW_SCHEMA.names}
    rows["subject"] = subjects
    rows["payload"] = [b"x"] * len(subjects)
    (tmp_path / "snap").mkdir()
    pq.write_table(pa.Table.from_pydict(rows, schema=ARROW_SCHEMA), tmp_path / "snap" / "part-0.parquet")
    m = pmap("m", ("eu", "EU", ["shop.eu.>"]))
    assert pt.unowned_traffic(m, tmp_path / "snap") == [
        {"subject": "other", "messages": 1},
        {"subject": "shop.xx.1", "messages": 2},
    ]
    with pytest.raises(ConfigError, match="no such directory"):
        pt.unowned_traffic(m, tmp_path / "missing")
