"""A move's preflight and plan, and when to hand the stream's leadership to the destination."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout
from pydantic import Field

from ferry.brokers.nats.jsapi import Server, ask_server, peers, stream_info, survey
from ferry.errors import BrokerUnavailable, FerryError, PreflightFailed, UsageError
from ferry.jobs.shared.models import Model
from ferry.jobs.shared.states import Machine


def same_placement(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.get("cluster") == b.get("cluster") and sorted(a.get("tags") or []) == sorted(b.get("tags") or [])


def placed_in(info: dict, names: set[str]) -> bool:
    """The stream's whole peer set is `names`-only, at its replica count, led and current."""
    ps = peers(info)
    return (
        bool((info.get("cluster") or {}).get("leader"))
        and len(ps) == int(info["config"].get("num_replicas", 1))
        and all(p["name"] in names and p["current"] for p in ps)
    )


# A peer that has just caught up installs a snapshot a moment later, which pushes a transfer
# campaign back to a whole election timeout (the stream leaderless for a second, seen on the
# lab): the peer must have been ready this long before ferry hands over to it.
HANDOFF_STEADY_S = 0.3


def handoff_candidate(info: dict, dest: set[str], keep: str | None = None) -> str | None:
    """The destination server to hand the stream's leadership to now, else None.

    A server that reports its migration (nats-server 2.15+: ``cluster.desired.status``) moves the
    leader only when a check, every 500 ms, samples a majority of its destination peers with no
    lag; under load that took 1-2 s after they had caught up (bench/RESULTS.md, "`ferry move`").
    So when the origin leader says it has every peer in the group and waits only for the
    destination's to catch up, and a majority of them are current with no lag (the server's own
    rule), ferry asks it to step down to the current one it heard from last, once that server
    says it can (``ready_to_lead``): the same raft leader transfer the server would make, only
    on a fresh answer (``_watch``). Older servers (no status) are left alone, and so is a move
    still adding peers: a transfer then left the stream leaderless for a second on the lab.
    """
    c = info.get("cluster") or {}
    status = (c.get("desired") or {}).get("status") or {}
    # the status line the server gives once the group holds every peer (runStreamMigration);
    # "catchup" alone also covers a peer not added yet
    waiting = status.get("type") == "catchup" and status.get("description") == "waiting for desired peers to catch up"
    if not waiting or not c.get("leader") or c["leader"] in dest:
        return None
    mine = [r for r in c.get("replicas") or [] if r.get("name") in dest]
    if len(mine) < int(info["config"].get("num_replicas", 1)):
        return None
    current = [r for r in mine if r.get("current") and not r.get("lag") and not r.get("offline")]
    if len(current) < len(mine) // 2 + 1:
        return None
    if keep in {r["name"] for r in current}:  # the peer being watched for steadiness
        return keep
    return min(current, key=lambda r: r.get("active", 0))["name"]


async def ready_to_lead(sysnc: Client, server: str, account: str, stream: str, leader: str) -> bool:
    """`server` can take over `stream` from `leader` now: its replica passes the server's own
    health check (in particular it is not fetching the stream's messages, which travel outside
    the Raft log: such a peer is "current" in stream info yet cannot lead at once), and it still
    sees `leader` leading (the server may have handed over itself since stream info answered; a
    second transfer would follow the first)."""
    health, jsz = await asyncio.gather(
        ask_server(sysnc, "HEALTHZ", server, account=account, stream=stream),
        ask_server(sysnc, "JSZ", server, account=account, streams=True),
    )
    seen = [
        (d.get("cluster") or {}).get("leader")
        for a in jsz.get("account_details") or []
        for d in a.get("stream_detail") or []
        if d.get("name") == stream
    ]
    return health.get("status") == "ok" and seen == [leader]


async def still_ready(nc: Client, stream: str, dest: set[str], peer: str, within: float = 0.25) -> bool:
    """A last look just before the handoff, answered within `within` seconds: `peer` is still the
    candidate. A peer that has fallen behind by the time the leader steps down to it cannot win
    the election it is asked to start, and the stream stays leaderless until an election timeout
    (4-9 s; seen once in about 20 moves at 12,000 msg/s when the view was a second old)."""
    try:
        info = await stream_info(nc, stream, timeout=within)
    except (BrokerUnavailable, NatsTimeout, TimeoutError, FerryError):
        return False
    return handoff_candidate(info, dest, peer) == peer


MovePhase = Literal["starting", "moving", "reconciling", "done", "cancelled"]
MOVE = Machine[MovePhase](
    "move",
    {
        None: {"starting"},
        "done": {"starting"},  # the next move of the stream
        "cancelled": {"starting"},
        "starting": {"moving", "reconciling"},  # reconciling: interrupted before the placement changed
        "moving": {"reconciling"},
        "reconciling": {"done", "cancelled"},
    },
)


@dataclass
class MoveRequest:
    stream: str
    to: str | None = None  # destination cluster
    to_tags: list[str] = field(default_factory=list)
    timeout: float = 600.0
    guard: bool = True
    dry_run: bool = False
    state_dir: Path | None = None  # where capture files go (default: $FERRY_STATE_DIR or ~/.local/state/ferry)

    def placement(self) -> dict[str, Any]:
        p: dict[str, Any] = {}
        if self.to:
            p["cluster"] = self.to
        if self.to_tags:
            p["tags"] = list(self.to_tags)
        return p

    def target(self) -> str:
        return self.to or "tags " + ",".join(self.to_tags)


async def led_stream_info(nc: Client, stream: str) -> dict:
    try:
        return await stream_info(nc, stream)
    except BrokerUnavailable:
        raise PreflightFailed(f"stream {stream!r} did not answer STREAM.INFO: no leader now") from None


class MovePlan(Model):
    """What a move will do, found by its preflight (which refuses, changing nothing, otherwise)."""

    stream: str
    origin: str = Field(alias="from")  # the cluster the stream is in now
    to: str
    replicas: int
    bytes: int
    messages: int
    last_seq: int
    peers: list[str]
    warnings: list[str] = []
    nothing_to_do: bool = False  # every peer is in the destination already
    dest_servers: list[str] = []
    origin_servers: list[str] = []
    servers: dict[str, dict[str, str]] = {}  # name -> cluster and client URL, for the guard's probes
    standby: list[str] = []  # the live `ferry serve`s that keep a standby guard and adopt the move if its ferry dies


async def preflight(nc: Client, sysnc: Client, req: MoveRequest, resuming: bool = False) -> MovePlan:
    """Refuse (PreflightFailed, nothing changed) or return the move's plan."""
    if not req.to and not req.to_tags:
        raise UsageError("say where to: --to CLUSTER or --to-tags TAG,...")
    view = await survey(sysnc)
    if not view.meta_leader:
        raise PreflightFailed("no JetStream meta leader: the super-cluster cannot place streams now")
    info = await led_stream_info(nc, req.stream)
    cfg = info["config"]
    replicas = int(cfg.get("num_replicas", 1))
    if req.to and req.to not in view.clusters():
        raise PreflightFailed(f"destination cluster {req.to!r} unknown (known: {', '.join(sorted(view.clusters()))})")
    c = info.get("cluster") or {}
    origin = c.get("name", "")
    ps = peers(info)
    dest_all = view.matching(req.placement())
    dest_names = {s.name for s in dest_all}
    plan = MovePlan(
        stream=req.stream,
        origin=origin,
        to=req.target(),
        replicas=replicas,
        bytes=info["state"]["bytes"],
        messages=info["state"]["messages"],
        last_seq=info["state"]["last_seq"],
        peers=[p["name"] for p in ps],
        warnings=[],
    )
    placement_now = cfg.get("placement") or {}
    moving = (placement_now.get("cluster") and placement_now.get("cluster") != origin) or len(ps) > replicas
    if moving and not resuming:
        raise PreflightFailed(
            f"stream {req.stream!r} is already moving "
            f"(placement {json.dumps(placement_now)}, {len(ps)} peers for R{replicas})"
        )
    if not moving and ps and all(p["name"] in dest_names for p in ps):
        plan.nothing_to_do = True
        return plan
    if not c.get("leader"):
        raise PreflightFailed(f"stream {req.stream!r} has no leader now; move it once it is led")
    current = sum(1 for p in ps if p["current"] and not p.get("offline"))
    if current < replicas // 2 + 1:
        raise PreflightFailed(f"stream {req.stream!r} has no quorum now ({current} of {replicas} peers current)")
    refusal = destination_refusal(dest_all, replicas, info["state"]["bytes"], req.target())
    if refusal:
        raise PreflightFailed(refusal)
    counts = Counter(s.cluster for s in view.servers.values())
    dest_clusters = {s.cluster for s in dest_all}
    if origin and any(counts[d] != counts[origin] for d in dest_clusters):
        plan.warnings.append(
            f"clusters differ in size ({origin}: {counts[origin]} servers, "
            + ", ".join(f"{d}: {counts[d]}" for d in sorted(dest_clusters))
            + "): every destination server may briefly join the stream's Raft group"
        )
    plan.dest_servers = sorted(dest_names)
    plan.origin_servers = sorted(s.name for s in view.servers.values() if s.cluster == origin)
    plan.servers = {s.name: {"cluster": s.cluster, "url": s.url} for s in view.servers.values()}
    return plan


def destination_refusal(servers: list[Server], replicas: int, need: int, target: str) -> str | None:
    """Why `servers` cannot take an R`replicas` stream of `need` bytes (None: they can)."""
    healthy = [s for s in servers if not s.offline and s.free >= need]
    if len(healthy) >= replicas:
        return None
    why = []
    if off := [s.name for s in servers if s.offline]:
        why.append(f"offline or lame duck: {', '.join(off)}")
    if full := [s.name for s in servers if not s.offline and s.free < need]:
        why.append(f"not enough storage: {', '.join(full)}")
    return f"destination {target} has {len(healthy)} healthy server(s) for an R{replicas} stream" + (
        f" ({'; '.join(why)})" if why else ""
    )
