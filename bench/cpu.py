"""Benchmark: CPU per message of every data-plane job against its native mover, in one run (issue 51).

CPU-µs per message, ferry's driver, JVM and Python workers apart, and the brokers' own processes
over the same interval, next to the native mover doing the same work on the same machine:

- copy, JetStream (R3 east -> R3 west): server-side stream sourcing against `ferry copy` ordered
  and with 2 partitions, each into a plain and a batched (``allow_batched``) stream
  (:mod:`bench.copy`'s cases; the ferry rows include the Spark session's start-up);
- copy, RabbitMQ (10 queues ltm -> pc1 and back): dynamic shovels against `ferry copy --drain`;
- relay (R1 east -> R1 west over the gateway): sourcing against `ferry replicate run`, each
  draining a backlog alone; the relay's CPU from its first progress report on (a relay runs for
  days: its start-up is not per message), its start-up apart;
- the move's guard and read-back: a :class:`~ferry.jobs.shared.guard.Guard` hears an R3 stream's
  subjects while `ferry load` publishes to it, then the stream is read back and compared with the
  capture (:func:`~ferry.jobs.shared.guard.missing`), each in a process of its own; no native
  mover (a placement move has no guard), the target is absolute;
- audit: DuckDB against ferry's Spark audit on the same ledger and tier (:mod:`bench.audit`).

Targets (issue 51), total CPU per message against the anchor: JetStream copy <= 1.5x sourcing,
RabbitMQ copy <= 1.0x shovels, relay <= 2x sourcing, audit <= 2.5x DuckDB, guard + read-back
<= 3 µs per message heard.

    .venv/bin/python -m bench.cpu                       # 300,000 messages, a 2,000,000-row audit
    .venv/bin/python -m bench.cpu --only relay,guard    # some of the jobs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import audit as audit_bench
from bench import copy as copy_bench
from bench import replicate as relay_bench
from bench._util import PeakRss, lab_root, save_rows
from ferry import lab
from ferry.topology import load_topology

ROLES = ("driver", "jvm", "python workers", "other")
JOBS = ("copy-jetstream", "copy-rabbitmq", "relay", "guard", "audit")
TARGETS = {"copy-jetstream": 1.5, "copy-rabbitmq": 1.0, "relay": 2.0, "audit": 2.5}
GUARD_TARGET_US = 3.0
PY_SPY = Path(sys.executable).with_name("py-spy")  # --profile's


def row(job: str, who: str, messages: int, roles: dict[str, float], brokers: float, **extra: Any) -> dict[str, Any]:
    """CPU seconds by role over `messages`; a mover inside the brokers has no client (`roles` empty)."""
    return {"job": job, "who": who, "messages": messages, "roles": roles, "brokers": brokers, **extra}


def copy_rows(root: Path, n: int, job: str) -> list[dict[str, Any]]:
    if job == "copy-jetstream":
        rows = copy_bench.bench_jetstream(root, n, 100, [2], [])
    else:
        rows = copy_bench.bench_rabbitmq(root, n, 100, [])
    return [row(job, r["who"], r["messages"], r.get("client_cpu_by_role") or {}, r["broker_cpu"]) for r in rows]


def relay_rows(root: Path, n: int) -> list[dict[str, Any]]:
    """Each mover drains a backlog of `n` alone (as :mod:`bench.replicate` does); CPU is counted
    while the destination goes from 10 % to 90 % of it, away from either end (a relay runs for
    days: neither its start-up nor its idle time is per message)."""
    state = lab.up("supercluster", root, log=lambda _: None)
    topology = state.path / "topology.yaml"
    topo = load_topology(topology)
    servers = [p.pid for p in state.procs if p.kind == "nats"]
    relay = None
    try:
        asyncio.run(relay_bench.make_streams(topo))
        for src in ("bench_f", "bench_n"):
            load = ["load", "jetstream://east", "--subject", f"{src}.{{n}}", "--count", str(n), "--producers", "4"]
            relay_bench.run_ferry(topology, *load, "--ledger", str(root / f"backlog-{src}"))
        with PeakRss(pids=servers) as native:
            asyncio.run(relay_bench.source_natively(topo))
            moved, _, native_brokers = _middle(topo, "BENCH_N_W", n, native, None)
        anchor = row("relay", "stream sourcing (anchor)", moved, {}, native_brokers)
        start = ["replicate", "start", "--from", "east", "--to", "west", "--streams", "BENCH_F"]
        relay_bench.run_ferry(topology, *start, "--stream-name", "{stream}_W", "--subject-prefix", "relay.")
        env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
        argv = [*relay_bench.FERRY, "replicate", "run", "--from", "east", "--to", "west", "--json"]
        with PeakRss(pids=servers) as brokers:
            relay = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
            with PeakRss(root=relay.pid) as client:
                moved, roles, relay_brokers = _middle(topo, "BENCH_F_W", n, brokers, client)
        return [anchor, row("relay", "ferry replicate run", moved, roles, relay_brokers)]
    finally:
        if relay:
            os.killpg(relay.pid, signal.SIGKILL)
            relay.wait(timeout=30)
        lab.down("supercluster", root, log=lambda _: None)


def _middle(
    topo: Any, stream: str, n: int, brokers: PeakRss, client: PeakRss | None, timeout: float = 600
) -> tuple[int, dict[str, float], float]:
    """Once west's `stream` holds 10 % of `n` and again at 90 %: the messages stored in between,
    and the client's CPU by role and the brokers' CPU in between."""
    marks: list[tuple[int, dict[str, float], float]] = []
    deadline = time.monotonic() + timeout
    for share in (0.1, 0.9):
        while (held := relay_bench.count(topo, "west", stream)) < share * n:
            if time.monotonic() > deadline:
                raise SystemExit(f"{stream} holds {held:,} of {n:,} after {timeout:.0f} s")
            time.sleep(0.02)
        for tracker in (brokers, client):
            if tracker:
                tracker.sample()
        marks.append((held, dict(client.cpu_by_role) if client else {}, brokers.cpu))
    (n0, roles0, b0), (n1, roles1, b1) = marks
    return n1 - n0, {k: v - roles0.get(k, 0.0) for k, v in roles1.items()}, b1 - b0


def guard_rows(root: Path, n: int, rate: int = 10_000, profile: Path | None = None) -> list[dict[str, Any]]:
    """The guard hears `n` messages published at `rate`; then they are read back and compared.
    `profile`: each of the two processes runs under py-spy, its samples in that folder."""
    state = lab.up("supercluster", root, log=lambda _: None)
    topology = state.path / "topology.yaml"
    topo = load_topology(topology)
    try:
        asyncio.run(copy_bench._stream(topo, "east", "GUARDED", subjects=["guarded.>"]))
        work = Path(tempfile.mkdtemp(dir=root))
        env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
        me = [sys.executable, "-m", "bench.cpu", "--role"]

        def spied(role: str) -> list[str]:
            if not profile:
                return [*me, role, str(work)]
            profile.mkdir(parents=True, exist_ok=True)
            spy = [str(PY_SPY), "record", "-r", "250", "-f", "raw", "--gil"]
            return [*spy, "-o", str(profile / f"{role}.txt"), "--", *me, role, str(work)]

        guard = subprocess.Popen(spied("guard"), env=env, stdout=subprocess.PIPE, text=True)
        assert guard.stdout is not None
        while (line := guard.stdout.readline()) and line.strip() != "listening":  # py-spy says things first
            pass
        assert line, "the guard did not start"
        load = ["load", "jetstream://east", "--subject", "guarded.{n}", "--count", str(n), "--rate", str(rate)]
        relay_bench.run_ferry(topology, *load, "--producers", "4", "--ledger", str(work / "ledger"))
        os.kill(_listener(guard.pid), signal.SIGTERM)
        heard = _last_json(guard.communicate(timeout=120)[0])
        back = subprocess.run(spied("read-back"), env=env, capture_output=True, text=True, check=True)
        read = _last_json(back.stdout)
        if read["missing"]:
            raise SystemExit(f"the read-back finds {read['missing']} of {heard['heard']:,} heard missing")
        return [
            row("guard", "guard (hearing)", heard["heard"], {"driver": heard["cpu"]}, 0.0),
            row("guard", "read-back and compare", heard["heard"], {"driver": read["cpu"]}, 0.0),
        ]
    finally:
        lab.down("supercluster", root, log=lambda _: None)


def _last_json(out: str) -> dict[str, Any]:
    """A role's result: its last line that is JSON (py-spy's own lines come after)."""
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def _listener(pid: int) -> int:
    """The guard's own process: `pid`, or its child when py-spy runs it."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return (
        int(children[0])
        if children and not Path(f"/proc/{pid}/cmdline").read_bytes().startswith(sys.executable.encode())
        else pid
    )


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def role_guard(work: Path) -> None:
    """In a process of its own: listen until SIGTERM; print the messages heard and the CPU it took."""
    from ferry.jobs.shared.guard import Guard

    cluster = load_topology(Path(os.environ["FERRY_TOPOLOGY"])).nats("east")

    async def go() -> dict[str, Any]:
        guard = Guard(cluster, ["guarded.>"], work / "capture" / "0.arrow")
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await guard.start(led_in="east")
        cpu0 = _own_cpu()
        print("listening", flush=True)
        await stop.wait()
        await guard.stop()
        return {"cpu": _own_cpu() - cpu0}

    result = asyncio.run(go())
    from ferry.jobs.shared.guard import read_captures

    print(json.dumps({**result, "heard": read_captures(work / "capture").num_rows}))


def role_read_back(work: Path) -> None:
    """In a process of its own: read the stream back and compare it with the capture, as a move's
    reconcile does (:func:`~ferry.jobs.shared.guard.reconcile`, without re-publishing)."""
    from ferry.brokers import nats as bnats
    from ferry.brokers.nats.jsapi import stream_info
    from ferry.jobs.shared.guard import Stored, missing, read_captures

    cluster = load_topology(Path(os.environ["FERRY_TOPOLOGY"])).nats("east")

    async def go() -> dict[str, Any]:
        cpu0 = _own_cpu()
        async with bnats.session(cluster) as nc:
            last = (await stream_info(nc, "GUARDED"))["state"]["last_seq"]
        async with Stored(cluster, "GUARDED") as reader:
            stored = await reader.since(0, last)
        rows, _ = missing(read_captures(work / "capture"), stored)
        return {"cpu": _own_cpu() - cpu0, "missing": len(rows)}

    print(json.dumps(asyncio.run(go())))


def audit_rows(rows_n: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="ferry-bench-cpu-audit-") as tmp:
        root = Path(tmp)
        audit_bench.generate(root, rows_n)
        duck, spark = audit_bench.measure("duckdb", root), audit_bench.measure("spark", root)
    if duck["counts"] != spark["counts"]:
        raise SystemExit(f"the engines disagree: duckdb {duck['counts']} spark {spark['counts']}")
    messages = 2 * rows_n  # a ledger row and a tier row each
    return [
        row("audit", "duckdb (anchor)", messages, duck["cpu_by_role"], 0.0),
        row("audit", "ferry audit (spark)", messages, spark["cpu_by_role"], 0.0),
    ]


def total(r: dict[str, Any]) -> float:
    return sum(r["roles"].values()) + r["brokers"]


def report(rows: list[dict[str, Any]]) -> None:
    print(f"\nCPU-µs per message ({', '.join(ROLES)}: ferry's process tree; brokers: the servers' own)")
    print(f"{'job':15} {'who':32} {'messages':>9} " + " ".join(f"{r:>14}" for r in (*ROLES, "brokers", "all")))
    anchors = {r["job"]: total(r) / r["messages"] for r in rows if "anchor" in r["who"]}
    for r in rows:
        per = [r["roles"].get(x, 0.0) for x in ROLES] + [r["brokers"], total(r)]
        line = f"{r['job']:15} {r['who']:32} {r['messages']:>9,} " + " ".join(
            f"{v / r['messages'] * 1e6:>14.1f}" for v in per
        )
        if r["job"] in anchors and "anchor" not in r["who"]:
            ratio = total(r) / r["messages"] / anchors[r["job"]]
            line += f"  {ratio:.2f}x (target <= {TARGETS[r['job']]}x)"
        if "startup_s" in r:
            line += f"  start-up {r['startup_s']} CPU-s apart"
        print(line)
    guard = [r for r in rows if r["job"] == "guard"]
    if guard:
        us = sum(total(r) for r in guard) / guard[0]["messages"] * 1e6
        print(f"\nguard + read-back: {us:.1f} µs per message heard (target <= {GUARD_TARGET_US})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--audit-rows", type=int, default=2_000_000)
    parser.add_argument("--only", default=",".join(JOBS), help=f"some of {', '.join(JOBS)}")
    parser.add_argument("--profile", type=Path, help="py-spy the guard and the read-back: raw samples in this folder")
    parser.add_argument("--role", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        {"guard": role_guard, "read-back": role_read_back}[args.role[0]](Path(args.role[1]))
        return
    if args.profile and not PY_SPY.exists():
        raise SystemExit(f"--profile needs py-spy beside this Python: {PY_SPY.parent}/pip install py-spy")
    only = set(args.only.split(","))
    if unknown := only - set(JOBS):
        raise SystemExit(f"--only: unknown job(s) {', '.join(sorted(unknown))} (known: {', '.join(JOBS)})")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the labs below are taken down
    root = lab_root()
    rows: list[dict[str, Any]] = []
    try:
        for job in ("copy-jetstream", "copy-rabbitmq"):
            if job in only:
                rows += copy_rows(root, args.messages, job)
        if "relay" in only:
            rows += relay_rows(root, args.messages)
        if "guard" in only:
            rows += guard_rows(root, args.messages, profile=args.profile)
        if "audit" in only:
            rows += audit_rows(args.audit_rows)
    finally:
        lab.down(root=root, log=lambda _: None)
    report(rows)
    print(f"saved {save_rows('cpu', rows)}")


if __name__ == "__main__":
    main()
