"""Shipping ferry to the executors of a Spark cluster that has never seen it.

On a cluster (``--spark-master spark://…``, yarn, k8s) or a Spark Connect server, the driver packs
ferry and every distribution its Spark tasks import (nats-py, aio-pika, pydantic, nkeys, …) into one
zip and adds it to the session as a Python file (``addPyFile``; ``addArtifacts(pyfile=True)`` on
Spark Connect). An executor's Python finds the zip on its path; its first ``import ferry`` unpacks it
beside itself (:mod:`ferry.shipped`). The zip is built from the driver's own environment, once per
set of versions, under ``~/.cache/ferry/ship/``.

Not shipped: pyspark's own dependencies (pyarrow, pandas, numpy), which Spark wants in the
executors' Python anyway. Which Python the executors run is Spark's choice, as ever:
``$PYSPARK_PYTHON`` on the driver (else ``python3`` on the workers).

Binary modules in the zip (pydantic_core, PyNaCl) are the driver's: the executors must run the
same Python minor version on the same platform, which pyspark checks itself. The first job ferry
runs on a session (:func:`check`) asks every executor slot for its Python, platform and pyarrow and
fails in one line naming the worker host and what is missing.

Instead, ``--spark-archive PATH`` (``$FERRY_SPARK_ARCHIVE``) names a packed Python environment with
ferry installed (``venv-pack``, ``conda-pack``): it reaches the executors as ``spark.archives``
(``PATH#ferry_env``), they run ``./ferry_env/bin/python`` unless ``$PYSPARK_PYTHON`` says
otherwise, and nothing is zipped.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata as md
import json
import os
import platform
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

from ferry.errors import ConfigError

__all__ = ["ARCHIVE_ALIAS", "archive", "check", "is_local", "ship", "sparks_own"]

ARCHIVE_ALIAS = "ferry_env"  # where `--spark-archive` unpacks on an executor: ./ferry_env/bin/python

# ferry's modules whose imports make up what an executor needs (the command line, the HTTP API and
# the lab never run there)
_DRIVER_ONLY = ("ferry.cli", "ferry.api", "ferry.lab", "ferry.__main__")
# imported lazily, by a task that logs in with an nkey or a .creds file
_LAZY = ("nkeys", "nacl.signing", "nacl.exceptions")

_TRACE = f"""
import importlib, json, pkgutil, sys, ferry
def walk(package):  # pkgutil.walk_packages would import the driver's packages too
    for m in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        if not m.name.startswith({_DRIVER_ONLY!r}):
            module = importlib.import_module(m.name)
            if m.ispkg:
                walk(module)
walk(ferry)
for name in {_LAZY!r}:
    importlib.import_module(name)
print(json.dumps(sorted({{n.split(".")[0] for n in sys.modules}})))
"""


def is_local(master: str | None, remote: str | None) -> bool:
    """Executors on this machine running this interpreter: nothing to ship."""
    return not remote and (not master or master.startswith("local"))


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(names: set[str], extra: str | None = None) -> set[str]:
    """`names` and every installed distribution they require (with `extra`'s requirements)."""
    out: set[str] = set()
    todo = list(names)
    while todo:
        name = _key(todo.pop())
        if name in out:
            continue
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        out.add(name)
        for req in requires:
            dep, _, marker = req.partition(";")
            if not marker or (extra and re.search(rf"extra == .{extra}.", marker)):
                todo.append(re.split(r"[<>=!~\[ (]", dep.strip(), maxsplit=1)[0])
    return out


def sparks_own() -> set[str]:
    """pyspark and the distributions it needs for Spark SQL (pyarrow, pandas, numpy and theirs):
    what a cluster's executors have already."""
    return _closure({"pyspark"}, extra="sql")


def _ferry_files() -> tuple[Path, list[Path]]:
    """The directory of the ferry this process imports (unpacked, on an executor) and its files."""
    import ferry

    pkg = Path(ferry.__path__[0])
    return pkg, sorted(p for p in pkg.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def _distributions() -> list[md.Distribution]:
    """The installed distributions ferry's executor-side modules import, pyspark's own left out."""
    out = subprocess.run([sys.executable, "-c", _TRACE], capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise ConfigError(f"could not list what ferry's Spark tasks import: {out.stderr.strip().splitlines()[-1:]}")
    top = set(json.loads(out.stdout.strip().splitlines()[-1]))
    owners = md.packages_distributions()
    imported = {_key(d) for t in top for d in owners.get(t, [])} - {"ferry-mq", "setuptools"}
    names = _closure(imported) - sparks_own()
    return [md.distribution(n) for n in sorted(names)]


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ferry" / "ship"


@functools.cache  # ferry's files and the installed versions do not change under a running ferry
def archive() -> Path:
    """The zip of ferry and its executors' dependencies for this environment (built on first use,
    about 2 s; then found by the digest of ferry's files and every installed version)."""
    import ferry

    h = hashlib.sha256(f"{sys.version}|{platform.machine()}|{ferry_digest()}".encode())
    for d in sorted(md.distributions(), key=lambda d: _key(d.metadata["Name"] or "")):
        h.update(f"{d.metadata['Name']}=={d.version};".encode())
    path = _cache() / f"ferry-{ferry.__version__}-{h.hexdigest()[:16]}.zip"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    pkg, files = _ferry_files()
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for f in files:
            z.write(f, f"ferry/{f.relative_to(pkg)}")
        for dist in _distributions():
            for rel in dist.files or []:
                if rel.parts[0] == ".." or "__pycache__" in rel.parts or rel.suffix == ".pyc":
                    continue  # scripts outside site-packages; bytecode the executor writes itself
                src = Path(str(dist.locate_file(rel)))
                if src.is_file():
                    z.write(src, str(rel))
    os.replace(tmp, path)
    return path


def ship(spark: Any, prepared: str | None) -> dict[str, Any]:
    """Make ferry importable on `spark`'s executors (unless `prepared`, a ``--spark-archive``,
    brings it), then :func:`check` them. Returns what it did and how long it took."""
    from ferry.spark.tasks import is_connect

    started = time.monotonic()
    shipped: dict[str, Any] = {}
    if is_connect(spark) and not prepared:  # a server's executors outlive sessions: this ferry may be there
        with contextlib.suppress(ConfigError):
            found = check(spark)
            if all(e.get("ferry") == ferry_digest() for e in found):
                return {"executors": found, "already": True, "ship_s": round(time.monotonic() - started, 2)}
    if not prepared:
        path = archive()
        shipped = {"zip": str(path), "bytes": path.stat().st_size, "build_s": round(time.monotonic() - started, 2)}
        if is_connect(spark):
            spark.addArtifacts(str(path), pyfile=True)
        else:
            before = list(sys.path)
            spark.sparkContext.addPyFile(str(path))
            sys.path[:] = before  # the driver runs its own installed ferry, not the zip
    return shipped | {"executors": check(spark), "ship_s": round(time.monotonic() - started, 2)}


def _probe(_: Any) -> str:
    """On an executor: what it runs, and what ferry's tasks need that it lacks (stdlib only here:
    this runs where anything may be missing)."""
    import importlib
    import socket

    found: dict[str, Any] = {
        "host": socket.gethostname(),
        "executable": sys.executable,
        "python": "{}.{}".format(*sys.version_info[:2]),
        "machine": platform.machine(),
        "missing": [],
    }
    for name in ("pyarrow", "pandas", "ferry.spark.jetstream", "ferry.brokers.rabbitmq.queue_io", "nkeys"):
        try:
            found[name] = getattr(importlib.import_module(name), "__version__", "")
        except ModuleNotFoundError as exc:
            found["missing"].append(exc.name or name)
        except Exception as exc:  # a binary module built for another Python, say
            found["missing"].append(f"{name} ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
    found["missing"] = list(dict.fromkeys(found["missing"]))
    if not found["missing"]:
        found["ferry"] = ferry_digest()
    return json.dumps(found)


@functools.cache
def ferry_digest() -> str:
    """The digest of the ferry this process imports (its files): which ferry an executor runs."""
    pkg, files = _ferry_files()
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


_MIN_PYARROW = (18, 0)  # pyspark 4's own floor for Spark SQL's Arrow exchange


def check(spark: Any) -> list[dict[str, Any]]:
    """Ask every executor slot what it runs (one small job). One line on the first problem."""
    from ferry.spark.session import spark_error
    from ferry.spark.tasks import is_connect

    try:
        if is_connect(spark):
            from pyspark.sql import functions as F

            n = 2
            probe = F.udf(_probe, "string", useArrow=False)
            rows = [r[0] for r in spark.range(0, n, 1, n).select(probe("id")).collect()]
        else:
            sc = spark.sparkContext
            n = max(1, sc.defaultParallelism)
            rows = sc.parallelize(range(n), n).map(_probe).collect()
    except Exception as exc:
        raise _executor_error(exc, spark_error(exc).message) from None
    found = {json.dumps(r, sort_keys=True): r for r in (json.loads(x) for x in rows)}
    for r in found.values():
        where = f"Spark executor on {r['host']}"
        if r["missing"]:
            lacks = ", ".join(r["missing"])
            python = r["executable"]
            raise ConfigError(f"{where} cannot run ferry's tasks: its Python {python} lacks {lacks}", hint=_HINT)
        if tuple(int(x) for x in str(r["pyarrow"]).split(".")[:2]) < _MIN_PYARROW:
            raise ConfigError(f"{where} has pyarrow {r['pyarrow']}; Spark needs 18.0 or later", hint=_HINT)
        if r["machine"] != platform.machine():
            raise ConfigError(f"{where} is {r['machine']}, ferry's driver {platform.machine()}", hint=_HINT)
    return list(found.values())


_HINT = (
    "set PYSPARK_PYTHON to a Python of the driver's version with pyspark's dependencies (pyarrow, pandas) "
    "on every worker, or give --spark-archive"
)
_HOST = re.compile(r"\(([^ ()]+) executor [^)]+\)")


def _executor_error(exc: Exception, message: str) -> ConfigError:
    """A check job that failed before its probe ran: the executor's Python did not start or is
    another version than the driver's."""
    text = str(exc)
    host = m.group(1) if (m := _HOST.search(text)) else "a worker"
    if "PYTHON_VERSION_MISMATCH" in text or "different version" in text:
        found = re.search(r"different version:? \(?([\d., ]+)\)? than that in driver:? ([\d.]+)", text)
        what = f"Python {found.group(1).replace(', ', '.')}, the driver {found.group(2)}" if found else message
        return ConfigError(f"Spark executor on {host} runs another Python than ferry's driver: {what}", hint=_HINT)
    if "Cannot run program" in text:
        program = re.search(r'Cannot run program "([^"]+)"', text)
        what = program.group(1) if program else "its Python"
        return ConfigError(f"Spark executor on {host} cannot start {what} (no such program there)", hint=_HINT)
    return ConfigError(f"Spark executor on {host} failed ferry's first task: {message}", hint=_HINT)
