"""Applying a map: claim, converge the streams, and (``--execute``) repartition: the moving
subjects' history copied by the data plane, the switch under the capture guard, the tail forwarded,
the old owners purged only once the new ones hold every moved message."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal

from nats.aio.client import Client

from ferry.brokers import nats as bnats
from ferry.brokers.nats import jsapi
from ferry.errors import (
    Conflict,
    FerryError,
    NotFound,
    OperationFailed,
    PreflightFailed,
    UsageError,
)
from ferry.jobs.partition.claims import claim, open_claims, read_record, unclaim
from ferry.jobs.partition.map import Partition, PartitionMap, require_valid
from ferry.jobs.partition.plan import (
    copies_of,
    last_seq,
    list_streams,
    patterns_of,
    plan,
    stage_subject,
    stored_count,
)
from ferry.jobs.shared.events import Emit, no_emit
from ferry.jobs.shared.guard import Guard, check_listen, reconcile, state_root
from ferry.jobs.shared.states import Machine
from ferry.journal import KvJournal
from ferry.spark.session import SparkFactory, factory
from ferry.subjects import intersection
from ferry.topology import NatsCluster, Topology

RepartitionPhase = Literal["copying", "switching", "switched", "done"]
REPARTITION = Machine[RepartitionPhase](
    "repartition",
    {
        None: {"copying"},
        "done": {"copying"},  # the map's next repartition
        "copying": {"switching"},
        "switching": {"switched"},
        "switched": {"done"},
    },
)

# -- applying ----------------------------------------------------------------------------------------


def _stream_config(part: Partition, existing: dict[str, Any] | None, subjects: list[str], stage: bool) -> dict:
    cfg = dict(existing or {"name": part.stream, "storage": "file", "retention": "limits", "discard": "old"})
    cfg["subjects"] = subjects + ([f"{stage_subject(part.stream)}.>"] if stage else [])
    cfg["num_replicas"] = part.replicas
    if part.cluster and not existing:
        cfg["placement"] = {"cluster": part.cluster}
    if stage:
        cfg["subject_transform"] = {"src": f"{stage_subject(part.stream)}.>", "dest": ">"}
    else:
        cfg.pop("subject_transform", None)
    return cfg


async def _put_stream(nc: Client, cfg: dict[str, Any], exists: bool) -> None:
    verb = "UPDATE" if exists else "CREATE"
    await jsapi.api(nc, f"$JS.API.STREAM.{verb}.{cfg['name']}", cfg, timeout=10)


async def _converge(
    nc: Client,
    pmap: PartitionMap,
    p: dict[str, Any],
    staged: frozenset[str] = frozenset(),
    changed: list[str] | None = None,
) -> None:
    """Give every stream its planned subjects. Subjects another stream takes over are removed
    first (JetStream refuses overlapping streams), then every partition gets its patterns in
    one update (`staged` streams keep their staging subject). Each change made is added to
    `changed` ("created S", "updated S"), for an error part-way to name."""
    changed = [] if changed is None else changed

    async def put(cfg: dict[str, Any], update: bool) -> None:
        await _put_stream(nc, cfg, update)
        if (done := f"{'updated' if update else 'created'} {cfg['name']}") not in changed:
            changed.append(done)

    streams = await list_streams(nc)
    index = pmap.index()
    for r in p["retire"]:
        if r["stream"] in streams:
            await put(dict(streams[r["stream"]]["config"], subjects=r["keeps"]), True)
    for part in pmap.partitions:
        s = streams.get(part.stream)
        if not s:
            continue
        old = patterns_of(s["config"])
        keep = [q for q in old if all(o.stream == part.stream for o, _ in index.overlapping(q))]
        if keep != old:  # a stream needs a subject: the staging one stands in when none is left
            await put(_stream_config(part, s["config"], keep, stage=part.stream in staged or not keep), True)
    streams = await list_streams(nc)
    for part in pmap.partitions:
        s = streams.get(part.stream)
        cfg = _stream_config(part, s["config"] if s else None, part.patterns, stage=part.stream in staged)
        if s is None or any(
            cfg.get(k) != s["config"].get(k) for k in ("subjects", "num_replicas", "subject_transform")
        ):
            await put(cfg, s is not None)


async def _verify(nc: Client, pmap: PartitionMap) -> list[str]:
    """Each partition's stream captures exactly its patterns (and exists, with its replicas)."""
    streams = await list_streams(nc)
    out = []
    for part in pmap.partitions:
        s = streams.get(part.stream)
        if s is None:  # CI saw a list just after the stream's creation leave it out, not even as missing
            with contextlib.suppress(NotFound):
                s = {"config": (await jsapi.stream_info(nc, part.stream, timeout=10))["config"]}
        if s is None:
            out.append(f"stream {part.stream} is missing")
        elif sorted(s["config"].get("subjects") or []) != sorted(part.patterns):
            out.append(f"stream {part.stream} captures {s['config'].get('subjects')}, not {part.patterns}")
        elif int(s["config"].get("num_replicas", 1)) != part.replicas:
            out.append(f"stream {part.stream} has {s['config'].get('num_replicas')} replicas, not {part.replicas}")
    # a stream that still holds messages of subjects another partition owns: held twice (or not by their owner)
    for part in pmap.partitions:
        for other in pmap.partitions if part.stream in streams else []:
            for q in other.patterns if other is not part else []:
                if n := await stored_count(nc, part.stream, q):
                    out.append(f"stream {part.stream} still holds {n:,} messages of {q}, which {other.stream} owns")
    return out


async def _clusters(cluster: NatsCluster, via: str) -> set[str] | None:
    """The super-cluster's cluster names, from its system account (None: it does not answer)."""
    try:
        async with bnats.session(cluster, name=via, system=True, client_name="ferry-partition-sys") as sysnc:
            return (await jsapi.survey(sysnc)).clusters()
    except (FerryError, OSError, TimeoutError):
        return None


async def apply(
    topo: Topology,
    via: str,
    pmap: PartitionMap,
    *,
    execute: bool = False,
    dry_run: bool = False,
    force: bool = False,
    emit: Emit = no_emit,
    state_dir: Path | None = None,
    spark: SparkFactory | None = None,
) -> dict[str, Any]:
    """Claim `pmap` and make the streams match it; a repartition needs `execute` (its history is
    copied by a Spark job, started by `spark`; default: where ``$FERRY_SPARK_*`` say)."""
    require_valid(pmap)
    cluster = topo.nats(via)
    async with bnats.session(cluster, name=via, client_name="ferry-partition") as nc:
        kv = await open_claims(nc, create=False)
        record, _ = await read_record(kv) if kv else ({"maps": {}}, 0)
        seen = record["maps"].get(pmap.name)
        journal = KvJournal(nc, f"partition.{pmap.name}", replicas=min(3, len(cluster.brokers)))
        prior = await journal.open(create=not dry_run)
        unfinished = prior if prior and prior.get("phase") not in (None, "done") else None
        if unfinished:
            _may_resume(pmap, unfinished, journal)
        placed = any(part.cluster for part in pmap.partitions)
        p = await plan(nc, pmap, record, await _clusters(cluster, via) if placed else None)
        if unfinished:  # its moves, from its journal: the plan sees the owners as they are now
            p["unfinished"] = {k: unfinished.get(k) for k in ("phase", "op_id", "moves", "started")}
        if dry_run:
            return {**p, "outcome": "dry-run"}
        if p["refusals"] and not unfinished:
            more = f" (and {len(p['refusals']) - 1} more)" if len(p["refusals"]) > 1 else ""
            raise Conflict(p["refusals"][0] + more)
        if p["pending"] and not unfinished and not force:
            by = (seen or {}).get("by") or {}
            raise PreflightFailed(
                f"a repartition of map {pmap.name!r} started by {by.get('host')} pid {by.get('pid')} at "
                f"{by.get('at')} did not finish and left no journal to resume it from (an older ferry?); the old "
                "owners still hold every message it moved (nothing is purged before it is counted in the new owner), "
                "and the new owners may hold copies of some (with Ferry-Source headers): check the streams "
                "(`ferry partition plan`), then apply with --force"
            )
        emit("plan", **p)
        if unfinished and not execute:
            raise UsageError(
                f"a repartition of map {pmap.name!r} did not finish (phase {unfinished['phase']}: "
                f"{_moves_text(unfinished)}); run the same command with --execute to finish it"
            )
        if p["moves"] and not execute:
            raise UsageError(
                f"map {pmap.name!r} changes the owner of {len(p['moves'])} pattern(s) holding "
                f"{p['messages_to_move']:,} stored messages ({_moves_text(p)}); review `ferry partition plan` "
                "and run apply again with --execute"
            )
        t0 = time.monotonic()
        kv = kv or await open_claims(nc)
        if p["moves"] or unfinished:
            beat = asyncio.create_task(_heartbeat(journal))
            try:
                result = await _repartition(
                    topo, via, nc, kv, pmap, p, seen, emit, state_dir, spark, journal, unfinished
                )
            finally:
                beat.cancel()
        else:
            claimed = await claim(kv, pmap, seen)
            emit("claimed", map=pmap.name)
            changed: list[str] = []
            try:
                await _converge(nc, pmap, p, changed=changed)
            except FerryError as exc:  # a stream the server would not make (too many replicas): no claim stays
                await unclaim(kv, pmap, claimed, seen)
                made = (
                    f"; done before that, and kept: {', '.join(changed)} (a corrected map applied again takes "
                    f"{'them' if len(changed) > 1 else 'it'} over)"
                    if changed
                    else ""
                )
                raise OperationFailed(f"map {pmap.name!r} not applied, its claim withdrawn: {exc}{made}") from None
            result = {}
        problems = await _verify(nc, pmap)
        if problems:
            raise OperationFailed(f"map {pmap.name!r} applied but " + "; ".join(problems))
        result = {**p, **result, "outcome": "applied", "took_s": round(time.monotonic() - t0, 3)}
        emit("done", **result)
        return result


def _may_resume(pmap: PartitionMap, st: dict[str, Any], journal: KvJournal) -> None:
    """Refuse to resume a repartition another ferry drives, or with another map than it started with."""
    if journal.owner_alive(st):
        o = st.get("owner") or {}
        who = f"pid {o.get('pid')} on {o.get('host')}"
        raise Conflict(f"a repartition of map {pmap.name!r} is running ({who}, phase {st['phase']})")
    if st.get("target_map") != pmap.model_dump():
        raise PreflightFailed(
            f"a repartition of map {pmap.name!r} to another map did not finish (phase {st['phase']}: "
            f"{_moves_text(st)}); apply that map with --execute to finish it first"
        )


async def _heartbeat(journal: KvJournal, every: float = 2.0) -> None:
    """The journal's heartbeat while a repartition runs (its Spark copy takes minutes)."""
    while True:
        await asyncio.sleep(every)
        if journal.state.get("phase"):  # once the repartition is on record
            journal.save_soon()


def _moves_text(p: dict[str, Any]) -> str:
    return ", ".join(f"{m['pattern']} {m['from']}->{m['to']}" for m in p["moves"][:3]) + (
        ", ..." if len(p["moves"]) > 3 else ""
    )


# -- repartition -------------------------------------------------------------------------------------


async def _forward(cluster_json: str, via: str, move: dict[str, Any], lo: int, hi: int) -> tuple[int, int]:
    """Copy `move['from']`'s messages matching its pattern with lo <= seq <= hi into the new owner's staging subject."""
    from ferry.brokers.nats.reader import Range, ReadConfig, read_rows
    from ferry.brokers.nats.writer import WriteConfig, write_rows

    if hi < lo:
        return 0, 0
    read = ReadConfig(cluster=cluster_json, name=via, streams=(move["from"],), subject=move["pattern"])
    write = WriteConfig(
        cluster=cluster_json, name=via, stream=move["to"], subject_prefix=stage_subject(move["to"]) + "."
    )
    counts = await write_rows(write, read_rows(read, Range(move["from"], lo, hi, fetch=2000)))
    return counts.rows, counts.duplicates


def _spark_copy(
    topo: Topology, via: str, move: dict[str, Any], start: int, hi: int, emit: Emit, spark: SparkFactory | None
) -> int:
    """The history of one moving pattern from sequence `start` to `hi`, copied by the data plane (a
    Spark job); the copies the new owner dropped as duplicates. Its progress is emitted as
    "copying" events (messages the new owner gained, about every 0.5 s)."""
    from urllib.parse import quote

    from ferry.jobs.copy.plan import CopyOptions, plan_copy
    from ferry.jobs.copy.run import run_copy

    src = f"jetstream://{via}/{move['from']}?subject={quote(move['pattern'])}&start_seq={start}&end_seq={hi}"
    opts = CopyOptions(mode="parallel", partitions=1, subject_prefix=stage_subject(move["to"]) + ".")
    copy_plan = plan_copy(topo, src, f"jetstream://{via}/{move['to']}", opts)
    session = (spark or factory(app_name=f"ferry partition {move['pattern']}", data_sources=False))()
    what = {k: move[k] for k in ("from", "to", "pattern")}
    report = run_copy(topo, copy_plan, session, lambda n: emit("copying", **what, messages=n, total=copy_plan.messages))
    return report.duplicates


def _copied_as(streams: dict[str, Any], m: dict[str, Any]) -> list[str]:
    """The subjects the copies of move `m` take in its new owner: its pattern where the old owner captures it."""
    return [x for q in patterns_of(streams[m["from"]]["config"]) if (x := intersection(m["pattern"], q))]


async def _switched(nc: Client, st: dict[str, Any]) -> bool:
    """Whether the owners were switched: every new owner captures its moving patterns."""
    streams = await list_streams(nc)
    return all(m["pattern"] in patterns_of((streams.get(m["to"]) or {"config": {}})["config"]) for m in st["moves"])


async def _repartition(
    topo: Topology,
    via: str,
    nc: Client,
    kv: Any,
    pmap: PartitionMap,
    p: dict[str, Any],
    seen: dict[str, Any] | None,
    emit: Emit,
    state_dir: Path | None,
    spark: SparkFactory | None,
    journal: KvJournal,
    prior: dict[str, Any] | None,
) -> dict[str, Any]:
    """The repartition, journaled in ``ferry_ops`` (``partition.<map>``) phase by phase, so that a
    rerun of the same command resumes it: **copying** (staging, history, catch-up; the new owners'
    copies tell how far it got), **switching** (guards, the switch; what the new owners held of
    the copies just before it is journaled first), **switched** (the tail forwarded as far as the
    new owners lack it, the captures reconciled, the old owners purged once every moved message is
    counted in its new owner), **done**."""
    cluster = topo.nats(via)
    cjson = cluster.model_dump_json()
    if prior is None:
        moves = p["moves"]
        await check_listen(cluster, [m["pattern"] for m in moves])  # its guard refused later would leave copies
        streams = await list_streams(nc)
        for m in moves:  # what a new owner holds of them before the copy could not be told from the copies
            for x in _copied_as(streams, m) if m["to"] in streams else []:
                if held := await stored_count(nc, m["to"], x):
                    raise PreflightFailed(
                        f"stream {m['to']} already holds {held:,} messages of {x}, which {m['from']} owns (copies left "
                        f"by an unfinished repartition?): purge them first (`nats stream purge {m['to']} --subject "
                        f"'{x}'`), then run the same command again"
                    )
        op_id = uuid.uuid4().hex[:12]
        targets = sorted({m["to"] for m in moves})
        journal.state = {
            "kind": "partition",
            "map": pmap.name,
            "target_map": pmap.model_dump(),
            "op_id": op_id,
            "moves": moves,
            "targets": targets,
            "copied_as": {str(i): _copied_as(streams, m) for i, m in enumerate(moves)},
            "before": {t: (streams[t]["config"] if t in streams else None) for t in targets},
            "seen": seen,  # the map's claim before: what an undo puts back
            "capture_dir": str(state_root(state_dir) / "partition" / f"{pmap.name}-{op_id}"),
            "started": time.time(),
        }
        # journaled before the claim: a claim left pending always has a journal to resume from
        await journal.save(phase=REPARTITION.step(None, "copying"))
    else:
        journal.state = dict(prior)
        await journal.save()  # claimed by compare-and-set: of two reruns at once, one stops here
        emit("resume", phase=prior["phase"], op_id=prior["op_id"], map=pmap.name)
    st = journal.state
    st["claimed"] = await claim(kv, pmap, seen, pending=True)  # as it is now: pending already, on a resume
    emit("claimed", map=pmap.name, pending=True)
    unguarded = None
    if prior and prior["phase"] != "copying" and prior.get("heartbeat"):
        # the guards of the run before listened until about its last heartbeat; this run's from now on
        unguarded = round(max(0.0, time.time() - float(prior["heartbeat"])), 1)
        emit(
            "unguarded",
            seconds=unguarded,
            note=f"no guard listened for about {unguarded:.1f}s before this run: core (fire-and-forget) publishes "
            "then are not covered where the subjects had no owner (JetStream publishes with retries are)",
        )
    moves, targets, op_id = st["moves"], st["targets"], st["op_id"]
    source = {i: f"{via}/{m['from']}" for i, m in enumerate(moves)}  # their copies' Ferry-Source
    xs = {i: st["copied_as"][str(i)] for i in range(len(moves))}
    root = Path(st["capture_dir"])
    done: dict[int, int] = {int(k): v for k, v in (st.get("done") or {}).items()}
    dups: dict[int, int] = defaultdict(int)  # copies a new owner dropped as already held (same msg id), this run

    async def held_up_to(i: int) -> int:
        """Before the switch, the last source sequence the new owner holds a copy of (its only messages there)."""
        return max(await copies_of(nc, moves[i]["to"], xs[i], source[i], last=True), default=0)

    async def forward(i: int, lo: int) -> int:
        hi = await last_seq(nc, moves[i]["from"])
        got, dup = await _forward(cjson, via, moves[i], lo, hi)
        dups[i] += dup
        done[i] = hi
        return got

    async def catch_up() -> int:
        return sum([await forward(i, done[i] + 1) for i in range(len(moves))])

    async def unless_dropped() -> None:
        """A new owner that dropped copies as duplicates (its duplicate window still holds their
        msg ids: it held them itself a moment ago) would own the pattern without them: undo the
        staging before the switch, and say when to run the same command again (its --force too)."""
        dropped = [i for i in range(len(moves)) if dups[i]]
        if not dropped:
            return
        for t in targets:
            if st["before"][t] is None:
                await jsapi.api(nc, f"$JS.API.STREAM.DELETE.{t}", timeout=10)
                continue
            for x in [x for i, m in enumerate(moves) if m["to"] == t for x in xs[i]]:  # it held none before (checked)
                await jsapi.api(nc, f"$JS.API.STREAM.PURGE.{t}", {"filter": x}, timeout=10)
            await _put_stream(nc, st["before"][t], True)
        await unclaim(kv, pmap, st["claimed"], st["seen"])
        await journal.delete()  # last: a journal whose claim was withdrawn claims again when resumed
        journal.state = {}  # no heartbeat writes it again
        shutil.rmtree(root, ignore_errors=True)
        first = dropped[0]
        m, n = moves[first], dups[first]
        before = st["before"][m["to"]]
        if before is not None:
            window = int(before.get("duplicate_window", 0)) / 1e9
            why = f"its duplicate window ({window:g}s) still remembers their Nats-Msg-Id, or "
            at = time.strftime("%H:%M:%S UTC", time.gmtime(time.time() + window))
            after = f"; run the same command again after {at}"
        else:
            why, after = "", ""  # a new stream remembers nothing
        raise OperationFailed(
            f"{m['to']} dropped {n:,} of the copies of {m['pattern']} as duplicates: {why}{m['from']} holds "
            f"messages that share one. Undone: {m['from']} still owns {', '.join(xs[first])} and holds every "
            f"message{after}"
        )

    # 1. copying: the new owners get a staging subject (created if missing); the history goes through
    # the data plane from where the new owner's copies end; an in-process copy catches up
    if st["phase"] == "copying":
        streams = await list_streams(nc)
        for t in targets:
            part = next(x for x in pmap.partitions if x.stream == t)
            s = streams.get(t)
            kept = patterns_of(s["config"]) if s else []
            await _put_stream(nc, _stream_config(part, s["config"] if s else None, kept, stage=True), s is not None)
        for i, m in enumerate(moves):
            start = await held_up_to(i) + 1 if prior else 1
            hi = await last_seq(nc, m["from"])
            if start <= hi and await stored_count(nc, m["from"], m["pattern"]):
                dups[i] += await asyncio.to_thread(_spark_copy, topo, via, m, start, hi, emit, spark)
            done[i] = hi
            emit("copied", **{k: m[k] for k in ("from", "to", "pattern")}, messages=await _held(nc, m, xs[i]), up_to=hi)
        await journal.save(done=done)
        for _ in range(5):
            t0 = time.monotonic()
            n = await catch_up()
            emit("caught-up", messages=n, seconds=round(time.monotonic() - t0, 3))
            if n < 200:
                break
        await unless_dropped()
        # the guard's comparison starts here: the new owners' messages from now on
        seq0 = {t: await last_seq(nc, t) for t in targets}
        await journal.save(phase=REPARTITION.step(st["phase"], "switching"), seq0=seq0, done=done)
    # 2. switching: guard the moving patterns on each new owner, switch
    guards: dict[str, Guard] = {}
    try:
        if st["phase"] == "switching" and not await _switched(nc, st):
            if prior and prior["phase"] == "switching":  # the copies a killed run made since its last save
                for i in range(len(moves)):
                    done[i] = max(done[i], await held_up_to(i))
            for t in targets:  # one refused (the user may not listen): the switch is not made
                subjects = [m["pattern"] for m in moves if m["to"] == t]
                guards[t] = Guard(cluster, subjects, root / t / f"capture-{os.getpid()}-{int(time.time())}.arrow")
                await guards[t].start()
            await catch_up()
            await unless_dropped()
            # what each new owner holds of its copies just before the switch: the count the purge checks
            at_switch = {str(i): {"copies": await _held(nc, m, xs[i]), "done": done[i]} for i, m in enumerate(moves)}
            seq_switch = {t: await last_seq(nc, t) for t in targets}
            await journal.save(at_switch=at_switch, seq_switch=seq_switch, done=done)
            t_switch = time.monotonic()
            await _converge(nc, pmap, p, staged=frozenset(targets))
            emit("switched", seconds=round(time.monotonic() - t_switch, 4), map=pmap.name)
        if st["phase"] == "switching":
            await journal.save(phase=REPARTITION.step(st["phase"], "switched"))
        # 3. switched: the tail the old owners stored until the switch, as far as the new owners lack it
        counted = {}
        for i, m in enumerate(moves):
            was = st["at_switch"][str(i)]
            after = await copies_of(nc, m["to"], xs[i], source[i], after=st["seq_switch"][m["to"]])
            await forward(i, max([was["done"], *after]) + 1)
            tail = await copies_of(nc, m["to"], xs[i], source[i], after=st["seq_switch"][m["to"]])
            counted[i] = was["copies"] + len(set(tail))
            if len(tail) != len(set(tail)):
                raise OperationFailed(f"{m['to']} holds a copy of a message of {m['from']} twice (seq {tail})")
    finally:
        for g in guards.values():
            await g.stop()
    await journal.save(done=done)
    # 4. what the guards heard and the new owner lacks is re-published there
    guard_results = {}
    for t in targets:
        heard = await reconcile(cluster, nc, t, {"seq0": st["seq0"][t], "move_id": op_id}, root / t, no_emit)
        # the guard's window compares with the new owner only; the subjects had no owner for the switch
        guard_results[t] = {k: v for k, v in heard.items() if k != "unavailable_s"}
        emit("guard", stream=t, **guard_results[t])
    # 5. purge what moved from the old owners, once every message is counted in the new one
    purged = 0
    for i, m in enumerate(moves):
        left = await stored_count(nc, m["from"], m["pattern"])
        if left == 0:  # nothing left to purge (purged by a run killed after it)
            continue
        if left != counted[i]:
            raise OperationFailed(
                f"{m['from']} holds {left:,} messages of {m['pattern']}; {m['to']} holds copies of "
                f"{counted[i]:,} of them; nothing was purged (the copies carry Ferry-Source headers); the "
                f"repartition of map {pmap.name!r} stays on record: run the same command again to retry"
            )
        r = await jsapi.api(
            nc, f"$JS.API.STREAM.PURGE.{m['from']}", {"filter": m["pattern"], "seq": done[i] + 1}, timeout=10
        )
        purged += int(r.get("purged", 0))
    emit("purged", messages=purged)
    # 6. staging off, claims final
    await _converge(nc, pmap, p)
    await claim(kv, pmap, {"map": (st["seen"] or {}).get("map"), "pending": pmap.model_dump()})
    result = {
        "op_id": op_id,
        "copied": sum(counted.values()),
        "purged": purged,
        "guard": guard_results,
        "reinjected": sum(g["reinjected"] for g in guard_results.values()),
        "resumed": prior is not None,
        **({"unguarded_s": unguarded} if unguarded is not None else {}),
    }
    await journal.save(phase=REPARTITION.step(st["phase"], "done"), result=result)
    shutil.rmtree(root, ignore_errors=True)  # every guard reconciled: the captures have served
    return result


async def _held(nc: Client, m: dict[str, Any], xs: list[str]) -> int:
    """The messages of `m`'s new owner on the subjects its copies take (before the switch: copies only)."""
    return sum([await stored_count(nc, m["to"], x) for x in xs])
