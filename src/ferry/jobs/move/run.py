"""Running a move: the placement update, the watch until the stream lives in the destination
(or is back after a cancel), the reconciliation of the guard's capture, and the journal."""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout
from pydantic import ConfigDict, Field

from ferry.brokers import nats as bnats
from ferry.brokers.nats.jsapi import account_name, api, ask_server, paged, peers, stream_info
from ferry.errors import BrokerUnavailable, FerryError, NotFound, OperationFailed, PreflightFailed, UsageError
from ferry.jobs.move.plan import (
    HANDOFF_STEADY_S,
    MOVE,
    MovePhase,
    MovePlan,
    MoveRequest,
    handoff_candidate,
    led_stream_info,
    placed_in,
    preflight,
    ready_to_lead,
    same_placement,
    still_ready,
)
from ferry.jobs.move.standby import listened_since, standby_ferries
from ferry.jobs.move.verify import snapshot, verify
from ferry.jobs.shared.events import Emit, no_emit
from ferry.jobs.shared.guard import Guard, reconcile, state_root
from ferry.jobs.shared.models import Model
from ferry.journal import BUCKET, KvJournal, owner_alive
from ferry.topology import NatsCluster

MoveOutcome = Literal["moved", "cancelled", "dry-run", "already there", "not started", "refused", "failed"]


class Verification(Model):
    ok: bool
    problems: list[str]
    last_seq: int


class MoveResult(Model):
    """What a move did (or, for a dry run or a stream already there, its plan)."""

    stream: str
    outcome: MoveOutcome
    error: str | None = None  # refused or failed (``--streams``: each move's own)
    plan: MovePlan | None = None  # a dry run's, or a stream already there
    move_id: str | None = None
    origin: str | None = Field(None, alias="from")
    to: str | None = None
    unguarded_s: float | None = None  # a resumed move: how long no guard listened before it
    standby: bool | None = None  # a standby guard (ferry serve's) listened beside this run's
    # the watch
    leader_changes: list[dict[str, Any]] = []
    handoff: dict[str, Any] | None = None
    leaderless_s: float | None = None
    unanswered_s: float | None = None
    moved_in_s: float | None = None
    # the guard's reconciliation
    captured: int | None = None
    missed: int | None = None
    reinjected: int | None = None
    already_stored: int | None = None  # a producer's own retry got there first (same Nats-Msg-Id)
    unavailable_s: float | None = None
    guard_deaf_s: float | None = None  # this run's guard: seconds its connection was down
    leaders_lost: list[dict[str, Any]] = []  # leaders that died meanwhile: what core publishes lost, inherently
    verify: Verification | None = None
    cluster: str | None = None
    peers: list[str] = []
    took_s: float | None = None


class MoveRecord(Model):
    """A move as its journal keeps it (``move --status``)."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")  # a journal a newer ferry wrote

    stream: str
    move_id: str
    phase: MovePhase | None = None
    origin: str | None = Field(None, alias="from")
    to: str | None = None
    placement: dict[str, Any] = {}
    started: float | None = None
    outcome: str | None = None
    cancel: str | None = None  # a cancel asked for (Ctrl-C, timeout) that a rerun carries out
    result: MoveResult | None = None
    owner: dict[str, Any] | None = None
    heartbeat: float | None = None
    owner_alive: bool = False


class CancelAsked(Model):
    stream: str
    cancelled: bool
    cluster: str | None
    driven_by: str | None = None  # the live ferry running the move, which then ends it cancelled


_MOVE_NOT_IN_PROGRESS = 10129  # nats-server's JSStreamMoveNotInProgress
# a cancel this ferry did not ask for: the server puts the placement back on `ferry move --stop`
# (from any ferry), on a CANCEL_MOVE from any other client, or on a placement update
_FROM_OUTSIDE = "outside this ferry: `ferry move --stop`, or another client's cancel or placement update"


async def _cancel_request(sysnc: Client, account: str, stream: str) -> dict:
    return await api(sysnc, f"$JS.API.ACCOUNT.STREAM.CANCEL_MOVE.{account}.{stream}", timeout=10)


async def move(
    cluster: NatsCluster,
    req: MoveRequest,
    emit: Emit = no_emit,
    stop: asyncio.Event | None = None,
) -> MoveResult:
    """Run (or resume) one move; returns its result. Raises PreflightFailed having changed nothing."""
    async with (
        bnats.session(cluster, client_name="ferry-move") as nc,
        bnats.session(cluster, system=True, client_name="ferry-move-sys") as sysnc,
    ):
        await led_stream_info(nc, req.stream)  # a leaderless stream is refused before the journal is touched
        journal = KvJournal(nc, f"move.{req.stream}", replicas=min(3, len(cluster.brokers)))
        try:
            prior = await journal.open()
        except (NatsTimeout, TimeoutError):
            raise BrokerUnavailable(f"the journal bucket {BUCKET} did not answer; JetStream unavailable?") from None
        resuming = bool(prior and prior.get("phase") not in (None, "done", "cancelled"))
        if resuming and journal.owner_alive(prior or {}) and not req.dry_run:
            # driven by a live ferry (`ferry serve`, which adopted it, or another run): followed to its end
            followed = await _follow(journal, prior or {}, emit, stop)
            if followed is not None:
                return followed
            prior = await journal.open()  # its driver died while followed: this run goes on with it
            resuming = bool(prior and prior.get("phase") not in (None, "done", "cancelled"))
        plan = await preflight(nc, sysnc, req, resuming=resuming)
        if resuming and prior and prior.get("from"):  # the move's origin, not where its group is by now
            plan.origin, plan.nothing_to_do = prior["from"], False
        if req.guard and not plan.nothing_to_do:
            serves = standby_ferries(cluster.urls, req.state_dir)
            plan.standby = [f"ferry serve pid {o['pid']} on {o['host']}" for o in serves]
            if not plan.standby:
                plan.warnings.append(
                    "no ferry serve keeps a standby guard (none reads this cluster with this state directory): if this "
                    "ferry dies, core publishes until the move runs again are not captured"
                )
        emit("plan", **plan.doc())
        if req.dry_run or (plan.nothing_to_do and not resuming):
            return MoveResult(stream=req.stream, outcome="dry-run" if req.dry_run else "already there", plan=plan)
        account = await account_name(nc)
        t0 = time.monotonic()
        if resuming:
            journal.state = dict(prior or {})
            emit("resume", phase=journal.state["phase"], move_id=journal.state["move_id"])
            capture_dir = Path(journal.state["capture_dir"])
        else:
            move_id = uuid.uuid4().hex[:12]
            capture_dir = state_root(req.state_dir) / "moves" / f"{req.stream}-{move_id}"
            pre = await snapshot(nc, req.stream)
            journal.state = {
                "stream": req.stream,
                "move_id": move_id,
                "account": account,
                "from": plan.origin,
                "to": req.target(),
                "placement": req.placement(),
                "origin_servers": plan.origin_servers,
                "dest_servers": plan.dest_servers,
                "seq0": pre["last_seq"],
                "pre": pre,
                "capture_dir": str(capture_dir),
                "state_dir": str(state_root(req.state_dir)),  # a `ferry serve` with the same one adopts
                "started": time.time(),
                "timeout": req.timeout,
                "guard": req.guard,
            }
        st = journal.state
        info = await stream_info(nc, req.stream)
        st["subjects"] = info["config"].get("subjects") or []  # what a standby guard listens to
        # journaled before the guard writes its first capture (a run killed in between leaves a record
        # whose rerun reconciles the capture and removes it); a resume claims the journal here, before
        # it acts (compare-and-set: of two reruns at once, one stops)
        await journal.save(**({} if resuming else {"phase": MOVE.step(None, "starting")}))
        guard = None
        if req.guard and info["config"].get("subjects"):
            guard = Guard(
                cluster, info["config"]["subjects"], capture_dir / f"capture-{os.getpid()}-{int(time.time())}.arrow"
            )
            try:
                led = info.get("cluster") or {}
                await guard.start(led_in=led.get("name", ""), servers=plan.servers, avoid=led.get("leader", ""))
                await journal.save()  # a heartbeat: the guard's start may take seconds
            except BaseException:
                if not resuming:  # nothing changed yet: a guard refused leaves what was on record before
                    shutil.rmtree(capture_dir, ignore_errors=True)
                    with contextlib.suppress(Exception):
                        await _put_back(journal, prior)
                raise
            emit(
                "guard",
                subjects=info["config"]["subjects"],
                file=str(guard.path),
                waited=guard.waited,
                server=guard.server,
            )
            if plan.standby and await _standby_listens(capture_dir, emit):
                await journal.save(standby_seen=True)  # nothing changes until the standby listens too
        elif req.guard:
            emit(
                "guard", subjects=[], note="the stream has no subjects of its own (mirror/sourced): nothing to capture"
            )
        result: dict[str, Any] = {"move_id": st["move_id"], "from": st["from"], "to": st["to"]}
        standby_since = listened_since(capture_dir)
        result["standby"] = standby_since is not None
        if resuming and guard and prior and prior.get("heartbeat"):
            # the run before listened until about its last heartbeat (until it died: past that heartbeat);
            # this one from now on; a standby from its start on (while the run before ran, if that one saw it)
            died = float(prior["heartbeat"])
            since = died if prior.get("standby_seen") else min(time.time(), standby_since or time.time())
            result["unguarded_s"] = round(max(0.0, since - died), 1)
        if gap := result.get("unguarded_s"):
            emit(
                "unguarded",
                seconds=gap,
                note=f"no guard listened for about {gap:.1f}s before this run: core (fire-and-forget) publishes "
                "then are not covered (JetStream publishes with retries are)",
            )
        try:
            placed = same_placement(info["config"].get("placement") or {}, st["placement"])
            if st.get("phase") == "starting" and not placed and stop and stop.is_set():
                # interrupted before the placement changed: nothing to cancel, the stream stays put
                emit("cancelled", by="interrupt before the placement update")
                await journal.save(phase=MOVE.step(st["phase"], "reconciling"), outcome="cancelled")
            if st.get("phase") == "starting":
                if not placed:
                    cfg = dict(info["config"])
                    cfg["placement"] = st["placement"]
                    await api(nc, f"$JS.API.STREAM.UPDATE.{req.stream}", cfg, timeout=10)
                    emit("placement", placement=st["placement"])
                # not awaited: a resume from "starting" finds the placement already set and goes on
                journal.save_soon(phase=MOVE.step(st["phase"], "moving"))
            if st["phase"] == "moving":
                outcome, watch = await _watch(nc, sysnc, req, journal, emit, stop, t0)
                result.update(watch)
                # not awaited (the bucket takes a second under load): a resume from "moving" finds the
                # stream in place at once and reconciles all the same
                journal.save_soon(phase=MOVE.step(st["phase"], "reconciling"), outcome=outcome)
        finally:
            if guard:
                await guard.stop()
        result["outcome"] = st["outcome"]
        if guard:
            result["guard_deaf_s"] = guard.deaf_s
        result["leaders_lost"] = _leaders_lost(st.get("leader_changes") or [], guard, emit)
        if guard or (capture_dir.exists() and any(capture_dir.glob("capture-*.arrow"))):
            async with _beating(journal):  # a minute at most, and no other ferry adopts the move meanwhile
                result.update(await reconcile(cluster, nc, req.stream, st, capture_dir, emit))
        post = await snapshot(nc, req.stream)
        problems = verify(st["pre"], post)
        result["verify"] = {"ok": not problems, "problems": problems, "last_seq": post["last_seq"]}
        emit("verify", **result["verify"])
        info = await stream_info(nc, req.stream)
        result["cluster"] = (info.get("cluster") or {}).get("name")
        result["peers"] = [p["name"] for p in peers(info)]
        result["took_s"] = round(time.time() - st["started"], 3)
        ended = MOVE.step(st["phase"], "done" if st["outcome"] == "moved" else "cancelled")
        moved = MoveResult(stream=req.stream, **result)
        await journal.save(phase=ended, result=moved.doc())
        shutil.rmtree(capture_dir, ignore_errors=True)  # reconciled: the captures have served
        emit("done", **{k: v for k, v in moved.doc().items() if k != "verify"})
        return moved


async def _follow(
    journal: KvJournal, prior: dict[str, Any], emit: Emit, stop: asyncio.Event | None
) -> MoveResult | None:
    """Wait for the move's live driver to end it; its result, or None once that driver is dead."""
    o, st = prior.get("owner") or {}, prior
    emit("follow", driven_by=f"ferry pid {o.get('pid')} on {o.get('host')}", phase=prior.get("phase"))
    while st.get("phase") not in ("done", "cancelled"):
        if not journal.owner_alive(st):
            return None
        if stop is not None and stop.is_set():
            return MoveResult(stream=prior["stream"], outcome="not started", error="interrupted while following")
        await asyncio.sleep(0.5)
        st = await journal.open(create=False) or {}
        if not st:
            raise NotFound(f"the move of {prior['stream']!r} left the journal while followed (stopped?)")
    return MoveResult.model_validate(st["result"])


async def _standby_listens(capture_dir: Path, emit: Emit, within: float = 5.0) -> bool:
    """Wait until a standby guard writes in `capture_dir` (a `ferry serve` reads the journal twice a
    second), `within` seconds at most; say which, and return whether one does."""
    deadline = time.monotonic() + within
    while listened_since(capture_dir) is None:
        if time.monotonic() > deadline:
            said = "if this ferry dies, core publishes until the move runs again are not captured"
            emit("warning", note=f"no standby guard listened within {within:g}s: {said}")
            return False
        await asyncio.sleep(0.1)
    emit("standby", note="a standby guard (ferry serve) listens too: a kill of this ferry leaves no gap")
    return True


@contextlib.asynccontextmanager
async def _beating(journal: KvJournal) -> AsyncIterator[None]:
    """The journal's heartbeat every second while the block runs."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(1.0)
            journal.save_soon()

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _put_back(journal: KvJournal, prior: dict[str, Any] | None) -> None:
    """The record as it was before a move that changed nothing (an earlier move's result, or none)."""
    if prior is None:
        await journal.delete()
    else:
        journal.state = dict(prior)
        await journal.save(release=True)


async def _watch(
    nc: Client,
    sysnc: Client,
    req: MoveRequest,
    journal: KvJournal,
    emit: Emit,
    stop: asyncio.Event | None,
    t0: float,
) -> tuple[str, dict[str, Any]]:
    """Poll the stream until it lives in the destination (or is back in the origin after a cancel).
    A leader change whose former leader does not answer the system account, or answers having
    started since it led, is marked ``lost``: the server died (or was cut off), no step-down."""
    st = journal.state
    dest, origin = set(st["dest_servers"]), set(st["origin_servers"])
    deadline = t0 + req.timeout
    began = time.monotonic() - (time.time() - st["started"])  # the move's start: times are from there
    leader = st.get("leader")  # the last one a run saw: a change while no ferry watched is seen too
    changes: list[dict[str, Any]] = st.setdefault("leader_changes", [])  # journaled: a rerun goes on with them
    leaderless = unanswered = 0.0
    asked = st.get("cancel")  # a cancel a run before this one asked for (Ctrl-C, timeout)
    last_poll = time.monotonic()
    last_emit = last_beat = 0.0
    cancelled_at: float | None = None
    cancel_again_at = not_moving_since = 0.0  # after a cancel the server called premature or late
    handoff: dict[str, Any] | None = None
    ready_since: tuple[str, float] | None = None  # (peer, when it was first found ready to lead)
    while True:
        now = time.monotonic()
        try:
            info = await stream_info(nc, req.stream, timeout=1.0)
            fresh = time.monotonic() - now < 0.6  # a busy leader answers late: its view is old news
        except (BrokerUnavailable, NatsTimeout, TimeoutError, FerryError) as exc:
            if isinstance(exc, NotFound):
                raise
            info = None
        dt, last_poll = now - last_poll, now
        new_leader = ((info or {}).get("cluster") or {}).get("leader")
        if info is None:  # a leader busy catching up new peers answers late: not the same as none
            unanswered += dt
        elif not new_leader:
            leaderless += dt
        if new_leader and new_leader != leader:
            if leader is not None:
                change = {"at_s": round(now - began, 3), "from": leader, "to": new_leader}
                started, known = await _started(sysnc, leader), st.get("leader_started")
                if started is None or (known and started != known):
                    change["lost"] = True  # no answer, or a server started since it led
                changes.append(change)
                emit("leader", at_s=change["at_s"], leader=new_leader, previous=leader, lost=change.get("lost", False))
            leader = st["leader"] = new_leader
            st["leader_started"] = await _started(sysnc, leader)
        if info:
            placement = info["config"].get("placement") or {}
            if cancelled_at is None and not same_placement(placement, st["placement"]):
                cancelled_at = now
                emit("cancelled", by=f"the run before ({asked})" if asked else _FROM_OUTSIDE)
            if cancelled_at is None and placed_in(info, dest):
                outcome = "moved"
                break
            if cancelled_at is not None and placed_in(info, origin):
                outcome = "cancelled"
                break
            keep = ready_since[0] if ready_since else None
            ready = handoff_candidate(info, dest, keep) if fresh and cancelled_at is None and handoff is None else None
            if not (ready and await ready_to_lead(sysnc, ready, st["account"], req.stream, new_leader)):
                ready_since = None
            elif not ready_since or ready_since[0] != ready:
                ready_since = (ready, now)
            elif now - ready_since[1] < HANDOFF_STEADY_S:
                pass
            elif not await still_ready(nc, req.stream, dest, ready):
                ready_since = None  # behind again at the last look: steady once more first
            else:
                handoff = {"at_s": round(now - began, 3), "from": new_leader, "to": ready}
                try:
                    await api(nc, f"$JS.API.STREAM.LEADER.STEPDOWN.{req.stream}", {"placement": {"preferred": ready}})
                except (FerryError, NatsTimeout, TimeoutError) as exc:  # e.g. the server moved it itself just now
                    handoff["error"] = str(exc)
                emit("handoff", **handoff)
            if now - last_emit >= 0.5:
                last_emit = now
                emit(
                    "progress",
                    at_s=round(now - began, 2),
                    leader=new_leader,
                    peers=peers(info),
                    last_seq=info["state"]["last_seq"],
                )
        interrupted = stop is not None and stop.is_set()
        if cancelled_at is None and (now > deadline or interrupted or asked) and now >= cancel_again_at:
            if not cancel_again_at:
                reason = "timeout" if now > deadline else "interrupted" if interrupted else f"asked before: {asked}"
                try:  # journaled first: a rerun carries the cancel out if this run cannot
                    await journal.save(cancel=asked or reason)
                except Exception as exc:  # but the cancel does not wait on the journal's health
                    emit("warning", note=f"the cancel is not journaled ({exc}); asking for it all the same")
                emit("cancelling", reason=reason)
            try:
                await _cancel_request(sysnc, st["account"], req.stream)
                cancelled_at = now
            except FerryError as exc:
                if getattr(exc, "fields", {}).get("err_code") != 10129:
                    raise
                # "not in progress": the group holds only the destination's peers already (the next
                # poll finds the stream moved) or not yet theirs; ask again unless it lands first
                if not cancel_again_at:
                    emit("cancel", note=f"too late to cancel, or too early: {exc}")
                    not_moving_since = now
                elif now - not_moving_since > 120:
                    now_on = ", ".join(p["name"] + ("" if p["current"] else " (behind)") for p in peers(info or {}))
                    raise FerryError(
                        f"stream {req.stream!r}: no move in progress, says the server, yet the stream is not healthy "
                        f"in {st['to']} after 120s (peers: {now_on or 'unknown'})"
                    ) from None
                cancel_again_at = now + 0.5
        if cancelled_at is not None and now - cancelled_at > 120:
            raise FerryError(f"stream {req.stream!r} not healthy in {st['from']} 120s after the cancel")
        if now - last_beat >= 1.0:
            last_beat = now
            journal.save_soon()
        await asyncio.sleep(0.05)
    return outcome, {
        "leader_changes": changes,
        "handoff": handoff,
        "leaderless_s": round(leaderless, 3),
        "unanswered_s": round(unanswered, 3),
        "moved_in_s": round(now - began, 3),
    }


async def _started(sysnc: Client, server: str) -> str | None:
    """When `server` started (its VARZ, through the system account); None when it does not answer."""
    return (await ask_server(sysnc, "VARZ", server)).get("start")


def _leaders_lost(changes: list[dict[str, Any]], guard: Guard | None, emit: Emit) -> list[dict[str, Any]]:
    """What a leader that died during the move means for core publishes, said once per death:
    those that reached only the dead server (its buffers, or its own clients' on their way to
    it) died with it, and no guard on another server can hear them (inherent, as with no move at
    all); those that reached any other server, the guard heard and re-published where the stream
    missed them, unless it was deaf itself (its connection down: `guard_deaf_s`)."""
    lost = []
    for c in changes:
        if not c.get("lost"):
            continue
        said = {"server": c["from"], "at_s": c["at_s"], "guard_on": guard.server if guard else None}
        if guard is None:
            said["guarded"] = "nothing: no guard listened (core publishes around the death are not covered)"
        else:
            deaf = f", though it was deaf {guard.deaf_s:.1f}s (its connection down)" if guard.deaf_s else ""
            said["guarded"] = (
                f"core publishes that reached any other server: the guard on {guard.server} heard them{deaf}"
            )
        said["inherent"] = (
            f"core publishes that reached only {c['from']} (in its buffers, or its clients' on the way to it) died "
            "with it: no guard on another server hears them; JetStream publishes unacked are the publishers' to retry"
        )
        emit("leader_lost", **said)
        lost.append(said)
    return lost


async def move_many(
    cluster: NatsCluster,
    pattern: str,
    req: MoveRequest,
    concurrency: int = 1,
    emit: Emit = no_emit,
    stop: asyncio.Event | None = None,
) -> list[MoveResult]:
    """Every stream whose name matches `pattern`, `concurrency` at a time (one move per stream)."""
    async with bnats.session(cluster) as nc:
        names = sorted([n async for n in paged(nc, "$JS.API.STREAM.NAMES", "streams")])
    chosen = [n for n in names if fnmatch.fnmatchcase(n, pattern) and n != "KV_" + BUCKET]
    if not chosen:
        raise NotFound(f"no stream matches {pattern!r}")
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(name: str) -> MoveResult:
        async with gate:
            if stop and stop.is_set():
                return MoveResult(stream=name, outcome="not started", error="interrupted before its turn")
            r = MoveRequest(**{**req.__dict__, "stream": name})
            try:
                return await move(cluster, r, lambda ev, **d: emit(ev, **{"stream": name, **d}), stop)
            except FerryError as exc:
                emit("error", stream=name, error=str(exc))
                outcome: MoveOutcome = "refused" if isinstance(exc, PreflightFailed) else "failed"
                return MoveResult(stream=name, outcome=outcome, error=str(exc))

    return list(await asyncio.gather(*(one(n) for n in chosen)))


async def status(cluster: NatsCluster, stream: str) -> MoveRecord:
    """`ferry move --status STREAM`: the journaled state of the stream's last move."""
    async with bnats.session(cluster) as nc:
        state = await KvJournal(nc, f"move.{stream}").open(create=False)
    if state is None:
        raise NotFound(f"no move of {stream!r} on record")
    live = state.get("phase") not in ("done", "cancelled")
    return MoveRecord.model_validate({**state, "owner_alive": live and owner_alive(state)})


async def cancel(cluster: NatsCluster, stream: str) -> CancelAsked:
    """`ferry move --stop STREAM`: put a moving stream back where it was."""
    async with (
        bnats.session(cluster) as nc,
        bnats.session(cluster, system=True) as sysnc,
    ):
        info = await stream_info(nc, stream)
        account = await account_name(nc)
        where, driver = (info.get("cluster") or {}).get("name"), None
        with contextlib.suppress(Exception):  # who runs the move, if a ferry does: said, not needed
            record = await KvJournal(nc, f"move.{stream}").open(create=False) or {}
            if record.get("phase") not in (None, "done", "cancelled") and owner_alive(record):
                o = record.get("owner") or {}
                driver = f"ferry pid {o.get('pid')} on {o.get('host')}"
        try:
            await _cancel_request(sysnc, account, stream)
        except FerryError as exc:
            if exc.fields.get("err_code") == _MOVE_NOT_IN_PROGRESS:
                raise UsageError(
                    f"stream {stream!r} is not moving (its group is in {where}): nothing to stop"
                ) from None
            said = exc.fields.get("description") or exc
            raise OperationFailed(f"stream {stream!r}: the server refused to stop its move: {said}") from None
        return CancelAsked(stream=stream, cancelled=True, cluster=where, driven_by=driver)
