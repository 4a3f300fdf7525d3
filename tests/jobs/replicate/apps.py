"""Applications that consume a stream through durable consumers at a site, as a site failover
and fail-back must carry them (issue 52): pull and push, different filters and ways of
acknowledging. Per consumer, by message id, :func:`judged` checks that nothing it had not
acknowledged is skipped at the new site, and that what it had acknowledged comes again at most as
the failover's or fail-back's report announced."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.js.api import AckPolicy, ConsumerConfig

STREAM = "CYCONS"  # its subjects: cycons.0 ... cycons.3


@dataclass
class App:
    """One application at nyc: its durable consumer, how it acknowledges, what it acknowledged."""

    name: str
    filters: list[str]
    how: str  # "in-order" | "reversed" (each batch's acks in reverse) | "late" (every 5th acked on redelivery)
    push: bool = False  # delivered to a subject (in order) instead of fetched
    acked: dict[str, float] = field(default_factory=dict)  # id -> when the server confirmed the ack (nyc)
    unsure: set[str] = field(default_factory=set)  # an ack in flight as nyc died
    acked_sfo: set[str] = field(default_factory=set)
    checkpoint_at: float = 0.0  # the last checkpoint before the failover

    def config(self) -> ConsumerConfig:
        one = self.filters[0] if len(self.filters) == 1 else None
        many = self.filters if len(self.filters) > 1 else None
        return ConsumerConfig(
            durable_name=self.name,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=2.0,
            max_ack_pending=500,
            filter_subject=one,
            filter_subjects=many,
            deliver_subject=f"deliver.{self.name}" if self.push else None,
        )

    async def bind(self, nc: Any) -> Callable[[int, float], Awaitable[list[Any]]]:
        """Its durable at the site `nc` is connected to, as ``take(n, wait)``: up to n messages,
        waiting `wait` s at most (nats-py raises a TimeoutError when none came)."""
        js = nc.jetstream()
        if not self.push:
            sub = await js.pull_subscribe_bind(self.name, STREAM)
            return lambda n, wait: sub.fetch(n, timeout=wait)
        push = await js.subscribe_bind(STREAM, self.config(), self.name, manual_ack=True)

        async def one(_: int, wait: float) -> list[Any]:
            return [await push.next_msg(timeout=wait)]

        return one


APPS = [
    App("all-in-order", [], "in-order"),
    App("all-reversed", [], "reversed"),
    App("all-late", [], "late"),
    App("zero", ["cycons.0"], "in-order"),
    App("one-reversed", ["cycons.1"], "reversed"),
    App("two-late", ["cycons.2"], "late"),
    App("three-pushed", ["cycons.3"], "in-order", push=True),
    App("zero-one", ["cycons.0", "cycons.1"], "reversed"),
    App("two-three-late", ["cycons.2", "cycons.3"], "late"),
    App("slow", [], "in-order"),
]


async def consume(nc: Any, app: App, stop: threading.Event) -> None:
    """Take and acknowledge (each ack confirmed by the server) until `stop` or the server dies."""
    take = await app.bind(nc)
    seen: set[str] = set()
    while not stop.is_set():
        try:
            msgs = await take(20 if app.name != "slow" else 2, 1.0)
        except (TimeoutError, nats.errors.TimeoutError):  # nats-py raises either
            continue
        except Exception:  # nyc died
            return
        if app.how == "reversed":
            msgs = msgs[::-1]
        for m in msgs:
            mid = m.headers["Nats-Msg-Id"]
            if app.how == "late" and hash(mid) % 5 == 0 and mid not in seen:
                seen.add(mid)  # left pending: delivered again after ack_wait, acknowledged then
                continue
            try:
                await m.ack_sync(timeout=2)
            except Exception:
                app.unsure.add(mid)
                return
            app.acked[mid] = time.time()
        if app.name == "slow":
            await asyncio.sleep(0.2)


async def drain(nc: Any, app: App) -> list[str]:
    """Everything the application's durable delivers until it has nothing more for 1 s (3 s for a
    push consumer: what it pushed before the subscription came is pushed again after its 2 s
    ack wait), each acknowledged (confirmed)."""
    take, got = await app.bind(nc), []
    while True:
        try:
            msgs = await take(500, 3.0 if app.push else 1.0)
        except (TimeoutError, nats.errors.TimeoutError):  # nats-py raises either
            return got
        for m in msgs:
            got.append(m.headers["Nats-Msg-Id"])
            await m.ack_sync(timeout=5)


def judged(app: App, held: list[dict[str, Any]], got: list[str], done: set[str], allowed: int) -> dict[str, int]:
    """Nothing of `held` the application has not acknowledged (`done`) is missing from `got`, and
    at most `allowed` of the messages it had acknowledged come again (counted once each: a message
    the new site delivers twice, its ack wait passed on a busy machine, is that site's own
    redelivery, not the failover's)."""
    mine = {r["msg_id"] for r in held if not app.filters or r["subject"] in app.filters}
    skipped = mine - done - app.unsure - set(got)
    assert not skipped, f"{app.name}: {len(skipped)} messages it had not acknowledged never came"
    again = set(got) & done
    assert len(again) <= allowed, (app.name, len(again), allowed)
    return {"got": len(got), "again": len(again), "allowed": allowed}
