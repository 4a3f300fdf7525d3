"""A move's standby guard: ``ferry serve`` listens beside the move's own guard, so that a driver
killed between two runs leaves no unguarded gap.

While a move is ``starting`` or ``moving`` and its ferry runs with the state directory of
``ferry serve`` (``$FERRY_STATE_DIR``: the same path, on the same host or one both mount), serve
runs a second :class:`~ferry.jobs.shared.guard.Guard` on the stream's subjects into the move's
capture directory
(``standby-<host>-<pid>-<start, ns>.arrow``). When the driver dies, serve adopts the move (its own run
of :func:`ferry.jobs.move.move`, which resumes from the journal); the reconciliation reads both
kinds of capture (:func:`~ferry.jobs.shared.guard.read_captures`: the standby's rows count only
beyond what the drivers heard), so what was published between the kill and the adoption is
heard all the same.

A serve announces itself in the state directory (``serve/<host>-<pid>.json``, rewritten every
few seconds, with the NATS servers whose journals it reads); a move's plan says whether one runs
for its cluster (:func:`standby_ferries`), and, if none does, that a killed driver leaves core
publishes unguarded until it runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferry.jobs.shared.guard import STANDBY, Guard, state_root
from ferry.journal import Journal, owner_alive
from ferry.topology import NatsCluster

ANNOUNCE_EVERY = 2.0  # seconds between two writes of serve's announcement
MOVING = ("starting", "moving")  # the phases in which a standby guard listens


def reachable(st: dict[str, Any]) -> bool:
    """Whether this process shares the state directory of the move on record `st` (the same path,
    on this host or mounted here too): then it may stand by and adopt."""
    owner = st.get("owner") or {}
    return st.get("state_dir") == str(state_root()) and (
        Path(st["capture_dir"]).is_dir() or owner.get("host") == socket.gethostname()
    )


def guarded(st: dict[str, Any]) -> bool:
    """A move on record whose driver runs a guard a standby may stand beside."""
    return st.get("phase") in MOVING and bool(st.get("subjects")) and st.get("guard", True) and reachable(st)


async def stand_by(cluster: NatsCluster, st: dict[str, Any], moving: Callable[[], bool]) -> None:
    """Listen to the move's subjects into its capture directory while `moving()` says it still
    moves; then stop, and remove this file (and the directory) if the move has ended meanwhile
    (its driver removes the directory once reconciled)."""
    directory = Path(st["capture_dir"])
    path = directory / f"{STANDBY}-{socket.gethostname()}-{os.getpid()}-{time.time_ns()}.arrow"
    guard = Guard(cluster, list(st["subjects"]), path.with_suffix(".starting"))
    try:
        await guard.start()
        guard.path = guard.path.rename(path)  # named once it listens: the driver waits for that name
        while moving():
            await asyncio.sleep(0.2)
    finally:
        await guard.stop()
        path.with_suffix(".starting").unlink(missing_ok=True)
        if not moving() and not any(directory.glob("capture-*.arrow")):
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                directory.rmdir()


def listened_since(directory: Path) -> float | None:
    """When the first standby guard in a move's capture `directory` started listening (epoch s), if any."""
    starts = [int(f.stem.rsplit("-", 1)[1]) / 1e9 for f in directory.glob(f"{STANDBY}-*.arrow")]
    return min(starts) if starts else None


def _announcements(root: Path | None = None) -> Path:
    return state_root(root) / "serve"


async def announce(urls: list[str], root: Path | None = None) -> None:
    """Say, in the state directory, that this process keeps standby guards (``ferry serve``) for the
    moves of the NATS servers at `urls` (those whose journals it reads), until cancelled."""
    folder = _announcements(root)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"{socket.gethostname()}-{os.getpid()}.json"
    try:
        while True:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"owner": Journal.owner(), "heartbeat": time.time(), "urls": urls}))
            tmp.replace(path)
            await asyncio.sleep(ANNOUNCE_EVERY)
    finally:
        path.unlink(missing_ok=True)


def standby_ferries(urls: list[str], root: Path | None = None) -> list[dict[str, Any]]:
    """The owners (host, pid) of the live ``ferry serve`` processes announced in the state directory
    that read the journal of a NATS cluster with a server at one of `urls`."""
    out = []
    for f in sorted(_announcements(root).glob("*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError):
            said = json.loads(f.read_text())
            if owner_alive(said, stale_after=3 * ANNOUNCE_EVERY) and set(urls) & set(said["urls"]):
                out.append(said["owner"])
    return out
