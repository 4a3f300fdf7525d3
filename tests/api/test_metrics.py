"""What `/metrics` and the console make of the journals serve has read: pure logic, states injected
(the real brokers, Prometheus and Chromium are in test_console.py)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ferry.api.audits import Audits
from ferry.api.console import view
from ferry.api.metrics import JournalCollector, render
from ferry.api.watch import Registry, kind_of
from ferry.jobs.shared.metrics import EventMetrics
from ferry.journal import Journal
from ferry.topology import Topology
from tests.helpers import UNREACHABLE, VALID

TWO_CLUSTERS = VALID.replace(
    "  dr:\n",
    """      west:
        kind: nats
        credentials: {user: app, password_env: FERRY_T_APP}
        brokers:
          - name: west-1
            url: nats://127.0.0.1:4223
  dr:
""",
)
assert "west-1" in TWO_CLUSTERS


@pytest.fixture
def registry(topology_of: Callable[[str], Topology]) -> Registry:
    return Registry(topology_of(TWO_CLUSTERS))


class Fixed:
    """A collector of families made once (the same values for both renderings)."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


def scrape(reg: Registry) -> str:
    """/metrics's text, checked equal to what prometheus_client writes for the same families."""
    families = list(JournalCollector(reg, Audits(None)).collect())
    r = CollectorRegistry(auto_describe=False)
    r.register(Fixed(families))  # type: ignore[arg-type]
    text = render(families).decode()
    assert text == generate_latest(r).decode()
    return text


def sample(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and ",".join(sorted(line[len(name) + 1 : line.index("}")].split(","))) == want:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_every_job_on_record_is_counted_once_with_its_figures(registry: Registry) -> None:
    now = time.time()
    move = {"phase": "done", "started": now - 30, "result": {"missed": 12, "reinjected": 12, "unavailable_s": 0.03}}
    evac = {
        "kind": "evacuation", "cluster": "east", "node": "east-1", "state": "evicting_conns", "since": now - 5,
        "initial": {"connections": 40}, "evicted": {"connections": 10},
    }  # fmt: skip
    relay = {
        "source": "nyc", "dest": "sfo", "desired": "running", "state": "relaying", "lease": 5,
        "owner": Journal.owner(), "heartbeat": now, "progress_at": now,
        "progress": {"ORDERS": {"relayed": 90, "source_last": 100, "lag": 10, "lag_s": 1.5, "rate": 20.0}},
    }  # fmt: skip
    failback = {
        "phase": "transferring", "source": "ltm", "target": "pc1",
        "queues": [{"vhost": "/", "queue": "q1", "before": 100}], "duplicates": {"%2F/q1": 3},
        "upstreams": [{"value": {"uri": "amqp://ferry:hunter2@pc1"}}],
    }  # fmt: skip
    src, dst = "jetstream://east/ORDERS", "parquet:///tmp/orders"
    copying = {"kind": "copy", "state": "running", "source": src, "destination": dst, "messages": 200, "copied": 50,
               "owner": Journal.owner(), "heartbeat": now}  # fmt: skip
    dead_copy = {**copying, "source": "jetstream://east/OTHER", "heartbeat": now - 60}  # its ferry died
    # a map whose repartition is unfinished: its claim's figures and its journal's phase (watch.py merges them)
    pmap = {"kind": "partition", "map": "orders", "state": "repartitioning", "partitions": 3, "phase": "switching"}
    east = {
        "move.ORDERS": move, "evacuation.east.east-1": evac, "relay.nyc.sfo": relay,
        "copy.1": copying, "copy.2": dead_copy, "partition.orders": pmap,
    }  # fmt: skip
    # the clusters of one NATS site read one bucket: the move is seen through east and west
    registry.states = {
        "east": east,
        "west": dict(east),
        "ltm": {"dr-failback": failback},
    }
    registry.read_at = dict.fromkeys(registry.states, time.monotonic())
    registry.live["queues:ltm"] = (now, {("/", "q1"): 25})
    text = scrape(registry)
    assert sample(text, "ferry_operations", kind="move", state="done") == 1
    assert sample(text, "ferry_operations", kind="evacuation", state="evicting_conns") == 1
    assert sample(text, "ferry_operations", kind="relay", state="relaying") == 1
    assert sample(text, "ferry_operations", kind="dr_failback", state="transferring") == 1
    assert sample(text, "ferry_operations", kind="rebalance", state="waiting_takeover") == 0  # every state, even unused
    assert sample(text, "ferry_operations", kind="copy", state="running") == 1
    assert sample(text, "ferry_operations", kind="copy", state="interrupted") == 1
    assert sample(text, "ferry_operations", kind="copy", state="done") == 0
    assert sample(text, "ferry_operations", kind="partition", state="repartitioning") == 1
    (shown,) = [o for o in view(registry, Audits(None))["operations"] if o["kind"] == "partition"]
    assert shown["detail"] == "3 partition(s), repartition switching", shown
    assert sample(text, "ferry_operation_progress_ratio", kind="copy", id=f"{src} -> {dst}") == 0.25
    assert sample(text, "ferry_move_missed_total", stream="ORDERS") == 12
    assert sample(text, "ferry_operation_progress_ratio", kind="evacuation", id="east/east-1") == 0.25
    assert sample(text, "ferry_operation_progress_ratio", kind="dr_failback", id="ltm->pc1") == 0.75
    assert sample(text, "ferry_node_available", cluster="east", node="east-1") == 0
    assert sample(text, "ferry_node_available", cluster="west", node="west-1") == 1
    assert (
        sample(text, "ferry_relay_lag_messages", **{"account": "", "from": "nyc", "to": "sfo", "stream": "ORDERS"})
        == 10
    )
    assert sample(text, "ferry_relay_active", **{"account": "", "from": "nyc", "to": "sfo"}) == 1
    assert sample(text, "ferry_failback_messages_left", vhost="/", queue="q1") == 25
    assert sample(text, "ferry_failback_duplicates_total", vhost="/", queue="q1") == 3
    assert "hunter2" not in text and "hunter2" not in str(view(registry, Audits(None)))
    # a relay whose owner died: not active, its lag read at the source instead of its last report
    registry.states["east"]["relay.nyc.sfo"] = {**relay, "heartbeat": now - 60}
    registry.live["lag:relay.nyc.sfo"] = (now, {"ORDERS": {"relayed": 90, "source_last": 130, "lag": 40, "lag_s": 9.0}})
    text = scrape(registry)
    assert sample(text, "ferry_relay_active", **{"account": "", "from": "nyc", "to": "sfo"}) == 0
    assert (
        sample(text, "ferry_relay_lag_messages", **{"account": "", "from": "nyc", "to": "sfo", "stream": "ORDERS"})
        == 40
    )


def test_another_accounts_operations_are_read_from_its_own_journal_and_labelled(
    topology_of: Callable[[str], Topology],
) -> None:
    """A NATS cluster's other accounts keep their own journals: serve reads each (east@SALES) and
    tells their operations apart from the default account's of the same names."""
    with_sales = TWO_CLUSTERS.replace(
        "    system_credentials: {user: sys, password_env: FERRY_T_SYS}\n",
        "    system_credentials: {user: sys, password_env: FERRY_T_SYS}\n"
        "        accounts: {SALES: {user: sales, password_env: FERRY_T_APP}}\n",
    )
    registry = Registry(topology_of(with_sales))
    assert set(registry.journals) == {"east", "east@SALES", "west", "ltm"}
    assert registry.journals["east@SALES"].credentials.user == "sales"  # type: ignore[union-attr]
    now = time.time()
    progress = {"ORDERS": {"relayed": 90, "lag": 10, "lag_s": 2.5, "rate": 50.0}}
    relay = {"source": "nyc", "dest": "sfo", "state": "relaying", "desired": "running", "owner": Journal.owner(),
             "heartbeat": now, "progress": progress}  # fmt: skip
    stopped = {**relay, "state": "stopped", "desired": "stopped", "heartbeat": now - 60}
    registry.states = {"east": {"relay.nyc.sfo": relay}, "east@SALES": {"relay.nyc.sfo": stopped}}
    registry.read_at = dict.fromkeys(registry.states, time.monotonic())
    registry.live["lag:relay.nyc.sfo@SALES"] = (now, {"ORDERS": {"relayed": 90, "lag": 700, "lag_s": 9.0}})
    text = scrape(registry)
    assert sample(text, "ferry_operations", kind="relay", state="relaying") == 1
    assert sample(text, "ferry_operations", kind="relay", state="stopped") == 1
    assert sample(text, "ferry_relay_active", **{"account": "", "from": "nyc", "to": "sfo"}) == 1
    assert sample(text, "ferry_relay_active", **{"account": "SALES", "from": "nyc", "to": "sfo"}) == 0
    sales = {"account": "SALES", "from": "nyc", "to": "sfo", "stream": "ORDERS"}
    assert sample(text, "ferry_relay_lag_messages", **sales) == 700  # read at SALES's source
    assert sample(text, "ferry_relay_lag_messages", **{**sales, "account": ""}) == 10
    assert sample(text, "ferry_journal_read_age_seconds", cluster="east@SALES") is not None
    got = view(registry, Audits(None))
    assert sorted(o["id"] for o in got["operations"]) == ["nyc->sfo", "nyc->sfo@SALES"], got["operations"]
    assert sorted((r["account"] or "", r["streams"][0]["lag"]) for r in got["relays"]) == [("", 10), ("SALES", 700)]


def test_only_evacuations_and_rebalances_of_its_own_cluster_are_adopted(registry: Registry) -> None:
    dead = {"owner": {"host": "elsewhere", "pid": 1}, "heartbeat": time.time() - 60}
    registry.states = {
        "east": {
            "move.ORDERS": {**dead, "phase": "moving"},  # a move is resumed by rerunning it, never by serve
            "relay.nyc.sfo": {**dead, "state": "relaying"},
            "evacuation.east.east-1": {**dead, "kind": "evacuation", "cluster": "east", "node": "east-1"},
        },
        "west": {"evacuation.east.east-1": {**dead, "kind": "evacuation", "cluster": "east", "node": "east-1"}},
    }
    registry.read_at = dict.fromkeys(registry.states, time.monotonic())
    assert [(c, k) for c, k, _ in registry.orphans()] == [("east", "evacuation.east.east-1")]
    assert kind_of("site-failback", {}) == "site_failback" and kind_of("site", {}) == "site_failover"


def test_a_changes_of_state_is_an_event_once_whichever_cluster_saw_it(registry: Registry) -> None:
    registry._saw("east", {}, {"move.A": {"phase": "moving"}})
    registry._saw("west", {}, {"move.A": {"phase": "moving"}})
    registry._saw("east", {"move.A": {"phase": "moving"}}, {})
    assert [(e[1], e[2], e[3], e[4]) for e in registry.events] == [
        ("move", "A", None, "moving"),
        ("move", "A", "moving", None),
    ]


def test_a_jobs_own_metrics_are_its_events_numbers_only() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    m = EventMetrics("evacuation", None)
    emit = m.wrap(lambda event, **data: seen.append((event, data)))
    emit("evicted", connections=5, left=20, node="east-1", ok=True)
    emit("evicted", connections=3, left=17, node="east-1")
    assert seen[1] == ("evicted", {"connections": 3, "left": 17, "node": "east-1"})
    r = CollectorRegistry(auto_describe=False)
    r.register(m)  # type: ignore[arg-type]
    text = generate_latest(r).decode()
    assert sample(text, "ferry_job_events_total", kind="evacuation", event="evicted") == 2
    assert sample(text, "ferry_job_event_value", kind="evacuation", event="evicted", field="left") == 17
    assert "east-1" not in text and 'field="ok"' not in text


def test_audit_reports_are_read_from_the_folder_and_nothing_outside_it(tmp_path) -> None:
    import json

    (tmp_path / "a.html").write_text("<html></html>")
    (tmp_path / "a.json").write_text(json.dumps({"tiers": {"west": {"lost": 2}}, "sent": {"sent": 10}, "pass": False}))
    (tmp_path / "not-audit.json").write_text("[1, 2]")
    os.utime(tmp_path / "a.json")
    audits = Audits(tmp_path)
    (only,) = audits.reports()
    assert only["name"] == "a" and only["tiers"]["west"]["lost"] == 2 and only["sent"] == 10 and not only["pass"]
    assert audits.html("a") == tmp_path / "a.html" and audits.html("../a") is None
    r = CollectorRegistry(auto_describe=False)
    r.register(audits)  # type: ignore[arg-type]
    assert sample(generate_latest(r).decode(), "ferry_audit_messages", tier="west", outcome="lost") == 2


def test_metrics_and_api_docs_answer_at_once_offline_with_no_broker_answering(
    topology_of: Callable[[str], Topology],
) -> None:
    """Nothing listens where the topology points: /metrics still answers at once (from what serve
    has, here nothing), the console's data needs the token, and the API docs load no script from
    a CDN (an air-gapped operations network)."""
    from fastapi.testclient import TestClient

    from ferry.api import create_app

    with TestClient(create_app(topology_of(UNREACHABLE), "tok")) as client:
        auth = {"Authorization": "Bearer tok"}
        t0 = time.monotonic()
        got = client.get("/metrics", headers=auth)
        assert got.status_code == 200 and time.monotonic() - t0 < 1.0
        assert 'ferry_node_available{cluster="east",node="east-1"} 1.0' in got.text  # fails open, as the check
        assert client.get("/metrics").status_code == 401 and client.get("/api/console").status_code == 401
        assert client.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
        docs = client.get("/docs").text
        assert "cdn" not in docs.lower()
        scripts = re.findall(r'src="([^"]+)"', docs)
        assert scripts and all(client.get(s).status_code == 200 for s in scripts), scripts
        page = client.get("/")
        assert page.status_code == 200 and "console.js" in page.text  # the page itself holds no data


def test_the_text_format_escapes_names_from_user_data_as_prometheus_client_does() -> None:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def families() -> list[Any]:
        g = GaugeMetricFamily("ferry_x", "help with \\ and\nnewline", labels=["queue", "vhost"])
        g.add_metric(['a "quoted" \\ q\nx', "/"], 1.5)
        g.add_metric(["é-ü", "v"], float("inf"))
        c = CounterMetricFamily("ferry_y", "count")
        c.add_metric([], 3)
        return [g, c]

    r = CollectorRegistry(auto_describe=False)
    r.register(Fixed(families()))  # type: ignore[arg-type]
    assert render(families()) == generate_latest(r)
