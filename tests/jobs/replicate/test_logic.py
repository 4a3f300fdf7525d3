"""Pure logic of `ferry replicate`: where a relay resumes, and the replication's naming."""

from __future__ import annotations

import pytest

from ferry.jobs.replicate.plan import Held, Replication, backlog_from, replicable
from ferry.spark.session import spark_error


def test_resume_after_the_highest_and_recheck_only_holes() -> None:
    assert Held().holes() is None and Held().last == 0  # nothing relayed: start at the beginning
    contiguous = Held(set(range(5, 101)))
    assert contiguous.last == 100 and contiguous.holes() is None  # no hole: nothing to replay
    holes = Held(set(range(5, 101)) - {50, 97})
    assert holes.holes() == (5, 100)  # a dead relay's unacked publishes: re-check 5..100
    whole = Held(set(range(3, 11)), whole=True)
    assert whole.holes() == (1, 10)  # the whole destination was read: 1 and 2 are missing too
    # a finished micro-batch's end is a floor: nothing at or below it is re-checked, even when the
    # destination no longer holds it, and it is the resume point when the scan found less
    assert Held(set(range(5, 101)) - {50}, floor=60).holes() is None
    assert Held(set(range(5, 101)) - {97}, floor=60).holes() == (61, 100)
    assert Held(set(), floor=70).last == 70 and Held(set(), floor=70).holes() is None


def test_mapping_and_key() -> None:
    rep = Replication("nyc", "sfo", "ORD*", subject_prefix="nyc.", stream_name="NYC_{stream}")
    assert rep.key == "relay.nyc.sfo" and rep.dest_stream("ORDERS") == "NYC_ORDERS" and rep.mapped
    assert not Replication("nyc", "sfo").mapped
    assert Replication.from_state({**rep.__dict__, "desired": "running", "owner": None}) == rep
    options = "--streams 'ORD*' --subject-prefix nyc. --stream-name 'NYC_{stream}'"
    assert rep.start_command() == f"ferry replicate start --from nyc --to sfo {options}"
    assert Replication("nyc", "sfo").start_command() == "ferry replicate start --from nyc --to sfo"


@pytest.mark.parametrize("name", ["X", "{streams}"])
def test_stream_name_needs_the_placeholder(name: str) -> None:
    from ferry.errors import UsageError
    from ferry.jobs.replicate.plan import check
    from ferry.topology import Topology

    topo = Topology.model_validate(
        {
            "version": 1,
            "sites": {
                s: {"clusters": {s: {"kind": "nats", "brokers": [{"name": f"{s}-1", "url": "nats://127.0.0.1:4222"}]}}}
                for s in ("nyc", "sfo")
            },
        }
    )
    with pytest.raises(UsageError, match="must contain"):
        check(topo, Replication("nyc", "sfo", stream_name=name))


def test_each_stream_is_relayed_to_the_server_that_leads_its_destination() -> None:
    import json

    from ferry.spark.jetstream import JetStreamDataSource
    from ferry.topology import NatsCluster

    def cluster(name: str) -> str:
        brokers = [{"name": f"{name}-{i}", "url": f"nats://127.0.0.1:{4222 + i}"} for i in (1, 2, 3)]
        return NatsCluster(kind="nats", brokers=brokers).model_dump_json()

    relay_to = {"cluster": cluster("west"), "cluster_name": "west", "leaders": {"A": "west-2"}}
    options = {"cluster": cluster("east"), "stream": "A,B", "relay_to": json.dumps(relay_to)}
    relay = JetStreamDataSource(options).streamReader(None).relay
    assert relay is not None and relay["A"].leader == "west-2" and relay["B"].leader == ""
    assert relay["A"].name == relay["B"].name == "west"  # the rest of the write options as given


def test_a_glob_leaves_out_each_site_s_own_streams() -> None:
    names = ["ORDERS", "KV_ferry_journal", "$MQTT_sess", "$MQTT_msgs", "OTHER"]
    assert replicable(names, "*") == ["ORDERS", "OTHER"]
    assert replicable(names, "$MQTT_*") == []


def test_a_failed_relay_query_is_told_by_its_cause() -> None:
    """Spark's first line of a streaming source's failure is its own; the task's exception comes last."""
    text = (
        "[PYTHON_STREAMING_DATA_SOURCE_RUNTIME_ERROR] Failed when Python streaming data source perform "
        "latestOffset: Traceback (most recent call last):\n"
        '  File "/x/ferry/pipeline/jetstream.py", line 700, in latestOffset\n'
        "    return asyncio.run(self._latest())\n"
        "ferry.errors.BrokerUnavailable: cannot connect to nyc: connection refused\n"
        "\tat org.apache.spark.sql.execution.python.PythonStreamingSourceRunner.latestOffset(x.scala:1)\n"
    )
    assert str(spark_error(Exception(text))) == "cannot connect to nyc: connection refused"


def test_a_stopped_replication_stands_at_its_marker_else_at_its_last_progress_less_what_is_foreign() -> None:
    after_failback = {"progress": {"A": {"relayed": 100, "foreign": 40}, "B": {"relayed": 7}}}
    assert backlog_from(after_failback) == ({"A": 100, "B": 7}, {"A": 40, "B": 0})
    # a graceful stop's marker is exact: nothing after it is taken for foreign
    stopped = {**after_failback, "marker": {"A": 150}}
    assert backlog_from(stopped) == ({"A": 150, "B": 7}, {"B": 0})


def test_a_consumer_copy_is_paused_positioned_by_reset_and_marked() -> None:
    from types import SimpleNamespace

    from nats.js.api import ConsumerConfig, DeliverPolicy

    from ferry.jobs.replicate.consumers import ORIGIN, Position, copied, copy_config, rpo, unmatched

    cfg = ConsumerConfig(durable_name="d", deliver_policy=DeliverPolicy.NEW, filter_subjects=["a.1", "a.2"])
    seqs = SimpleNamespace
    # 10 deliveries above the floor, 4 pending: 6 acknowledged out of order (delivered again elsewhere)
    info = SimpleNamespace(
        name="d",
        config=cfg,
        ack_floor=seqs(consumer_seq=20, stream_seq=200),
        delivered=seqs(consumer_seq=30, stream_seq=215),
        num_ack_pending=4,
    )
    p = Position.of("ORDERS", info)
    assert (p.ack_floor, p.acked_above_floor) == (200, 6)
    copy = copy_config(p, "nyc", subject_prefix="nyc.")
    assert copy.deliver_policy == DeliverPolicy.ALL and copy.opt_start_seq is None  # a reset positions it
    assert copy.filter_subjects == ["nyc.a.1", "nyc.a.2"] and copy.pause_until
    assert copied(copy) and copy.metadata and copy.metadata[ORIGIN] == "nyc" and not copied(cfg)
    row = {"stream": "ORDERS", "consumer": "d", "ack_floor": 200, "position": 181, "acked_above_floor": 6, "at": 100.0}
    refused = {**row, "consumer": "mine", "refused": "ORDERS has a consumer mine of its own"}
    said, not_carried = rpo({"consumers": [row, refused]}, now=103.0)
    assert said["redelivered_at_least"] == 6 and said["checkpoint_age_s"] == 3.0 and said["position"] == 181
    assert "refused" not in said and not_carried["refused"] == refused["refused"]
    assert unmatched(p, ["a.>"]) is None and unmatched(p, ["a.1"]) is None  # one filter of two is enough
    assert unmatched(p, ["b.>", "a.3"]) == "its filter a.1, a.2 matches none of ORDERS's subjects (b.>, a.3)"
    assert unmatched(Position("ORDERS", "all", {}, 0, 0), ["b.>"]) is None  # no filter: every subject
