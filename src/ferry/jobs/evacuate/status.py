"""Evacuations and rebalances on record: ``node status``, ``cluster status`` and ``stop``."""

from __future__ import annotations

from typing import Any

from ferry.errors import FerryError, NotFound, OperationFailed
from ferry.jobs.evacuate.nodes import open_nodes
from ferry.jobs.evacuate.nodes.base import STALE_AFTER
from ferry.jobs.evacuate.plan import evacuation_key, rebalance_key
from ferry.jobs.evacuate.run import public, resolve
from ferry.journal import Journal, owner_alive
from ferry.topology import NatsCluster, RabbitCluster, Topology

# -- status and stop ---------------------------------------------------------------------------------------


async def states(cluster: NatsCluster | RabbitCluster, name: str) -> dict[str, dict[str, Any]]:
    """Every evacuation and rebalance journaled for cluster `name`, by key."""
    async with open_nodes(name, cluster, avoid=[]) as nodes:
        journal = nodes.journal("")
        await journal.open()
        return await journaled(journal, name)


async def journaled(journal: Journal, name: str) -> dict[str, dict[str, Any]]:
    """The states under an open journal of cluster `name`, by key."""
    keys = await journal.keys([f"evacuation.{name}.>", rebalance_key(name)])
    return {k: st for k in keys if (st := await journal.get(k))}


async def node_status(topo: Topology, node: str | None = None, cluster: str = "") -> list[dict[str, Any]]:
    """`ferry node status`: each evacuation (or the one of `node`) with live counts."""
    if node:
        clusters = [resolve(topo, node, cluster)]
    else:
        clusters = [(n, c) for _, n, c in topo.clusters() if not cluster or n == cluster]
    rows = []
    for cname, c in clusters:
        found = await states(c, cname)
        evacs = [st for k, st in found.items() if k.startswith("evacuation.") and (not node or st["node"] == node)]
        if not evacs and not node:
            continue
        async with open_nodes(cname, c, avoid=[]) as nodes:
            for st in evacs:
                now = await nodes.view(st["node"])
                alive = owner_alive(st, STALE_AFTER)
                rows.append({**public(st), "current": now.summary(), "driven_by": st.get("owner") if alive else None})
    return rows


async def rebalance_status(topo: Topology, cluster: str = "") -> list[dict[str, Any]]:
    """`ferry cluster status`: the rebalance running in each cluster (or in `cluster`)."""
    if cluster:
        topo.cluster(cluster)  # unknown -> one line
    rows = []
    for _, cname, c in topo.clusters():
        if cluster and cname != cluster:
            continue
        st = (await states(c, cname)).get(rebalance_key(cname))
        if st:
            rows.append({**public(st), "driven_by": st.get("owner") if owner_alive(st, STALE_AFTER) else None})
    return rows


async def stop(topo: Topology, key_cluster: str, node: str | None) -> dict[str, Any]:
    """`ferry node stop NODE` / `ferry cluster stop CLUSTER`: end the operation; the node(s) return to service."""
    cname, cluster = resolve(topo, node, key_cluster) if node else (key_cluster, topo.cluster(key_cluster))
    key = evacuation_key(cname, node) if node else rebalance_key(cname)
    async with open_nodes(cname, cluster, avoid=[]) as nodes:
        journal = nodes.journal(key)
        st = await journal.open()
        if not st:
            raise NotFound(f"no {'evacuation of ' + node if node else 'rebalance of ' + cname} is running")
        await journal.stop()
        if node and st.get("state") == "prohibiting":
            try:
                await nodes.allow(node)
            except FerryError as exc:  # e.g. a wrong Erlang cookie: keep the journal, so it can be stopped again
                await journal.save(release=True, **st)
                raise OperationFailed(
                    f"{node} stays in maintenance mode and its evacuation is kept ({exc}); "
                    f"run `ferry node stop {node}` again once that is fixed"
                ) from None
    return {**public(st), "outcome": "stopped"}
