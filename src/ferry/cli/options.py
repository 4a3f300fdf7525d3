"""What every command shares: its common options, the topology it reads, and how it runs a job
(``run``: asyncio, with Ctrl-C reaching Spark jobs at once)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ferry.cli import render

PLAIN = {"rich_markup_mode": None}  # usage errors as plain "Error: ..." lines, not boxes


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


def _json_mode(value: bool) -> bool:
    render.JSON = value  # the events the command's layers emit on their own (spark) follow it
    return value


JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON document instead of tables.", callback=_json_mode)
]
# `copy` and `snapshot` once refused a federated queue without it; a federated queue is now read
# without pulling from its upstream, and scripts that pass it keep working (it changes nothing)
FederatedOpt = Annotated[bool, typer.Option("--federated", hidden=True)]
MetricsPortOpt = Annotated[
    int | None,
    typer.Option(
        min=1, max=65535, help="Serve the running job's own figures as Prometheus metrics on 127.0.0.1:PORT/metrics."
    ),
]
AccountOpt = Annotated[
    str | None,
    typer.Option("--account", help="NATS account: one of the cluster's `accounts` (default: its credentials)."),
]
DirOpt = Annotated[Path | None, typer.Option("--dir", help="Lab directory (default: $FERRY_LAB_DIR or ./.ferry-lab).")]


def run(coro: Any) -> Any:
    """asyncio.run, except that Ctrl-C stops Spark jobs at once: asyncio.run would first wait for
    the threads running them (failback's, the relay's) to end."""
    spark = sys.modules.get("ferry.spark.session")
    if spark:
        spark.clear_interrupt()  # a Ctrl-C seen by an earlier command of this process
    with asyncio.Runner() as runner:
        try:
            return runner.run(coro)
        except KeyboardInterrupt:
            interrupt_spark()
            raise


def lab_dir_arg(path: Path | None) -> Path | None:
    return path.absolute() if path else None


def open_topology(path: Path | None) -> Any:
    from ferry.topology import load_topology

    return load_topology(path)


# -- stream -------------------------------------------------------------------------------


ClusterOpt = Annotated[str, typer.Option("--cluster", "-c", help="A NATS cluster of the topology to talk to.")]


def stream_name_arg(value: str | None) -> str | None:
    """A stream argument that can name a stream (else a usage error, before any broker is asked)."""
    from ferry.subjects import stream_name_problem

    if value is not None and (why := stream_name_problem(value)):
        raise typer.BadParameter(why)
    return value


StreamArg = Annotated[str, typer.Argument(callback=stream_name_arg)]


def host_port_arg(value: str | None) -> str | None:
    """HOST:PORT (HOST may be ``*``, a name, an IPv4 or a bracketed IPv6 address), written into a
    configuration file as it is: anything else is a usage error."""
    import re

    if value in (None, ""):
        return value
    m = re.fullmatch(r"(\*|[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):([0-9]{1,5})", value)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise typer.BadParameter(f"{value!r} is not HOST:PORT")
    return value


# -- copy ---------------------------------------------------------------------------------

SparkMaster = Annotated[
    str | None,
    typer.Option(
        "--spark-master", envvar="FERRY_SPARK_MASTER", help="Spark master URL spark://host:port (default local[*])."
    ),
]
SparkRemote = Annotated[
    str | None,
    typer.Option(
        "--spark-remote",
        envvar="FERRY_SPARK_REMOTE",
        help="Spark Connect URL sc://host:port (from the environment, a ;token= stays off the command line).",
    ),
]
SparkArchive = Annotated[
    str | None,
    typer.Option(
        "--spark-archive",
        envvar="FERRY_SPARK_ARCHIVE",
        help="With --spark-master: a packed Python environment with ferry (venv-pack, conda-pack) for the "
        "executors, instead of the zip ferry ships them.",
    ),
]


def via_cluster(topo: Any, via: str | None) -> str:
    """The NATS cluster to connect through: `via`, else the topology's first."""
    from ferry.errors import ConfigError

    if via:
        topo.nats(via)  # unknown -> one-line error
        return via
    for _, name, c in topo.clusters():
        if c.kind == "nats":
            return name
    raise ConfigError("the topology has no NATS cluster")


def name_list(value: str | None) -> list[str]:
    return [n for n in (value or "").replace(",", " ").split() if n]


def interrupt_spark() -> None:
    spark = sys.modules.get("ferry.spark.session")  # loaded only by the commands that use Spark
    if spark:
        spark.interrupt()
