"""`ferry node evacuate | status | stop` and `ferry cluster rebalance | status | stop`."""

from __future__ import annotations

import time
from collections import Counter
from typing import Annotated, Any

import typer
from rich.table import Table

from ferry.cli.options import (
    PLAIN,
    JsonOpt,
    MetricsPortOpt,
    SparkArchive,
    SparkMaster,
    SparkRemote,
    TopologyOpt,
    name_list,
    open_topology,
    run,
)
from ferry.cli.render import err, json_event, out, plain_event, print_json
from ferry.jobs.shared.metrics import EventMetrics
from ferry.spark.session import factory

# -- evacuate / rebalance / serve -----------------------------------------------------------

node_app = typer.Typer(
    **PLAIN, help="Evacuate a node: move its clients and JetStream leaders away at a set rate.", no_args_is_help=True
)
cluster_app = typer.Typer(**PLAIN, help="Rebalance clients and leaders across a cluster's nodes.", no_args_is_help=True)

NodeClusterOpt = Annotated[str, typer.Option("--cluster", help="The node's cluster (when its name is ambiguous).")]
WaitHealthOpt = Annotated[
    float, typer.Option(min=0, help="Seconds for the load balancer to see the node unavailable before evicting.")
]
ConnRateOpt = Annotated[int, typer.Option(min=1, help="Connections closed per second (per node).")]
WaitTakeoverOpt = Annotated[float, typer.Option(min=0, help="Seconds for clients to reconnect before moving sessions.")]
SessRateOpt = Annotated[int, typer.Option(min=1, help="Leaders and replicas moved per second (per node).")]
GuardOpt = Annotated[
    bool,
    typer.Option(help="NATS: capture each stream's subjects while its leader steps down; re-publish what it missed."),
]


class _Ticker:
    """Prints operation events on stderr: state changes at once, eviction counts at most once a second."""

    def __init__(self, as_json: bool) -> None:
        self.as_json, self.last, self.counts = as_json, 0.0, Counter[str]()

    def __call__(self, event: str, **data: Any) -> None:
        if self.as_json:
            json_event(event, **data)
        elif event == "evicted":
            self.counts.update({k: data.get(k, 0) for k in ("connections", "sessions", "replicas")})
            if time.monotonic() - self.last >= 1.0:
                self.last = time.monotonic()
                left = f", {data['left']:,} left" if "left" in data else ""
                done = ", ".join(f"{v:,} {k}" for k, v in self.counts.items() if v)
                err.print(f"  moved so far: {done}{left}", highlight=False)
        elif event != "plan":  # the plan is in the final report
            plain_event(event, **data)


@node_app.command("evacuate")
def node_evacuate(
    node: Annotated[str, typer.Argument(help="The node (broker name in the topology).")],
    cluster: NodeClusterOpt = "",
    wait_health_check: WaitHealthOpt = 60.0,
    conn_evict_rate: ConnRateOpt = 500,
    wait_takeover: WaitTakeoverOpt = 60.0,
    sess_evict_rate: SessRateOpt = 500,
    guard: GuardOpt = True,
    migrate_to: Annotated[str | None, typer.Option(help="Nodes to move leaders to (comma list).")] = None,
    redirect_to: Annotated[str | None, typer.Option(help="MQTT 5 redirection targets (not offered by NATS).")] = None,
    relocate_rate: Annotated[
        int | None,
        typer.Option(
            min=1, metavar="MSGS", help="Messages per second when relocating a classic queue (unpaced if unset)."
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what the node holds; change nothing.")] = False,
    spark_master: SparkMaster = None,
    spark_remote: SparkRemote = None,
    spark_archive: SparkArchive = None,
    topology: TopologyOpt = None,
    metrics_port: MetricsPortOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Empty a node at a set rate (EMQX's evacuation); resumes a persisted one. Returns once it is prohibiting."""
    from ferry.jobs.evacuate.plan import EvacuateRequest
    from ferry.jobs.evacuate.run import evacuate

    topo = open_topology(topology)
    req = EvacuateRequest(
        node=node,
        cluster=cluster,
        wait_health_check=wait_health_check,
        conn_evict_rate=conn_evict_rate,
        wait_takeover=wait_takeover,
        sess_evict_rate=sess_evict_rate,
        guard=guard,
        migrate_to=name_list(migrate_to),
        redirect_to=name_list(redirect_to),
        relocate_rate=relocate_rate,
        dry_run=dry_run,
    )
    spark = factory(
        spark_master, spark_remote, archive=spark_archive, app_name=f"ferry evacuate {node}"
    )  # relocates classic queues
    report = run(evacuate(topo, req, EventMetrics("evacuation", metrics_port).wrap(_Ticker(as_json)), spark=spark))
    if as_json:
        print_json(report)
        return
    _print_evacuation(report)


def _print_evacuation(r: dict[str, Any]) -> None:
    i = r["initial"]
    rates = r["rates"]
    out.print(
        f"{r['node']} ({r['cluster']}): {r.get('outcome', r.get('state'))}; state {r.get('state', '-')}; "
        f"conn rate {rates['conn_evict_rate']}/s, session rate {rates['sess_evict_rate']}/s, "
        f"wait health check {rates['wait_health_check']:g}s, wait takeover {rates['wait_takeover']:g}s"
        + (f", relocate rate {rates['relocate_rate']:,}/s" if rates.get("relocate_rate") else ""),
        highlight=False,
    )
    now = r.get("now") or r.get("current") or {}
    table = Table("", "connections", "mqtt", "sessions (leaders)", "replicas (followers)")
    table.add_row("initial", *(f"{i[k]:,}" for k in ("connections", "mqtt", "sessions", "replicas")))
    if now:
        table.add_row("current", *(f"{now.get(k, 0):,}" for k in ("connections", "mqtt", "sessions", "replicas")))
    ev = r.get("evicted") or {}
    table.add_row(
        "moved by ferry",
        f"{ev.get('connections', 0):,}",
        "",
        f"{ev.get('sessions', 0):,}",
        f"{ev.get('replicas', 0):,}",
    )
    out.print(table)
    out.print(
        "moved by ferry: leaders stepped down (or classic queues relocated, or one-replica streams moved with "
        "their consumers), followers moved off (a peer-remove); other leaders left with their replicas, and "
        "followers with no spare server to go to stay (kept)",
        style="dim",
        highlight=False,
    )
    out.print(f"recipients: {', '.join(r['recipients'])}", highlight=False)
    if r.get("relocated"):
        moves = ", ".join(f"{x['queue']} -> {x['to']}" for x in r["relocated"])
        out.print(f"classic queues relocated: {moves}", highlight=False)
    for x in r.get("lost_by_rabbitmq") or []:
        out.print(f"lost by RabbitMQ: {x['messages']:,} messages of {x['queue']} ({x['note']})", highlight=False)
    if r.get("singles_moved"):
        moved = ", ".join(r["singles_moved"])
        out.print(f"one-replica streams moved (scaled to 2, led elsewhere, back to 1): {moved}", highlight=False)
    if r.get("kept"):
        out.print(f"kept on the node (not movable): {', '.join(r['kept'])}", highlight=False)
    if r.get("outcome") == "evacuated":
        out.print(f"`ferry node stop {r['node']}` returns it to service; until then `ferry serve` keeps it empty")


@node_app.command("status")
def node_status_cmd(
    node: Annotated[str | None, typer.Argument(help="One node (default: every evacuation).")] = None,
    cluster: NodeClusterOpt = "",
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Evacuations on record: state, rates, initial and current connections and sessions, recipients."""
    from ferry.jobs.evacuate.status import node_status

    rows = run(node_status(open_topology(topology), node, cluster))
    if as_json:
        print_json(rows)
        return
    if not rows:
        out.print(f"no evacuation of {node} on record: it is in service" if node else "no evacuation is running")
    for r in rows:
        _print_evacuation(r)
        out.print("driven by: " + _driver_line(r), highlight=False)


def _driver_line(r: dict[str, Any]) -> str:
    """Who drives a journaled evacuation or rebalance, for `ferry node status` / `cluster status`."""
    from ferry.jobs.evacuate.plan import way_on

    if driver := r.get("driven_by"):
        return f"{driver['host']} pid {driver['pid']}"
    if r.get("refused"):
        return f"nobody: the broker refused its driver ({r['refused']}); {way_on(r)}"
    return "nobody (ferry serve adopts it)"


@node_app.command("stop")
def node_stop(
    node: Annotated[str, typer.Argument()],
    cluster: NodeClusterOpt = "",
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """End an evacuation: the node returns to service (the health check answers 200 again)."""
    from ferry.jobs.evacuate.status import stop

    r = run(stop(open_topology(topology), cluster, node))
    if as_json:
        print_json(r)
        return
    out.print(
        f"evacuation of {node} stopped (was {r.get('state')}); the node is back in service "
        "(`ferry serve` reads the journal twice a second: its availability check says so within 1 s)"
    )


@cluster_app.command("rebalance")
def cluster_rebalance(
    cluster: Annotated[str, typer.Argument(help="The NATS or RabbitMQ cluster.")],
    nodes: Annotated[str | None, typer.Option(help="Participating nodes (comma list; default: all).")] = None,
    abs_conn_threshold: Annotated[
        float, typer.Option(min=1, help="Balanced if avg(donor) < avg(recipient) + this.")
    ] = 1000,
    rel_conn_threshold: Annotated[float, typer.Option(help="... or avg(donor) < avg(recipient) * this (> 1).")] = 1.1,
    abs_sess_threshold: Annotated[
        float, typer.Option(min=1, help="The same for leaders (JetStream, quorum queues).")
    ] = 1000,
    rel_sess_threshold: Annotated[float, typer.Option(help="The same for leaders (> 1).")] = 1.1,
    wait_health_check: WaitHealthOpt = 60.0,
    conn_evict_rate: ConnRateOpt = 500,
    wait_takeover: WaitTakeoverOpt = 60.0,
    sess_evict_rate: SessRateOpt = 500,
    guard: GuardOpt = True,
    execute: Annotated[
        bool, typer.Option("--execute", help="Carry the proposal out (default: only print it).")
    ] = False,
    topology: TopologyOpt = None,
    metrics_port: MetricsPortOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Propose moving clients and leaders from busy nodes to idle ones; --execute carries it out."""
    from ferry.jobs.evacuate.plan import RebalanceRequest
    from ferry.jobs.evacuate.run import rebalance

    req = RebalanceRequest(
        cluster=cluster,
        nodes=name_list(nodes),
        abs_conn_threshold=abs_conn_threshold,
        rel_conn_threshold=rel_conn_threshold,
        abs_sess_threshold=abs_sess_threshold,
        rel_sess_threshold=rel_sess_threshold,
        wait_health_check=wait_health_check,
        conn_evict_rate=conn_evict_rate,
        wait_takeover=wait_takeover,
        sess_evict_rate=sess_evict_rate,
        guard=guard,
        execute=execute,
    )
    r = run(rebalance(open_topology(topology), req, EventMetrics("rebalance", metrics_port).wrap(_Ticker(as_json))))
    if as_json:
        print_json(r)
    else:
        _print_rebalance(r)
    if r["outcome"].startswith("aborted"):
        raise typer.Exit(1)


def _print_rebalance(r: dict[str, Any]) -> None:
    if "proposal" in r:
        table = Table("node", "role", "connections", "after", "leaders to move", "after", "kept")
        for p in r["proposal"]:
            table.add_row(
                p["node"],
                p["role"],
                f"{p['connections']:,}",
                f"{p['connections_after']:,}",
                f"{p['sessions']:,}",
                f"{p['sessions_after']:,}",
                f"{p.get('sessions_kept', 0):,}",
            )
        out.print(table)
        out.print("kept: leaders no step-down can move (an R1 stream, another account's)", style="dim")
        for node, labels in (r.get("kept") or {}).items():
            if labels:
                more = f" and {len(labels) - 5:,} more" if len(labels) > 5 else ""
                out.print(f"  kept on {node}: {', '.join(labels[:5])}{more}", highlight=False)
    for note in r.get("notes") or []:
        out.print(f"note: {note}", highlight=False)
    outcome = r["outcome"]
    if outcome == "dry-run":
        out.print("dry run: nothing changed; add --execute to carry it out")
    elif outcome == "nothing to balance":
        out.print(f"nothing to balance: {r['cluster']} is within the thresholds")
    else:
        ev = r.get("evicted", {})
        out.print(
            f"rebalance of {r['cluster']}: {outcome}; moved {ev.get('connections', 0):,} connections, "
            f"{ev.get('sessions', 0):,} leaders",
            highlight=False,
        )
        for n in r.get("now", []):
            out.print(f"  {n['node']}: {n['connections']:,} connections, {n['sessions']:,} leaders", highlight=False)


@cluster_app.command("status")
def cluster_status(
    cluster: Annotated[str | None, typer.Argument(help="One cluster (default: every one).")] = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The rebalance running in each cluster: state, donors, recipients, last counts, what moved."""
    from ferry.jobs.evacuate.status import rebalance_status

    rows = run(rebalance_status(open_topology(topology), cluster or ""))
    if as_json:
        print_json(rows)
        return
    if not rows:
        out.print(f"no rebalance of {cluster} is running" if cluster else "no rebalance is running")
    for r in rows:
        ev = r.get("evicted") or {}
        out.print(
            f"rebalance of {r['cluster']}: state {r.get('state')}; donors {', '.join(r.get('donors') or []) or '-'}, "
            f"recipients {', '.join(r.get('recipients') or []) or '-'}; moved {ev.get('connections', 0):,} "
            f"connections, {ev.get('sessions', 0):,} leaders; "
            f"driven by {_driver_line(r)}",
            highlight=False,
        )
        counts = r.get("counts") or {}
        if counts:
            out.print("  last counts: " + ", ".join(f"{n} {c:,}" for n, c in counts.items()), highlight=False)


@cluster_app.command("stop")
def cluster_stop(
    cluster: Annotated[str, typer.Argument()], topology: TopologyOpt = None, as_json: JsonOpt = False
) -> None:
    """Stop a running rebalance: its donors return to service."""
    from ferry.jobs.evacuate.status import stop

    r = run(stop(open_topology(topology), cluster, None))
    if as_json:
        print_json(r)
        return
    out.print(f"rebalance of {cluster} stopped (was {r.get('state')})")


def register(app: typer.Typer) -> None:
    """Add node's commands to `app`."""
    app.add_typer(node_app, name="node")
    app.add_typer(cluster_app, name="cluster")
