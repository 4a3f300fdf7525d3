"""`ferry stream add | info | rm`."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from ferry.cli.options import PLAIN, AccountOpt, ClusterOpt, JsonOpt, StreamArg, TopologyOpt, open_topology, run
from ferry.cli.render import err, out, print_json

stream_app = typer.Typer(**PLAIN, help="Create, inspect and delete JetStream streams.", no_args_is_help=True)


@stream_app.command("add")
def stream_add(
    name: StreamArg,
    cluster: ClusterOpt,
    subjects: Annotated[list[str], typer.Option("--subject", "-s", metavar="SUBJECT", help="Subject (repeat).")],
    replicas: Annotated[int, typer.Option(min=1, max=5)] = 3,
    placement: Annotated[str | None, typer.Option(help="Cluster to place it in (default: --cluster).")] = None,
    account: AccountOpt = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a stream placed in a cluster."""
    from ferry.brokers import nats as bnats

    nats_cluster = open_topology(topology).nats(cluster, account)
    where = placement or cluster
    info = run(bnats.stream_add(nats_cluster, name, subjects, replicas=replicas, placement=where, cluster_name=cluster))
    _print_stream(info, as_json)


@stream_app.command("info")
def stream_info(
    name: StreamArg,
    cluster: ClusterOpt,
    account: AccountOpt = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Placement, leader, peers and state of a stream."""
    from ferry.brokers import nats as bnats

    _print_stream(run(bnats.stream_info(open_topology(topology).nats(cluster, account), name, cluster)), as_json)


@stream_app.command("rm")
def stream_rm(
    name: StreamArg,
    cluster: ClusterOpt,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking.")] = False,
    account: AccountOpt = None,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Delete a stream and its messages (asks first, unless --yes)."""
    from ferry.brokers import nats as bnats
    from ferry.errors import UsageError

    nats_cluster = open_topology(topology).nats(cluster, account)
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


def register(app: typer.Typer) -> None:
    """Add stream's commands to `app`."""
    app.add_typer(stream_app, name="stream")
