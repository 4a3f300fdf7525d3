"""`ferry load`, `ferry snapshot` and `ferry audit`: the proof."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ferry.cli.options import (
    FederatedOpt,
    JsonOpt,
    SparkArchive,
    SparkMaster,
    SparkRemote,
    TopologyOpt,
    open_topology,
    run,
)
from ferry.cli.render import busy, err, out, print_json, progress_bar, utc_time


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
            help="Connect to this URL (e.g. a load balancer), not the topology's brokers; NATS takes a "
            "comma-separated list (the first, then the next on reconnect); RabbitMQ producers reconnect "
            "and re-send what was not confirmed."
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
    from ferry.jobs.proof.load import LoadOptions, run_load

    if not (duration or count or until_signal):
        raise UsageError("give --count, --duration or --until-signal")
    topo = open_topology(topology)
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


def snapshot_cmd(
    source: Annotated[
        str, typer.Argument(help="jetstream://CLUSTER/STREAM or rabbitmq://CLUSTER/VHOST/QUEUE (vhost *, queue a glob)")
    ],
    out_dir: Annotated[Path, typer.Option("--out", help="New (or empty) directory for the Parquet snapshot.")],
    federated: FederatedOpt = False,
    spark_master: SparkMaster = None,
    spark_remote: SparkRemote = None,
    spark_archive: SparkArchive = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Capture what a stream or queue holds, without changing it (queues are read and requeued)."""
    from ferry.jobs.proof.snapshot import snapshot
    from ferry.spark.session import factory

    topo = open_topology(topology)

    spark = factory(
        spark_master, spark_remote, archive=spark_archive, app_name=f"ferry snapshot {source}", data_sources=False
    )

    result = snapshot(topo, spark, source, out_dir, progress=lambda n: progress_bar(n, "snapshot", enabled=not as_json))
    if as_json:
        print_json(result)
        return
    out.print(f"snapshot of {source}: {result['messages']:,} messages in {result['out']}")
    if result.get("note"):
        out.print(f"note: {result['note']}")


def audit_cmd(
    ledger: Annotated[
        list[Path], typer.Option(metavar="DIR", help="A ledger directory written by `ferry load` (repeat).")
    ],
    tier: Annotated[
        list[str],
        typer.Option(metavar="NAME=WHERE", help="NAME=SNAPSHOT_DIR or NAME=jetstream://CLUSTER/STREAM (repeat)."),
    ],
    holds: Annotated[
        list[str] | None,
        typer.Option(
            metavar="TIER=LEDGER",
            help="The tier must hold this ledger's messages (repeat); without it, every ledger's.",
        ),
    ] = None,
    events: Annotated[
        list[Path] | None,
        typer.Option(
            metavar="FILE",
            help="A job's --json events (its stderr), marked on the report's timeline (repeat).",
        ),
    ] = None,
    bucket: Annotated[int, typer.Option(min=1, help="Seconds per time bucket.")] = 10,
    html: Annotated[Path, typer.Option(help="Where to write the HTML report.")] = Path("ferry-audit.html"),
    max_lost: Annotated[int, typer.Option(min=0, help="Exit non-zero when more are lost.")] = 0,
    max_dup: Annotated[int, typer.Option(min=0, help="Exit non-zero when more duplicate copies exist.")] = 0,
    spark_master: SparkMaster = None,
    spark_remote: SparkRemote = None,
    spark_archive: SparkArchive = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Reconcile a ledger with what each tier holds: lost, duplicated, unexpected, reordered, corrupted, delay."""
    from ferry.errors import UsageError
    from ferry.jobs.proof.audit import FULL_JVM_ROWS, audit, check_inputs, read_events, tier_frame, verdict
    from ferry.jobs.proof.report import render_html
    from ferry.spark.session import get_session

    tiers: dict[str, str] = {}
    for item in tier:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise UsageError(f"--tier {item!r}: expected NAME=SNAPSHOT_DIR or NAME=URI")
        if name in tiers:
            raise UsageError(f"--tier {name}: given twice (each tier needs a name of its own)")
        tiers[name] = value
    needs_topology = any("://" in v and not v.startswith("parquet://") for v in tiers.values())
    topo = open_topology(topology) if needs_topology else None
    ledgers = [str(p) for p in ledger]
    held = _holds(holds or [], tiers, ledgers)
    marks = read_events(events or [])
    rows, warnings = check_inputs(topo, ledgers, tiers, held)
    for line in warnings:
        err.print(f"warning: {line}", markup=False, highlight=False)
    if not html.resolve().parent.is_dir():  # found out before the Spark job, not after it
        raise UsageError(f"--html {str(html)!r}: no such directory {str(html.resolve().parent)!r}")
    spark = get_session(
        master=spark_master,
        remote=spark_remote,
        archive=spark_archive,
        app_name=f"ferry audit {' '.join(tiers)}",  # the tiers' names
        light_jvm=rows < FULL_JVM_ROWS,
        data_sources=False,
        python_tasks=needs_topology,  # a stream's tier is read in Python tasks; Parquet files are not
    )
    with busy(f"auditing {len(tiers)} tier(s) against {len(ledgers)} ledger(s) (a Spark job)", not as_json):
        report = audit(
            spark,
            ledgers[0] if len(ledgers) == 1 else ledgers,
            {n: tier_frame(spark, topo, v) for n, v in tiers.items()},
            bucket_s=bucket,
            holds=held,
        )
    report["warnings"], report["events"] = warnings, marks
    failures = verdict(report, max_lost, max_dup)
    html.write_text(render_html(report, failures))
    report["html"] = str(html.absolute())
    report["pass"] = not failures
    # beside the HTML, for `ferry serve --reports` (the console and ferry_audit_messages)
    html.with_suffix(".json").write_text(json.dumps(report, default=str))
    if as_json:
        print_json(report)
    else:
        _print_audit(report)
        out.print(f"HTML report: {html.absolute()}")
    if failures:
        for line in failures:
            err.print(f"[red]fail:[/] {line}", highlight=False)
        raise typer.Exit(3)


def _holds(given: list[str], tiers: dict[str, str], ledgers: list[str]) -> dict[str, list[str]]:
    """--holds TIER=LEDGER, each naming a --tier and a --ledger: the ledgers of each tier named."""
    from ferry.errors import UsageError

    by_path = {Path(p).resolve(): p for p in ledgers}
    out: dict[str, list[str]] = {}
    for item in given:
        name, sep, path = item.partition("=")
        if not sep or name not in tiers:
            raise UsageError(f"--holds {item!r}: expected TIER=LEDGER, TIER one of the tiers ({', '.join(tiers)})")
        if (ledger := by_path.get(Path(path).resolve())) is None:
            raise UsageError(f"--holds {item!r}: {path!r} is not one of the --ledger directories")
        out.setdefault(name, []).append(ledger)
    return out


def _print_audit(report: dict[str, Any]) -> None:
    from ferry.jobs.proof.report import copied_delay_note

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
        "sent→stored p50/p99 ms",
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
            f"{d['p50_ms']:.1f} / {d['p99_ms']:.1f}{' *' if d.get('by_copy') else ''}" if d else "-",
        )
    out.print(table)
    for name, t in report["tiers"].items():
        if (d := t.get("delay")) and d.get("by_copy"):
            out.print(f"  * {name}: {copied_delay_note(d)}")
    for name, t in report["tiers"].items():
        lossy = [b for b in t["buckets"] if b["lost_acked"] + b["lost_not_asked"] + b["extra_copies"]]
        for b in lossy[:20]:
            out.print(
                f"  {name}: bucket {utc_time(b['bucket'])}: {b['lost_acked'] + b['lost_not_asked']} lost, "
                f"{b['extra_copies']} duplicate copies"
            )
        for r in t["lost_ids"][:10]:
            out.print(f"  {name}: lost {r['id']} (bucket {utc_time(r['bucket'])})", highlight=False)


def register(app: typer.Typer) -> None:
    """Add proof's commands to `app`."""
    app.command("load")(load_cmd)
    app.command("snapshot")(snapshot_cmd)
    app.command("audit")(audit_cmd)
