"""Site failover and site fail-back (``ferry site``): the primary site moves to the replica and back.

**Failover** (``--to sfo``) fences and stops nyc -> sfo, records the last nyc
sequence sfo holds per stream, and makes sfo the primary. **Site fail-back**
(``--to nyc``) reconciles both sides by origin sequence (Spark anti-joins): what
nyc acked but never relayed before it failed (the RPO) goes to sfo, what was
written at sfo meanwhile goes to nyc, each exactly once; then nyc -> sfo is
defined again. (Not to be confused with the DR fail-back of RabbitMQ queues,
:mod:`ferry.jobs.dr_failback`.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ferry.errors import Conflict, FerryError, NotFound, UsageError
from ferry.jobs.replicate.consumers import Translator
from ferry.jobs.replicate.consumers import home as consumers_home
from ferry.jobs.replicate.consumers import resume as resume_consumers
from ferry.jobs.replicate.consumers import rpo as consumer_rpo
from ferry.jobs.replicate.control import start, status_row, stop
from ferry.jobs.replicate.plan import (
    Replication,
    ensure_streams,
    in_account,
    positions,
    relay_command,
    site_cluster,
    site_journal,
    site_record,
    site_session,
    streams_at,
    took_over,
)
from ferry.jobs.replicate.relay import count_after, send_missing
from ferry.jobs.shared.events import Emit, no_emit
from ferry.journal import Lease
from ferry.topology import NatsCluster, Topology

# -- sites ------------------------------------------------------------------------------------


async def _save_site(topo: Topology, site: str, record: dict[str, Any]) -> None:
    async with site_journal(topo, site, "site") as j:
        await j.open()
        j.state = record
        await j.save(release=True)


async def _reachable(topo: Topology, site: str) -> bool:
    try:
        async with site_session(topo, site, timeout=2):
            return True
    except FerryError:
        return False


async def failover(
    topo: Topology,
    to: str,
    source: str | None = None,
    emit: Emit = no_emit,
    reverse: bool = False,
    wait: float = 600,
    dry_run: bool = False,
) -> dict[str, Any]:
    """Stop SOURCE -> TO (fencing its relay), record what TO holds, make TO the primary; with
    `reverse`, define TO -> SOURCE once SOURCE answers (within `wait` seconds). `dry_run`: what
    TO holds so far and whether a relay still runs; nothing changes."""
    async with site_journal(topo, to, "") as j:
        keys = await j.keys([f"relay.*.{to}"])
        defs = {k: await j.get(k) or {} for k in keys}
    sources = sorted({d["source"] for d in defs.values() if d.get("source")} if not source else {source})
    if len(sources) != 1:
        raise UsageError(
            f"which site fails over to {to}? pass --from "
            f"(replications into {to}{in_account(topo)}: {sources or 'none'})"
        )
    (src,) = sources
    state = defs.get(Replication(src, to).key)
    if not state:
        raise NotFound(f"no replication {src} -> {to} to fail over{in_account(topo)}")
    rep = Replication.from_state(state)
    if rep.mapped:
        raise UsageError("site failover needs a replication without stream or subject mapping")
    if dry_run:
        found = await positions(topo, rep, await _failover_streams(topo, state, rep))
        return {
            "dry_run": True,
            "from": src,
            "to": to,
            "relay": status_row(state, time.time())["summary"],
            "replicated": {s: h.last for s, h in found.items()},
            "consumers": consumer_rpo(state, time.time()),
            "source_reachable": await _reachable(topo, src),
        }
    stopped = await stop(topo, src, to, wait=10.0, force=True)
    emit("fenced", replication=f"{src} -> {to}", marker=stopped.get("marker"))
    found = await positions(topo, rep, await _failover_streams(topo, stopped, rep))
    replicated = {s: h.last for s, h in found.items()}
    consumers = consumer_rpo(stopped, time.time())
    async with site_session(topo, to) as nc:  # the applications come here: their consumers deliver
        await resume_consumers(nc, consumers, Translator(site_cluster(topo, to), to, src), rep.dest_stream)
    record = {
        "primary": to,
        "failover": {
            "from": src,
            "at": time.time(),
            "replicated": replicated,
            "streams": rep.streams,
            "consumers": consumers,
        },
    }
    await _save_site(topo, to, record)
    emit("primary", site=to, replicated=replicated, consumers=sum("refused" not in c for c in consumers))
    source_up = await _reachable(topo, src)
    deadline = time.monotonic() + (wait if reverse else 0)
    while not source_up and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        source_up = await _reachable(topo, src)
    if source_up:
        await _save_site(topo, src, record)
    result = {**record, "source_reachable": source_up}
    if reverse:
        if not source_up:
            raise FerryError(f"{to} is primary, but {src} did not answer within {wait:.0f}s: no reverse replication")
        result["reverse"] = await start(topo, Replication(to, src, rep.streams), keep_marker=False)
        emit("reverse", replication=f"{to} -> {src}")
    return result


async def _failover_streams(topo: Topology, state: dict[str, Any], rep: Replication) -> list[str]:
    """The streams a failover records: those the last relay reported on, else those at the destination."""
    streams = sorted((state.get("progress") or {}) or (state.get("resumed_after") or {}))
    return streams or await streams_at(site_cluster(topo, rep.dest), rep.streams, rep.dest)


async def failback(
    topo: Topology, to: str, spark_factory: Callable[[], Any], emit: Emit = no_emit, dry_run: bool = False
) -> dict[str, Any]:
    """Reconcile both sites by origin sequence, make TO the primary again, define TO -> other.

    Run it once clients write to TO again (or not at all): what the old primary stores after its
    stream was read here is not copied."""
    record, primary, silent = await _failed_over_from(topo, to)
    if not record:
        return await _failed_back(topo, to, dry_run, silent)
    if not await _reachable(topo, to):
        raise FerryError(f"site {to} is not reachable; fail back once it is up")
    if dry_run:
        return {
            "dry_run": True,
            "primary": primary,
            "to": to,
            "streams": await _failback_plan(topo, to, primary, record),
        }
    async with _one_failback(topo, to) as lease:
        record, primary, silent = await _failed_over_from(topo, to)  # again: one that just ended changed it
        if not record:
            return await _failed_back(topo, to, dry_run, silent)
        return await _failback(topo, to, spark_factory, emit, record, primary, lease)


async def _failed_back(topo: Topology, to: str, dry_run: bool, silent: list[str]) -> dict[str, Any]:
    """When no reachable site failed over from TO: TO's record of the failback that made it primary
    again (a rerun has nothing to do), else NotFound. A site that does not answer (`silent`) may have
    taken over since (TO's own record is not updated while TO is down): then nothing can be told."""
    if silent:
        raise FerryError(
            f"no reachable site failed over from {to}, and {', '.join(silent)} did not answer; try again once it does"
        )
    record = await site_record(topo, to) or {}
    if record.get("primary") == to and record.get("failback"):
        return {"already": True, "dry_run": dry_run, "primary": to, "failback": record["failback"]}
    raise NotFound(f"no site failed over from {to}{in_account(topo)} (nothing to fail back)")


async def _failback_plan(topo: Topology, to: str, primary: str, record: dict[str, Any]) -> dict[str, Any]:
    """Per stream, what a failback would start from: how far TO's messages had reached `primary`
    when it took over, TO's last sequence now and the difference (what TO stored past that point:
    the bulk of what is recovered; the failback also fills any gap below it), and what `primary`
    holds (its writes since are brought to TO). Stream infos only: the counts are the failback's
    own work."""
    from nats.js.errors import NotFoundError

    plan: dict[str, Any] = {}
    states: dict[tuple[str, str], Any] = {}
    for site in (to, primary):
        async with site_session(topo, site) as nc:
            for s in record["failover"]["replicated"]:
                with contextlib.suppress(NotFoundError):
                    states[site, s] = (await nc.jsm().stream_info(s)).state
    for s, replicated in sorted(record["failover"]["replicated"].items()):
        here, there = states.get((to, s)), states.get((primary, s))
        plan[s] = {
            "replicated": int(replicated),
            "last_seq": here.last_seq if here else None,
            "after_replicated": max(0, here.last_seq - int(replicated)) if here else 0,
            "primary_messages": there.messages if there else None,
        }
    return plan


async def _failed_over_from(topo: Topology, to: str) -> tuple[dict[str, Any] | None, str, list[str]]:
    """The site record of the site that took over from TO and that site, else (None, "", the
    sites that did not answer)."""
    silent = []
    for _, name, cluster in topo.clusters():
        if not isinstance(cluster, NatsCluster) or name == to:
            continue
        if not await _reachable(topo, name):
            silent.append(name)
            continue
        got = await site_record(topo, name)
        if took_over(got, name, to):
            return got, name, []
    return None, "", silent


@contextlib.asynccontextmanager
async def _one_failback(topo: Topology, to: str) -> AsyncIterator[Lease]:
    """Hold ``site-failback`` in TO's journal while a failback to it runs: a second one is refused
    (two at once each count and copy the whole difference, kept single only by the duplicate window)."""
    async with site_journal(topo, to, "site-failback") as j, j.hold(f"a failback to {to} is already running") as lease:
        yield lease


async def _failback(
    topo: Topology,
    to: str,
    spark_factory: Callable[[], Any],
    emit: Emit,
    record: dict[str, Any],
    primary: str,
    lease: Lease,
) -> dict[str, Any]:
    fo = record["failover"]
    back, forth = Replication(primary, to, fo["streams"]), Replication(to, primary, fo["streams"])
    streams = sorted(fo["replicated"])
    with contextlib.suppress(NotFound):
        await stop(topo, primary, to, wait=10.0, force=True)  # a reverse replication, if one ran
    await ensure_streams(topo, back, streams)
    spark = await asyncio.to_thread(spark_factory)
    report: dict[str, Any] = {"primary_was": primary, "to": to, "streams": {}}
    progress: dict[str, dict[str, Any]] = {}  # where TO -> primary stands once reconciled
    for s in streams:
        if lease.lost.is_set():  # its key unsaved too long: another failback may have begun
            raise Conflict(f"the failback to {to} lost its hold on {to}'s journal (no answer); run it again")
        # what TO acked but never relayed before it failed (the RPO), then what was written at `primary`
        rpo = await asyncio.to_thread(count_after, spark, topo, forth, s, int(fo["replicated"][s]))
        async with site_session(topo, to) as nc:  # TO's own messages up to here are at `primary` once sent forth
            read_to = (await nc.jsm().stream_info(s)).state.last_seq
        sent_forth = await asyncio.to_thread(send_missing, spark, topo, forth, s)
        sent_back = await asyncio.to_thread(send_missing, spark, topo, back, s)
        # after `read_to`, TO holds what was brought back (never relayed forth) and any new writes
        progress[s] = {"relayed": read_to, "foreign": sent_back}
        async with site_session(topo, to) as here, site_session(topo, primary) as there:  # applications go home
            floors = {r["consumer"]: r["ack_floor"] for r in fo.get("consumers") or [] if r["stream"] == s}
            came_home = await consumers_home(site_cluster(topo, to), to, site_cluster(topo, primary), primary, s,
                                             here, there, floors)  # fmt: skip
        report["streams"][s] = {"rpo": rpo, "recovered": sent_forth, "brought": sent_back, "consumers": came_home}
        emit("reconciled", stream=s, **report["streams"][s])
    # defined again before the records say TO is primary: a failback cut short between the two
    # finds its record on a rerun, instead of leaving TO -> other undefined
    # the reconciliation moved its position: the next relay scans; until one reports, the lag
    # counts only what it will relay (not the messages brought back from `primary`)
    again = await start(topo, forth, keep_marker=False, progress=progress)
    new = {"primary": to, "failback": {"from": primary, "at": time.time()}}
    for site in (to, primary):
        await _save_site(topo, site, new)
    report["replication"] = (
        f"{forth.source} -> {forth.dest} defined again ({status_row(again, time.time())['summary']});"
        f" run relays with: {relay_command(forth.source, forth.dest, topo.account)}"
    )
    return report


async def status(topo: Topology) -> list[dict[str, Any]]:
    """`ferry site status`: each site's own record (which site is primary, its last failover and
    fail-back) and whether a fail-back to it is running; a site that does not answer says so."""
    rows: list[dict[str, Any]] = []
    for site, name, cluster in topo.clusters():
        if not isinstance(cluster, NatsCluster) or name != site:
            continue
        try:
            async with site_journal(topo, site, "") as j:
                record, running = await j.get("site"), await j.get("site-failback")
        except FerryError as exc:
            rows.append({"site": site, "unreachable": str(exc)})
            continue
        rows.append(
            {
                "site": site,
                "primary": (record or {}).get("primary"),
                "failover": (record or {}).get("failover"),
                "failback": (record or {}).get("failback"),
                "failback_running": bool(running and j.owner_alive(running)),
            }
        )
    return rows
