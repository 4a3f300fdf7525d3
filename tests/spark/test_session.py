"""The local Spark session: its JVM's output goes to the Spark log, and only the JVM's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.spark

SCRIPT = """
import sys, threading, time
from ferry.spark.session import get_session, spark_log

def report():  # another thread reporting while the JVM starts, as ferry failback's progress does
    for i in range(400):
        print(f"line {i}", file=sys.stderr, flush=True)
        time.sleep(0.01)
t = threading.Thread(target=report)
t.start()
spark = get_session()
assert spark.range(3).count() == 3
t.join()
print(spark_log())
"""


def test_the_jvm_writes_to_the_spark_log_and_other_threads_to_stderr(tmp_path: Path) -> None:
    env = {**os.environ, "FERRY_SPARK_CDS": "0", "TMPDIR": str(tmp_path)}  # no "saving Spark's classes" note at exit
    folder = tmp_path / f"ferry-spark-{os.getuid()}"
    folder.mkdir()
    for i in range(25):  # the logs of earlier ferries: the oldest go, the newest 20 stay
        (folder / f"{i}.log").write_text("old")
        os.utime(folder / f"{i}.log", (1000 + i, 1000 + i))
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.splitlines() == [f"line {i}" for i in range(400)], result.stderr[-3000:]
    log = Path(result.stdout.strip()).read_text()
    assert Path(result.stdout.strip()).parent == folder
    assert sorted(p.name for p in folder.glob("*.log")) == sorted(
        [f"{i}.log" for i in range(5, 25)] + [Path(result.stdout.strip()).name]
    )
    # none of this process's own lines (a worker's traceback at exit, "line 95, in worker", may be there)
    assert "Setting default log level" in log and not {f"line {i}" for i in range(400)} & set(log.splitlines())


def test_no_task_begins_once_ctrl_c_came(spark: Any) -> None:
    """A Ctrl-C that lands once the session is made but before a job begins: cancelling stops only
    running jobs, so the data plane's tasks must not begin at all (the fail-back's mover)."""
    import pyarrow as pa

    from ferry.spark import session, tasks

    schema = pa.schema([("i", pa.int64())])
    assert tasks.per_task(spark, 2, lambda i: {"i": i}, schema) == [{"i": 0}, {"i": 1}]
    session.interrupt()
    try:
        with pytest.raises(KeyboardInterrupt):
            tasks.per_task(spark, 2, lambda i: {"i": i}, schema)
    finally:
        session.clear_interrupt()
    assert tasks.per_task(spark, 1, lambda i: {"i": i}, schema) == [{"i": 0}]
