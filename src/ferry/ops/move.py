"""`ferry move`: move a JetStream stream to another cluster of a super-cluster, losing nothing.

The server does the move (a placement update); ferry makes it safe:

1. **Preflight** (nothing changed when refused): destination known and with
   enough healthy servers (online, not lame duck, storage free), no move in
   progress, the stream led and in quorum, a meta leader.
2. **Journal**: the move's state lives in the JetStream KV bucket ``ferry_ops``
   (key ``move.<stream>``) with an owner heartbeat, so one move runs per stream
   and the same command run again (from anywhere) resumes a move whose owner died.
3. **Capture guard**: while the stream moves, ferry subscribes to its subjects
   and appends what it hears to an Arrow file (memory stays bounded). Afterwards
   it reads the stream from the sequence the move began at, and re-publishes
   exactly the captured messages the stream does not hold, in capture order,
   marked ``Ferry-Reinjected: <move id>``. Identity is ``Nats-Msg-Id`` when
   present (the re-publish keeps it, so the stream's de-duplication absorbs a
   producer's own late retry), else subject + headers + payload, counted as a
   multiset.
4. **Leader handoff** (nats-server 2.15+): once the destination peers have
   caught up, ferry asks the origin leader to step down to one of them instead
   of waiting for the server's sampled check to pass (``handoff_candidate``).
5. **Progress**: peers, lag, leader changes, leaderless time; the
   unavailability window is measured from the traffic itself: the longest time
   during which publishes arrived and the stream stored none of them.
6. **Timeout / Ctrl-C / ``--cancel``**: the system account's CANCEL_MOVE puts
   the stream back where it was; ferry waits for it to be healthy there.
7. **Verify**: messages, first/last sequence, per-subject counts unchanged but
   for new publishes; every durable consumer keeps its configuration and ack
   floor and none points past the last sequence.

Limits of the guard (said plainly): it only hears what reaches a subscription
on ferry's connection, so messages published while ferry was disconnected or
not running (between a kill and the rerun) are not guarded; the comparison
covers the stream from the move's first sequence, so a stream whose limits
discard messages during the move may see a discarded one re-published; two
identical messages without ``Nats-Msg-Id`` are told apart only by count.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hashlib
import json
import os
import shutil
import signal
import time
import uuid
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from statistics import median
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout

from ferry.brokers import nats as bnats
from ferry.errors import AuthError, BrokerUnavailable, Conflict, FerryError, NotFound, PreflightFailed, UsageError
from ferry.ops import Emit, no_emit
from ferry.ops.journal import BUCKET, Journal, owner_alive
from ferry.pipeline._nats import Msg as WireMsg
from ferry.pipeline._nats import Wire, header_value
from ferry.publish import MSG_ID, SOURCE_HDR, SOURCE_SEQ_HDR, Publisher
from ferry.topology import NatsCluster

__all__ = [
    "MoveRequest",
    "cancel",
    "identity",
    "move",
    "move_many",
    "repair_consumers",
    "status",
    "unavailable_window",
]

REINJECTED = "Ferry-Reinjected"
CAPTURE_SCHEMA = pa.schema(
    [
        ("recv_ns", pa.int64()),
        ("subject", pa.string()),
        ("headers", pa.map_(pa.string(), pa.string())),
        ("payload", pa.binary()),
        ("identity", pa.string()),  # computed as heard, so the comparison after the move hashes only the stream
    ]
)


@dataclass
class MoveRequest:
    stream: str
    to: str | None = None  # destination cluster
    to_tags: list[str] = field(default_factory=list)
    timeout: float = 600.0
    guard: bool = True
    dry_run: bool = False
    state_dir: Path | None = None  # where capture files go (default: $FERRY_STATE_DIR or ~/.local/state/ferry)

    def placement(self) -> dict[str, Any]:
        p: dict[str, Any] = {}
        if self.to:
            p["cluster"] = self.to
        if self.to_tags:
            p["tags"] = list(self.to_tags)
        return p

    def target(self) -> str:
        return self.to or "tags " + ",".join(self.to_tags)


# -- the super-cluster as the system account sees it ---------------------------------------------


@dataclass
class Server:
    name: str
    cluster: str
    tags: list[str]
    free: int  # bytes of file storage left
    offline: bool
    url: str = ""  # where clients connect to it (VARZ); "" when it listens on every interface


@dataclass
class View:
    servers: dict[str, Server]
    meta_leader: str

    def matching(self, placement: dict[str, Any]) -> list[Server]:
        tags = set(placement.get("tags") or [])
        cluster = placement.get("cluster")
        return [s for s in self.servers.values() if (not cluster or s.cluster == cluster) and tags <= set(s.tags)]

    def clusters(self) -> set[str]:
        return {s.cluster for s in self.servers.values()}


async def survey(sysnc: Client, wait: float = 2.0) -> View:
    """Every JetStream server's JSZ and client URL ($SYS.REQ.SERVER.PING.JSZ and .VARZ), gathered
    until all meta peers answered both."""
    got: list[dict] = []
    urls: dict[str, str] = {}
    done = asyncio.Event()
    expected = [0]

    def check() -> None:
        if expected[0] and len(got) >= expected[0] and all(r["server"]["name"] in urls for r in got):
            done.set()

    async def on_jsz(m: Msg) -> None:
        with contextlib.suppress(ValueError):
            got.append(json.loads(m.data))
            size = ((got[-1].get("data") or {}).get("meta_cluster") or {}).get("cluster_size", 0)
            expected[0] = max(expected[0], size)
            check()

    async def on_varz(m: Msg) -> None:
        with contextlib.suppress(ValueError, KeyError):
            r = json.loads(m.data)
            host, port = r["data"].get("host", ""), r["data"].get("port")
            host = f"[{host}]" if ":" in host else host
            urls[r["server"]["name"]] = f"nats://{host}:{port}" if port and host not in ("", "0.0.0.0", "[::]") else ""
            check()

    subs = []
    try:
        for what, cb in (("JSZ", on_jsz), ("VARZ", on_varz)):
            inbox = sysnc.new_inbox()
            subs.append(await sysnc.subscribe(inbox, cb=cb))
            await sysnc.publish(f"$SYS.REQ.SERVER.PING.{what}", b"{}", reply=inbox)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), wait)
    finally:
        for sub in subs:
            await sub.unsubscribe()
    if not got:
        raise BrokerUnavailable("no JetStream server answered $SYS.REQ.SERVER.PING.JSZ")
    leader = ""
    for r in got:
        leader = leader or ((r.get("data") or {}).get("meta_cluster") or {}).get("leader", "")
    offline: dict[str, bool] = {}
    for r in got:
        if r["server"]["name"] == leader:
            for p in (r["data"].get("meta_cluster") or {}).get("replicas") or []:
                offline[p["name"]] = bool(p.get("offline"))
    servers = {}
    for r in got:
        si, d = r["server"], r.get("data") or {}
        cfg = d.get("config") or {}
        free = max(0, int(cfg.get("max_storage", 0)) - int(d.get("storage", 0)))
        name = si["name"]
        servers[name] = Server(
            name, si.get("cluster", ""), si.get("tags") or [], free, offline.get(name, False), urls.get(name, "")
        )
    return View(servers, leader)


# -- stream API (raw JSON: the config round-trips exactly) ---------------------------------------


async def api(nc: Client, subject: str, payload: dict | None = None, timeout: float = 5.0) -> dict:
    resp = await bnats.sys_request(nc, subject, payload or {}, timeout=timeout)
    err = resp.get("error")
    if err:
        code = err.get("err_code", 0)
        if code == 10059:
            raise NotFound(f"stream {subject.rsplit('.', 1)[-1]!r} not found")
        raise FerryError(f"{subject}: {err.get('description', err)} (err_code {code})", err_code=code)
    return resp


async def stream_info(nc: Client, stream: str, timeout: float = 5.0, **req: Any) -> dict:
    return await api(nc, f"$JS.API.STREAM.INFO.{stream}", req, timeout=timeout)


def peers(info: dict) -> list[dict]:
    """Leader first, then replicas: name, current, lag, offline."""
    c = info.get("cluster") or {}
    out = [{"name": c["leader"], "current": True, "lag": 0, "leader": True}] if c.get("leader") else []
    for r in c.get("replicas") or []:
        out.append(
            {
                "name": r["name"],
                "current": bool(r.get("current")),
                "lag": int(r.get("lag", 0)),
                "offline": bool(r.get("offline")),
            }
        )
    return out


def same_placement(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.get("cluster") == b.get("cluster") and sorted(a.get("tags") or []) == sorted(b.get("tags") or [])


def _in(info: dict, names: set[str]) -> bool:
    """The stream's whole peer set is `names`-only, at its replica count, led and current."""
    ps = peers(info)
    return (
        bool((info.get("cluster") or {}).get("leader"))
        and len(ps) == int(info["config"].get("num_replicas", 1))
        and all(p["name"] in names and p["current"] for p in ps)
    )


# A peer that has just caught up installs a snapshot a moment later, which pushes a transfer
# campaign back to a whole election timeout (the stream leaderless for a second, seen on the
# lab): the peer must have been ready this long before ferry hands over to it.
HANDOFF_STEADY_S = 0.3


def handoff_candidate(info: dict, dest: set[str], keep: str | None = None) -> str | None:
    """The destination server to hand the stream's leadership to now, else None.

    A server that reports its migration (nats-server 2.15+: ``cluster.desired.status``) moves the
    leader only when a check, every 500 ms, samples a majority of its destination peers with no
    lag; under load that took 1-2 s after they had caught up (bench/RESULTS.md, "`ferry move`").
    So when the origin leader says it has every peer in the group and waits only for the
    destination's to catch up, and a majority of them are current with no lag (the server's own
    rule), ferry asks it to step down to the current one it heard from last, once that server
    says it can (``ready_to_lead``): the same raft leader transfer the server would make, only
    on a fresh answer (``_watch``). Older servers (no status) are left alone, and so is a move
    still adding peers: a transfer then left the stream leaderless for a second on the lab.
    """
    c = info.get("cluster") or {}
    status = (c.get("desired") or {}).get("status") or {}
    # the status line the server gives once the group holds every peer (runStreamMigration);
    # "catchup" alone also covers a peer not added yet
    waiting = status.get("type") == "catchup" and status.get("description") == "waiting for desired peers to catch up"
    if not waiting or not c.get("leader") or c["leader"] in dest:
        return None
    mine = [r for r in c.get("replicas") or [] if r.get("name") in dest]
    if len(mine) < int(info["config"].get("num_replicas", 1)):
        return None
    current = [r for r in mine if r.get("current") and not r.get("lag") and not r.get("offline")]
    if len(current) < len(mine) // 2 + 1:
        return None
    if keep in {r["name"] for r in current}:  # the peer being watched for steadiness
        return keep
    return min(current, key=lambda r: r.get("active", 0))["name"]


async def ready_to_lead(sysnc: Client, server: str, account: str, stream: str, leader: str) -> bool:
    """`server` can take over `stream` from `leader` now: its replica passes the server's own
    health check (in particular it is not fetching the stream's messages, which travel outside
    the Raft log: such a peer is "current" in stream info yet cannot lead at once), and it still
    sees `leader` leading (the server may have handed over itself since stream info answered; a
    second transfer would follow the first)."""
    who = {"server_name": server, "exact_match": True, "account": account}

    async def ask(kind: str, **q: Any) -> dict:
        try:
            r = await bnats.sys_request(sysnc, f"$SYS.REQ.SERVER.PING.{kind}", {**who, **q}, timeout=1.0)
        except (FerryError, NatsTimeout, TimeoutError):
            return {}
        return r.get("data") or {}

    health, jsz = await asyncio.gather(ask("HEALTHZ", stream=stream), ask("JSZ", streams=True))
    seen = [
        (d.get("cluster") or {}).get("leader")
        for a in jsz.get("account_details") or []
        for d in a.get("stream_detail") or []
        if d.get("name") == stream
    ]
    return health.get("status") == "ok" and seen == [leader]


async def _still_ready(nc: Client, stream: str, dest: set[str], peer: str, within: float = 0.25) -> bool:
    """A last look just before the handoff, answered within `within` seconds: `peer` is still the
    candidate. A peer that has fallen behind by the time the leader steps down to it cannot win
    the election it is asked to start, and the stream stays leaderless until an election timeout
    (4-9 s; seen once in about 20 moves at 12,000 msg/s when the view was a second old)."""
    try:
        info = await stream_info(nc, stream, timeout=within)
    except (BrokerUnavailable, NatsTimeout, TimeoutError, FerryError):
        return False
    return handoff_candidate(info, dest, peer) == peer


async def paged(
    nc: Client, subject: str, key: str, info: Callable[[str], Awaitable[Any]] | None = None
) -> AsyncIterator[Any]:
    """Every item of a paged JetStream list API (``offset`` / ``total``).

    In a cluster, a list leaves out the streams or consumers whose leader did not answer within
    4 s (a leader just elected, a busy server) and names them under ``missing``; `info` fetches
    each of those on its own, so a caller never mistakes a late item for an absent one."""
    offset = 0
    while True:
        page = await api(nc, subject, {"offset": offset})
        items = page.get(key) or []
        for item in items:
            yield item
        listed = {i.get("name") or i["config"]["name"] for i in items if isinstance(i, dict)}
        late = [n for n in page.get("missing") or [] if n not in listed]
        if late and info is None:
            raise FerryError(f"{subject}: no answer about {', '.join(late)}")
        for name in late:
            yield await info(name)  # type: ignore[misc]
        offset += len(items) + len(late)
        if not (items or late) or offset >= page.get("total", 0):
            return


async def consumers(nc: Client, stream: str) -> dict[str, dict]:
    def info(name: str) -> Awaitable[dict]:
        return api(nc, f"$JS.API.CONSUMER.INFO.{stream}.{name}", timeout=10)

    return {c["name"]: c async for c in paged(nc, f"$JS.API.CONSUMER.LIST.{stream}", "consumers", info)}


async def snapshot(nc: Client, stream: str) -> dict:
    """What verification compares: stream state, per-subject counts, durable consumers."""
    info = await stream_info(nc, stream, subjects_filter=">")
    st = info["state"]
    durable = {
        n: {"config": c["config"], "ack_floor": c["ack_floor"]["stream_seq"], "delivered": c["delivered"]["stream_seq"]}
        for n, c in (await consumers(nc, stream)).items()
        if c["config"].get("durable_name")
    }
    # under load, a consumer read after the stream may already be past the last_seq read before it
    last_seq_after = (await stream_info(nc, stream))["state"]["last_seq"] if durable else st["last_seq"]
    return {
        "messages": st["messages"],
        "first_seq": st["first_seq"],
        "last_seq": st["last_seq"],
        "last_seq_after_consumers": last_seq_after,
        "subjects": st.get("subjects") or {},
        "consumers": durable,
    }


_VOLATILE = {"num_replicas"}  # a consumer's replica count follows the stream's placement


def verify(pre: dict, post: dict) -> list[str]:
    """Problems found comparing the snapshot before a move with the one after (empty: verified)."""
    problems = []
    new = post["last_seq"] - pre["last_seq"]
    if new < 0:
        problems.append(f"last sequence went back from {pre['last_seq']} to {post['last_seq']}")
    if post["first_seq"] != pre["first_seq"]:
        problems.append(f"first sequence changed from {pre['first_seq']} to {post['first_seq']}")
    if post["messages"] != pre["messages"] + max(new, 0):
        problems.append(f"{post['messages']} messages, expected {pre['messages']} + {max(new, 0)} new")
    for subj, n in pre["subjects"].items():
        if post["subjects"].get(subj, 0) < n:
            problems.append(f"subject {subj}: {post['subjects'].get(subj, 0)} messages, had {n}")
    for name, c in pre["consumers"].items():
        now = post["consumers"].get(name)
        if now is None:
            problems.append(f"consumer {name} is gone")
            continue
        before = {k: v for k, v in c["config"].items() if k not in _VOLATILE}
        after = {k: v for k, v in now["config"].items() if k not in _VOLATILE}
        if before != after:
            changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
            problems.append(f"consumer {name}: configuration changed ({', '.join(changed)})")
        if now["ack_floor"] < c["ack_floor"]:
            problems.append(f"consumer {name}: ack floor went back from {c['ack_floor']} to {now['ack_floor']}")
    last = post.get("last_seq_after_consumers", post["last_seq"])
    for name, now in post["consumers"].items():
        if max(now["ack_floor"], now["delivered"]) > last:
            problems.append(
                f"consumer {name} points past the stream's last sequence {last} "
                f"(delivered {now['delivered']}); run `ferry repair consumers`"
            )
    return problems


# -- capture guard --------------------------------------------------------------------------------


def identity(subject: str, headers: dict[str, str] | None, payload: bytes) -> str:
    """A message's identity: its Nats-Msg-Id, else a digest of subject, headers and payload.

    What ferry's data plane adds to a copy (``Ferry-Source*``, and the ``<source>:<seq>``
    id it gives a message that had none) is not part of the identity, so a copy and
    the original heard live are the same message.
    """
    headers = headers or {}
    msg_id = headers.get(MSG_ID)
    if msg_id and msg_id != f"{headers.get(SOURCE_HDR)}:{headers.get(SOURCE_SEQ_HDR)}":
        return "id:" + msg_id
    h = hashlib.blake2b(digest_size=16)
    h.update(subject.encode() + b"\0")
    for k, v in sorted(headers.items()):
        if k not in (REINJECTED, MSG_ID, SOURCE_HDR, SOURCE_SEQ_HDR) and not k.startswith("Nats-Expected"):
            h.update(f"{k}\0{v}\0".encode())
    h.update(payload)
    return "c:" + h.hexdigest()


def identity_of(m: WireMsg) -> str:
    """``identity(m.subject, m.headers, m.data)`` for a message off the data plane's connection,
    without parsing its header block when that holds one plain ``Nats-Msg-Id`` (and no
    ``Ferry-Source``): then the identity is that id. Half the time of reading a stream back
    went into parsing headers."""
    raw = m.raw
    if raw is not None and raw.count(b"Nats-Msg-Id") == 1 and b"Ferry-Source" not in raw:
        msg_id = header_value(raw, MSG_ID.encode())
        if msg_id:
            return "id:" + msg_id
    return identity(m.subject, m.headers, m.data)


def _deaf(violation: str) -> AuthError:
    return AuthError(
        f"the capture guard may not listen to the stream's subjects: the server says "
        f"{violation!r} (ferry's user must be allowed to subscribe to them)"
    )


async def check_listen(cluster: NatsCluster, subjects: list[str]) -> None:
    """Raise AuthError when ferry's user may not subscribe to `subjects`, where a capture guard
    will listen: for an operation that changes things before its guard starts."""
    conn = await Wire.open(cluster, client_name="ferry-guard")
    try:
        for s in subjects:
            await conn.subscribe(s, lambda m: None)
        await conn.flush(timeout=5)
        if conn.denied:
            raise _deaf(conn.denied[0])
    finally:
        await conn.close()


class Guard:
    """Listens to a stream's subjects and appends what it hears to an Arrow IPC file.

    It has a connection of its own, the data plane's lean one (``Wire``): at 24,000 msg/s nats-py
    took more than a core, on the same event loop and connection as the move's polls, which
    then answered late."""

    def __init__(self, cluster: NatsCluster, subjects: list[str], path: Path, flush_every: float = 0.2) -> None:
        self.cluster, self.subjects, self.path, self.flush_every = cluster, subjects, path, flush_every
        self.rows: dict[str, list] = {n: [] for n in CAPTURE_SCHEMA.names}
        self._conn: Wire | None = None
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._sink: Any = None
        self._flusher: asyncio.Task[None] | None = None
        self.waited = False  # whether start() waited blindly for gateway interest

    async def start(self, led_in: str = "", servers: dict[str, dict[str, str]] | None = None) -> None:
        """Listen; return once every server that may take a publish passes the subjects on to the guard.

        `led_in` names the NATS cluster that leads the stream: when the guard's server is in it,
        the other clusters' servers already send it the stream's subjects (the stream listens on
        them there). Otherwise they learn the guard's interest through the gateways: then each
        server of the other clusters in `servers` (name -> cluster and client URL, as
        :func:`survey` finds them) is probed too. When one of them cannot be (no URL, no
        connection, no probe heard) or `servers` is not given, the guard waits until 0.3 s have
        passed since it subscribed (`self.waited`), the time gateway interest took on the lab.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # messages: for ferry's user only
        self.path.touch(mode=0o600)
        self._sink = pa.OSFile(str(self.path), "wb")
        self._writer = pa.ipc.new_stream(self._sink, CAPTURE_SCHEMA)
        try:
            self._conn = await Wire.open(self.cluster, client_name="ferry-guard")
            subscribed = time.monotonic()
            for s in self.subjects:
                await self._conn.subscribe(s, self._on_msg)
            await self._conn.flush(timeout=5)  # the server answers a subscription it refuses before this
            if self._conn.denied:  # a guard that hears nothing would prove nothing
                raise _deaf(self._conn.denied[0])
            own = self._conn.server_cluster
            remote = [s["url"] for s in (servers or {}).values() if s["cluster"] != own]
            checks = [self._reached(self.cluster.urls)]
            if own != led_in:  # the other clusters learn of the guard through the gateways
                probeable = bool(remote) and all(remote)  # a server without a client URL cannot be probed
                checks.append(self._reached(remote, remote=True) if probeable else asyncio.sleep(0, False))
            self.waited = not all(await asyncio.gather(*checks))
            if self.waited:
                await asyncio.sleep(max(0.0, subscribed + 0.3 - time.monotonic()))
        except BaseException:
            await self.stop()
            raise
        self._flusher = asyncio.create_task(self._flush_loop())

    async def _reached(self, urls: list[str], remote: bool = False, timeout: float = 2.0) -> bool:
        """Whether each server at `urls` routes the guard's subjects to it. A server passes a
        connection's subscriptions on to the others in order (to its routes and gateways), so a
        probe subject subscribed after them (in the guard's inbox, which a user may subscribe to)
        is published from every server until the guard hears it from each, for `timeout` seconds
        at most (a user may be denied publishing there). A server of the guard's own cluster that
        ferry cannot connect to is left out (no producer reaches it either); one of another
        cluster (`remote`: another site's network, perhaps) fails the check, after 0.5 s at most."""
        assert self._conn is not None
        heard: set[str] = set()
        probe = self._conn.new_inbox()
        await self._conn.subscribe(probe, lambda m: heard.add(m.data.decode()))
        await self._conn.flush(timeout=5)

        async def reach(url: str) -> bool:
            try:
                w = await Wire.open(
                    self.cluster, urls=[url], client_name="ferry-guard-probe", timeout=0.5 if remote else 2
                )
            except BrokerUnavailable:
                return not remote
            except FerryError:  # another cluster's TLS or credentials, not the guard's: wait instead
                if remote:
                    return False
                raise
            try:
                async with asyncio.timeout(timeout):
                    while url not in heard:
                        w.publish_raw(probe.encode(), b"", b"", url.encode())
                        await asyncio.sleep(0.01)
                return True
            except (TimeoutError, FerryError):
                return False
            finally:
                await w.close()

        return all(await asyncio.gather(*(reach(u) for u in urls)))

    def _on_msg(self, m: WireMsg) -> None:
        r = self.rows
        headers = m.headers
        r["recv_ns"].append(time.time_ns())
        r["subject"].append(m.subject)
        r["headers"].append(list(headers.items()) if headers else None)
        r["payload"].append(m.data)
        r["identity"].append(identity(m.subject, headers, m.data))

    def _flush(self) -> None:
        if self.rows["recv_ns"] and self._writer:
            batch = pa.RecordBatch.from_pydict(self.rows, schema=CAPTURE_SCHEMA)
            self.rows = {n: [] for n in CAPTURE_SCHEMA.names}
            self._writer.write_batch(batch)
            self._sink.flush()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_every)
            self._flush()

    async def stop(self) -> None:
        if self._conn:
            with contextlib.suppress(Exception):
                await self._conn.flush(timeout=5)  # what the server sent before now has been heard
            await self._conn.close()
            self._conn = None
        if self._flusher:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        self._flush()
        if self._writer:
            self._writer.close()
            self._sink.close()
            self._writer = None


def read_captures(directory: Path) -> pa.Table:
    """Every capture file of a move (several when it was resumed), a killed writer's tail dropped."""
    batches = []
    for f in sorted(directory.glob("capture-*.arrow")):
        with contextlib.suppress(pa.ArrowInvalid, OSError):
            reader = pa.ipc.open_stream(pa.memory_map(str(f)))
            while True:
                try:
                    batch = reader.read_next_batch()
                except (StopIteration, pa.ArrowInvalid, OSError):
                    break
                if "identity" not in batch.schema.names:  # written by an older ferry (a move resumed after an upgrade)
                    d = batch.to_pydict()
                    rows = zip(d["subject"], d["headers"], d["payload"], strict=True)
                    ids = [identity(s, dict(h) if h else None, p) for s, h, p in rows]
                    batch = batch.append_column("identity", pa.array(ids, pa.string()))
                batches.append(batch)
    table = pa.Table.from_batches(batches, schema=CAPTURE_SCHEMA)
    recv = table.column("recv_ns")
    if len(recv) > 1 and not pc.all(pc.less_equal(recv[:-1], recv[1:])).as_py():
        table = table.sort_by("recv_ns")  # several files, or the clock stepped back: a copy of every payload
    return table


class Stored:
    """Reads back what a stream stored, range after range, on one consumer: a range that starts
    where the last one ended goes on with it, so reading the tail after the head sets up nothing."""

    def __init__(self, cluster: NatsCluster, stream: str) -> None:
        from ferry.pipeline.jetstream import ReadConfig

        self.cfg = ReadConfig(cluster=cluster.model_dump_json(), name="move", streams=(stream,))
        self.stream = stream
        self._reader: Any = None

    async def since(self, seq0: int, last: int) -> list[tuple[str, int]]:
        """(identity, store time ns) of every message with seq0 < seq <= last."""
        from ferry.pipeline.jetstream import Range, Reader, read_ahead

        if last <= seq0:
            return []
        self._reader = self._reader or await Reader.open(self.cfg, self.stream)
        lists = read_ahead(self._reader.lists(Range(self.stream, seq0 + 1, last, fetch=2000), keep=True))
        async with contextlib.aclosing(lists):
            return [(identity_of(m), ts_ns) async for got in lists for m, _, ts_ns in got]

    async def __aenter__(self) -> Stored:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._reader:
            await self._reader.close()


def missing(captured: pa.Table, stored: list[tuple[str, int]]) -> tuple[list[int], dict[str, int]]:
    """Row numbers of captured messages the stream does not hold (capture order), and identity -> first row."""
    held = Counter(i for i, _ in stored)
    ids = captured.column("identity").to_pylist()
    first: dict[str, int] = {}
    seen: Counter[str] = Counter()
    out = []
    for row, ident in enumerate(ids):
        first.setdefault(ident, row)
        if ident.startswith("id:"):
            if row == first[ident] and held[ident] == 0:
                out.append(row)  # a re-sent msg id counts once
            continue
        seen[ident] += 1
        if seen[ident] > held[ident]:
            out.append(row)
    return out, first


def unavailable_window(capture_ns: list[int], stored_ns: list[int], offset_ns: int) -> float:
    """Seconds: the longest gap between two stored messages during which publishes were heard.

    `offset_ns` maps capture clock to store clock (median store - capture delay of
    matched messages), so the figure does not depend on the two clocks agreeing.
    """
    if len(stored_ns) < 2 or not capture_ns:
        return 0.0
    s = sorted(stored_ns)
    c = sorted(x + offset_ns for x in capture_ns)
    best = 0
    for a, b in pairwise(s):
        if b - a > best and bisect_left(c, b) > bisect_right(c, a):
            best = b - a
    return best / 1e9


def measured_window(captured: pa.Table, stored: list[tuple[str, int]], first: dict[str, int]) -> float:
    """The unavailability window of a move, the capture clock mapped onto the store clock
    through the messages both saw (`first`: identity -> first capture row, from :func:`missing`)."""
    recv = captured.column("recv_ns").to_pylist()
    when = dict(stored)
    pairs = [when[ident] - recv[row] for ident, row in first.items() if ident in when]
    offset = int(median(pairs)) if pairs else 0
    return unavailable_window(recv, [ts for _, ts in stored], offset)


# -- the move ----------------------------------------------------------------------------------------


def state_root(given: Path | None = None) -> Path:
    """Where ferry keeps capture files: `given`, else $FERRY_STATE_DIR, else ~/.local/state/ferry."""
    if given:
        return given
    env = os.environ.get("FERRY_STATE_DIR")
    return Path(env) if env else Path.home() / ".local" / "state" / "ferry"


async def account_name(nc: Client) -> str:
    info = await bnats.sys_request(nc, "$SYS.REQ.USER.INFO", timeout=5)
    acc = (info.get("data") or {}).get("account")
    if not acc:
        raise FerryError("cannot tell the account of the topology's credentials ($SYS.REQ.USER.INFO)")
    return acc


async def _led_stream_info(nc: Client, stream: str) -> dict:
    try:
        return await stream_info(nc, stream)
    except BrokerUnavailable:
        raise PreflightFailed(f"stream {stream!r} did not answer STREAM.INFO: no leader now") from None


async def preflight(nc: Client, sysnc: Client, req: MoveRequest, resuming: bool = False) -> dict[str, Any]:
    """Refuse (PreflightFailed, nothing changed) or return the move's plan."""
    if not req.to and not req.to_tags:
        raise UsageError("say where to: --to CLUSTER or --to-tags TAG,...")
    view = await survey(sysnc)
    if not view.meta_leader:
        raise PreflightFailed("no JetStream meta leader: the super-cluster cannot place streams now")
    info = await _led_stream_info(nc, req.stream)
    cfg = info["config"]
    replicas = int(cfg.get("num_replicas", 1))
    if req.to and req.to not in view.clusters():
        raise PreflightFailed(f"destination cluster {req.to!r} unknown (known: {', '.join(sorted(view.clusters()))})")
    c = info.get("cluster") or {}
    origin = c.get("name", "")
    ps = peers(info)
    dest_all = view.matching(req.placement())
    dest_names = {s.name for s in dest_all}
    plan: dict[str, Any] = {
        "stream": req.stream,
        "from": origin,
        "to": req.target(),
        "replicas": replicas,
        "bytes": info["state"]["bytes"],
        "messages": info["state"]["messages"],
        "last_seq": info["state"]["last_seq"],
        "peers": [p["name"] for p in ps],
        "warnings": [],
    }
    placement_now = cfg.get("placement") or {}
    moving = (placement_now.get("cluster") and placement_now.get("cluster") != origin) or len(ps) > replicas
    if moving and not resuming:
        raise PreflightFailed(
            f"stream {req.stream!r} is already moving "
            f"(placement {json.dumps(placement_now)}, {len(ps)} peers for R{replicas})"
        )
    if not moving and ps and all(p["name"] in dest_names for p in ps):
        plan["nothing_to_do"] = True
        return plan
    if not c.get("leader"):
        raise PreflightFailed(f"stream {req.stream!r} has no leader now; move it once it is led")
    current = sum(1 for p in ps if p["current"] and not p.get("offline"))
    if current < replicas // 2 + 1:
        raise PreflightFailed(f"stream {req.stream!r} has no quorum now ({current} of {replicas} peers current)")
    refusal = destination_refusal(dest_all, replicas, info["state"]["bytes"], req.target())
    if refusal:
        raise PreflightFailed(refusal)
    counts = Counter(s.cluster for s in view.servers.values())
    dest_clusters = {s.cluster for s in dest_all}
    if origin and any(counts[d] != counts[origin] for d in dest_clusters):
        plan["warnings"].append(
            f"clusters differ in size ({origin}: {counts[origin]} servers, "
            + ", ".join(f"{d}: {counts[d]}" for d in sorted(dest_clusters))
            + "): every destination server may briefly join the stream's Raft group"
        )
    plan["dest_servers"] = sorted(dest_names)
    plan["origin_servers"] = sorted(s.name for s in view.servers.values() if s.cluster == origin)
    plan["servers"] = {s.name: {"cluster": s.cluster, "url": s.url} for s in view.servers.values()}
    return plan


def destination_refusal(servers: list[Server], replicas: int, need: int, target: str) -> str | None:
    """Why `servers` cannot take an R`replicas` stream of `need` bytes (None: they can)."""
    healthy = [s for s in servers if not s.offline and s.free >= need]
    if len(healthy) >= replicas:
        return None
    why = []
    if off := [s.name for s in servers if s.offline]:
        why.append(f"offline or lame duck: {', '.join(off)}")
    if full := [s.name for s in servers if not s.offline and s.free < need]:
        why.append(f"not enough storage: {', '.join(full)}")
    return f"destination {target} has {len(healthy)} healthy server(s) for an R{replicas} stream" + (
        f" ({'; '.join(why)})" if why else ""
    )


class StopOnSignal:
    """Ctrl-C / SIGTERM during a move: ask for a cancel (a second one exits at once)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.installed: list[int] = []

    def __enter__(self) -> StopOnSignal:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._on_signal)
                self.installed.append(sig)
        return self

    def _on_signal(self) -> None:
        if self.event.is_set():
            os.write(
                2,
                b"stopped at once: a move that had begun is on record; run the same command again to finish it "
                b"(a cancel journaled is carried out then)\n",
            )
            os._exit(130)
        self.event.set()

    def __exit__(self, *exc: object) -> None:
        loop = asyncio.get_running_loop()
        for sig in self.installed:
            loop.remove_signal_handler(sig)


async def _cancel_request(sysnc: Client, account: str, stream: str) -> dict:
    return await api(sysnc, f"$JS.API.ACCOUNT.STREAM.CANCEL_MOVE.{account}.{stream}", timeout=10)


async def move(
    cluster: NatsCluster,
    req: MoveRequest,
    emit: Emit = no_emit,
    stop: asyncio.Event | None = None,
) -> dict[str, Any]:
    """Run (or resume) one move; returns its result. Raises PreflightFailed having changed nothing."""
    async with (
        bnats.session(cluster, client_name="ferry-move") as nc,
        bnats.session(cluster, system=True, client_name="ferry-move-sys") as sysnc,
    ):
        await _led_stream_info(nc, req.stream)  # a leaderless stream is refused before the journal is touched
        journal = Journal(nc, f"move.{req.stream}", replicas=min(3, len(cluster.brokers)))
        try:
            prior = await journal.open()
        except (NatsTimeout, TimeoutError):
            raise BrokerUnavailable(f"the journal bucket {BUCKET} did not answer; JetStream unavailable?") from None
        resuming = bool(prior and prior.get("phase") not in (None, "done", "cancelled"))
        if resuming and journal.owner_alive(prior or {}):
            o = (prior or {}).get("owner", {})
            raise Conflict(
                f"a move of {req.stream!r} is already running (pid {o.get('pid')} on {o.get('host')}, "
                f"phase {prior.get('phase')})"  # type: ignore[union-attr]
            )
        plan = await preflight(nc, sysnc, req, resuming=resuming)
        emit("plan", **plan)
        if req.dry_run or (plan.get("nothing_to_do") and not resuming):
            return {**plan, "outcome": "dry-run" if req.dry_run else "already there"}
        account = await account_name(nc)
        t0 = time.monotonic()
        if resuming:
            journal.state = dict(prior or {})
            emit("resume", phase=journal.state["phase"], move_id=journal.state["move_id"])
            capture_dir = Path(journal.state["capture_dir"])
        else:
            move_id = uuid.uuid4().hex[:12]
            capture_dir = state_root(req.state_dir) / "moves" / f"{req.stream}-{move_id}"
            pre = await snapshot(nc, req.stream)
            journal.state = {
                "stream": req.stream,
                "move_id": move_id,
                "account": account,
                "from": plan["from"],
                "to": req.target(),
                "placement": req.placement(),
                "origin_servers": plan["origin_servers"],
                "dest_servers": plan["dest_servers"],
                "seq0": pre["last_seq"],
                "pre": pre,
                "capture_dir": str(capture_dir),
                "started": time.time(),
            }
        st = journal.state
        info = await stream_info(nc, req.stream)
        guard = None
        if req.guard and info["config"].get("subjects"):
            guard = Guard(
                cluster, info["config"]["subjects"], capture_dir / f"capture-{os.getpid()}-{int(time.time())}.arrow"
            )
            try:
                await guard.start(led_in=(info.get("cluster") or {}).get("name", ""), servers=plan.get("servers"))
            except BaseException:
                if not resuming:  # nothing was journaled or changed yet
                    shutil.rmtree(capture_dir, ignore_errors=True)
                raise
            emit("guard", subjects=info["config"]["subjects"], file=str(guard.path), waited=guard.waited)
        elif req.guard:
            emit(
                "guard", subjects=[], note="the stream has no subjects of its own (mirror/sourced): nothing to capture"
            )
        result: dict[str, Any] = {"stream": req.stream, "move_id": st["move_id"], "from": st["from"], "to": st["to"]}
        if resuming and guard and prior and prior.get("heartbeat"):
            # the run before listened until about its last heartbeat; this one from now on
            result["unguarded_s"] = gap = round(max(0.0, time.time() - float(prior["heartbeat"])), 1)
            emit(
                "unguarded",
                seconds=gap,
                note=f"no guard listened for about {gap:.1f}s before this run: core (fire-and-forget) publishes "
                "then are not covered (JetStream publishes with retries are)",
            )
        try:
            # journaled once the guard listens (a guard refused leaves nothing behind); a resume claims
            # the journal here, before it acts (compare-and-set: of two reruns at once, one stops)
            await journal.save(**({} if resuming else {"phase": "starting"}))
            placed = same_placement(info["config"].get("placement") or {}, st["placement"])
            if st.get("phase") == "starting" and not placed and stop and stop.is_set():
                # interrupted before the placement changed: nothing to cancel, the stream stays put
                emit("cancelled", by="interrupt before the placement update")
                await journal.save(phase="reconciling", outcome="cancelled")
            if st.get("phase") == "starting":
                if not placed:
                    cfg = dict(info["config"])
                    cfg["placement"] = st["placement"]
                    await api(nc, f"$JS.API.STREAM.UPDATE.{req.stream}", cfg, timeout=10)
                    emit("placement", placement=st["placement"])
                # not awaited: a resume from "starting" finds the placement already set and goes on
                journal.save_soon(phase="moving")
            if st["phase"] == "moving":
                outcome, watch = await _watch(nc, sysnc, req, journal, emit, stop, t0)
                result.update(watch)
                # not awaited (the bucket takes a second under load): a resume from "moving" finds the
                # stream in place at once and reconciles all the same
                journal.save_soon(phase="reconciling", outcome=outcome)
        finally:
            if guard:
                await guard.stop()
        result["outcome"] = st["outcome"]
        if guard or (capture_dir.exists() and any(capture_dir.glob("capture-*.arrow"))):
            result.update(await reconcile(cluster, nc, req.stream, st, capture_dir, emit))
        post = await snapshot(nc, req.stream)
        problems = verify(st["pre"], post)
        result["verify"] = {"ok": not problems, "problems": problems, "last_seq": post["last_seq"]}
        emit("verify", **result["verify"])
        info = await stream_info(nc, req.stream)
        result["cluster"] = (info.get("cluster") or {}).get("name")
        result["peers"] = [p["name"] for p in peers(info)]
        result["took_s"] = round(time.time() - st["started"], 3)
        await journal.save(phase="done" if st["outcome"] == "moved" else "cancelled", result=result)
        shutil.rmtree(capture_dir, ignore_errors=True)  # reconciled: the captures have served
        emit("done", **{k: v for k, v in result.items() if k != "verify"})
        return result


async def _watch(
    nc: Client,
    sysnc: Client,
    req: MoveRequest,
    journal: Journal,
    emit: Emit,
    stop: asyncio.Event | None,
    t0: float,
) -> tuple[str, dict[str, Any]]:
    """Poll the stream until it lives in the destination (or is back in the origin after a cancel)."""
    st = journal.state
    dest, origin = set(st["dest_servers"]), set(st["origin_servers"])
    deadline = t0 + req.timeout
    leader = None
    changes: list[dict[str, Any]] = []
    leaderless = unanswered = 0.0
    asked = st.get("cancel")  # a cancel a run before this one asked for (Ctrl-C, timeout)
    last_poll = time.monotonic()
    last_emit = last_beat = 0.0
    cancelled_at: float | None = None
    cancel_again_at = not_moving_since = 0.0  # after a cancel the server called premature or late
    handoff: dict[str, Any] | None = None
    ready_since: tuple[str, float] | None = None  # (peer, when it was first found ready to lead)
    while True:
        now = time.monotonic()
        try:
            info = await stream_info(nc, req.stream, timeout=1.0)
            fresh = time.monotonic() - now < 0.6  # a busy leader answers late: its view is old news
        except (BrokerUnavailable, NatsTimeout, TimeoutError, FerryError) as exc:
            if isinstance(exc, NotFound):
                raise
            info = None
        dt, last_poll = now - last_poll, now
        new_leader = ((info or {}).get("cluster") or {}).get("leader")
        if info is None:  # a leader busy catching up new peers answers late: not the same as none
            unanswered += dt
        elif not new_leader:
            leaderless += dt
        if new_leader and new_leader != leader:
            if leader is not None:
                changes.append({"at_s": round(now - t0, 3), "from": leader, "to": new_leader})
                emit("leader", at_s=round(now - t0, 3), leader=new_leader, previous=leader)
            leader = new_leader
        if info:
            placement = info["config"].get("placement") or {}
            if cancelled_at is None and not same_placement(placement, st["placement"]):
                cancelled_at = now
                emit("cancelled", by=f"the run before ({asked})" if asked else "someone else (placement changed back)")
            if cancelled_at is None and _in(info, dest):
                outcome = "moved"
                break
            if cancelled_at is not None and _in(info, origin):
                outcome = "cancelled"
                break
            keep = ready_since[0] if ready_since else None
            ready = handoff_candidate(info, dest, keep) if fresh and cancelled_at is None and handoff is None else None
            if not (ready and await ready_to_lead(sysnc, ready, st["account"], req.stream, new_leader)):
                ready_since = None
            elif not ready_since or ready_since[0] != ready:
                ready_since = (ready, now)
            elif now - ready_since[1] < HANDOFF_STEADY_S:
                pass
            elif not await _still_ready(nc, req.stream, dest, ready):
                ready_since = None  # behind again at the last look: steady once more first
            else:
                handoff = {"at_s": round(now - t0, 3), "from": new_leader, "to": ready}
                try:
                    await api(nc, f"$JS.API.STREAM.LEADER.STEPDOWN.{req.stream}", {"placement": {"preferred": ready}})
                except (FerryError, NatsTimeout, TimeoutError) as exc:  # e.g. the server moved it itself just now
                    handoff["error"] = str(exc)
                emit("handoff", **handoff)
            if now - last_emit >= 0.5:
                last_emit = now
                emit(
                    "progress",
                    at_s=round(now - t0, 2),
                    leader=new_leader,
                    peers=peers(info),
                    last_seq=info["state"]["last_seq"],
                )
        interrupted = stop is not None and stop.is_set()
        if cancelled_at is None and (now > deadline or interrupted or asked) and now >= cancel_again_at:
            if not cancel_again_at:
                reason = "timeout" if now > deadline else "interrupted" if interrupted else f"asked before: {asked}"
                try:  # journaled first: a rerun carries the cancel out if this run cannot
                    await journal.save(cancel=asked or reason)
                except Exception as exc:  # but the cancel does not wait on the journal's health
                    emit("warning", note=f"the cancel is not journaled ({exc}); asking for it all the same")
                emit("cancelling", reason=reason)
            try:
                await _cancel_request(sysnc, st["account"], req.stream)
                cancelled_at = now
            except FerryError as exc:
                if getattr(exc, "fields", {}).get("err_code") != 10129:
                    raise
                # "not in progress": the group holds only the destination's peers already (the next
                # poll finds the stream moved) or not yet theirs; ask again unless it lands first
                if not cancel_again_at:
                    emit("cancel", note=f"too late to cancel, or too early: {exc}")
                    not_moving_since = now
                elif now - not_moving_since > 120:
                    now_on = ", ".join(p["name"] + ("" if p["current"] else " (behind)") for p in peers(info or {}))
                    raise FerryError(
                        f"stream {req.stream!r}: no move in progress, says the server, yet the stream is not healthy "
                        f"in {st['to']} after 120s (peers: {now_on or 'unknown'})"
                    ) from None
                cancel_again_at = now + 0.5
        if cancelled_at is not None and now - cancelled_at > 120:
            raise FerryError(f"stream {req.stream!r} not healthy in {st['from']} 120s after the cancel")
        if now - last_beat >= 1.0:
            last_beat = now
            journal.save_soon()
        await asyncio.sleep(0.05)
    return outcome, {
        "leader_changes": changes,
        "handoff": handoff,
        "leaderless_s": round(leaderless, 3),
        "unanswered_s": round(unanswered, 3),
        "moved_in_s": round(now - t0, 3),
    }


async def reconcile(
    cluster: NatsCluster, nc: Client, stream: str, st: dict[str, Any], capture_dir: Path, emit: Emit
) -> dict[str, Any]:
    """Compare what the guard heard with what the stream holds; re-publish what it lacks."""
    stop_ns = time.time_ns()
    # what the stream holds now is read back while the captures are read and it settles, the rest after
    held = max(st["seq0"], (await stream_info(nc, stream))["state"]["last_seq"])
    async with Stored(cluster, stream) as reader:
        head = asyncio.ensure_future(reader.since(st["seq0"], held))
        try:
            captured = await asyncio.to_thread(read_captures, capture_dir)
            heard_last = captured["recv_ns"][-1].as_py() if captured.num_rows else 0
            await _settle(nc, stream, stop_ns, heard_last)
            last = (await stream_info(nc, stream))["state"]["last_seq"]
            stored = await head + await reader.since(held, last)
        finally:
            head.cancel()
            await asyncio.gather(head, return_exceptions=True)  # off the reader before it closes
    rows, first = missing(captured, stored)
    window = measured_window(captured, stored, first)
    reinjected = already = 0
    if rows:
        async with Publisher(nc, window=256, ack_timeout=2.0, give_up_after=60.0) as pub:
            for m in captured.take(rows).to_pylist():
                headers = {k: v for k, v in (m["headers"] or []) if not k.startswith("Nats-Expected")}
                headers[REINJECTED] = st["move_id"]
                await pub.publish(m["subject"], m["payload"], headers=headers, msg_id=headers.get(MSG_ID))
            stats = await pub.flush()  # the publisher gives up on what it cannot store
        if stats.failed:
            raise FerryError(f"re-publishing {len(rows)} missed messages: {stats.failed} failed ({stats.errors[:1]})")
        reinjected, already = stats.stored, stats.duplicates
    out = {
        "captured": captured.num_rows,
        "missed": len(rows),
        "reinjected": reinjected,
        "already_stored": already,  # a producer's own retry got there first (same Nats-Msg-Id)
        "unavailable_s": round(window, 4),
    }
    emit("guard", **out)
    return out


async def _settle(nc: Client, stream: str, stop_ns: int, heard_last: int) -> None:
    """A publish heard just before the guard stopped may still be on its way to the stream: wait
    (2 s at most) until the stream holds something stored after that, or (the producers stopped
    too) until it has stored nothing new for half a second."""
    last_seq, still = -1, 0
    for _ in range(40 if heard_last > stop_ns - 500_000_000 else 0):
        info = await stream_info(nc, stream)
        if _ts_ns(info["state"].get("last_ts", "")) > stop_ns + 200_000_000:
            return
        still = still + 1 if info["state"]["last_seq"] == last_seq else 0
        if still >= 10:
            return
        last_seq = info["state"]["last_seq"]
        await asyncio.sleep(0.05)


def _ts_ns(text: str) -> int:
    """RFC 3339 with nanoseconds (what JetStream reports) to epoch ns."""
    from datetime import datetime

    if not text:
        return 0
    base, _, frac = text.rstrip("Z").partition(".")
    secs = int(datetime.fromisoformat(base + "+00:00").timestamp())
    digits = "".join(ch for ch in frac if ch.isdigit())[:9].ljust(9, "0")
    return secs * 1_000_000_000 + int(digits)


async def move_many(
    cluster: NatsCluster,
    pattern: str,
    req: MoveRequest,
    concurrency: int = 1,
    emit: Emit = no_emit,
    stop: asyncio.Event | None = None,
) -> list[dict[str, Any]]:
    """Every stream whose name matches `pattern`, `concurrency` at a time (one move per stream)."""
    async with bnats.session(cluster) as nc:
        names = sorted([n async for n in paged(nc, "$JS.API.STREAM.NAMES", "streams")])
    chosen = [n for n in names if fnmatch.fnmatchcase(n, pattern) and n != "KV_" + BUCKET]
    if not chosen:
        raise NotFound(f"no stream matches {pattern!r}")
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(name: str) -> dict[str, Any]:
        async with gate:
            if stop and stop.is_set():
                return {"stream": name, "outcome": "not started", "error": "interrupted before its turn"}
            r = MoveRequest(**{**req.__dict__, "stream": name})
            try:
                return await move(cluster, r, lambda ev, **d: emit(ev, **{"stream": name, **d}), stop)
            except FerryError as exc:
                emit("error", stream=name, error=str(exc))
                return {
                    "stream": name,
                    "outcome": "refused" if isinstance(exc, PreflightFailed) else "failed",
                    "error": str(exc),
                }

    return list(await asyncio.gather(*(one(n) for n in chosen)))


async def status(cluster: NatsCluster, stream: str) -> dict[str, Any]:
    """`ferry move --status STREAM`: the journaled state of the stream's last move."""
    from nats.js.errors import BucketNotFoundError, KeyNotFoundError

    async with bnats.session(cluster) as nc:
        try:
            entry = await (await nc.jetstream().key_value(BUCKET)).get(f"move.{stream}")
        except (BucketNotFoundError, KeyNotFoundError):
            raise NotFound(f"no move of {stream!r} on record") from None
    state = json.loads(entry.value or b"{}")
    state.pop("pre", None)
    live = state.get("phase") not in ("done", "cancelled")
    state["owner_alive"] = live and owner_alive(state)
    return state


async def cancel(cluster: NatsCluster, stream: str) -> dict[str, Any]:
    """`ferry move --cancel STREAM`: put a moving stream back where it was."""
    async with (
        bnats.session(cluster) as nc,
        bnats.session(cluster, system=True) as sysnc,
    ):
        info = await stream_info(nc, stream)
        account = await account_name(nc)
        try:
            await _cancel_request(sysnc, account, stream)
        except FerryError as exc:
            raise UsageError(f"stream {stream!r}: nothing to cancel ({exc})") from None
        return {"stream": stream, "cancelled": True, "cluster": (info.get("cluster") or {}).get("name")}


async def repair_consumers(cluster: NatsCluster, stream: str, dry_run: bool = False) -> list[dict[str, Any]]:
    """Recreate each durable consumer left pointing past the stream's last sequence (a sequence reset).

    Every message the stream holds now was stored after the reset and none of
    them was delivered to the stuck consumer, so it restarts at the stream's first
    sequence, keeping its name and the rest of its configuration.
    """
    async with bnats.session(cluster) as nc:
        info = await stream_info(nc, stream)
        st = info["state"]
        fixes = []
        for name, c in (await consumers(nc, stream)).items():
            delivered, floor = c["delivered"]["stream_seq"], c["ack_floor"]["stream_seq"]
            if max(delivered, floor) <= st["last_seq"] or not c["config"].get("durable_name"):
                continue
            if (
                c["config"].get("deliver_policy") == "by_start_sequence"
                and delivered == c["config"]["opt_start_seq"] - 1
            ):
                continue  # configured to wait for a sequence still to come: not stuck
            cfg = dict(c["config"])
            start = st["first_seq"] if st["messages"] else st["last_seq"] + 1
            for k in ("opt_start_time", "opt_start_seq"):
                cfg.pop(k, None)
            cfg.update(deliver_policy="by_start_sequence", opt_start_seq=max(1, start))
            fix = {
                "consumer": name,
                "delivered": delivered,
                "ack_floor": floor,
                "last_seq": st["last_seq"],
                "restart_at": start,
            }
            if not dry_run:
                await api(nc, f"$JS.API.CONSUMER.DELETE.{stream}.{name}")
                await api(nc, f"$JS.API.CONSUMER.CREATE.{stream}.{name}", {"stream_name": stream, "config": cfg})
                fix["recreated"] = True
            fixes.append(fix)
        return fixes
