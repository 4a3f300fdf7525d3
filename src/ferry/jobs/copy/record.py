"""A copy on record: its state and progress in the journal of the cluster it writes to (of the
one it reads, when it writes Parquet), so that `ferry serve` shows it as it shows every other job
(``ferry_operations{kind="copy"}``, its progress ratio, the console). Under the key
``copy.<hash of source and destination>``: a rerun of the same copy replaces its record.

A copy's driver waits on Spark, so the record is written from a thread of its own: once at the
start, every HEARTBEAT seconds while the copy runs (the messages copied so far, and the heartbeat
that tells a live copy from one whose ferry died), and once at the end. A journal that cannot be
written costs the copy nothing but the record: one line on stderr."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ferry.brokers import nats as bnats
from ferry.brokers.rabbitmq import Management
from ferry.jobs.copy.plan import CopyPlan
from ferry.journal import Journal, KvJournal, ParamJournal
from ferry.topology import Topology

HEARTBEAT = 2.0  # seconds between the saves of a running copy's progress
# "interrupted": running on record, its ferry gone; "stopped": by Ctrl-C
STATES = ["done", "failed", "interrupted", "running", "stopped"]


def record_key(plan: CopyPlan) -> str:
    return "copy." + hashlib.sha1(f"{plan.source} -> {plan.destination}".encode()).hexdigest()[:12]


class CopyRecord:
    """``with CopyRecord(topo, plan, warn) as rec:`` … ``rec.progress(n)`` … ``rec.done(report)``;
    leaving the block without ``done`` records the copy as stopped (Ctrl-C) or failed with its error."""

    def __init__(self, topo: Topology, plan: CopyPlan, warn: Callable[[str], None]) -> None:
        self.topo, self.plan, self.warn = topo, plan, warn
        self.copied = 0
        self.final: dict[str, Any] | None = None
        self.ended = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="ferry-copy-record", daemon=True)

    def __enter__(self) -> CopyRecord:
        self.thread.start()
        return self

    def progress(self, copied: int) -> None:
        self.copied = copied

    def done(self, result: dict[str, Any]) -> None:
        """The copy ended: its report's figures (not its rows per queue, which may be thousands)."""
        figures = {k: v for k, v in result.items() if not isinstance(v, (dict, list))}
        self.final = {"state": "done", "copied": int(result.get("read") or 0), "result": figures}

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, KeyboardInterrupt):
            self.final = {"state": "stopped", "copied": self.copied}  # Ctrl-C: what the user asked for
        elif self.final is None:
            error = (str(exc) or type(exc).__name__) if exc else "ended without a result"
            self.final = {"state": "failed", "copied": self.copied, "error": error}
        self.ended.set()
        self.thread.join(10.0)  # a journal that hangs does not hold the command's exit for longer

    def _where(self) -> tuple[str, str] | None:
        """(kind, cluster) of the journal the record goes to; None with no broker on either end."""
        for end in (self.plan.destination, self.plan.source):
            if end.kind in ("jetstream", "rabbitmq") and end.cluster:
                return end.kind, end.cluster
        return None

    @contextlib.asynccontextmanager
    async def _journal(self, kind: str, name: str) -> AsyncIterator[Journal]:
        if kind == "jetstream":
            cluster = self.topo.nats(name)
            async with bnats.session(cluster, name=name, client_name="ferry-ctl-copy") as nc:
                yield KvJournal(nc, record_key(self.plan), replicas=min(3, len(cluster.brokers)))
        else:
            async with Management(self.topo.rabbitmq(name)) as m:
                yield ParamJournal(m, record_key(self.plan))

    async def _run(self) -> None:
        if not (where := self._where()):
            return  # Parquet to Parquet: no broker to keep it in
        try:
            async with self._journal(*where) as journal:
                await journal.open()
                now = time.time()
                first = {"source": str(self.plan.source), "destination": str(self.plan.destination)}
                await journal.save(
                    kind="copy", state="running", **first, messages=self.plan.messages, copied=0, started=now, since=now
                )
                while not self.ended.is_set():
                    await asyncio.to_thread(self.ended.wait, HEARTBEAT)
                    if not self.ended.is_set():
                        await journal.save(copied=self.copied)
                await journal.save(release=True, since=time.time(), **(self.final or {}))
        except Exception as exc:  # the copy goes on without its record
            self.warn(f"the copy is not on record in the journal: {exc}")


def state_of(st: dict[str, Any], alive: bool) -> str:
    """A copy's state as serve shows it: a running one whose ferry died is interrupted."""
    state = str(st.get("state") or "running")
    return "interrupted" if state == "running" and not alive else state
