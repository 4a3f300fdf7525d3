"""Running an evacuation or a rebalance: one state machine (:class:`_Driver`) that saves the
journal at least every second, the evacuation's states and the rebalance's."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Coroutine
from typing import Any

from ferry.errors import Conflict, Forbidden, NotFound, PreflightFailed, UsageError
from ferry.jobs.evacuate.nodes import open_nodes
from ferry.jobs.evacuate.nodes.base import Asset, NodeView
from ferry.jobs.evacuate.nodes.nats import NatsNodes
from ferry.jobs.evacuate.nodes.rabbitmq import RabbitNodes
from ferry.jobs.evacuate.plan import (
    EVACUATION,
    REBALANCE,
    RETRY_AFTER,
    STATES,
    TICK,
    EvacuateRequest,
    EvacuationState,
    Pacer,
    RebalanceRequest,
    avg,
    evacuation_key,
    least_loaded,
    planned_moves,
    propose,
    rebalance_key,
    split,
    way_on,
    why_nothing,
    within,
)
from ferry.jobs.shared.events import Emit, no_emit
from ferry.journal import Journal
from ferry.spark.session import SparkFactory
from ferry.topology import NatsCluster, RabbitCluster, Topology

Nodes = NatsNodes | RabbitNodes


def resolve(topo: Topology, node: str, cluster: str) -> tuple[str, NatsCluster | RabbitCluster]:
    if cluster:
        return cluster, topo.cluster(cluster)
    found = [(n, c) for _, n, c in topo.clusters() if node in {b.name for b in c.brokers}]
    if not found:
        raise NotFound(f"no node {node!r} in the topology")
    if len(found) > 1:
        raise UsageError(f"node {node!r} is in clusters {', '.join(n for n, _ in found)}; say which with --cluster")
    return found[0]


async def _claim(nodes: Nodes, key: str, what: str, hint: str = "") -> tuple[Journal, dict[str, Any] | None]:
    """The operation's journal, holding its state when resuming; refused while another live ferry drives it."""
    journal = nodes.journal(key)
    prior = await journal.open()
    if prior and journal.owner_alive(prior):
        o = prior.get("owner") or {}
        raise Conflict(
            f"{what} is already running (state {prior.get('state')}, pid {o.get('pid')} on {o.get('host')})"
            + (f"; {hint}" if hint else "")
        )
    journal.state = dict(prior or {})
    journal.state.pop("refused", None)  # resumed by a user the broker may allow (see _Driver.run)
    return journal, prior


RATES = {"wait_health_check", "conn_evict_rate", "wait_takeover", "sess_evict_rate", "guard"}  # journaled


# -- the state machine shared by both operations ------------------------------------------------------


class _Driver:
    """Runs an operation's states, saving the journal at least every second (the heartbeat)."""

    def __init__(self, nodes: Nodes, journal: Journal, emit: Emit, stop: asyncio.Event | None) -> None:
        self.nodes, self.journal, self.emit = nodes, journal, emit
        self.stop = stop or asyncio.Event()
        self.saved = 0.0
        self.tried: dict[str, float] = {}  # cid or asset label -> when last acted on

    @property
    def st(self) -> dict[str, Any]:
        return self.journal.state

    async def save(self, **changes: Any) -> None:
        if changes or time.monotonic() - self.saved >= 1.0:
            await self.journal.save(**changes)
            self.saved = time.monotonic()

    async def enter(self, state: EvacuationState, **extra: Any) -> None:
        machine = EVACUATION if self.st.get("kind") == "evacuation" else REBALANCE
        machine.step(self.st.get("state"), state)
        await self.save(state=state, since=time.time(), **extra)
        self.emit("state", state=state, **extra)

    async def run(self, steps: Coroutine[Any, Any, Any]) -> tuple[Any, dict[str, Any] | None]:
        """Run the operation's state loop: (its result, None), or (None, the report) when
        `ferry ... stop` deleted the journal or this ferry was asked to let go (detached)."""
        try:
            result = await steps
        except Conflict:
            if not await self.journal.get(self.journal.key):
                return None, {**public(self.st), "outcome": "stopped"}
            raise
        except Forbidden as exc:
            # the broker refused a permission to this driver's user: on record as refused, so that no
            # `ferry serve` adopts it and goes on as a user of its own; run again, it resumes
            try:
                await self.journal.save(release=True, refused=exc.message)
            except Exception:
                raise exc from None  # not on record as refused: adopted as any other whose ferry died
            what = f"evacuation of {self.st['node']}" if self.st.get("node") else f"rebalance of {self.st['cluster']}"
            raise Forbidden(
                exc.message, hint=f"the {what} stays on record, driven by nobody: {way_on(self.st)}"
            ) from None
        if self.stop.is_set():
            with contextlib.suppress(Conflict):
                await self.journal.save(release=True)
            return None, {**public(self.st), "outcome": "detached"}
        return result, None

    def _heard(self, event: str, **data: Any) -> None:
        """A step-down guard's reconciliation: said, and its re-published messages counted on record."""
        if event == "guard":
            guarded = self.st.setdefault("guarded", {"captured": 0, "reinjected": 0})
            guarded["captured"] += data["captured"]
            guarded["reinjected"] += data["reinjected"]
        self.emit(event, **data)

    def recent(self, key: str) -> bool:
        """Acted on within RETRY_AFTER seconds."""
        return time.monotonic() - self.tried.get(key, -RETRY_AFTER) < RETRY_AFTER

    def fresh(self, key: str) -> bool:
        """Not acted on within RETRY_AFTER seconds (then mark it acted on)."""
        now = time.monotonic()
        if now - self.tried.get(key, -RETRY_AFTER) < RETRY_AFTER:
            return False
        self.tried[key] = now
        return True

    async def while_saving(self, work: Coroutine[Any, Any, Any], halt: asyncio.Event | None = None) -> Any:
        """Await `work`, saving the heartbeat every second meanwhile. Stopped, taken over or
        interrupted meanwhile, `halt` tells the work to start nothing new, and what it has in hand
        finishes first (a classic queue half relocated holds its messages in a holding queue, a
        one-replica stream being moved has two)."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                await self.save()
                await asyncio.wait({task}, timeout=1.0)
        except BaseException:
            if halt:
                halt.set()
            if not task.done():
                self.emit("warning", message="stopping: finishing the move in hand first")
                with contextlib.suppress(Exception):
                    await asyncio.shield(task)
            raise
        return task.result()

    async def wait_until(self, deadline: float) -> None:
        while time.time() < deadline and not self.stop.is_set():
            await self.save()
            await asyncio.sleep(min(TICK * 5, max(0.0, deadline - time.time())))

    async def evict_conns(self, view: NodeView, pacer: Pacer, limit: int | None = None) -> int:
        todo = [c["cid"] for c in view.conns if self.fresh(f"cid:{view.name}:{c['cid']}")]
        n = pacer.take(len(todo) if limit is None else min(len(todo), limit))
        for cid in todo[n:]:
            self.tried.pop(f"cid:{view.name}:{cid}")
        kicked = sum(await asyncio.gather(*(self.nodes.kick(view, cid) for cid in todo[:n])))
        return kicked

    async def evict_leaders(
        self, view: NodeView, pacer: Pacer, targets: list[str], load: dict[str, int], limit: int | None = None
    ) -> tuple[int, list[str]]:
        """Step down movable leaders on the node, each towards the target peer with the fewest leaders."""
        kept = [a.label for a in view.leaders if not self.nodes.movable(a) and a.kind != "classic"]
        todo = [a for a in view.leaders if self.nodes.movable(a) and self.fresh(f"lead:{a.label}")]
        n = pacer.take(len(todo) if limit is None else min(len(todo), limit))
        for a in todo[n:]:
            self.tried.pop(f"lead:{a.label}")
        moves = []
        for a in todo[:n]:
            options = [p for p in a.peers if p in targets and p != view.name]
            moves.append((a, least_loaded(options, load) if options else None))
        guard = bool(self.st["rates"].get("guard", True))
        errors = await self.while_saving(self.nodes.step_down_many(moves, guard, self._heard))
        for (a, _), err in zip(moves, errors, strict=True):
            if err:
                self.emit("warning", message=f"{a.label}: step-down refused: {err}")
        return sum(1 for err in errors if not err), kept


# -- evacuation ------------------------------------------------------------------------------------------


async def evacuate(
    topo: Topology,
    req: EvacuateRequest,
    emit: Emit = no_emit,
    stop: asyncio.Event | None = None,
    hold: bool = False,
    resume_only: bool = False,
    spark: SparkFactory | None = None,
) -> dict[str, Any]:
    """Start or resume the evacuation of `req.node`; returns once it is prohibiting
    (or, with `hold`, once stopped). Raises having changed nothing when refused.
    `resume_only` (an adopting `ferry serve`): never start one that is no longer journaled.
    `spark`: where a RabbitMQ evacuation's classic queue relocation runs its Spark job."""
    cname, cluster = resolve(topo, req.node, req.cluster)
    async with open_nodes(cname, cluster, avoid=[req.node], spark=spark) as nodes:
        nodes.check([req.node], "node")
        nodes.check(req.migrate_to, "--migrate-to")
        if req.node in req.migrate_to:
            raise UsageError(f"--migrate-to cannot include the node being evacuated ({req.node})")
        journal, prior = await _claim(
            nodes, evacuation_key(cname, req.node), f"an evacuation of {req.node}", f"`ferry node status {req.node}`"
        )
        if prior and (req.dry_run or (resume_only and prior.get("refused"))):
            why = "on record, not resumed (dry run)" if req.dry_run else "refused: not adopted"
            return {**public(prior), "outcome": why}
        if prior:
            emit("resume", state=prior["state"], rates=prior["rates"])
            await nodes.recover(emit)
        elif resume_only:
            return {"outcome": "nothing to resume"}
        else:
            plan = await _evacuation_plan(nodes, journal, cname, req)
            emit("plan", **plan)
            if req.dry_run:
                return {**plan, "outcome": "dry-run"}
            journal.state = {
                "kind": "evacuation",
                **plan,
                "state": EVACUATION.step(None, STATES[0]),
                "since": time.time(),
            }
            await journal.save()
            emit("state", state=STATES[0])
        return await _run_evacuation(_Driver(nodes, journal, emit, stop), hold)


async def _evacuation_plan(nodes: Nodes, journal: Journal, cname: str, req: EvacuateRequest) -> dict[str, Any]:
    others = [n for n in nodes.brokers if n != req.node]
    rb = await journal.get(rebalance_key(cname))
    if rb and req.node in rb.get("nodes", []):
        raise Conflict(f"a rebalance of cluster {cname!r} involving {req.node} is running; stop it first")
    views = await nodes.views([req.node, *others])
    if not views[req.node].up:
        raise PreflightFailed(f"node {req.node} is not answering ({views[req.node].error})")
    up = [n for n in others if views[n].up]
    recipients = [n for n in (req.migrate_to or others) if n in up]
    if not recipients:
        raise PreflightFailed(f"no other node of cluster {cname!r} is up to take {req.node}'s clients")
    v = views[req.node]
    return {
        "cluster": cname,
        "node": req.node,
        "rates": req.model_dump(include={*RATES, "relocate_rate"}),
        "migrate_to": req.migrate_to,
        "recipients": recipients,
        "initial": v.summary(),
        "evicted": {"connections": 0, "sessions": 0, "replicas": 0},
    }


async def _run_evacuation(d: _Driver, hold: bool) -> dict[str, Any]:
    _, ended = await d.run(_evacuation_steps(d, hold))
    if ended and ended["outcome"] == "stopped" and d.st.get("state") == "prohibiting":
        # stopped while this ferry put the node in maintenance: `stop` may have revived it before the drain ended
        await d.nodes.allow(d.st["node"])
    if ended:
        return ended
    v = await d.nodes.view(d.st["node"])
    return {**public(d.st), "outcome": "evacuated", "now": v.summary()}


async def _evacuation_steps(d: _Driver, hold: bool) -> None:
    st, node, nodes = d.st, d.st["node"], d.nodes
    rates = st["rates"]
    conn_pacer, sess_pacer = Pacer(rates["conn_evict_rate"]), Pacer(rates["sess_evict_rate"])
    prohibited = False
    while not d.stop.is_set():
        state = st["state"]
        if state == "waiting_health_check":
            await d.wait_until(st["since"] + rates["wait_health_check"])
            if not d.stop.is_set():
                conn_pacer.restart()
                await d.enter("evicting_conns")
        elif state == "evicting_conns":
            v = await nodes.view(node, jetstream=False)
            if not v.up:  # restarting: its clients come back (the balancer keeps new ones away)
                await d.save()
                await asyncio.sleep(TICK * 5)
            elif v.conns:
                n = await d.evict_conns(v, conn_pacer)
                if n:
                    st["evicted"]["connections"] += n
                    d.emit("evicted", connections=n, left=len(v.conns) - n)
                await d.save()
                await asyncio.sleep(TICK)
            else:
                await d.enter("waiting_takeover")
        elif state == "waiting_takeover":
            await d.wait_until(st["since"] + rates["wait_takeover"])
            if not d.stop.is_set():
                sess_pacer.restart()
                await d.enter("evicting_sessions")
        elif state == "evicting_sessions":
            if await _evict_sessions(d, sess_pacer):
                await d.enter("prohibiting")  # first: a stop from now on returns the node to service
                await nodes.prohibit(node)
                prohibited = True
                if not hold:
                    await d.journal.save(release=True)
                    break
            await d.save()
            await asyncio.sleep(TICK)
        else:  # prohibiting: whatever comes back is moved off again
            if not prohibited:
                await nodes.prohibit(node)
                prohibited = True
            v = await nodes.view(node)
            if v.up:
                n = await d.evict_conns(v, conn_pacer)
                moved, _ = await d.evict_leaders(v, sess_pacer, st["recipients"], {})
                if n or moved:
                    st["evicted"]["connections"] += n
                    st["evicted"]["sessions"] += moved
                    d.emit("evicted", connections=n, sessions=moved, prohibiting=True)
            if not hold:  # resumed by the CLI: it returns once prohibiting, as when it got there itself
                await d.journal.save(release=True)
                break
            await d.save()
            await asyncio.sleep(TICK * 5)


async def _evict_sessions(d: _Driver, pacer: Pacer) -> bool:
    """One step of session eviction; True when nothing movable is left on the node."""
    st, node, nodes = d.st, d.st["node"], d.nodes
    v = await nodes.view(node)
    if not v.up:
        return False  # the node restarted: wait for it, its leaders may come back
    views = await nodes.views([n for n in nodes.brokers if n != node])
    load = {n: len(x.leaders) for n, x in views.items()}
    scaled = set(st.get("scaled", []))  # one-replica streams being moved (see NatsNodes.move_single)
    # their leaders (stream and consumers) move only once the new replica holds everything
    others = dataclasses.replace(v, assets=[a for a in v.assets if f"{a.account}/{a.stream}" not in scaled])
    moved, kept = await d.evict_leaders(others, pacer, st["recipients"], load)
    spare = [n for n, x in views.items() if x.up]  # replicas go where the cluster places them, not only recipients
    singles = [
        a
        for a in v.assets
        if isinstance(nodes, NatsNodes)
        and spare
        and (a.label in scaled or (nodes.single(a, node) and a.label not in st.get("unmovable", [])))
    ]
    replicas = [
        a
        for a in v.assets
        if nodes.moves_replicas
        and a.consumer is None
        and a.leader != node
        and nodes.movable(a)
        and a.label not in scaled
        and set(spare) - set(a.peers)
    ]
    removed = 0
    for a in singles[: pacer.take(len(singles))]:
        if not d.fresh(f"single:{a.label}"):
            continue
        await d.save(scaled=sorted(scaled | {a.label}))  # first: a ferry killed mid-way finishes it
        err, retry = await d.while_saving(nodes.move_single(a, node))  # type: ignore[union-attr]
        scaled = set(st["scaled"]) - ({a.label} if not err or not retry else set())
        if err:
            d.emit("warning", message=f"{a.label}: one-replica stream not moved: {err}")
            if not retry:
                st.setdefault("unmovable", []).append(a.label)
        else:  # its leaders moved (the stream's and its consumers'), counted as the node's sessions were
            moved += sum(1 for x in v.leaders if (x.account, x.stream) == (a.account, a.stream)) or 1
            st["singles_moved"] = sorted({*st.get("singles_moved", []), a.label})
        await d.save(scaled=sorted(scaled))
    for a in replicas[: pacer.take(len(replicas))]:
        if not d.fresh(f"peer:{a.label}"):
            continue
        err = await nodes.peer_remove(a, node)
        if err:
            d.emit("warning", message=f"{a.label}: peer-remove refused: {err}")
        else:
            removed += 1
    classic = [a for a in v.assets if a.kind == "classic"]
    here = {a.label for a in classic}
    begun = [Asset(vhost, name, None, node, [node], "classic") for vhost, name, _ in st.get("relocating", [])]
    classic += [a for a in begun if a.label not in here]  # by a ferry killed mid-way: Q may have left the node
    if classic and isinstance(nodes, RabbitNodes):
        moved += await _relocate(d, nodes, classic[: pacer.take(len(classic))], spare, load)
    if moved or removed:
        st["evicted"]["sessions"] += moved
        st["evicted"]["replicas"] += removed
        d.emit("evicted", sessions=moved, replicas=removed, left=len(v.leaders) - moved)
    pending = [a for a in v.leaders if nodes.movable(a) or a.kind == "classic"] + replicas + singles
    moving = {a.label for a in singles}
    st["kept"] = [k for k in kept if k not in moving] + [
        a.label for a in v.assets if a.consumer is None and a.leader != node and a not in replicas + singles
    ]
    return not pending and not st.get("relocating")


async def _relocate(d: _Driver, nodes: RabbitNodes, queues: list[Asset], up: list[str], load: dict[str, int]) -> int:
    """Relocate classic queues to the recipients with the fewest queues (the heartbeat goes on
    while the data plane moves their messages); how many now live elsewhere. Each is journaled
    (vhost, queue, target) before it begins, so that a ferry killed mid-way finishes it."""
    planned = {(vhost, name): to for vhost, name, to in d.st.get("relocating", [])}

    async def journal() -> None:
        await d.save(relocating=[[vhost, name, to] for (vhost, name), to in planned.items()])

    moves = []
    for a in queues:
        if up and d.fresh(f"relocate:{a.label}"):
            to = planned.get((a.account, a.stream))
            if to not in up:
                to = least_loaded(up, load)
            planned[(a.account, a.stream)] = to
            moves.append((a, to))
    if not moves:
        return 0
    await journal()
    halt = asyncio.Event()
    said = len(nodes.lost_by_rabbitmq)
    errors = await d.while_saving(nodes.relocate(moves, d.emit, d.st["rates"].get("relocate_rate"), halt), halt)
    if lost := nodes.lost_by_rabbitmq[said:]:  # a node died under its queue's relocation: on record
        d.st.setdefault("lost_by_rabbitmq", []).extend(lost)
    for (a, target), err in zip(moves, errors, strict=True):
        if err:
            d.emit("warning", message=f"{a.label}: relocation to {target} failed: {err}")
        else:
            d.st.setdefault("relocated", []).append({"queue": a.label, "to": target})
            del planned[(a.account, a.stream)]
    await journal()
    return sum(1 for err in errors if not err)


def public(st: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in st.items() if k not in ("owner", "heartbeat")}


# -- rebalance -----------------------------------------------------------------------------------------


async def rebalance(
    topo: Topology,
    req: RebalanceRequest,
    emit: Emit = no_emit,
    stop: asyncio.Event | None = None,
    resume_only: bool = False,
) -> dict[str, Any]:
    """Propose (and with `execute`, carry out) a rebalance of `req.cluster`."""
    cluster = topo.cluster(req.cluster)
    names = req.nodes or [b.name for b in cluster.brokers]
    if len(names) < 2:
        raise UsageError("a rebalance needs at least two nodes")
    async with open_nodes(req.cluster, cluster, avoid=[]) as nodes:
        nodes.check(names, "--nodes")
        journal, prior = await _claim(nodes, rebalance_key(req.cluster), f"a rebalance of {req.cluster}")
        if prior and (not req.execute or (resume_only and prior.get("refused"))):
            why = "on record, not resumed (add --execute)" if not req.execute else "refused: not adopted"
            return {**public(prior), "outcome": why}
        if prior:
            emit("resume", state=prior["state"])
            await nodes.recover(emit)
        elif resume_only:
            return {"outcome": "nothing to resume"}
        else:
            plan = await _rebalance_plan(nodes, journal, req, names)
            emit("plan", **plan)
            if not req.execute or plan["outcome"] == "nothing to balance":
                return {**plan, "outcome": plan["outcome"] if plan["outcome"] != "proposal" else "dry-run"}
            first = REBALANCE.step(
                None, STATES[0] if plan["donors"] else "evicting_sessions"
            )  # no client moves: no wait
            journal.state = {"kind": "rebalance", **plan, "state": first, "since": time.time()}
            await journal.save()
            emit("state", state=first)
        return await _run_rebalance(_Driver(nodes, journal, emit, stop))


async def _rebalance_plan(nodes: Nodes, journal: Journal, req: RebalanceRequest, names: list[str]) -> dict[str, Any]:
    for name in names:
        ev = await journal.get(evacuation_key(req.cluster, name))
        if ev:
            raise Conflict(f"node {name} is being evacuated ({ev.get('state')}); stop that first")
    views = await nodes.views(names)
    down = [n for n, v in views.items() if not v.up]
    if down:
        raise PreflightFailed(f"node {', '.join(down)} not answering ({views[down[0]].error})")
    conns = {n: len(v.conns) for n, v in views.items()}
    kept = {n: sorted(a.label for a in v.leaders if not nodes.movable(a)) for n, v in views.items()}
    sess = {n: _load(nodes, v, "sessions") for n, v in views.items()}  # what a step-down cannot move stays out
    conn_after = propose(conns, req.abs_conn_threshold, req.rel_conn_threshold)
    sess_after = propose(sess, req.abs_sess_threshold, req.rel_sess_threshold)
    notes = (
        []
        if conn_after
        else [why_nothing("connections", conns, req.abs_conn_threshold, req.rel_conn_threshold, "conn")]
    )
    if not sess_after:
        notes.append(why_nothing("leaders", sess, req.abs_sess_threshold, req.rel_sess_threshold, "sess"))
    donors, recipients = split(conns) if conn_after else ([], [])
    sess_donors, sess_recipients = split(sess) if sess_after else ([], [])
    rows = [
        {
            "node": n,
            "role": "donor" if n in donors + sess_donors else "recipient" if n in recipients + sess_recipients else "-",
            "connections": conns[n],
            "connections_after": (conn_after or conns)[n],
            "sessions": sess[n],
            "sessions_after": (sess_after or sess)[n],
            "sessions_kept": len(kept[n]),
        }
        for n in names
    ]
    return {
        "cluster": req.cluster,
        "nodes": names,
        "donors": donors,
        "recipients": recipients,
        "session_donors": sess_donors,
        "session_recipients": sess_recipients,
        "rates": req.model_dump(include=RATES),
        "thresholds": req.model_dump(
            include={"abs_conn_threshold", "rel_conn_threshold", "abs_sess_threshold", "rel_sess_threshold"}
        ),
        "proposal": rows,
        "kept": kept,
        "notes": notes,
        "evicted": {"connections": 0, "sessions": 0},
        "outcome": "proposal" if conn_after or sess_after else "nothing to balance",
    }


def _load(nodes: Nodes, view: NodeView, what: str) -> int:
    """What a rebalance balances on a node: its connections, or its sessions, the leaders a
    step-down can move (not an R1 stream's, nor another account's)."""
    return len(view.conns) if what == "connections" else sum(1 for a in view.leaders if nodes.movable(a))


async def _run_rebalance(d: _Driver) -> dict[str, Any]:
    outcome, ended = await d.run(_rebalance_steps(d))
    if ended:
        return ended
    await d.journal.delete()  # donors return to service
    views = await _settled(d)
    if outcome == "done":  # the end state measured, not assumed
        outcome = _judged(d.st, views, d.nodes)
    return {**public(d.st), "outcome": outcome, "now": [v.summary() for v in views.values()]}


SETTLE = 10.0  # seconds a rebalance's end waits for the clients it evicted to be listed again


async def _settled(d: _Driver) -> dict[str, NodeView]:
    """The nodes once the clients evicted are back (as many connections listed as before), for
    at most SETTLE seconds: a node's listing lags, and an evicted client takes a moment to return.
    A node listing fewer than the plan leaves on it (its connections less those it gave) is one
    whose listing is late or was left out of the answer (a loaded RabbitMQ node's, seen in CI:
    the rebalance called itself balanced): waited out for SETTLE seconds more."""
    before = sum(row["connections"] for row in d.st["proposal"])
    floor = {row["node"]: min(row["connections"], row["connections_after"]) for row in d.st["proposal"]}
    began = time.monotonic()
    while True:
        views = await d.nodes.views(d.st["nodes"])
        short = any(v.up and len(v.conns) < floor.get(n, 0) for n, v in views.items())
        waited = time.monotonic() - began
        back = sum(len(v.conns) for v in views.values()) >= before
        if (not short and (back or waited > SETTLE)) or waited > 2 * SETTLE:
            return views
        await asyncio.sleep(TICK)


def _judged(st: dict[str, Any], views: dict[str, NodeView], nodes: Nodes) -> str:
    """The outcome from the counts measured at the end: balanced, or which counts are not."""
    th, off = st["thresholds"], []
    sides = (
        ("connections", st["donors"], st["recipients"], "conn"),
        ("sessions", st["session_donors"], st["session_recipients"], "sess"),
    )
    for what, donors, recipients, flag in sides:
        if not donors:
            continue
        counts = {n: _load(nodes, v, what) for n, v in views.items()}
        if not within(
            avg([counts[n] for n in donors]),
            avg([counts[n] for n in recipients]),
            th[f"abs_{flag}_threshold"],
            th[f"rel_{flag}_threshold"],
        ):
            label = "connections" if what == "connections" else "movable leaders"
            off.append(f"{label} now {', '.join(f'{n} {c:,}' for n, c in counts.items())}")
    if not off:
        return "balanced"
    return "moved as planned, not balanced: " + "; ".join(off) + " (a rebalance moves no more than its plan)"


async def _rebalance_steps(d: _Driver) -> str:
    """The rebalance's state loop; its outcome."""
    st, nodes = d.st, d.nodes
    rates, th = st["rates"], st["thresholds"]
    conn_pacers = {n: Pacer(rates["conn_evict_rate"]) for n in st["donors"]}
    sess_pacers = {n: Pacer(rates["sess_evict_rate"]) for n in st["session_donors"]}
    planned = {kind: planned_moves(st["proposal"], kind) for kind in ("connections", "sessions")}
    outcome = "done"
    while not d.stop.is_set():
        state = st["state"]
        if state in ("waiting_health_check", "waiting_takeover"):
            await d.wait_until(st["since"] + rates[state.replace("waiting_", "wait_")])
            if d.stop.is_set():
                break
            nxt = "evicting_conns" if state == "waiting_health_check" else "evicting_sessions"
            for p in (conn_pacers if nxt == "evicting_conns" else sess_pacers).values():
                p.restart()
            await d.enter(nxt)
            continue
        views = await nodes.views(st["nodes"], jetstream=state == "evicting_sessions")
        down = [n for n, v in views.items() if not v.up]
        if down:
            outcome = f"aborted: node {', '.join(down)} stopped answering"
            d.emit("abort", reason=outcome)
            break
        conns = state == "evicting_conns"
        donors, recipients = (
            (st["donors"], st["recipients"]) if conns else (st["session_donors"], st["session_recipients"])
        )
        kind = "connections" if conns else "sessions"
        counts = {n: _load(nodes, v, kind) for n, v in views.items()}
        # a node's listing lags (RabbitMQ's by up to a statistics interval): clients kicked a moment
        # ago may still be listed; they are on their way, so they count as given up already
        left = {n: sum(1 for c in v.conns if not d.recent(f"cid:{n}:{c['cid']}")) for n, v in views.items()}
        goal = avg([counts[r] for r in recipients])
        abs_t, rel_t = (
            (th["abs_conn_threshold"], th["rel_conn_threshold"])
            if conns
            else (th["abs_sess_threshold"], th["rel_sess_threshold"])
        )
        st["counts"] = counts
        given = st.setdefault("evicted_by", {}).setdefault(kind, {})
        quota = {dn: planned[kind].get(dn, 0) - given.get(dn, 0) for dn in donors}
        balanced = not donors or within(avg([counts[x] for x in donors]), goal, abs_t, rel_t)
        if balanced or not any(q > 0 for q in quota.values()):  # never past the plan
            if conns:
                await d.enter("waiting_takeover")
                continue
            break
        level = avg(list(counts.values()))  # what every node holds once balanced
        over = [dn for dn in donors if counts[dn] > level and quota[dn] > 0]
        if not conns and not any(nodes.movable(a) for dn in over for a in views[dn].leaders):
            outcome = "balanced as far as possible (the donors' other leaders cannot move)"
            break
        # leaders go where ferry sends them: never past the level (rounded up) on the recipients, or two
        # donors giving in one tick overfill them (6,1,4 became 3,5,3); clients reconnect where they like
        room = math.inf if conns else sum(max(0, math.ceil(level) - counts[r]) for r in recipients)
        if not room:
            outcome = "balanced as far as possible (the recipients hold their share)"
            break
        for dn in sorted(over, key=counts.__getitem__, reverse=True):
            if conns and left[dn] <= level:
                continue  # what it still lists above the level was kicked a moment ago
            excess = min(room, quota[dn], max(1, math.ceil((left[dn] if conns else counts[dn]) - level)))
            room -= excess  # (moving to `goal` would overshoot)
            if not excess:
                break
            if conns:
                n = await d.evict_conns(views[dn], conn_pacers[dn], limit=excess)
            else:
                n, _ = await d.evict_leaders(views[dn], sess_pacers[dn], recipients, dict(counts), limit=excess)
            st["evicted"][kind] += n
            given[dn] = given.get(dn, 0) + n
            if n:
                d.emit("evicted", node=dn, **{"connections" if conns else "sessions": n})
        await d.save()
        await asyncio.sleep(TICK)
    return outcome
