"""What applying a map would change: streams created, updated or retired, patterns changing
owner and the stored messages that move with them; refusals before anything changes."""

from __future__ import annotations

import contextlib
from typing import Any

from nats.aio.client import Client

from ferry.brokers.nats import jsapi, while_electing
from ferry.headers import SOURCE_HDR, SOURCE_SEQ_HDR
from ferry.jobs.partition.claims import claimed_maps, foreign_conflicts
from ferry.jobs.partition.map import PartitionMap
from ferry.subjects import SubjectIndex, overlap_witness, problem

# -- planning ----------------------------------------------------------------------------------------


def stage_subject(stream: str) -> str:
    return f"ferry.stage.{stream}"


async def last_seq(nc: Client, stream: str) -> int:
    return (await jsapi.stream_info(nc, stream))["state"]["last_seq"]


async def list_streams(nc: Client) -> dict[str, dict[str, Any]]:
    """name -> {config, cluster, messages} of every stream in the account."""
    out = {}
    async for info in jsapi.paged(nc, "$JS.API.STREAM.LIST", "streams", lambda n: jsapi.stream_info(nc, n, timeout=10)):
        out[info["config"]["name"]] = {
            "config": info["config"],
            "cluster": (info.get("cluster") or {}).get("name"),
            "messages": info["state"]["messages"],
        }
    return out


async def stored_count(nc: Client, stream: str, pattern: str) -> int:
    """Messages of `stream` matching `pattern` (an ephemeral filtered consumer's pending count)."""
    from nats.js.api import AckPolicy, ConsumerConfig

    jsm = nc.jsm()
    cfg = ConsumerConfig(filter_subject=pattern, ack_policy=AckPolicy.NONE, mem_storage=True, inactive_threshold=30.0)
    info = await while_electing(lambda: jsm.add_consumer(stream, cfg))
    with contextlib.suppress(Exception):
        await jsm.delete_consumer(stream, info.name)
    return info.num_pending


async def copies_of(
    nc: Client, stream: str, subjects: list[str], source: str, *, after: int = 0, last: bool = False
) -> list[int]:
    """The source sequences of `stream`'s copies of `source` (``via/STREAM``, their Ferry-Source
    header) on `subjects`, stored after sequence `after` (`last`: only the last message on
    `subjects`), in order; read headers only, on one ephemeral consumer."""
    if not subjects:
        return []
    # read again while JetStream answers 503 (no responders: seen right after a switch and after a
    # killed run's connection went): the read changes nothing
    return await while_electing(lambda: _copies_of(nc, stream, subjects, source, after, last))


async def _copies_of(nc: Client, stream: str, subjects: list[str], source: str, after: int, last: bool) -> list[int]:
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    jsm = nc.jsm()
    where = (
        {"deliver_policy": DeliverPolicy.LAST}
        if last
        else {
            "deliver_policy": DeliverPolicy.BY_START_SEQUENCE,
            "opt_start_seq": after + 1,
        }
    )
    cfg = ConsumerConfig(
        filter_subjects=subjects, ack_policy=AckPolicy.NONE, headers_only=True, mem_storage=True,
        inactive_threshold=30.0, **where,
    )  # fmt: skip
    info = await jsm.add_consumer(stream, cfg)
    seqs, left = [], min(info.num_pending, 1) if last else info.num_pending
    try:
        sub = await nc.jetstream().pull_subscribe_bind(info.name, stream)
        while left > 0:
            for m in await sub.fetch(min(left, 1000), timeout=10):
                left -= 1
                headers = m.headers or {}
                if headers.get(SOURCE_HDR) == source and SOURCE_SEQ_HDR in headers:
                    seqs.append(int(headers[SOURCE_SEQ_HDR]))
        await sub.unsubscribe()
    finally:
        with contextlib.suppress(Exception):
            await jsm.delete_consumer(stream, info.name)
    return seqs


def patterns_of(config: dict[str, Any]) -> list[str]:
    return [s for s in config.get("subjects") or [] if not s.startswith("ferry.stage.")]


async def plan(
    nc: Client, pmap: PartitionMap, record: dict[str, Any], clusters: set[str] | None = None
) -> dict[str, Any]:
    """What applying `pmap` would change, and what refuses it (nothing changed)."""
    mine = record["maps"].get(pmap.name) or {}
    prev = PartitionMap.model_validate(mine["map"]) if mine.get("map") else None
    streams = await list_streams(nc)
    ours = {p.stream for p in pmap.partitions} | {p.stream for p in (prev.partitions if prev else [])}
    refusals = foreign_conflicts(record, pmap)
    if clusters is not None:  # the super-cluster's, when its system account answers
        known = ", ".join(sorted(clusters))
        refusals += [
            f"partition {part.name!r} is placed in cluster {part.cluster!r}, which the super-cluster does not "
            f"have (known: {known})"
            for part in pmap.partitions
            if part.cluster and part.cluster not in clusters
        ]
    index = pmap.index()
    # streams outside the map (and outside every claim) may not capture our subjects
    claimed_elsewhere = {
        p.stream
        for m in claimed_maps({"maps": {k: v for k, v in record["maps"].items() if k != pmap.name}})
        for p in m.partitions
    }
    for name, s in sorted(streams.items()):
        if name in ours or name in claimed_elsewhere:
            continue
        for subj in s["config"].get("subjects") or []:
            if problem(subj):  # the server would not have taken it
                continue
            for part, p in index.overlapping(subj):
                refusals.append(
                    f"pattern {p!r} of partition {part.name!r} overlaps subject {subj!r} of stream {name!r}, "
                    f"which is not a partition of map {pmap.name!r}; both would own {overlap_witness(p, subj)!r}"
                )
    # who captures what now, among our streams
    current: SubjectIndex[tuple[str, str]] = SubjectIndex(
        (q, (name, q)) for name in sorted(ours & set(streams)) for q in patterns_of(streams[name]["config"])
    )
    creates, updates, moves, retire = [], [], [], []
    for part in pmap.partitions:
        s = streams.get(part.stream)
        if s is None:
            creates.append({"partition": part.name, "stream": part.stream, "patterns": part.patterns})
        else:
            if part.cluster and s["cluster"] and s["cluster"] != part.cluster:
                refusals.append(
                    f"stream {part.stream!r} is in cluster {s['cluster']!r} but the map places partition "
                    f"{part.name!r} in {part.cluster!r}; move it first: ferry move {part.stream} --to {part.cluster}"
                )
            cfg = s["config"]
            if cfg.get("subject_transform") and not any(x.startswith("ferry.stage.") for x in cfg.get("subjects", [])):
                refusals.append(f"stream {part.stream!r} has a subject transform; ferry cannot stage a copy into it")
            before = patterns_of(cfg)
            if sorted(before) != sorted(part.patterns) or int(cfg.get("num_replicas", 1)) != part.replicas:
                updates.append(
                    {"partition": part.name, "stream": part.stream, "from": before, "to": part.patterns}
                    | ({"replicas": part.replicas} if int(cfg.get("num_replicas", 1)) != part.replicas else {})
                )
        for p in part.patterns:
            for owner in sorted({o for o, _ in current.overlapping(p)}):
                if owner != part.stream:
                    moves.append(
                        {
                            "from": owner,
                            "to": part.stream,
                            "pattern": p,
                            "messages": await stored_count(nc, owner, p),
                        }
                    )
    for name in sorted(ours - {p.stream for p in pmap.partitions}):
        if name in streams:
            keep = [q for q in patterns_of(streams[name]["config"]) if not index.overlapping(q)]
            retire.append(
                {"stream": name, "keeps": keep or [f"ferry.retired.{name}"], "messages": streams[name]["messages"]}
            )
    return {
        "map": pmap.name,
        "previous": bool(prev),
        "pending": mine.get("pending") is not None,
        "create": creates,
        "update": updates,
        "moves": moves,
        "retire": retire,
        "messages_to_move": sum(m["messages"] for m in moves),
        "refusals": refusals,
    }
