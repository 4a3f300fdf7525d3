"""`ferry serve`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from ferry.cli.options import TopologyOpt, open_topology


def serve_cmd(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8377,
    token_file: Annotated[
        Path | None, typer.Option(help="File holding the bearer token the mutating endpoints require.")
    ] = None,
    public_read: Annotated[
        bool, typer.Option(help="Let anyone read the console and /metrics (default: they need the bearer token).")
    ] = False,
    reports: Annotated[
        Path | None,
        typer.Option(help="Folder of audit reports (`ferry audit --html DIR/NAME.html`) the console lists."),
    ] = None,
    topology: TopologyOpt = None,
) -> None:
    """HTTP API and operations console: availability checks for load balancers, evacuations and
    rebalances (start, stop, inspect), Prometheus metrics of every job at /metrics, a live page at /.

    Keeps every journaled evacuation, rebalance and move driven (adopting those whose ferry died;
    beside a move, a standby guard listens: see docs/jobs/move.md).
    OpenAPI at /openapi.json, docs at /docs (served offline). The console and /metrics need the
    bearer token unless --public-read; without --token-file and --public-read they are off.
    """
    import gc

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
    if reports is not None and not reports.is_dir():
        raise ConfigError(f"--reports {reports}: no such directory")
    app_ = create_app(open_topology(topology), token, public_read=public_read, reports=reports)
    # what is loaded by now lives as long as serve: out of the collector's full passes, which
    # otherwise held a scrape up every ~11 s (p99 140 -> 88 ms, bench/RESULTS.md)
    gc.freeze()
    uvicorn.run(app_, host=host, port=port, log_level="warning")


def register(app: typer.Typer) -> None:
    """Add serve's commands to `app`."""
    app.command("serve")(serve_cmd)
