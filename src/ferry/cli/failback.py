"""`ferry failback` (the DR fail-back of RabbitMQ queues)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.table import Table

from ferry.cli.options import (
    JsonOpt,
    MetricsPortOpt,
    SparkArchive,
    SparkMaster,
    SparkRemote,
    TopologyOpt,
    open_topology,
    run,
)
from ferry.cli.render import (
    count_or_unknown,
    err,
    json_event,
    out,
    plain_event,
    print_json,
    progress_bar,
    redelivered_warning,
)
from ferry.jobs.shared.metrics import EventMetrics

# -- failback -------------------------------------------------------------------------------

DUPLICATES_EXIT = 3  # finished, but some messages may have been delivered twice (as `ferry audit` finding losses)


def failback_cmd(
    source: Annotated[str, typer.Option("--from", help="The DR RabbitMQ cluster holding orphaned messages.")],
    target: Annotated[str, typer.Option("--to", help="The main RabbitMQ cluster to bring them to.")],
    vhost: Annotated[str | None, typer.Option(help="Only this vhost (default: every vhost).")] = None,
    engine: Annotated[
        str,
        typer.Option(
            help="spark: the data-plane mover, each message once; after a killed run, what comes back and the "
            "target holds by message id is not delivered again (without an id it may be: counted); shovel: "
            "dynamic shovels on the source, each message once unless a shovel ends other than by itself (up to "
            "16 per such end are counted)."
        ),
    ] = "spark",
    max_active: Annotated[int, typer.Option(min=1, help="Shovels running at once.")] = 50,
    stall_timeout: Annotated[
        float,
        typer.Option(
            min=10, metavar="SECONDS", help="Stop when a shovel has moved no message (none acked) for this long."
        ),
    ] = 60.0,
    verify: Annotated[
        bool,
        typer.Option(
            help="After the transfer, count each target queue against what moved and, where it holds more, "
            "name the message ids it holds twice (reads up to 100,000 per queue, consuming none)."
        ),
    ] = True,
    target_queue: Annotated[
        str | None, typer.Option(help="Send every queue's messages to this queue (testing on one cluster).")
    ] = None,
    abort: Annotated[
        bool,
        typer.Option(
            "--stop", "--abort", help="Stop a failback on record: restore its upstreams and clean up, unfinished."
        ),
    ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan or the journal; change nothing.")] = False,
    status: Annotated[
        bool, typer.Option("--status", help="Show the failback on record from --from (if any); change nothing.")
    ] = False,
    spark_master: SparkMaster = None,
    spark_remote: SparkRemote = None,
    spark_archive: SparkArchive = None,
    topology: TopologyOpt = None,
    metrics_port: MetricsPortOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Move the messages left on the DR cluster's federated queues to the main cluster, pulling none from upstream."""
    from ferry.jobs.dr_failback.plan import FailbackRequest
    from ferry.jobs.dr_failback.run import failback
    from ferry.spark.session import factory

    topo = open_topology(topology)
    req = FailbackRequest(
        source=source,
        target=target,
        vhost=vhost,
        target_queue=target_queue,
        engine=engine,
        max_active=max_active,
        dry_run=dry_run,
        abort=abort,
        stall_timeout=stall_timeout,
        verify=verify,
    )

    if status:
        from ferry.jobs.dr_failback.run import status as on_record

        view = run(on_record(topo, req))
        print_json(view) if as_json else _print_resuming(view)
        return
    # the queue mover reads with no data source
    spark = factory(
        spark_master,
        spark_remote,
        archive=spark_archive,
        app_name=f"ferry failback {source} to {target}",
        data_sources=False,
    )

    begun: list[tuple[str, dict[str, Any]]] = []  # from the journal on: what an interrupt leaves on record
    try:
        with contextlib.ExitStack() as stack:
            bar: list[Callable[[int], None]] = []

            def emit(event: str, **data: Any) -> None:
                if event in ("journal", "resume", "upstream-disabled", "upstream-restored") and not abort:
                    begun.append((event, data))
                if as_json:
                    json_event(event, **data)
                elif event == "plan":
                    _print_failback_plan(data)
                elif event == "progress":
                    if not bar:
                        bar.append(stack.enter_context(progress_bar(data["total"], f"failback ({engine})")))
                    bar[0](data["moved"])
                elif event in ("resume", "upstream-disabled", "upstream-restored"):
                    plain_event(event, **data)

            report = run(failback(topo, req, EventMetrics("dr_failback", metrics_port).wrap(emit), spark))
    except KeyboardInterrupt:
        if begun:
            err.print(interrupted_note(source, target, engine, begun), highlight=False)
        raise
    if as_json:
        print_json(report)
    else:
        _print_report(report, source, target, engine)
    if report.get("duplicates") or report.get("unverified_duplicates"):
        raise typer.Exit(DUPLICATES_EXIT)


def _print_report(report: dict[str, Any], source: str, target: str, engine: str) -> None:
    if "resuming" in report:
        _print_resuming(report)
        return
    if report["outcome"] == "nothing to do":
        out.print(f"nothing to do: no federated queue on {source} holds ready messages")
        return
    if report["outcome"] == "nothing to abort":
        out.print(f"nothing to abort: no failback from {source} is in progress")
        return
    if report["outcome"] == "dry-run":
        return
    table = Table(
        "vhost", "queue", "type", "before", "moved", "left", f"{target} before", f"{target} after", "duplicates"
    )
    table.caption = "upstream queues: " + ", ".join(
        f"{u['queue']} via {u['upstream']} {count_or_unknown(u['before'])} -> {count_or_unknown(u['after'])}"
        for u in report["upstream_queues"]
    )
    for r in report["queues"]:
        table.add_row(
            r["vhost"],
            r["queue"] + ("" if r["target"] == r["queue"] else f" -> {r['target']}"),
            r["type"],
            f"{r['before']:,}",
            f"{r['moved']:,}",
            f"{r['left']:,}",
            f"{r['target_before']:,}",
            f"{r['target_after']:,}",
            _duplicates_cell(r),
        )
    out.print(table)
    t = report["total"]
    out.print(
        f"{report['outcome']}: moved {t['moved']:,} of {t['before']:,}, left {t['left']:,}; "
        f"upstreams restored identical: {sum(u['identical'] for u in report['upstreams_restored'])}"
        f"/{len(report['upstreams_restored'])}; pulled from upstream: {report['upstream_pulled']:,}"
        + (f"; leftover shovels removed: {report['shovels_deleted']}" if report["shovels_deleted"] else "")
    )
    for c in report["verification"] or []:
        if c["verdict"] != "ok":
            ids = c["duplicate_ids"]
            named = f": {', '.join(ids)}{' ...' if c['duplicates'] > len(ids) else ''}" if ids else ""
            out.print(f"  {target} {c['vhost']}/{c['queue']}: {c['verdict']}{named}")
    if report["verification"] is None and not report["outcome"].startswith("aborted"):
        out.print(f"not verified (--no-verify): {target}'s queues were not counted against what moved")
    if t["already_there"]:
        out.print(
            f"{t['already_there']:,} messages a killed run had delivered came back to {source}: acked there, "
            "not delivered again"
        )
    if report["duplicates"]:
        out.print(f"[yellow]{report['duplicates']:,} messages reached {target} twice (exit {DUPLICATES_EXIT})[/]")
    if report["unverified_duplicates"]:
        out.print(
            f"[yellow]up to {report['unverified_duplicates']:,} messages may have reached {target} twice, "
            f"not verified: a shovel ended (restarted, deleted, a node lost) after the target confirmed "
            f"messages whose ack never reached {source} (exit {DUPLICATES_EXIT})[/]"
            if engine == "shovel"
            else redelivered_warning(report["unverified_duplicates"])
        )


def _duplicates_cell(r: dict[str, Any]) -> str:
    """Duplicates as verified, else at most what ferry counted as possible ("≤ N")."""
    if r["duplicates"] is not None:
        return f"{r['duplicates']:,}"
    return f"≤ {r['possible_duplicates']:,}" if r["possible_duplicates"] else "0"


def interrupted_note(source: str, target: str, engine: str, begun: list[tuple[str, dict[str, Any]]]) -> str:
    """What an interrupted failback left on record, from the events it had emitted since its
    journal was written (a new run's "journal", a resumed run's "resume" and its phase)."""
    record = next(d for e, d in begun if e in ("journal", "resume"))
    phase = record.get("phase", "disabling")
    names = [e for e, _ in begun]
    off = "upstream-restored" not in names and (
        phase in ("transferring", "restoring") or names.count("upstream-disabled") >= record["upstreams"]
    )
    shovels = "its shovels may still move messages, and " if off and engine == "shovel" else ""
    return (
        f"the failback from {source} to {target} is on record, unfinished: {shovels}{source}'s federation "
        f"upstreams {'stay off' if off else 'may be partly off'}. Run the same command again to finish it, "
        "or add --abort to drop it and restore its upstreams"
    )


def _print_failback_plan(plan: dict[str, Any]) -> None:
    out.print(
        f"[bold]failback {plan['source']} -> {plan['target']}[/]: {plan['messages']:,} messages "
        f"in {len(plan['queues'])} federated queue(s), engine {plan['engine']}: {plan['guarantee']}"
    )
    if plan["queues"]:
        table = Table("vhost", "queue", "type", "ready", "target queue")
        for x in plan["queues"]:
            table.add_row(x["vhost"], x["queue"], x["type"], f"{x['before']:,}", x["target"])
        out.print(table)
    for u in plan["upstreams"]:
        out.print(f"  upstream to disable: {u['name']!r} in vhost {u['vhost']!r}")
    for w in plan["warnings"]:
        out.print(f"  [yellow]warning:[/] {w}")


def register(app: typer.Typer) -> None:
    """Add failback's commands to `app`."""
    app.command("failback")(failback_cmd)


def _print_resuming(report: dict[str, Any]) -> None:
    """A failback on record: its phase and what each queue still holds."""
    j = report["resuming"]
    out.print(f"failback {j['id']} {j['source']} -> {j['target']}: phase {j['phase']} since {j['updated']}")
    for name, left in report["left"].items():
        out.print(f"  {name}: {left:,} left")
    if report["abort"]:
        names = ", ".join(f"{u['name']!r} in vhost {u['vhost']!r}" for u in j["upstreams"])
        out.print(
            f"--stop or --abort would remove ferry's shovels and restore the upstream(s) {names}; "
            f"what has moved stays on {j['target']}"
        )
