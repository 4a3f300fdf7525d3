"""`ferry topology check` and `ferry topology smoke`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ferry.cli.options import PLAIN, JsonOpt, TopologyOpt, open_topology, run
from ferry.cli.render import err, out, print_json

topology_app = typer.Typer(**PLAIN, help="Validate and probe topology files.", no_args_is_help=True)


# -- topology --------------------------------------------------------------------------


@topology_app.command("check")
def topology_check(
    file: Annotated[Path, typer.Argument(help="Topology YAML file.")],
    probe: Annotated[bool, typer.Option(help="Probe every endpoint (--no-probe: validate only).")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Validate a topology file and probe every endpoint; one line per problem.

    For each endpoint: whether it answered, its TLS session (version, the server certificate's
    subject, days until it expires) and who the server says ferry is (NATS user and account,
    RabbitMQ user and tags). A certificate or user JWT that expires within 30 days is a warning;
    an expired one is a problem (exit 1)."""
    from ferry.brokers import client_certificates, probe_all
    from ferry.topology import load_topology

    topo = load_topology(file)
    problems = [f"{file}: {p}" for p in topo.credential_problems()]
    expired, warnings = client_certificates(topo) if not problems else ([], [])
    problems += [f"{file}: {p}" for p in expired]
    probes = run(probe_all(topo)) if probe and not problems else []
    problems += [f"{p.cluster}/{p.broker} {p.endpoint} {p.url}: {p.detail}" for p in probes if not p.ok]
    warnings += [f"{p.cluster}/{p.broker} {p.endpoint}: {w}" for p in probes for w in p.warnings]
    if as_json:
        print_json(
            {
                "file": str(file),
                "ok": not problems,
                "problems": problems,
                "warnings": warnings,
                "probes": [p.__dict__ for p in probes],
            }
        )
    else:
        if probes:
            table = Table("cluster", "broker", "endpoint", "url", "answer", "tls", "identity", "ms", title=f"{file}")
            for p in probes:
                answer = f"[green]{p.detail}[/]" if p.ok else f"[red]{p.detail}[/]"
                table.add_row(p.cluster, p.broker, p.endpoint, p.url, answer, _tls_cell(p.tls), p.identity or "-",
                              f"{p.ms:.0f}")  # fmt: skip
            out.print(table)
        for line in warnings:
            err.print(f"[yellow]warning:[/] {line}", highlight=False, soft_wrap=True)
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


def _tls_cell(tls: dict | None) -> str:
    """``TLSv1.3 CN=nats-a (354 d)``; ``-`` for plaintext."""
    if not tls:
        return "-"
    days = tls["days_left"]
    left = "" if days is None else f" ({days} d)" if days >= 30 else f" [yellow]({days} d)[/]"
    return f"{tls['version']} {tls['subject']}{left}"


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
    from ferry.jobs.proof import smoke

    topo = open_topology(topology)
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


def register(app: typer.Typer) -> None:
    """Add topology's commands to `app`."""
    app.add_typer(topology_app, name="topology")
