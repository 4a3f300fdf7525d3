"""`ferry failback --from DR --to MAIN`: bring the messages left on a DR RabbitMQ
cluster back to the main one without pulling new ones from the upstream.

A federated queue pulls from its upstream while it has a consumer, so its
messages cannot simply be consumed: the consumer would pull more. The protocol
is the bash gist's (../shared/seeds/003), made safe and exact:

1. **plan** — the queues with a federation policy and ready messages (live
   counts), the upstreams their policies use, each queue's target queue;
2. **journal** — one global parameter on the source broker, ``ferry-failback``,
   holds the plan, every upstream's full definition, the counts before and the
   phase. It is written *before* any upstream is deleted, so a definition is
   never lost, and any machine can resume from it;
3. **disable** — delete those upstreams, then wait until the management API
   lists no federation link for them;
4. **transfer** — ``shovel`` (one dynamic shovel per queue: ``ack-mode
   on-confirm``, ``src-delete-after queue-length``, ``dest-queue``; at most
   ``max_active`` at once) or ``spark`` (the data plane's queue mover, which
   marks each message with ``x-ferry-transfer``). A queue is done the moment it
   is drained: counts are polled every 0.2 s by passive declares;
5. **restore** — put each upstream back exactly as saved and compare, delete
   every shovel ferry created, then the journal.

One failback runs per source broker at a time: ferry holds an exclusive queue,
``ferry-failback-lock``, while it works, and the broker drops it if ferry dies.
Killing ferry at any step and running the same command again (anywhere)
finishes the job; with nothing to do it says so and changes nothing.

Accounting: per queue, ready before (from the journal), moved (before - left:
exact, since nothing else feeds a queue whose upstream is gone), left; the
target's count before and after (exact while nothing consumes there); the
upstream queues' counts before and after, which show that nothing was pulled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aio_pika
import aiormq

from ferry.brokers.rabbitmq import FEDERATION_KEYS, Management, amqp_connect, amqp_uri, effective_policy, q, queue_path
from ferry.errors import ConfigError, Conflict, FerryError, NotFound, OperationFailed, UsageError, redact
from ferry.ops import Emit, no_emit
from ferry.pipeline._amqp import QueueCounts
from ferry.topology import RabbitCluster, Topology

__all__ = ["JOURNAL", "FailbackRequest", "failback"]

JOURNAL = "ferry-failback"  # global parameter on the source broker
LOCK = "ferry-failback-lock"  # exclusive queue held while ferry works
SHOVEL_PREFIX = "ferry-failback-"
POLL = 0.2
EMPTY_WAIT = 10.0  # seconds a shovel may sit on an empty queue with nothing acked before it is deleted


@dataclass
class FailbackRequest:
    source: str  # the DR cluster holding the orphaned messages
    target: str  # the main cluster
    vhost: str | None = None  # only this vhost (default: every vhost)
    target_queue: str | None = None  # one target queue for all (testing on one cluster)
    engine: str = "shovel"  # shovel | spark
    max_active: int = 50  # shovels at once
    dry_run: bool = False
    abort: bool = False  # restore the upstreams and clean up without finishing
    link_timeout: float = 30.0  # seconds for federation links to stop
    stall_timeout: float = 60.0  # seconds a shovel may move no message (none acked) before the failback stops


def public(plan: dict[str, Any]) -> dict[str, Any]:
    """A plan or journal fit to print: upstream URIs without their passwords."""
    upstreams = [
        {**u, "value": {**u["value"], "uri": [redact(x) for x in _uris(u["value"])]}} for u in plan["upstreams"]
    ]
    return {**plan, "upstreams": upstreams}


# -- reading the source ---------------------------------------------------------------------------


def _federation(definition: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (definition or {}).items() if k in FEDERATION_KEYS}


async def _federated_queues(m: Management, vhosts: list[str]) -> list[dict[str, Any]]:
    """Queues of `vhosts` whose effective policy carries a federation key."""
    policies = await m.get("/policies")
    found = []
    for item in await m.get("/queues?columns=name,vhost,type,exclusive,consumers"):
        if item["vhost"] not in vhosts or item.get("exclusive") or item["name"] == LOCK:
            continue
        policy = effective_policy(policies, item["vhost"], item["name"])
        fed = _federation(policy["definition"] if policy else None)
        if fed:
            found.append(
                {
                    "vhost": item["vhost"],
                    "queue": item["name"],
                    "type": item.get("type", "classic"),
                    "policy": policy["name"] if policy else None,
                    "federation": fed,
                    "consumers": int(item.get("consumers") or 0),
                }
            )
    return sorted(found, key=lambda x: (x["vhost"], x["queue"]))


async def _upstream_names(m: Management, vhost: str, fed: dict[str, Any]) -> list[str]:
    if "federation-upstream" in fed:
        return [fed["federation-upstream"]]
    name = fed["federation-upstream-set"]
    if name == "all":
        return [u["name"] for u in await m.get(f"/parameters/federation-upstream/{q(vhost)}", ok404=True) or []]
    members = await m.get(f"/parameters/federation-upstream-set/{q(vhost)}/{q(name)}", ok404=True)
    return [x["upstream"] for x in (members or {}).get("value", [])]


async def _upstreams(m: Management, queues: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The full definition of every upstream the queues' policies use; each queue gets its names."""
    defs: dict[tuple[str, str], dict[str, Any]] = {}
    for x in queues:
        x["upstreams"] = await _upstream_names(m, x["vhost"], x["federation"])
        for name in x["upstreams"]:
            key = (x["vhost"], name)
            if key not in defs:
                got = await m.get(f"/parameters/federation-upstream/{q(x['vhost'])}/{q(name)}", ok404=True)
                if got is not None:
                    defs[key] = {"vhost": x["vhost"], "name": name, "value": got["value"]}
    return [defs[k] for k in sorted(defs)]


def _uris(value: dict[str, Any]) -> list[str]:
    uri = value.get("uri")
    return [uri] if isinstance(uri, str) else list(uri or [])


async def _upstream_counts(upstreams: list[dict[str, Any]], queues: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ready messages in each upstream queue the federated queues pull from (None when unreachable)."""
    by_key = {(u["vhost"], u["name"]): u for u in upstreams}
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for x in queues:
        for name in x.get("upstreams", []):
            u = by_key.get((x["vhost"], name))
            if u is None:
                continue
            queue = u["value"].get("queue") or x["queue"]
            rows.setdefault((x["vhost"], name, queue), {"vhost": x["vhost"], "upstream": name, "queue": queue})
    conns: dict[str, Any] = {}  # one connection per upstream URI
    try:
        for (vhost, name, queue), row in rows.items():
            row["messages"], row["error"] = None, None
            for uri in _uris(by_key[(vhost, name)]["value"]):
                try:
                    if uri not in conns:
                        conns[uri] = await aio_pika.connect(uri, timeout=5)
                    ch = await conns[uri].channel()
                    declared = await ch.declare_queue(queue, passive=True)
                    row["messages"], row["error"] = int(declared.declaration_result.message_count), None
                    await ch.close()
                    break
                except Exception as exc:  # unreachable, refused, or no such queue: say so, do not stop
                    row["error"] = f"{redact(uri)} queue {queue!r}: {type(exc).__name__}"
    finally:
        for conn in conns.values():
            with contextlib.suppress(Exception):
                await conn.close()
    return list(rows.values())


# -- the journal and the lock ----------------------------------------------------------------------


async def read_journal(m: Management) -> dict[str, Any] | None:
    got = await m.get(f"/global-parameters/{JOURNAL}", ok404=True)
    if got is None:
        return None
    value = got["value"]
    missing = [k for k in _JOURNAL_KEYS if not isinstance(value, dict) or k not in value]
    if missing:
        raise ConfigError(
            f"{m.name}: global parameter {JOURNAL!r} is not a ferry journal (no {', '.join(missing)}); "
            "inspect and delete it by hand"
        )
    return value


_JOURNAL_KEYS = ("id", "source", "target", "phase", "started", "queues", "upstreams")


async def _write_journal(m: Management, journal: dict[str, Any]) -> None:
    journal["updated"] = datetime.now(UTC).isoformat(timespec="seconds")
    await m.put(f"/global-parameters/{JOURNAL}", {"name": JOURNAL, "value": journal})


@contextlib.asynccontextmanager
async def _lock(cluster: RabbitCluster, name: str, vhost: str) -> AsyncIterator[None]:
    """Hold the exclusive lock queue; Conflict if another ferry holds it."""
    conn = await amqp_connect(cluster, vhost=vhost)
    try:
        ch = await conn.channel()
        try:
            await ch.declare_queue(LOCK, exclusive=True, auto_delete=True)
        except aiormq.exceptions.ChannelLockedResource:
            raise Conflict(f"{name}: another ferry failback is running against this broker") from None
        yield
    finally:
        with contextlib.suppress(Exception):
            await conn.close()


# -- the operation ---------------------------------------------------------------------------------


async def failback(
    topo: Topology, req: FailbackRequest, emit: Emit = no_emit, spark: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """Plan, journal, disable, transfer, restore; resumes a journaled failback. Returns the report.

    `spark` makes the Spark session for the spark engine (default: a local one).
    """
    if req.engine not in ("shovel", "spark"):
        raise UsageError(f"--engine must be shovel or spark, got {req.engine!r}")
    if req.max_active < 1:
        raise UsageError("--max-active must be at least 1")
    src_c, dst_c = topo.rabbitmq(req.source), topo.rabbitmq(req.target)
    async with Management(src_c, name=req.source) as sm, Management(dst_c, name=req.target) as dm:
        await _preflight(sm, dm, req)
        vhosts = sorted(v["name"] for v in await sm.get("/vhosts"))
        lock_vhost = "/" if "/" in vhosts else vhosts[0]
        if req.dry_run:
            journal = await read_journal(sm)
            if journal:
                return await _resume_view(journal, src_c, req)
            if req.abort:
                return {"outcome": "nothing to abort", "source": req.source}
            plan = public(await _plan(sm, dm, src_c, dst_c, req, vhosts))
            emit("plan", **plan)
            return {"outcome": "dry-run" if plan["queues"] else "nothing to do", "plan": plan}
        async with _lock(src_c, req.source, lock_vhost):
            journal = await read_journal(sm)
            if journal is None:
                if req.abort:
                    return {"outcome": "nothing to abort", "source": req.source}
                plan = await _plan(sm, dm, src_c, dst_c, req, vhosts)
                emit("plan", **public(plan))
                if not plan["queues"]:
                    return {"outcome": "nothing to do", "plan": public(plan)}
                journal = {**plan, "phase": "disabling", "host": socket.gethostname()}
                journal["upstream_queues"] = await _upstream_counts(journal["upstreams"], journal["queues"])
                await _write_journal(sm, journal)  # before any upstream is deleted
                # from here on, an interrupted run is on record
                emit("journal", id=journal["id"], upstreams=len(journal["upstreams"]))
            else:
                _check_resume(journal, req)
                emit(
                    "resume",
                    id=journal["id"],
                    phase=journal["phase"],
                    started=journal["started"],
                    upstreams=len(journal["upstreams"]),
                )
            if req.abort:
                return await _finish(sm, src_c, dst_c, journal, req, emit, aborted=True)
            if req.engine == "spark" and journal["phase"] in ("disabling", "transferring"):
                spark = _started(spark or _local_session)  # the JVM starts while links go down
            if journal["phase"] == "disabling":
                await _disable(sm, journal, emit)
                journal["phase"] = "transferring"
                await _write_journal(sm, journal)
            if journal["phase"] == "transferring":
                await _links_down(sm, journal, req.link_timeout)
                engine_report = await _transfer(topo, sm, src_c, journal, req, emit, spark)
                journal["phase"] = "restoring"
                await _write_journal(sm, journal)
            else:
                engine_report = {}
            return await _finish(sm, src_c, dst_c, journal, req, emit, engine=engine_report)


async def _preflight(sm: Management, dm: Management, req: FailbackRequest) -> None:
    """Both brokers answer with these credentials; the plugins the protocol needs are on."""
    if req.source == req.target and not req.target_queue:
        raise UsageError("--from and --to are the same cluster: give --target-queue to test on one cluster")
    await sm.get("/overview")
    await dm.get("/overview")
    if await sm.get("/federation-links", ok404=True) is None:
        raise ConfigError(f"{req.source}: the federation plugin is not enabled (rabbitmq_federation_management)")
    if req.engine == "shovel" and await sm.get("/shovels", ok404=True) is None:
        raise ConfigError(f"{req.source}: the shovel plugin is not enabled (rabbitmq_shovel_management)")


async def _plan(
    sm: Management,
    dm: Management,
    src_c: RabbitCluster,
    dst_c: RabbitCluster,
    req: FailbackRequest,
    vhosts: list[str],
) -> dict[str, Any]:
    if req.vhost is not None:
        if req.vhost not in vhosts:
            raise NotFound(f"{req.source}: vhost {req.vhost!r} does not exist")
        vhosts = [req.vhost]
    queues = await _federated_queues(sm, vhosts)
    src_counts, dst_counts = QueueCounts(src_c, req.source), QueueCounts(dst_c, req.target)
    try:
        for x in queues:
            x["before"] = await src_counts.ready(x["vhost"], x["queue"])
        queues = [x for x in queues if x["before"] > 0]
        for vhost in sorted({x["vhost"] for x in queues}):
            if await dm.get(f"/vhosts/{q(vhost)}", ok404=True) is None:
                raise NotFound(f"{req.target}: vhost {vhost!r} does not exist (nothing was changed)")
        for x in queues:
            x["target"] = req.target_queue or x["queue"]
            try:
                x["target_before"] = await dst_counts.ready(x["vhost"], x["target"])
            except NotFound:
                raise NotFound(
                    f"{req.target}: queue {x['target']!r} does not exist in vhost {x['vhost']!r} (nothing was changed)"
                ) from None
    finally:
        await src_counts.close()
        await dst_counts.close()
    upstreams = await _upstreams(sm, queues)
    warnings = [
        f"queue {_path(x)} has {x['consumers']} consumer(s) on {req.source}: are applications still connected there?"
        for x in queues
        if x["consumers"]
    ]
    return {
        "id": uuid.uuid4().hex[:12],
        "source": req.source,
        "target": req.target,
        "engine": req.engine,
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "queues": [{k: v for k, v in x.items() if k != "consumers"} for x in queues],
        "upstreams": upstreams,
        "messages": sum(x["before"] for x in queues),
        "warnings": warnings,
    }


def _check_resume(journal: dict[str, Any], req: FailbackRequest) -> None:
    if journal.get("target") != req.target:
        raise Conflict(
            f"{req.source}: failback {journal['id']} to {journal.get('target')} is in progress; "
            f"rerun it with --to {journal.get('target')}, or --abort it"
        )


async def _resume_view(journal: dict[str, Any], src_c: RabbitCluster, req: FailbackRequest) -> dict[str, Any]:
    counts = QueueCounts(src_c, req.source)
    try:
        left = {_path(x): await counts.ready(x["vhost"], x["queue"]) for x in journal["queues"]}
    finally:
        await counts.close()
    return {"outcome": "dry-run", "resuming": public(journal), "left": left, "abort": req.abort}


async def _disable(sm: Management, journal: dict[str, Any], emit: Emit) -> None:
    for u in journal["upstreams"]:
        await sm.delete(f"/parameters/federation-upstream/{q(u['vhost'])}/{q(u['name'])}")
        emit("upstream-disabled", vhost=u["vhost"], upstream=u["name"])


async def _links_down(sm: Management, journal: dict[str, Any], timeout: float) -> None:
    """Wait until no federation link of the saved upstreams runs (else a consumer would pull)."""
    names = {(u["vhost"], u["name"]) for u in journal["upstreams"]}
    deadline = time.monotonic() + timeout
    while True:
        for u in journal["upstreams"]:
            if await sm.get(f"/parameters/federation-upstream/{q(u['vhost'])}/{q(u['name'])}", ok404=True):
                raise Conflict(
                    f"upstream {u['name']!r} in vhost {u['vhost']!r} was re-created during the failback; "
                    "nothing moved (rerun to disable it again, or --abort)"
                )
        links = [x for x in await sm.get("/federation-links") if (x["vhost"], x["upstream"]) in names]
        if not links:
            return
        if time.monotonic() > deadline:
            x = links[0]
            raise OperationFailed(
                f"federation link {x['upstream']!r} for {queue_path(x['vhost'], x.get('queue') or x.get('exchange'))} "
                f"still {x.get('status')} after {timeout:.0f}s; nothing moved (rerun to continue)"
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
) -> dict[str, Any]:
    counts = QueueCounts(src_c, req.source)
    try:
        ready = await _left(counts, journal["queues"])
        todo = [x for x in journal["queues"] if ready[_path(x)] > 0]
        emit("transfer", engine=req.engine, queues=len(todo), of=len(journal["queues"]))
        progress = _progress(emit, sum(ready.values()))
        if req.engine == "shovel":
            result = await _shovels(topo, sm, counts, journal, todo, ready, req, emit, progress)
        else:
            await _delete_shovels(sm, journal)  # left by an interrupted shovel run
            watch = asyncio.create_task(_watch(src_c, req.source, journal, progress))
            try:
                result = await asyncio.to_thread(_spark_move, topo, journal, todo, ready, req, spark) if todo else {}
            finally:
                watch.cancel()
        progress(sum((await _left(counts, journal["queues"])).values()))
        return result
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


async def _left(counts: QueueCounts, queues: list[dict[str, Any]]) -> dict[str, int]:
    return {_path(x): await counts.ready(x["vhost"], x["queue"]) for x in queues}


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


def _local_session() -> Any:
    from ferry.pipeline.spark import get_session

    return get_session(app_name="ferry failback", data_sources=False)


def _started(make: Callable[[], Any]) -> Callable[[], Any]:
    """Call `make` now in a background thread; the returned callable waits for its result (or error)."""
    result: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            result.set_result(make())
        except BaseException as exc:  # raised where the session is asked for, if it ever is
            result.set_exception(exc)

    threading.Thread(target=run, name="spark-session", daemon=True).start()
    return result.result


def _spark_move(
    topo: Topology,
    journal: dict[str, Any],
    todo: list[dict[str, Any]],
    ready: dict[str, int],
    req: FailbackRequest,
    spark: Callable[[], Any],
) -> dict[str, Any]:
    """The data plane's queue mover: one Spark task per queue, source acks after the target confirmed."""
    from ferry.pipeline.copy import CopyOptions, CopyPlan, run_copy
    from ferry.pipeline.uris import Endpoint

    plan = CopyPlan(
        Endpoint("rabbitmq", f"rabbitmq://{req.source}", cluster=req.source),
        Endpoint("rabbitmq", f"rabbitmq://{req.target}", cluster=req.target),
        CopyOptions(),
        "mover",
        queues=[
            {
                "vhost": x["vhost"],
                "queue": x["queue"],
                "ready": ready[_path(x)],
                "target": x["target"],
                "target_vhost": x["vhost"],
            }
            for x in todo
        ],
        transfer_id=journal["id"],
    )
    report = run_copy(topo, plan, spark())
    return {"possible_duplicates": report.possible_duplicates, "queues": report.queues}


def _path(x: dict[str, Any]) -> str:
    """A journal queue's (or a row's) name in messages, events and the counts' keys."""
    return queue_path(x["vhost"], x["queue"])


def _shovel_name(journal: dict[str, Any], x: dict[str, Any]) -> str:
    return f"{SHOVEL_PREFIX}{journal['id']}-{journal['queues'].index(x)}"


def shovel_definition(topo: Topology, req: FailbackRequest, x: dict[str, Any]) -> dict[str, Any]:
    """A dynamic shovel that drains one queue into its target and then deletes itself."""
    return {
        "src-protocol": "amqp091",
        "src-uri": f"amqp:///{q(x['vhost'])}",  # the source node itself
        "src-queue": x["queue"],
        "src-delete-after": "queue-length",
        "dest-protocol": "amqp091",
        "dest-uri": amqp_uri(topo.rabbitmq(req.target), x["vhost"]),
        "dest-queue": x["target"],
        "ack-mode": "on-confirm",
    }


async def _shovels(
    topo: Topology,
    sm: Management,
    counts: QueueCounts,
    journal: dict[str, Any],
    todo: list[dict[str, Any]],
    ready: dict[str, int],
    req: FailbackRequest,
    emit: Emit,
    progress: Callable[..., None],
) -> dict[str, Any]:
    """At most `max_active` shovels; a queue is done once its shovel deleted itself and it is empty.

    `ready` ("vhost/queue" -> count, every journal queue) is kept current for progress. The
    journal keeps the shovels created and the possible duplicates, across runs: a shovel an
    earlier run created that is gone with messages left ended while ferry was down, and the
    messages it held unacked came back to the queue after they may have reached the target."""
    present = {p["name"] for p in await _ferry_shovels(sm, journal)}
    active = {_shovel_name(journal, x): x for x in todo if _shovel_name(journal, x) in present}  # adopt
    pending = [x for x in todo if _shovel_name(journal, x) not in active]
    created_before = set(journal.setdefault("shovels", []))
    journal.setdefault("possible_duplicates", 0)
    journal["possible_duplicates"] += sum(
        ready[_path(x)] for x in pending if _shovel_name(journal, x) in created_before
    )
    gone_since: dict[str, float] = {}
    created_at: dict[str, float] = {}
    # progress is a new low of a queue's ready count, or a change of its ack count (the management
    # API's, up to a statistics interval old, 5 s here): a shovel that takes messages it cannot
    # deliver (a target that refuses them, or blocks every publisher under an alarm) gives them back
    # unacked, and the last ones it took stay unacked until the target confirms them
    acks: dict[str, int | None] = {}
    seen_acks: dict[str, int | None] = {}
    fewest: dict[str, int] = {}
    stalled: dict[str, float] = {}  # seconds a queue's shovel existed since it last made progress
    created = 0
    last_emit = last_acks = 0.0
    last_poll = time.monotonic()
    while pending or active:
        while pending and len(active) < req.max_active:
            x = pending.pop(0)
            name = _shovel_name(journal, x)
            journal["shovels"] = sorted({*journal["shovels"], name})
            await _write_journal(sm, journal)  # before the shovel exists
            await sm.put(f"/parameters/shovel/{q(x['vhost'])}/{q(name)}", {"value": shovel_definition(topo, req, x)})
            active[name] = x
            gone_since.pop(name, None)
            created_at[name] = time.monotonic()
            created += 1
            emit("shovel", queue=_path(x), name=name, active=len(active))
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
            ready[_path(x)] = left
            acked = acks.get(_path(x))
            moved = left < fewest.get(name, left + 1) or acked != seen_acks.get(name, acked)  # a reset counts too
            fewest[name], seen_acks[name] = min(left, fewest.get(name, left)), acked
            if moved:
                stalled[name] = 0.0
            elif name in present:
                stalled[name] = stalled.get(name, 0.0) + waited
            if name not in present:
                # it deleted itself (the length it saw at start has been moved), but until its
                # consumer is gone it may hold unacked messages that come back when its
                # channel closes (a CI run saw 0 ready, then 158); a foreign consumer is waited out
                if consumers and now - gone_since.setdefault(name, now) < 10.0:
                    continue
                del active[name]
                if left:
                    # it stopped before its last source acks took effect (seen with quorum queues), or
                    # was deleted by hand: these may already be at the target, so count them
                    pending.append(x)
                    journal["possible_duplicates"] += left  # written before its shovel is created again
                else:
                    emit("drained", queue=_path(x), active=len(active))
                continue
            if stalled.get(name, 0.0) > req.stall_timeout:
                state = states.get((x["vhost"], name), {})
                said = ": ".join(str(s) for s in (state.get("state", "not listed"), state.get("reason")) if s)
                said = " ".join(redact(said).split())  # the reason is an Erlang term, printed over lines
                raise OperationFailed(
                    f"shovel for {_path(x)} moved no message for {req.stall_timeout:g}s "
                    f"({said if len(said) <= 300 else said[:300] + ' ...'}); "
                    "upstreams stay disabled (rerun to continue, or --abort)"
                )
            # none ready and none acked for a while: someone else consumed part of the queue, so the
            # shovel waits for messages that will not come; deleting it requeues any it still holds
            if left == 0 and min(stalled.get(name, 0.0), now - created_at.get(name, 0.0)) > EMPTY_WAIT:
                await sm.delete(f"/parameters/shovel/{q(x['vhost'])}/{q(name)}")
        if now - last_emit >= 0.5:
            last_emit = now
            # only shovelled queues change (no upstream feeds them): the rest keep their last count
            progress(sum(ready.values()), active=len(active), pending=len(pending))
    return {"shovels_created": created, "possible_duplicates": journal["possible_duplicates"]}


async def _ferry_shovels(sm: Management, journal: dict[str, Any]) -> list[dict[str, Any]]:
    """The shovel parameters ferry created in the journal's vhosts."""
    vhosts = {x["vhost"] for x in journal["queues"]}
    return [
        p
        for p in await sm.get("/parameters/shovel", ok404=True) or []
        if p["vhost"] in vhosts and p["name"].startswith(SHOVEL_PREFIX)
    ]


async def _delete_shovels(sm: Management, journal: dict[str, Any]) -> int:
    found = await _ferry_shovels(sm, journal)
    for p in found:
        await sm.delete(f"/parameters/shovel/{q(p['vhost'])}/{q(p['name'])}")
    return len(found)


# -- restore and report ------------------------------------------------------------------------------


async def _finish(
    sm: Management,
    src_c: RabbitCluster,
    dst_c: RabbitCluster,
    journal: dict[str, Any],
    req: FailbackRequest,
    emit: Emit,
    engine: dict[str, Any] | None = None,
    aborted: bool = False,
) -> dict[str, Any]:
    """Delete ferry's shovels, restore the upstreams and compare, report, delete the journal."""
    shovels_deleted = await _delete_shovels(sm, journal)
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
                    "moved": x["before"] - left,
                    "left": left,
                    "target_before": x["target_before"],
                    "target_after": await dst_counts.ready(x["vhost"], x["target"]),
                }
            )
    finally:
        await src_counts.close()
        await dst_counts.close()
    if not aborted and any(r["left"] for r in rows):
        left = ", ".join(f"{_path(r)} ({r['left']:,})" for r in rows if r["left"])
        raise OperationFailed(
            f"messages left after the transfer: {left}; the upstreams stay disabled (rerun to continue, or --abort)"
        )
    upstream_after = await _upstream_counts(journal["upstreams"], journal["queues"])
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
    await sm.delete(f"/global-parameters/{JOURNAL}")
    before = {(u["vhost"], u["upstream"], u["queue"]): u.get("messages") for u in journal.get("upstream_queues", [])}
    upstream_queues = [
        {**u, "before": before.get((u["vhost"], u["upstream"], u["queue"])), "after": u.pop("messages")}
        for u in upstream_after
    ]
    report = {
        "outcome": "aborted" if aborted else "complete",
        "id": journal["id"],
        "source": journal["source"],
        "target": journal["target"],
        "engine": req.engine,
        "started": journal["started"],
        "queues": rows,
        "total": {k: sum(r[k] for r in rows) for k in ("before", "moved", "left")},
        "upstreams_restored": restored,
        "upstream_queues": upstream_queues,
        "upstream_pulled": sum(
            (u["before"] or 0) - (u["after"] or 0) for u in upstream_queues if u["before"] is not None
        ),
        "shovels_deleted": shovels_deleted,
        "possible_duplicates": (engine or {}).get("possible_duplicates", 0),
    }
    return report
