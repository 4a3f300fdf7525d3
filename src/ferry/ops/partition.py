"""`ferry partition`: subjects partitioned across JetStream streams, with exact ownership.

A **partition map** (YAML) names its partitions; each is one stream, placed in a
cluster, that owns a set of subject patterns::

    name: shop                       # the map's identity in the claims record
    partitions:
      - name: orders-eu
        stream: P_ORDERS_EU
        cluster: east                # optional placement
        replicas: 3
        patterns: [orders.eu.>]

- **check**: invalid patterns (with the reason), every overlapping pair (with a
  subject both would own), names used twice; with a traffic snapshot, the
  subjects seen that no partition owns.
- **route**: the owner of a literal subject, or "no partition owns it" at once.
- **claims**: ownership lives in the KV bucket ``ferry_partitions``, key
  ``claims``: one JSON record for every map, written only by compare-and-set on
  its revision. A claim re-reads the record after every lost race and checks its
  patterns against every other map's (claimed and pending) patterns, so two
  claims of overlapping subjects cannot both succeed, whatever the timing.
- **apply**: refuses, before changing anything, an invalid map, a conflict with
  another map's claim or with a stream outside the map; then claims and creates
  or updates one stream per partition capturing exactly its patterns.
- **repartition** (a map that changes the owner of subjects, ``--execute``):
  the new owner gets a staging subject (``ferry.stage.<STREAM>.>``, transformed
  back to the original subject on store); the data plane copies the moving
  subjects' history into it (a Spark job), an in-process copy catches up, then,
  under the move machinery's capture guard, the old owner drops the patterns
  and the new owner takes them; the tail is forwarded, what the guard heard and
  the new owner lacks is re-published, and only when the counts match are the
  moved subjects purged from the old owner.

Limits, said plainly: per-subject order in the new owner is kept for the
history and for live traffic, but messages stored in the old owner during the
last moments before the switch land after the first ones stored in the new
owner (at most what is published during the switch, tens of milliseconds);
a repartition interrupted half-way is not resumed automatically (the claims
record shows it as pending and nothing is purged before the copy is counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml
from nats.aio.client import Client
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ferry.brokers import nats as bnats
from ferry.errors import (
    BrokerUnavailable,
    ConfigError,
    Conflict,
    FerryError,
    NotFound,
    OperationFailed,
    PreflightFailed,
    UsageError,
)
from ferry.ops import Emit, no_emit
from ferry.ops import move as mv
from ferry.subjects import SubjectError, SubjectIndex, covers, intersection, overlap_witness, problem
from ferry.topology import Topology

__all__ = ["PartitionMap", "apply", "check", "load_map", "plan", "read_claims", "route", "unowned_traffic"]

RESERVED = ("ferry.stage.>", "ferry.retired.>")
# JetStream refuses a stream (without no-ack) whose subjects overlap its API or the system's,
# except under these (server/stream.go, checkStreamCfg)
SERVER_RESERVED = {"$JS.>": "$JS.EVENT.>", "$JSC.>": None, "$NRG.>": None, "$SYS.>": "$SYS.ACCOUNT.>"}
MAX_NAME = 255  # JSMaxNameLen
BUCKET = "ferry_partitions"
KEY = "claims"


# -- the map ---------------------------------------------------------------------------------------


class Partition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    stream: str = Field(min_length=1)
    cluster: str | None = None
    replicas: int = Field(default=1, ge=1, le=5)
    patterns: list[str] = Field(min_length=1)


class PartitionMap(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    partitions: list[Partition] = Field(min_length=1)

    def index(self) -> SubjectIndex[tuple[Partition, str]]:
        return SubjectIndex(
            (p, (part, p)) for part in self.partitions for p in part.patterns if not problem(p, strict=True)
        )


def load_map(path: Path) -> PartitionMap:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} not valid YAML") from None
    try:
        return PartitionMap.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(x) for x in first["loc"]) or "(top level)"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ConfigError(f"{path}: {loc}: {first['msg']}{more}") from None


def check(pmap: PartitionMap) -> dict[str, Any]:
    """Every problem of a map: invalid patterns and names, names used twice, overlapping pairs."""
    invalid, overlaps, problems = [], [], []
    for what in ("name", "stream"):
        seen: set[str] = set()
        for part in pmap.partitions:
            value = getattr(part, what)
            if value in seen:
                problems.append(f"{what} {value!r} is used by more than one partition")
            seen.add(value)
    for part in pmap.partitions:
        if any(c in part.stream for c in " \t\r\n\f.*>/\\") or len(part.stream) > MAX_NAME:
            problems.append(
                f"partition {part.name!r}: stream name {part.stream!r} may not contain . * > / \\ or "
                f"whitespace, nor be longer than {MAX_NAME} characters"
            )
    index: SubjectIndex[tuple[int, str, str]] = SubjectIndex()
    for i, part in enumerate(pmap.partitions):
        for pattern in part.patterns:
            why = problem(pattern, strict=True) or _reserved(pattern)
            if why:
                invalid.append({"partition": part.name, "pattern": pattern, "problem": why})
                continue
            for j, other, q in index.overlapping(pattern):
                overlaps.append(
                    {
                        "a": {"partition": other, "pattern": q},
                        "b": {"partition": part.name, "pattern": pattern},
                        "witness": overlap_witness(q, pattern),
                        "same_partition": i == j,
                    }
                )
            index.insert(pattern, (i, part.name, pattern))
    problems += [f"partition {x['partition']!r}: {x['problem']}" for x in invalid]
    problems += [
        f"partition {o['a']['partition']!r} {o['a']['pattern']!r} overlaps "
        f"partition {o['b']['partition']!r} {o['b']['pattern']!r}"
        + (" (the same partition; JetStream refuses overlapping subjects in one stream)" if o["same_partition"] else "")
        + f": both own {o['witness']!r}"
        for o in overlaps
    ]
    return {
        "map": pmap.name,
        "ok": not problems,
        "partitions": len(pmap.partitions),
        "patterns": sum(len(p.patterns) for p in pmap.partitions),
        "invalid": invalid,
        "overlaps": overlaps,
        "problems": problems,
    }


def _reserved(pattern: str) -> str | None:
    """Why a valid pattern may not be a partition's: subjects ferry or JetStream reserve."""
    if any(overlap_witness(pattern, r) for r in RESERVED):
        return f"{pattern!r} overlaps {RESERVED}, which ferry reserves for staging a repartition"
    for namespace, allowed in SERVER_RESERVED.items():
        if overlap_witness(pattern, namespace) and not (allowed and covers(allowed, pattern)):
            return (
                f"{pattern!r} overlaps {namespace!r}, which JetStream keeps for its API "
                "(nats-server 2.11+ refuses a stream that captures it)"
            )
    return None


def require_valid(pmap: PartitionMap) -> None:
    """Refuse a map with any problem `check` finds (one line, naming the first)."""
    report = check(pmap)
    if not report["ok"]:
        n = len(report["problems"])
        more = f" (and {n - 1} more; see `ferry partition check`)" if n > 1 else ""
        raise ConfigError(f"map {pmap.name!r}: {report['problems'][0]}{more}")


def unowned_traffic(pmap: PartitionMap, snapshot: Path) -> list[dict[str, Any]]:
    """Subjects in a snapshot (Parquet, ferry's message schema) that no partition owns, with counts."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    if not Path(snapshot).exists():
        raise ConfigError(f"--traffic {snapshot}: no such directory")
    counts: dict[str, int] = defaultdict(int)
    try:
        for batch in ds.dataset(str(snapshot), format="parquet").to_batches(columns=["subject"]):
            for row in pc.value_counts(batch.column("subject")).to_pylist():
                counts[row["values"]] += row["counts"]
    except Exception as exc:  # not Parquet, no subject column
        raise ConfigError(f"--traffic {snapshot}: not a ferry snapshot ({type(exc).__name__}: {exc})") from None
    index = pmap.index()
    out = []
    for subject, n in sorted(counts.items(), key=lambda kv: kv[0] or ""):
        try:
            if subject is not None and index.route(subject) is None:
                out.append({"subject": subject, "messages": n})
        except SubjectError as exc:
            out.append({"subject": subject, "messages": n, "problem": str(exc)})
    return out


def route(owners: list[PartitionMap], subjects: list[str]) -> list[dict[str, Any]]:
    """The owning partition of each literal subject (an error entry for a wildcard or invalid one)."""
    index: SubjectIndex[tuple[str, Partition]] = SubjectIndex(
        (p, (m.name, part))
        for m in owners
        for part in m.partitions
        for p in part.patterns
        if not problem(p, strict=True)
    )
    out = []
    for s in subjects:
        try:
            found = index.route(s)
        except SubjectError as exc:
            out.append({"subject": s, "error": str(exc)})
            continue
        if found is None:
            out.append({"subject": s, "owner": None, "error": f"no partition owns {s!r}"})
        else:
            m, part = found
            out.append({"subject": s, "owner": part.name, "map": m, "stream": part.stream, "cluster": part.cluster})
    return out


# -- the claims record -------------------------------------------------------------------------------


async def _bucket(nc: Client, create: bool = True) -> Any:
    from nats.js.api import KeyValueConfig
    from nats.js.errors import BucketNotFoundError

    js = nc.jetstream()
    try:
        return await js.key_value(BUCKET)
    except BucketNotFoundError:
        if not create:
            return None
        try:
            return await js.create_key_value(KeyValueConfig(bucket=BUCKET, history=10, replicas=3))
        except Exception as exc:
            with contextlib.suppress(BucketNotFoundError):
                return await js.key_value(BUCKET)  # another ferry created it meanwhile
            raise BrokerUnavailable(f"cannot create the claims bucket {BUCKET} (R3): {exc}") from None


async def _read(kv: Any) -> tuple[dict[str, Any], int]:
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
    kv = await _bucket(nc, create=False)
    return (await _read(kv))[0] if kv else {"maps": {}}


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
        record, revision = await _read(kv)
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
        record, revision = await _read(kv)
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


# -- planning ----------------------------------------------------------------------------------------


def stage_subject(stream: str) -> str:
    return f"ferry.stage.{stream}"


async def _last_seq(nc: Client, stream: str) -> int:
    return (await mv.stream_info(nc, stream))["state"]["last_seq"]


async def list_streams(nc: Client) -> dict[str, dict[str, Any]]:
    """name -> {config, cluster, messages} of every stream in the account."""
    out = {}
    async for info in mv.paged(nc, "$JS.API.STREAM.LIST", "streams", lambda n: mv.stream_info(nc, n, timeout=10)):
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
    info = await jsm.add_consumer(stream, cfg)
    with contextlib.suppress(Exception):
        await jsm.delete_consumer(stream, info.name)
    return info.num_pending


def _patterns_of(config: dict[str, Any]) -> list[str]:
    return [s for s in config.get("subjects") or [] if not s.startswith("ferry.stage.")]


async def plan(nc: Client, pmap: PartitionMap, record: dict[str, Any]) -> dict[str, Any]:
    """What applying `pmap` would change, and what refuses it (nothing changed)."""
    mine = record["maps"].get(pmap.name) or {}
    prev = PartitionMap.model_validate(mine["map"]) if mine.get("map") else None
    streams = await list_streams(nc)
    ours = {p.stream for p in pmap.partitions} | {p.stream for p in (prev.partitions if prev else [])}
    refusals = foreign_conflicts(record, pmap)
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
        (q, (name, q)) for name in sorted(ours & set(streams)) for q in _patterns_of(streams[name]["config"])
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
            before = _patterns_of(cfg)
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
            keep = [q for q in _patterns_of(streams[name]["config"]) if not index.overlapping(q)]
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
    await mv.api(nc, f"$JS.API.STREAM.{verb}.{cfg['name']}", cfg, timeout=10)


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
        old = _patterns_of(s["config"])
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
                s = {"config": (await mv.stream_info(nc, part.stream, timeout=10))["config"]}
        if s is None:
            out.append(f"stream {part.stream} is missing")
        elif sorted(s["config"].get("subjects") or []) != sorted(part.patterns):
            out.append(f"stream {part.stream} captures {s['config'].get('subjects')}, not {part.patterns}")
        elif int(s["config"].get("num_replicas", 1)) != part.replicas:
            out.append(f"stream {part.stream} has {s['config'].get('num_replicas')} replicas, not {part.replicas}")
    return out


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
) -> dict[str, Any]:
    """Claim `pmap` and make the streams match it; a repartition needs `execute`."""
    require_valid(pmap)
    cluster = topo.nats(via)
    async with bnats.session(cluster, name=via, client_name="ferry-partition") as nc:
        kv = await _bucket(nc, create=False)
        record, _ = await _read(kv) if kv else ({"maps": {}}, 0)
        seen = record["maps"].get(pmap.name)
        p = await plan(nc, pmap, record)
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
        kv = kv or await _bucket(nc)
        if p["moves"]:
            result = await _repartition(topo, via, nc, kv, pmap, p, seen, emit, state_dir)
        else:
            claimed = await claim(kv, pmap, seen)
            emit("claimed", map=pmap.name)
            changed: list[str] = []
            try:
                await _converge(nc, pmap, p, changed=changed)
            except FerryError as exc:  # a stream the server would not make (an unknown cluster): no claim stays
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
    from ferry.pipeline.jetstream import Range, ReadConfig, WriteConfig, read_rows, write_rows

    if hi < lo:
        return 0, 0
    read = ReadConfig(cluster=cluster_json, name=via, streams=(move["from"],), subject=move["pattern"])
    write = WriteConfig(
        cluster=cluster_json, name=via, stream=move["to"], subject_prefix=stage_subject(move["to"]) + "."
    )
    counts = await write_rows(write, read_rows(read, Range(move["from"], lo, hi, fetch=2000)))
    return counts.rows, counts.duplicates


def _spark_copy(topo: Topology, via: str, move: dict[str, Any], hi: int, emit: Emit) -> tuple[int, int]:
    """The history of one moving pattern, copied by the data plane (a Spark job): rows, duplicates.
    Its progress is emitted as "copying" events (messages the new owner gained, about every 0.5 s)."""
    from urllib.parse import quote

    from ferry.pipeline.copy import CopyOptions, plan_copy, run_copy
    from ferry.pipeline.spark import get_session

    src = f"jetstream://{via}/{move['from']}?subject={quote(move['pattern'])}&end_seq={hi}"
    opts = CopyOptions(mode="parallel", partitions=1, subject_prefix=stage_subject(move["to"]) + ".")
    copy_plan = plan_copy(topo, src, f"jetstream://{via}/{move['to']}", opts)
    spark = get_session(app_name="ferry partition", data_sources=False)
    what = {k: move[k] for k in ("from", "to", "pattern")}
    report = run_copy(topo, copy_plan, spark, lambda n: emit("copying", **what, messages=n, total=copy_plan.messages))
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
) -> dict[str, Any]:
    cluster = topo.nats(via)
    cjson = cluster.model_dump_json()
    op_id = uuid.uuid4().hex[:12]
    moves = p["moves"]
    targets = sorted({m["to"] for m in moves})
    await mv.check_listen(cluster, [m["pattern"] for m in moves])  # its guard refused later would leave copies
    streams = await list_streams(nc)

    def copied_as(m: dict[str, Any]) -> list[str]:
        """The subjects the copies of move `m` take in its new owner: its pattern where the old owner captures it."""
        return [x for q in _patterns_of(streams[m["from"]]["config"]) if (x := intersection(m["pattern"], q))]

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
        kept = _patterns_of(s["config"]) if s else []
        await _put_stream(nc, _stream_config(part, s["config"] if s else None, kept, stage=True), s is not None)
    # 2. history through the data plane
    done: dict[int, int] = {}
    copied: dict[int, int] = defaultdict(int)
    dups: dict[int, int] = defaultdict(int)  # copies the new owner dropped as already held (same msg id)
    for i, m in enumerate(moves):
        hi = await _last_seq(nc, m["from"])
        if await stored_count(nc, m["from"], m["pattern"]):
            rows, dup = await asyncio.to_thread(_spark_copy, topo, via, m, hi, emit)
            copied[i] += rows
            dups[i] += dup
        done[i] = hi
        emit("copied", **{k: m[k] for k in ("from", "to", "pattern")}, messages=copied[i], up_to=hi)

    async def catch_up() -> int:
        n = 0
        for i, m in enumerate(moves):
            hi = await _last_seq(nc, m["from"])
            got, dup = await _forward(cjson, via, m, done[i] + 1, hi)
            copied[i] += got
            dups[i] += dup
            done[i] = hi
            n += got
        return n

    # 3. catch up in process until little is left; the guard's comparison starts before it
    seq0 = {t: await _last_seq(nc, t) for t in targets}
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
                await mv.api(nc, f"$JS.API.STREAM.DELETE.{t}", timeout=10)
                continue
            for x in [x for m in moves if m["to"] == t for x in copied_as(m)]:  # it held none before (checked)
                await mv.api(nc, f"$JS.API.STREAM.PURGE.{t}", {"filter": x}, timeout=10)
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
    root = mv.state_root(state_dir) / "partition" / f"{pmap.name}-{op_id}"
    guards, t_switch = {}, 0.0
    try:
        for t in targets:  # one refused (the user may not listen): the switch is not made
            guards[t] = mv.Guard(
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
        heard = await mv.reconcile(cluster, nc, t, {"seq0": seq0[t], "move_id": op_id}, root / t, no_emit)
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
            r = await mv.api(
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
