"""`ferry serve`: the HTTP API beside the CLI.

- ``GET /availability_check?node=NAME`` (or ``/availability_check/NAME``): 503 for
  a node being evacuated or a donor of a running rebalance, 200 otherwise — the
  load balancer's health check (EMQX's ``load_rebalance/availability_check``);
- ``/evacuations`` and ``/rebalances``: start (POST), inspect (GET), stop
  (DELETE). Mutating endpoints need ``Authorization: Bearer <token>``;
- ``GET /metrics`` (Prometheus, :mod:`ferry.api.metrics`), ``GET /`` (the operations console)
  and its data ``GET /api/console`` (:mod:`ferry.api.console`), ``/reports/NAME.html`` (audit
  reports): the bearer token unless ``--public-read``;
- OpenAPI at ``/openapi.json``, its docs at ``/docs`` (assets from the package).

The server reads every cluster's journal (NATS: the ``ferry_ops`` bucket; RabbitMQ:
the ``ferry-ops.*`` global parameters and the DR fail-back's record) twice a second
(:mod:`ferry.api.watch`), so answers
follow the journal whoever wrote it (a CLI, another ``ferry serve``), and it
drives every journaled evacuation, rebalance and move whose driver died: an
evacuation started from the CLI is kept ``prohibiting`` here after the CLI
returns; beside every move it keeps a standby guard (:mod:`ferry.jobs.move.standby`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST

from ferry.api.audits import Audits
from ferry.api.console import view
from ferry.api.metrics import JournalCollector, render
from ferry.api.watch import READ_FRESH, Registry, kind_of
from ferry.errors import Conflict, FerryError, NotFound
from ferry.jobs import evacuate as rb
from ferry.jobs import move as mv
from ferry.jobs.evacuate.plan import evacuation_key, rebalance_key
from ferry.jobs.move.standby import announce, stand_by
from ferry.topology import NatsCluster, Topology

# seconds from serve's start an availability check may wait for the first journal read: less than
# the lab HAProxy's check timeout (its `inter`, 1 s, with no `timeout check`)
FIRST_READ = 0.5
LISTED_WITHIN = 3.0  # seconds a started operation's answer waits for serve to read its journal key
MAX_BODY = 64 * 1024  # bytes of a request body (an evacuation's or a rebalance's fields)
STATIC = Path(__file__).parent / "static"

__all__ = ["READ_FRESH", "Registry", "create_app"]


def _resume(reg: Registry, cname: str, key: str, st: dict[str, Any]) -> Any:
    """The driver that takes over an evacuation, rebalance or move on record whose ferry died."""
    if kind_of(key, st) == "move":  # not stopped at serve's end: for a move that means cancelled
        where = st.get("placement") or {}
        req = mv.MoveRequest(
            stream=st["stream"],
            to=where.get("cluster"),
            to_tags=list(where.get("tags") or []),
            timeout=float(st.get("timeout") or 600.0),
            guard=bool(st.get("guard", True)),
        )
        return mv.move(reg.journals[cname], req)  # type: ignore[arg-type]
    stop = asyncio.Event()
    if st.get("kind") == "evacuation":
        reg.stops[evacuation_key(cname, st["node"])] = stop
        req = rb.EvacuateRequest(node=st["node"], cluster=cname)
        return rb.evacuate(reg.topo, req, stop=stop, hold=True, resume_only=True)
    reg.stops[rebalance_key(cname)] = stop
    return rb.rebalance(reg.topo, rb.RebalanceRequest(cluster=cname, execute=True), stop=stop, resume_only=True)


def locate(reg: Registry, node: str, cluster: str | None) -> str:
    """The cluster of `node` (404 when none has it, 400 when several do and `cluster` is not given)."""
    found = [
        n for n, c in reg.clusters.items() if (not cluster or n == cluster) and node in {b.name for b in c.brokers}
    ]
    if not found:
        raise HTTPException(404, f"no node {node!r}" + (f" in cluster {cluster!r}" if cluster else ""))
    if len(found) > 1:
        raise HTTPException(400, f"node {node!r} is in clusters {', '.join(found)}; add ?cluster=")
    return found[0]


async def _first_event(reg: Registry, cname: str, key: str, coro: Any) -> dict[str, Any]:
    """Start an operation in the background; answer with its plan (or its refusal) at once, once
    its journal key is read (so a GET right after lists it), or a few seconds at most."""
    got: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    def emit(event: str, **data: Any) -> None:
        if event in ("plan", "resume") and not got.done():
            got.set_result({"event": event, **data})

    def refused() -> None:
        if task.done() and (exc := task.exception()):
            status = 404 if isinstance(exc, NotFound) else 409 if isinstance(exc, Conflict) else 400
            raise HTTPException(status, str(exc) if isinstance(exc, FerryError) else f"{type(exc).__name__}: {exc}")

    task = reg.start(key, coro(emit))
    await asyncio.wait([task, got], timeout=30, return_when=asyncio.FIRST_COMPLETED)
    refused()
    if task.done():
        return task.result()
    deadline = time.monotonic() + LISTED_WITHIN
    while key not in reg.states.get(cname, {}) and not task.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    refused()  # within the wait
    return got.result() if got.done() else {"event": "starting"}


def create_app(topo: Topology, token: str | None, public_read: bool = False, reports: Path | None = None) -> FastAPI:
    """The app of `ferry serve`: mutating endpoints need `token`; the console and ``/metrics`` need
    it too unless `public_read` (with no token and no `public_read`, they are off)."""
    reg, audits = Registry(topo), Audits(reports)
    metrics = JournalCollector(reg, audits)
    bearer = HTTPBearer(auto_error=False)

    def check(cred: HTTPAuthorizationCredentials | None, what: str) -> None:
        if token is None:
            raise HTTPException(403, f"ferry serve runs without a token: {what} (--token-file)")
        if cred is None or not hmac.compare_digest(cred.credentials.encode(), token.encode()):
            raise HTTPException(401, "a valid bearer token is required", headers={"WWW-Authenticate": "Bearer"})

    def authorized(cred: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        check(cred, "mutating endpoints are off")

    def may_read(cred: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if not public_read:
            check(cred, "the console and /metrics are off unless --public-read")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        reg.started = time.monotonic()
        reg.first_read = {n: asyncio.Event() for n in reg.journals}
        tasks = [asyncio.create_task(reg.watch(n, c)) for n, c in reg.journals.items()]
        tasks.append(asyncio.create_task(reg.adopt(lambda c, k, st: _resume(reg, c, k, st))))
        tasks.append(asyncio.create_task(reg.stand_by(lambda c, st, moving: stand_by(reg.journals[c], st, moving))))
        nats_urls = sorted({u for c in reg.journals.values() if isinstance(c, NatsCluster) for u in c.urls})
        tasks.append(reg.spawn("announcing this serve", announce(nats_urls)))  # a failure is logged
        tasks.append(asyncio.create_task(reg.refresh()))
        yield
        for ev in reg.stops.values():
            ev.set()  # drivers release their journals so another ferry adopts them at once
        drivers = [t for k, t in reg.drivers.items() if not t.done() and k in reg.stops]
        if drivers:
            await asyncio.wait(drivers, timeout=5)
        # moves and standby guards are cancelled: their journal stays for the next ferry to adopt
        left = tasks + list(reg.drivers.values()) + [t for t, _ in reg.standbys.values()]
        for t in left:
            t.cancel()
        await asyncio.wait(left, timeout=5)  # a guard closes its file and connection

    app = FastAPIOffline(  # the API docs' scripts come from the package: no CDN on an operations network
        title="ferry",
        summary="Availability checks for load balancers; node evacuation and cluster rebalancing; "
        "the operations console and Prometheus metrics of every job.",
        lifespan=lifespan,
    )

    @app.middleware("http")
    async def small_bodies(request: Request, call_next: Any) -> Response:
        """A request body is a few fields: one over MAX_BODY bytes is refused before it is read."""
        length = request.headers.get("content-length")
        if (
            request.method in ("POST", "PUT", "PATCH", "DELETE")
            and length is None
            and "chunked" in (request.headers.get("transfer-encoding") or "")
        ):
            return JSONResponse({"detail": "a request body needs a Content-Length"}, status_code=411)
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            return JSONResponse({"detail": f"a request body is at most {MAX_BODY:,} bytes"}, status_code=413)
        return await call_next(request)  # type: ignore[no-any-return]

    Auth, Read = Depends(authorized), Depends(may_read)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    def console_page() -> FileResponse:
        return FileResponse(STATIC / "console.html", headers={"Cache-Control": "no-store"})

    @app.get("/api/console", dependencies=[Read], summary="What the console shows: operations, nodes, lag, audits")
    def console() -> dict[str, Any]:
        return view(reg, audits)

    @app.get("/metrics", dependencies=[Read], summary="Prometheus metrics of every operation on record")
    def prometheus_metrics() -> Response:  # in a thread: the availability checks never wait for a render
        return Response(render(metrics.collect()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/reports/{name}.html", dependencies=[Read], include_in_schema=False)
    def report(name: str) -> FileResponse:
        path = audits.html(name)
        if path is None:
            raise HTTPException(404, f"no audit report {name!r}")
        return FileResponse(path)

    async def availability(node: str, cluster: str | None) -> JSONResponse:
        cname = locate(reg, node, cluster)
        # just started: the answer waits for the journal (a node under evacuation is not 200 for a moment)
        read, wait = reg.first_read.get(cname), reg.started + FIRST_READ - time.monotonic()
        if read and not read.is_set() and wait > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(read.wait(), wait)
        why = reg.unavailable(cname, node)
        if why is None:  # a journal that cannot be read must not take every node out of the balancer
            return JSONResponse({"node": node, "cluster": cname, "available": True, "reason": "journal not read yet"})
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
        cname = locate(reg, node, cluster)
        st = reg.states.get(cname, {}).get(evacuation_key(cname, node))
        if not st:
            raise HTTPException(404, f"no evacuation of {node}")
        return {k: v for k, v in st.items() if k != "heartbeat"}

    @app.post("/evacuations", dependencies=[Auth], status_code=202)
    async def start_evacuation(req: rb.EvacuateRequest) -> dict[str, Any]:
        cname = locate(reg, req.node, req.cluster or None)
        key = evacuation_key(cname, req.node)
        stop = reg.stops[key] = asyncio.Event()
        req = req.model_copy(update={"cluster": cname})
        return await _first_event(reg, cname, key, lambda emit: rb.evacuate(reg.topo, req, emit, stop=stop, hold=True))

    @app.delete("/evacuations/{node}", dependencies=[Auth])
    async def stop_evacuation(node: str, cluster: Annotated[str | None, Query()] = None) -> dict[str, Any]:
        try:
            return await rb.stop(reg.topo, locate(reg, node, cluster), node)
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
        return await _first_event(reg, req.cluster, key, lambda emit: rb.rebalance(reg.topo, req, emit, stop=stop))

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
