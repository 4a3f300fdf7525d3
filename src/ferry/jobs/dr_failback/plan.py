"""A DR fail-back's plan, read from the brokers and changing nothing: the federated queues holding
ready messages, the upstreams their policies use (full definitions), each queue's target, and
the upstream queues' counts that later show nothing was pulled."""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import aio_pika

from ferry.brokers.rabbitmq import FEDERATION_KEYS, Management, amqp_connect, effective_policy, q, queue_path
from ferry.brokers.rabbitmq.wire import QueueCounts
from ferry.errors import ConfigError, Conflict, NotFound, UsageError, redact
from ferry.jobs.shared.states import Machine
from ferry.topology import RabbitCluster, Topology

JOURNAL = "ferry-failback"  # global parameter on the source broker
FailbackPhase = Literal["disabling", "transferring", "restoring"]
FAILBACK = Machine[FailbackPhase](
    "failback",
    # restoring -> disabling: messages came back after the transfer (a source node that crashed
    # before it stored the acks), and a consumer would make restored links pull
    {None: {"disabling"}, "disabling": {"transferring"}, "transferring": {"restoring"}, "restoring": {"disabling"}},
)
LOCK = "ferry-failback-lock"  # exclusive queue held while ferry works
SHOVEL_PREFIX = "ferry-failback-"
POLL = 0.2
EMPTY_WAIT = 10.0  # seconds a shovel may sit on an empty queue with nothing acked before it is deleted
SETTLE = 2.0  # seconds a queue whose shovel is gone must stay empty to be drained (its unacked may come back)
PREFETCH = 16  # a shovel's unacked deliveries at most: below the quorum queue client's 32 held-back acks
STUCK_WAIT = 15.0  # seconds a shovel may move nothing (its queue not empty) before it is replaced


# what each engine promises, in the plan (the default is spark: 0.48x and 0.06x the gist's time in
# bench/failback.py's two shapes, where the shovels take 0.79x and 0.12x)
GUARANTEES = {
    "spark": "each message once; what a killed run delivered comes back to the source unacknowledged, and a "
    "rerun delivers again only those without a message id the target holds (counted as possible duplicates)",
    "shovel": "each message once; a shovel that ends other than by itself (deleted, restarted, a node lost) "
    f"may deliver up to {PREFETCH} messages again (counted as possible duplicates), and a source node that "
    "crashes sends again what it had not stored as acknowledged (found by the check after the transfer)",
}


@dataclass
class FailbackRequest:
    source: str  # the DR cluster holding the orphaned messages
    target: str  # the main cluster
    vhost: str | None = None  # only this vhost (default: every vhost)
    target_queue: str | None = None  # one target queue for all (testing on one cluster)
    engine: str = "spark"  # spark | shovel
    max_active: int = 50  # shovels at once
    dry_run: bool = False
    abort: bool = False  # restore the upstreams and clean up without finishing
    link_timeout: float = 30.0  # seconds for federation links to stop
    stall_timeout: float = 60.0  # seconds a shovel may move no message (none acked) before the failback stops
    verify: bool = True  # check the targets against what moved (verify.py)


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


async def _dial(topo: Topology, uri: str) -> aio_pika.abc.AbstractConnection:
    """A connection to an upstream URI's broker: as ferry's user of the topology's cluster that has
    a broker at its host and port (with that cluster's TLS: the URI's TLS files are on the broker
    hosts), else with the URI itself (plain ``amqp://`` only)."""
    parts = urlsplit(uri)
    vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
    for _, _, cluster in topo.clusters():
        for broker in cluster.brokers if isinstance(cluster, RabbitCluster) else []:
            at = urlsplit(broker.url)
            if (at.hostname, at.port) == (parts.hostname, parts.port):
                return await amqp_connect(cluster, broker, vhost=vhost)
    if parts.scheme != "amqp":
        raise ConfigError("an amqps:// upstream whose broker is not in the topology")
    return await aio_pika.connect(uri, timeout=5)


async def upstream_counts(
    topo: Topology, upstreams: list[dict[str, Any]], queues: list[dict[str, Any]]
) -> list[dict[str, Any]]:
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
                        conns[uri] = await _dial(topo, uri)
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


async def preflight(sm: Management, dm: Management, req: FailbackRequest) -> None:
    """Both brokers answer with these credentials; the plugins the protocol needs are on."""
    if req.source == req.target and not req.target_queue:
        raise UsageError("--from and --to are the same cluster: give --target-queue to test on one cluster")
    await sm.get("/overview")
    await dm.get("/overview")
    if await sm.get("/federation-links", ok404=True) is None:
        raise ConfigError(f"{req.source}: the federation plugin is not enabled (rabbitmq_federation_management)")
    if req.engine == "shovel" and await sm.get("/shovels", ok404=True) is None:
        raise ConfigError(f"{req.source}: the shovel plugin is not enabled (rabbitmq_shovel_management)")


async def make_plan(
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
        f"queue {queue_label(x)} has {x['consumers']} consumer(s) on {req.source}: "
        "are applications still connected there?"
        for x in queues
        if x["consumers"]
    ]
    return {
        "id": uuid.uuid4().hex[:12],
        "source": req.source,
        "target": req.target,
        "engine": req.engine,
        "guarantee": GUARANTEES[req.engine],
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "queues": [{k: v for k, v in x.items() if k != "consumers"} for x in queues],
        "upstreams": upstreams,
        "messages": sum(x["before"] for x in queues),
        "warnings": warnings,
    }


def check_resume(journal: dict[str, Any], req: FailbackRequest) -> None:
    if journal.get("target") != req.target:
        raise Conflict(
            f"{req.source}: failback {journal['id']} to {journal.get('target')} is in progress; "
            f"rerun it with --to {journal.get('target')}, or --abort it"
        )


async def resume_view(journal: dict[str, Any], src_c: RabbitCluster, req: FailbackRequest) -> dict[str, Any]:
    counts = QueueCounts(src_c, req.source)
    try:
        left = {queue_label(x): await counts.ready(x["vhost"], x["queue"]) for x in journal["queues"]}
    finally:
        await counts.close()
    return {"outcome": "dry-run", "resuming": public(journal), "left": left, "abort": req.abort}


def queue_label(x: dict[str, Any]) -> str:
    """A journal queue's (or a row's) name in messages, events and the counts' keys."""
    return queue_path(x["vhost"], x["queue"])
