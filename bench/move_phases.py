"""Where `ferry move`'s time goes: one move under bench.move's load, each phase timed.

    .venv/bin/python -m bench.move_phases            # 3,500 msg/s per producer, 1 move
    .venv/bin/python -m bench.move_phases --rate 12000 --runs 2
    .venv/bin/python -m bench.move_phases --quick    # 5,000 prefilled (what `make bench` runs)

Prints a line per phase (seconds since the move began, and its own duration). The
phases are ferry's own functions, wrapped with a timer: nothing else changes.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from typing import Any

from bench import move as bm
from bench._util import lab_root
from ferry import lab
from ferry.jobs import move as mv
from ferry.jobs.shared.guard import Guard, Stored
from ferry.topology import load_topology

T0 = [0.0]


def stamp(what: str) -> None:
    print(f"{time.monotonic() - T0[0]:7.3f} {what}", flush=True)


def timed(owner: Any, name: str, label: str) -> None:
    """Replace owner.name (sync or async) with a copy that stamps its duration."""
    f = getattr(owner, name)
    if asyncio.iscoroutinefunction(f):

        @functools.wraps(f)
        async def wrapper(*a: Any, **k: Any) -> Any:
            t = time.monotonic()
            r = await f(*a, **k)
            stamp(f"{label} {time.monotonic() - t:.3f}s")
            return r
    else:

        @functools.wraps(f)
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.monotonic()
            r = f(*a, **k)
            stamp(f"{label} {time.monotonic() - t:.3f}s")
            return r

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=int, default=3500, help="per producer, as bench.move")
    parser.add_argument("--prefill", type=int, default=40_000)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="5,000 prefilled (as bench.move --quick)")
    args = parser.parse_args()
    if args.quick:
        args.prefill = 5_000
    for name in ("preflight", "snapshot", "_watch", "reconcile", "read_captures", "missing", "_settle"):
        timed(mv, name, name)
    timed(Guard, "start", "guard.start")
    timed(Stored, "since", "stored since")
    root = lab_root()
    try:
        lab.up("supercluster", root, log=lambda _: None)
        topology = root / "topology.yaml"
        topo = load_topology(topology)
        for run in range(args.runs):
            name = f"PHASES{run}"
            asyncio.run(bm.make(topo, name, args.prefill))
            out = root / f"w{run}"
            out.mkdir()
            procs = bm.loads(topology, name, args.rate, out)
            time.sleep(3)
            T0[0] = time.monotonic()
            req = mv.MoveRequest(stream=name, to="west", state_dir=out / "state")
            res = asyncio.run(
                mv.move(
                    topo.nats("west"),
                    req,
                    emit=lambda ev, **d: stamp(ev + (f" {d}" if ev in ("handoff", "leader") else "")),
                )
            )
            stamp(f"total, captured {res.captured}, missed {res.missed}")
            for p in procs:
                p.wait(timeout=120)
    finally:
        lab.down(root=root, log=lambda _: None)


if __name__ == "__main__":
    main()
