"""The audit's delay summary from fine bins (pure logic; the Spark side is in tests/spark/test_audit.py)."""

from __future__ import annotations

import math
import random

import pytest

from ferry.jobs.proof.audit import _DELAY_FLOOR, _DELAY_STEPS, _delay_summary


def _bins(delays: list[float]) -> list[dict]:
    """What the audit's aggregation gives: per fine bin, its count and its smallest and largest delay."""
    bins: dict[int, list[float]] = {}
    for d in delays:
        bins.setdefault(math.ceil(math.log2(max(d, _DELAY_FLOOR)) * _DELAY_STEPS), []).append(d)
    return [{"dbin": b, "delays": len(v), "dmin": min(v), "dmax": max(v)} for b, v in bins.items()]


def test_percentiles_are_within_a_bin_of_the_exact_ones() -> None:
    rng = random.Random(7)
    delays = [rng.lognormvariate(1.5, 1.2) for _ in range(20_000)]
    summary = _delay_summary(_bins(delays))
    assert summary is not None
    exact = sorted(delays)
    for p, key in ((0.5, "p50_ms"), (0.9, "p90_ms"), (0.99, "p99_ms")):
        assert summary[key] == pytest.approx(exact[int(p * len(exact)) - 1], rel=2 ** (1 / _DELAY_STEPS) - 1)
    assert summary["max_ms"] == round(max(delays), 2)


def test_equal_delays_are_exact_and_the_histogram_counts_each_doubling() -> None:
    summary = _delay_summary(_bins([3.0] * 10 + [1.0] * 5 + [0.2] * 2 + [4.0]))
    assert summary is not None
    assert summary["p50_ms"] == 3.0
    # <= 1 ms: 0.2 and 1.0 (a bin's upper edge is in it); <= 2: none; <= 4: 3.0 and 4.0
    assert [(h["le_ms"], h["count"]) for h in summary["histogram"]] == [(1, 7), (2, 0), (4, 11)]


def test_no_delays_no_summary() -> None:
    assert _delay_summary([]) is None
