"""What a node of a NATS or RabbitMQ cluster holds, and how to move it off: the two backends of
`ferry node evacuate` and `ferry cluster rebalance` (the state machines are in ``rebalance.py``).

Both answer the same questions: a node's client connections and its "sessions"
(NATS: JetStream stream and consumer Raft groups; RabbitMQ: quorum and classic
queues), and both move them: close a connection, hand a leader to a preferred peer,
and switch a node's intake off and on again.

- **NATS**: connz and jsz on each server's monitoring port; connections closed with
  the system account's ``$SYS.REQ.SERVER.<id>.KICK``; leaders step down with
  ``placement.preferred``; replicas move with a peer-remove, and a one-replica stream by a
  scale-up to two, a step-down and a scale back to one. The journal is the
  cluster's ``ferry_ops`` KV bucket.
- **RabbitMQ**: connections and queues from the management API; connections closed
  with ``DELETE /api/connections/<name>`` and an ``X-Reason``; quorum queue leaders
  moved with ``rabbit_quorum_queue:transfer_leadership/2`` through ``rabbitmqctl eval``;
  a prohibited node is put in maintenance mode (``rabbitmq-upgrade drain``: listeners
  suspended, so it takes no client at all) and ``revive``d at stop. The Erlang CLI needs
  the topology's ``erlang`` block (cookie and epmd port). A classic queue lives on one
  node, so evacuation *relocates* it (see ``RabbitNodes.relocate``): same name, arguments
  and bindings on another node, its messages moved by the data plane's queue mover
  (Spark). Quorum queue followers, auto-delete and exclusive queues stay (reported as
  kept). The journal is a global parameter on the cluster.

Relocating a classic queue Q, every step idempotent and read back from the broker, and Q
in the evacuation's journal from before step 1 until step 3 is done, so a killed
evacuation resumes at the right step (even once Q has left the node):

1. declare ``ferry.relocate.Q`` on the target node (like Q), bind it as Q is bound, then
   unbind Q: messages routed through exchanges now land in the holding queue;
2. move Q's messages to it, and delete Q once empty (its consumers get a cancel);
3. declare Q on the target node, bind it, unbind the holding queue, move the held
   messages back and delete the holding queue.

Limits: between the two steps Q does not exist for a moment, so a message published
straight to Q (default exchange) in that moment is unroutable (returned to a publisher
that sets ``mandatory``, dropped otherwise); one routed while both queues are bound is
delivered to both (at least once, never lost). Consumers of Q must re-subscribe after
the cancel (most clients do on a consumer-cancel notification).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from nats.aio.client import Client

from ferry.brokers import nats as bnats
from ferry.brokers.rabbitmq import Management, amqp_connect, q, queue_path
from ferry.errors import AuthError, BrokerUnavailable, ConfigError, FerryError, NotFound
from ferry.ops.journal import Journal, ParamJournal
from ferry.ops.move import api as js_api
from ferry.pipeline._amqp import QueueCounts
from ferry.topology import NatsCluster, RabbitCluster

RELOCATE_PREFIX = "ferry.relocate."  # the holding queue of a classic queue being relocated
CONTROL = "ferry-ctl"  # connection-name prefix of ferry's own control connections: never evicted
STALE_AFTER = 5.0  # seconds without a heartbeat before another ferry adopts an operation


@dataclass
class Asset:
    """A JetStream stream or consumer (a Raft group) as one server sees it."""

    account: str
    stream: str
    consumer: str | None
    leader: str
    peers: list[str]
    kind: str = ""  # RabbitMQ: "classic" for a classic queue ferry can relocate

    @property
    def label(self) -> str:
        """ACCOUNT/STREAM[/CONSUMER], or a RabbitMQ queue's VHOST/QUEUE (its `queue_path`)."""
        return queue_path(self.account, self.stream) + (f"/{self.consumer}" if self.consumer else "")


@dataclass
class NodeView:
    name: str
    up: bool = False
    error: str = ""
    server_id: str = ""
    conns: list[dict] = field(default_factory=list)
    assets: list[Asset] = field(default_factory=list)

    @property
    def leaders(self) -> list[Asset]:
        return [a for a in self.assets if a.leader == self.name]

    def summary(self) -> dict[str, Any]:
        return {
            "node": self.name,
            "up": self.up,
            "connections": len(self.conns),
            "mqtt": sum(1 for c in self.conns if c.get("mqtt_client")),
            "sessions": len(self.leaders),
            "replicas": len(self.assets) - len(self.leaders),
            **({"error": self.error} if self.error else {}),
        }


class _Nodes:
    name: str
    brokers: dict[str, Any]

    cluster: NatsCluster | RabbitCluster
    avoid: list[str]

    async def view(self, node: str, jetstream: bool = True) -> NodeView:
        raise NotImplementedError

    def reach_order(self) -> list[Any]:
        """The brokers to connect through: the nodes being emptied last, so ferry's own connections avoid them."""
        brokers = self.cluster.brokers
        return [b for b in brokers if b.name not in self.avoid] + [b for b in brokers if b.name in self.avoid]

    def check(self, names: list[str], what: str) -> None:
        unknown = [n for n in names if n not in self.brokers]
        if unknown:
            raise NotFound(
                f"{what}: no node {', '.join(unknown)} in cluster {self.name!r} (has {', '.join(self.brokers)})"
            )

    async def views(self, nodes: list[str], jetstream: bool = True) -> dict[str, NodeView]:
        got = await asyncio.gather(*(self.view(n, jetstream) for n in nodes))
        return {v.name: v for v in got}


class NatsNodes(_Nodes):
    """Counts and moves for the servers of one NATS cluster, through its monitoring
    endpoints (connz, jsz), the system account (KICK) and the JetStream API."""

    moves_replicas = True  # stream replicas leave with a peer-remove (the cluster picks a spare server)

    def __init__(self, name: str, cluster: NatsCluster, avoid: list[str]) -> None:
        self.name, self.cluster = name, cluster
        self.brokers = {b.name: b for b in cluster.brokers}
        self.avoid = avoid
        self.nc: Client | None = None
        self.sysnc: Client | None = None
        self.account = ""

    async def __aenter__(self) -> NatsNodes:
        opts = {"name": self.name, "urls": [b.url for b in self.reach_order()], "dont_randomize": True}
        self.nc = await bnats.connect(self.cluster, client_name=f"{CONTROL}-{self.name}", **opts)
        try:
            self.sysnc = await bnats.connect(
                self.cluster, system=True, client_name=f"{CONTROL}-{self.name}-sys", **opts
            )
            info = await bnats.sys_request(self.nc, "$SYS.REQ.USER.INFO", timeout=5)
            self.account = ((info.get("data") or {}).get("account")) or ""
        except BaseException:
            await self.nc.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        for c in (self.nc, self.sysnc):
            if c:
                with contextlib.suppress(Exception):
                    await c.close()

    async def view(self, node: str, jetstream: bool = True) -> NodeView:
        b = self.brokers[node]
        v = NodeView(node)
        if not b.monitor_url:
            v.error = "no monitor_url in the topology"
            return v
        try:
            connz = await bnats.monitor_get(b.monitor_url, "connz", timeout=3, auth="true", limit=1_000_000)
            jsz = (
                await bnats.monitor_get(
                    b.monitor_url, "jsz", timeout=3, accounts="true", streams="true", consumers="true", config="false"
                )
                if jetstream
                else {}
            )
        except Exception as exc:  # any failure means the node is not answering
            v.error = str(exc) if isinstance(exc, FerryError) else f"{type(exc).__name__}: {exc}"
            return v
        v.up, v.server_id = True, connz.get("server_id", "")
        v.conns = [c for c in connz.get("connections") or [] if not str(c.get("name", "")).startswith(CONTROL)]
        for acc in jsz.get("account_details") or []:
            for s in acc.get("stream_detail") or []:
                cl = s.get("cluster") or {}
                peers = [cl.get("leader", "")] + [r["name"] for r in cl.get("replicas") or []]
                v.assets.append(Asset(acc["name"], s["name"], None, cl.get("leader", ""), [p for p in peers if p]))
                for c in s.get("consumer_detail") or []:
                    ccl = c.get("cluster") or {}
                    cpeers = [ccl.get("leader", "")] + [r["name"] for r in ccl.get("replicas") or []]
                    v.assets.append(
                        Asset(acc["name"], s["name"], c["name"], ccl.get("leader", ""), [p for p in cpeers if p])
                    )
        return v

    async def kick(self, view: NodeView, cid: int) -> bool:
        assert self.sysnc
        try:
            r = await bnats.sys_request(self.sysnc, f"$SYS.REQ.SERVER.{view.server_id}.KICK", {"cid": cid}, timeout=2)
        except BrokerUnavailable:
            return False
        return not r.get("error")

    def journal(self, key: str) -> Journal:
        assert self.nc
        return Journal(self.nc, key, stale_after=STALE_AFTER, replicas=min(3, len(self.brokers)))

    def movable(self, a: Asset) -> bool:
        return a.account == self.account and len(a.peers) > 1

    async def step_down_many(self, moves: list[tuple[Asset, str | None]]) -> list[str]:
        """Each leader steps down towards its preferred peer, else wherever its group chooses; '' or the error."""
        errors = []
        for a, preferred in moves:
            err = await self.step_down(a, preferred)
            if err and preferred:  # the preferred peer may be behind: let the group choose
                err = await self.step_down(a, None)
            errors.append(err)
        return errors

    async def prohibit(self, node: str) -> None:
        """Nothing to switch on a NATS server: the prohibiting state kicks whatever comes back."""

    async def allow(self, node: str) -> None:
        """Nothing to switch back."""

    async def step_down(self, a: Asset, preferred: str | None) -> str:
        """Ask the group's leader to hand over (to `preferred` when given); '' or the error."""
        assert self.nc
        subject = (
            f"$JS.API.CONSUMER.LEADER.STEPDOWN.{a.stream}.{a.consumer}"
            if a.consumer
            else f"$JS.API.STREAM.LEADER.STEPDOWN.{a.stream}"
        )
        body = {"placement": {"preferred": preferred}} if preferred else b""
        try:
            r = await bnats.sys_request(self.nc, subject, body, timeout=3)
        except BrokerUnavailable as exc:
            return str(exc)
        return (r.get("error") or {}).get("description", "") if not r.get("success") else ""

    def single(self, a: Asset, node: str) -> bool:
        """A one-replica stream on `node` (in an account ferry can manage)."""
        return a.consumer is None and a.account == self.account and a.peers == [node]

    async def move_single(self, a: Asset, node: str, catch_up_s: float = 120.0) -> tuple[str, bool]:
        """Move a one-replica stream off `node` without a moment where its only copy is gone: it is
        scaled to two replicas (the server adds one elsewhere, which catches up from `node`), the
        new replica takes the lead once it holds everything, and the stream is scaled back to one
        (a scale-down keeps the leader). Repeating it after an interruption finishes the job.

        ('' or the error, whether to try again later): a scale-up refused for good (the stream's
        placement allows no other server) changed nothing and is not tried again."""
        assert self.nc
        nc, api = self.nc, f"$JS.API.STREAM.%s.{a.stream}"
        clock = asyncio.get_running_loop().time
        deadline, asked = clock() + catch_up_s, -10.0
        try:
            info = await js_api(nc, api % "INFO")
            cfg, leader = info["config"], (info.get("cluster") or {}).get("leader") or ""
            done = cfg["num_replicas"] == 1 and leader not in ("", node)  # an earlier run finished it
            if cfg["num_replicas"] == 1 and not done:
                try:
                    await js_api(nc, api % "UPDATE", {**cfg, "num_replicas": 2})
                except FerryError as exc:
                    return str(exc), "move already in progress" in str(exc)  # else e.g. placement allows no other
            while not done:  # until a replica away from `node` holds everything, and leads
                cl = (await js_api(nc, api % "INFO")).get("cluster") or {}
                leader = cl.get("leader") or ""
                away = [p for p in [leader, *(r["name"] for r in cl.get("replicas") or [])] if p not in ("", node)]
                if away and await self._holds_all(a, away[0], node):
                    if leader == away[0]:
                        break
                    if clock() - asked > 3 and await self.step_down(a, away[0]) == "":
                        asked = clock()  # the election takes a moment: ask again only if it did not happen
                if clock() > deadline:
                    return f"no replica away from {node} caught up within {catch_up_s:.0f}s", True
                await asyncio.sleep(0.25)
            if not done:
                await js_api(nc, api % "UPDATE", {**cfg, "num_replicas": 1})
            while await self._copy(a, node) is not None:  # `node` drops its copy a moment after the scale-down
                if clock() > deadline:
                    return f"{node} still holds a copy after the scale-down", True
                await asyncio.sleep(0.25)
        except (FerryError, httpx.HTTPError) as exc:
            return str(exc), True
        return "", True

    async def _holds_all(self, a: Asset, server: str, origin: str) -> bool:
        """`server`'s copy of a's stream is complete: the server's own health check of the stream
        passes (no catch-up under way) and, in its own jsz, it stores at least the last sequence
        `origin` stored a moment before, and each durable consumer's delivered and ack floor are
        at least origin's. (A Raft peer reported "current" may still be fetching the stream's
        messages, which travel outside the Raft log, and a consumer follower starts at 0.)"""
        try:
            before = await self._copy(a, origin)
            await bnats.monitor_get(
                self.brokers[server].monitor_url, "healthz", timeout=3, account=a.account, stream=a.stream
            )
            there = await self._copy(a, server)
        except (FerryError, httpx.HTTPError):
            return False
        return (
            before is not None
            and there is not None
            and there["last_seq"] >= before["last_seq"]
            and all(
                there_pos >= pos
                for c, positions in before["consumers"].items()
                for there_pos, pos in zip(there["consumers"].get(c, (-1, -1)), positions, strict=True)
            )
        )

    async def _copy(self, a: Asset, server: str) -> dict[str, Any] | None:
        """`server`'s own copy of a's stream (its jsz): last sequence and, per durable consumer,
        (delivered, ack floor) stream sequences; None when it holds none."""
        jsz = await bnats.monitor_get(
            self.brokers[server].monitor_url,
            "jsz",
            timeout=3,
            acc=a.account,
            accounts="true",
            streams="true",
            consumers="true",
            config="true",
        )
        for acc in jsz.get("account_details") or []:
            for s in acc.get("stream_detail") or []:
                if acc["name"] == a.account and s["name"] == a.stream:
                    return {
                        "last_seq": int(s["state"]["last_seq"]),
                        "consumers": {
                            c["name"]: (c["delivered"]["stream_seq"], c["ack_floor"]["stream_seq"])
                            for c in s.get("consumer_detail") or []
                            if (c.get("config") or {}).get("durable_name")
                        },
                    }
        return None

    async def peer_remove(self, a: Asset, node: str) -> str:
        assert self.nc
        try:
            r = await bnats.sys_request(self.nc, f"$JS.API.STREAM.PEER.REMOVE.{a.stream}", {"peer": node}, timeout=5)
        except BrokerUnavailable as exc:
            return str(exc)
        return (r.get("error") or {}).get("description", "") if not r.get("success") else ""


class RabbitNodes(_Nodes):
    """Counts and moves for the nodes of one RabbitMQ cluster (see the module docstring)."""

    moves_replicas = False  # a quorum member removed is not replaced: followers stay
    CLI_TIMEOUT = 120.0

    def __init__(self, name: str, cluster: RabbitCluster, avoid: list[str]) -> None:
        self.name, self.cluster = name, cluster
        self.brokers = {b.name: b for b in cluster.brokers}
        self.erlang = {b.name: b.node or f"rabbit@{urlsplit(b.url).hostname}" for b in cluster.brokers}
        self.by_erlang = {v: k for k, v in self.erlang.items()}
        self.avoid = avoid
        self.m: Management | None = None
        self.spark: Any = None  # a Spark session, started for the first classic queue to relocate

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

    async def step_down_many(self, moves: list[tuple[Asset, str | None]]) -> list[str]:
        """Quorum queue leaders (all on one node) handed over in one ``rabbitmqctl eval`` on that node."""
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
            try:
                moved = await self._relocate(a, target, rate)
            except FerryError as exc:
                results.append(str(exc))
                continue
            emit("relocated", queue=a.label, to=target, messages=moved)
            results.append("")
        return results

    async def _relocate(self, a: Asset, target: str, rate: float | None) -> int:
        assert self.m
        m, vhost, name = self.m, a.account, a.stream
        held = RELOCATE_PREFIX + name
        moved = 0

        def path(queue: str) -> str:
            return f"/queues/{q(vhost)}/{q(queue)}"

        here = await m.get(path(name), ok404=True)
        hold = await m.get(path(held), ok404=True)
        if here and here.get("node") == self.erlang[a.leader]:
            if hold is None:
                hold = await self._declare(vhost, held, here, target)
            await self._rebind(vhost, name, held)
            moved += await self._drain_into(vhost, name, held, target, rate)
        elif hold is None:
            return 0  # relocated already
        if await m.get(path(name), ok404=True) is None:
            await self._declare(vhost, name, hold, target)
        await self._rebind(vhost, held, name)
        moved += await self._drain_into(vhost, held, name, target, rate)
        return moved

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

    async def _drain_into(self, vhost: str, source: str, dest: str, target: str, rate: float | None) -> int:
        """Move `source`'s messages to `dest` with the data plane until `source` is empty, then
        delete it (only if empty: a publisher may still add to it)."""
        from ferry.pipeline.copy import run_moves
        from ferry.pipeline.rabbitmq import MoveTask

        assert self.m
        cluster = self.cluster.model_dump_json()
        sink = {"kind": "rabbitmq", "cluster": cluster, "vhost": vhost, "queue": dest, "name": self.name}
        index = list(self.brokers).index(target)
        moved, counts = 0, QueueCounts(self.cluster, f"{CONTROL}-relocate")
        try:
            for _ in range(100):
                try:
                    ready = await counts.ready(vhost, source)
                except NotFound:
                    return moved
                if ready:
                    task = MoveTask(cluster, self.name, vhost, source, sink, f"relocate-{uuid.uuid4().hex[:8]}")
                    task.broker, task.rate = index, rate
                    spark = await self._spark()
                    moved += sum(r.moved for r in await asyncio.to_thread(run_moves, spark, [task]))
                try:
                    await self.m.request("DELETE", f"/queues/{q(vhost)}/{q(source)}", params={"if-empty": "true"})
                    return moved
                except NotFound:
                    return moved
                except FerryError as exc:
                    if "empty" not in str(exc).lower():
                        raise
        finally:
            await counts.close()
        raise FerryError(f"{queue_path(vhost, source)} keeps receiving messages; relocation to {target} did not finish")

    async def _spark(self) -> Any:
        if self.spark is None:
            from ferry.pipeline.spark import get_session

            self.spark = await asyncio.to_thread(get_session, app_name="ferry evacuate")
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


def open_nodes(name: str, cluster: NatsCluster | RabbitCluster, avoid: list[str]) -> NatsNodes | RabbitNodes:
    return NatsNodes(name, cluster, avoid) if isinstance(cluster, NatsCluster) else RabbitNodes(name, cluster, avoid)
