"""`ferry serve`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from ferry.cli.options import TopologyOpt, open_topology


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
    app_ = create_app(open_topology(topology), token)
    uvicorn.run(app_, host=host, port=port, log_level="warning")


def register(app: typer.Typer) -> None:
    """Add serve's commands to `app`."""
    app.command("serve")(serve_cmd)
