"""The operations console's data (``GET /api/console``): every operation on record with its state,
progress and figures, every node's availability, the replications' lag, the changes of state
serve saw, and the audit reports. Made of the fields below only, never of a raw journal record
(a DR fail-back's record holds its upstreams' URIs, passwords included). The page
(``static/console.html``) renders it with ``textContent``: a name is data, never markup."""

from __future__ import annotations

import time
from typing import Any

from ferry.api.audits import Audits
from ferry.api.watch import Registry, account_of, failback_total, operation_id, relaying, state_of
from ferry.jobs.evacuate.nodes.base import STALE_AFTER
from ferry.journal import owner_alive


def view(reg: Registry, audits: Audits) -> dict[str, Any]:
    now = time.time()
    ops, relays = [], []
    for cname, key, kind, st in reg.operations():
        figures, at = reg.relay_progress(cname, key, st) if kind == "relay" else ({}, None)
        ops.append(
            {
                "kind": kind,
                "id": operation_id(reg.where(cname), key, kind, st),
                "cluster": cname,
                "state": state_of(kind, st),
                "since": st.get("since") or st.get("started"),
                "progress": reg.progress(cname, kind, st),
                "driven": owner_alive(st, STALE_AFTER) if "owner" in st else None,
                "detail": detail(reg, cname, kind, st, figures),
            }
        )
        if kind == "relay" and st.get("source"):
            relays.append(
                {
                    "from": st["source"],
                    "to": st["dest"],
                    "account": account_of(cname),
                    "active": relaying(st),
                    "read_age_s": round(now - float(at), 1) if at else None,
                    "streams": [
                        {"stream": s, **{k: p.get(k) for k in ("relayed", "lag", "lag_s", "rate")}}
                        for s, p in sorted(figures.items())
                    ],
                }
            )
    nodes = []
    for cname, cluster in sorted(reg.clusters.items()):
        for b in cluster.brokers:
            why = reg.unavailable(cname, b.name)
            read = reg.live.get(f"node:{cname}:{b.name}")
            nodes.append(
                {
                    "cluster": cname,
                    "node": b.name,
                    "available": not why,
                    "reason": "journal not read yet" if why is None else why,
                    "connections": read[1]["connections"] if read and why else None,
                }
            )
    return {
        "at": now,
        "operations": ops,
        "nodes": nodes,
        "relays": relays,
        "events": [
            {"at": at, "kind": kind, "id": oid, "was": was, "now": new}
            for at, kind, oid, was, new in reversed(reg.events)
        ],
        "audits": audits.reports()[:20],
        "journals": [
            {"cluster": c, "read_age_s": round(time.monotonic() - reg.read_at[c], 1) if c in reg.read_at else None}
            for c in sorted(reg.journals)
        ],
    }


def detail(reg: Registry, cname: str, kind: str, st: dict[str, Any], figures: dict[str, dict[str, Any]]) -> str:
    """One line of figures for an operation (`figures`: a relay's progress per stream)."""
    if kind == "evacuation":
        initial, evicted = st.get("initial") or {}, st.get("evicted") or {}
        read = reg.live.get(f"node:{cname}:{st.get('node')}")
        now = f"; {read[1]['connections']} on the node now" if read else ""
        return f"{evicted.get('connections', 0)} of {initial.get('connections', 0)} connections evicted{now}"
    if kind == "rebalance":
        return (
            f"donors {', '.join(st.get('donors') or []) or '-'}; {st.get('evicted', {}).get('connections', 0)} evicted"
        )
    if kind == "move":
        res = st.get("result") or {}
        where = f"{st.get('from') or res.get('from') or '?'} -> {st.get('to') or res.get('to') or '?'}"
        if not res:
            return where
        return (
            f"{where}; missed {res.get('missed') or 0}, reinjected {res.get('reinjected') or 0}, "
            f"unavailable {res.get('unavailable_s') or 0} s"
        )
    if kind == "relay":
        lag = sum(int(p.get("lag") or 0) for p in figures.values())
        error = f"; last error: {st['error']}" if st.get("error") else ""
        return f"{len(figures)} stream(s), {lag} message(s) behind{error}"
    if kind == "dr_failback":
        before = failback_total(st)
        left = reg.failback_left(cname, st)
        return f"{len(st.get('queues') or [])} queue(s); " + (
            f"{sum(left.values())} of {before} message(s) left" if left is not None else f"{before} message(s) to move"
        )
    if kind == "copy":
        error = f"; error: {st['error']}" if st.get("error") else ""
        return f"{int(st.get('copied') or 0):,} of {int(st.get('messages') or 0):,} message(s){error}"
    if kind == "partition":
        phase = f", repartition {st['phase']}" if st.get("phase") not in (None, "done") else ""
        return f"{st.get('partitions', 0)} partition(s){phase}"
    if kind in ("site_failover", "site_failback"):
        return f"primary {st.get('primary') or '?'}"
    return ""
