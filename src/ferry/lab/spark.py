"""A Spark standalone cluster whose workers have never seen ferry: what ``ferry lab up spark`` starts.

A master, two workers (each its own JVM, 1 core and 2 GiB) and a Spark Connect server whose jobs
run on those workers, all from pyspark's own ``spark-class`` on 127.0.0.1. The executors run a
*bare* Python environment (:func:`worker_python`): pyspark's own dependencies (pyarrow, pandas,
numpy) and nothing of ferry's, so every ferry job reaches them only through what its session ships
(:mod:`ferry.spark.ship`). The lab writes ``spark.env`` with what a ferry command needs
(``FERRY_SPARK_MASTER``, ``PYSPARK_PYTHON``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from ferry.lab.procs import Proc
from ferry.spark.ship import sparks_own

WORKERS = 2
WORKER_MEMORY = "2g"  # the Connect server's executor (512 MiB) and an application's (1 GiB) side by side


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ferry"


def worker_python(libs: tuple[str, ...] | None = None) -> Path:
    """A Python environment with `libs` only (default: pyspark's own dependencies for Spark SQL,
    pyarrow, pandas, numpy and theirs; Spark brings pyspark itself), made once from this
    interpreter's base Python and the installed copies of `libs` (linked, not downloaded: the lab
    works offline), cached under ~/.cache/ferry. Its ``bin/python``."""
    if libs is None:
        libs = tuple(sorted(sparks_own() - {"pyspark", "py4j"}))
    dists = [md.distribution(n) for n in libs]
    key = "|".join([sys.version, *(f"{d.metadata['Name']}=={d.version}" for d in dists)])
    env = _cache() / f"spark-python-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    python = env / "bin" / "python"
    if python.exists():
        return python
    tmp = env.with_name(f"{env.name}.{os.getpid()}.tmp")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(tmp)], check=True, capture_output=True, timeout=120)
    site = Path(
        subprocess.run(
            [str(tmp / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
    )
    for d in dists:
        tops = {Path(str(f)).parts[0] for f in d.files or [] if Path(str(f)).parts[0] != ".."}
        for top in tops:
            src = Path(str(d.locate_file(top)))
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    try:
        tmp.rename(env)  # its bin/python links to the base Python: it works from the new name
    except OSError:  # another lab made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return python


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def make_procs(pdir: Path, ports: dict[str, int], python: Path) -> tuple[list[Proc], dict[str, Any]]:
    """The master, the workers and the Connect server, and what the lab state records of them."""
    home = spark_home()
    master = f"spark://127.0.0.1:{ports['master']}"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SPARK_HOME": str(home),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(pdir / "logs"),
        "PYSPARK_PYTHON": str(python),  # the Connect server's executors (a driver picks its executors' Python)
        **({"JAVA_HOME": os.environ["JAVA_HOME"]} if "JAVA_HOME" in os.environ else {}),
    }
    cls = str(home / "bin" / "spark-class")
    procs = [
        Proc(
            name="spark-master",
            kind="spark",
            argv=[
                *(cls, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1"),
                *("--port", str(ports["master"]), "--webui-port", str(ports["master_ui"])),
            ],
            env=env,
            cwd=str(pdir),
            log=str(pdir / "master.log"),
        )
    ]
    for i in range(1, WORKERS + 1):
        work = pdir / f"worker-{i}"
        work.mkdir()
        procs.append(
            Proc(
                name=f"spark-worker-{i}",
                kind="spark",
                argv=[
                    *(cls, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", "1"),
                    *("--memory", WORKER_MEMORY, "--work-dir", str(work)),
                    *("--webui-port", str(ports[f"worker_{i}_ui"]), master),
                ],
                env=env,
                cwd=str(work),
                log=str(work / "worker.log"),
            )
        )
    conf = {
        "spark.connect.grpc.binding.port": ports["connect"],
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.python.worker.reuse": "true",
        # one core at most, and only while it has work (an executor idle for 2 minutes goes back):
        # a ferry command's own application (--spark-master) always finds the other worker's core
        "spark.cores.max": "1",
        "spark.dynamicAllocation.enabled": "true",
        "spark.dynamicAllocation.shuffleTracking.enabled": "true",
        "spark.dynamicAllocation.executorIdleTimeout": "120s",
        "spark.dynamicAllocation.minExecutors": "0",
        "spark.executor.memory": "512m",
    }
    submit = [str(home / "bin" / "spark-submit"), "--master", master, "--driver-memory", "1g"]
    submit += [a for k, v in conf.items() for a in ("--conf", f"{k}={v}")]
    submit += ["--class", "org.apache.spark.sql.connect.service.SparkConnectServer", "spark-internal"]
    log = str(pdir / "connect.log")
    procs.append(Proc(name="spark-connect", kind="spark", argv=submit, env=env, cwd=str(pdir), log=log))
    info = {
        "master": master,
        "master_ui": f"http://127.0.0.1:{ports['master_ui']}",
        "workers_ui": [f"http://127.0.0.1:{ports[f'worker_{i}_ui']}" for i in range(1, WORKERS + 1)],
        "connect": f"sc://127.0.0.1:{ports['connect']}",
        "python": str(python),
        "env_file": str(pdir / "spark.env"),
    }
    (pdir / "spark.env").write_text(
        f"FERRY_SPARK_MASTER={master}\nPYSPARK_PYTHON={python}\n"
        f"# or, for the Spark Connect server instead: FERRY_SPARK_REMOTE={info['connect']}\n"
    )
    return procs, info


PORTS = ("master", "master_ui", "connect", *(f"worker_{i}_ui" for i in range(1, WORKERS + 1)))


def health(info: dict[str, Any]) -> dict[str, str]:
    """Each process: ok, or why not (the master's own view of its workers)."""
    import httpx

    from ferry.lab.procs import port_open

    out: dict[str, str] = {}
    try:
        state = httpx.get(info["master_ui"] + "/json/", timeout=2).json()
        out["spark-master"] = "ok" if state.get("status") == "ALIVE" else f"status {state.get('status')}"
        alive = {w["webuiaddress"].rstrip("/") for w in state.get("workers", []) if w.get("state") == "ALIVE"}
    except (httpx.HTTPError, ValueError) as exc:
        out["spark-master"] = f"not answering ({type(exc).__name__})"
        alive = set()
    for i, ui in enumerate(info["workers_ui"], 1):
        out[f"spark-worker-{i}"] = "ok" if ui in alive else "not registered with the master"
    port = int(info["connect"].rsplit(":", 1)[1])
    out["spark-connect"] = "ok" if port_open(port) else "gRPC port closed"
    return out


def executors(info: dict[str, Any]) -> dict[str, list[dict[str, str]]]:
    """Each worker's executors now (``app_id``, ``executor``, ``app``: the application's name)."""
    import httpx

    out: dict[str, list[dict[str, str]]] = {}
    try:
        apps = {a["id"]: a["name"] for a in httpx.get(info["master_ui"] + "/json/", timeout=2).json()["activeapps"]}
    except (httpx.HTTPError, ValueError, KeyError):
        apps = {}
    for i, ui in enumerate(info["workers_ui"], 1):
        try:
            running = httpx.get(ui + "/json/", timeout=2).json().get("executors", [])
        except (httpx.HTTPError, ValueError):
            continue
        out[f"spark-worker-{i}"] = [
            {"app_id": e["appid"], "executor": str(e["id"]), "app": apps.get(e["appid"], "?")} for e in running
        ]
    return out


def workers_running(info: dict[str, Any], app: str) -> list[str]:
    """The workers with an executor of an application whose name starts with `app` (``ferry copy``)."""
    return [w for w, ex in executors(info).items() if any(e["app"].startswith(app) for e in ex)]
