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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ferry.errors import FerryError

_plain = {"rich_markup_mode": None}  # usage errors as plain "Error: ..." lines, not boxes
app = typer.Typer(
    **_plain,
    name="ferry",
    help="Move message workloads between NATS JetStream and RabbitMQ clusters without losing a message.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
topology_app = typer.Typer(**_plain, help="Validate and probe topology files.", no_args_is_help=True)
lab_app = typer.Typer(**_plain, help="Real brokers on 127.0.0.1 for demos, tests and benchmarks.", no_args_is_help=True)
app.add_typer(topology_app, name="topology")
app.add_typer(lab_app, name="lab")

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

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
    return asyncio.run(coro)


def print_json(data: Any) -> None:
    out.print_json(json.dumps(data, default=str))


def _lab_dir(path: Path | None) -> Path | None:
    if path:
        os.environ["FERRY_LAB_DIR"] = str(path.absolute())
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


# -- copy ---------------------------------------------------------------------------------

SparkMaster = Annotated[str | None, typer.Option("--spark-master", help="Spark master URL (default local[*]).")]
SparkRemote = Annotated[str | None, typer.Option("--spark-remote", help="Spark Connect URL sc://host:port.")]


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
        mode=mode, partitions=partitions, rate=rate, create=create and not dry_run, subject_prefix=subject_prefix
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
    spark = get_session(master=spark_master, remote=spark_remote, app_name="ferry copy")
    with _progress(plan.messages, "copying", enabled=not as_json) as advance:
        report = run_copy(topo, plan, spark, progress=advance)
    if as_json:
        print_json(report.as_dict())
        return
    out.print(
        f"read {report.read:,}, stored {report.stored:,}, already present {report.duplicates:,}, "
        f"retries {report.retries:,}, {report.bytes / 1e6:.1f} MB in {report.seconds:.1f}s ({report.rate:,.0f} msg/s)"
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
        out.print(
            f"[yellow]{report.possible_duplicates:,} messages were redelivered after an interrupted run and "
            "may be duplicates at the destination (they carry x-ferry-transfer; `ferry audit` counts them)[/]"
        )


def _print_plan(plan: dict[str, Any]) -> None:
    out.print(
        f"[bold]{plan['source']}[/] -> [bold]{plan['destination']}[/]: {plan['messages']:,} messages "
        f"({plan['bytes'] / 1e6:.1f} MB), engine {plan['engine']}, mode {plan['mode']}"
    )
    for x in plan["queues"]:
        out.print(
            f"  queue {x['vhost']}/{x['queue']}: {x['ready']:,} ready"
            + (f" -> {x['target']}" if x.get("target") else "")
        )
    for note in plan["notes"]:
        out.print(f"  note: {note}")


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
        TextColumn(what),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ]
    t0 = time.monotonic()
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task(what, total=total or None, rate="")

        def advance(done: int) -> None:
            rate = done / max(1e-6, time.monotonic() - t0)
            bar.update(task, completed=done, rate=f"{rate:,.0f} msg/s")

        yield advance


# -- lab ---------------------------------------------------------------------------------


@lab_app.command("up")
def lab_up(
    profile: Annotated[str, typer.Argument(help="supercluster | sites | rabbit-dr | rabbit-cluster")],
    dir: DirOpt = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for health.")] = 180.0,
) -> None:
    """Start a profile's servers on 127.0.0.1 and wait until they are healthy."""
    from ferry import lab

    t0 = time.perf_counter()
    state = lab.up(profile, _lab_dir(dir), timeout=timeout, log=lambda m: err.print(m))
    out.print(f"lab {profile}: {len(state.procs)} processes healthy in {time.perf_counter() - t0:.1f}s")
    out.print(f"topology: {lab.lab_root() / 'topology.yaml'}")


@lab_app.command("status")
def lab_status(dir: DirOpt = None, as_json: JsonOpt = False) -> None:
    """Each lab server: pid, ports, health."""
    from ferry import lab

    _lab_dir(dir)
    rows = lab.status()
    if as_json:
        print_json(rows)
        return
    if not rows:
        out.print(f"no lab is running under {lab.lab_root()}")
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
    try:
        app()  # typer reports usage errors itself (exit 2)
    except FerryError as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
