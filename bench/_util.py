"""Measurement helpers shared by the benchmarks: CPU seconds and peak memory of process trees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes so far (their own, not their children's)."""
    total = 0
    for pid in pids:
        f = _stat(pid)
        if f:
            total += int(f[11]) + int(f[12])
    return total / _TICK


def tree(root: int) -> list[int]:
    """`root` and all its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (f := _stat(int(entry))):
            children.setdefault(int(f[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        f = _stat(pid)
        if f:
            total += int(f[21]) * _PAGE
    return total


def role(pid: int, root: int | None) -> str:
    """What a process of ferry's tree is: its "driver" (the tree's root), Spark's "jvm", Spark's
    "python workers" (pyspark.daemon and its forks), else "other"."""
    if pid == root:
        return "driver"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "other"
    if argv and argv[0].endswith(b"java"):
        return "jvm"
    if argv and b"python" in argv[0] and any(b"pyspark" in a for a in argv[1:]):
        return "python workers"
    return "other"  # spark-submit's shell, before it becomes the JVM


class PeakRss:
    """Samples a process tree (or fixed pids) every 100 ms: peak summed RSS, and CPU seconds.

    CPU is the sum over every process seen of its last sampled user+system time,
    so short-lived workers count too (minus their last <100 ms); `cpu_by_role` splits a
    tree's by :func:`role`.
    """

    def __init__(self, root: int | None = None, pids: list[int] | None = None) -> None:
        self.root, self.pids, self.peak = root, pids, 0
        self._cpu: dict[int, float] = {}
        self._role: dict[int, str] = {}
        self._base = {pid: cpu_seconds([pid]) for pid in (pids or [])}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def cpu(self) -> float:
        return sum(v - self._base.get(pid, 0.0) for pid, v in self._cpu.items())

    @property
    def cpu_by_role(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, v in self._cpu.items():
            r = self._role.get(pid, "other")
            out[r] = out.get(r, 0.0) + v - self._base.get(pid, 0.0)
        return out

    def sample(self) -> None:
        """Sample now (as the thread does every 100 ms): a caller's mark between two readings."""
        pids = tree(self.root) if self.root else (self.pids or [])
        self.peak = max(self.peak, rss_bytes(pids))
        for pid in pids:
            used = cpu_seconds([pid])
            if used:
                self._cpu[pid] = max(self._cpu.get(pid, 0.0), used)
                self._role[pid] = role(pid, self.root)  # again: spark-submit's shell becomes the JVM

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.sample()

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.pids:
            self.sample()


def run_ferry(args: list[str], topology: Path) -> dict[str, Any]:
    """Run the ferry CLI (its own Spark driver); return its JSON report plus wall, CPU and peak RSS."""
    env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
    started, t0 = time.time(), time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ferry", *args, "--json"], env=env, stdout=out, stderr=subprocess.PIPE, text=True
        )
        with PeakRss(root=proc.pid) as peak:
            _, stderr = proc.communicate()
        wall = time.monotonic() - t0
        out.seek(0)
        text = out.read()
    if proc.returncode != 0:
        raise SystemExit(f"ferry {' '.join(args)} failed: {stderr.strip()[-2000:]}")
    return {
        "report": json.loads(text),
        "events": [json.loads(ln) for ln in stderr.splitlines() if ln.startswith("{")],  # --json events
        "started": started,  # time.time(), as the events' "t"
        "wall": wall,
        "cpu": peak.cpu,
        "cpu_by_role": peak.cpu_by_role,
        "peak_rss": peak.peak,
    }


def lab_root() -> Path:
    """A new directory for a benchmark's lab (``FERRY_LAB_DIR``), which the brokers' users can read."""
    root = Path(tempfile.mkdtemp(prefix="ferry-bench-", dir="/tmp"))
    root.chmod(0o755)
    os.environ["FERRY_LAB_DIR"] = str(root)
    return root


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def save_rows(name: str, rows: list[dict[str, Any]]) -> Path:
    """Keep a run's rows as bench/out/<name>-<time>.json."""
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    path = out / f"{name}-{int(time.time())}.json"
    path.write_text(json.dumps(rows, indent=2))
    return path
