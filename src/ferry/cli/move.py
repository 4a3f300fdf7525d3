"""`ferry move` and `ferry repair consumers`."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ferry.cli.options import (
    PLAIN,
    AccountOpt,
    JsonOpt,
    MetricsPortOpt,
    TopologyOpt,
    open_topology,
    run,
    stream_name_arg,
    via_cluster,
)
from ferry.cli.render import err, event_line, json_event, out, print_json
from ferry.jobs.shared.metrics import EventMetrics

# -- move ------------------------------------------------------------------------------------


def move_cmd(
    stream: Annotated[
        str | None, typer.Argument(help="Stream to move (or --streams GLOB).", callback=stream_name_arg)
    ] = None,
    to: Annotated[str | None, typer.Option("--to", help="Destination cluster.")] = None,
    to_tags: Annotated[str | None, typer.Option("--to-tags", help="Destination server tags, comma-separated.")] = None,
    streams: Annotated[str | None, typer.Option("--streams", help="Move every stream matching this glob.")] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Streams moved at once (one move per stream).")] = 1,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds before the move is cancelled.")] = 600.0,
    guard: Annotated[bool, typer.Option(help="Capture the stream's subjects and re-publish what it misses.")] = True,
    stop: Annotated[
        bool, typer.Option("--stop", "--cancel", help="Stop STREAM's move in progress: it goes back where it was.")
    ] = False,
    status: Annotated[bool, typer.Option("--status", help="Show STREAM's last move as journaled.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Preflight and print the plan; change nothing.")] = False,
    via: Annotated[
        str | None, typer.Option("--via", help="Topology cluster to connect through (default: the first NATS one).")
    ] = None,
    account: AccountOpt = None,
    topology: TopologyOpt = None,
    metrics_port: MetricsPortOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Move JetStream streams to another cluster of the super-cluster, losing nothing."""
    from ferry.errors import UsageError
    from ferry.jobs import move as mv
    from ferry.jobs.shared import signals

    topo = open_topology(topology)
    cluster = topo.nats(via_cluster(topo, via), account)
    if status:
        if not stream:
            raise UsageError("--status needs the STREAM")
        record = run(mv.status(cluster, stream))
        if as_json:
            print_json(record)
        else:
            r = record.result
            out.print(
                f"{stream}: {record.phase} ({record.origin} -> {record.to}), move {record.move_id}"
                + (f"; {r.outcome} in {r.took_s}s, re-published {r.reinjected or 0}" if r else "")
            )
        return
    if stop:
        if not stream:
            raise UsageError("--stop needs the STREAM")
        asked = run(mv.cancel(cluster, stream))
        print_json(asked) if as_json else out.print(
            f"cancel of {stream}'s move requested; it returns to {asked.cluster}"
            + (f" ({asked.driven_by}, which runs the move, ends it cancelled)" if asked.driven_by else "")
        )
        return
    if bool(stream) == bool(streams):
        raise UsageError("give one STREAM or --streams GLOB")
    if bool(to) == bool(to_tags):
        raise UsageError("give one of --to CLUSTER or --to-tags TAG,...")
    tags = [t.strip() for t in (to_tags or "").split(",") if t.strip()]
    req = mv.MoveRequest(stream=stream or "", to=to, to_tags=tags, timeout=timeout, guard=guard, dry_run=dry_run)
    emit = EventMetrics("move", metrics_port).wrap(json_event if as_json else _print_event)

    async def go() -> list[mv.MoveResult]:
        with signals.StopOnSignal() as stop:
            if streams:
                return await mv.move_many(cluster, streams, req, concurrency, emit, stop.event)
            return [await mv.move(cluster, req, emit, stop.event)]

    results = run(go())
    if as_json:
        print_json(results if streams else results[0])
    else:
        for r in results:
            if r.outcome == "dry-run":
                out.print(f"{r.stream}: preflight passed; nothing changed (dry run)", highlight=False)
    failed = [r for r in results if r.outcome not in ("moved", "dry-run", "already there")]
    failed += [r for r in results if r.verify and not r.verify.ok]
    if failed:
        from ferry.errors import OperationFailed

        if streams:  # each one's error was printed as it came
            names = sorted({r.stream for r in failed})
            raise OperationFailed(f"{len(names)} of {len(results)} moves did not finish: {', '.join(names)}")
        raise OperationFailed("; ".join(f"{r.stream}: {r.error or r.outcome}" for r in failed))


def _print_event(event: str, **data: Any) -> None:
    who = f"{data['stream']}: " if "stream" in data and event not in ("plan", "done") else ""
    if event == "plan":
        line = (
            f"plan: {data['stream']} R{data['replicas']} {data['messages']:,} msgs {data['bytes']:,} B "
            f"from {data['from']} to {data['to']}"
        )
        if data.get("nothing_to_do"):
            line += " (already there)"
        for w in data.get("warnings", []):
            line += f"\nwarning: {w}"
    elif event == "progress":
        ps = " ".join(_peer(p) for p in data["peers"])
        line = f"{data['at_s']:>6.2f}s peers {ps} last_seq {data['last_seq']:,}"
    elif event == "leader":
        line = f"{data['at_s']:>6.2f}s leader {data['previous']} -> {data['leader']}"
        if data.get("lost"):
            line += f" ({data['previous']} does not answer: it died, no step-down)"
    elif event == "leader_lost":
        line = (
            f"{data['server']} died leading the stream: lost inherently, {data['inherent']}; guarded, {data['guarded']}"
        )
    elif event == "handoff":
        line = f"{data['at_s']:>6.2f}s handoff {data['from']} -> {data['to']} (destination caught up)"
        if data.get("error"):
            line += f": {data['error']}"
    elif event == "guard" and "captured" in data:
        line = (
            f"guard: heard {data['captured']:,}, stream missed {data['missed']:,}, "
            f"re-published {data['reinjected']:,} (already stored by a retry: {data['already_stored']:,}); "
            f"unavailable {data['unavailable_s'] * 1000:.1f} ms"
        )
    elif event == "verify":
        line = "verify: ok" if data["ok"] else "verify: " + "; ".join(data["problems"])
    elif event == "done":
        line = (
            f"{data['outcome']}: {data['stream']} now in {data.get('cluster')} on {', '.join(data.get('peers', []))} "
            f"in {data.get('took_s', 0):.2f}s"
        )
        if data.get("moved_in_s") is not None:  # took_s also counts the guard's reconciliation and the check
            line += f" ({data['moved_in_s']:.2f}s to move its group, the rest to reconcile and verify)"
        if "leaderless_s" in data:  # a resumed move's journal may predate unanswered_s
            line += (
                f"; leaderless {data['leaderless_s']:.2f}s, stream info unanswered {data.get('unanswered_s', 0):.2f}s"
            )
    else:
        line = event_line(event, {k: v for k, v in data.items() if k != "stream"})
    # the plan and the outcome are the command's result (stdout); the rest is progress (stderr)
    (out if event in ("plan", "done") else err).print(who + line, highlight=False)


def _peer(p: dict[str, Any]) -> str:
    mark = "*" if p.get("leader") else ""
    return p["name"] + mark + ("" if p["current"] else f"(lag {p['lag']})")


repair_app = typer.Typer(**PLAIN, help="Repair what a broker left broken.", no_args_is_help=True)


@repair_app.command("consumers")
def repair_consumers_cmd(
    stream: Annotated[str, typer.Argument(help="Stream whose durable consumers to check.", callback=stream_name_arg)],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be recreated; change nothing.")] = False,
    via: Annotated[str | None, typer.Option("--via", help="Topology cluster to connect through.")] = None,
    account: AccountOpt = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Recreate durable consumers left pointing past the stream's last sequence (a sequence reset)."""
    from ferry.jobs import move as mv

    topo = open_topology(topology)
    cluster = topo.nats(via_cluster(topo, via), account)
    fixes = run(mv.repair_consumers(cluster, stream, dry_run=dry_run))
    if as_json:
        print_json(fixes)
        return
    if not fixes:
        out.print(f"{stream}: every durable consumer is within the stream")
    for f in fixes:
        verb = "would recreate" if dry_run else "recreated"
        out.print(
            f"{verb} {f.consumer}: delivered {f.delivered}, ack floor {f.ack_floor} past last seq "
            f"{f.last_seq}; now starts at {f.restart_at}"
        )


def register(app: typer.Typer) -> None:
    """Add move's commands to `app`."""
    app.command("move")(move_cmd)
    app.add_typer(repair_app, name="repair")
