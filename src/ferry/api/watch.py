"""What `ferry serve` knows, kept current in the background: every cluster's journal checked twice a
second and read again when it changed (every job's operations on record, whichever ferry wrote
them), and the live figures only the brokers know (an evacuated node's connections, a fail-back's
queues, a stopped relay's lag), read every few seconds with bounded waits. Answers (the
availability check, ``/metrics``, the console) are made from these copies and never wait on a
broker."""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import time
from typing import Any

from ferry.brokers import nats as bnats
from ferry.jobs.copy import record as copy_record
from ferry.jobs.dr_failback.journal import read_journal
from ferry.jobs.dr_failback.plan import FAILBACK
from ferry.jobs.evacuate.nodes import open_nodes
from ferry.jobs.evacuate.nodes.base import CONTROL, STALE_AFTER
from ferry.jobs.evacuate.plan import EVACUATION, REBALANCE, unavailable
from ferry.jobs.move import standby
from ferry.jobs.move.plan import MOVE
from ferry.jobs.partition.claims import on_record as partitions_on_record
from ferry.jobs.replicate.control import lease_live, status_row
from ferry.jobs.replicate.plan import RELAY, backlog_from, lags
from ferry.journal import Journal, KvJournal, ParamJournal, owner_alive, running_here
from ferry.topology import NatsCluster, RabbitCluster, Topology

log = logging.getLogger("ferry.serve")
READ_FRESH = 2.0  # seconds: how recent the journal read behind an adoption must be
LIVE_EVERY = 3.0  # seconds between reads of the live figures
LIVE_WAIT = 2.0  # seconds one read of live figures may take before it is given up (the last values stay)
ADOPTED = ("evacuation", "rebalance")  # the jobs serve drives when their ferry died (and moves)
MOVE_STALE_AFTER = 10.0  # seconds without a heartbeat before a move's ferry counts as dead (the move's own)
FAILBACK_KEY = "dr-failback"  # where a RabbitMQ cluster's DR fail-back record is kept among its states


def kind_of(key: str, state: dict[str, Any]) -> str:
    """The job an operation on record belongs to."""
    if state.get("kind"):
        return str(state["kind"])
    head = key.split(".", 1)[0]
    return {
        "move": "move",
        "relay": "relay",
        "site": "site_failover",
        "site-failback": "site_failback",
        FAILBACK_KEY: "dr_failback",
    }.get(head, head)


# every state of every job, so that a dashboard's "by state" panel and an alert on a state have a
# series (0) before the first operation enters it
STATES: dict[str, list[str]] = {
    "move": sorted(MOVE.states),
    "evacuation": sorted(EVACUATION.states),
    "rebalance": sorted(REBALANCE.states),
    "relay": sorted(RELAY.states),
    "dr_failback": sorted(FAILBACK.states),
    "site_failover": ["done"],
    "site_failback": ["running", "done"],
    "partition": ["applied", "repartitioning"],
    "copy": copy_record.STATES,
}


def state_of(kind: str, st: dict[str, Any]) -> str:
    """An operation's state, under the name its job's machine gives it."""
    if kind == "move":
        return str(st.get("phase") or "starting")
    if kind == "dr_failback":
        return str(st.get("phase") or "disabling")
    if kind == "site_failover":
        return "done"
    if kind == "site_failback":
        return "running" if "primary" not in st else "done"
    if kind == "copy":
        return copy_record.state_of(st, owner_alive(st))
    return str(st.get("state") or "defined")


def operation_id(where: str, key: str, kind: str, st: dict[str, Any]) -> str:
    """A short name of an operation, unique among those on record (`where`: the journal's site or
    RabbitMQ cluster; ``nyc@SALES`` for another NATS account's, whose operations end ``@SALES``)."""
    site, _, account = where.partition("@")
    named = _operation_id(site, key, kind, st)
    return f"{named}@{account}" if account else named


def _operation_id(where: str, key: str, kind: str, st: dict[str, Any]) -> str:
    if kind == "evacuation":
        return f"{st.get('cluster')}/{st.get('node')}"
    if kind == "rebalance":
        return str(st.get("cluster"))
    if kind == "move":
        return key.removeprefix("move.")
    if kind == "relay":
        return f"{st.get('source')}->{st.get('dest')}"
    if kind == "dr_failback":
        return f"{st.get('source')}->{st.get('target')}"
    if kind == "copy":
        return f"{st.get('source')} -> {st.get('destination')}"
    if kind == "partition":
        return f"{where}/{st.get('map')}"
    return f"{where}/{key}"


def account_of(journal: str) -> str | None:
    """The NATS account of a journal serve reads (``east@SALES``: SALES), None for the default."""
    return journal.partition("@")[2] or None


class Registry:
    """The journaled operations of every cluster, kept current, their drivers, and the live figures."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.clusters: dict[str, NatsCluster | RabbitCluster] = {n: c for _, n, c in topo.clusters()}
        self.site_of: dict[str, str] = {n: s for s, n, _ in topo.clusters()}
        # the journals read: each cluster's (by its name) and each other NATS account's (east@SALES)
        self.journals: dict[str, NatsCluster | RabbitCluster] = dict(self.clusters)
        for n, c in self.clusters.items():
            if isinstance(c, NatsCluster):
                self.journals |= {f"{n}@{a}": c.in_account(a, n) for a in sorted(c.accounts)}
        self.states: dict[str, dict[str, dict[str, Any]]] = {}  # journal -> key -> state (read at least once)
        self.drivers: dict[str, asyncio.Task[Any]] = {}
        # a move's standby guard and when it began, by driver_key
        self.standbys: dict[str, tuple[asyncio.Task[Any], float]] = {}
        self.stops: dict[str, asyncio.Event] = {}
        self.read_at: dict[str, float] = {}  # journal -> time.monotonic() of its last read
        self.started = time.monotonic()
        self.first_read: dict[str, asyncio.Event] = {}  # journal -> set once it was read (made at start)
        # live figures: what -> (time.time() read, value); kept when a read fails, with their age
        self.live: dict[str, tuple[float, Any]] = {}
        # the changes of state serve saw, newest last: (time.time(), kind, id, old state, new state)
        self.events: collections.deque[tuple[float, str, str, str | None, str | None]] = collections.deque(maxlen=50)

    async def watch(self, name: str, cluster: NatsCluster | RabbitCluster) -> None:
        """Mirror `name`'s journal keys twice a second, reconnecting forever. A poll, not a KV
        watch: nats-py's ordered consumer can stall for good when the server holding it dies."""
        failures = 0
        while True:
            read_before = self.read_at.get(name)
            try:
                if isinstance(cluster, NatsCluster):  # reading needs no system account
                    async with bnats.session(cluster, name=name, client_name=f"{CONTROL}-serve") as nc:
                        await self._poll(name, KvJournal(nc, "", replicas=min(3, len(cluster.brokers))))
                else:
                    async with open_nodes(name, cluster, avoid=[]) as nodes:
                        await self._poll(name, nodes.journal(""))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the last known states; try again, less often while it fails
                failures = 0 if self.read_at.get(name) != read_before else failures + 1
                log.warning("reading %s's journal: %s", name, exc)
                await asyncio.sleep(min(30.0, 2.0 ** max(0, failures - 1)))

    async def _poll(self, name: str, journal: Journal) -> None:
        if isinstance(journal, KvJournal) and account_of(name):
            # another account's bucket is never made by serve: none yet reads as no operation
            while (await journal.open(create=False), journal.kv)[1] is None:
                self._read(name, {}, time.monotonic())
                await asyncio.sleep(5.0)
        else:
            await journal.open()
        read: tuple[Any, dict[str, dict[str, Any]]] | None = None  # (version, states) of the last full read
        while True:
            began = time.monotonic()  # the heartbeats read are at least this old
            version = await journal.version()
            if read is None or version is None or version != read[0]:
                # read in full only on a change: one stream info a poll instead of a consumer
                read = (version, await journal.all())
            states = copy.deepcopy(read[1])
            if isinstance(journal, ParamJournal) and (record := await read_journal(journal.m)):
                states[FAILBACK_KEY] = record
            if isinstance(journal, KvJournal):
                maps = await self._partitions(name, journal)
                for key in [k for k, st in states.items() if kind_of(k, st) == "partition" and k not in maps]:
                    del states[key]  # a repartition's journal outlives its map's claim (forgotten)
                for key, entry in maps.items():
                    # an unfinished repartition's journal (same key): its phase and its driver too
                    mine = states.get(key) or {}
                    states[key] = {**mine, **entry} if mine.get("phase") not in (None, "done") else entry
            self._read(name, states, began)
            await asyncio.sleep(0.5)

    def _read(self, name: str, states: dict[str, dict[str, Any]], began: float) -> None:
        """`name`'s journal as read from `began` on."""
        self._saw(name, self.states.get(name), states)
        self.states[name] = states
        self.read_at[name] = began
        if name in self.first_read:
            self.first_read[name].set()

    async def _partitions(self, name: str, journal: KvJournal) -> dict[str, dict[str, Any]]:
        """The partition maps on record (the last ones read, when their record cannot be read: it
        must not stop the journal's read, which the availability check goes by)."""
        try:
            return await partitions_on_record(journal.nc)
        except Exception as exc:
            log.warning("reading %s's partition claims: %s", name, exc)
            return {k: st for k, st in self.states.get(name, {}).items() if kind_of(k, st) == "partition"}

    def _saw(self, name: str, old: dict[str, dict[str, Any]] | None, new: dict[str, dict[str, Any]]) -> None:
        """Note each operation that began, changed state or ended since the last read (none on the first)."""
        if old is None:
            return
        for key in sorted(old.keys() | new.keys()):
            before, after = old.get(key), new.get(key)
            st = after or before or {}
            kind = kind_of(key, st)
            was, now = (state_of(kind, before) if before else None), (state_of(kind, after) if after else None)
            event = (kind, operation_id(self.where(name), key, kind, st), was, now)
            # the clusters of a NATS site read one bucket: each change is seen through every one of them
            if was != now and not any(e[1:] == event and time.time() - e[0] < 10 for e in self.events):
                self.events.append((time.time(), *event))

    def where(self, journal: str) -> str:
        """Whose journal `journal` is: its site's for NATS (the clusters of a site share one bucket;
        ``nyc@SALES`` in another account), else its RabbitMQ cluster's."""
        cname, _, account = journal.partition("@")
        if not isinstance(self.clusters.get(cname), NatsCluster):
            return cname
        return f"{self.site_of[cname]}@{account}" if account else self.site_of[cname]

    def operations(self) -> list[tuple[str, str, str, dict[str, Any]]]:
        """(cluster, key, kind, state) of every operation on record, once each (a move is read
        through each cluster of its site)."""
        seen: set[tuple[str, str]] = set()
        out = []
        for cname, states in sorted(self.states.items()):
            for key, st in sorted(states.items()):
                if (self.where(cname), key) not in seen:
                    seen.add((self.where(cname), key))
                    out.append((cname, key, kind_of(key, st), st))
        return out

    # -- the live figures --------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read the live figures every LIVE_EVERY seconds, each read bounded by LIVE_WAIT."""
        while True:
            reads = []
            for cname, key, kind, st in self.operations():
                if kind == "evacuation" and st.get("node"):
                    reads.append((f"node:{cname}:{st['node']}", self._node(cname, st["node"])))
                elif kind == "relay" and st.get("source") and not relaying(st):
                    reads.append((self._lag_key(cname, key), self._lag(cname, st)))
                elif kind == "dr_failback":
                    reads.append((f"queues:{cname}", self._queues(cname)))
            await asyncio.gather(*(self._keep(what, read) for what, read in reads))
            await asyncio.sleep(LIVE_EVERY)

    async def _keep(self, what: str, read: Any) -> None:
        try:
            self.live[what] = (time.time(), await asyncio.wait_for(read, LIVE_WAIT))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the last value stays, and ages
            log.debug("reading %s: %s", what, exc)

    async def _node(self, cname: str, node: str) -> dict[str, Any]:
        async with open_nodes(cname, self.clusters[cname], avoid=[node]) as nodes:
            return (await nodes.view(node, jetstream=False)).summary()

    async def _lag(self, journal: str, st: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """A replication no relay is running: its backlog at the source now (in its account)."""
        relayed, foreign = backlog_from(st)
        source = self.topo.nats(st["source"], account_of(journal))
        async with bnats.session(source, name=st["source"], client_name=f"{CONTROL}-serve") as nc:
            return await lags(nc, relayed, foreign)

    @staticmethod
    def _lag_key(journal: str, key: str) -> str:
        account = account_of(journal)
        return f"lag:{key}@{account}" if account else f"lag:{key}"

    async def _queues(self, cname: str) -> dict[tuple[str, str], int]:
        async with open_nodes(cname, self.clusters[cname], avoid=[]) as nodes:
            got = await nodes.m.get("/queues?columns=name,vhost,messages")
        return {(x["vhost"], x["name"]): int(x.get("messages") or 0) for x in got or []}

    def progress(self, cname: str, kind: str, st: dict[str, Any]) -> float | None:
        """0..1 for a job that knows its total; None for one that does not."""
        if kind == "evacuation":
            if st.get("state") == "prohibiting":
                return 1.0
            total = int((st.get("initial") or {}).get("connections") or 0)
            return min(1.0, int(st.get("evicted", {}).get("connections", 0)) / total) if total else 0.0
        if kind == "rebalance":
            total = sum(max(0, r["connections"] - r["connections_after"]) for r in st.get("proposal") or [])
            return min(1.0, int(st.get("evicted", {}).get("connections", 0)) / total) if total else 0.0
        if kind == "move":
            return 1.0 if st.get("phase") in ("done", "cancelled") else None
        if kind == "copy":
            total = int(st.get("messages") or 0)
            done = st.get("state") == "done"
            return 1.0 if done else min(1.0, int(st.get("copied") or 0) / total) if total else None
        if kind == "dr_failback":
            before = failback_total(st)
            left = self.failback_left(cname, st)
            return None if left is None or not before else max(0.0, 1.0 - sum(left.values()) / before)
        return None

    def failback_left(self, cname: str, st: dict[str, Any]) -> dict[tuple[str, str], int] | None:
        """Messages left in each queue of a DR fail-back, as last read (None: not read yet)."""
        read = self.live.get(f"queues:{cname}")
        if not read:
            return None
        return {(x["vhost"], x["queue"]): read[1].get((x["vhost"], x["queue"]), 0) for x in st.get("queues") or []}

    def relay_progress(
        self, journal: str, key: str, st: dict[str, Any]
    ) -> tuple[dict[str, dict[str, Any]], float | None]:
        """A replication's progress per stream and when it was read: the running relay's own
        report, or (none running) the backlog serve read at the source."""
        if relaying(st):
            return status_row(st, time.time()).get("progress") or {}, st.get("progress_at")
        read = self.live.get(self._lag_key(journal, key))
        return (read[1], read[0]) if read else (st.get("progress") or {}, st.get("progress_at"))

    # -- adoption ----------------------------------------------------------------------------------

    async def adopt(self, resume: Any) -> None:
        """Drive every journaled operation whose driver is gone (`resume(journal, key, state)` makes the driver)."""
        while True:
            for cname, key, st in self.orphans():
                name = self.driver_key(cname, key)
                if not ((task := self.drivers.get(name)) and not task.done()):  # a move is read via each cluster
                    log.warning("adopting %s (state %s)", key, st.get("state") or st.get("phase"))
                    self.start(name, resume(cname, key, st))
            await asyncio.sleep(1.0)

    def driver_key(self, journal: str, key: str) -> str:
        """The name of an operation's driver here: a move's by its site and account (a stream's name is
        not unique across them), an evacuation's or rebalance's by its key (which names its cluster)."""
        return f"{self.where(journal)}:{key}" if key.startswith("move.") else key

    def moves(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(journal, key, state) of each move on record that has not ended."""
        return [(cname, key, st) for cname, key, _, st in self.operations() if _unfinished_move(key, st)]

    async def stand_by(self, guard: Any) -> None:
        """Keep a standby guard beside every move that runs one (`guard(journal, state, moving)`
        makes it; :mod:`ferry.jobs.move.standby`), so a driver's death leaves no gap."""
        while True:
            for cname, key, st in self.moves():
                name = self.driver_key(cname, key)
                task, began = self.standbys.get(name, (None, 0.0))
                # one that failed (its guard refused, say) is tried again every few seconds, not at once
                if (task is None or (task.done() and time.monotonic() - began > 5.0)) and standby.guarded(st):
                    where, move_id = self.where(cname), st.get("move_id")

                    def moving(where: str = where, key: str = key, move_id: Any = move_id) -> bool:
                        now = next((s for c, k, s in self.moves() if self.where(c) == where and k == key), {})
                        return now.get("move_id") == move_id and now.get("phase") in standby.MOVING

                    log.info("standby guard for %s (move %s)", key, move_id)
                    self.standbys[name] = (self.spawn(name, guard(cname, st, moving)), time.monotonic())
            await asyncio.sleep(0.2)

    def orphans(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(cluster, key, state) of each evacuation, rebalance or move to adopt: no driver of ours runs
        it, and its owner looks dead in a journal read of the last READ_FRESH seconds (a move: one
        whose state directory serve shares, :func:`~ferry.jobs.move.standby.reachable`). A cluster's
        last known states age while its journal does not answer (the node being evacuated may be
        the one serve reads through): its live owners' heartbeats would look stale. An owner still
        running on this host is never adopted, however late its heartbeat (CI saw a CLI
        evacuation's save take longer than STALE_AFTER under load), nor one whose driver the
        broker refused."""
        now = time.monotonic()
        return [
            (cname, key, st)
            for cname, states in list(self.states.items())
            if now - self.read_at.get(cname, float("-inf")) < READ_FRESH
            for key, st in list(states.items())
            if (kind_of(key, st) in ADOPTED or (_unfinished_move(key, st) and standby.reachable(st)))
            and st.get("cluster", cname) == cname  # the clusters of a NATS site share one bucket
            and not ((task := self.drivers.get(self.driver_key(cname, key))) and not task.done())
            and not owner_alive(st, MOVE_STALE_AFTER if kind_of(key, st) == "move" else STALE_AFTER)
            and not running_here(st)
            and not st.get("refused")  # the broker refused its driver's user: not to go on under serve's
        ]

    def start(self, key: str, coro: Any) -> asyncio.Task[Any]:
        self.drivers[key] = task = self.spawn(key, coro)
        return task

    @staticmethod
    def spawn(key: str, coro: Any) -> asyncio.Task[Any]:
        """`coro` as a task whose failure is logged under `key` (a Conflict, another ferry's, is not)."""
        from ferry.errors import Conflict

        task = asyncio.create_task(coro)

        def done(t: asyncio.Task[Any]) -> None:
            if not t.cancelled() and t.exception() and not isinstance(t.exception(), Conflict):
                log.warning("%s: %s", key, t.exception())

        task.add_done_callback(done)
        return task

    def public(self, kind: str) -> list[dict[str, Any]]:
        return [{k: v for k, v in st.items() if k != "heartbeat"} for _, key, k, st in self.operations() if k == kind]

    def unavailable(self, cname: str, node: str) -> str | None:
        """Why the load balancer should not send `node` new clients ('' if it may), by the states
        of cluster `cname` the availability check goes by; None while its journal was never read
        (then the node is available: an unreadable journal must not empty the balancer)."""
        if cname not in self.states:
            return None
        states = {k: st for k, st in self.states[cname].items() if kind_of(k, st) in ADOPTED}
        return unavailable(states, cname, node)


def _unfinished_move(key: str, st: dict[str, Any]) -> bool:
    """A move on record that has not ended."""
    return kind_of(key, st) == "move" and st.get("phase") not in (None, "done", "cancelled")


def failback_total(st: dict[str, Any]) -> int:
    """The messages a DR fail-back found in its queues."""
    return sum(int(x.get("before") or 0) for x in st.get("queues") or [])


def relaying(st: dict[str, Any]) -> bool:
    """A relay holds the replication's lease and reports its progress."""
    return st.get("state") == "relaying" and lease_live(st)
