"""The two transfer engines of a DR fail-back: ``shovel`` (one dynamic shovel per queue, at most
``max_active`` at once) and ``spark`` (the data plane's queue mover, which marks each message with
``x-ferry-transfer``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

from ferry.brokers.rabbitmq import Management, amqp_uri, q, queue_path
from ferry.brokers.rabbitmq.wire import QueueCounts
from ferry.errors import OperationFailed, redact
from ferry.jobs.dr_failback.journal import write_journal
from ferry.jobs.dr_failback.plan import (
    EMPTY_WAIT,
    POLL,
    PREFETCH,
    SETTLE,
    SHOVEL_PREFIX,
    STUCK_WAIT,
    FailbackRequest,
    queue_label,
)
from ferry.jobs.dr_failback.verify import read_target
from ferry.jobs.shared.events import Emit
from ferry.topology import RabbitCluster, Topology


def started(make: Callable[[], Any]) -> Callable[[], Any]:
    """Call `make` now in a background thread; the returned callable waits for its result (or error)."""
    result: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            result.set_result(make())
        except BaseException as exc:  # raised where the session is asked for, if it ever is
            result.set_exception(exc)

    threading.Thread(target=run, name="spark-session", daemon=True).start()
    return result.result


def spark_move(
    topo: Topology,
    journal: dict[str, Any],
    todo: list[dict[str, Any]],
    ready: dict[str, int],
    req: FailbackRequest,
    spark: Callable[[], Any],
    there: dict[str, dict[str, Any]],
) -> None:
    """The data plane's queue mover: one Spark task per queue, source acks after the target
    confirmed. `there` ("vhost/queue" -> `delivered_ids`'s skip_ids and all_ids) is what a killed
    run delivered: acked when it comes back, not delivered again."""
    session = spark()  # first: the thread making it imports pyspark, which two threads at once leave half-made
    from ferry.jobs.copy.plan import CopyOptions, CopyPlan
    from ferry.jobs.copy.run import run_copy
    from ferry.uris import Endpoint

    plan = CopyPlan(
        Endpoint("rabbitmq", f"rabbitmq://{req.source}", cluster=req.source),
        Endpoint("rabbitmq", f"rabbitmq://{req.target}", cluster=req.target),
        CopyOptions(),
        "mover",
        queues=[
            {
                "vhost": x["vhost"],
                "queue": x["queue"],
                "ready": ready[queue_label(x)],
                "target": x["target"],
                "target_vhost": x["vhost"],
                **there.get(queue_label(x), {}),
            }
            for x in todo
        ],
        transfer_id=journal["id"],
    )
    report = run_copy(topo, plan, session)
    duplicates, skipped = journal.setdefault("duplicates", {}), journal.setdefault("already_there", {})
    for row in report.queues:  # came redelivered: an earlier run may have stored them
        label = queue_path(row["vhost"], row["queue"])
        if row.get("redelivered"):
            duplicates[label] = duplicates.get(label, 0) + row["redelivered"]
        if row.get("skipped"):
            skipped[label] = skipped.get(label, 0) + row["skipped"]


async def delivered_ids(
    cluster: RabbitCluster, name: str, journal: dict[str, Any], todo: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per queue of `todo`, the mover's `skip_ids`: the message ids its target holds with this
    fail-back's mark (what a killed spark run delivered, confirmed but never acked at the source),
    and `all_ids`: whether the target was read whole (no consumer, under SAMPLE messages; beyond,
    what comes back may be delivered again, counted)."""
    counts = QueueCounts(cluster, name)
    try:
        consumers = {queue_label(x): (await counts.state(x["vhost"], x["target"]))[1] for x in todo}
    finally:
        await counts.close()
    found: dict[str, dict[str, Any]] = {}
    for x in todo:
        rows, ended = await read_target(cluster, name, x["vhost"], x["target"], journal["id"])
        found[queue_label(x)] = {
            "skip_ids": [msg_id for msg_id, marked in rows if msg_id and marked],
            "all_ids": ended and not consumers[queue_label(x)],  # what applications took is not read
        }
    return found


def _shovel_name(journal: dict[str, Any], x: dict[str, Any]) -> str:
    return f"{SHOVEL_PREFIX}{journal['id']}-{journal['queues'].index(x)}"


def shovel_definition(topo: Topology, req: FailbackRequest, x: dict[str, Any]) -> dict[str, Any]:
    """A dynamic shovel that drains one queue into its target and then deletes itself.

    Its prefetch is PREFETCH: a quorum queue's client holds back acks beyond 32 in flight
    (rabbit_fifo_client's soft limit) and drops them when the shovel's channel closes, so with
    the default prefetch (1,000) a shovel that deleted itself handed back messages the target had
    already confirmed, which the next shovel delivered again (issue 46). With at most PREFETCH
    unacked, every ack is sent; a shovel that ends any other way (deleted, restarted, a node lost)
    can have delivered at most PREFETCH messages whose ack did not reach the source."""
    return {
        "src-protocol": "amqp091",
        "src-uri": f"amqp:///{q(x['vhost'])}",  # the source node itself
        "src-queue": x["queue"],
        "src-delete-after": "queue-length",
        "src-prefetch-count": PREFETCH,
        "dest-protocol": "amqp091",
        "dest-uri": amqp_uri(topo, req.target, x["vhost"], dialer=req.source),
        "dest-queue": x["target"],
        "ack-mode": "on-confirm",
    }


async def run_shovels(
    topo: Topology,
    sm: Management,
    counts: QueueCounts,
    journal: dict[str, Any],
    todo: list[dict[str, Any]],
    ready: dict[str, int],
    req: FailbackRequest,
    emit: Emit,
    progress: Callable[..., None],
) -> None:
    """At most `max_active` shovels; a queue is done once its shovel deleted itself and it is empty.

    `ready` ("vhost/queue" -> count, every journal queue) is kept current for progress. The
    journal keeps the shovels created and, per queue, the possible duplicates, across runs: a
    shovel that ended other than by deleting itself after its last ack (an earlier run's, gone
    while ferry was down; one deleted by hand; one stuck and replaced) may have delivered up to
    PREFETCH messages whose ack never reached the source: they come back and move again."""
    duplicates: dict[str, int] = journal.setdefault("duplicates", {})

    def maybe_twice(x: dict[str, Any]) -> None:
        label = queue_label(x)
        if ready[label]:
            duplicates[label] = duplicates.get(label, 0) + min(ready[label], PREFETCH)

    listed = {p["name"] for p in await _ferry_shovels(sm, journal)}
    known = {(s["vhost"], s["name"]): s for s in await sm.get("/shovels")}
    active: dict[str, dict[str, Any]] = {}
    for x in todo:  # adopt an earlier run's shovels that still run; replace those that do not
        name = _shovel_name(journal, x)
        state = known.get((x["vhost"], name), {})
        if name in listed and state.get("state") == "running":
            active[name] = x
            if _started(journal, name, state) != "same":  # while ferry was away (a node restarted, say)
                maybe_twice(x)  # or not seen running before: it may have
        elif name in listed:
            await _replace(sm, counts, x, name, emit, f"was {state.get('state', 'not listed')}")
    pending = [x for x in todo if _shovel_name(journal, x) not in active]
    created_before = set(journal.setdefault("shovels", []))
    for x in pending:
        if _shovel_name(journal, x) in created_before:
            maybe_twice(x)
    gone_since: dict[str, float] = {}
    ran: set[str] = set(active)  # shovels seen running (adopted ones may have)
    interrupted: set[str] = set()  # shovels ferry deleted (rather than they themselves, after their last ack)
    created_at: dict[str, float] = {}
    # progress is a new low of a queue's ready count, or a change of its ack count (the management
    # API's, up to a statistics interval old, 5 s here): a shovel that takes messages it cannot
    # deliver (a target that refuses them, or blocks every publisher under an alarm) gives them back
    # unacked, and the last ones it took stay unacked until the target confirms them
    acks: dict[str, int | None] = {}
    seen_acks: dict[str, int | None] = {}
    fewest: dict[str, int] = {}
    stalled: dict[str, float] = {}  # seconds a queue's shovel existed since it last made progress
    rounds = 0
    last_emit = last_acks = 0.0
    last_poll = time.monotonic()

    async def came_back() -> bool:
        """Whether messages came back to a drained queue once every shovel was gone: deliveries a
        shovel held unacked return when its channel closes, later on a busy quorum queue than the
        per-queue settle saw, and are shovelled again (three rounds at most, then the count left
        says so). A shovel that deleted itself had not published them; one ferry deleted may have."""
        nonlocal rounds
        if rounds >= 3:
            return False
        await asyncio.sleep(SETTLE)
        back = []
        for x in todo:
            ready[queue_label(x)] = await counts.ready(x["vhost"], x["queue"])
            if ready[queue_label(x)]:
                back.append(x)
        rounds += 1
        for x in back:
            if _shovel_name(journal, x) in interrupted:
                maybe_twice(x)
            pending.append(x)
            emit("came-back", queue=queue_label(x), messages=ready[queue_label(x)])
        return bool(back)

    while pending or active or await came_back():
        while pending and len(active) < req.max_active:
            x = pending.pop(0)
            name = _shovel_name(journal, x)
            journal["shovels"] = sorted({*journal["shovels"], name})
            journal.setdefault("shovel_started", {}).pop(name, None)  # a new shovel of that name
            await write_journal(sm, journal)  # before the shovel exists
            await sm.put(f"/parameters/shovel/{q(x['vhost'])}/{q(name)}", {"value": shovel_definition(topo, req, x)})
            active[name] = x
            gone_since.pop(name, None)
            created_at[name] = time.monotonic()
            emit("shovel", queue=queue_label(x), name=name, active=len(active))
        await asyncio.sleep(POLL)
        present = {p["name"] for p in await _ferry_shovels(sm, journal)}
        states = {(s["vhost"], s["name"]): s for s in await sm.get("/shovels") if s["name"] in active}
        now = time.monotonic()
        waited, last_poll = now - last_poll, now
        if now - last_acks >= 1.0:
            last_acks = now
            for vhost in {x["vhost"] for x in active.values()}:
                for item in await sm.get(f"/queues/{q(vhost)}?columns=name,message_stats.ack"):
                    acks[queue_path(vhost, item["name"])] = (item.get("message_stats") or {}).get("ack")
        for name, x in list(active.items()):
            left, consumers = await counts.state(x["vhost"], x["queue"])
            ready[queue_label(x)] = left
            acked = acks.get(queue_label(x))
            moved = left < fewest.get(name, left + 1) or acked != seen_acks.get(name, acked)  # a reset counts too
            fewest[name], seen_acks[name] = min(left, fewest.get(name, left)), acked
            if moved:
                stalled[name] = 0.0
            elif name in present:
                stalled[name] = stalled.get(name, 0.0) + waited
            if name not in present:
                # it deleted itself (the length it saw at start has been moved), but until its
                # consumer is gone it may hold unacked messages that come back when its
                # channel closes (a CI run saw 0 ready, then 158); a foreign consumer is waited out,
                # and an empty queue must stay empty for SETTLE seconds after the shovel is gone
                since = now - gone_since.setdefault(name, now)
                if (consumers and since < 10.0) or (not left and since < SETTLE):
                    continue
                del active[name]
                if left:
                    # its count was short (a quorum queue's count may time out and read 0): it ended
                    # after its last ack, and what it got beyond its count it never published. One
                    # ferry deleted may have published up to PREFETCH of these (counted, and written
                    # before its shovel is created again)
                    pending.append(x)
                    if name in interrupted:
                        maybe_twice(x)
                else:
                    emit("drained", queue=queue_label(x), active=len(active))
                continue
            state = states.get((x["vhost"], name), {})
            if state.get("state") == "running":
                ran.add(name)
                started = _started(journal, name, state)
                if started == "again":  # what it held unacked came back: it delivers them again
                    ready[queue_label(x)] = left
                    maybe_twice(x)
                    emit("shovel-restarted", queue=queue_label(x), name=name)
                if started != "same":  # on record, so a rerun can tell a restart while ferry was away
                    await write_journal(sm, journal)
            if stalled.get(name, 0.0) > req.stall_timeout:
                said = ": ".join(str(s) for s in (state.get("state", "not listed"), state.get("reason")) if s)
                said = " ".join(redact(said).split())  # the reason is an Erlang term, printed over lines
                raise OperationFailed(
                    f"shovel for {queue_label(x)} moved no message for {req.stall_timeout:g}s "
                    f"({said if len(said) <= 300 else said[:300] + ' ...'}); "
                    "upstreams stay disabled (rerun to continue, or --abort)"
                )
            # none ready and none acked for a while: someone else consumed part of the queue, so the
            # shovel waits for messages that will not come; deleting it requeues any it still holds
            if left == 0 and min(stalled.get(name, 0.0), now - created_at.get(name, 0.0)) > EMPTY_WAIT:
                await sm.delete(f"/parameters/shovel/{q(x['vhost'])}/{q(name)}")
                interrupted.add(name)
            elif left and min(stalled.get(name, 0.0), now - created_at.get(name, 0.0)) > STUCK_WAIT:
                # a dynamic shovel whose destination came back can stay `starting` for ever (seen
                # after pc1 restarted), or `running` and move nothing (after a memory alarm on pc1
                # ended): a new one connects afresh; --stall-timeout still counts from the last move
                why = f"{state.get('state', 'not listed')}, nothing moved for {STUCK_WAIT:g}s"
                await _replace(sm, counts, x, name, emit, why)
                ready[queue_label(x)] = await counts.ready(x["vhost"], x["queue"])
                if name in ran:  # one that never ran delivered nothing
                    maybe_twice(x)
                del active[name]
                pending.insert(0, x)  # created again first, the count above on record before it
        if now - last_emit >= 0.5:
            last_emit = now
            # only shovelled queues change (no upstream feeds them): the rest keep their last count
            progress(sum(ready.values()), active=len(active), pending=len(pending))


def _started(journal: dict[str, Any], name: str, state: dict[str, Any]) -> str:
    """A running shovel's start against the journal: "first" seen running, the "same" start, or
    started "again" (the broker's state timestamp moved on; kept in the journal across runs):
    each start returns what the last one held unacked."""
    seen = journal.setdefault("shovel_started", {})
    was, now = seen.get(name), state.get("timestamp")
    seen[name] = now
    return "first" if was is None else "same" if now == was else "again"


async def _replace(sm: Management, counts: QueueCounts, x: dict[str, Any], name: str, emit: Emit, why: str) -> None:
    """Delete a shovel that does not run and wait until its consumer is gone (what it held is back)."""
    await sm.delete(f"/parameters/shovel/{q(x['vhost'])}/{q(name)}")
    deadline = time.monotonic() + STUCK_WAIT
    while (await counts.state(x["vhost"], x["queue"]))[1] and time.monotonic() < deadline:
        await asyncio.sleep(POLL)
    emit("shovel-replaced", queue=queue_label(x), name=name, reason=why)


async def _ferry_shovels(sm: Management, journal: dict[str, Any]) -> list[dict[str, Any]]:
    """The shovel parameters ferry created in the journal's vhosts."""
    vhosts = {x["vhost"] for x in journal["queues"]}
    return [
        p
        for p in await sm.get("/parameters/shovel", ok404=True) or []
        if p["vhost"] in vhosts and p["name"].startswith(SHOVEL_PREFIX)
    ]


async def delete_shovels(sm: Management, journal: dict[str, Any]) -> int:
    found = await _ferry_shovels(sm, journal)
    for p in found:
        await sm.delete(f"/parameters/shovel/{q(p['vhost'])}/{q(p['name'])}")
    return len(found)
