"""Topologies for the tests of `ferry serve` that need no broker."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ferry.topology import Topology, load_topology

# VALID where nothing listens: serve can read no journal


@pytest.fixture
def topology_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Topology]:
    """Load a topology file of the given text, its password variables set."""
    for var in ("FERRY_T_APP", "FERRY_T_SYS", "FERRY_T_LTM"):
        monkeypatch.setenv(var, "secret")

    def load(text: str) -> Topology:
        path = tmp_path / "t.yaml"
        path.write_text(text)
        return load_topology(path)

    return load
