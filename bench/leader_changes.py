"""Stress, not speed: fast batch publishing (`BatchPublisher`) through stream leader changes.

Lab: the super-cluster. Each round makes an R3 stream in east (`allow_batched`, a
10 s duplicate window), publishes to it as fast as one `BatchPublisher` goes
while the stream's leader steps down three times, a second apart, then reads the
stream back and counts the message ids lost and stored twice. Also counted: the
messages the leader answered "in process" when they were sent again, the state a
leader change leaves ids in on the server that lost their proposals
(`publish._IN_PROCESS`): before commit 2d2e59f a batch counted those as stored.

    .venv/bin/python -m bench.leader_changes --rounds 30
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from nats.js.api import Placement, StreamConfig

from bench._util import lab_root
from ferry import lab
from ferry.brokers import nats as bnats
from ferry.brokers.nats.publish import BatchPublisher
from ferry.brokers.nats.reader import Range, ReadConfig, read_range, stream_states
from ferry.brokers.nats.wire import wire
from ferry.topology import Topology, load_topology


async def one_round(topo: Topology) -> dict[str, int]:
    east = topo.nats("east")
    async with bnats.session(east) as nc:
        jsm = nc.jsm()
        with contextlib.suppress(Exception):  # the first round has none
            await jsm.delete_stream("LC")
        await jsm.add_stream(
            StreamConfig(
                name="LC",
                subjects=["lc.>"],
                num_replicas=3,
                placement=Placement(cluster="east"),
                allow_batched=True,
                duplicate_window=10,
            )
        )

        async def stepdowns() -> None:
            for _ in range(3):
                await asyncio.sleep(1.0)
                await nc.request("$JS.API.STREAM.LEADER.STEPDOWN.LC", b"", timeout=10)

        stepper = asyncio.create_task(stepdowns())
        n = 0
        async with wire(east, "east") as w, BatchPublisher(w, ack_timeout=1.0, give_up_after=60) as pub:
            while not stepper.done() or n < 10_000:
                await pub.publish(f"lc.s{n % 7}", b"x" * 100, msg_id=f"m{n}")
                n += 1
                if n % 1000 == 0:
                    await asyncio.sleep(0)
        await stepper
    cfg = ReadConfig(cluster=east.model_dump_json(), name="east", streams=("LC",))
    st = (await stream_states(east, ["LC"], name="east"))["LC"]
    ids: list[int] = []
    async for batch in read_range(cfg, Range("LC", st["first_seq"], st["last_seq"], 2000)):
        ids += [int(dict(h)["Nats-Msg-Id"][1:]) for h in batch.column("headers").to_pylist()]
    return {
        "sent": n,
        "lost": len(set(range(n)) - set(ids)),
        "duplicated": len(ids) - len(set(ids)),
        "failed": pub.stats.failed,
        "sent_again": pub.stats.retries,
        "in_process": pub.stats.in_process,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    a = parser.parse_args()
    root = lab_root()
    totals: dict[str, int] = {}
    try:
        state = lab.up("supercluster", root, log=lambda _: None)
        topo = load_topology(state.path / "topology.yaml")
        for r in range(a.rounds):
            row = asyncio.run(one_round(topo))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v:,}" for k, v in row.items()), flush=True)
            for k, v in row.items():
                totals[k] = totals.get(k, 0) + v
            totals["rounds with in-process ids"] = totals.get("rounds with in-process ids", 0) + bool(row["in_process"])
    finally:
        lab.down(root=root, log=lambda _: None)
    print(f"{a.rounds} rounds: " + ", ".join(f"{k} {v:,}" for k, v in totals.items()))


if __name__ == "__main__":
    main()
