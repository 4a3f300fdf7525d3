"""A real Prometheus (Debian's ``prometheus``) scraping `ferry serve` every second, with ferry's
alerting rules (``dashboards/alerts.yml``) loaded: what ``ferry lab up --haproxy`` starts beside
serve, and what the console tests query."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from ferry.errors import FerryError
from ferry.lab.procs import Proc

RULES = Path(__file__).resolve().parents[3] / "dashboards" / "alerts.yml"


def binary() -> str:
    found = shutil.which("prometheus", path="/usr/bin:/usr/local/bin:/usr/sbin")
    if not found:
        raise FerryError("lab: no prometheus binary (Debian package `prometheus`; `make setup` installs it)")
    return found


def config(targets: dict[str, list[str]], token_file: Path | None, rules: list[Path]) -> str:
    """The configuration: one scrape job per `targets` entry (name -> host:port list), every second;
    `token_file` holds the bearer token `ferry serve` wants (read by Prometheus, never inlined)."""
    jobs = []
    for name, hosts in targets.items():
        job: dict = {"job_name": name, "static_configs": [{"targets": hosts}]}
        if token_file and name == "ferry-serve":
            job["authorization"] = {"type": "Bearer", "credentials_file": str(token_file)}
        jobs.append(job)
    doc = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(r) for r in rules],
        "scrape_configs": jobs,
    }
    return yaml.safe_dump(doc, sort_keys=False)


def proc(d: Path, port: int, targets: dict[str, list[str]], token_file: Path | None, rules: list[Path]) -> Proc:
    """The Prometheus process for `d` (its config, data and log go there)."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = d / "prometheus.yml"
    cfg.write_text(config(targets, token_file, rules))
    return Proc(
        name="prometheus",
        kind="prometheus",
        argv=[
            binary(),
            f"--config.file={cfg}",
            f"--storage.tsdb.path={d / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
            "--storage.tsdb.retention.time=1d",
        ],
        env={"PATH": "/usr/bin:/bin"},
        cwd=str(d),
        log=str(d / "prometheus.log"),
    )
