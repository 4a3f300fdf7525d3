"""Where `ferry failback --engine spark` spends its time: 10 queues x 10,000 on the rabbit-dr lab.

Each run loads the queues afresh (bench.failback's `reset` and `load`), runs
`ferry failback --from ltm --to pc1 --engine spark --json` in its own process and
prints its events, stamped in seconds since the process started ("first moved" is
the first progress event with messages moved: progress is polled every 0.5 s, so
it is up to that late), then checks the result (bench.failback's `check`).

    .venv/bin/python -m bench.failback_phases            # 3 runs
    .venv/bin/python -m bench.failback_phases --runs 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

from bench import failback as bf
from bench._util import lab_root
from ferry import lab
from ferry.topology import load_topology

QUEUES, PER_QUEUE = 10, 10_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    root = lab_root()
    walls = []
    try:
        state = lab.up("rabbit-dr", root, log=lambda _: None)
        topology = state.path / "topology.yaml"
        topo = load_topology(topology)
        queues = [f"fed-{i}" for i in range(QUEUES)]
        for run in range(args.runs):
            asyncio.run(bf.reset(topo, queues))
            bf.load(topology, QUEUES, PER_QUEUE, root / f"ledger-{run}")
            cmd = [sys.executable, "-m", "ferry", "failback", "--from", "ltm", "--to", "pc1"]
            cmd += ["--engine", "spark", "--json"]
            t0 = time.monotonic()
            env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            moved = False
            for line in p.stderr or ():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") != "progress":
                    print(f"{time.monotonic() - t0:7.2f} {event.get('event')}", flush=True)
                elif event.get("moved", 0) > 0 and not moved:
                    moved = True
                    print(f"{time.monotonic() - t0:7.2f} first moved ({event['moved']:,})", flush=True)
            if p.wait() != 0:
                raise SystemExit(f"ferry failback exited {p.returncode}")
            walls.append(time.monotonic() - t0)
            print(f"{walls[-1]:7.2f} exit", flush=True)
            asyncio.run(bf.check(topo, queues, PER_QUEUE))
    finally:
        lab.down(root=root, log=lambda _: None)
    print("wall s: " + ", ".join(f"{w:.2f}" for w in sorted(walls)))


if __name__ == "__main__":
    main()
