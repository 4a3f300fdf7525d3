"""The Spark session every ferry job runs in.

- local (default): ``local[*]`` on this machine, with offline-safe settings
  (loopback only, no UI, executors run this very interpreter);
- ``master="spark://host:7077"`` (or yarn, k8s): a Spark cluster;
- ``remote="sc://host:15002"``: a Spark Connect server.

Executors import ``ferry`` by name (data sources are pickled by reference): on a
cluster or Connect server the session ships ferry to them first
(:mod:`ferry.spark.ship`). The topology's credentials must be readable there too
(the same environment variables or secret files).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ferry.errors import ConfigError, FerryError, redact
from ferry.spark import listeners, ship

__all__ = ["get_session", "register", "spark_error"]

# offline-safe: a local session listens on loopback only and serves no UI
_LOCAL_ONLY = {"spark.ui.enabled": "false", "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"}
_CONF = {
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "8",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.python.worker.reuse": "true",
    # Over TCP, a task's input reaches its Python worker ~40 ms after the task's header (Nagle
    # against delayed ACKs): 60 ms per trivial Python task here, 20 ms over a Unix socket.
    "spark.python.unix.domain.socket.enabled": "true",
    "spark.sql.session.timeZone": "UTC",
    "spark.driver.memory": "2g",
    "spark.sql.sources.partitionOverwriteMode": "dynamic",
    "spark.log.level": "FATAL",
    # a data source's read() that raises is a failed task; don't retry silently (a task whose
    # executor was lost, its worker killed, is not counted and runs again elsewhere)
    "spark.task.maxFailures": "1",
}


# Jobs that move messages do their work in Python workers; the JVM only schedules.
# C1-only JIT and the serial GC nearly halve its start-up CPU (17 -> 9.5 CPU-s
# measured here), which otherwise competes with the move for the same cores.
_LIGHT_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:CICompilerCount=2"
# Jobs that compute in the JVM (the audit) get the throughput collector: the 10M-row audit
# bench took 37-39 s with it against 40-43 s with G1 (more time in GC, less in barriers).
_FULL_JVM = "-XX:+UseParallelGC"
# JVM warnings (class data sharing's among them) go to stderr, i.e. the Spark log, not stdout
_JVM_LOG = "-Xlog:disable -Xlog:all=warning:stderr"

_USER_PYTHON = os.environ.get("PYSPARK_PYTHON")  # the executors' Python on a cluster, as Spark reads it
_remote_sessions: list[Any] = []  # this process's Spark Connect sessions: their jobs run on the server
_interrupted = threading.Event()  # Ctrl-C: no Spark job of this process begins or goes on


def _spark_defaults() -> dict[str, str]:
    """The settings of the ``spark-defaults.conf`` that spark-submit reads (``$SPARK_CONF_DIR``,
    else ``$SPARK_HOME/conf``, else pyspark's own): a cluster's client settings."""
    import pyspark

    home = os.environ.get("SPARK_HOME") or str(Path(pyspark.__file__).parent)
    path = Path(os.environ.get("SPARK_CONF_DIR") or Path(home) / "conf") / "spark-defaults.conf"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    pairs = (re.match(r"([^\s=:]+)\s*[=:\s]?\s*(.*)", line.strip()) for line in lines)
    return {m[1]: m[2] for m in pairs if m and not m[1].startswith(("#", "!"))}  # java.util.Properties' syntax


# ferry's tuning, which a cluster's own settings (spark-defaults.conf) override: a cluster's
# executors get the driver's JVM flavour (the audit's 10M rows on the lab's two workers: 58.7 s
# with the throughput collector, 65 s with G1), unless its settings give them JVM options (two
# collectors named would stop an executor starting); a larger cluster wants more shuffle partitions
_TUNING = frozenset({"spark.sql.shuffle.partitions", "spark.driver.memory", "spark.executor.extraJavaOptions"})


def _tuned(options: dict[str, str]) -> dict[str, str]:
    """`options` without the tuning that the user's spark-defaults.conf sets otherwise."""
    theirs = _TUNING & _spark_defaults().keys()
    return {k: v for k, v in options.items() if k not in theirs}


def _class_archive(light_jvm: bool) -> str:
    """JVM options for class data sharing: the driver maps the classes Spark loads from an
    archive instead of parsing them from jars, 3.5 s or more less per session start here
    (bench/RESULTS.md, "Spark start-up"). The first session of a Python environment writes the
    archive as its JVM exits (once, ~15 s, ~150 MB under ~/.cache/ferry); FERRY_SPARK_CDS=0 turns
    this off. A stale archive (another Java) is ignored by the JVM itself."""
    archive = class_archive_path(light_jvm)
    if archive is None:
        return ""
    if archive.exists():
        return f"-XX:SharedArchiveFile={archive}"
    cache = archive.parent
    try:
        cache.mkdir(parents=True, exist_ok=True)
        for old in cache.glob("spark-classes-*.tmp"):  # left by a process killed before its JVM exited
            if time.time() - old.stat().st_mtime > 600:
                old.unlink(missing_ok=True)
    except OSError:
        return ""
    tmp = archive.with_name(f"{archive.name}.{os.getpid()}.tmp")
    atexit.register(_keep_archive, tmp, archive)
    return f"-XX:ArchiveClassesAtExit={tmp}"


def class_archive_path(light_jvm: bool) -> Path | None:
    """Where this Python environment's archive for this kind of JVM lives (None: turned off)."""
    import pyspark

    if os.environ.get("FERRY_SPARK_CDS") == "0":
        return None
    java = shutil.which("java", path=os.path.join(os.environ.get("JAVA_HOME", ""), "bin")) or shutil.which("java")
    key = f"{pyspark.__version__}|{sys.prefix}|{java and os.path.realpath(java)}|{light_jvm}"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ferry"
    return cache / f"spark-classes-{hashlib.sha256(key.encode()).hexdigest()[:12]}.jsa"


def _keep_archive(tmp: Path, archive: Path) -> None:
    """At exit: let the gateway JVM exit (it does when its stdin closes) and write its archive."""
    from pyspark import SparkContext

    proc = getattr(SparkContext._gateway, "proc", None)
    if proc is not None and proc.poll() is None:
        print(
            "ferry: saving Spark's classes for faster starts (once per JVM setting: light and full)",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(Exception):
            if SparkContext._active_spark_context is not None:
                SparkContext._active_spark_context.stop()  # its accumulator server first
            proc.stdin.close()
            proc.wait(timeout=60)
    if proc is not None and proc.returncode == 0 and tmp.exists():
        os.replace(tmp, archive)
    else:
        tmp.unlink(missing_ok=True)


def get_session(
    master: str | None = None,
    remote: str | None = None,
    app_name: str = "ferry",
    light_jvm: bool = True,
    data_sources: bool = True,
    archive: str | None = None,
    python_tasks: bool = True,
    **conf: Any,
) -> Any:
    """A SparkSession with ferry's data sources registered: the one way every ferry job starts Spark.

    Where it runs: `master` (a cluster, ``spark://...``; default ``$FERRY_SPARK_MASTER``, else
    ``local[*]``) or `remote` (a Spark Connect server, ``sc://...``; default
    ``$FERRY_SPARK_REMOTE``). ``light_jvm`` (the driver's JVM, and a cluster's executors' unless
    its own settings say otherwise): a JVM tuned for moving data; pass False for jobs that compute
    in the JVM (the audit). ``data_sources=False``: for jobs that read with none (the queue
    mover); registering them sets up Spark SQL's session state, about a second of the start-up
    here. ``archive`` (default ``$FERRY_SPARK_ARCHIVE``): a packed Python environment with ferry
    for a cluster's executors instead of the zip ferry ships (:mod:`ferry.spark.ship`).
    ``python_tasks=False``: the session's jobs run no Python on the executors (an audit of Parquet
    files): nothing is shipped to a cluster or checked there, and its executors start while the
    driver plans the first job.
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    if not master and not remote:
        master, remote = os.environ.get("FERRY_SPARK_MASTER") or None, os.environ.get("FERRY_SPARK_REMOTE") or None
    if master and remote:
        raise ConfigError("give --spark-master or --spark-remote (or FERRY_SPARK_REMOTE), not both")
    local = ship.is_local(master, remote)
    archive = archive or os.environ.get("FERRY_SPARK_ARCHIVE") or None
    if archive:
        if local or remote:
            raise ConfigError("--spark-archive is for a cluster's executors: give --spark-master spark://... too")
        if not Path(archive).is_file():
            raise ConfigError(f"--spark-archive {archive}: no such file")
        conf.setdefault("spark.archives", f"{Path(archive).resolve()}#{ship.ARCHIVE_ALIAS}")
    # local executors run this very interpreter; a cluster's run what Spark is told (or python3)
    python = sys.executable if local else _USER_PYTHON or (archive and f"./{ship.ARCHIVE_ALIAS}/bin/python")
    if python:
        os.environ["PYSPARK_PYTHON"] = python
    else:
        os.environ.pop("PYSPARK_PYTHON", None)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if remote:
        if not remote.startswith("sc://"):
            raise ConfigError(f"--spark-remote must be an sc:// URL, got {remote!r}")
        _reachable(remote)
        builder = SparkSession.builder.remote(remote).appName(app_name)
    else:
        if local:
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        log4j = Path(__file__).with_name("log4j2.properties")
        launching = SparkContext._gateway is None  # else this process has its JVM already
        java = " ".join(
            [f"-Dlog4j2.configurationFile=file:{log4j}", _JVM_LOG]
            + ([_class_archive(light_jvm)] if launching else [])
            + [_LIGHT_JVM if light_jvm else _FULL_JVM]
        )
        executors = {"spark.executor.extraJavaOptions": _LIGHT_JVM if light_jvm else _FULL_JVM}
        options = {
            "spark.master": master or "local[*]",
            "spark.app.name": app_name,
            **_tuned(_CONF | ({} if local else executors)),
            **(_LOCAL_ONLY if local else {}),
            "spark.driver.extraJavaOptions": java,
            **conf,
        }
        builder = SparkSession.builder
        for key, value in options.items():
            builder = builder.config(key, value)
    try:
        if not remote and launching:
            # the Python that Spark starts on the driver to plan a read of ferry's data sources
            # (a streaming read's source above all) runs what the executors run: it finds the
            # shipped ferry on the JVM's PYTHONPATH
            _launch_jvm(options, ship.archive() if python_tasks and not (local or archive) else None)
        spark = builder.getOrCreate()
    except Exception as exc:  # the JVM failed to start or the remote is unreachable
        where = remote or master or "local[*]"
        raise ConfigError(
            f"could not start a Spark session on {where}: {str(exc).splitlines()[0]}", hint=f"see {spark_log()}"
        ) from None
    if remote:
        _remote_sessions.append(spark)
    no_job_after_interrupt()  # Ctrl-C came while the JVM started
    where = {"remote": redact(remote)} if remote else {"master": master or "local[*]"}
    info: dict[str, Any] = {"app_name": app_name, **where}
    if not local and python_tasks:
        try:
            info["shipped"] = ship.ship(spark, archive)
        except BaseException:
            with contextlib.suppress(Exception):
                spark.stop()  # a cluster's cores go back at once
            raise
    if data_sources:
        register(spark)
    with contextlib.suppress(Exception):  # a Connect server that does not say
        info["app_id"] = spark.conf.get("spark.app.id")
    for listener in listeners:
        listener(info)
    return spark


SparkFactory = Callable[[], Any]


def factory(
    master: str | None = None, remote: str | None = None, app_name: str = "ferry", **options: Any
) -> SparkFactory:
    """A job's way to its Spark session, made where the user said (``--spark-master``,
    ``--spark-remote``) and started only if the job needs it: ``factory(...)()``."""
    return functools.partial(get_session, master, remote, app_name, **options)


def no_job_after_interrupt() -> None:
    """KeyboardInterrupt once Ctrl-C came (:func:`interrupt`): said before a job begins, since
    cancelling stops only the jobs that run (one begun right after went to its end)."""
    if _interrupted.is_set():
        raise KeyboardInterrupt


def clear_interrupt() -> None:
    """Let Spark jobs begin again after :func:`interrupt` (the next command of the same process)."""
    _interrupted.clear()


def interrupt(timeout: float = 5.0) -> None:
    """Stop this process's Spark jobs (Ctrl-C). A job runs in a thread that asyncio waits for
    before the process exits: a local job is cancelled, a session still being made gets no job
    (:func:`get_session` raises), and a job on a Spark Connect server, which would otherwise run
    on to its end unwatched, is interrupted there (bounded: pyspark retries a server that does not
    answer for minutes)."""
    from pyspark import SparkContext

    _interrupted.set()
    local = SparkContext._active_spark_context
    if local is not None:
        with contextlib.suppress(Exception):
            local.cancelAllJobs()

    def interrupt_remote() -> None:
        for spark in _remote_sessions:
            with contextlib.suppress(Exception):
                spark.interruptAll()

    if _remote_sessions:
        t = threading.Thread(target=interrupt_remote, daemon=True)
        t.start()
        with contextlib.suppress(BaseException):  # a second Ctrl-C: leave without waiting
            t.join(timeout)


SPARK_LOGS_KEPT = 20  # logs of earlier local Spark drivers kept when one starts (the newest)


def spark_log() -> Path:
    """Where the local JVM and its Python workers write their own output (not the terminal): one
    file per ferry process, in a folder of this user's."""
    return Path(tempfile.gettempdir()) / f"ferry-spark-{os.getuid()}" / f"{os.getpid()}.log"


def _prune_logs(folder: Path) -> None:
    """Keep the SPARK_LOGS_KEPT newest logs (another ferry may be writing one of them)."""
    logs = sorted(folder.glob("*.log"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in logs[SPARK_LOGS_KEPT:]:
        with contextlib.suppress(OSError):
            old.unlink()


def _launch_jvm(options: dict[str, str], shipped: Path | None = None) -> None:
    """Start the driver JVM with its stderr, which every Python worker it forks inherits, in the
    Spark log. Only the JVM's: other threads keep reporting on this process's own stderr while
    it starts. `shipped` (a cluster's zip of ferry) goes on the Python path of the workers the
    JVM forks on this machine."""
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    log = spark_log()
    log.parent.mkdir(mode=0o700, exist_ok=True)
    with contextlib.suppress(OSError):  # a log that vanished meanwhile (another ferry pruned it)
        _prune_logs(log.parent)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    before = os.environ.get("PYTHONPATH")
    if shipped:  # launch_gateway hands the JVM this process's environment
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shipped), before]))
    try:
        gateway = launch_gateway(SparkConf(loadDefaults=False).setAll(options.items()), popen_kwargs={"stderr": fd})
    finally:
        os.close(fd)
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before
    SparkContext._ensure_initialized(gateway=gateway)


def _reachable(remote: str, timeout: float = 5.0) -> None:
    """Spark Connect's client retries an unreachable server for minutes: fail fast instead."""
    parts = urlsplit(remote.replace("sc://", "http://", 1))
    try:
        with socket.create_connection((parts.hostname or "localhost", parts.port or 15002), timeout=timeout):
            pass
    except OSError as exc:
        raise ConfigError(f"Spark Connect server {remote} is not reachable ({exc.strerror or exc})") from None


def register(spark: Any) -> None:
    """Register ferry's Python data sources on a session (idempotent)."""
    from ferry.spark.jetstream import JetStreamDataSource
    from ferry.spark.rabbitmq import RabbitMQDataSource

    for source in (JetStreamDataSource, RabbitMQDataSource):
        spark.dataSource.register(source)


_EXC_LINE = re.compile(
    r"^(ferry\.errors\.\w+|[A-Za-z_][\w.]*(?:Error|Exception|NotFound|Unavailable|Conflict|Failed)): (.+)$"
)


def spark_error(exc: Exception) -> FerryError:
    """An error raised in a Spark task reaches the driver as text: recover its one line."""
    if isinstance(exc, FerryError):
        return exc
    from ferry import errors

    found = None
    for line in str(exc).splitlines():
        match = _EXC_LINE.match(line.strip())
        if match and not match.group(1).startswith(("org.apache", "java.", "py4j", "pyspark")):
            found = match  # the last Python exception line is the root cause
    if found:
        name, message = found.group(1), found.group(2)
        cls = getattr(errors, name.removeprefix("ferry.errors."), None) if name.startswith("ferry.errors.") else None
        if cls is not None:
            return cls(message)
        return FerryError(f"a Spark task failed: {name.rsplit('.', 1)[-1]}: {redact(message)[:300]}")
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    return FerryError(f"Spark job failed: {redact(first)[:300]}")


if __name__ == "__main__":  # `make setup`: write both class archives now rather than on first use
    import subprocess

    for light in (True, False):
        path = class_archive_path(light)
        if path is not None and not path.exists():
            code = f"from ferry.spark.session import get_session; get_session(light_jvm={light}).range(1).count()"
            subprocess.run([sys.executable, "-c", code], check=True)
