"""Benchmark: ferry's Spark audit against the same reconciliation in DuckDB, same data, same run.

A ledger of N rows and a tier of about N rows with 0.1 % injected faults
(0.025 % each: lost, duplicated, corrupted, unexpected). Each engine runs in its
own process; wall time, rows/s and peak memory (RSS of the whole process tree)
are measured from outside. The two engines must report the same counts.

    .venv/bin/python -m bench.audit                 # 10,000,000 rows
    .venv/bin/python -m bench.audit --quick         # 1,000,000 rows
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._util import PeakRss, mb

T0 = 1_800_000_000_000_000_000


def generate(root: Path, n: int) -> None:
    import duckdb

    (root / "ledger").mkdir()
    con = duckdb.connect()
    con.execute(f"""COPY (
        SELECT 'r-p' || (i % 10) || '-' || (i // 10) AS id, 'r' AS run, (i % 10)::INTEGER AS producer,
               (i // 10)::BIGINT AS seq, 's.' || (i % 100) AS subject, ({T0} + i * 100000)::BIGINT AS sent_ns,
               'acked' AS outcome, NULL::BIGINT AS ack_ns, NULL::BIGINT AS stored_seq, NULL::VARCHAR AS error,
               substr(sha256('payload-' || i), 1, 16) AS hash, 32::INTEGER AS size
        FROM range({n}) t(i)) TO '{root}/ledger/part-0.parquet' (FORMAT parquet)""")
    # tier rows: every ledger row except the lost ones, in sequence order, then duplicates and strangers
    con.execute(f"""COPY (
        WITH kept AS (
            SELECT i, i % 4000 AS f FROM range({n}) t(i) WHERE i % 4000 <> 1
            UNION ALL SELECT i, -1 FROM range({n}) t(i) WHERE i % 4000 = 2
        )
        SELECT 's.' || (i % 100) AS subject,
               CASE WHEN f = 3 THEN ('corrupt-' || i)::BLOB ELSE ('payload-' || i)::BLOB END AS payload,
               MAP {{'Ferry-Id': 'r-p' || (i % 10) || '-' || (i // 10)}} AS headers,
               'r-p' || (i % 10) || '-' || (i // 10) AS msg_id, 'east/S' AS source,
               (row_number() OVER (ORDER BY f = -1, i))::BIGINT AS source_seq,
               make_timestamp((({T0} + i * 100000 + 2000000) // 1000)::BIGINT) AS timestamp,
               NULL::STRUCT(content_type VARCHAR) AS properties
        FROM kept
        UNION ALL
        SELECT 's.0', 'stranger'::BLOB, MAP {{'Ferry-Id': 'stranger-' || i}}, 'stranger-' || i, 'east/S',
               ({n} * 2 + i)::BIGINT, NULL::TIMESTAMP, NULL::STRUCT(content_type VARCHAR)
        FROM range({n} // 4000) t(i)
    ) TO '{root}/tier.parquet' (FORMAT parquet)""")


def run_spark(root: Path) -> dict[str, Any]:
    from ferry.jobs.proof.audit import audit
    from ferry.spark.session import get_session

    spark = get_session(app_name="bench audit", light_jvm=False, **{"spark.driver.memory": "6g"})
    t0 = time.monotonic()
    report = audit(spark, str(root / "ledger"), {"t": spark.read.parquet(str(root / "tier.parquet"))})
    seconds = time.monotonic() - t0
    t = report["tiers"]["t"]
    return {"seconds": seconds, "counts": {k: t[k] for k in _KEYS}}


_KEYS = ["lost", "extra_copies", "duplicated", "corrupted", "unexpected", "reordered", "tier_messages"]

_DUCKDB_SQL = """
CREATE VIEW led AS SELECT id, producer, seq, sent_ns, outcome, hash AS l_hash,
    (floor(sent_ns / 10e9) * 10)::BIGINT AS bucket FROM read_parquet('{root}/ledger/*.parquet');
CREATE VIEW tier AS SELECT coalesce(headers['Ferry-Id'], msg_id) AS id, source, source_seq AS pos,
    subject AS t_subject, substr(sha256(payload), 1, 16) AS t_hash,
    CASE WHEN properties IS NULL THEN timestamp END AS stored_at FROM read_parquet('{root}/tier.parquet');
CREATE TABLE tl AS SELECT t.*, l.l_hash, l.producer, l.seq, l.sent_ns,
    l.l_hash IS NOT NULL AS known, l.l_hash IS NOT NULL AND t.t_hash <> l.l_hash AS corrupted,
    coalesce(l.seq < max(l.seq) OVER (PARTITION BY source, t_subject, l.producer ORDER BY pos
        ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), false) AS reordered,
    (epoch_us(stored_at) * 1000 - l.sent_ns) / 1e6 AS delay_ms
    FROM tier t LEFT JOIN led l USING (id);
CREATE TABLE lc AS SELECT led.*, c.copies, c.corrupt, c.reord, c.copies IS NOT NULL AS present FROM led
    LEFT JOIN (SELECT id, count(*) AS copies, max(corrupted::INT) AS corrupt, max(reordered::INT) AS reord
               FROM tl WHERE known GROUP BY id) c USING (id);
"""


def run_duckdb(root: Path) -> dict[str, Any]:
    import duckdb

    con = duckdb.connect()
    t0 = time.monotonic()
    con.execute(_DUCKDB_SQL.format(root=root))
    buckets = con.execute("""SELECT bucket, count(*), sum((NOT present AND outcome IN ('acked','not_asked'))::INT),
        sum((copies > 1)::INT), sum(greatest(copies - 1, 0)), sum((corrupt = 1)::INT), sum((reord = 1)::INT)
        FROM lc GROUP BY bucket ORDER BY bucket""").fetchall()
    extra = con.execute("""SELECT sum((NOT known)::INT), count(*), quantile_cont(delay_ms, [0.5, 0.9, 0.99]),
        max(delay_ms) FROM tl""").fetchone()
    con.execute("SELECT id FROM lc WHERE NOT present ORDER BY id LIMIT 10000").fetchall()
    con.execute("SELECT id FROM lc WHERE copies > 1 ORDER BY id LIMIT 10000").fetchall()
    con.execute("SELECT id FROM lc WHERE corrupt = 1 ORDER BY id LIMIT 10000").fetchall()
    seconds = time.monotonic() - t0
    totals = [sum(int(b[k] or 0) for b in buckets) for k in range(2, 7)]
    counts = dict(zip(["lost", "duplicated", "extra_copies", "corrupted", "reordered"], totals, strict=True))
    counts |= {"unexpected": int(extra[0]), "tier_messages": int(extra[1])}
    return {"seconds": seconds, "counts": {k: counts[k] for k in _KEYS}}


def measure(engine: str, root: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.audit", "--engine", engine, "--root", str(root)],
        stdout=subprocess.PIPE,
        text=True,
    )
    with PeakRss(root=proc.pid) as peak:
        out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{engine} failed")
    result = json.loads(out.strip().splitlines()[-1])
    return {
        **result,
        "wall": time.monotonic() - t0,
        "peak_rss": peak.peak,
        "cpu": peak.cpu,
        "cpu_by_role": peak.cpu_by_role,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--quick", action="store_true", help="1,000,000 rows")
    parser.add_argument("--engine", choices=["spark", "duckdb"], help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        print(json.dumps((run_spark if args.engine == "spark" else run_duckdb)(args.root)))
        return
    n = 1_000_000 if args.quick else args.rows
    with tempfile.TemporaryDirectory(prefix="ferry-bench-audit-") as tmp:
        root = Path(tmp)
        print(f"generating a {n:,}-row ledger and tier with 0.1 % faults", flush=True)
        generate(root, n)
        duck = measure("duckdb", root)
        spark = measure("spark", root)
    if duck["counts"] != spark["counts"]:
        raise SystemExit(f"the engines disagree: duckdb {duck['counts']} spark {spark['counts']}")
    print(f"\ncounts (both engines): {spark['counts']}\n")
    print(
        f"{'engine':18} {'audit s':>8} {'rows/s':>12} {'ratio':>6} {'process wall s':>15} {'cpu s':>7} {'peak RSS':>10}"
    )
    for name, r in (("duckdb (anchor)", duck), ("ferry spark audit", spark)):
        print(
            f"{name:18} {r['seconds']:>8.1f} {2 * n / r['seconds']:>12,.0f} {r['seconds'] / duck['seconds']:>5.2f}x "
            f"{r['wall']:>15.1f} {r['cpu']:>7.1f} {mb(r['peak_rss']):>10}"
        )


if __name__ == "__main__":
    main()
