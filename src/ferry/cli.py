"""The `ferry` command line.

Each command is a thin shell over one module (ops/, pipeline/, lab/): parse
options, call it, print a rich table or, with ``--json``, one JSON document.
Errors a user can cause end as one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import pydantic
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ferry.errors import FerryError, redact

try:  # typer vendors click since 0.2x; its errors are what a bad command line raises
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException, NoArgsIsHelpError

_plain = {"rich_markup_mode": None}  # usage errors as plain "Error: ..." lines, not boxes
app = typer.Typer(
    **_plain,
    name="ferry",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
topology_app = typer.Typer(**_plain, help="Validate and probe topology files.", no_args_is_help=True)
lab_app = typer.Typer(**_plain, help="Real brokers on 127.0.0.1 for demos, tests and benchmarks.", no_args_is_help=True)
stream_app = typer.Typer(**_plain, help="Create, inspect and delete JetStream streams.", no_args_is_help=True)
app.add_typer(topology_app, name="topology")
app.add_typer(stream_app, name="stream")
app.add_typer(lab_app, name="lab")

out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)


def _version(show: bool) -> None:
    if show:
        from ferry import __version__

        out.print(f"ferry {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print ferry's version and exit.")
    ] = False,
) -> None:
    """Move message workloads between NATS JetStream and RabbitMQ clusters without losing a message."""


TopologyOpt = Annotated[
    Path | None,
    typer.Option(
        "--topology",
        "-t",
        help="Topology file (default: $FERRY_TOPOLOGY, else the lab's).",
        envvar="FERRY_TOPOLOGY",
        show_envvar=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")]
DirOpt = Annotated[Path | None, typer.Option("--dir", help="Lab directory (default: $FERRY_LAB_DIR or ./.ferry-lab).")]


def run(coro: Any) -> Any:
    """asyncio.run, except that Ctrl-C stops Spark jobs at once: asyncio.run would first wait for
    the threads running them (failback's, the relay's) to end."""
    spark = sys.modules.get("ferry.pipeline.spark")
    if spark:
        spark.clear_interrupt()  # a Ctrl-C seen by an earlier command of this process
    with asyncio.Runner() as runner:
        try:
            return runner.run(coro)
        except KeyboardInterrupt:
            _interrupt_spark()
            raise


def print_json(data: Any) -> None:
    out.print_json(json.dumps(data, default=str))


def _lab_dir(path: Path | None) -> Path | None:
    return path.absolute() if path else None


def _topology(path: Path | None) -> Any:
    from ferry.topology import load_topology

    return load_topology(path)


# -- topology --------------------------------------------------------------------------


@topology_app.command("check")
def topology_check(
    file: Annotated[Path, typer.Argument(help="Topology YAML file.")],
    probe: Annotated[bool, typer.Option(help="Probe every endpoint (--no-probe: validate only).")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Validate a topology file and probe every endpoint; one line per problem."""
    from ferry.brokers import probe_all
    from ferry.topology import load_topology

    topo = load_topology(file)
    problems = [f"{file}: {p}" for p in topo.credential_problems()]
    probes = run(probe_all(topo)) if probe and not problems else []
    problems += [f"{p.cluster}/{p.broker} {p.endpoint} {p.url}: {p.detail}" for p in probes if not p.ok]
    if as_json:
        print_json(
            {"file": str(file), "ok": not problems, "problems": problems, "probes": [p.__dict__ for p in probes]}
        )
    else:
        if probes:
            table = Table("cluster", "broker", "endpoint", "url", "answer", "ms", title=f"{file}")
            for p in probes:
                answer = f"[green]{p.detail}[/]" if p.ok else f"[red]{p.detail}[/]"
                table.add_row(p.cluster, p.broker, p.endpoint, p.url, answer, f"{p.ms:.0f}")
            out.print(table)
        for line in problems:
            err.print(f"[red]problem:[/] {line}", highlight=False, soft_wrap=True)
        if not problems:
            n = sum(len(c.brokers) for _, _, c in topo.clusters())
            out.print(
                f"ok: {len(topo.sites)} sites, {sum(1 for _ in topo.clusters())} clusters, {n} brokers"
                + ("" if probe else " (not probed)")
            )
    if problems:
        raise typer.Exit(1)


@topology_app.command("smoke")
def topology_smoke(
    stream_in: Annotated[str | None, typer.Option(help="NATS cluster to place the test stream in.")] = None,
    client_in: Annotated[str | None, typer.Option(help="NATS cluster the client connects to (default: same).")] = None,
    rabbitmq: Annotated[str | None, typer.Option(help="RabbitMQ cluster to test instead.")] = None,
    count: Annotated[int, typer.Option(min=1)] = 5000,
    replicas: Annotated[int, typer.Option(min=1, max=5)] = 3,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write and read back COUNT messages through a temporary stream or queue, then delete it."""
    from ferry.errors import UsageError
    from ferry.ops import smoke

    topo = _topology(topology)
    if rabbitmq:
        result = run(smoke.rabbit_smoke(topo, rabbitmq, count))
    elif stream_in:
        result = run(smoke.nats_smoke(topo, stream_in, client_in or stream_in, count, replicas))
    else:
        raise UsageError("give --stream-in CLUSTER (NATS) or --rabbitmq CLUSTER")
    if as_json:
        print_json(result)
        return
    if result["kind"] == "nats":
        out.print(
            f"stream {result['stream']} (R{result['replicas']}) placed in [bold]{result['placed_in']}[/] "
            f"(leader {result['leader']}); client on [bold]{result['client_cluster']}[/] ({result['client_server']})"
        )
        what = "stream"
    else:
        out.print(f"queue {result['queue']} on [bold]{result['cluster']}[/]")
        what = "queue"
    out.print(
        f"published {result['published']} ({result['publish_rate']}/s), read back {result['read_back']} "
        f"({result['read_rate']}/s), every payload checked; temporary {what} deleted"
    )


# -- stream -------------------------------------------------------------------------------


ClusterOpt = Annotated[str, typer.Option("--cluster", "-c", help="A NATS cluster of the topology to talk to.")]


def _stream_name(value: str | None) -> str | None:
    """A stream argument that can name a stream (else a usage error, before any broker is asked)."""
    from ferry.subjects import stream_name_problem

    if value is not None and (why := stream_name_problem(value)):
        raise typer.BadParameter(why)
    return value


StreamArg = Annotated[str, typer.Argument(callback=_stream_name)]


@stream_app.command("add")
def stream_add(
    name: StreamArg,
    cluster: ClusterOpt,
    subjects: Annotated[list[str], typer.Option("--subject", "-s", metavar="SUBJECT", help="Subject (repeat).")],
    replicas: Annotated[int, typer.Option(min=1, max=5)] = 3,
    placement: Annotated[str | None, typer.Option(help="Cluster to place it in (default: --cluster).")] = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a stream placed in a cluster."""
    from ferry.brokers import nats as bnats

    topo = _topology(topology)
    info = run(
        bnats.stream_add(
            topo.nats(cluster), name, subjects, replicas=replicas, placement=placement or cluster, cluster_name=cluster
        )
    )
    _print_stream(info, as_json)


@stream_app.command("info")
def stream_info(name: StreamArg, cluster: ClusterOpt, topology: TopologyOpt = None, as_json: JsonOpt = False) -> None:
    """Placement, leader, peers and state of a stream."""
    from ferry.brokers import nats as bnats

    _print_stream(run(bnats.stream_info(_topology(topology).nats(cluster), name, cluster)), as_json)


@stream_app.command("rm")
def stream_rm(
    name: StreamArg,
    cluster: ClusterOpt,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking.")] = False,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Delete a stream and its messages (asks first, unless --yes)."""
    from ferry.brokers import nats as bnats
    from ferry.errors import UsageError

    nats_cluster = _topology(topology).nats(cluster)
    info = run(bnats.stream_info(nats_cluster, name, cluster))
    if not yes:
        what = f"stream {name} and its {info['messages']:,} messages"
        if not sys.stdin.isatty():
            raise UsageError(f"pass --yes to delete {what}")
        if not typer.confirm(f"delete {what}?", err=True):
            err.print("nothing deleted")
            raise typer.Exit(1)
    run(bnats.stream_delete(nats_cluster, name, cluster))
    if as_json:
        print_json({"deleted": name, "messages": info["messages"]})
        return
    out.print(f"stream {name} deleted ({info['messages']:,} messages)")


def _print_stream(info: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(info)
        return
    out.print(
        f"stream {info['name']} ({', '.join(info['subjects'] or [])}): R{info['replicas']} in "
        f"{info['cluster'] or 'a standalone server'}, leader {info['leader'] or '-'}, "
        f"peers {', '.join(info['peers']) or '-'}; "
        f"{info['messages']:,} messages, seq {info['first_seq']}..{info['last_seq']}"
    )


# -- copy ---------------------------------------------------------------------------------

SparkMaster = Annotated[str | None, typer.Option("--spark-master", help="Spark master URL (default local[*]).")]
SparkRemote = Annotated[
    str | None,
    typer.Option(
        "--spark-remote",
        envvar="FERRY_SPARK_REMOTE",
        help="Spark Connect URL sc://host:port (from the environment, a ;token= stays off the command line).",
    ),
]


@app.command("copy")
def copy_cmd(
    source: Annotated[
        str, typer.Argument(help="jetstream://CLUSTER/STREAM, rabbitmq://CLUSTER/VHOST/QUEUE, parquet:///DIR")
    ],
    destination: Annotated[str, typer.Argument(help="Same forms; a RabbitMQ queue may be * (same names).")],
    mode: Annotated[
        str, typer.Option(help="JetStream->JetStream: ordered (exact order, resumable) or parallel.")
    ] = "ordered",
    partitions: Annotated[
        int | None, typer.Option(min=1, help="Read/write in N parallel ranges (implies parallel).")
    ] = None,
    rate: Annotated[float | None, typer.Option(min=1, help="Messages per second, all tasks together.")] = None,
    create: Annotated[bool, typer.Option(help="Create a missing destination stream/queue like the source.")] = False,
    subject_prefix: Annotated[str, typer.Option(help="Prefix added to every subject written to JetStream.")] = "",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing.")] = False,
    spark_master: SparkMaster = None,
    spark_remote: SparkRemote = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Copy messages between streams, queues and Parquet, as a Spark job."""
    from ferry.pipeline.copy import CopyOptions, plan_copy, run_copy
    from ferry.pipeline.spark import get_session

    topo = _topology(topology)
    opts = CopyOptions(
        mode=mode, partitions=partitions, rate=rate, create=create, dry_run=dry_run, subject_prefix=subject_prefix
    )
    plan = plan_copy(topo, source, destination, opts)
    if dry_run:
        if as_json:
            print_json({"dry_run": True, "plan": plan.as_dict()})
        else:
            _print_plan(plan.as_dict())
        return
    if not as_json:
        _print_plan(plan.as_dict())
    spark = get_session(master=spark_master, remote=spark_remote, app_name="ferry copy", data_sources=False)
    with _progress(plan.messages, "copying", enabled=not as_json) as advance:
        report = run_copy(topo, plan, spark, progress=advance)
    if as_json:
        print_json(report.as_dict())
        return
    out.print(
        f"read {report.read:,}, stored {report.stored:,}, already present {report.duplicates:,}, "
        f"retries {report.retries:,}, {report.bytes / 1e6:.1f} MB of payload in {report.seconds:.1f}s "
        f"({report.rate:,.0f} msg/s)"
    )
    if report.queues:
        table = Table("vhost", "queue", "before", "moved", "left", "redelivered", "seconds")
        for r in report.queues:
            table.add_row(
                r["vhost"],
                r["queue"],
                f"{r['before']:,}",
                f"{r['moved']:,}",
                f"{r['left']:,}",
                f"{r['redelivered']:,}",
                f"{r['seconds']:.1f}",
            )
        out.print(table)
    if report.possible_duplicates:
        out.print(_redelivered(report.possible_duplicates))


def _print_plan(plan: dict[str, Any]) -> None:
    out.print(
        f"[bold]{plan['source']}[/] -> [bold]{plan['destination']}[/]: {plan['messages']:,} messages "
        f"({plan['bytes'] / 1e6:.1f} MB of payload), engine {plan['engine']}"
        + ("" if plan["queues"] else f", mode {plan['mode']}")  # queues move one task each, in no other mode
    )
    for x in plan["queues"]:
        out.print(
            f"  queue {x['queue']} (vhost {x['vhost']}): {x['ready']:,} ready"
            + (f" -> {x['target']}" if x.get("target") else "")
        )
    for note in plan["notes"]:
        out.print(f"  note: {note}")


@contextlib.contextmanager
def _busy(what: str, enabled: bool = True) -> Iterator[None]:
    """A spinner with the time so far, on stderr, for work that cannot count its progress; none
    when stderr is no terminal (rich would print only an empty line there when it ends)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True, disable=not (enabled and err.is_terminal)) as bar:
        bar.add_task(escape(what))
        yield


@contextlib.contextmanager
def _progress(total: int, what: str, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """A rich progress bar (messages, rate, ETA) fed with absolute counts."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if not enabled:
        yield lambda _: None
        return
    columns = [
        TextColumn("{task.description}"),  # `what` as text: a subject's braces or brackets are no format
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ]
    t0 = time.monotonic()
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task(escape(what), total=total or None, rate="")

        def advance(done: int) -> None:
            rate = done / max(1e-6, time.monotonic() - t0)
            bar.update(task, completed=done, rate=f"{rate:,.0f} msg/s")

        yield advance


# -- move ------------------------------------------------------------------------------------


@app.command("move")
def move_cmd(
    stream: Annotated[
        str | None, typer.Argument(help="Stream to move (or --streams GLOB).", callback=_stream_name)
    ] = None,
    to: Annotated[str | None, typer.Option("--to", help="Destination cluster.")] = None,
    to_tags: Annotated[str | None, typer.Option("--to-tags", help="Destination server tags, comma-separated.")] = None,
    streams: Annotated[str | None, typer.Option("--streams", help="Move every stream matching this glob.")] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Streams moved at once (one move per stream).")] = 1,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds before the move is cancelled.")] = 600.0,
    guard: Annotated[bool, typer.Option(help="Capture the stream's subjects and re-publish what it misses.")] = True,
    cancel: Annotated[bool, typer.Option("--cancel", help="Cancel STREAM's move in progress.")] = False,
    status: Annotated[bool, typer.Option("--status", help="Show STREAM's last move as journaled.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Preflight and print the plan; change nothing.")] = False,
    via: Annotated[
        str | None, typer.Option("--via", help="Topology cluster to connect through (default: the first NATS one).")
    ] = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Move JetStream streams to another cluster of the super-cluster, losing nothing."""
    from ferry.errors import UsageError
    from ferry.ops import move as mv

    topo = _topology(topology)
    cluster = topo.nats(_via(topo, via))
    if status:
        if not stream:
            raise UsageError("--status needs the STREAM")
        state = run(mv.status(cluster, stream))
        if as_json:
            print_json(state)
        else:
            r = state.get("result") or {}
            out.print(
                f"{stream}: {state.get('phase')} ({state.get('from')} -> {state.get('to')}), "
                f"move {state.get('move_id')}"
                + (f"; {r.get('outcome')} in {r.get('took_s')}s, re-published {r.get('reinjected', 0)}" if r else "")
            )
        return
    if cancel:
        if not stream:
            raise UsageError("--cancel needs the STREAM")
        result = run(mv.cancel(cluster, stream))
        print_json(result) if as_json else out.print(
            f"cancel of {stream}'s move requested; it returns to {result['cluster']}"
        )
        return
    if bool(stream) == bool(streams):
        raise UsageError("give one STREAM or --streams GLOB")
    if bool(to) == bool(to_tags):
        raise UsageError("give one of --to CLUSTER or --to-tags TAG,...")
    tags = [t.strip() for t in (to_tags or "").split(",") if t.strip()]
    req = mv.MoveRequest(stream=stream or "", to=to, to_tags=tags, timeout=timeout, guard=guard, dry_run=dry_run)
    emit = _json_events if as_json else _print_event

    async def go() -> list[dict[str, Any]]:
        with mv.StopOnSignal() as stop:
            if streams:
                return await mv.move_many(cluster, streams, req, concurrency, emit, stop.event)
            return [await mv.move(cluster, req, emit, stop.event)]

    results = run(go())
    if as_json:
        print_json(results if streams else results[0])
    else:
        for r in results:
            if r.get("outcome") == "dry-run":
                out.print(f"{r['stream']}: preflight passed; nothing changed (dry run)", highlight=False)
    failed = [r for r in results if r.get("outcome") not in ("moved", "dry-run", "already there")]
    failed += [r for r in results if r.get("verify") and not r["verify"]["ok"]]
    if failed:
        from ferry.errors import OperationFailed

        if streams:  # each one's error was printed as it came
            names = sorted({r["stream"] for r in failed})
            raise OperationFailed(f"{len(names)} of {len(results)} moves did not finish: {', '.join(names)}")
        raise OperationFailed("; ".join(f"{r['stream']}: {r.get('error') or r.get('outcome')}" for r in failed))


def _via(topo: Any, via: str | None) -> str:
    """The NATS cluster to connect through: `via`, else the topology's first."""
    from ferry.errors import ConfigError

    if via:
        topo.nats(via)  # unknown -> one-line error
        return via
    for _, name, c in topo.clusters():
        if c.kind == "nats":
            return name
    raise ConfigError("the topology has no NATS cluster")


def _json_events(event: str, **data: Any) -> None:
    err.print(json.dumps({"event": event, "t": round(time.time(), 3), **data}, default=str), highlight=False)


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
        if "leaderless_s" in data:  # a resumed move's journal may predate unanswered_s
            line += (
                f"; leaderless {data['leaderless_s']:.2f}s, stream info unanswered {data.get('unanswered_s', 0):.2f}s"
            )
    else:
        line = _event_line(event, {k: v for k, v in data.items() if k != "stream"})
    # the plan and the outcome are the command's result (stdout); the rest is progress (stderr)
    (out if event in ("plan", "done") else err).print(who + line, highlight=False)


def _event_line(event: str, data: dict[str, Any]) -> str:
    """An event for people: ``event: key=value ...``, nested keys dotted (``placement.cluster=west``),
    lists comma-joined, None as ``-``; an event whose one value bears its name gives that value."""

    def flat(key: str, value: Any) -> Iterator[tuple[str, Any]]:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                yield from flat(f"{key}.{k}", v)
        elif isinstance(value, list | tuple):
            plain = all(not isinstance(v, dict | list | tuple) for v in value)
            yield key, ",".join(map(str, value)) if plain else json.dumps(value, default=str)
        else:
            yield key, "-" if value is None or value == {} else value

    pairs = [pair for k, v in data.items() for pair in flat(k, v)]
    if not pairs:
        return event
    if len(pairs) == 1 and pairs[0][0] == event:
        return f"{event}: {pairs[0][1]}"
    return f"{event}: " + " ".join(f"{k}={v}" for k, v in pairs)


def _print_plain_event(event: str, **data: Any) -> None:
    err.print(_event_line(event, data), highlight=False, markup=False)  # a glob's [a-z] is no markup


def _peer(p: dict[str, Any]) -> str:
    mark = "*" if p.get("leader") else ""
    return p["name"] + mark + ("" if p["current"] else f"(lag {p['lag']})")


repair_app = typer.Typer(**_plain, help="Repair what a broker left broken.", no_args_is_help=True)
app.add_typer(repair_app, name="repair")


@repair_app.command("consumers")
def repair_consumers_cmd(
    stream: Annotated[str, typer.Argument(help="Stream whose durable consumers to check.", callback=_stream_name)],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be recreated; change nothing.")] = False,
    via: Annotated[str | None, typer.Option("--via", help="Topology cluster to connect through.")] = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Recreate durable consumers left pointing past the stream's last sequence (a sequence reset)."""
    from ferry.ops import move as mv

    topo = _topology(topology)
    cluster = topo.nats(_via(topo, via))
    fixes = run(mv.repair_consumers(cluster, stream, dry_run=dry_run))
    if as_json:
        print_json(fixes)
        return
    if not fixes:
        out.print(f"{stream}: every durable consumer is within the stream")
    for f in fixes:
        verb = "would recreate" if dry_run else "recreated"
        out.print(
            f"{verb} {f['consumer']}: delivered {f['delivered']}, ack floor {f['ack_floor']} past last seq "
            f"{f['last_seq']}; now starts at {f['restart_at']}"
        )


# -- failback -------------------------------------------------------------------------------


@app.command("failback")
def failback_cmd(
    source: Annotated[str, typer.Option("--from", help="The DR RabbitMQ cluster holding orphaned messages.")],
    target: Annotated[str, typer.Option("--to", help="The main RabbitMQ cluster to bring them to.")],
    vhost: Annotated[str | None, typer.Option(help="Only this vhost (default: every vhost).")] = None,
    engine: Annotated[str, typer.Option(help="shovel (dynamic shovels) or spark (the data-plane mover).")] = "shovel",
    max_active: Annotated[int, typer.Option(min=1, help="Shovels running at once.")] = 50,
    stall_timeout: Annotated[
        float,
        typer.Option(
            min=10, metavar="SECONDS", help="Stop when a shovel has moved no message (none acked) for this long."
        ),
    ] = 60.0,
    target_queue: Annotated[
        str | None, typer.Option(help="Send every queue's messages to this queue (testing on one cluster).")
    ] = None,
    abort: Annotated[
        bool, typer.Option("--abort", help="Restore the upstreams and clean up a failback without finishing it.")
    ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan or the journal; change nothing.")] = False,
    spark_master: SparkMaster = None,
    spark_remote: SparkRemote = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Move the messages left on the DR cluster's federated queues to the main cluster, pulling none from upstream."""
    from ferry.ops.failback import FailbackRequest, failback
    from ferry.pipeline.spark import get_session

    topo = _topology(topology)
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
    )

    def spark() -> Any:  # the queue mover reads with no data source
        return get_session(master=spark_master, remote=spark_remote, app_name="ferry failback", data_sources=False)

    begun: list[tuple[str, dict[str, Any]]] = []  # from the journal on: what an interrupt leaves on record
    try:
        with contextlib.ExitStack() as stack:
            bar: list[Callable[[int], None]] = []

            def emit(event: str, **data: Any) -> None:
                if event in ("journal", "resume", "upstream-disabled", "upstream-restored") and not abort:
                    begun.append((event, data))
                if as_json:
                    _json_events(event, **data)
                elif event == "plan":
                    _print_failback_plan(data)
                elif event == "progress":
                    if not bar:
                        bar.append(stack.enter_context(_progress(data["total"], f"failback ({engine})")))
                    bar[0](data["moved"])
                elif event in ("resume", "upstream-disabled", "upstream-restored"):
                    _print_plain_event(event, **data)

            report = run(failback(topo, req, emit, spark))
    except KeyboardInterrupt:
        if begun:
            err.print(_failback_interrupted(source, target, engine, begun), highlight=False)
        raise
    if as_json:
        print_json(report)
        return
    if "resuming" in report:
        j = report["resuming"]
        out.print(f"failback {j['id']} {j['source']} -> {j['target']}: phase {j['phase']} since {j['updated']}")
        for name, left in report["left"].items():
            out.print(f"  {name}: {left:,} left")
        if report["abort"]:
            names = ", ".join(f"{u['name']!r} in vhost {u['vhost']!r}" for u in j["upstreams"])
            out.print(
                f"--abort would remove ferry's shovels and restore the upstream(s) {names}; "
                f"what has moved stays on {j['target']}"
            )
        return
    if report["outcome"] == "nothing to do":
        out.print(f"nothing to do: no federated queue on {source} holds ready messages")
        return
    if report["outcome"] == "nothing to abort":
        out.print(f"nothing to abort: no failback from {source} is in progress")
        return
    if report["outcome"] == "dry-run":
        return
    table = Table("vhost", "queue", "type", "before", "moved", "left", f"{target} before", f"{target} after")
    table.caption = "upstream queues: " + ", ".join(
        f"{u['queue']} via {u['upstream']} {_count(u['before'])} -> {_count(u['after'])}"
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
        )
    out.print(table)
    t = report["total"]
    out.print(
        f"{report['outcome']}: moved {t['moved']:,} of {t['before']:,}, left {t['left']:,}; "
        f"upstreams restored identical: {sum(u['identical'] for u in report['upstreams_restored'])}"
        f"/{len(report['upstreams_restored'])}; pulled from upstream: {report['upstream_pulled']:,}"
        + (f"; leftover shovels removed: {report['shovels_deleted']}" if report["shovels_deleted"] else "")
    )
    if report["possible_duplicates"]:
        out.print(_redelivered(report["possible_duplicates"]))


def _redelivered(n: int) -> str:
    """The warning for queue messages that came with the redelivered flag: RabbitMQ says only that
    they were delivered before, not by whom."""
    return (
        f"[yellow]{n:,} messages came redelivered (delivered before and not acked: an interrupted run, a "
        "snapshot, or another consumer): any an earlier run had stored is a duplicate at the destination "
        "(it carries x-ferry-transfer; `ferry audit` counts them)[/]"
    )


def _count(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def _per_stream(seqs: dict[str, int]) -> str:
    return ", ".join(f"{s} {n:,}" for s, n in seqs.items()) or "none"


def _failback_interrupted(source: str, target: str, engine: str, begun: list[tuple[str, dict[str, Any]]]) -> str:
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
        f"in {len(plan['queues'])} federated queue(s), engine {plan['engine']}"
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


# -- proof: load, snapshot, audit -----------------------------------------------------------


# -- partition ------------------------------------------------------------------------------

partition_app = typer.Typer(
    **_plain, help="Subjects partitioned across JetStream streams, with exact ownership.", no_args_is_help=True
)
app.add_typer(partition_app, name="partition")
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
    from ferry.ops import partition as pt

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
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Name the partition owning each subject, or say that none does (exit 1 if any has no owner)."""
    from ferry.ops import partition as pt

    if map_file:
        maps = [pt.load_map(map_file)]
        pt.require_valid(maps[0])  # an overlap would route a subject to either owner
    else:
        topo = _topology(topology)

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

    name = _via(topo, via)
    async with bnats.session(topo.nats(name), name=name, client_name="ferry-partition") as nc:
        yield nc


@partition_app.command("plan")
def partition_plan(file: MapArg, via: ViaOpt = None, topology: TopologyOpt = None, as_json: JsonOpt = False) -> None:
    """What applying MAP would change: streams created or updated, subjects changing owner and messages moving."""
    partition_apply(file, dry_run=True, via=via, topology=topology, as_json=as_json)


@partition_app.command("apply")
def partition_apply(
    file: MapArg,
    execute: Annotated[
        bool, typer.Option("--execute", help="Carry out a repartition: move stored messages to their new owners.")
    ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing.")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Apply although a repartition of this map did not finish (checked by hand).")
    ] = False,
    via: ViaOpt = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Claim MAP's subjects and create or update one stream per partition capturing exactly its patterns."""
    from ferry.ops import partition as pt

    pmap = pt.load_map(file)
    topo = _topology(topology)
    with contextlib.ExitStack() as bar:  # a progress bar while a moving pattern's history is copied
        advance: list[Callable[[int], None]] = []

        def emit(event: str, **data: Any) -> None:
            if as_json:
                _json_events(event, **data)
            elif event == "copying":
                if not advance:
                    what = f"copying {data['pattern']} {data['from']} -> {data['to']}"
                    advance.append(bar.enter_context(_progress(data["total"], what)))
                advance[0](data["messages"])
            else:
                if advance:  # one live display at a time: the copy's bar ends before what follows it
                    bar.close()
                    advance.clear()
                _print_partition_event(event, **data)

        result = run(pt.apply(topo, _via(topo, via), pmap, execute=execute, dry_run=dry_run, force=force, emit=emit))
    if as_json:
        print_json(result)
    elif dry_run:
        _print_partition_plan(result)
        out.print("dry run: nothing changed")
    if result["refusals"]:
        raise typer.Exit(1)


def _print_partition_plan(p: dict[str, Any]) -> None:
    out.print(f"map {p['map']}" + (" (a repartition is pending)" if p.get("pending") else ""), highlight=False)
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
        line = _event_line(event, data)
    err.print(line, highlight=False)


@app.command("load")
def load_cmd(
    target: Annotated[str, typer.Argument(help="nats://CLUSTER (core), jetstream://CLUSTER, rabbitmq://CLUSTER/VHOST")],
    ledger: Annotated[Path, typer.Option(help="Ledger directory to write (must be new or empty).")],
    subject: Annotated[str, typer.Option(help="Subject (or routing key) pattern; {n} = 0..subjects-1.")] = "load.{n}",
    subjects: Annotated[int, typer.Option(min=1)] = 10,
    producers: Annotated[int, typer.Option(min=1, help="Concurrent producers, one connection each.")] = 1,
    rate: Annotated[
        float | None, typer.Option(help="Messages per second, all producers (default: as fast as possible).")
    ] = None,
    duration: Annotated[float | None, typer.Option(help="Seconds to run.")] = None,
    count: Annotated[int | None, typer.Option(min=1, help="Messages to send.")] = None,
    until_signal: Annotated[bool, typer.Option("--until-signal", help="Run until SIGINT/SIGTERM.")] = False,
    size: Annotated[int, typer.Option(min=16, help="Payload bytes.")] = 100,
    retry: Annotated[bool, typer.Option(help="JetStream: re-send unacked publishes under the same msg id.")] = True,
    msg_id: Annotated[bool, typer.Option(help="NATS: set Nats-Msg-Id on every message.")] = True,
    confirms: Annotated[bool, typer.Option(help="RabbitMQ: publisher confirms.")] = True,
    exchange: Annotated[str | None, typer.Option(help="RabbitMQ: exchange (default: the default exchange).")] = None,
    url: Annotated[
        str | None,
        typer.Option(
            help="Connect to this URL (e.g. a load balancer), not the topology's brokers; "
            "RabbitMQ producers reconnect and re-send what was not confirmed."
        ),
    ] = None,
    give_up_after: Annotated[
        float,
        typer.Option(
            help="JetStream with --retry, RabbitMQ with --confirms: seconds a message may go unacked before "
            "it counts as an error; the run may last this long past --duration when a broker stops answering."
        ),
    ] = 60.0,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Publish a known workload and write a ledger of every message (id, time, outcome, hash)."""
    import signal

    from ferry.errors import UsageError
    from ferry.load import LoadOptions, run_load

    if not (duration or count or until_signal):
        raise UsageError("give --count, --duration or --until-signal")
    topo = _topology(topology)
    opts = LoadOptions(
        target=target,
        subject=subject,
        subjects=subjects,
        producers=producers,
        rate=rate,
        duration=duration,
        count=count,
        size=size,
        ledger=ledger,
        retry=retry,
        msg_id=msg_id,
        confirms=confirms,
        exchange=exchange,
        url=url,
        give_up_after=give_up_after,
    )

    def progress(summary: Any, inflight: int) -> None:
        if not as_json:
            err.print(
                f"load {summary.run}: sent {summary.sent:,} ({summary.rate:,.0f}/s), acked {summary.acked:,}, "
                f"errors {summary.errors:,}, in flight {inflight:,}",
                highlight=False,
            )

    signalled: list[int] = []

    async def main() -> Any:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda sig=sig: (signalled.append(sig), stop.set()))
        return await run_load(topo, opts, stop, progress)

    summary = run(main())
    summary.interrupted &= not until_signal  # a signal is how --until-signal ends
    if as_json:
        print_json(summary.as_dict())
    else:
        out.print(
            f"load {summary.run}: sent {summary.sent:,} in {summary.seconds:.1f}s ({summary.rate:,.0f} msg/s); "
            f"acked {summary.acked:,}, errors {summary.errors:,}, fire-and-forget {summary.not_asked:,}, "
            f"retries {summary.retries:,}; ledger {summary.ledger}"
        )
        for line in summary.first_errors:
            err.print(f"  error: {line}", highlight=False)
    if summary.interrupted:
        err.print("stopped before its --count or --duration: the ledger holds what was sent", highlight=False)
        raise typer.Exit(128 + signalled[0])


@app.command("snapshot")
def snapshot_cmd(
    source: Annotated[
        str, typer.Argument(help="jetstream://CLUSTER/STREAM or rabbitmq://CLUSTER/VHOST/QUEUE (vhost *, queue a glob)")
    ],
    out_dir: Annotated[Path, typer.Option("--out", help="New (or empty) directory for the Parquet snapshot.")],
    federated: Annotated[
        bool, typer.Option(help="Read federated queues too: reading one pulls messages from its upstream into it.")
    ] = False,
    spark_master: SparkMaster = None,
    spark_remote: SparkRemote = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Capture what a stream or queue holds, without changing it (queues are read and requeued)."""
    from ferry.pipeline.snapshot import snapshot
    from ferry.pipeline.spark import get_session

    topo = _topology(topology)

    def spark() -> Any:
        return get_session(master=spark_master, remote=spark_remote, app_name="ferry snapshot", data_sources=False)

    if source.startswith("jetstream:"):  # a stream's readers count what they got
        result = snapshot(
            topo, spark, source, out_dir, federated, progress=lambda n: _progress(n, "snapshot", enabled=not as_json)
        )
    else:
        with _busy(f"snapshot of {source} (a Spark job)", not as_json):
            result = snapshot(topo, spark, source, out_dir, federated)
    if as_json:
        print_json(result)
        return
    out.print(f"snapshot of {source}: {result['messages']:,} messages in {result['out']}")
    if result.get("note"):
        out.print(f"note: {result['note']}")


@app.command("audit")
def audit_cmd(
    ledger: Annotated[
        list[Path], typer.Option(metavar="DIR", help="A ledger directory written by `ferry load` (repeat).")
    ],
    tier: Annotated[
        list[str],
        typer.Option(metavar="NAME=WHERE", help="NAME=SNAPSHOT_DIR or NAME=jetstream://CLUSTER/STREAM (repeat)."),
    ],
    bucket: Annotated[int, typer.Option(min=1, help="Seconds per time bucket.")] = 10,
    html: Annotated[Path, typer.Option(help="Where to write the HTML report.")] = Path("ferry-audit.html"),
    max_lost: Annotated[int, typer.Option(min=0, help="Exit non-zero when more are lost.")] = 0,
    max_dup: Annotated[int, typer.Option(min=0, help="Exit non-zero when more duplicate copies exist.")] = 0,
    spark_master: SparkMaster = None,
    spark_remote: SparkRemote = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Reconcile a ledger with what each tier holds: lost, duplicated, unexpected, reordered, corrupted, delay."""
    from ferry.errors import UsageError
    from ferry.pipeline.audit import FULL_JVM_ROWS, audit, check_inputs, tier_frame, verdict
    from ferry.pipeline.spark import get_session
    from ferry.report import render_html

    tiers: dict[str, str] = {}
    for item in tier:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise UsageError(f"--tier {item!r}: expected NAME=SNAPSHOT_DIR or NAME=URI")
        if name in tiers:
            raise UsageError(f"--tier {name}: given twice (each tier needs a name of its own)")
        tiers[name] = value
    needs_topology = any("://" in v and not v.startswith("parquet://") for v in tiers.values())
    topo = _topology(topology) if needs_topology else None
    ledgers = [str(p) for p in ledger]
    rows = check_inputs(topo, ledgers, tiers)
    if not html.resolve().parent.is_dir():  # found out before the Spark job, not after it
        raise UsageError(f"--html {str(html)!r}: no such directory {str(html.resolve().parent)!r}")
    spark = get_session(
        master=spark_master,
        remote=spark_remote,
        app_name="ferry audit",
        light_jvm=rows < FULL_JVM_ROWS,
        data_sources=False,
    )
    with _busy(f"auditing {len(tiers)} tier(s) against {len(ledgers)} ledger(s) (a Spark job)", not as_json):
        report = audit(
            spark,
            ledgers[0] if len(ledgers) == 1 else ledgers,
            {n: tier_frame(spark, topo, v) for n, v in tiers.items()},
            bucket_s=bucket,
        )
    failures = verdict(report, max_lost, max_dup)
    html.write_text(render_html(report, failures))
    report["html"] = str(html.absolute())
    report["pass"] = not failures
    if as_json:
        print_json(report)
    else:
        _print_audit(report)
        out.print(f"HTML report: {html.absolute()}")
    if failures:
        for line in failures:
            err.print(f"[red]fail:[/] {line}", highlight=False)
        raise typer.Exit(3)


def _print_audit(report: dict[str, Any]) -> None:
    s = report["sent"]
    out.print(
        f"ledger: {s['sent']:,} sent, {s['acked']:,} acked, {s['errors']:,} publish errors, "
        f"{s['not_asked']:,} fire-and-forget"
    )
    table = Table(
        "tier",
        "holds",
        "lost (acked)",
        "lost (f&f)",
        "dup copies",
        "unexpected",
        "reordered",
        "corrupted",
        "delay p50/p99 ms",
    )
    for name, t in report["tiers"].items():
        d = t.get("delay")
        table.add_row(
            name,
            f"{t['tier_messages']:,}",
            f"{t.get('lost_acked', 0):,}",
            f"{t.get('lost_not_asked', 0):,}",
            f"{t.get('extra_copies', 0):,}",
            f"{t['unexpected']:,}",
            f"{t.get('reordered', 0):,}",
            f"{t.get('corrupted', 0):,}",
            f"{d['p50_ms']:.1f} / {d['p99_ms']:.1f}" if d else "-",
        )
    out.print(table)
    for name, t in report["tiers"].items():
        lossy = [b for b in t["buckets"] if b["lost_acked"] + b["lost_not_asked"] + b["extra_copies"]]
        for b in lossy[:20]:
            out.print(
                f"  {name}: bucket {_utc(b['bucket'])}: {b['lost_acked'] + b['lost_not_asked']} lost, "
                f"{b['extra_copies']} duplicate copies"
            )
        for r in t["lost_ids"][:10]:
            out.print(f"  {name}: lost {r['id']} (bucket {_utc(r['bucket'])})", highlight=False)


def _utc(epoch_s: int) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(epoch_s, UTC).strftime("%H:%M:%S")


# -- evacuate / rebalance / serve -----------------------------------------------------------

node_app = typer.Typer(
    **_plain, help="Evacuate a node: move its clients and JetStream leaders away at a set rate.", no_args_is_help=True
)
cluster_app = typer.Typer(
    **_plain, help="Rebalance clients and leaders across a cluster's nodes.", no_args_is_help=True
)
app.add_typer(node_app, name="node")
app.add_typer(cluster_app, name="cluster")

NodeClusterOpt = Annotated[str, typer.Option("--cluster", help="The node's cluster (when its name is ambiguous).")]
WaitHealthOpt = Annotated[
    float, typer.Option(min=0, help="Seconds for the load balancer to see the node unavailable before evicting.")
]
ConnRateOpt = Annotated[int, typer.Option(min=1, help="Connections closed per second (per node).")]
WaitTakeoverOpt = Annotated[float, typer.Option(min=0, help="Seconds for clients to reconnect before moving sessions.")]
SessRateOpt = Annotated[int, typer.Option(min=1, help="Leaders and replicas moved per second (per node).")]


def _names(value: str | None) -> list[str]:
    return [n for n in (value or "").replace(",", " ").split() if n]


class _Ticker:
    """Prints operation events on stderr: state changes at once, eviction counts at most once a second."""

    def __init__(self, as_json: bool) -> None:
        self.as_json, self.last, self.counts = as_json, 0.0, Counter[str]()

    def __call__(self, event: str, **data: Any) -> None:
        if self.as_json:
            _json_events(event, **data)
        elif event == "evicted":
            self.counts.update({k: data.get(k, 0) for k in ("connections", "sessions", "replicas")})
            if time.monotonic() - self.last >= 1.0:
                self.last = time.monotonic()
                left = f", {data['left']:,} left" if "left" in data else ""
                done = ", ".join(f"{v:,} {k}" for k, v in self.counts.items() if v)
                err.print(f"  moved so far: {done}{left}", highlight=False)
        elif event != "plan":  # the plan is in the final report
            _print_plain_event(event, **data)


@node_app.command("evacuate")
def node_evacuate(
    node: Annotated[str, typer.Argument(help="The node (broker name in the topology).")],
    cluster: NodeClusterOpt = "",
    wait_health_check: WaitHealthOpt = 60.0,
    conn_evict_rate: ConnRateOpt = 500,
    wait_takeover: WaitTakeoverOpt = 60.0,
    sess_evict_rate: SessRateOpt = 500,
    migrate_to: Annotated[str | None, typer.Option(help="Nodes to move leaders to (comma list).")] = None,
    redirect_to: Annotated[str | None, typer.Option(help="MQTT 5 redirection targets (not offered by NATS).")] = None,
    relocate_rate: Annotated[
        int | None,
        typer.Option(
            min=1, metavar="MSGS", help="Messages per second when relocating a classic queue (unpaced if unset)."
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what the node holds; change nothing.")] = False,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Empty a node at a set rate (EMQX's evacuation); resumes a persisted one. Returns once it is prohibiting."""
    from ferry.ops.rebalance import EvacuateRequest, evacuate

    topo = _topology(topology)
    req = EvacuateRequest(
        node=node,
        cluster=cluster,
        wait_health_check=wait_health_check,
        conn_evict_rate=conn_evict_rate,
        wait_takeover=wait_takeover,
        sess_evict_rate=sess_evict_rate,
        migrate_to=_names(migrate_to),
        redirect_to=_names(redirect_to),
        relocate_rate=relocate_rate,
        dry_run=dry_run,
    )
    report = run(evacuate(topo, req, _Ticker(as_json)))
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
        "moved by ferry: leaders stepped down (or classic queues relocated), replicas moved off (a peer-remove, "
        "or a one-replica stream with its leader); other leaders left with their replicas, and followers with "
        "no spare server to go to stay (kept)",
        style="dim",
        highlight=False,
    )
    out.print(f"recipients: {', '.join(r['recipients'])}", highlight=False)
    if r.get("relocated"):
        moves = ", ".join(f"{x['queue']} -> {x['to']}" for x in r["relocated"])
        out.print(f"classic queues relocated: {moves}", highlight=False)
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
    from ferry.ops.rebalance import node_status

    rows = run(node_status(_topology(topology), node, cluster))
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
    from ferry.ops.rebalance import way_on

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
    from ferry.ops.rebalance import stop

    r = run(stop(_topology(topology), cluster, node))
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
    execute: Annotated[
        bool, typer.Option("--execute", help="Carry the proposal out (default: only print it).")
    ] = False,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Propose moving clients and leaders from busy nodes to idle ones; --execute carries it out."""
    from ferry.ops.rebalance import RebalanceRequest, rebalance

    req = RebalanceRequest(
        cluster=cluster,
        nodes=_names(nodes),
        abs_conn_threshold=abs_conn_threshold,
        rel_conn_threshold=rel_conn_threshold,
        abs_sess_threshold=abs_sess_threshold,
        rel_sess_threshold=rel_sess_threshold,
        wait_health_check=wait_health_check,
        conn_evict_rate=conn_evict_rate,
        wait_takeover=wait_takeover,
        sess_evict_rate=sess_evict_rate,
        execute=execute,
    )
    r = run(rebalance(_topology(topology), req, _Ticker(as_json)))
    if as_json:
        print_json(r)
    else:
        _print_rebalance(r)
    if r["outcome"].startswith("aborted"):
        raise typer.Exit(1)


def _print_rebalance(r: dict[str, Any]) -> None:
    if "proposal" in r:
        table = Table("node", "role", "connections", "after", "sessions (leaders)", "after")
        for p in r["proposal"]:
            table.add_row(
                p["node"],
                p["role"],
                f"{p['connections']:,}",
                f"{p['connections_after']:,}",
                f"{p['sessions']:,}",
                f"{p['sessions_after']:,}",
            )
        out.print(table)
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
    from ferry.ops.rebalance import rebalance_status

    rows = run(rebalance_status(_topology(topology), cluster or ""))
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
    from ferry.ops.rebalance import stop

    r = run(stop(_topology(topology), cluster, None))
    if as_json:
        print_json(r)
        return
    out.print(f"rebalance of {cluster} stopped (was {r.get('state')})")


# -- replicate / site ---------------------------------------------------------------------------

replicate_app = typer.Typer(
    **_plain, help="Relay streams from one site to another (a Spark streaming job).", no_args_is_help=True
)
site_app = typer.Typer(**_plain, help="Fail a site over to its replica, and back.", no_args_is_help=True)
app.add_typer(replicate_app, name="replicate")
app.add_typer(site_app, name="site")


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
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Define a replication (kept at the destination) and create missing destination streams.

    Relays are the `ferry replicate run` processes: run one or more (one relays, the others stand by).
    """
    from ferry.ops import replicate as rp

    rep = rp.Replication(source, to, streams, subject_prefix, stream_name)
    result = run(rp.start(_topology(topology), rep, dry_run=dry_run))
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
        out.print(f"run relays with: ferry replicate run --from {source} --to {to}")


@replicate_app.command("run")
def replicate_run(
    source: FromOpt,
    to: ToOpt,
    lease: Annotated[float, typer.Option(min=2, help="Seconds after which a standby takes over a silent relay.")] = 5.0,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus metrics on 127.0.0.1:PORT/metrics.")
    ] = None,
    spark_master: SparkMaster = None,
    spark_remote: SparkRemote = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Relay (or stand by to relay) a defined replication until `ferry replicate stop`."""
    from ferry.ops import replicate as rp
    from ferry.pipeline.spark import get_session

    topo = _topology(topology)
    metrics = rp.Metrics(metrics_port) if metrics_port else None

    def spark() -> Any:
        return get_session(master=spark_master, remote=spark_remote, app_name=f"ferry relay {source} to {to}")

    emit = _json_events if as_json else _print_plain_event
    state = run(rp.Relay(topo, source, to, spark, lease=lease, emit=emit, metrics=metrics).run())
    if as_json:
        print_json(state)


@replicate_app.command("stop")
def replicate_stop(
    source: FromOpt,
    to: ToOpt,
    wait: Annotated[float, typer.Option(min=0, help="Seconds to wait for the relay's stop marker.")] = 30.0,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Stop a replication gracefully: the relay writes a stop marker, so its successor needs no replay check."""
    from ferry.ops import replicate as rp

    state = run(rp.stop(_topology(topology), source, to, wait=wait))
    if as_json:
        print_json(state)
        return
    marker = state.get("marker")
    positions = ", ".join(f"{k} {v:,}" for k, v in marker.items()) if isinstance(marker, dict) else marker
    out.print(f"{source} -> {to} stopped" + (f"; positions: {positions}" if marker else "; the next start will scan"))


@replicate_app.command("status")
def replicate_status(topology: TopologyOpt = None, as_json: JsonOpt = False) -> None:
    """Every replication: state, relay leader, per stream last relayed sequence, lag and rate."""
    from ferry.ops import replicate as rp

    rows = run(rp.status(_topology(topology)))
    if as_json:
        print_json(rows)
        return
    if not rows:
        out.print("no replication is defined")
        return
    table = Table("replication", "state", "leader", "stream", "relayed", "lag", "lag s", "rate/s")
    for r in rows:
        name = f"{r.get('source', '?')} -> {r.get('dest')}"
        if r.get("unreachable"):
            table.add_row(name, "[red]unreachable[/]", "", "", "", "", "", r["unreachable"])
            continue
        leader = f"{r['leader']['host']}:{r['leader']['pid']}" if r.get("leader") else "-"
        state = r.get("summary") or f"{r.get('state')} ({r.get('desired')})"
        progress = r.get("progress") or {"": {}}
        for stream, p in progress.items():
            cells = [p.get(k) for k in ("relayed", "lag", "lag_s", "rate")]
            table.add_row(name, state, leader, stream, *("-" if c is None else f"{c:,}" for c in cells))
            if p.get("lag_at") == "last relay":
                table.caption = "lag as the last relay saw it where the source did not answer now"
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
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Stop FROM -> TO (fencing its relay), record the last sequence TO holds per stream, make TO primary."""
    from ferry.ops import replicate as rp

    emit = _json_events if as_json else _print_plain_event
    result = run(rp.failover(_topology(topology), to, source, emit=emit, reverse=reverse, wait=wait, dry_run=dry_run))
    if as_json:
        print_json(result)
        return
    if dry_run:
        reach = "reachable" if result["source_reachable"] else "not reachable"
        out.print(
            f"dry run: would fence {result['from']} -> {to} ({result['relay']}) and make {to} primary; "
            f"{result['from']} sequences {to} holds so far: {_per_stream(result['replicated'])}; "
            f"{result['from']} is {reach}",
            highlight=False,
        )
        return
    fo = result["failover"]
    out.print(f"{to} is primary (was {fo['from']}); {fo['from']} sequences {to} holds: {_per_stream(fo['replicated'])}")
    if result.get("reverse"):
        out.print(f"defined {to} -> {fo['from']}; run relays with: ferry replicate run --from {to} --to {fo['from']}")


@site_app.command("failback")
def site_failback(
    to: Annotated[str, typer.Option("--to", help="The site that becomes primary again.")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be reconciled.")] = False,
    spark_master: SparkMaster = None,
    spark_remote: SparkRemote = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Reconcile both sites by origin sequence (exactly once each way), make TO primary, define TO -> other."""
    from ferry.ops import replicate as rp
    from ferry.pipeline.spark import get_session

    def spark() -> Any:
        return get_session(master=spark_master, remote=spark_remote, app_name="ferry failback", data_sources=False)

    emit = _json_events if as_json else _print_plain_event
    try:
        report = run(rp.failback(_topology(topology), to, spark, emit=emit, dry_run=dry_run))
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
    out.print(report["replication"])


@app.command("serve")
def serve_cmd(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8377,
    token_file: Annotated[
        Path | None, typer.Option(help="File holding the bearer token the mutating endpoints require.")
    ] = None,
    topology: TopologyOpt = None,
) -> None:
    """HTTP API: availability checks for load balancers, start/stop/inspect evacuations and rebalances.

    Keeps every journaled evacuation and rebalance driven (adopting those whose ferry died).
    OpenAPI at /openapi.json, docs at /docs.
    """
    import uvicorn

    from ferry.api import create_app
    from ferry.errors import ConfigError

    token = None
    if token_file:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --token-file {token_file}: {exc.strerror}") from None
        if not token:
            raise ConfigError(f"--token-file {token_file} is empty")
    token = token or os.environ.get("FERRY_API_TOKEN") or None
    app_ = create_app(_topology(topology), token)
    uvicorn.run(app_, host=host, port=port, log_level="warning")


# -- lab ---------------------------------------------------------------------------------


@lab_app.command("up")
def lab_up(
    profile: Annotated[str, typer.Argument(help="supercluster | sites | rabbit-dr | rabbit-cluster")],
    dir: DirOpt = None,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds to wait for health.")] = 180.0,
    haproxy: Annotated[
        bool,
        typer.Option("--haproxy", help="Put HAProxy (checked through `ferry serve`) in front of the lab's clusters."),
    ] = False,
) -> None:
    """Start a profile's servers on 127.0.0.1 and wait until they are healthy."""
    from ferry import lab

    t0 = time.perf_counter()
    state = lab.up(profile, _lab_dir(dir), timeout=timeout, log=lambda m: err.print(m), haproxy=haproxy)
    out.print(f"lab {profile}: {len(state.procs)} processes healthy in {time.perf_counter() - t0:.1f}s")
    out.print(f"topology: {(_lab_dir(dir) or lab.lab_root()) / 'topology.yaml'}")
    if state.lb:
        out.print(f"ferry serve: {state.lb['serve']}  HAProxy stats: {state.lb['stats']}")
        for name, urls in state.lb["clusters"].items():
            out.print(f"through HAProxy: {name}: {' '.join(urls.values())}")


@lab_app.command("haproxy-config")
def lab_haproxy_config(
    cluster: Annotated[str, typer.Argument(help="The NATS or RabbitMQ cluster to front.")],
    serve: Annotated[str, typer.Option(help="host:port of `ferry serve` (the availability check).")] = "127.0.0.1:8377",
    nats_bind: Annotated[str, typer.Option(help="Where HAProxy listens for NATS clients.")] = "*:4222",
    amqp_bind: Annotated[str, typer.Option(help="Where HAProxy listens for AMQP clients.")] = "*:5672",
    mqtt_bind: Annotated[str, typer.Option(help="Where HAProxy listens for MQTT clients ('' for none).")] = "*:1883",
    topology: TopologyOpt = None,
) -> None:
    """Print an haproxy.cfg for a cluster of the topology: leastconn, node health + ferry's availability check."""
    from ferry.lab import haproxy

    c = _topology(topology).cluster(cluster)
    fronts = haproxy.frontends(cluster, c, nats_bind if c.kind == "nats" else amqp_bind, mqtt_bind or None)
    out.print(haproxy.render(fronts, serve, stats_bind="127.0.0.1:8404"), highlight=False, markup=False)


@lab_app.command("failback-setting")
def lab_failback_setting(
    queues: Annotated[int, typer.Option(min=1, help="Federated queues fed-0 .. fed-N-1 (in vhost /).")] = 4,
    messages: Annotated[int, typer.Option(min=0, help="Messages left on each of ltm's federated queues.")] = 500,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """On the rabbit-dr lab: upstream art federates queues to pc1 and ltm, and ltm's hold messages
    nobody consumed (what `ferry failback --from ltm --to pc1` brings home). Run again, it adds as
    many messages again."""
    from ferry.lab.scenarios import dr_federation, fill_queue

    topo = _topology(topology)
    for name in ("art", "pc1", "ltm"):
        topo.rabbitmq(name)  # a one-line error on another lab's topology
    names = [f"fed-{i}" for i in range(queues)]

    async def go() -> dict[str, Any]:
        setting = await dr_federation(topo, ["/"], names, prefix="fed-")
        for queue in names:
            await fill_queue(topo, "ltm", "/", queue, messages)
        return {**setting, "ltm_messages_per_queue": messages}

    result = run(go())
    if as_json:
        print_json(result)
        return
    out.print(
        f"art federates {', '.join(names)} (vhost /) to pc1 and ltm; each of them on ltm holds {messages:,} "
        "messages more, left behind as after a DR\n"
        "next: ferry failback --from ltm --to pc1 --dry-run"
    )


@lab_app.command("status")
def lab_status(dir: DirOpt = None, as_json: JsonOpt = False) -> None:
    """Each lab server: pid, ports, health."""
    from ferry import lab

    root = _lab_dir(dir)
    rows = lab.status(root)
    if as_json:
        print_json(rows)
        return
    if not rows:
        out.print(f"no lab is running under {root or lab.lab_root()}")
        return
    table = Table("profile", "server", "kind", "pid", "ports", "health")
    for r in rows:
        ports = " ".join(f"{k}={v}" for k, v in r["ports"].items())
        health = "[green]ok[/]" if r["health"] == "ok" else f"[red]{r['health']}[/]"
        table.add_row(r["profile"], r["server"], r["kind"], str(r["pid"]), ports, health)
    out.print(table)


@lab_app.command("down")
def lab_down(
    profile: Annotated[str | None, typer.Argument(help="Profile to stop (default: all).")] = None,
    dir: DirOpt = None,
) -> None:
    """Stop exactly the processes the lab started and remove its files."""
    from ferry import lab

    stopped = lab.down(profile, _lab_dir(dir), log=lambda m: out.print(m))
    if not stopped:
        out.print("nothing to stop")


# -- entry point ------------------------------------------------------------------------------


def main() -> None:
    # client libraries log connection failures themselves; ferry reports them once, as one line
    for name in ("aiormq", "aio_pika", "nats", "py4j", "asyncio"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # py4j reports a call cut short by Ctrl-C on the root logger, with a traceback each time: the
    # root logger keeps quiet, and ferry's own loggers write their lines to stderr
    logging.getLogger().addHandler(logging.NullHandler())
    logging.getLogger("ferry").addHandler(logging.StreamHandler())
    try:
        code = app(standalone_mode=False)  # usage errors come here, to be reported on one line
    except NoArgsIsHelpError as exc:
        err.print(exc.format_message(), highlight=False, markup=False)
        sys.exit(2)
    except ClickException as exc:  # bad usage: one line, exit 2
        err.print(f"[red]error:[/] {escape(redact(exc.format_message()))}", highlight=False)
        sys.exit(exc.exit_code)
    except typer.Abort:
        _interrupted()
    except FerryError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
        sys.exit(exc.exit_code)
    except pydantic.ValidationError as exc:
        e = exc.errors()[0]
        where = ".".join(str(x) for x in e["loc"])
        err.print(f"[red]error:[/] {where}: {redact(e['msg'].removeprefix('Value error, '))}", highlight=False)
        sys.exit(2)
    except TimeoutError as exc:
        from ferry.brokers.nats import DENIALS

        why = f"; the server had refused ferry's user: {escape(DENIALS[-1])}" if DENIALS else ""
        err.print(
            f"[red]error:[/] a broker did not answer in time ({type(exc).__module__}.{type(exc).__name__}){why}",
            highlight=False,
        )
        sys.exit(1)
    except KeyboardInterrupt:
        _interrupted()
    except OSError as exc:  # a path that is not what the command needs (a file where a directory goes)
        where = f": {exc.filename}" if exc.filename else ""
        err.print(f"[red]error:[/] {escape(redact(exc.strerror or str(exc)))}{escape(str(where))}", highlight=False)
        sys.exit(1)
    except Exception as exc:  # a Spark job's failure (from a task, or Spark's own): one line too
        # a broker's answer no command turned into a FerryError (a permission refused, say)
        module = type(exc).__module__
        if module.startswith(("nats.", "aiormq.", "aio_pika.")):
            text = getattr(exc, "description", None) or str(exc) or type(exc).__name__
            if not module.startswith("nats."):  # AMQP's args: (403, "ACCESS_REFUSED - access to queue ...")
                text = next((a for a in reversed(exc.args) if isinstance(a, str) and a), text)
            err.print(f"[red]error:[/] {escape(redact(text.splitlines()[0]))}", highlight=False)
            sys.exit(1)
        if not module.startswith(("pyspark", "py4j")):
            raise
        from ferry.pipeline.spark import spark_error

        failure = spark_error(exc)
        err.print(f"[red]error:[/] {escape(str(failure))}", highlight=False)
        sys.exit(failure.exit_code)
    if code == 130:  # typer's answer to Ctrl-C
        _interrupted()
    sys.exit(code if isinstance(code, int) else 0)  # a typer.Exit's code, else success


def _interrupt_spark() -> None:
    spark = sys.modules.get("ferry.pipeline.spark")  # loaded only by the commands that use Spark
    if spark:
        spark.interrupt()


def _interrupted() -> None:
    _interrupt_spark()
    err.print("interrupted")
    sys.exit(130)


if __name__ == "__main__":
    main()
