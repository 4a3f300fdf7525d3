"""`ferry partition check | route | plan | apply`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

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
    via_cluster,
)
from ferry.cli.render import err, event_line, json_event, out, print_json, progress_bar
from ferry.jobs.shared.metrics import EventMetrics
from ferry.spark.session import factory

# -- proof: load, snapshot, audit -----------------------------------------------------------


# -- partition ------------------------------------------------------------------------------

partition_app = typer.Typer(
    **PLAIN, help="Subjects partitioned across JetStream streams, with exact ownership.", no_args_is_help=True
)
MapArg = Annotated[Path, typer.Argument(help="Partition map (YAML).")]
ViaOpt = Annotated[
    str | None, typer.Option("--via", help="Topology cluster to connect through (default: the first NATS one).")
]


@partition_app.command("check")
def partition_check(
    file: MapArg,
    traffic: Annotated[
        Path | None, typer.Option("--traffic", help="A `ferry snapshot` directory: report subjects nobody owns.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Report invalid patterns, every overlapping pair (with a subject both own) and unowned traffic."""
    from ferry.jobs import partition as pt

    pmap = pt.load_map(file)
    report = pt.check(pmap)
    if traffic:
        report["unowned_traffic"] = pt.unowned_traffic(pmap, traffic)
        report["ok"] = report["ok"] and not report["unowned_traffic"]
    if as_json:
        print_json(report)
    else:
        for line in report["problems"]:
            err.print(f"problem: {line}", highlight=False)
        for x in report.get("unowned_traffic", []):
            why = x.get("problem") or "has no owner"
            err.print(f"unowned: {x['subject']!r} ({x['messages']:,} messages) {why}", highlight=False)
        if report["ok"]:
            out.print(
                f"ok: map {pmap.name}: {report['partitions']} partitions, {report['patterns']} patterns, no overlap"
            )
    if not report["ok"]:
        raise typer.Exit(1)


@partition_app.command("route")
def partition_route(
    subjects: Annotated[list[str], typer.Argument(help="Literal subjects to route.")],
    map_file: Annotated[
        Path | None, typer.Option("--map", help="Route by this map file instead of the claims in the cluster.")
    ] = None,
    via: ViaOpt = None,
    account: AccountOpt = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Name the partition owning each subject, or say that none does (exit 1 if any has no owner)."""
    from ferry.jobs import partition as pt

    if map_file:
        maps = [pt.load_map(map_file)]
        pt.require_valid(maps[0])  # an overlap would route a subject to either owner
    else:
        topo = open_topology(topology).in_account(account)

        async def claimed() -> list[Any]:
            async with _nats_session(topo, via) as nc:
                return pt.claimed_maps(await pt.read_claims(nc))

        maps = run(claimed())
    rows = pt.route(maps, subjects)
    if as_json:
        print_json(rows)
    else:
        for r in rows:
            if r.get("owner"):
                where = f" in {r['cluster']}" if r.get("cluster") else ""
                out.print(
                    f"{r['subject']} -> {r['owner']} (stream {r['stream']}{where}, map {r['map']})", highlight=False
                )
            else:
                err.print(f"{r['subject']}: {r['error']}", highlight=False)
    if any("error" in r for r in rows):
        raise typer.Exit(1)


@contextlib.asynccontextmanager
async def _nats_session(topo: Any, via: str | None) -> Any:
    from ferry.brokers import nats as bnats

    name = via_cluster(topo, via)
    async with bnats.session(topo.nats(name), name=name, client_name="ferry-partition") as nc:
        yield nc


@partition_app.command("plan")
def partition_plan(
    file: MapArg,
    via: ViaOpt = None,
    account: AccountOpt = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """What applying MAP would change (the same as `apply --dry-run`): streams created or updated,
    subjects changing owner and messages moving."""
    partition_apply(file, dry_run=True, via=via, account=account, topology=topology, as_json=as_json)


@partition_app.command("status")
def partition_status(
    via: ViaOpt = None, account: AccountOpt = None, topology: TopologyOpt = None, as_json: JsonOpt = False
) -> None:
    """Every map on record in the cluster (of the account): its partitions and streams, and a
    repartition that did not finish."""
    from ferry.jobs import partition as pt
    from ferry.jobs.partition.claims import status

    topo = open_topology(topology).in_account(account)

    async def on_record() -> list[dict[str, Any]]:
        async with _nats_session(topo, via) as nc:
            return status(await pt.read_claims(nc))

    rows = run(on_record())
    if as_json:
        print_json(rows)
        return
    if not rows:
        out.print("no partition map is on record")
    for r in rows:
        parts = ", ".join(f"{n} ({p['stream']}: {' '.join(p['patterns'])})" for n, p in r["partitions"].items())
        out.print(f"map {r['map']}: {parts or 'no partition applied yet'}", highlight=False)
        if r["pending"]:
            by = r["by"]
            out.print(
                f"  a repartition started by {by.get('host')} pid {by.get('pid')} at {by.get('at')} did not finish: "
                "`ferry partition plan` shows it, `ferry partition apply` of the map with --execute finishes it",
                highlight=False,
            )


@partition_app.command("apply")
def partition_apply(
    file: MapArg,
    execute: Annotated[
        bool, typer.Option("--execute", help="Carry out a repartition: move stored messages to their new owners.")
    ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing.")] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Apply although a repartition of this map left no journal to resume from (checked by hand).",
        ),
    ] = False,
    via: ViaOpt = None,
    account: AccountOpt = None,
    spark_master: SparkMaster = None,
    spark_remote: SparkRemote = None,
    spark_archive: SparkArchive = None,
    topology: TopologyOpt = None,
    metrics_port: MetricsPortOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Claim MAP's subjects and create or update one stream per partition capturing exactly its patterns.

    With --account, in that NATS account: its streams, and its own record of claims."""
    from ferry.jobs import partition as pt

    pmap = pt.load_map(file)
    topo = open_topology(topology).in_account(account)
    spark = factory(
        spark_master,
        spark_remote,
        archive=spark_archive,
        app_name=f"ferry partition apply {pmap.name}",
        data_sources=False,
    )
    with contextlib.ExitStack() as bar:  # a progress bar while a moving pattern's history is copied
        advance: list[Callable[[int], None]] = []

        def emit(event: str, **data: Any) -> None:
            if as_json:
                json_event(event, **data)
            elif event == "copying":
                if not advance:
                    what = f"copying {data['pattern']} {data['from']} -> {data['to']}"
                    advance.append(bar.enter_context(progress_bar(data["total"], what)))
                advance[0](data["messages"])
            else:
                if advance:  # one live display at a time: the copy's bar ends before what follows it
                    bar.close()
                    advance.clear()
                _print_partition_event(event, **data)

        result = run(
            pt.apply(
                topo,
                via_cluster(topo, via),
                pmap,
                execute=execute,
                dry_run=dry_run,
                force=force,
                emit=EventMetrics("partition", metrics_port).wrap(emit),
                spark=spark,
            )
        )
    if as_json:
        print_json(result)
    elif dry_run:
        _print_partition_plan(result)
        out.print("dry run: nothing changed")
    if result["refusals"]:
        raise typer.Exit(1)


def _print_partition_plan(p: dict[str, Any]) -> None:
    out.print(f"map {p['map']}" + (" (a repartition is pending)" if p.get("pending") else ""), highlight=False)
    if u := p.get("unfinished"):
        moves = ", ".join(f"{m['pattern']} {m['from']}->{m['to']}" for m in u["moves"])
        out.print(
            f"  a repartition ({moves}) did not finish, in its {u['phase']} phase: `ferry partition apply` of "
            "this map with --execute finishes it",
            highlight=False,
        )
    for c in p["create"]:
        out.print(f"  create {c['stream']} for partition {c['partition']}: {', '.join(c['patterns'])}", highlight=False)
    for u in p["update"]:
        extra = f", R{u['replicas']}" if "replicas" in u else ""
        out.print(f"  update {u['stream']}: {', '.join(u['from'])} -> {', '.join(u['to'])}{extra}", highlight=False)
    for m in p["moves"]:
        out.print(
            f"  move {m['pattern']} from {m['from']} to {m['to']}: {m['messages']:,} stored messages", highlight=False
        )
    for r in p["retire"]:
        out.print(f"  retire {r['stream']} from the map (keeps {', '.join(r['keeps'])}; its messages stay)")
    if not (p["create"] or p["update"] or p["moves"] or p["retire"]):
        out.print("  nothing to change")
    for line in p["refusals"]:
        err.print(f"refused: {line}", highlight=False)


def _print_partition_event(event: str, **data: Any) -> None:
    if event == "plan":
        _print_partition_plan(data)
        return
    if event == "copied":
        line = (
            f"copied {data['messages']:,} messages of {data['pattern']} "
            f"{data['from']} -> {data['to']} (<= seq {data['up_to']:,})"
        )
    elif event == "resume":
        line = f"resuming the repartition of map {data['map']} ({data['op_id']}) from its {data['phase']} phase"
    elif event == "unguarded":
        line = f"note: {data['note']}"
    elif event == "switched":
        line = f"switched owners: the moving subjects had no stream for {data['seconds'] * 1000:.1f} ms"
    elif event == "guard":
        line = (
            f"guard on {data['stream']}: heard {data['captured']:,}, the new owner lacked "
            f"{data['missed']:,}, re-published {data['reinjected']:,} (already stored by a retry: "
            f"{data['already_stored']:,})"
        )
    elif event == "done":
        line = f"applied map {data['map']} in {data['took_s']:.2f}s" + (
            f": moved {data['copied']:,} messages, purged {data['purged']:,} from the old owners"
            if "copied" in data
            else ""
        )
    else:
        line = event_line(event, data)
    err.print(line, highlight=False)


def register(app: typer.Typer) -> None:
    """Add partition's commands to `app`."""
    app.add_typer(partition_app, name="partition")
