"""Pure logic of shipping ferry to executors: the executor's unpacking, the check's one-liners."""

from __future__ import annotations

import os
import stat
import sys
import zipfile
from pathlib import Path

import pytest

from ferry.shipped import unpacked
from ferry.spark.ship import _executor_error, is_local


def _zip(tmp: Path) -> Path:
    path = tmp / "ferry-0.1.0-abc.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("ferry/__init__.py", "")
        z.writestr("dep/__init__.py", "X = 1\n")
    return path


def test_a_zip_unpacks_once_into_a_folder_of_this_users_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    z = _zip(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path[:1], str(z), *sys.path[1:]])
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    folder = unpacked(f"{z}/ferry/__init__.py")
    root = tmp_path / "tmp" / f"ferry-{os.getuid()}" / z.name
    assert folder == str(root / "ferry") and (root / "dep" / "__init__.py").read_text() == "X = 1\n"
    assert stat.S_IMODE((root.parent).stat().st_mode) == 0o700
    assert sys.path.index(str(root)) < sys.path.index(str(z))  # the unpacked copy is found first
    (root / "dep" / "marker").write_text("kept")
    assert unpacked(f"{z}/ferry/__init__.py") == folder and (root / "dep" / "marker").exists()  # not again


def test_a_shared_temporary_folder_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    z = _zip(tmp_path)
    shared = tmp_path / "tmp" / f"ferry-{os.getuid()}"
    shared.mkdir(parents=True)
    shared.chmod(0o777)  # anyone could have put code there
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    assert unpacked(f"{z}/ferry/__init__.py") == f"{z}.d/ferry"  # beside the zip instead
    assert not any(shared.iterdir())


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            "Lost task 0.0 in stage 0.0 (TID 0) (10.0.0.7 executor 1): org.apache.spark.SparkException: "
            "[PYTHON_VERSION_MISMATCH] Python in worker has different version: 3.12 than that in driver: 3.11",
            "Spark executor on 10.0.0.7 runs another Python than ferry's driver: Python 3.12, the driver 3.11",
        ),
        (
            'Lost task 1.0 (TID 3) (worker-2 executor 0): java.io.IOException: Cannot run program "/opt/py/bin/python"',
            "Spark executor on worker-2 cannot start /opt/py/bin/python (no such program there)",
        ),
        ("something else entirely", "Spark executor on a worker failed ferry's first task: boom"),
    ],
)
def test_a_failed_check_is_one_line_naming_the_host(text: str, line: str) -> None:
    assert _executor_error(Exception(text), "boom").message == line


def test_only_a_local_master_runs_without_shipping() -> None:
    assert is_local(None, None) and is_local("local[2]", None)
    assert not is_local("spark://h:7077", None) and not is_local(None, "sc://h:15002")


def test_a_clusters_own_settings_override_ferrys_tuning_not_its_guarantees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ferry.spark.session import _CONF, _tuned

    executors = {"spark.executor.extraJavaOptions": "-XX:+UseParallelGC"}
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    assert _tuned(_CONF | executors) == _CONF | executors  # no spark-defaults.conf there
    (tmp_path / "spark-defaults.conf").write_text(
        "# the cluster's client settings\n"
        "spark.executor.extraJavaOptions   -XX:+UseG1GC -Dcorp.proxy=1\n"
        "spark.sql.shuffle.partitions=64\n"
        "spark.task.maxFailures: 4\n"
    )
    tuned = _tuned(_CONF | executors)
    assert "spark.executor.extraJavaOptions" not in tuned and "spark.sql.shuffle.partitions" not in tuned
    assert tuned["spark.task.maxFailures"] == "1"  # a task that raises is ferry's to report, not retried


def test_a_cluster_sessions_line_names_its_application_and_what_was_shipped(capsys: pytest.CaptureFixture) -> None:
    from ferry.cli import render

    render.spark_event({"app_name": "ferry copy a -> b", "master": "local[*]", "app_id": "local-1"})
    assert capsys.readouterr().err == ""  # on this machine: nothing to say
    shipped = {"zip": "/x.zip", "bytes": 16_300_000, "ship_s": 4.04, "executors": []}
    render.spark_event({"master": "spark://m:7077", "app_id": "app-1", "shipped": shipped})
    render.spark_event({"master": "spark://m:7077", "app_id": "app-2"})
    assert capsys.readouterr().err.splitlines() == [
        "spark: app-1 on spark://m:7077; ferry shipped (16.3 MB), executors checked in 4.0s",
        "spark: app-2 on spark://m:7077; no Python tasks: nothing shipped",
    ]
