"""Running a DR fail-back: journal, disable the upstreams, transfer with an engine, restore, and the
lock that keeps one fail-back per source broker."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from typing import Any

from ferry.brokers.rabbitmq import Management, amqp_uri, q, queue_path
from ferry.brokers.rabbitmq.wire import QueueCounts
from ferry.errors import Conflict, FerryError, NotFound, OperationFailed, UsageError
from ferry.jobs.dr_failback.engines import delete_shovels, delivered_ids, run_shovels, spark_move, started
from ferry.jobs.dr_failback.journal import read_journal, record, write_journal
from ferry.jobs.dr_failback.plan import (
    FAILBACK,
    POLL,
    FailbackRequest,
    check_resume,
    make_plan,
    preflight,
    public,
    queue_label,
    resume_view,
    upstream_counts,
)
from ferry.jobs.dr_failback.verify import verify
from ferry.jobs.shared.events import Emit, no_emit
from ferry.spark.session import factory
from ferry.topology import RabbitCluster, Topology

# -- the journal and the lock ----------------------------------------------------------------------


# -- the operation ---------------------------------------------------------------------------------


async def failback(
    topo: Topology, req: FailbackRequest, emit: Emit = no_emit, spark: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """Plan, journal, disable, transfer, restore; resumes a journaled failback. Returns the report.

    `spark` makes the Spark session for the spark engine (default: where ``$FERRY_SPARK_*`` say, else local).
    """
    if req.engine not in ("shovel", "spark"):
        raise UsageError(f"--engine must be shovel or spark, got {req.engine!r}")
    if req.max_active < 1:
        raise UsageError("--max-active must be at least 1")
    src_c, dst_c = topo.rabbitmq(req.source), topo.rabbitmq(req.target)
    if req.engine == "shovel" and not req.abort:
        amqp_uri(topo, req.target, "/", dialer=req.source)  # refused here, before anything changes
    async with Management(src_c, name=req.source) as sm, Management(dst_c, name=req.target) as dm:
        await preflight(sm, dm, req)
        vhosts = sorted(v["name"] for v in await sm.get("/vhosts"))
        lock_vhost = "/" if "/" in vhosts else vhosts[0]
        if req.dry_run:
            journal = await read_journal(sm)
            if journal:
                return await resume_view(journal, src_c, req)
            if req.abort:
                return {"outcome": "nothing to abort", "source": req.source}
            plan = public(await make_plan(sm, dm, src_c, dst_c, req, vhosts))
            emit("plan", **plan)
            return {"outcome": "dry-run" if plan["queues"] else "nothing to do", "plan": plan}
        async with record(sm).hold(lock_vhost, "another ferry failback is running against this broker"):
            journal = await read_journal(sm)
            if journal is None:
                if req.abort:
                    return {"outcome": "nothing to abort", "source": req.source}
                plan = await make_plan(sm, dm, src_c, dst_c, req, vhosts)
                emit("plan", **public(plan))
                if not plan["queues"]:
                    return {"outcome": "nothing to do", "plan": public(plan)}
                journal = {**plan, "phase": FAILBACK.step(None, "disabling"), "host": socket.gethostname()}
                journal["upstream_queues"] = await upstream_counts(topo, journal["upstreams"], journal["queues"])
                await write_journal(sm, journal)  # before any upstream is deleted
                # from here on, an interrupted run is on record
                emit("journal", id=journal["id"], upstreams=len(journal["upstreams"]))
            else:
                check_resume(journal, req)
                emit(
                    "resume",
                    id=journal["id"],
                    phase=journal["phase"],
                    started=journal["started"],
                    upstreams=len(journal["upstreams"]),
                )
            if req.abort:
                return await _finish(topo, sm, src_c, dst_c, journal, req, emit, aborted=True)
            if journal["phase"] == "restoring" and await _came_back(src_c, req.source, journal):
                journal["phase"] = FAILBACK.step(journal["phase"], "disabling")  # and move them again
                await write_journal(sm, journal)
                emit("transfer-again", id=journal["id"])
            if req.engine == "spark" and journal["phase"] in ("disabling", "transferring"):
                spark = started(
                    spark or factory(app_name=f"ferry failback {req.source} to {req.target}", data_sources=False)
                )  # the JVM starts while links go down
            if journal["phase"] == "disabling":
                await _disable(sm, journal, emit)
                journal["phase"] = FAILBACK.step(journal["phase"], "transferring")
                await write_journal(sm, journal)
            if journal["phase"] == "transferring":
                await _links_down(sm, journal, req.link_timeout)
                await _transfer(topo, sm, src_c, journal, req, emit, spark)
                journal["phase"] = FAILBACK.step(journal["phase"], "restoring")
                await write_journal(sm, journal)
            return await _finish(topo, sm, src_c, dst_c, journal, req, emit)


async def status(topo: Topology, req: FailbackRequest) -> dict[str, Any]:
    """`ferry failback --status`: the failback on record at the source (phase, queues, what is left)."""
    src_c = topo.rabbitmq(req.source)
    async with Management(src_c, name=req.source) as sm:
        journal = await read_journal(sm)
    if journal is None:
        raise NotFound(f"no failback from {req.source} is on record")
    return await resume_view(journal, src_c, req)


# The broker stops an upstream's links inside the DELETE request that removes it, after removing
# the upstream itself, and stops where the request is cut (a client that gave up, a killed ferry):
# the links of the queues not reached yet keep running with no upstream on record, and a rerun's
# DELETE (404) never reaches them (rabbit_runtime_parameters:clear_any; issue 46, F1).
DELETE_WAIT = 120.0  # seconds a DELETE of an upstream may take
NUDGE_AFTER = 2.0  # seconds a link of a deleted upstream may take to stop before it is restarted away


async def _disable(sm: Management, journal: dict[str, Any], emit: Emit) -> None:
    for u in journal["upstreams"]:
        await sm.delete(f"/parameters/federation-upstream/{q(u['vhost'])}/{q(u['name'])}", timeout=DELETE_WAIT)
        emit("upstream-disabled", vhost=u["vhost"], upstream=u["name"])


def reset_set(journal: dict[str, Any]) -> str:
    """The upstream set a fail-back makes and deletes at once to restart lingering links."""
    return f"ferry-reset-{journal['id']}"


async def _links_down(sm: Management, journal: dict[str, Any], timeout: float) -> None:
    """Wait until no federation link of the saved upstreams runs (else a consumer would pull).

    A link counts while it is starting or its connection is open; a status row whose connection
    is gone is what a crashed or half-stopped link left behind, and pulls nothing. Links still
    running NUDGE_AFTER seconds in are restarted away once: making and deleting an upstream set
    restarts every link of the broker, and only those whose upstream exists come back."""
    names = {(u["vhost"], u["name"]) for u in journal["upstreams"]}
    began = time.monotonic()
    nudged = False
    while True:
        for u in journal["upstreams"]:
            if await sm.get(f"/parameters/federation-upstream/{q(u['vhost'])}/{q(u['name'])}", ok404=True):
                raise Conflict(
                    f"upstream {u['name']!r} in vhost {u['vhost']!r} was re-created during the failback; "
                    "nothing moved (rerun to disable it again, or --abort)"
                )
        rows = [x for x in await sm.get("/federation-links") if (x["vhost"], x["upstream"]) in names]
        conns = {c["name"] for c in await sm.get("/connections?columns=name") or []} if rows else set()
        links = [x for x in rows if x.get("status") == "starting" or x.get("local_connection") in conns]
        if not links:
            return
        if not nudged and time.monotonic() - began > NUDGE_AFTER:
            path = f"/parameters/federation-upstream-set/{q(links[0]['vhost'])}/{q(reset_set(journal))}"
            await sm.put(path, {"value": [{"upstream": reset_set(journal)}]}, timeout=DELETE_WAIT)
            await sm.delete(path, timeout=DELETE_WAIT)
            nudged = True
        if time.monotonic() - began > timeout:
            x = links[0]
            raise OperationFailed(
                f"federation link {x['upstream']!r} for {queue_path(x['vhost'], x.get('queue') or x.get('exchange'))} "
                f"still {x.get('status')} after {timeout:.0f}s (connection {x.get('local_connection')!r}) with its "
                f"upstream deleted{', and restarting the links did not stop it' if nudged else ''}; "
                "nothing moved (rerun to continue)"
            )
        await asyncio.sleep(POLL)


# -- transfer ---------------------------------------------------------------------------------------


async def _transfer(
    topo: Topology,
    sm: Management,
    src_c: RabbitCluster,
    journal: dict[str, Any],
    req: FailbackRequest,
    emit: Emit,
    spark: Callable[[], Any] | None,
) -> None:
    counts = QueueCounts(src_c, req.source)
    try:
        ready = await _left(counts, journal["queues"])
        todo = [x for x in journal["queues"] if ready[queue_label(x)] > 0]
        emit("transfer", engine=req.engine, queues=len(todo), of=len(journal["queues"]))
        progress = _progress(emit, sum(ready.values()))
        if req.engine == "shovel":
            await run_shovels(topo, sm, counts, journal, todo, ready, req, emit, progress)
        else:
            await delete_shovels(sm, journal)  # left by an interrupted shovel run
            there: dict[str, dict[str, Any]] = {}
            if todo and journal.get("spark_ran"):  # what a killed run delivered comes back: not again
                there = await delivered_ids(topo.rabbitmq(req.target), req.target, journal, todo)
                emit("already-there", messages=sum(len(x["skip_ids"]) for x in there.values()))
            elif todo:
                journal["spark_ran"] = True
                await write_journal(sm, journal)
            watch = asyncio.create_task(_watch(src_c, req.source, journal, progress))
            try:
                if todo:
                    await asyncio.to_thread(spark_move, topo, journal, todo, ready, req, spark, there)
            finally:
                watch.cancel()
        progress(sum((await _left(counts, journal["queues"])).values()))
    finally:
        await counts.close()


def _progress(emit: Emit, total: int) -> Callable[..., None]:
    """Emit progress now (nothing moved yet: a progress bar starts its clock here), and return
    what emits it from the count left: moved and rate count this transfer's messages and seconds
    only (a resumed failback's earlier runs are not in them)."""
    t0 = time.monotonic()

    def progress(left: int, **extra: Any) -> None:
        moved, seconds = total - left, time.monotonic() - t0
        emit("progress", moved=moved, total=total, rate=round(moved / seconds) if seconds else 0, **extra)

    progress(total)
    return progress


async def _came_back(cluster: RabbitCluster, name: str, journal: dict[str, Any]) -> bool:
    """Whether a queue the transfer had drained holds messages again."""
    counts = QueueCounts(cluster, name)
    try:
        return any((await _left(counts, journal["queues"])).values())
    finally:
        await counts.close()


async def _left(counts: QueueCounts, queues: list[dict[str, Any]]) -> dict[str, int]:
    return {queue_label(x): await counts.ready(x["vhost"], x["queue"]) for x in queues}


async def _watch(cluster: RabbitCluster, name: str, journal: dict[str, Any], progress: Callable[..., None]) -> None:
    """Progress while Spark moves: its own connections, so cancelling it leaves no reply in flight elsewhere."""
    counts = QueueCounts(cluster, name)
    try:
        while True:
            await asyncio.sleep(0.5)
            with contextlib.suppress(FerryError):
                progress(sum((await _left(counts, journal["queues"])).values()))
    finally:
        await counts.close()


# -- restore and report ------------------------------------------------------------------------------


async def _finish(
    topo: Topology,
    sm: Management,
    src_c: RabbitCluster,
    dst_c: RabbitCluster,
    journal: dict[str, Any],
    req: FailbackRequest,
    emit: Emit,
    aborted: bool = False,
) -> dict[str, Any]:
    """Delete ferry's shovels, restore the upstreams and compare, delete the journal, check the
    targets against what moved, report."""
    shovels_deleted = await delete_shovels(sm, journal)
    duplicates, there = journal.get("duplicates", {}), journal.get("already_there", {})
    src_counts, dst_counts = QueueCounts(src_c, req.source), QueueCounts(dst_c, req.target)
    try:
        rows = []
        for x in journal["queues"]:
            left = await src_counts.ready(x["vhost"], x["queue"])
            rows.append(
                {
                    "vhost": x["vhost"],
                    "queue": x["queue"],
                    "target": x["target"],
                    "type": x["type"],
                    "before": x["before"],
                    # what arrived since the plan (a link that pulled, a producer) was not moved
                    "moved": max(0, x["before"] - left),
                    "left": left,
                    "arrived": max(0, left - x["before"]),
                    "target_before": x["target_before"],
                    "target_after": await dst_counts.ready(x["vhost"], x["target"]),
                    "possible_duplicates": duplicates.get(queue_label(x), 0),
                    # came back from a killed run, already at the target: acked, not delivered again
                    "already_there": there.get(queue_label(x), 0),
                }
            )
    finally:
        await src_counts.close()
        await dst_counts.close()
    if not aborted and any(r["left"] for r in rows):
        left = ", ".join(f"{queue_label(r)} ({r['left']:,})" for r in rows if r["left"])
        raise OperationFailed(
            f"messages left after the transfer: {left}; the upstreams stay disabled (rerun to continue, or --abort)"
        )
    for vhost in sorted({u["vhost"] for u in journal["upstreams"]}):  # what a run killed mid-nudge left
        await sm.delete(f"/parameters/federation-upstream-set/{q(vhost)}/{q(reset_set(journal))}", timeout=DELETE_WAIT)
    upstream_after = await upstream_counts(topo, journal["upstreams"], journal["queues"])
    restored = []
    for u in journal["upstreams"]:
        path = f"/parameters/federation-upstream/{q(u['vhost'])}/{q(u['name'])}"
        await sm.put(path, {"value": u["value"]})
        now = await sm.get(path, ok404=True)
        same = now is not None and now["value"] == u["value"]
        restored.append({"vhost": u["vhost"], "upstream": u["name"], "identical": same})
        emit("upstream-restored", vhost=u["vhost"], upstream=u["name"], identical=same)
    if not all(r["identical"] for r in restored):
        raise OperationFailed("an upstream differs from its saved definition after restore; the journal is kept")
    await record(sm).delete()
    before = {(u["vhost"], u["upstream"], u["queue"]): u.get("messages") for u in journal.get("upstream_queues", [])}
    upstream_queues = [
        {**u, "before": before.get((u["vhost"], u["upstream"], u["queue"])), "after": u.pop("messages")}
        for u in upstream_after
    ]
    checks = None if aborted or not req.verify else await verify(dst_c, req.target, journal["id"], rows)
    outcome = ("aborted" if aborted else "complete") + _duplicates(rows, checks or [])
    report = {
        "outcome": outcome,
        "id": journal["id"],
        "source": journal["source"],
        "target": journal["target"],
        "engine": req.engine,
        "started": journal["started"],
        "queues": rows,
        "total": {
            k: sum(r[k] for r in rows)
            for k in ("before", "moved", "left", "arrived", "already_there", "possible_duplicates")
        },
        "upstreams_restored": restored,
        "upstream_queues": upstream_queues,
        "upstream_pulled": sum(
            (u["before"] or 0) - (u["after"] or 0) for u in upstream_queues if u["before"] is not None
        ),
        "shovels_deleted": shovels_deleted,
        "possible_duplicates": sum(r["possible_duplicates"] for r in rows),
        "duplicates": sum(r["duplicates"] or 0 for r in rows),
        "unverified_duplicates": sum(r["possible_duplicates"] for r in rows if r["duplicates"] is None),
        "verification": checks,
    }
    return report


def _duplicates(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    """Give each row what the check knows of its duplicates (None: not known; a target shared by
    several queues is known only as a whole), and say in the outcome what was delivered twice."""
    by_target = {(c["vhost"], c["queue"]): c for c in checks}
    for r in rows:
        c = by_target.get((r["vhost"], r["target"]))
        r["check"] = c["verdict"] if c else None
        if c and c["duplicates"] is not None and len(c["sources"]) > 1:  # known for the target only
            r["duplicates"] = 0 if c["duplicates"] == 0 else None
        else:
            r["duplicates"] = c["duplicates"] if c else None
    said = []
    known = [r for r in rows if r["duplicates"]]
    if known:
        said.append(f"{sum(r['duplicates'] for r in known):,} duplicates on {_queues(len(known))}")
    maybe = [r for r in rows if r["duplicates"] is None and r["possible_duplicates"]]
    if maybe:
        said.append(f"up to {sum(r['possible_duplicates'] for r in maybe):,} duplicates on {_queues(len(maybe))}")
    return ", with " + " and ".join(said) if said else ""


def _queues(n: int) -> str:
    return f"{n} queue" if n == 1 else f"{n} queues"
