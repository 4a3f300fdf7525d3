"""Ownership of subjects, cluster-wide: the claims record in the KV bucket ``ferry_partitions``
(key ``claims``), one JSON record for every map, written only by compare-and-set on its revision.
A claim re-reads the record after every lost race and checks its patterns against every other
map's (claimed and pending) patterns, so two claims of overlapping subjects cannot both succeed."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from typing import Any

from nats.aio.client import Client
from pydantic import ValidationError

from ferry.errors import (
    ConfigError,
    Conflict,
)
from ferry.jobs.partition.map import Partition, PartitionMap
from ferry.journal import open_bucket
from ferry.subjects import SubjectIndex, overlap_witness

BUCKET = "ferry_partitions"
KEY = "claims"


# -- the claims record -------------------------------------------------------------------------------


async def open_claims(nc: Client, create: bool = True) -> Any:
    """The claims bucket (R3, ten revisions kept), through the journal's one bucket opener."""
    return await open_bucket(nc, BUCKET, replicas=3, history=10, create=create)


async def read_record(kv: Any) -> tuple[dict[str, Any], int]:
    from nats.js.errors import KeyNotFoundError

    try:
        entry = await kv.get(KEY)
    except KeyNotFoundError:
        return {"maps": {}}, 0
    try:
        record = json.loads(entry.value) if entry.value else {"maps": {}}
        for m in record["maps"].values():
            PartitionMap.model_validate(m.get("pending") or m["map"])
    except (ValueError, KeyError, TypeError, ValidationError) as exc:
        raise ConfigError(f"the claims record {BUCKET}/{KEY} is not ferry's ({type(exc).__name__})") from None
    return record, entry.revision


async def read_claims(nc: Client) -> dict[str, Any]:
    kv = await open_claims(nc, create=False)
    return (await read_record(kv))[0] if kv else {"maps": {}}


def claimed_maps(record: dict[str, Any]) -> list[PartitionMap]:
    """Every map as currently applied (a repartition in progress has not changed owners yet)."""
    return [PartitionMap.model_validate(e["map"]) for e in record["maps"].values() if e.get("map")]


def foreign_conflicts(record: dict[str, Any], pmap: PartitionMap) -> list[str]:
    """Our patterns and streams that another map claims (or has pending), one line each."""
    index: SubjectIndex[tuple[str, dict, Partition, str]] = SubjectIndex()
    streams: dict[str, tuple[str, dict, Partition]] = {}
    for name, entry in record["maps"].items():
        if name == pmap.name:
            continue
        for key in ("map", "pending"):
            for part in PartitionMap.model_validate(entry[key]).partitions if entry.get(key) else []:
                streams[part.stream] = (name, entry.get("by") or {}, part)
                for q in part.patterns:
                    index.insert(q, (name, entry.get("by") or {}, part, q))

    def owner(other: str, by: dict, opart: Partition) -> str:
        return (
            f"partition {opart.name!r} (stream {opart.stream}) of map {other!r}, claimed by "
            f"{by.get('host', '?')} pid {by.get('pid', '?')} at {by.get('at', '?')}"
        )

    out = []
    for part in pmap.partitions:
        if part.stream in streams:
            out.append(f"stream {part.stream!r} of partition {part.name!r} belongs to {owner(*streams[part.stream])}")
        for p in part.patterns:
            for other, by, opart, q in index.overlapping(p):
                out.append(
                    f"pattern {p!r} of partition {part.name!r} overlaps {q!r}, owned by {owner(other, by, opart)}; "
                    f"both would own {overlap_witness(p, q)!r}"
                )
    return out


def _by() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _content(entry: dict[str, Any] | None) -> tuple[Any, Any]:
    return (entry or {}).get("map"), (entry or {}).get("pending")


async def claim(
    kv: Any, pmap: PartitionMap, seen: dict[str, Any] | None, pending: bool = False, attempts: int = 100
) -> dict[str, Any]:
    """Record `pmap` as its map's claim (as pending next to the current one if `pending`), by CAS.

    `seen` is the map's entry as this run first read it: if another run changed it
    meanwhile, refuse instead of overwriting what it did.
    """
    from nats.js.errors import KeyWrongLastSequenceError

    for _ in range(attempts):
        record, revision = await read_record(kv)
        mine = record["maps"].get(pmap.name)
        entry = (
            {"map": (mine or {}).get("map"), "pending": pmap.model_dump()} if pending else {"map": pmap.model_dump()}
        )
        if _content(mine) != _content(seen) and _content(mine) != _content(entry):
            by = (mine or {}).get("by") or {}
            raise Conflict(
                f"map {pmap.name!r} was changed by another apply ({by.get('host')} pid {by.get('pid')} at "
                f"{by.get('at')}) while this one ran; look at `ferry partition plan` and run it again"
            )
        problems = foreign_conflicts(record, pmap)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise Conflict(problems[0] + more)
        record["maps"][pmap.name] = {**entry, "by": _by()}
        data = json.dumps(record).encode()
        try:
            if revision:
                await kv.update(KEY, data, last=revision)
            else:
                await kv.create(KEY, data)
            return record["maps"][pmap.name]
        except KeyWrongLastSequenceError:
            await asyncio.sleep(0.005)  # someone else wrote first: read again and re-check
    raise Conflict(f"could not record the claims of map {pmap.name!r}: the record kept changing")


async def unclaim(
    kv: Any, pmap: PartitionMap, claimed: dict[str, Any], seen: dict[str, Any] | None, attempts: int = 100
) -> None:
    """Put the claim of `pmap`'s map back as this run first read it (`seen`; none: no claim), by
    CAS, unless another run changed it since this one `claimed` it."""
    from nats.js.errors import KeyWrongLastSequenceError

    for _ in range(attempts):
        record, revision = await read_record(kv)
        if _content(record["maps"].get(pmap.name)) != _content(claimed):
            return
        if seen is None:
            record["maps"].pop(pmap.name, None)
        else:
            record["maps"][pmap.name] = seen
        try:
            await kv.update(KEY, json.dumps(record).encode(), last=revision)
            return
        except KeyWrongLastSequenceError:
            await asyncio.sleep(0.005)
    raise Conflict(f"could not withdraw the claims of map {pmap.name!r}: the record kept changing")


async def on_record(nc: Client) -> dict[str, dict[str, Any]]:
    """Every map on record as an operation, as `ferry serve` lists them (key ``partition.<map>``):
    applied, or repartitioning while a repartition has not finished."""
    from datetime import UTC, datetime

    out = {}
    for row in status(await read_claims(nc)):
        at = row["by"].get("at")
        out[f"partition.{row['map']}"] = {
            "kind": "partition",
            "map": row["map"],
            "state": "repartitioning" if row["pending"] else "applied",
            "partitions": len(row["partitions"]),
            "since": datetime.strptime(at, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp() if at else None,
        }
    return out


def status(record: dict[str, Any]) -> list[dict[str, Any]]:
    """`ferry partition status`: every map on record with its partitions, and a repartition that
    did not finish (pending: who started it and when)."""
    rows = []
    for name, entry in sorted(record["maps"].items()):
        current = PartitionMap.model_validate(entry["map"]) if entry.get("map") else None
        rows.append(
            {
                "map": name,
                "partitions": {p.name: {"stream": p.stream, "patterns": p.patterns} for p in current.partitions}
                if current
                else {},
                "pending": bool(entry.get("pending")),
                "by": entry.get("by") or {},
            }
        )
    return rows
