"""`ferry replicate start | run | stop | status` and `ferry site failover | failback`."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from ferry.cli.options import (
    PLAIN,
    AccountOpt,
    JsonOpt,
    MetricsPortOpt,
    SparkArchive,
    SparkMaster,
    SparkRemote,
    TopologyOpt,
    open_topology,
    run,
)
from ferry.cli.render import err, json_event, out, per_stream, plain_event, print_json, utc_time

# -- replicate / site ---------------------------------------------------------------------------

replicate_app = typer.Typer(
    **PLAIN, help="Relay streams from one site to another (a Spark streaming job).", no_args_is_help=True
)
site_app = typer.Typer(**PLAIN, help="Fail a site over to its replica, and back.", no_args_is_help=True)


FromOpt = Annotated[str, typer.Option("--from", help="Source site (a NATS cluster of the topology).")]
ToOpt = Annotated[str, typer.Option("--to", help="Destination site.")]


@replicate_app.command("start")
def replicate_start(
    source: FromOpt,
    to: ToOpt,
    streams: Annotated[str, typer.Option(help="Glob over the source's stream names.")] = "*",
    subject_prefix: Annotated[str, typer.Option(help="Prefix added to subjects at the destination.")] = "",
    stream_name: Annotated[str, typer.Option(help="Destination stream name; {stream} is the source's.")] = "{stream}",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be relayed; change nothing.")] = False,
    account: AccountOpt = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Define a replication (kept at the destination) and create missing destination streams.

    Relays are the `ferry replicate run` processes: run one or more (one relays, the others stand by).
    With --account, the replication of that account's streams, kept in that account (give the same
    --account to `run`, `stop` and `status`).
    """
    from ferry.jobs import replicate as rp

    rep = rp.Replication(source, to, streams, subject_prefix, stream_name)
    result = run(rp.start(open_topology(topology).in_account(account), rep, dry_run=dry_run))
    if as_json:
        print_json(result)
        return
    pairs = ", ".join(f"{a} -> {b}" for a, b in result.get("dest_streams", {}).items())
    verb = "would relay" if dry_run else "already running:" if result.get("already") else "defined:"
    prefix = f", subjects prefixed with {subject_prefix!r}" if subject_prefix else ""
    out.print(
        f"{source} -> {to} {verb} {pairs}{prefix}" + (" (already running so)" if dry_run and result["already"] else "")
    )
    if result.get("created"):
        out.print(f"created at {to}: {', '.join(result['created'])}")
    if not dry_run:
        out.print(f"run relays with: {rp.relay_command(source, to, account)}")


@replicate_app.command("run")
def replicate_run(
    source: FromOpt,
    to: ToOpt,
    lease: Annotated[float, typer.Option(min=2, help="Seconds after which a standby takes over a silent relay.")] = 5.0,
    consumer_interval: Annotated[
        float,
        typer.Option(
            min=0,
            max=3600,
            help="Seconds between checkpoints of the source's durable consumers, copied paused to the "
            "destination at their translated positions (0: none).",
        ),
    ] = 3.0,
    metrics_port: MetricsPortOpt = None,
    spark_master: SparkMaster = None,
    spark_remote: SparkRemote = None,
    spark_archive: SparkArchive = None,
    account: AccountOpt = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Relay (or stand by to relay) a defined replication until `ferry replicate stop`."""
    from ferry.jobs import replicate as rp
    from ferry.spark.session import factory

    topo = open_topology(topology).in_account(account)
    metrics = rp.Metrics(metrics_port, account) if metrics_port else None

    spark = factory(spark_master, spark_remote, archive=spark_archive, app_name=f"ferry relay {source} to {to}")

    emit = json_event if as_json else plain_event
    relay = rp.Relay(topo, source, to, spark, lease=lease, emit=emit, metrics=metrics, consumers=consumer_interval)
    state = run(relay.run())
    if as_json:
        print_json(state)


@replicate_app.command("stop")
def replicate_stop(
    source: FromOpt,
    to: ToOpt,
    wait: Annotated[float, typer.Option(min=0, help="Seconds to wait for the relay's stop marker.")] = 30.0,
    account: AccountOpt = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Stop a replication gracefully: the relay writes a stop marker, so its successor needs no replay check."""
    from ferry.jobs import replicate as rp

    state = run(rp.stop(open_topology(topology).in_account(account), source, to, wait=wait))
    if as_json:
        print_json(state)
        return
    marker = state.get("marker")
    positions = ", ".join(f"{k} {v:,}" for k, v in marker.items()) if isinstance(marker, dict) else marker
    out.print(f"{source} -> {to} stopped" + (f"; positions: {positions}" if marker else "; the next start will scan"))


@replicate_app.command("status")
def replicate_status(account: AccountOpt = None, topology: TopologyOpt = None, as_json: JsonOpt = False) -> None:
    """Every replication (of the account): state, relay leader, per stream last relayed sequence, lag and rate."""
    from ferry.jobs import replicate as rp

    rows = run(rp.status(open_topology(topology).in_account(account)))
    if as_json:
        print_json(rows)
        return
    if not rows:
        out.print("no replication is defined")
        return
    out.print(status_table(rows))
    consumers = [(r, c) for r in rows for c in r.get("consumers") or []]
    if consumers:
        table = Table("replication", "stream", "consumer", "acked up to (source)", "delivers from (dest)", "age s")
        for r, c in consumers:
            unmatched = " (its filter matches no subject)" if "unmatched" in c else ""
            where = c.get("refused") or f"{c['position']:,}{unmatched}"
            table.add_row(f"{r['source']} -> {r['dest']}", c["stream"], c["consumer"], f"{c['ack_floor']:,}", where,
                          f"{c['age_s']:,}")  # fmt: skip
        out.print(table)


def status_table(rows: list[dict[str, Any]]) -> Table:
    """`replicate status` as a table: one row per replication and stream; a site that did not
    answer says why in its state."""
    table = Table("replication", "state", "leader", "stream", "relayed", "lag", "lag s", "rate/s")
    for r in rows:
        name = f"{r.get('source', '?')} -> {r.get('dest')}"
        if r.get("unreachable"):
            table.add_row(name, f"[red]unreachable[/]: {escape(r['unreachable'])}", *[""] * 6)
            continue
        leader = f"{r['leader']['host']}:{r['leader']['pid']}" if r.get("leader") else "-"
        state = r.get("summary") or f"{r.get('state')} ({r.get('desired')})"
        progress = r.get("progress") or {"": {}}
        for stream, p in progress.items():
            cells = [p.get(k) for k in ("relayed", "lag", "lag_s", "rate")]
            table.add_row(name, state, leader, stream, *("-" if c is None else f"{c:,}" for c in cells))
            if p.get("lag_at") == "last relay":
                table.caption = "lag as the last relay saw it where the source did not answer now"
    return table


@site_app.command("status")
def site_status(account: AccountOpt = None, topology: TopologyOpt = None, as_json: JsonOpt = False) -> None:
    """Which site is primary, by each site's own record, with its last failover and fail-back
    (--account: of that account's replications)."""
    from ferry.jobs import replicate as rp

    rows = run(rp.site_status(open_topology(topology).in_account(account)))
    if as_json:
        print_json(rows)
        return
    table = Table("site", "primary (its record)", "last failover", "last fail-back", "fail-back running")
    for r in rows:
        if r.get("unreachable"):
            table.add_row(r["site"], "[red]unreachable[/]", escape(r["unreachable"]), "", "")
            continue
        fo, fb = r.get("failover") or {}, r.get("failback") or {}
        table.add_row(
            r["site"],
            r.get("primary") or "-",
            f"from {fo['from']} at {utc_time(int(fo['at']))}" if fo else "-",
            f"from {fb['from']} at {utc_time(int(fb['at']))}" if fb else "-",
            "yes" if r["failback_running"] else "no",
        )
    out.print(table)


@site_app.command("failover")
def site_failover(
    to: Annotated[str, typer.Option("--to", help="The site that becomes primary.")],
    source: Annotated[
        str | None, typer.Option("--from", help="The failed site (default: the one replicating).")
    ] = None,
    reverse: Annotated[
        bool, typer.Option("--reverse", help="Then define TO -> FROM replication once FROM is reachable.")
    ] = False,
    wait: Annotated[float, typer.Option(min=0, help="With --reverse: seconds to wait for FROM.")] = 600.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what TO holds so far; change nothing.")] = False,
    account: AccountOpt = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Stop FROM -> TO (fencing its relay), record the last sequence TO holds per stream, make TO primary.

    With --account, the replication of that account's streams (each account's sites fail over apart)."""
    from ferry.jobs import replicate as rp

    emit = json_event if as_json else plain_event
    topo = open_topology(topology).in_account(account)
    result = run(rp.failover(topo, to, source, emit=emit, reverse=reverse, wait=wait, dry_run=dry_run))
    if as_json:
        print_json(result)
        return
    if dry_run:
        reach = "reachable" if result["source_reachable"] else "not reachable"
        out.print(
            f"dry run: would fence {result['from']} -> {to} ({result['relay']}) and make {to} primary; "
            f"{result['from']} sequences {to} holds so far: {per_stream(result['replicated'])}; "
            f"{result['from']} is {reach}",
            highlight=False,
        )
        _consumer_rpo(result["consumers"], to, "would deliver")
        return
    fo = result["failover"]
    out.print(f"{to} is primary (was {fo['from']}); {fo['from']} sequences {to} holds: {per_stream(fo['replicated'])}")
    _consumer_rpo(fo["consumers"], to, "delivers")
    if result.get("reverse"):
        out.print(f"defined {to} -> {fo['from']}; run relays with: {rp.relay_command(to, fo['from'], account)}")


def _consumer_rpo(rows: list[dict], site: str, verb: str) -> None:
    """A line per durable consumer copied to `site`: where it delivers from, what it may deliver again."""
    for r in rows:
        if "refused" in r:
            out.print(f"consumer {r['stream']}/{r['consumer']} not carried: {r['refused']}", highlight=False)
            continue
        if "unmatched" in r:
            out.print(f"consumer {r['stream']}/{r['consumer']}: {r['unmatched']}", highlight=False)
        age = f"{r['checkpoint_age_s']:.1f}s"
        out.print(
            f"consumer {r['stream']}/{r['consumer']} {verb} from {site} sequence {r['position']:,} (acked up to "
            f"{r['ack_floor']:,} at the source {age} before); delivered again: {r['redelivered_at_least']:,} it "
            f"acknowledged out of order, and what it acknowledged in those {age}",
            highlight=False,
        )


@site_app.command("failback")
def site_failback(
    to: Annotated[str, typer.Option("--to", help="The site that becomes primary again.")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be reconciled.")] = False,
    spark_master: SparkMaster = None,
    spark_remote: SparkRemote = None,
    spark_archive: SparkArchive = None,
    account: AccountOpt = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Reconcile both sites by origin sequence (exactly once each way), make TO primary, define TO -> other.

    With --account, the sites of that account's replication."""
    from ferry.jobs import replicate as rp
    from ferry.spark.session import factory

    spark = factory(
        spark_master, spark_remote, archive=spark_archive, app_name=f"ferry site failback to {to}", data_sources=False
    )

    emit = json_event if as_json else plain_event
    try:
        report = run(rp.failback(open_topology(topology).in_account(account), to, spark, emit=emit, dry_run=dry_run))
    except KeyboardInterrupt:
        if not dry_run:
            err.print(
                f"the failback to {to} is unfinished: run the same command again to finish it "
                "(what it copied stays, and nothing is copied twice)",
                highlight=False,
            )
        raise
    if as_json:
        print_json(report)
        return
    if report.get("already"):
        fb = report["failback"]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(fb["at"]))
        out.print(f"{to} is primary already (failed back from {fb['from']} at {when}): nothing to fail back")
        return
    primary = report["primary"] if dry_run else report["primary_was"]
    if dry_run:
        table = Table(
            "stream",
            f"{to}'s relayed to {primary} at failover",
            f"{to}'s last seq",
            f"{to}'s past that (recovered to {primary})",
            f"{primary} holds",
        )
        for s, r in report["streams"].items():
            last, held = r["last_seq"], r["primary_messages"]
            table.add_row(
                s,
                f"{r['replicated']:,}",
                "missing" if last is None else f"{last:,}",
                f"{r['after_replicated']:,}",
                "missing" if held is None else f"{held:,}",
            )
        out.print(table)
        out.print(
            f"would: stop {primary} -> {to} if it runs; copy to {primary} what {to} acked but never relayed; "
            f"bring to {to} what {primary} holds and {to} lacks; define {to} -> {primary} again; make {to} primary"
        )
        return
    table = Table("stream", "RPO (acked, never relayed)", f"recovered to {primary}", f"brought to {to}")
    for s, r in report["streams"].items():
        before = r["rpo"] - r["recovered"]  # at the primary before this run (an interrupted one's copies)
        recovered = f"{r['recovered']:,}" + (f" (+{before:,} already there)" if before > 0 else "")
        table.add_row(s, f"{r['rpo']:,}", recovered, f"{r['brought']:,}")
    out.print(table)
    for s, r in report["streams"].items():
        for c in r.get("consumers") or []:
            out.print(
                f"consumer {s}/{c['consumer']} delivers from {to} sequence {c['position']:,} (where it stood at "
                f"{primary}); delivered again: {c['redelivered_at_least']:,} it acknowledged out of order there",
                highlight=False,
            )
    out.print(report["replication"])


def register(app: typer.Typer) -> None:
    """Add replicate's commands to `app`."""
    app.add_typer(replicate_app, name="replicate")
    app.add_typer(site_app, name="site")
