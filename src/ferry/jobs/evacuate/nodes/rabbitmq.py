"""The RabbitMQ backend of evacuation and rebalance: the management API (connections, queues),
the Erlang CLI (quorum leaders, maintenance mode) and the data plane's queue mover (classic queues
relocated)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from ferry.brokers.rabbitmq import Management, amqp_connect, q, queue_path
from ferry.brokers.rabbitmq.wire import QueueCounts
from ferry.errors import AuthError, BrokerUnavailable, ConfigError, FerryError, NotFound
from ferry.jobs.evacuate.nodes.base import CONTROL, RELOCATE_PREFIX, STALE_AFTER, Asset, Nodes, NodeView
from ferry.jobs.shared.events import Emit, no_emit
from ferry.journal import ParamJournal
from ferry.spark.session import SparkFactory, factory
from ferry.topology import RabbitCluster


class RabbitNodes(Nodes):
    """Counts and moves for the nodes of one RabbitMQ cluster (see the module docstring)."""

    moves_replicas = False  # a quorum member removed is not replaced: followers stay
    CLI_TIMEOUT = 120.0

    def __init__(self, name: str, cluster: RabbitCluster, avoid: list[str], spark: SparkFactory | None = None) -> None:
        self.name, self.cluster = name, cluster
        self.spark_factory = spark or factory(app_name=f"ferry evacuate {name}")
        self.brokers = {b.name: b for b in cluster.brokers}
        self.erlang = {b.name: b.node or f"rabbit@{urlsplit(b.url).hostname}" for b in cluster.brokers}
        self.by_erlang = {v: k for k, v in self.erlang.items()}
        self.avoid = avoid
        self.m: Management | None = None
        self.spark: Any = None  # a Spark session, started for the first classic queue to relocate
        # a classic queue's messages on its own node while they are relocated, (vhost, queue) ->
        # {"ready": counted there, "moved": since, "died": its node died meanwhile, "durable"}; and
        # what RabbitMQ itself lost once such a node came back (see _at_risk)
        self.at_risk: dict[tuple[str, str], dict[str, Any]] = {}
        self.lost_by_rabbitmq: list[dict[str, Any]] = []

    async def __aenter__(self) -> RabbitNodes:
        for b in self.reach_order():
            m = Management(self.cluster, b, name=self.name)
            try:
                await m.get("/overview", params={"columns": "cluster_name"})
            except BrokerUnavailable:
                await m.aclose()
                continue
            self.m = m
            return self
        raise BrokerUnavailable(f"{self.name}: no node's management API answers")

    async def __aexit__(self, *exc: object) -> None:
        if self.m:
            await self.m.aclose()

    def journal(self, key: str) -> ParamJournal:
        assert self.m
        return ParamJournal(self.m, key, stale_after=STALE_AFTER)

    async def view(self, node: str, jetstream: bool = True) -> NodeView:
        return (await self.views([node], jetstream))[node]

    async def views(self, nodes: list[str], jetstream: bool = True) -> dict[str, NodeView]:
        """One read of the cluster's nodes, connections (and queues) for all of `nodes`."""
        assert self.m
        out = {n: NodeView(n) for n in nodes}
        try:
            running = await self.m.get("/nodes", params={"columns": "name,running"})
            conns = await self.m.get("/connections", params={"columns": "name,node,protocol,client_properties"})
            queues = (
                await self.m.get(
                    "/queues", params={"columns": "name,vhost,type,node,leader,members,exclusive,auto_delete"}
                )
                if jetstream
                else []
            )
        except FerryError as exc:
            for v in out.values():
                v.error = str(exc)
            return out
        up = {n["name"] for n in running or [] if n.get("running")}
        for node, v in out.items():
            erl = self.erlang[node]
            if erl not in up:
                v.error = f"{erl} is not running"
                continue
            v.up, v.server_id = True, erl
            for c in conns or []:
                label = str((c.get("client_properties") or {}).get("connection_name") or "")
                if c.get("node") == erl and not label.startswith(CONTROL):
                    v.conns.append({"cid": c["name"], "name": label, "mqtt_client": "MQTT" in str(c.get("protocol"))})
            for x in queues or []:
                if x.get("type") == "quorum":
                    members = [self.by_erlang.get(m, m) for m in x.get("members") or []]
                    if node in members:
                        leader = self.by_erlang.get(x.get("leader") or "", "")
                        v.assets.append(Asset(x["vhost"], x["name"], None, leader, members))
                elif x.get("node") == erl and not x.get("exclusive"):  # a classic queue lives on one node
                    held = x["name"].startswith(RELOCATE_PREFIX)  # finished by the relocation that made it
                    kind = "" if x.get("auto_delete") or held else "classic"
                    v.assets.append(Asset(x["vhost"], x["name"], None, node, [node], kind))
        return out

    async def kick(self, view: NodeView, cid: str) -> bool:
        assert self.m
        reason = f"ferry: node {view.name} is being emptied; please reconnect"
        try:
            await self.m.request("DELETE", f"/connections/{q(cid)}", headers={"X-Reason": reason})
        except AuthError:  # another user's connection needs the administrator tag: no use going on
            raise
        except FerryError:  # NotFound: already gone (the listing lags by up to a statistics interval)
            return False
        return True

    def movable(self, a: Asset) -> bool:
        return len(a.peers) > 1

    async def step_down_many(
        self, moves: list[tuple[Asset, str | None]], guard: bool = False, emit: Emit = no_emit
    ) -> list[str]:
        """Quorum queue leaders (all on one node) handed over in one ``rabbitmqctl eval`` on that node
        (no guard: an AMQP publisher's confirms already say what a queue did not take)."""
        if not moves:
            return []

        def b64(text: str) -> str:
            return base64.b64encode(text.encode()).decode()

        items = []
        for a, preferred in moves:
            target = preferred or next(p for p in a.peers if p != a.leader)
            items.append(f'{{<<"{b64(a.account)}">>,<<"{b64(a.stream)}">>,<<"{b64(self.erlang[target])}">>}}')
        expr = (
            "D = fun(B) -> base64:decode(B) end, "
            "R = [begin Res = case rabbit_amqqueue:lookup(rabbit_misc:r(D(V), queue, D(N))) of "
            "{ok, Q} -> rabbit_quorum_queue:transfer_leadership(Q, binary_to_atom(D(T), utf8)); "
            "Other -> Other end, "
            'list_to_binary(io_lib:format("~0p", [Res])) end '
            f"|| {{V, N, T}} <- [{','.join(items)}]], "
            'io:format("~s~n", [rabbit_json:encode(R)]).'
        )
        try:
            out = await self._cli("rabbitmqctl", moves[0][0].leader, "eval", expr)
            results = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("[")))
        except (FerryError, StopIteration, ValueError) as exc:
            return [str(exc)] * len(moves)
        return ["" if r.startswith("{migrated") else r for r in results]

    async def relocate(
        self,
        moves: list[tuple[Asset, str]],
        emit: Callable[..., None],
        rate: float | None = None,
        halt: asyncio.Event | None = None,
    ) -> list[str]:
        """Relocate classic queues (each to its target node; see the module docstring), their
        messages moved at `rate` per second (None: unpaced), one after the other until `halt` is
        set: the error per queue, "" when it now lives on its target."""
        results = []
        for a, target in moves:
            if halt and halt.is_set():
                results.append("stopped")
                continue
            said = len(self.lost_by_rabbitmq)
            try:
                moved = await self._relocate(a, target, rate)
            except Exception as exc:  # a Spark job's failure too: said in one line
                results.append(await self._why(a, target, exc))
                continue
            finally:
                for lost in self.lost_by_rabbitmq[said:]:
                    emit("lost_by_rabbitmq", **lost)
            emit("relocated", queue=a.label, to=target, messages=moved)
            results.append("")
        return results

    async def _why(self, a: Asset, target: str, exc: Exception) -> str:
        """A relocation's failure in one line; a node of the two that went down is named as the cause
        (the queue's messages are out of reach until it is back: the evacuation waits for it, then
        relocates the queue from where it stopped)."""
        from ferry.spark.session import spark_error

        said = str(spark_error(exc))
        down = [self.by_erlang.get(n, n) for n in re.findall(r"home node '([^']+)'", said)]  # the broker's words
        with contextlib.suppress(Exception):
            assert self.m
            nodes = await self.m.get("/nodes", params={"columns": "name,running"})
            running = {n["name"] for n in nodes if n["running"]}
            down += [n for n in (a.leader, target) if self.erlang[n] not in running and n not in down]
        if a.leader in down and (a.account, a.stream) in self.at_risk:
            self.at_risk[(a.account, a.stream)]["died"] = True  # what it held is counted once it is back
        if down:
            back = "the queue is relocated once it is back"
            return f"{' and '.join(down)} went down during the relocation ({said}); {back}"
        return said

    async def _relocate(self, a: Asset, target: str, rate: float | None) -> int:
        """Relocate one classic queue (see the module docstring): the messages moved back, each
        counted once; one connection counts its queues live throughout."""
        counts = QueueCounts(self.cluster, f"{CONTROL}-relocate")
        try:
            return await self._relocate_with(a, target, rate, counts)
        finally:
            await counts.close()

    async def _relocate_with(self, a: Asset, target: str, rate: float | None, counts: QueueCounts) -> int:
        assert self.m
        m, vhost, name = self.m, a.account, a.stream
        held = RELOCATE_PREFIX + name

        def path(queue: str) -> str:
            return f"/queues/{q(vhost)}/{q(queue)}"

        here = await m.get(path(name), ok404=True)
        hold = await m.get(path(held), ok404=True)
        if here and here.get("node") == self.erlang[a.leader]:
            # first, live: the node may die before anything moves
            self._at_risk(vhost, name, a.leader, await counts.ready(vhost, name), here.get("durable", True))
            if hold is None:
                hold = await self._declare(vhost, held, here, target)
            await self._rebind(vhost, name, held)
            await self._drain_into(vhost, name, held, target, rate, counts, on=a.leader)  # counted on their way back
        else:
            if (risk := self.at_risk.get((vhost, name))) and risk["died"]:
                node = await m.get(f"/nodes/{q(self.erlang[a.leader])}", ok404=True)
                if risk["durable"] or not (node and node.get("running")):  # not listed until recovered
                    raise BrokerUnavailable(f"{queue_path(vhost, name)} is not back on {a.leader} yet (its node died)")
                self._at_risk(vhost, name, a.leader, 0, False)  # back without it: a queue not durable dies
            if hold is None:
                return 0  # relocated already
        if await m.get(path(name), ok404=True) is None:
            await self._declare(vhost, name, hold, target)
        await self._rebind(vhost, held, name)
        return await self._drain_into(vhost, held, name, target, rate, counts)  # every message relocated, once

    async def _declare(self, vhost: str, queue: str, like: dict[str, Any], target: str) -> dict[str, Any]:
        """Declare `queue` like `like` on `target` (through an AMQP connection to that node: RabbitMQ
        places a classic queue on the declaring client's node by default)."""
        assert self.m
        conn = await amqp_connect(self.cluster, self.brokers[target], vhost=vhost, name=f"{CONTROL}-relocate")
        try:
            ch = await conn.channel()
            await ch.declare_queue(queue, durable=like.get("durable", True), arguments=like.get("arguments") or {})
        finally:
            await conn.close()
        info = await self.m.get(f"/queues/{q(vhost)}/{q(queue)}")
        if info.get("node") != self.erlang[target]:
            raise FerryError(
                f"{queue_path(vhost, queue)} was placed on {info.get('node')}, not {target} "
                "(a queue_leader_locator other than client-local?)"
            )
        return info

    async def _rebind(self, vhost: str, old: str, new: str) -> None:
        """Give `new` every exchange binding of `old`, then take them from `old` (in that order:
        a message routed in between reaches both, none reaches neither)."""
        assert self.m
        bindings = [b for b in await self.m.get(f"/queues/{q(vhost)}/{q(old)}/bindings") if b["source"]]
        for b in bindings:
            body = {"routing_key": b["routing_key"], "arguments": b.get("arguments") or {}}
            await self.m.request("POST", f"/bindings/{q(vhost)}/e/{q(b['source'])}/q/{q(new)}", json=body)
        for b in bindings:
            await self.m.delete(f"/bindings/{q(vhost)}/e/{q(b['source'])}/q/{q(old)}/{q(b['properties_key'])}")

    def _at_risk(self, vhost: str, queue: str, node: str, ready: int, durable: bool | None = None) -> None:
        """`queue` holds `ready` messages on `node`, counted live before each step moves them.
        Counted again after `node` died and came back, the difference is RabbitMQ's own loss: what
        it held at the last count, less what ferry moved to the holding queue since (confirmed
        there), less what it holds now. RabbitMQ keeps only the persistent messages of a durable
        queue across a node's restart; transient ones, and a queue that is not durable, die with
        the node. (A persistent message moved but whose ack the dead node had not stored comes
        back and is moved again, a duplicate the count then leaves out: the relocation's window at
        most; one routed to the queue between the first count and its bindings' move, a moment,
        is not counted.)"""
        risk = self.at_risk.get((vhost, queue))
        if risk and risk["died"]:
            lost = risk["ready"] - risk["moved"] - ready
            if lost > 0:
                self.lost_by_rabbitmq.append(
                    {
                        "queue": queue_path(vhost, queue),
                        "node": node,
                        "messages": lost,
                        "note": f"{node} died with them: RabbitMQ keeps only a durable queue's persistent "
                        "messages across a node's restart (transient ones, and a queue not durable, die with it)",
                    }
                )
        was = risk["durable"] if risk else True
        self.at_risk[(vhost, queue)] = {
            "ready": ready,
            "moved": 0,
            "died": False,
            "durable": was if durable is None else durable,
        }

    async def _drain_into(
        self,
        vhost: str,
        source: str,
        dest: str,
        target: str,
        rate: float | None,
        counts: QueueCounts,
        on: str | None = None,
    ) -> int:
        """Move `source`'s messages to `dest` with the data plane until `source` is empty, then
        delete it (only if empty: a publisher may still add to it); `counts` counts them live.
        `on`: the node `source` lives on, which may die meanwhile (see :meth:`_at_risk`)."""
        from ferry.brokers.rabbitmq.queue_io import MoveTask
        from ferry.spark.tasks import run_moves

        assert self.m
        cluster = self.cluster.model_dump_json()
        index = list(self.brokers).index(target)  # read and write through the target: it lives on
        sink = {
            "kind": "rabbitmq",
            "cluster": cluster,
            "vhost": vhost,
            "queue": dest,
            "name": self.name,
            "broker": index,
        }
        moved = 0
        for _ in range(100):
            try:
                ready = await counts.ready(vhost, source)
            except NotFound:
                return moved
            if on:
                self._at_risk(vhost, source, on, ready)
            if ready:
                task = MoveTask(cluster, self.name, vhost, source, sink, f"relocate-{uuid.uuid4().hex[:8]}")
                task.broker, task.rate, task.source_may_die = index, rate, on is not None
                spark = await self._spark()
                (result,) = await asyncio.to_thread(run_moves, spark, [task])
                moved += result.moved
                if on:  # counted even when the source's node died under the task ("source lost")
                    self.at_risk[(vhost, source)]["moved"] += result.moved
                if result.errors:
                    raise FerryError(f"moving {queue_path(vhost, source)}: {result.errors[0]}")
            try:
                await self.m.request("DELETE", f"/queues/{q(vhost)}/{q(source)}", params={"if-empty": "true"})
                return moved
            except NotFound:
                return moved
            except FerryError as exc:
                if "empty" not in str(exc).lower():
                    raise
        raise FerryError(f"{queue_path(vhost, source)} keeps receiving messages; relocation to {target} did not finish")

    async def _spark(self) -> Any:
        if self.spark is None:
            self.spark = await asyncio.to_thread(self.spark_factory)
        return self.spark

    async def prohibit(self, node: str) -> None:
        """Maintenance mode: the node's listeners are suspended and its leaders handed over."""
        await self._cli("rabbitmq-upgrade", node, "drain")

    async def allow(self, node: str) -> None:
        await self._cli("rabbitmq-upgrade", node, "revive")

    async def _cli(self, tool: str, node: str, *args: str) -> str:
        """Run an Erlang CLI tool against `node` with the topology's cookie (in a private HOME, never argv)."""
        access = self.cluster.erlang
        if access is None:
            raise ConfigError(
                f"cluster {self.name!r}: moving quorum queue leaders needs the Erlang CLI",
                hint="add an `erlang: {cookie_file: ..., epmd_port: ...}` block to the cluster in the topology",
            )
        binary = (
            f"/usr/lib/rabbitmq/bin/{tool}" if os.path.exists(f"/usr/lib/rabbitmq/bin/{tool}") else shutil.which(tool)
        )
        if not binary:
            raise ConfigError(f"{tool} not found", hint="install rabbitmq-server's CLI tools where ferry runs")
        with tempfile.TemporaryDirectory(prefix="ferry-erl-") as home:
            cookie = os.path.join(home, ".erlang.cookie")
            with open(os.open(cookie, os.O_WRONLY | os.O_CREAT, 0o400), "w") as f:
                f.write(access.cookie())
            env = {
                "HOME": home,
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "LANG": "C.UTF-8",
                "LC_ALL": "C.UTF-8",
                "ERL_EPMD_PORT": str(access.epmd_port),
            }
            proc = await asyncio.create_subprocess_exec(
                binary,
                "-q",
                "-n",
                self.erlang[node],
                *args,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            try:
                out, err = await asyncio.wait_for(proc.communicate(), self.CLI_TIMEOUT)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                raise BrokerUnavailable(f"{tool} {args[0]} on {node}: no answer in {self.CLI_TIMEOUT:.0f}s") from None
        if proc.returncode:
            raise FerryError(f"{tool} {args[0]} on {node} failed: {_cli_reason((err or out).decode(errors='replace'))}")
        return out.decode(errors="replace")


def _cli_reason(text: str) -> str:
    """One line from an Erlang CLI tool's failure: its suggestion when it diagnosed the node, else
    its error line, else its last line but the cookie's hash (which ends a failed diagnosis and
    says nothing)."""
    lines = [ln.strip(" *") for ln in text.strip().splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith("Erlang cookie hash")]
    hint = next((ln.removeprefix("suggestion: ") for ln in lines if ln.startswith("suggestion: ")), "")
    error = next((ln for ln in lines if ln.startswith("Error")), "")
    return hint or error or (lines[-1] if lines else "no output")
