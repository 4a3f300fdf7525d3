"""Output directories a job writes (a copy's Parquet, a load's ledger): refused before anything
is read or sent when they cannot be written here."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ferry.errors import ConfigError


def check_writable(what: str, path: Path) -> None:
    """Raise ConfigError naming `what` when `path` (a directory, made later if missing) cannot be
    written: a directory is made in its nearest existing parent, and removed."""
    parent = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if not parent.is_dir():
        raise ConfigError(f"{what}: {parent} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ferry-probe-", dir=parent))
    except OSError as exc:
        raise ConfigError(f"{what}: cannot write under {parent} ({exc.strerror})") from None
