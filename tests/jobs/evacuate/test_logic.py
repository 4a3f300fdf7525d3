"""Balance condition, donors/recipients, proposals and pacing of `ferry cluster rebalance` and `ferry node evacuate`."""

from __future__ import annotations

import time

import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ferry.jobs.evacuate.plan import EvacuateRequest, Pacer, RebalanceRequest, propose, split, unavailable, within
from ferry.lab.haproxy import Frontend, render


def test_within_is_emqx_condition() -> None:
    assert within(100, 0, 101, 1.1)  # 100 < 0 + 101
    assert not within(100, 0, 100, 1.1)  # strict
    assert within(105, 100, 0, 1.1)  # 105 < 110
    assert not within(300, 0, 10, 1.1)


def test_split_donors_are_above_average() -> None:
    assert split({"a": 300, "b": 0, "c": 0}) == (["a"], ["b", "c"])
    assert split({"a": 5, "b": 5}) == ([], ["a", "b"])


def test_propose_300_on_one_node() -> None:
    after = propose({"a": 300, "b": 0, "c": 0}, 10, 1.1)
    assert after is not None and sum(after.values()) == 300
    assert within(after["a"], (after["b"] + after["c"]) / 2, 10, 1.1)
    assert after["a"] > after["b"] - 1  # moved only as far as needed
    assert propose({"a": 300, "b": 0, "c": 0}, 1000, 1.1) is None  # within the default absolute threshold
    assert propose({"a": 10, "b": 10, "c": 10}, 0, 1.01) is None
    assert propose({"a": 4, "b": 4, "c": 3}, 1, 1.1) is None  # not within, but no whole move helps


@given(st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 2000), min_size=2), st.integers(0, 50))
def test_propose_conserves_and_balances(counts: dict[str, int], abs_t: int) -> None:
    after = propose(counts, abs_t, 1.1)
    if after is None:
        return
    assert after != counts  # a proposal moves something
    assert sum(after.values()) == sum(counts.values())
    donors, recipients = split(counts)
    d = sum(after[x] for x in donors) / len(donors)
    r = sum(after[x] for x in recipients) / len(recipients)
    assert within(d, r, abs_t, 1.1) or max(after[x] for x in donors) <= min(after[x] for x in recipients) + 1


def test_pacer_holds_the_rate() -> None:
    p = Pacer(50)
    assert p.take(1000) == 1  # the first at once
    time.sleep(0.2)
    assert 9 <= p.take(1000) <= 12
    assert p.take(1000) == 0


def test_pacer_keeps_no_more_than_a_second_of_unused_allowance() -> None:
    p = Pacer(20)
    assert p.take(1000) == 1
    time.sleep(0.6)  # a node restarting: nothing to take meanwhile
    assert p.take(0) == 0
    time.sleep(0.9)  # 1.5 s idle in all: a second's worth (20), not 30
    assert p.take(1000) == 20
    assert p.take(1000) == 0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="must be > 1"):
        RebalanceRequest(cluster="east", rel_conn_threshold=1.0)
    with pytest.raises(pydantic.ValidationError, match="greater than or equal to 1"):
        RebalanceRequest(cluster="east", abs_conn_threshold=0)  # never within: the donors would answer 503 for good
    with pytest.raises(pydantic.ValidationError):
        EvacuateRequest(node="n", conn_evict_rate=-1)
    with pytest.raises(pydantic.ValidationError, match="MQTT 5"):
        EvacuateRequest(node="n", redirect_to=["h:1"])


def test_availability_from_journal_states() -> None:
    states = {
        "evacuation.east.east-1": {"kind": "evacuation", "node": "east-1", "state": "evicting_conns"},
        "rebalance.east": {"kind": "rebalance", "donors": ["east-2"], "state": "waiting_health_check"},
    }
    assert "evacuated" in unavailable(states, "east", "east-1")
    assert "donor" in unavailable(states, "east", "east-2")
    assert unavailable(states, "east", "east-3") == ""
    assert unavailable(states, "west", "east-1") == ""
    # refused by the broker, driven by nobody: the evacuated node stays out, a rebalance's donors come back
    for state in states.values():
        state["refused"] = "management API refused DELETE /connections/x to user 'u': not authorised"
    assert unavailable(states, "east", "east-1") == "being evacuated (evicting_conns, refused: driven by nobody)"
    assert unavailable(states, "east", "east-2") == ""


def test_haproxy_config_checks_node_and_ferry() -> None:
    cfg = render([Frontend("nats_east", "*:4222", [("east-1", "10.0.0.1:4222", 8222, "")])], "127.0.0.1:8377")
    assert "server east-1 10.0.0.1:4222 check addr 10.0.0.1 port 8222" in cfg
    assert "uri-lf /availability_check?node=%[srv_name]" in cfg
    assert "http-check connect addr 127.0.0.1 port 8377" in cfg
    assert "balance leastconn" in cfg


def test_a_rebalance_moves_no_more_than_each_donor_gives_in_its_proposal() -> None:
    from ferry.jobs.evacuate.plan import planned_moves

    proposal = [
        {"node": "a", "sessions": 8, "sessions_after": 6},
        {"node": "b", "sessions": 9, "sessions_after": 6},
        {"node": "c", "sessions": 0, "sessions_after": 5},
    ]
    assert planned_moves(proposal, "sessions") == {"a": 2, "b": 3, "c": 0}


def test_a_dry_run_says_why_it_moves_nothing() -> None:
    from ferry.jobs.evacuate.plan import why_nothing

    # the default --abs-sess-threshold 1000 on a small cluster: the leader side does nothing, and says why
    said = why_nothing("leaders", {"a": 7, "b": 2, "c": 2}, 1000, 1.2, "sess")
    assert said == (
        "leaders: the donors hold 7.0 on average and the recipients 2.0, within --abs-sess-threshold 1,000 "
        "or --rel-sess-threshold 1.2: nothing to move (lower them to balance)"
    )
    assert (
        why_nothing("connections", {"a": 3, "b": 3}, 1, 1.1, "conn") == "connections: even (a 3, b 3): nothing to move"
    )
    assert (
        why_nothing("leaders", {"a": 4, "b": 4, "c": 3}, 1, 1.0, "sess")
        == "leaders: no whole move brings the counts closer"
    )


def test_what_rabbitmq_lost_is_counted_once_its_node_is_back() -> None:
    """A queue's messages counted on its node before they move, the node dead mid-way and back:
    RabbitMQ's loss is what it held less what ferry moved less what it holds again; said once."""
    from types import SimpleNamespace

    from ferry.jobs.evacuate.nodes.rabbitmq import RabbitNodes

    nodes = SimpleNamespace(at_risk={}, lost_by_rabbitmq=[])
    count = RabbitNodes._at_risk
    count(nodes, "/", "q", "r1", 3500)  # type: ignore[arg-type]
    nodes.at_risk[("/", "q")]["moved"] = 500
    count(nodes, "/", "q", "r1", 3000)  # a later round, its node alive: counted afresh
    assert (
        nodes.at_risk[("/", "q")] == {"ready": 3000, "moved": 0, "died": False, "durable": True}
        and not nodes.lost_by_rabbitmq
    )
    nodes.at_risk[("/", "q")].update(moved=1200, died=True)
    count(nodes, "/", "q", "r1", 800)  # back, holding its persistent messages: 1,000 transient died
    assert [x["messages"] for x in nodes.lost_by_rabbitmq] == [1000] and "r1 died" in nodes.lost_by_rabbitmq[0]["note"]
    assert nodes.at_risk[("/", "q")] == {"ready": 800, "moved": 0, "died": False, "durable": True}  # counted afresh
    nodes.at_risk[("/", "q")].update(moved=800, died=True)
    count(nodes, "/", "q", "r1", 0)  # all moved before it died: nothing lost, nothing said
    assert len(nodes.lost_by_rabbitmq) == 1
