"""What an operator asks of a replication: ``replicate start`` (define or re-enable it at its
destination), ``replicate stop`` (the active relay stops gracefully and writes its stop marker) and
``replicate status`` (every replication at every reachable site, with what actually happens)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import Any

from ferry.errors import Conflict, FerryError, NotFound
from ferry.jobs.replicate.plan import (
    RELAY,
    Replication,
    backlog_from,
    check,
    ensure_streams,
    first_line,
    lags,
    site_cluster,
    site_journal,
    site_session,
    source_configs,
    streams_at,
)
from ferry.journal import KvJournal, owner_alive
from ferry.topology import NatsCluster, Topology

PROGRESS_STALE = 10.0  # seconds: older progress of a live relay shows no current rate in `status`


async def start(
    topo: Topology,
    rep: Replication,
    dry_run: bool = False,
    keep_marker: bool = True,
    progress: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Define (or re-enable) a replication at its destination; create missing destination streams.

    A stop marker of the same replication is kept (the relay starts there) unless `keep_marker` is
    False (something else wrote to the destination since: it must be scanned). `progress`: where
    it stands now, for `status` and lag until a relay reports (a site fail-back knows it)."""
    check(topo, rep)
    streams = await streams_at(site_cluster(topo, rep.source), rep.streams, rep.source)
    dest_streams = {s: rep.dest_stream(s) for s in streams}
    async with site_session(topo, rep.source) as snc:
        await source_configs(snc, rep, streams)  # refuses what cannot be relayed, before anything changes
    if dry_run:  # read without creating the journal's bucket
        return {
            "dry_run": True,
            **asdict(rep),
            "dest_streams": dest_streams,
            "already": _running(await _peek(topo, rep), rep),
        }
    async with site_journal(topo, rep.dest, rep.key) as j:
        state = await j.open()
        if _running(state, rep):
            created = (await ensure_streams(topo, rep, streams))[0]
            return {**state, "dest_streams": dest_streams, "created": created, "already": True}
        if state and j.owner_alive(state):
            raise Conflict(f"the relay {rep.source} -> {rep.dest} is still stopping; try again in a few seconds")
        created, *_ = await ensure_streams(topo, rep, streams)
        state = state or {"state": RELAY.step(None, "defined")}
        new = {**state, **asdict(rep), "desired": "running"}
        if "source" in state and Replication.from_state(state) != rep:
            new["marker"], new["progress"] = None, None  # positions in other streams
        elif not keep_marker:
            new["marker"] = None
        if progress is not None:
            new["progress"], new["progress_at"] = progress, time.time()
        j.state = new
        await j.save(release=True)
    return {**new, "dest_streams": dest_streams, "created": created}


def _running(state: dict[str, Any] | None, rep: Replication) -> bool:
    """Whether `state` is `rep` started; raises if another replication between its sites is."""
    if not state or state.get("desired") != "running":
        return False
    if Replication.from_state(state) != rep:
        raise Conflict(f"replication {rep.source} -> {rep.dest} is already running with other settings; stop it first")
    return True


async def _peek(topo: Topology, rep: Replication) -> dict[str, Any] | None:
    """`rep`'s journal state at its destination, read without creating the bucket."""
    async with site_session(topo, rep.dest) as nc:
        return await KvJournal(nc, rep.key).open(create=False)


async def stop(topo: Topology, source: str, dest: str, wait: float = 30.0, force: bool = False) -> dict[str, Any]:
    """Ask the active relay to stop gracefully (it writes a stop marker); without one, mark it stopped."""
    key = Replication(source, dest).key
    async with site_journal(topo, dest, key) as j:
        if await j.open() is None:
            raise NotFound(f"no replication {source} -> {dest} is defined (nothing under {key!r} at {dest})")
        state = await j.request(desired="stopped")
        deadline = time.monotonic() + wait
        while j.owner_alive(state) and state.get("state") != "stopped":
            if time.monotonic() > deadline:
                if not force:
                    raise FerryError(f"the relay {source} -> {dest} did not stop within {wait:.0f}s")
                break
            await asyncio.sleep(0.3)
            state = await j.open() or {}
        if state.get("state") != "stopped" or j.owner_alive(state):
            # nobody (alive) relays, or forced: fence the owner out; the next start scans
            state = await j.request(state=RELAY.step(state.get("state"), "stopped"), owner=None, marker=None)
        return state


async def status(topo: Topology) -> list[dict[str, Any]]:
    """Every replication defined at any reachable NATS site, with its progress.

    A row keeps the journal's fields: ``desired`` is what the operator asked for ("running" once
    started, "stopped"), ``state`` the last one a relay or command wrote, which may be a dead relay's.
    What actually happens is added: ``live`` (a relay holds the lease with a fresh heartbeat; then
    ``leader`` is it, else None), ``heartbeat_age_s`` (the live leader's), ``relay`` ("running",
    "resuming", "stopping" or "none"), ``intent`` ("started" or "stopped") and ``summary`` (one line
    for people, e.g. ``started, no relay running`` or ``running (leader h:1, heartbeat 0.4 s ago)``).
    Per stream ``rate`` is the live relay's only; without one it is None and the last relay's is
    ``last_rate``, measured ``progress_age_s`` seconds ago (a row field), while the backlog
    (``lag``, ``lag_s``, ``source_last``) is read from the source now (``lag_at``)."""

    async def at(site: str) -> list[dict[str, Any]]:
        try:
            async with site_journal(topo, site, "") as j:
                return [status_row(await j.get(key) or {}, time.time()) for key in sorted(await j.keys(["relay.*.*"]))]
        except Exception as exc:  # one unreachable site must not hide the others
            return [{"dest": site, "unreachable": first_line(exc)}]

    sites = [site for site, name, cluster in topo.clusters() if isinstance(cluster, NatsCluster) and name == site]
    out = [row for rows in await asyncio.gather(*map(at, sites)) for row in rows]  # every site at once
    for row in out:
        if row.get("progress") and not any(p.get("rate") is not None for p in row["progress"].values()):
            await _lag_now(topo, row)
    return out


async def _lag_now(topo: Topology, row: dict[str, Any]) -> None:
    """Without a relay reporting, the backlog keeps growing at the source: read it there now
    (``lag_at`` "now"), instead of showing the last relay's figures (left as they were, with
    ``lag_at`` "last relay", when the source does not answer). A graceful stop's marker is the
    exact position (the last progress report may be a second older)."""
    relayed, foreign = backlog_from(row)
    try:
        async with site_session(topo, row["source"], timeout=2) as nc:
            fresh = await lags(nc, relayed, foreign)
    except Exception:
        for p in row["progress"].values():
            p["lag_at"] = "last relay"
        return
    for s, p in row["progress"].items():
        p.update(fresh[s], lag_at="now")


def lease_live(state: dict[str, Any]) -> bool:
    """Whether the replication's lease holder is alive, as standbys see it."""
    lease = state.get("lease")
    return owner_alive(state, max(1.0, float(lease) - 1.0) if lease else 10.0)


def status_row(state: dict[str, Any], now: float) -> dict[str, Any]:
    """`state` (a journal record) with what is actually happening: see `status`."""
    live = lease_live(state)
    started = state.get("desired") == "running"
    row: dict[str, Any] = {**state, "leader": state.get("owner") if live else None, "live": live}
    row["intent"] = "started" if started else "stopped"
    row["heartbeat_age_s"] = round(max(0.0, now - float(state.get("heartbeat") or 0)), 1) if live else None
    recorded = state.get("state")
    if not live:
        row["relay"] = "none"
        if started:
            row["summary"] = "started, no relay running"
            if recorded == "failed" and state.get("error"):
                row["summary"] += f" (the last one failed: {state['error']})"
            elif recorded in ("resuming", "relaying"):
                row["summary"] += " (the last one died or was cut off)"
        else:
            row["summary"] = "stopped" if recorded in ("stopped", "defined", None) else f"stopped ({recorded})"
    else:
        row["relay"] = "stopping" if not started else "running" if recorded == "relaying" else "resuming"
        o = state.get("owner") or {}
        who = f"leader {o.get('host', '?')}:{o.get('pid', '?')}, heartbeat {row['heartbeat_age_s']} s ago"
        row["summary"] = f"started, relay resuming ({who})" if row["relay"] == "resuming" else f"{row['relay']} ({who})"
    at = state.get("progress_at") or (state.get("heartbeat") if live else None)
    row["progress_age_s"] = round(max(0.0, now - float(at)), 1) if at and state.get("progress") else None
    current = live and row["relay"] == "running" and (row["progress_age_s"] or 0) <= PROGRESS_STALE
    row["consumers"] = [{**c, "age_s": round(max(0.0, now - c["at"]), 1)} for c in state.get("consumers") or []]
    if state.get("progress"):  # the last relay's; its rate is a current one only while it relays
        row["progress"] = {s: dict(p or {}) for s, p in state["progress"].items()}
        for p in row["progress"].values():
            if "rate" in p:
                p["last_rate"] = p["rate"]
                p["rate"] = p["rate"] if current else None
    return row
