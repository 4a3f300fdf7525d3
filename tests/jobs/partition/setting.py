"""A repartition to kill, on the lab super-cluster: map v1 has one partition (stream `<P>`, R1 in
east) owning `<p>.eu.>` and `<p>.us.>`; map v2 splits `<p>.us.>` off to `<P>_US`. Numbered
messages are stored first, and acked JetStream publishes go on during the repartition. After the
rerun, every id is counted in the streams here: each once, in its owner only. Shared by the kill
test of test_partition.py and the fault matrix of test_faults.py, as is `forget`, which removes
what a partition test made."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from ferry import lab
from ferry.brokers import nats as bnats
from ferry.brokers.nats import jsapi
from ferry.jobs.partition.claims import KEY, open_claims, read_record
from tests.conftest import profile_topology
from tests.helpers import acked_ids, ferry, finish, read_stream, start_load


class Setting:
    def __init__(self, state: lab.LabState, tmp_path: Path, name: str, stored: int = 3000) -> None:
        self.topology, self.topo, self.name = state.path / "topology.yaml", profile_topology(state), name
        self.old, self.new = name.upper(), f"{name.upper()}_US"
        part = {"name": "all", "stream": self.old, "cluster": "east", "replicas": 1}
        self.v1, self.v2 = tmp_path / "v1.yaml", tmp_path / "v2.yaml"
        self.v1.write_text(yaml.safe_dump({"name": name, "partitions": [
            {**part, "patterns": [f"{name}.eu.>", f"{name}.us.>"]}]}))  # fmt: skip
        self.v2.write_text(yaml.safe_dump({"name": name, "partitions": [
            {**part, "patterns": [f"{name}.eu.>"]},
            {**part, "name": "us", "stream": self.new, "patterns": [f"{name}.us.>"]}]}))  # fmt: skip
        self.ledger = tmp_path / "ledger"
        self.load: subprocess.Popen | None = None
        ferry("partition", "apply", str(self.v1), topology=self.topology, check=True)
        self.stored = asyncio.run(self._publish(stored))

    async def _publish(self, n: int) -> set[str]:
        async with bnats.session(self.topo.nats("east")) as nc:
            js = nc.jetstream()
            for i in range(n):
                region = "us" if i % 2 else "eu"
                await js.publish(f"{self.name}.{region}.{i % 7}", b"x", headers={"Nats-Msg-Id": f"{self.name}-{i}"})
        return {f"{self.name}-{i}" for i in range(n)}

    def start_load(self) -> None:
        """Acked JetStream publishes to the moving subjects, 300 msg/s until :meth:`stop_load`."""
        subject = f"{self.name}.us.l{{n}}"
        self.load = start_load(self.topology, "jetstream://east", subject, self.ledger, 600, "--rate", "300",
                               "--until-signal")  # fmt: skip

    def stop_load(self) -> None:
        if self.load is not None:
            self.load.send_signal(signal.SIGTERM)
            finish(self.load)

    def apply(self, *extra: str) -> subprocess.CompletedProcess[str]:
        return ferry("partition", "apply", str(self.v2), "--execute", *extra, topology=self.topology, timeout=300)

    def counted(self) -> dict[str, Any]:
        """Each id counted in both streams: {"lost": ..., "twice": ..., "misplaced": ...} (misplaced: a
        us message in the old owner, or an eu one in the new)."""
        old = asyncio.run(read_stream(self.topo, "east", self.old))
        new = asyncio.run(read_stream(self.topo, "east", self.new))
        held = Counter(r["msg_id"] for r in old + new)
        sent = self.stored | (acked_ids(self.ledger) if self.ledger.exists() else set())
        misplaced = [r for r in old if ".us." in r["subject"]] + [r for r in new if ".eu." in r["subject"]]
        return {
            "lost": len(sent - set(held)),
            "twice": sum(n - 1 for n in held.values() if n > 1),
            "misplaced": len(misplaced),
            "held": sum(held.values()),
        }

    def on_record(self) -> dict[str, Any]:
        """The map's entry in the claims record, and its repartition's journal."""

        async def read() -> dict[str, Any]:
            async with bnats.session(self.topo.nats("east")) as nc:
                record, _ = await read_record(await open_claims(nc))
                kv = await nc.jetstream().key_value("ferry_ops")
                entry = await kv.get(f"partition.{self.name}")
                return {"claim": record["maps"].get(self.name), "journal": json.loads(entry.value)}

        return asyncio.run(read())

    def forget(self) -> None:
        """Remove the map's claim, journal and streams."""

        async def go() -> None:
            async with bnats.session(self.topo.nats("east")) as nc:
                await forget(nc, [self.name], [self.old, self.new])
                await (await nc.jetstream().key_value("ferry_ops")).delete(f"partition.{self.name}")

        asyncio.run(go())


async def forget(nc: Any, maps: list[str], streams: list[str]) -> None:
    """Remove what a test claimed and created (the claims record is shared by the lab's account)."""
    kv = await open_claims(nc)
    record, revision = await read_record(kv)
    for m in maps:
        record["maps"].pop(m, None)
    await kv.update(KEY, json.dumps(record).encode(), last=revision)
    for s in streams:
        with contextlib.suppress(Exception):
            await jsapi.api(nc, f"$JS.API.STREAM.DELETE.{s}")
