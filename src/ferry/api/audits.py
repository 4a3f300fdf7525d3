"""The audit reports `ferry serve` shows: each ``ferry audit`` writes its HTML report and, beside it,
the same report as JSON (``NAME.json``); ``serve --reports DIR`` lists those of DIR on the console,
serves their HTML, and exports the newest one's figures as ``ferry_audit_messages{tier,outcome}``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

OUTCOMES = ("lost", "duplicated", "corrupted", "unexpected", "reordered")


class Audits:
    """The audit reports of a folder, re-read when a file changes."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self._seen: dict[Path, tuple[float, dict[str, Any] | None]] = {}

    def reports(self) -> list[dict[str, Any]]:
        """Every audit report of the folder, newest first: its name, when, pass or fail, and counts."""
        if not self.folder or not self.folder.is_dir():
            return []
        out = []
        for path in self.folder.glob("*.json"):
            report = self._read(path)
            if report is None or not path.with_suffix(".html").is_file():
                continue
            tiers = {name: {k: int(t.get(k) or 0) for k in OUTCOMES} for name, t in (report.get("tiers") or {}).items()}
            out.append(
                {
                    "name": path.stem,
                    "html": f"/reports/{path.stem}.html",
                    "at": path.stat().st_mtime,
                    "pass": bool(report.get("pass")),
                    "sent": int((report.get("sent") or {}).get("sent") or 0),
                    "tiers": tiers,
                }
            )
        return sorted(out, key=lambda r: r["at"], reverse=True)

    def _read(self, path: Path) -> dict[str, Any] | None:
        try:
            mtime = path.stat().st_mtime
            if (seen := self._seen.get(path)) and seen[0] == mtime:
                return seen[1]
            doc = json.loads(path.read_text())
            report = doc if isinstance(doc, dict) and isinstance(doc.get("tiers"), dict) else None
        except (OSError, ValueError):
            return None
        self._seen[path] = (mtime, report)
        return report

    def html(self, name: str) -> Path | None:
        """The HTML report `name` of the folder (None for any other name: no path outside it)."""
        if not self.folder:
            return None
        found = {p.stem: p for p in self.folder.glob("*.html")}
        return found.get(name)

    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily(
            "ferry_audit_messages",
            "Messages of each outcome per tier in the newest audit report",
            labels=["tier", "outcome"],
        )
        at = GaugeMetricFamily("ferry_audit_timestamp_seconds", "When the newest audit report was written")
        passed = GaugeMetricFamily("ferry_audit_pass", "1 when the newest audit report passed its limits")
        reports = self.reports()
        if reports:
            newest = reports[0]
            for tier, counts in sorted(newest["tiers"].items()):
                for outcome in OUTCOMES:
                    fam.add_metric([tier, outcome], counts[outcome])
            at.add_metric([], newest["at"])
            passed.add_metric([], 1.0 if newest["pass"] else 0.0)
        yield from (fam, at, passed)
