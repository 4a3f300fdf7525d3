"""Where a fresh Spark session's start-up goes: each step of `get_session()` and three small jobs.

    .venv/bin/python -m bench.spark_start         # the session ferry copy uses (data sources registered)
    .venv/bin/python -m bench.spark_start --rdd   # fail-back's: no data sources, then RDD jobs

Prints seconds since the start at each step. Run it a few times: the first run
of a Python environment also writes the class archive.
"""

from __future__ import annotations

import sys
import time

T0 = time.monotonic()


def stamp(what: str) -> None:
    print(f"{time.monotonic() - T0:6.2f} {what}", flush=True)


def imports(batches):  # type: ignore[no-untyped-def]
    import ferry.jobs.copy.run  # noqa: F401  what a mover's Python worker imports

    yield from batches


def main() -> None:
    from ferry.spark import session as fs

    rdd = "--rdd" in sys.argv[1:]
    stamp("imports")
    launch, register = fs._launch_jvm, fs.register

    def launched(options: dict[str, str]) -> None:
        launch(options)
        stamp("JVM up (gateway answers)")

    def registered(session: object) -> None:
        stamp("getOrCreate done")
        register(session)
        stamp("data sources registered")

    fs._launch_jvm, fs.register = launched, registered
    spark = fs.get_session(data_sources=not rdd)
    if rdd:
        stamp("getOrCreate done")
        sc = spark.sparkContext
        sc.parallelize(range(2), 2).mapPartitions(imports).collect()
        stamp("first Python RDD job")
        sc.parallelize(range(2), 2).mapPartitions(imports).collect()
        stamp("second Python RDD job")
    else:
        spark.range(2).count()
        stamp("first SQL job")
        spark.range(0, 2, 1, 2).mapInArrow(imports, "id long").collect()
        stamp("first mapInArrow job")
        spark.range(0, 2, 1, 2).mapInArrow(imports, "id long").collect()
        stamp("second mapInArrow job")


if __name__ == "__main__":
    main()
