"""`ferry serve`: the HTTP API beside the CLI.

- ``GET /availability_check?node=NAME`` (or ``/availability_check/NAME``): 503 for
  a node being evacuated or a donor of a running rebalance, 200 otherwise — the
  load balancer's health check (EMQX's ``load_rebalance/availability_check``);
- ``/evacuations`` and ``/rebalances``: start (POST), inspect (GET), stop
  (DELETE). Mutating endpoints need ``Authorization: Bearer <token>``;
- OpenAPI at ``/openapi.json``.

The server reads every cluster's journal (NATS: the ``ferry_ops`` bucket; RabbitMQ:
the ``ferry-ops.*`` global parameters) twice a second, so answers
follow the journal whoever wrote it (a CLI, another ``ferry serve``), and it
drives every journaled operation whose driver died: an evacuation started from
the CLI is kept ``prohibiting`` here after the CLI returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ferry.brokers import nats as bnats
from ferry.errors import Conflict, FerryError, NotFound
from ferry.jobs import evacuate as rb
from ferry.jobs.evacuate.nodes import STALE_AFTER, open_nodes
from ferry.jobs.evacuate.nodes.base import CONTROL
from ferry.jobs.evacuate.plan import evacuation_key, rebalance_key
from ferry.jobs.evacuate.status import journaled
from ferry.journal import Journal, KvJournal, ParamJournal, owner_alive, running_here
from ferry.topology import NatsCluster, RabbitCluster, Topology

log = logging.getLogger("ferry.serve")
READ_FRESH = 2.0  # seconds: how recent the journal read behind an adoption must be
# seconds from serve's start an availability check may wait for the first journal read: less than
# the lab HAProxy's check timeout (its `inter`, 1 s, with no `timeout check`)
FIRST_READ = 0.5

__all__ = ["create_app"]


class Registry:
    """The journaled operations of every cluster, kept current, and their drivers."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.clusters: dict[str, NatsCluster | RabbitCluster] = {n: c for _, n, c in topo.clusters()}
        self.states: dict[str, dict[str, dict[str, Any]]] = {}  # cluster -> key -> state (read at least once)
        self.drivers: dict[str, asyncio.Task[Any]] = {}
        self.stops: dict[str, asyncio.Event] = {}
        self.read_at: dict[str, float] = {}  # cluster -> time.monotonic() of its last journal read
        self.started = time.monotonic()
        self.first_read: dict[str, asyncio.Event] = {}  # cluster -> set once its journal was read (made at start)

    async def watch(self, name: str, cluster: NatsCluster | RabbitCluster) -> None:
        """Mirror `name`'s journal keys twice a second, reconnecting forever. A poll, not a KV
        watch: nats-py's ordered consumer can stall for good when the server holding it dies."""
        while True:
            try:
                if isinstance(cluster, NatsCluster):  # reading needs no system account
                    async with bnats.session(cluster, name=name, client_name=f"{CONTROL}-serve") as nc:
                        await self._poll(name, KvJournal(nc, "", replicas=min(3, len(cluster.brokers))))
                else:
                    async with open_nodes(name, cluster, avoid=[]) as nodes:
                        await self._poll(name, nodes.journal(""))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the last known states; try again
                log.warning("reading %s's journal: %s", name, exc)
                await asyncio.sleep(1.0)

    async def _poll(self, name: str, journal: Journal | ParamJournal) -> None:
        await journal.open()
        while True:
            began = time.monotonic()  # the heartbeats read are at least this old
            self.states[name] = await journaled(journal, name)
            self.read_at[name] = began
            if name in self.first_read:
                self.first_read[name].set()
            await asyncio.sleep(0.5)

    async def adopt(self) -> None:
        """Drive every journaled operation whose driver is gone."""
        while True:
            for cname, key, st in self.orphans():
                log.warning("adopting %s (state %s)", key, st.get("state"))
                self.start(key, self._resume(cname, st))
            await asyncio.sleep(1.0)

    def orphans(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(cluster, key, state) of each operation to adopt: no driver of ours runs it, and its owner
        looks dead in a journal read of the last READ_FRESH seconds. A cluster's last known states
        age while its journal does not answer (the node being evacuated may be the one serve
        reads through): its live owners' heartbeats would look stale. An owner still running on
        this host is never adopted, however late its heartbeat (CI saw a CLI evacuation's save take
        longer than STALE_AFTER under load), nor one whose driver the broker refused."""
        now = time.monotonic()
        return [
            (cname, key, st)
            for cname, states in list(self.states.items())
            if now - self.read_at.get(cname, float("-inf")) < READ_FRESH
            for key, st in list(states.items())
            if not ((task := self.drivers.get(key)) and not task.done())
            and not owner_alive(st, STALE_AFTER)
            and not running_here(st)
            and not st.get("refused")  # the broker refused its driver's user: not to go on under serve's
        ]

    def _resume(self, cname: str, st: dict[str, Any]) -> Any:
        stop = asyncio.Event()
        if st.get("kind") == "evacuation":
            key = evacuation_key(cname, st["node"])
            self.stops[key] = stop
            req = rb.EvacuateRequest(node=st["node"], cluster=cname)
            return rb.evacuate(self.topo, req, stop=stop, hold=True, resume_only=True)
        key = rebalance_key(cname)
        self.stops[key] = stop
        return rb.rebalance(self.topo, rb.RebalanceRequest(cluster=cname, execute=True), stop=stop, resume_only=True)

    def start(self, key: str, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self.drivers[key] = task

        def done(t: asyncio.Task[Any]) -> None:
            if not t.cancelled() and t.exception() and not isinstance(t.exception(), Conflict):
                log.warning("%s: %s", key, t.exception())

        task.add_done_callback(done)
        return task

    def locate(self, node: str, cluster: str | None) -> str:
        found = [
            n for n, c in self.clusters.items() if (not cluster or n == cluster) and node in {b.name for b in c.brokers}
        ]
        if not found:
            raise HTTPException(404, f"no node {node!r}" + (f" in cluster {cluster!r}" if cluster else ""))
        if len(found) > 1:
            raise HTTPException(400, f"node {node!r} is in clusters {', '.join(found)}; add ?cluster=")
        return found[0]

    def public(self, kind: str) -> list[dict[str, Any]]:
        return [
            {k: v for k, v in st.items() if k != "heartbeat"}
            for states in self.states.values()
            for st in states.values()
            if st.get("kind") == kind
        ]


async def _first_event(reg: Registry, key: str, coro: Any) -> dict[str, Any]:
    """Start an operation in the background; answer with its plan (or its refusal) at once."""
    got: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    def emit(event: str, **data: Any) -> None:
        if event in ("plan", "resume") and not got.done():
            got.set_result({"event": event, **data})

    task = reg.start(key, coro(emit))
    done, _ = await asyncio.wait([task, got], timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if task in done and task.exception():
        exc = task.exception()
        status = 404 if isinstance(exc, NotFound) else 409 if isinstance(exc, Conflict) else 400
        raise HTTPException(status, str(exc) if isinstance(exc, FerryError) else f"{type(exc).__name__}: {exc}")
    if task.done():
        return task.result()
    return got.result() if got.done() else {"event": "starting"}


def create_app(topo: Topology, token: str | None) -> FastAPI:
    reg = Registry(topo)
    bearer = HTTPBearer(auto_error=False)

    def authorized(cred: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if token is None:
            raise HTTPException(403, "ferry serve runs without a token: mutating endpoints are off (--token-file)")
        if cred is None or not hmac.compare_digest(cred.credentials.encode(), token.encode()):
            raise HTTPException(401, "a valid bearer token is required", headers={"WWW-Authenticate": "Bearer"})

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        reg.started = time.monotonic()
        reg.first_read = {n: asyncio.Event() for n in reg.clusters}
        tasks = [asyncio.create_task(reg.watch(n, c)) for n, c in reg.clusters.items()]
        tasks.append(asyncio.create_task(reg.adopt()))
        yield
        for ev in reg.stops.values():
            ev.set()  # drivers release their journals so another ferry adopts them at once
        drivers = [t for t in reg.drivers.values() if not t.done()]
        if drivers:
            await asyncio.wait(drivers, timeout=5)
        for t in tasks + drivers:
            t.cancel()

    app = FastAPI(
        title="ferry",
        summary="Availability checks for load balancers; node evacuation and cluster rebalancing.",
        lifespan=lifespan,
    )
    Auth = Depends(authorized)

    async def availability(node: str, cluster: str | None) -> JSONResponse:
        cname = reg.locate(node, cluster)
        # just started: the answer waits for the journal (a node under evacuation is not 200 for a moment)
        read, wait = reg.first_read.get(cname), reg.started + FIRST_READ - time.monotonic()
        if read and not read.is_set() and wait > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(read.wait(), wait)
        if cname not in reg.states:  # a journal that cannot be read must not take every node out of the balancer
            return JSONResponse({"node": node, "cluster": cname, "available": True, "reason": "journal not read yet"})
        why = rb.unavailable(reg.states[cname], cname, node)
        return JSONResponse({"node": node, "cluster": cname, "available": not why, "reason": why}, 503 if why else 200)

    @app.get("/availability_check", summary="503 while the node is evacuated or a rebalance donor, else 200")
    async def availability_check(node: str, cluster: Annotated[str | None, Query()] = None) -> JSONResponse:
        return await availability(node, cluster)

    @app.get("/availability_check/{node}", summary="The same, one URL per node")
    async def availability_check_node(node: str, cluster: Annotated[str | None, Query()] = None) -> JSONResponse:
        return await availability(node, cluster)

    @app.get("/evacuations")
    def evacuations() -> list[dict[str, Any]]:
        return reg.public("evacuation")

    @app.get("/evacuations/{node}")
    def evacuation(node: str, cluster: Annotated[str | None, Query()] = None) -> dict[str, Any]:
        cname = reg.locate(node, cluster)
        st = reg.states.get(cname, {}).get(evacuation_key(cname, node))
        if not st:
            raise HTTPException(404, f"no evacuation of {node}")
        return {k: v for k, v in st.items() if k != "heartbeat"}

    @app.post("/evacuations", dependencies=[Auth], status_code=202)
    async def start_evacuation(req: rb.EvacuateRequest) -> dict[str, Any]:
        cname = reg.locate(req.node, req.cluster or None)
        key = evacuation_key(cname, req.node)
        stop = reg.stops[key] = asyncio.Event()
        req = req.model_copy(update={"cluster": cname})
        return await _first_event(reg, key, lambda emit: rb.evacuate(reg.topo, req, emit, stop=stop, hold=True))

    @app.delete("/evacuations/{node}", dependencies=[Auth])
    async def stop_evacuation(node: str, cluster: Annotated[str | None, Query()] = None) -> dict[str, Any]:
        try:
            return await rb.stop(reg.topo, reg.locate(node, cluster), node)
        except NotFound as exc:
            raise HTTPException(404, str(exc)) from None

    @app.get("/rebalances")
    def rebalances() -> list[dict[str, Any]]:
        return reg.public("rebalance")

    @app.post("/rebalances", dependencies=[Auth], status_code=202)
    async def start_rebalance(req: rb.RebalanceRequest) -> dict[str, Any]:
        if req.cluster not in reg.clusters:
            raise HTTPException(404, f"no cluster {req.cluster!r}")
        key = rebalance_key(req.cluster)
        stop = reg.stops[key] = asyncio.Event()
        return await _first_event(reg, key, lambda emit: rb.rebalance(reg.topo, req, emit, stop=stop))

    @app.delete("/rebalances/{cluster}", dependencies=[Auth])
    async def stop_rebalance(cluster: str) -> dict[str, Any]:
        try:
            return await rb.stop(reg.topo, cluster, None)
        except NotFound as exc:
            raise HTTPException(404, str(exc)) from None

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {
            "ok": True,
            "journals_read": sorted(reg.states),
            "driving": sorted(k for k, t in reg.drivers.items() if not t.done()),
        }

    return app
