"""The move's pure logic: identities, what the stream missed, the unavailability window, verification."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ferry.brokers.nats.jsapi import Server, ts_ns
from ferry.headers import REINJECTED, encode_headers
from ferry.jobs.move import run as move_run
from ferry.jobs.move.plan import destination_refusal, handoff_candidate
from ferry.jobs.move.verify import verify
from ferry.jobs.shared.guard import CAPTURE_SCHEMA, identity, missing, read_captures, unavailable_window


def captured(rows: list[tuple[str, dict[str, str] | None, bytes]]) -> pa.Table:
    return pa.Table.from_pydict(
        {
            "recv_ns": list(range(len(rows))),
            "subject": [r[0] for r in rows],
            "header_block": [encode_headers(r[1]) if r[1] else None for r in rows],
            "payload": [r[2] for r in rows],
            "identity": [identity(*r) for r in rows],
        },
        schema=CAPTURE_SCHEMA,
    )


def test_captures_are_read_in_the_order_heard_across_files_and_a_torn_tail_is_dropped(tmp_path: Path) -> None:
    def write(name: str, recv: list[int], torn: bool = False) -> None:
        t = captured([("s", None, str(r).encode()) for r in recv]).set_column(0, "recv_ns", pa.array(recv, pa.int64()))
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, CAPTURE_SCHEMA) as w:
            for batch in t.to_batches(max_chunksize=2):
                w.write_batch(batch)
        data = sink.getvalue().to_pybytes()
        (tmp_path / name).write_bytes(data[:-20] if torn else data)

    write("capture-9-1.arrow", [1, 2, 3])
    assert read_captures(tmp_path)["recv_ns"].to_pylist() == [1, 2, 3]
    write("capture-10-2.arrow", [7, 8, 9, 10, 11], torn=True)  # a later run, sorted first by name; killed
    write("capture-11-3.arrow", [4, 5, 6])  # heard between the two
    got = read_captures(tmp_path)
    assert got["recv_ns"].to_pylist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert got["payload"].to_pylist() == [str(r).encode() for r in range(1, 11)]


def test_a_standby_guards_rows_count_only_beyond_what_the_drivers_heard(tmp_path: Path) -> None:
    """The driver heard a, b (killed), its rerun d; serve's standby heard b, c, c, d, e at the same
    time: each message as often as the guard that heard it most (c twice: two identical publishes)."""

    def write(name: str, heard: list[tuple[int, str]]) -> None:
        t = captured([("s", None, p.encode()) for _, p in heard])
        t = t.set_column(0, "recv_ns", pa.array([r for r, _ in heard], pa.int64()))
        with pa.ipc.new_stream(tmp_path / name, CAPTURE_SCHEMA) as w:
            w.write_table(t)

    write("capture-9-1.arrow", [(1, "a"), (2, "b")])
    write("capture-10-5.arrow", [(7, "d")])
    write("standby-ip-10-0-0-1-77-1.arrow", [(2, "b"), (3, "c"), (4, "c"), (7, "d"), (8, "e")])
    got = read_captures(tmp_path)
    assert got["payload"].to_pylist() == [b"a", b"b", b"c", b"c", b"d", b"e"]
    assert got["recv_ns"].to_pylist() == sorted(got["recv_ns"].to_pylist())
    write("standby-other-78-2.arrow", [(3, "c"), (9, "f")])  # a second serve: c once, f new
    assert read_captures(tmp_path)["payload"].to_pylist() == [b"a", b"b", b"c", b"c", b"d", b"e", b"f"]


def test_identity_uses_msg_id_else_content_and_ignores_the_reinjection_mark() -> None:
    assert identity("a", {"Nats-Msg-Id": "x"}, b"1") == identity("b", {"Nats-Msg-Id": "x"}, b"2") == "id:x"
    plain = identity("a", {"k": "v"}, b"1")
    assert plain == identity("a", {"k": "v", REINJECTED: "m1", "Nats-Expected-Last-Sequence": "4"}, b"1")
    assert plain != identity("a", {"k": "w"}, b"1") != identity("b", {"k": "v"}, b"1")
    assert identity("a", None, b"1") != identity("a", None, b"2")


def test_missing_counts_content_copies_and_msg_ids_once() -> None:
    rows = [
        ("s", None, b"same"),
        ("s", None, b"same"),
        ("s", None, b"same"),
        ("s", {"Nats-Msg-Id": "m"}, b"x"),
        ("s", {"Nats-Msg-Id": "m"}, b"x"),  # a producer's retry of the same id
        ("s", {"Nats-Msg-Id": "n"}, b"y"),
    ]
    table = captured(rows)
    stored = [(identity("s", None, b"same"), 1), (identity("s", {"Nats-Msg-Id": "n"}, b"y"), 2)]
    rows_missing, first = missing(table, stored)
    assert rows_missing == [1, 2, 3]  # two of three identical copies, and msg id m once
    assert first[identity("s", None, b"same")] == 0


@given(st.lists(st.integers(0, 3), max_size=30), st.lists(st.integers(0, 3), max_size=30))
def test_missing_is_the_multiset_difference(heard: list[int], held: list[int]) -> None:
    table = captured([("s", None, bytes([h])) for h in heard])
    stored = [(identity("s", None, bytes([h])), 0) for h in held]
    rows, _ = missing(table, stored)
    for v in range(4):
        expected = max(0, heard.count(v) - held.count(v))
        assert sum(1 for r in rows if heard[r] == v) == expected


def test_unavailable_window_is_the_longest_stored_gap_with_traffic_inside() -> None:
    ms = 1_000_000
    stored = [0, 1 * ms, 2 * ms, 50 * ms, 51 * ms, 400 * ms]  # the 350 ms gap had no publishes
    heard = [0, 1 * ms, 2 * ms, 10 * ms, 30 * ms, 50 * ms, 51 * ms, 400 * ms]
    assert unavailable_window(heard, stored, 0) == 0.048
    # the capture clock 5 s behind the store clock: same answer once offset
    assert unavailable_window([h - 5000 * ms for h in heard], stored, 5000 * ms) == 0.048
    assert unavailable_window([], stored, 0) == 0.0


def test_verify_names_each_problem() -> None:
    consumer = {"config": {"durable_name": "C", "ack_policy": "explicit", "num_replicas": 0}, "ack_floor": 10}
    pre = {
        "messages": 100,
        "first_seq": 1,
        "last_seq": 100,
        "subjects": {"a": 60, "b": 40},
        "consumers": {"C": {**consumer, "delivered": 10}},
    }
    post = {**pre, "messages": 150, "last_seq": 150, "subjects": {"a": 90, "b": 60}}
    assert verify(pre, post) == []
    post_c = {"C": {**consumer, "config": {**consumer["config"], "num_replicas": 3}, "delivered": 12}}
    assert verify(pre, {**post, "consumers": post_c}) == []  # replicas follow the placement
    bad = {
        **post,
        "messages": 149,
        "subjects": {"a": 59, "b": 60},
        "consumers": {"C": {**consumer, "ack_floor": 9, "delivered": 200}},
    }
    problems = verify(pre, bad)
    assert any("149 messages" in p for p in problems)
    assert any("subject a" in p for p in problems)
    assert any("ack floor went back" in p for p in problems)
    assert any("points past" in p for p in problems)
    assert verify(pre, {**post, "consumers": {}}) == ["consumer C is gone"]
    # under load the consumers are read after the stream: the stream's later last_seq is the bound
    ahead = {"C": {**consumer, "delivered": 160}}
    assert verify(pre, {**post, "consumers": ahead, "last_seq_after_consumers": 165}) == []
    assert any("points past" in p for p in verify(pre, {**post, "consumers": ahead, "last_seq_after_consumers": 155}))


def test_destination_refusal_counts_only_healthy_servers() -> None:
    gb = 1 << 30
    servers = [
        Server("w1", "west", [], gb, False),
        Server("w2", "west", [], gb, True),
        Server("w3", "west", [], 10, False),
    ]
    refusal = destination_refusal(servers, 3, 1000, "west")
    assert refusal == (
        "destination west has 1 healthy server(s) for an R3 stream (offline or lame duck: w2; not enough storage: w3)"
    )
    assert destination_refusal(servers, 1, 1000, "west") is None


def test_ts_ns_parses_jetstream_times() -> None:
    assert ts_ns("1970-01-01T00:00:01.5Z") == 1_500_000_000
    assert ts_ns("2026-11-21T10:00:00.123456789Z") % 1_000_000_000 == 123_456_789
    assert ts_ns("") == 0


def test_paged_fetches_what_a_cluster_list_names_missing(monkeypatch) -> None:
    """A clustered STREAM.LIST leaves out streams whose leader was late and names them `missing`:
    they are fetched one by one, counted in the offset, and never silently dropped."""
    import asyncio

    from ferry.brokers.nats import jsapi

    pages = {
        0: {"total": 4, "streams": [{"config": {"name": "A"}}], "missing": ["B"]},
        2: {"total": 4, "streams": [{"config": {"name": "C"}}, {"config": {"name": "D"}}], "missing": ["D"]},
    }
    asked = []

    async def api(nc, subject, payload=None, timeout=5.0):
        asked.append(payload["offset"])
        return pages[payload["offset"]]

    async def info(name):
        return {"config": {"name": name}, "fetched": True}

    async def collect(info):
        return [i async for i in jsapi.paged(None, "$JS.API.STREAM.LIST", "streams", info)]

    monkeypatch.setattr(jsapi, "api", api)
    got = asyncio.run(collect(info))
    assert [(i["config"]["name"], "fetched" in i) for i in got] == [
        ("A", False),
        ("B", True),
        ("C", False),
        ("D", False),
    ]
    assert asked == [0, 2]
    with pytest.raises(jsapi.FerryError, match="no answer about B"):
        asyncio.run(collect(None))


def info_with(leader: str, status: str | None, replicas: list[tuple[str, bool, int, float]], n: int = 3) -> dict:
    cluster: dict = {
        "leader": leader,
        "replicas": [{"name": r[0], "current": r[1], "lag": r[2], "active": r[3]} for r in replicas],
    }
    if status:
        line = "waiting for desired peers to catch up" if status == "catchup" else "adding peer west-1"
        cluster["desired"] = {"status": {"type": status, "description": line}}
    return {"config": {"num_replicas": n}, "cluster": cluster}


def test_handoff_waits_for_a_current_destination_majority_and_a_server_that_reports_its_migration() -> None:
    west = {"west-1", "west-2", "west-3"}
    caught_up = [
        ("east-2", True, 0, 0.1),
        ("west-1", True, 0, 0.02),
        ("west-2", True, 0, 0.01),
        ("west-3", True, 0, 0.3),
    ]
    assert handoff_candidate(info_with("east-1", "catchup", caught_up), west) == "west-2"  # heard from last
    # a server that does not report its migration (before 2.15), or is doing something else
    assert handoff_candidate(info_with("east-1", None, caught_up), west) is None
    assert handoff_candidate(info_with("east-1", "membership", caught_up), west) is None
    adding = info_with("east-1", "catchup", caught_up)
    adding["cluster"]["desired"]["status"]["description"] = "waiting for peer to catch up before adding it"
    assert handoff_candidate(adding, west) is None
    # the leader already in the destination
    assert handoff_candidate(info_with("west-3", "catchup", caught_up), west) is None
    # a majority of the destination is enough, and only a current peer is named
    lagging = [*caught_up[:2], ("west-2", True, 4, 0.0), ("west-3", True, 0, 0.3)]
    assert handoff_candidate(info_with("east-1", "catchup", lagging), west) == "west-1"
    assert handoff_candidate(info_with("east-1", "catchup", lagging), west, keep="west-3") == "west-3"
    assert handoff_candidate(info_with("east-1", "catchup", lagging), west, keep="west-2") == "west-1"  # lagging
    # not while two of three are behind, or before every destination peer is in the group
    behind = [*caught_up[:2], ("west-2", False, 0, 0.0), ("west-3", True, 9, 0.3)]
    assert handoff_candidate(info_with("east-1", "catchup", behind), west) is None
    assert handoff_candidate(info_with("east-1", "catchup", caught_up[:3]), west) is None


def test_watch_hands_off_once_when_the_destination_is_ready(monkeypatch) -> None:
    """`_watch` asks for the step-down only once the destination is ready and the peer's own
    health check passes, names the peer, and asks once."""
    import asyncio

    from ferry.brokers.nats import jsapi

    ready = [("east-2", True, 0, 0.1), ("west-1", True, 0, 0.2), ("west-2", True, 0, 0.01), ("west-3", True, 0, 0.3)]
    lagging = [ready[0], ("west-1", False, 0, 0.2), ("west-2", True, 0, 0.01), ("west-3", True, 7, 0.3)]
    placement = {"cluster": "west"}
    script = [
        info_with("east-1", "membership", ready),  # the server is adding peers
        info_with("east-1", "catchup", lagging),  # two of three destination peers behind
        info_with("east-1", "catchup", ready),  # west-2 says it cannot lead yet
        info_with("east-1", "catchup", ready),  # west-2 ready (the one heard from last) ...
        info_with("east-1", "catchup", ready),  # ... and still, HANDOFF_STEADY_S later,
        info_with("east-1", "catchup", lagging),  # but the last look finds it alone current:
        info_with("east-1", "catchup", ready),  # ready again,
        info_with("east-1", "catchup", ready),  # steady again HANDOFF_STEADY_S later,
        info_with("east-1", "catchup", ready),  # and in the last look: hand off
        info_with("east-1", "catchup", ready),  # not asked again
        info_with("west-2", "membership", [("west-1", True, 0, 0.1), ("west-3", True, 0, 0.1)]),
    ]
    for i in script:
        i["config"]["placement"] = placement
        i["state"] = {"last_seq": 1}
    asked: list[tuple[str, dict | None, int]] = []
    events: list[tuple[str, dict]] = []

    async def api(nc, subject, payload=None, timeout=5.0):
        if ".STEPDOWN." in subject:
            asked.append((subject, payload, len(script)))  # polls left: which poll it followed
            return {"success": True}
        return script.pop(0)

    healthy = iter([False, True, True, True, True])

    async def ready_to_lead(sysnc, server, account, stream, leader):
        assert (server, account, stream, leader) == ("west-2", "APP", "S", "east-1")
        return next(healthy)

    monkeypatch.setattr(move_run, "api", api)
    monkeypatch.setattr(jsapi, "api", api)  # stream_info asks through it
    monkeypatch.setattr(move_run, "ready_to_lead", ready_to_lead)
    monkeypatch.setattr(move_run, "HANDOFF_STEADY_S", 0.05)  # one poll

    async def started(sysnc, server):  # each server's start time: none restarted
        return f"{server} started"

    monkeypatch.setattr(move_run, "_started", started)
    journal = SimpleNamespace(
        state={
            "dest_servers": ["west-1", "west-2", "west-3"],
            "origin_servers": ["east-1", "east-2", "east-3"],
            "placement": placement,
            "account": "APP",
            "started": time.time(),
            "capture_dir": "/nonexistent",
        },
        save_soon=lambda **_: None,
    )
    req = SimpleNamespace(stream="S", timeout=60)
    outcome, watched = asyncio.run(
        move_run._watch(None, None, req, journal, lambda e, **d: events.append((e, d)), None, time.monotonic())
    )
    assert outcome == "moved"
    assert asked == [("$JS.API.STREAM.LEADER.STEPDOWN.S", {"placement": {"preferred": "west-2"}}, 2)]
    assert watched["handoff"]["from"] == "east-1" and watched["handoff"]["to"] == "west-2"
    assert [d["to"] for e, d in events if e == "handoff"] == ["west-2"]
    assert watched["leader_changes"][0]["to"] == "west-2"
    assert not watched["leader_changes"][0].get("lost")  # a step-down, not a death


def test_a_leader_that_died_is_said_once_with_what_its_death_cost() -> None:
    """The result names what died with a lost leader (inherent) and where the guard listened."""
    changes = [
        {"at_s": 1.0, "from": "east-1", "to": "east-2", "lost": True},
        {"at_s": 2.0, "from": "east-2", "to": "west-1"},  # a step-down: nothing to say
    ]
    events: list[tuple[str, dict]] = []
    guard = SimpleNamespace(server="east-3", deaf_s=0.0)
    (said,) = move_run._leaders_lost(changes, guard, lambda e, **d: events.append((e, d)))  # type: ignore[arg-type]
    assert said["server"] == "east-1" and said["guard_on"] == "east-3" and said["at_s"] == 1.0
    assert "reached only east-1" in said["inherent"] and "deaf" not in said["guarded"]
    assert events == [("leader_lost", said)]
    guard.deaf_s = 2.5
    (said,) = move_run._leaders_lost(changes, guard, lambda e, **d: None)  # type: ignore[arg-type]
    assert "deaf 2.5s" in said["guarded"]
    (said,) = move_run._leaders_lost(changes, None, lambda e, **d: None)
    assert said["guard_on"] is None and said["guarded"].startswith("nothing")


def test_an_older_ferrys_capture_is_read_with_its_headers_and_identities(tmp_path: Path) -> None:
    """Captures written before the header block was kept as it came (pairs; before that, no
    identity) read as this ferry's: a move resumed after an upgrade re-publishes them alike."""
    pairs = pa.map_(pa.string(), pa.string())
    rows = {"recv_ns": [1, 2], "subject": ["a", "b"], "headers": [[("Nats-Msg-Id", "x"), ("k", "v")], None]}
    rows |= {"payload": [b"1", b"2"]}
    older = pa.schema([("recv_ns", pa.int64()), ("subject", pa.string()), ("headers", pairs), ("payload", pa.binary())])
    with pa.ipc.new_stream(tmp_path / "capture-1-1.arrow", older) as w:
        w.write_table(pa.Table.from_pydict(rows, schema=older))
    old = older.append(pa.field("identity", pa.string()))
    with pa.ipc.new_stream(tmp_path / "capture-2-2.arrow", old) as w:
        w.write_table(pa.Table.from_pydict({**rows, "recv_ns": [3, 4], "identity": ["id:x", "c:2"]}, schema=old))
    got = read_captures(tmp_path)
    assert got.schema == CAPTURE_SCHEMA
    assert got["identity"].to_pylist() == ["id:x", identity("b", None, b"2"), "id:x", "c:2"]
    assert got["header_block"].to_pylist() == [b"NATS/1.0\r\nNats-Msg-Id: x\r\nk: v\r\n\r\n", None] * 2
