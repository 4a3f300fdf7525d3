"""A partition map and its checks, pure: every invalid pattern with its reason, every
overlapping pair with a subject both would own, the routing of a literal subject to its owner."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ferry.errors import (
    ConfigError,
)
from ferry.subjects import SubjectError, SubjectIndex, covers, overlap_witness, problem

RESERVED = ("ferry.stage.>", "ferry.retired.>")
# JetStream refuses a stream (without no-ack) whose subjects overlap its API or the system's,
# except under these (server/stream.go, checkStreamCfg)
SERVER_RESERVED = {"$JS.>": "$JS.EVENT.>", "$JSC.>": None, "$NRG.>": None, "$SYS.>": "$SYS.ACCOUNT.>"}
MAX_NAME = 255  # JSMaxNameLen


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
