"""`ferry copy`."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.table import Table

from ferry.cli.options import FederatedOpt, JsonOpt, SparkArchive, SparkMaster, SparkRemote, TopologyOpt, open_topology
from ferry.cli.render import err, json_event, out, print_json, progress_bar, redelivered_warning


def copy_cmd(
    source: Annotated[
        str, typer.Argument(help="jetstream://CLUSTER/STREAM, rabbitmq://CLUSTER/VHOST/QUEUE, parquet:///DIR")
    ],
    destination: Annotated[str, typer.Argument(help="Same forms; a RabbitMQ queue may be * (same names).")],
    mode: Annotated[
        str, typer.Option(help="ordered (one writer, the source's order; streams: resumable) or parallel.")
    ] = "ordered",
    partitions: Annotated[
        int | None, typer.Option(min=1, help="Read/write in N parallel ranges (implies parallel).")
    ] = None,
    rate: Annotated[float | None, typer.Option(min=1, help="Messages per second, all tasks together.")] = None,
    create: Annotated[
        bool, typer.Option(help="Create a missing destination stream/queue like the source (or its backup).")
    ] = False,
    subject_prefix: Annotated[str, typer.Option(help="Prefix added to every subject written to JetStream.")] = "",
    drain: Annotated[
        bool, typer.Option("--drain", help="Queues: move their messages out (default: read and requeue, keep them).")
    ] = False,
    federated: FederatedOpt = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing.")] = False,
    spark_master: SparkMaster = None,
    spark_remote: SparkRemote = None,
    spark_archive: SparkArchive = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Copy messages between streams, queues and Parquet, as a Spark job.

    A queue is read without consuming it (each message held unacked, copied, then requeued);
    --drain moves its messages out instead, leaving it empty."""
    from ferry.jobs.copy.plan import CopyOptions, plan_copy
    from ferry.jobs.copy.record import CopyRecord
    from ferry.jobs.copy.run import run_copy
    from ferry.spark.session import get_session

    topo = open_topology(topology)
    opts = CopyOptions(
        mode=mode,
        partitions=partitions,
        rate=rate,
        create=create,
        dry_run=dry_run,
        subject_prefix=subject_prefix,
        drain=drain,
    )
    plan = plan_copy(topo, source, destination, opts)
    if dry_run:
        if as_json:
            print_json({"dry_run": True, "plan": plan.as_dict()})
        else:
            _print_plan(plan.as_dict())
        return
    if as_json:
        json_event("plan", **plan.as_dict())
    else:
        _print_plan(plan.as_dict())
    spark = get_session(
        spark_master,
        spark_remote,
        archive=spark_archive,
        app_name=f"ferry copy {source} -> {destination}",
        data_sources=False,
    )
    with (
        CopyRecord(topo, plan, warn=lambda line: err.print(f"warning: {line}", markup=False)) as record,
        progress_bar(plan.messages, "copying", enabled=not as_json) as advance,
    ):
        said = [0.0]

        def progress(n: int) -> None:
            advance(n)
            record.progress(n)
            if as_json and time.monotonic() - said[0] >= 1.0:  # a line a second at most
                said[0] = time.monotonic()
                json_event("progress", messages=n, total=plan.messages)

        report = run_copy(topo, plan, spark, progress=progress)
        record.done(report.as_dict())
    if as_json:
        print_json(report.as_dict())
        return
    out.print(
        f"read {report.read:,}, stored {report.stored:,}, already present {report.duplicates:,}, "
        f"retries {report.retries:,}, {report.bytes / 1e6:.1f} MB of payload in {report.seconds:.1f}s "
        f"({report.rate:,.0f} msg/s)"
    )
    if report.queues:
        verb = "moved" if plan.engine == "mover" else "copied"
        table = Table("vhost", "queue", "before", verb, "left", "redelivered", "seconds")
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
        left = sum(r["left"] for r in report.queues)
        out.print(
            f"the source queues were drained: {left:,} messages left in them"
            if plan.engine == "mover"
            else f"the source queues keep their messages: {left:,} ready in them again, now redelivered"
        )
    if report.possible_duplicates:
        out.print(redelivered_warning(report.possible_duplicates))


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


def register(app: typer.Typer) -> None:
    """Add copy's commands to `app`."""
    app.command("copy")(copy_cmd)
