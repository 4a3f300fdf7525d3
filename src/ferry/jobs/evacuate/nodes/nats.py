"""The NATS backend of evacuation and rebalance: monitoring endpoints (connz, jsz), the system
account (KICK), and the JetStream API (step-downs, peer-removes, a one-replica stream's move)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
from nats.aio.client import Client

from ferry.brokers import nats as bnats
from ferry.brokers.nats import auth as bnats_auth
from ferry.brokers.nats.jsapi import api as js_api
from ferry.brokers.nats.jsapi import stream_info
from ferry.errors import BrokerUnavailable, FerryError
from ferry.jobs.evacuate.nodes.base import CONTROL, STALE_AFTER, Asset, Nodes, NodeView
from ferry.jobs.shared.events import Emit, no_emit
from ferry.jobs.shared.guard import Guard, reconcile, state_root
from ferry.journal import KvJournal, process_start
from ferry.topology import NatsCluster

SEQ0 = "seq0"  # the file beside a step-down's capture: the stream's last sequence before its guard listened
LIVE: set[Path] = set()  # the step-down captures this process is writing now


def _in_use(root: Path) -> bool:
    """Whether a live ferry writes the step-down captures under `root` (``<pid>-<process start>-<id>``),
    or reconciles them (``....<pid>``): this process's own only while its step-down runs."""
    name, _, claimer = root.name.partition(".")
    pid, _, rest = name.partition("-")
    if claimer:
        return claimer != str(os.getpid()) and claimer.isdigit() and process_start(int(claimer)) is not None
    if pid == str(os.getpid()):
        return root in LIVE
    return pid.isdigit() and process_start(int(pid)) in ("?", rest.rsplit("-", 1)[0])


class NatsNodes(Nodes):
    """Counts and moves for the servers of one NATS cluster, through its monitoring
    endpoints (connz, jsz), the system account (KICK) and the JetStream API."""

    moves_replicas = True  # stream replicas leave with a peer-remove (the cluster picks a spare server)

    def __init__(self, name: str, cluster: NatsCluster, avoid: list[str]) -> None:
        self.name, self.cluster = name, cluster
        self.brokers = {b.name: b for b in cluster.brokers}
        self.avoid = avoid
        self.nc: Client | None = None  # the default account's: the journal
        self.sysnc: Client | None = None
        # ferry's connection in each account of the topology, by the account's id and by its name (jsz
        # names assets' accounts by name: in operator mode the JWT's, its id is the public key)
        self.by_account: dict[str, Client] = {}
        self.in_account: dict[str, NatsCluster] = {}  # the topology's cluster as ferry's user in each account
        self.account_id: dict[str, str] = {}  # account name -> id, for the monitoring endpoints' queries

    def _tls(self, url: str | None) -> Any:
        """The TLS context for a server's monitoring endpoint over HTTPS (its broker's settings)."""
        return bnats_auth.tls_context(self.cluster, url)

    async def __aenter__(self) -> NatsNodes:
        opts = {"name": self.name, "urls": [b.url for b in self.reach_order()], "dont_randomize": True}
        self.nc = await bnats.connect(self.cluster, client_name=f"{CONTROL}-{self.name}", **opts)
        try:
            self.sysnc = await bnats.connect(
                self.cluster, system=True, client_name=f"{CONTROL}-{self.name}-sys", **opts
            )
            await self._in_account(self.nc, self.cluster)
            for account in self.cluster.accounts:  # their leaders move too, asked in their own account
                cluster = self.cluster.in_account(account, self.name)
                await self._in_account(
                    await bnats.connect(cluster, client_name=f"{CONTROL}-{self.name}-{account}", **opts), cluster
                )
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _in_account(self, nc: Client, cluster: NatsCluster) -> None:
        """Keep `nc` as ferry's connection in the account the server says it is in."""
        try:
            info = await bnats.sys_request(nc, "$SYS.REQ.USER.INFO", timeout=5)
        except BaseException:
            await nc.close()
            raise
        data = info.get("data") or {}
        account = data.get("account") or ""
        name = data.get("account_name") or account
        self.by_account[account] = self.by_account[name] = nc
        self.in_account[account] = self.in_account[name] = cluster
        self.account_id[name] = account

    async def __aexit__(self, *exc: object) -> None:
        for c in {self.nc, self.sysnc, *self.by_account.values()}:
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
            connz = await bnats.monitor_get(
                b.monitor_url, "connz", timeout=3, tls=self._tls(b.monitor_url), auth="true", limit=1_000_000
            )
            jsz = (
                await bnats.monitor_get(
                    b.monitor_url,
                    "jsz",
                    timeout=3,
                    tls=self._tls(b.monitor_url),
                    accounts="true",
                    streams="true",
                    consumers="true",
                    config="false",
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

    def journal(self, key: str) -> KvJournal:
        assert self.nc
        return KvJournal(self.nc, key, stale_after=STALE_AFTER, replicas=min(3, len(self.brokers)))

    def movable(self, a: Asset) -> bool:
        return a.account in self.by_account and len(a.peers) > 1

    async def step_down_many(
        self, moves: list[tuple[Asset, str | None]], guard: bool = False, emit: Emit = no_emit
    ) -> list[str]:
        """Each leader steps down towards its preferred peer, else wherever its group chooses; '' or
        the error. With `guard`, a capture guard hears each stream's subjects meanwhile, until the
        stream is led again, and what it missed is re-published (:mod:`ferry.jobs.shared.guard`):
        core publishes in the election are not lost."""
        streams = [a for a, _ in moves if a.consumer is None] if guard else []
        async with self._guarded(streams, emit):
            errors = []
            for a, preferred in moves:
                err = await self.step_down(a, preferred)
                if err and preferred:  # the preferred peer may be behind: let the group choose
                    err = await self.step_down(a, None)
                errors.append(err)
            stepped = [a for (a, _), err in zip(moves, errors, strict=True) if not err and a in streams]
            await asyncio.gather(*(self._led(a) for a in stepped))
        return errors

    @contextlib.asynccontextmanager
    async def _guarded(self, streams: list[Asset], emit: Emit) -> AsyncIterator[None]:
        """A guard on each stream's subjects while the block runs, then the reconciliation. The
        captures live in the state directory (``step-downs/<cluster>/<host>/<pid>-<start>-<id>/``) with the
        sequence each began at: a ferry killed meanwhile leaves them to the next one
        (:meth:`recover`)."""
        if not streams:
            yield
            return
        root = self._captures() / f"{os.getpid()}-{process_start(os.getpid())}-{uuid4().hex[:6]}"
        guards: list[tuple[Asset, Guard]] = []

        async def start(a: Asset) -> None:
            where = root / a.account / a.stream
            try:
                info = await stream_info(self.by_account[a.account], a.stream)
                if not info["config"].get("subjects"):
                    return  # a mirror or a sourced stream: no publisher writes to it
                where.mkdir(parents=True, exist_ok=True, mode=0o700)
                (where / SEQ0).write_text(str(info["state"]["last_seq"]))  # first: nothing heard is older
                capture = where / f"capture-{os.getpid()}.arrow"
                g = Guard(self.in_account[a.account], info["config"]["subjects"], capture)
                led = info.get("cluster") or {}
                await g.start(led_in=led.get("name", ""), avoid=led.get("leader", ""))  # stops itself when it fails
            except (FerryError, TimeoutError, OSError) as exc:  # not allowed to listen, leaderless, ...: said
                shutil.rmtree(where, ignore_errors=True)
                emit("warning", message=f"{a.label}: stepped down unguarded: {exc}")
                return
            guards.append((a, g))

        LIVE.add(root)
        try:
            try:
                await asyncio.gather(*(start(a) for a in streams))  # each says its own failure
                yield
            finally:
                await asyncio.gather(*(g.stop() for _, g in guards))
            await self._reconcile(root, emit)  # interrupted before: the captures stay, for recover()
        finally:
            LIVE.discard(root)

    async def _led(self, a: Asset, within: float = 15.0) -> None:
        """Until the stream answers with a leader other than the one that stepped down, or with that
        one after 2 s (elected again), `within` s at most."""
        clock = asyncio.get_running_loop().time
        start = clock()
        while clock() < start + within:
            with contextlib.suppress(FerryError, TimeoutError):
                info = await stream_info(self.by_account[a.account], a.stream, timeout=1.0)
                leader = (info.get("cluster") or {}).get("leader")
                if leader and (leader != a.leader or clock() > start + 2.0):
                    return
            await asyncio.sleep(0.1)

    async def _reconcile(self, root: Path, emit: Emit) -> None:
        """Re-publish what each stream under `root` missed of what its guard heard; remove `root`."""
        for where in sorted(root.glob("*/*")):
            account, stream = where.parent.name, where.name
            if account not in self.by_account or not (where / SEQ0).exists():
                continue
            st = {"seq0": int((where / SEQ0).read_text()), "move_id": f"step-down-{root.name}"}
            heard = await reconcile(self.in_account[account], self.by_account[account], stream, st, where, no_emit)
            emit("guard", stream=f"{account}/{stream}", **heard)
        shutil.rmtree(root, ignore_errors=True)

    def _captures(self) -> Path:
        return state_root() / "step-downs" / self.name / socket.gethostname()

    async def recover(self, emit: Emit) -> None:
        """Reconcile the step-down captures left in this cluster's state directory on this host by a
        ferry that is gone (or by an interrupted step-down of this one); each claimed first (renamed
        ``<name>.<pid>``), so that two ferries recovering at once do not both re-publish."""
        for root in sorted(self._captures().glob("*")):
            if _in_use(root):
                continue
            claimed = root.with_name(f"{root.name.partition('.')[0]}.{os.getpid()}")
            try:
                root.rename(claimed)
            except OSError:  # another ferry claimed it first
                continue
            emit("warning", message=f"reconciling the step-down captures an interrupted ferry left ({claimed.name})")
            await self._reconcile(claimed, emit)

    async def prohibit(self, node: str) -> None:
        """Nothing to switch on a NATS server: the prohibiting state kicks whatever comes back."""

    async def allow(self, node: str) -> None:
        """Nothing to switch back."""

    async def step_down(self, a: Asset, preferred: str | None) -> str:
        """Ask the group's leader to hand over (to `preferred` when given); '' or the error."""
        subject = (
            f"$JS.API.CONSUMER.LEADER.STEPDOWN.{a.stream}.{a.consumer}"
            if a.consumer
            else f"$JS.API.STREAM.LEADER.STEPDOWN.{a.stream}"
        )
        body = {"placement": {"preferred": preferred}} if preferred else b""
        try:
            r = await bnats.sys_request(self.by_account[a.account], subject, body, timeout=3)
        except BrokerUnavailable as exc:
            return str(exc)
        return (r.get("error") or {}).get("description", "") if not r.get("success") else ""

    def single(self, a: Asset, node: str) -> bool:
        """A one-replica stream on `node` (in an account ferry can manage)."""
        return a.consumer is None and a.account in self.by_account and a.peers == [node]

    async def move_single(self, a: Asset, node: str, catch_up_s: float = 120.0) -> tuple[str, bool]:
        """Move a one-replica stream off `node` without a moment where its only copy is gone: it is
        scaled to two replicas (the server adds one elsewhere, which catches up from `node`), the
        new replica takes the lead once it holds everything, and the stream is scaled back to one
        (a scale-down keeps the leader). Repeating it after an interruption finishes the job.

        ('' or the error, whether to try again later): a scale-up refused for good (the stream's
        placement allows no other server) changed nothing and is not tried again."""
        nc, api = self.by_account[a.account], f"$JS.API.STREAM.%s.{a.stream}"
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
                self.brokers[server].monitor_url,
                "healthz",
                timeout=3,
                tls=self._tls(self.brokers[server].monitor_url),
                account=self.account_id.get(a.account, a.account),
                stream=a.stream,
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
            tls=self._tls(self.brokers[server].monitor_url),
            acc=self.account_id.get(a.account, a.account),
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
        if a.account not in self.by_account:
            return f"no credentials for account {a.account} in the topology"
        nc = self.by_account[a.account]
        try:
            r = await bnats.sys_request(nc, f"$JS.API.STREAM.PEER.REMOVE.{a.stream}", {"peer": node}, timeout=5)
        except BrokerUnavailable as exc:
            return str(exc)
        return (r.get("error") or {}).get("description", "") if not r.get("success") else ""
