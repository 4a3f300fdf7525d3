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
from typing import Any

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
from ferry.jobs.partition.plan import last_seq, list_streams, patterns_of, plan, stage_subject, stored_count
from ferry.jobs.shared.events import Emit, no_emit
from ferry.jobs.shared.guard import Guard, check_listen, reconcile, state_root
from ferry.spark.session import SparkFactory, factory
from ferry.subjects import intersection
from ferry.topology import NatsCluster, Topology

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
        placed = any(part.cluster for part in pmap.partitions)
        p = await plan(nc, pmap, record, await _clusters(cluster, via) if placed else None)
        if dry_run:
            return {**p, "outcome": "dry-run"}
        if p["refusals"]:
            more = f" (and {len(p['refusals']) - 1} more)" if len(p["refusals"]) > 1 else ""
            raise Conflict(p["refusals"][0] + more)
        if p["pending"] and not force:
            by = (seen or {}).get("by") or {}
            raise PreflightFailed(
                f"a repartition of map {pmap.name!r} started by {by.get('host')} pid {by.get('pid')} at "
                f"{by.get('at')} did not finish; the old owners still hold every message it moved (nothing is "
                "purged before it is counted in the new owner), and the new owners may hold copies of some (with "
                "Ferry-Source headers): check the streams (`ferry partition plan`), then apply with --force"
            )
        emit("plan", **p)
        if p["moves"] and not execute:
            raise UsageError(
                f"map {pmap.name!r} changes the owner of {len(p['moves'])} pattern(s) holding "
                f"{p['messages_to_move']:,} stored messages ({_moves_text(p)}); review `ferry partition plan` "
                "and run apply again with --execute"
            )
        t0 = time.monotonic()
        kv = kv or await open_claims(nc)
        if p["moves"]:
            result = await _repartition(topo, via, nc, kv, pmap, p, seen, emit, state_dir, spark)
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
    topo: Topology, via: str, move: dict[str, Any], hi: int, emit: Emit, spark: SparkFactory | None
) -> tuple[int, int]:
    """The history of one moving pattern, copied by the data plane (a Spark job): rows, duplicates.
    Its progress is emitted as "copying" events (messages the new owner gained, about every 0.5 s)."""
    from urllib.parse import quote

    from ferry.jobs.copy.plan import CopyOptions, plan_copy
    from ferry.jobs.copy.run import run_copy

    src = f"jetstream://{via}/{move['from']}?subject={quote(move['pattern'])}&end_seq={hi}"
    opts = CopyOptions(mode="parallel", partitions=1, subject_prefix=stage_subject(move["to"]) + ".")
    copy_plan = plan_copy(topo, src, f"jetstream://{via}/{move['to']}", opts)
    session = (spark or factory(app_name=f"ferry partition {move['pattern']}", data_sources=False))()
    what = {k: move[k] for k in ("from", "to", "pattern")}
    report = run_copy(topo, copy_plan, session, lambda n: emit("copying", **what, messages=n, total=copy_plan.messages))
    return report.read, report.duplicates


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
) -> dict[str, Any]:
    cluster = topo.nats(via)
    cjson = cluster.model_dump_json()
    op_id = uuid.uuid4().hex[:12]
    moves = p["moves"]
    targets = sorted({m["to"] for m in moves})
    await check_listen(cluster, [m["pattern"] for m in moves])  # its guard refused later would leave copies
    streams = await list_streams(nc)

    def copied_as(m: dict[str, Any]) -> list[str]:
        """The subjects the copies of move `m` take in its new owner: its pattern where the old owner captures it."""
        return [x for q in patterns_of(streams[m["from"]]["config"]) if (x := intersection(m["pattern"], q))]

    for m in moves:  # what a new owner holds of them before the copy could not be told from the copies
        for x in copied_as(m) if m["to"] in streams else []:
            if held := await stored_count(nc, m["to"], x):
                raise PreflightFailed(
                    f"stream {m['to']} already holds {held:,} messages of {x}, which {m['from']} owns (copies left "
                    f"by an unfinished repartition?): purge them first (`nats stream purge {m['to']} --subject "
                    f"'{x}'`), then run the same command again"
                )
    claimed = await claim(kv, pmap, seen, pending=True)
    emit("claimed", map=pmap.name, pending=True)
    # 1. the new owners get a staging subject (created if missing)
    for t in targets:
        part = next(x for x in pmap.partitions if x.stream == t)
        s = streams.get(t)
        kept = patterns_of(s["config"]) if s else []
        await _put_stream(nc, _stream_config(part, s["config"] if s else None, kept, stage=True), s is not None)
    # 2. history through the data plane
    done: dict[int, int] = {}
    copied: dict[int, int] = defaultdict(int)
    dups: dict[int, int] = defaultdict(int)  # copies the new owner dropped as already held (same msg id)
    for i, m in enumerate(moves):
        hi = await last_seq(nc, m["from"])
        if await stored_count(nc, m["from"], m["pattern"]):
            rows, dup = await asyncio.to_thread(_spark_copy, topo, via, m, hi, emit, spark)
            copied[i] += rows
            dups[i] += dup
        done[i] = hi
        emit("copied", **{k: m[k] for k in ("from", "to", "pattern")}, messages=copied[i], up_to=hi)

    async def catch_up() -> int:
        n = 0
        for i, m in enumerate(moves):
            hi = await last_seq(nc, m["from"])
            got, dup = await _forward(cjson, via, m, done[i] + 1, hi)
            copied[i] += got
            dups[i] += dup
            done[i] = hi
            n += got
        return n

    # 3. catch up in process until little is left; the guard's comparison starts before it
    seq0 = {t: await last_seq(nc, t) for t in targets}
    for _ in range(5):
        t = time.monotonic()
        n = await catch_up()
        emit("caught-up", messages=n, seconds=round(time.monotonic() - t, 3))
        if n < 200:
            break

    async def unless_dropped() -> None:
        """A new owner that dropped copies as duplicates (its duplicate window still holds their
        msg ids: it held them itself a moment ago) would own the pattern without them: undo the
        staging before the switch, and say when to run the same command again (its --force too)."""
        dropped = [(m, dups[i]) for i, m in enumerate(moves) if dups[i]]
        if not dropped:
            return
        for t in targets:
            if t not in streams:
                await jsapi.api(nc, f"$JS.API.STREAM.DELETE.{t}", timeout=10)
                continue
            for x in [x for m in moves if m["to"] == t for x in copied_as(m)]:  # it held none before (checked)
                await jsapi.api(nc, f"$JS.API.STREAM.PURGE.{t}", {"filter": x}, timeout=10)
            await _put_stream(nc, streams[t]["config"], True)
        await unclaim(kv, pmap, claimed, seen)
        m, n = dropped[0]
        if m["to"] in streams:
            window = int(streams[m["to"]]["config"].get("duplicate_window", 0)) / 1e9
            why = f"its duplicate window ({window:g}s) still remembers their Nats-Msg-Id, or "
            at = time.strftime("%H:%M:%S UTC", time.gmtime(time.time() + window))
            after = f"; run the same command again after {at}"
        else:
            why, after = "", ""  # a new stream remembers nothing
        raise OperationFailed(
            f"{m['to']} dropped {n:,} of the copies of {m['pattern']} as duplicates: {why}{m['from']} holds "
            f"messages that share one. Undone: {m['from']} still owns {', '.join(copied_as(m))} and holds every "
            f"message{after}"
        )

    await unless_dropped()
    # 4. guard the moving patterns on each new owner, switch, forward the tail
    root = state_root(state_dir) / "partition" / f"{pmap.name}-{op_id}"
    guards, t_switch = {}, 0.0
    try:
        for t in targets:  # one refused (the user may not listen): the switch is not made
            guards[t] = Guard(
                cluster, [m["pattern"] for m in moves if m["to"] == t], root / t / f"capture-{os.getpid()}.arrow"
            )
            await guards[t].start()
        await catch_up()
        await unless_dropped()
        t_switch = time.monotonic()
        await _converge(nc, pmap, p, staged=frozenset(targets))
        switch_s = time.monotonic() - t_switch
        emit("switched", seconds=round(switch_s, 4), map=pmap.name)
        await catch_up()
    finally:
        for g in guards.values():
            await g.stop()
        if not t_switch:  # stopped before the switch: what the guards heard (payloads) serves nothing
            shutil.rmtree(root, ignore_errors=True)
    # 5. what the guard heard and the new owner lacks is re-published there
    guard_results = {}
    for t in targets:
        heard = await reconcile(cluster, nc, t, {"seq0": seq0[t], "move_id": op_id}, root / t, no_emit)
        # the guard's window compares with the new owner only; the subjects had no owner for switch_s
        guard_results[t] = {k: v for k, v in heard.items() if k != "unavailable_s"}
        emit("guard", stream=t, **guard_results[t])
    # 6. purge what moved from the old owners, once every message is counted in the new one
    purged = 0
    for i, m in enumerate(moves):
        left = await stored_count(nc, m["from"], m["pattern"])
        if left != copied[i] or dups[i]:
            raise OperationFailed(
                f"{m['from']} holds {left:,} messages of {m['pattern']}; {copied[i]:,} were copied to {m['to']}, "
                f"{dups[i]:,} of them dropped there as duplicates (same Nats-Msg-Id); "
                f"nothing was purged (the copies carry Ferry-Source headers); the claim of map {pmap.name!r} "
                "stays pending"
            )
        if left:
            r = await jsapi.api(
                nc, f"$JS.API.STREAM.PURGE.{m['from']}", {"filter": m["pattern"], "seq": done[i] + 1}, timeout=10
            )
            purged += int(r.get("purged", 0))
    emit("purged", messages=purged)
    shutil.rmtree(root, ignore_errors=True)  # every guard reconciled: the captures have served
    # 7. staging off, claims final
    await _converge(nc, pmap, p)
    await claim(kv, pmap, {"map": (seen or {}).get("map"), "pending": pmap.model_dump()})
    return {
        "op_id": op_id,
        "copied": sum(copied.values()),
        "purged": purged,
        "switch_s": round(switch_s, 4),
        "guard": guard_results,
        "reinjected": sum(g["reinjected"] for g in guard_results.values()),
    }
