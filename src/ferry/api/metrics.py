"""``GET /metrics``: every operation on record, as Prometheus families, made from what `ferry serve`
has read (:mod:`ferry.api.watch`) — a scrape never waits on a broker. The family names are fixed
(``dashboards/ferry.json`` and ``dashboards/alerts.yml`` rely on them); the live figures that
come from a broker carry their age in ``ferry_live_read_age_seconds``.

A relay run with ``--metrics-port`` serves the ``ferry_relay_*`` families itself, from the
figures only it knows (:class:`Relay`); labels are never secrets (names of clusters, nodes,
streams, vhosts and queues only)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ferry.api.audits import Audits
from ferry.api.watch import STATES, Registry, account_of, operation_id, relaying, state_of
from ferry.brokers.rabbitmq import queue_path
from ferry.jobs.replicate.relay import RelayFamilies


class JournalCollector(Collector):
    """The families of every operation `reg` has on record."""

    def __init__(self, reg: Registry, audits: Audits) -> None:
        self.reg, self.audits = reg, audits

    def collect(self) -> Iterator[Metric]:
        reg, now = self.reg, time.time()
        ops = GaugeMetricFamily(
            "ferry_operations", "Operations on record per job kind and state", labels=["kind", "state"]
        )
        ratio = GaugeMetricFamily(
            "ferry_operation_progress_ratio",
            "Progress of an operation whose job knows its total (0..1)",
            labels=["kind", "id"],
        )
        missed = CounterMetricFamily(
            "ferry_move_missed",
            "Messages the last move of a stream found missing and reinjected from its capture",
            labels=["stream"],
        )
        reinjected = CounterMetricFamily(
            "ferry_move_reinjected", "Messages the last move of a stream reinjected", labels=["stream"]
        )
        unavail = GaugeMetricFamily(
            "ferry_move_unavailable_seconds",
            "Seconds the stream did not take publishes during its last move",
            labels=["stream"],
        )
        conns = GaugeMetricFamily(
            "ferry_evacuation_connections",
            "Client connections on a node being evacuated, as last read",
            labels=["cluster", "node"],
        )
        evicted = CounterMetricFamily(
            "ferry_evacuation_evicted", "Client connections an evacuation closed on a node", labels=["cluster", "node"]
        )
        available = GaugeMetricFamily(
            "ferry_node_available",
            "1 when the availability check answers 200 for the node, 0 when 503",
            labels=["cluster", "node"],
        )
        relay = RelayFamilies()
        left = GaugeMetricFamily(
            "ferry_failback_messages_left", "Messages left in a queue a DR fail-back drains", labels=["vhost", "queue"]
        )
        dups = CounterMetricFamily(
            "ferry_failback_duplicates",
            "Messages a DR fail-back may have delivered twice (redelivered)",
            labels=["vhost", "queue"],
        )
        started = GaugeMetricFamily(
            "ferry_relay_started",
            "1 while a replication is started (`replicate start`), 0 once stopped",
            labels=["account", "from", "to"],
        )
        in_state = GaugeMetricFamily(
            "ferry_operation_state_age_seconds",
            "Seconds an operation has been in its state",
            labels=["kind", "id", "state"],
        )
        age = GaugeMetricFamily(
            "ferry_live_read_age_seconds", "Age of the live figures behind a family", labels=["what"]
        )
        journal_age = GaugeMetricFamily(
            "ferry_journal_read_age_seconds", "Age of serve's last read of a cluster's journal", labels=["cluster"]
        )

        counts = {(k, s): 0 for k, states in STATES.items() for s in states}
        for cname, key, kind, st in reg.operations():
            state = state_of(kind, st)
            counts[kind, state] = counts.get((kind, state), 0) + 1
            oid = operation_id(reg.where(cname), key, kind, st)
            if since := st.get("since") or st.get("started"):
                with contextlib.suppress(TypeError, ValueError):
                    in_state.add_metric([kind, oid, state], max(0.0, now - float(since)))
            if (p := reg.progress(cname, kind, st)) is not None:
                ratio.add_metric([kind, oid], p)
            if kind == "move" and (res := st.get("result")):
                missed.add_metric([oid], float(res.get("missed") or 0))
                reinjected.add_metric([oid], float(res.get("reinjected") or 0))
                unavail.add_metric([oid], float(res.get("unavailable_s") or 0))
            elif kind == "evacuation":
                node = str(st.get("node"))
                evicted.add_metric([cname, node], float(st.get("evicted", {}).get("connections", 0)))
                if read := reg.live.get(f"node:{cname}:{node}"):
                    conns.add_metric([cname, node], read[1]["connections"])
                    age.add_metric([f"node:{cname}:{node}"], now - read[0])
            elif kind == "relay" and st.get("source"):
                rep = [account_of(cname) or "", str(st["source"]), str(st["dest"])]
                figures, at = reg.relay_progress(cname, key, st)
                relay.active.add_metric(rep, 1.0 if relaying(st) else 0.0)
                started.add_metric(rep, 1.0 if st.get("desired") == "running" else 0.0)
                for stream, p in sorted(figures.items()):
                    relay.add(rep, stream, p)
                relay.add_consumers(rep, st.get("consumers") or [], now)
                if at:
                    age.add_metric([f"relay:{oid}"], max(0.0, now - float(at)))
            elif kind == "dr_failback":
                for (vhost, queue), n in sorted((reg.failback_left(cname, st) or {}).items()):
                    left.add_metric([vhost, queue], n)
                for x in st.get("queues") or []:
                    n = (st.get("duplicates") or {}).get(queue_path(x["vhost"], x["queue"]), 0)
                    dups.add_metric([x["vhost"], x["queue"]], float(n))
                if read := reg.live.get(f"queues:{cname}"):
                    age.add_metric([f"queues:{cname}"], now - read[0])
        for (kind, state), n in sorted(counts.items()):
            ops.add_metric([kind, state], n)
        for cname, cluster in sorted(reg.clusters.items()):
            for b in cluster.brokers:
                available.add_metric([cname, b.name], 0.0 if reg.unavailable(cname, b.name) else 1.0)
        for journal, read_at in sorted(reg.read_at.items()):
            journal_age.add_metric([journal], time.monotonic() - read_at)
        yield from (ops, ratio, missed, reinjected, unavail, conns, evicted, available)
        yield from (in_state, *relay, started, left, dups, age, journal_age)
        yield from self.audits.collect()


def render(families: Iterable[Metric]) -> bytes:
    """The Prometheus text format (0.0.4) of gauge and counter `families`, byte for byte what
    ``prometheus_client.generate_latest`` writes for them (a test holds them equal). Written here
    because the library's spends about 15 µs a line validating and escaping every label name:
    54 ms of a 70 ms scrape with 1,000 relay streams (bench/RESULTS.md)."""
    out = []
    for m in families:
        name = m.name + "_total" if m.type == "counter" else m.name
        doc = m.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {m.type}\n")
        for s in m.samples:
            value = floatToGoString(s.value)
            if s.labels:
                labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(s.labels.items()))
                out.append(f"{s.name}{{{labels}}} {value}\n")
            else:
                out.append(f"{s.name} {value}\n")
    return "".join(out).encode()


def _escape(value: str) -> str:
    if "\\" not in value and "\n" not in value and '"' not in value:  # nearly every name
        return value
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
