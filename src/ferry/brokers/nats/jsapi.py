"""The JetStream and system-account API as raw JSON: what ferry's jobs administer streams with.

Features: ``$JS.API`` requests whose configuration round-trips exactly (nats-py's
typed configs drop fields they do not know), paged lists that never mistake a
late item for an absent one, the super-cluster as the system account sees it
(every server's JetStream state, cluster, tags and client URL), and the account
of the connected user.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout

from ferry.brokers import nats as bnats
from ferry.errors import BrokerUnavailable, FerryError, NotFound

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


async def ask_server(sysnc: Client, kind: str, server: str, timeout: float = 1.0, **query: Any) -> dict:
    """One server's $SYS.REQ.SERVER.PING.<kind> answer (VARZ, JSZ, HEALTHZ ...) through the system
    account, filtered by `query`; {} when it does not answer in time (down, busy, cut off)."""
    who = {"server_name": server, "exact_match": True, **query}
    try:
        r = await bnats.sys_request(sysnc, f"$SYS.REQ.SERVER.PING.{kind}", who, timeout=timeout)
    except (FerryError, NatsTimeout, TimeoutError):
        return {}
    return r.get("data") or {}


# -- stream API (raw JSON: the config round-trips exactly) ---------------------------------------


async def api(nc: Client, subject: str, payload: dict | None = None, timeout: float = 5.0) -> dict:
    resp = await bnats.sys_request(nc, subject, payload or {}, timeout=timeout)
    err = resp.get("error")
    if err:
        code = err.get("err_code", 0)
        if code == 10059:
            raise NotFound(f"stream {subject.rsplit('.', 1)[-1]!r} not found")
        if off := bnats.jetstream_off(nc, code):
            raise off
        description = err.get("description", str(err))
        raise FerryError(f"{subject}: {description} (err_code {code})", err_code=code, description=description)
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


async def account_name(nc: Client) -> str:
    info = await bnats.sys_request(nc, "$SYS.REQ.USER.INFO", timeout=5)
    acc = (info.get("data") or {}).get("account")
    if not acc:
        raise FerryError("cannot tell the account of the topology's credentials ($SYS.REQ.USER.INFO)")
    return acc


def ts_ns(text: str) -> int:
    """RFC 3339 with nanoseconds (what JetStream reports) to epoch ns."""
    from datetime import datetime

    if not text:
        return 0
    base, _, frac = text.rstrip("Z").partition(".")
    secs = int(datetime.fromisoformat(base + "+00:00").timestamp())
    digits = "".join(ch for ch in frac if ch.isdigit())[:9].ljust(9, "0")
    return secs * 1_000_000_000 + int(digits)
