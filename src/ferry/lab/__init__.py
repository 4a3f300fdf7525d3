"""The lab: real brokers on 127.0.0.1 for the demo, the tests and the benchmarks.

``up(profile)`` picks free ports, writes configs and a topology file, starts the
servers detached, and waits (bounded) until they are healthy. ``down`` stops
exactly the processes it started (checked by pid and start time) and removes
the profile's directory. State lives in ``<lab root>/<profile>/state.json`` so
any later process can find, stop or restart what is running.

Profiles:

- ``supercluster``: NATS clusters east and west, 3 servers each, gateways, JetStream, MQTT
- ``sites``: two independent NATS deployments nyc and sfo (one server each)
- ``rabbit-dr``: three independent RabbitMQ nodes art, pc1 and ltm
- ``rabbit-cluster``: one RabbitMQ cluster ``rabbits`` of three nodes
- ``spark``: a Spark standalone master, two workers whose executors run a bare Python (no ferry)
  and a Spark Connect server on them (:mod:`ferry.lab.spark`)

``up(profile, haproxy=True)`` adds ``ferry serve`` and a real HAProxy in front of
every cluster's client (NATS or AMQP) and MQTT ports, health-checked through
``/availability_check`` (addresses in ``LabState.lb``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel

from ferry.errors import ConfigError, FerryError, NotFound
from ferry.lab import haproxy as lab_haproxy
from ferry.lab import nats as lab_nats
from ferry.lab import prometheus as lab_prometheus
from ferry.lab import rabbitmq as lab_rabbit
from ferry.lab import secure as lab_secure
from ferry.lab import spark as lab_spark
from ferry.lab.procs import Proc, free_ports, port_open, stop_all
from ferry.topology import lab_root

__all__ = ["PROFILES", "LabState", "down", "lab_root", "load_state", "running_profiles", "status", "up"]

PROFILES = {
    "supercluster": "NATS clusters east and west (3 servers each) joined by gateways; JetStream, MQTT",
    "sites": "two independent NATS deployments nyc and sfo",
    "rabbit-dr": "three independent RabbitMQ nodes: art (upstream), pc1 (main), ltm (DR)",
    "rabbit-cluster": "one RabbitMQ cluster 'rabbits' of 3 nodes",
    "spark": "a Spark standalone master, 2 workers (bare Python: no ferry) and a Spark Connect server",
}


class LabState(BaseModel):
    profile: str
    dir: str
    nats: list[list[dict]] = []  # one list of servers per NATS deployment
    rabbit: list[dict] = []
    procs: list[Proc] = []
    lb: dict = {}  # with HAProxy: serve, stats, token_file, clusters -> {nats or amqp, mqtt} URLs
    secure: bool = False  # TLS on every port; NATS in operator mode (lab.secure)
    spark: dict = {}  # profile spark: master, master_ui, workers_ui, connect, python, env_file

    @property
    def path(self) -> Path:
        return Path(self.dir)

    def save(self) -> None:
        tmp = self.path / "state.json.tmp"
        tmp.write_text(self.model_dump_json(indent=2))
        tmp.replace(self.path / "state.json")

    def proc(self, name: str) -> Proc:
        for p in self.procs:
            if p.name == name:
                return p
        raise NotFound(f"no server {name!r} in lab profile {self.profile!r}")

    def health(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for deployment in self.nats:
            out |= lab_nats.health([lab_nats.NatsServer(**s) for s in deployment])
        if self.rabbit:
            password = (self.path / "secrets" / "rabbitmq").read_text().strip()
            out |= lab_rabbit.health([lab_rabbit.RabbitNode(**n) for n in self.rabbit], password)
        if self.lb:
            out |= _lb_health(self)
        if self.spark:
            out |= lab_spark.health(self.spark)
        for p in self.procs:
            if p.name in out and not p.alive():
                out[p.name] = "not running"
        return out


def load_state(profile: str, root: Path | None = None) -> LabState | None:
    path = (root or lab_root()) / profile / "state.json"
    if not path.exists():
        return None
    return LabState.model_validate_json(path.read_text())


def running_profiles(root: Path | None = None) -> list[LabState]:
    root = root or lab_root()
    return [s for p in PROFILES if (s := load_state(p, root))]


def up(
    profile: str,
    root: Path | None = None,
    timeout: float = 180.0,
    log: Callable[[str], None] = print,
    haproxy: bool = False,
    secure: bool = False,
) -> LabState:
    """Start a profile (or restart its dead servers) and wait until it is healthy. `secure`: TLS on
    every port with client certificates required, as production deployments run it: NATS in
    operator mode (accounts APP, SALES and SYS, users with .creds files), RabbitMQ with TLS-only
    AMQP and management listeners."""
    if profile not in PROFILES:
        raise ConfigError(f"unknown lab profile {profile!r} (known: {', '.join(PROFILES)})")
    if profile == "spark" and (haproxy or secure):
        raise ConfigError("lab spark has no brokers: --haproxy and --secure are for the broker profiles")
    root = root or lab_root()
    state = load_state(profile, root)
    if state and haproxy and not state.lb:
        raise ConfigError(f"lab {profile} is up without HAProxy", hint=f"`ferry lab down {profile}` first")
    if state and state.secure != secure:
        raise ConfigError(
            f"lab {profile} is up {'with' if state.secure else 'without'} --secure",
            hint=f"`ferry lab down {profile}` first",
        )
    if state:
        dead = [p for p in state.procs if not p.alive()]
        if not dead:
            log(f"lab {profile}: already up")
        for p in dead:
            log(f"lab {profile}: restarting {p.name}")
            p.start()
        state.save()
        _wait_healthy(state, timeout)
        return state

    pdir = root / profile
    if pdir.exists():
        shutil.rmtree(pdir)
    pdir.mkdir(parents=True)
    pdir.chmod(0o755)
    sdir = pdir / "secrets"
    sdir.mkdir(mode=0o700)
    for name in ("app", "sys", "rabbitmq", "api"):
        (sdir / name).write_text(secrets.token_urlsafe(18))
        (sdir / name).chmod(0o600)
    state = LabState(profile=profile, dir=str(pdir), secure=secure)
    topo_sites = _build(profile, state, pdir, lambda n: (sdir / n).read_text())
    (pdir / "topology.yaml").write_text(yaml.safe_dump({"version": 1, "sites": topo_sites}, sort_keys=False))
    if haproxy:
        _add_haproxy(state, pdir)
    state.save()
    _write_combined_topology(root)
    try:
        for p in state.procs:
            p.start()
            state.save()
            if p.kind == "epmd":
                _wait_port(int(p.argv[2]), p, 10)
        _wait_healthy(state, timeout)
    except BaseException:
        # keep the logs the error points at; the next `up` starts afresh
        _stop([state])
        (pdir / "state.json").unlink()
        _write_combined_topology(root)
        raise
    return state


def _build(profile: str, state: LabState, pdir: Path, secret: Callable[[str], str]) -> dict[str, object]:
    sites: dict[str, object] = {}
    sdir = pdir / "secrets"
    sec = lab_secure.make(pdir) if state.secure else None
    tls_dir = str(sec.tls_dir) if sec else ""
    if profile == "supercluster":
        servers = lab_nats.plan_servers({"east": 3, "west": 3}, tls_dir)
        state.nats.append([asdict(s) for s in servers])
        state.procs += lab_nats.make_procs(servers, pdir, secret("app"), secret("sys"), sec)
        sites["sc"] = {"clusters": {c: lab_nats.topology_cluster(servers, c, sdir, sec) for c in ("east", "west")}}
    elif profile == "spark":
        ports = dict(zip(lab_spark.PORTS, free_ports(len(lab_spark.PORTS)), strict=True))
        procs, state.spark = lab_spark.make_procs(pdir, ports, lab_spark.worker_python())
        state.procs += procs
    elif profile == "sites":
        planned = lab_nats.plan_servers({"nyc": 1, "sfo": 1}, tls_dir)  # in one plan: no port handed out twice
        for site in ("nyc", "sfo"):
            servers = [s for s in planned if s.cluster == site]  # each site a cluster of its own
            state.nats.append([asdict(s) for s in servers])
            state.procs += lab_nats.make_procs(servers, pdir, secret("app"), secret("sys"), sec)
            sites[site] = {"clusters": {site: lab_nats.topology_cluster(servers, site, sdir, sec)}}
    else:
        user = lab_rabbit.run_user()
        if user and (blocked := lab_rabbit.reachable_by(user, pdir)):
            raise ConfigError(
                f"lab directory {pdir} is not reachable by user {user}: {blocked} has mode "
                f"{oct(blocked.stat().st_mode & 0o777)}",
                hint="use --dir under a world-traversable path",
            )
        if profile == "rabbit-dr":
            layout = {"art": ["art"], "pc1": ["pc1"], "ltm": ["ltm"]}
        else:
            layout = {"rabbits": ["rabbits-1", "rabbits-2", "rabbits-3"]}
        nodes = lab_rabbit.plan_nodes(layout, tls_dir)
        state.rabbit = [asdict(n) for n in nodes]
        (epmd_port,) = free_ports(1, exclude={p for n in nodes for p in (n.amqp, n.management, n.mqtt, n.dist)})
        state.procs += lab_rabbit.make_procs(nodes, pdir, secret("rabbitmq"), epmd_port)
        for cluster in layout:
            site = cluster if profile == "rabbit-dr" else "dc"
            sites.setdefault(site, {"clusters": {}})["clusters"][cluster] = lab_rabbit.topology_cluster(  # type: ignore[index]
                nodes, cluster, sdir, pdir, epmd_port, sec
            )
    return sites


def _add_haproxy(state: LabState, pdir: Path) -> None:
    """`ferry serve` and HAProxy in front of every cluster of the profile (NATS and MQTT, or AMQP and MQTT)."""
    from ferry.topology import load_topology

    topo = load_topology(pdir / "topology.yaml")
    clusters = [(n, c) for _, n, c in topo.clusters()]
    planned = {v for d in state.nats for srv in d for k, v in srv.items() if isinstance(v, int) and k != "index"}
    planned |= {v for n in state.rabbit for k, v in n.items() if isinstance(v, int)}
    serve_port, stats_port, prom_port, *lb_ports = free_ports(3 + 2 * len(clusters), exclude=planned)
    frontends, lb = [], {}
    for i, (name, cluster) in enumerate(clusters):
        port, mqtt_port = lb_ports[2 * i : 2 * i + 2]
        scheme = "nats" if cluster.kind == "nats" else "amqp"
        fronts = lab_haproxy.frontends(name, cluster, f"127.0.0.1:{port}", f"127.0.0.1:{mqtt_port}")
        frontends += fronts
        url = {"nats": "tls", "amqp": "amqps"}[scheme] if state.secure else scheme  # TLS passes through
        lb[name] = {scheme: f"{url}://127.0.0.1:{port}"}
        if len(fronts) > 1:  # the cluster's brokers have MQTT
            lb[name]["mqtt"] = f"{'mqtts' if state.secure else 'mqtt'}://127.0.0.1:{mqtt_port}"
    d = pdir / "haproxy"
    d.mkdir()
    cfg = d / "haproxy.cfg"
    cfg.write_text(lab_haproxy.render(frontends, f"127.0.0.1:{serve_port}", stats_bind=f"127.0.0.1:{stats_port}"))
    token = pdir / "secrets" / "api"
    state.lb = {
        "serve": f"http://127.0.0.1:{serve_port}",
        "stats": f"http://127.0.0.1:{stats_port}/stats",
        "token_file": str(token),
        "state_dir": str(pdir / "state"),
        "prometheus": f"http://127.0.0.1:{prom_port}",
        "clusters": lb,
    }
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "FERRY_TOPOLOGY": str(pdir / "topology.yaml"),
        "FERRY_STATE_DIR": str(pdir / "state"),  # it adopts the moves of ferries with this state directory
    }
    serve = [sys.executable, "-m", "ferry", "serve", "--port", str(serve_port)]
    state.procs += [
        Proc(
            name="ferry-serve",
            kind="ferry",
            argv=[*serve, "--token-file", str(token)],
            env=env,
            cwd=str(d),
            log=str(d / "serve.log"),
        ),
        Proc(
            name="haproxy",
            kind="haproxy",
            argv=[lab_haproxy.haproxy_binary(), "-f", str(cfg), "-db"],
            env={"PATH": "/usr/bin:/bin:/usr/sbin"},
            cwd=str(d),
            log=str(d / "haproxy.log"),
        ),
        lab_prometheus.proc(
            pdir / "prometheus",
            prom_port,
            {"ferry-serve": [f"127.0.0.1:{serve_port}"]},
            token,
            [lab_prometheus.RULES] if lab_prometheus.RULES.exists() else [],
        ),
    ]


def _lb_health(state: LabState) -> dict[str, str]:
    import httpx

    try:
        hz = httpx.get(state.lb["serve"] + "/healthz", timeout=2).json()
        read = set(hz.get("journals_read", []))
        serve = "ok" if read >= set(state.lb["clusters"]) else "journals not read yet"
    except (httpx.HTTPError, ValueError) as exc:
        serve = f"not answering ({type(exc).__name__})"
    stats_port = urlsplit(state.lb["stats"]).port or 0
    out = {"ferry-serve": serve, "haproxy": "ok" if port_open(stats_port) else "stats port closed"}
    if "prometheus" in state.lb:
        try:
            ready = httpx.get(state.lb["prometheus"] + "/-/ready", timeout=2).status_code == 200
            out["prometheus"] = "ok" if ready else "not ready"
        except httpx.HTTPError as exc:
            out["prometheus"] = f"not answering ({type(exc).__name__})"
    return out


def _wait_port(port: int, proc: Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not port_open(port):
        if not proc.alive() or time.monotonic() > deadline:
            raise FerryError(f"lab: {proc.name} did not open port {port}; see {proc.log}")
        time.sleep(0.05)


def _wait_healthy(state: LabState, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for p in state.procs:
            if not p.alive():
                why = _last_log_line(p.log)
                raise FerryError(f"lab {state.profile}: {p.name} exited during start-up ({why}); see {p.log}")
        health = state.health()
        bad = {k: v for k, v in health.items() if v != "ok"}
        if not bad:
            for deployment in state.nats:
                servers = [lab_nats.NatsServer(**s) for s in deployment]
                if state.secure:
                    creds = [lab_secure.creds_file(state.path / "secrets", a) for a in lab_secure.APP_ACCOUNTS]
                    lab_nats.warm_accounts(servers, creds)
                    lab_nats.warm_mqtt(servers, (state.path / "secrets" / "mqtt.jwt").read_text().strip())
                else:
                    lab_nats.warm_mqtt(servers, (state.path / "secrets" / "app").read_text().strip())
            if state.rabbit:
                password = (state.path / "secrets" / "rabbitmq").read_text().strip()
                lab_rabbit.settle_mqtt([lab_rabbit.RabbitNode(**n) for n in state.rabbit], state.procs, password)
            return
        if time.monotonic() > deadline:
            name, why = next(iter(bad.items()))
            log = state.proc(name).log
            raise FerryError(f"lab {state.profile}: {name} not healthy after {timeout:.0f}s: {why}; see {log}")
        time.sleep(0.25)


def _last_log_line(log: str) -> str:
    """The last fatal/error line of a server log, else its last line (what `up` quotes on failure)."""
    try:
        lines = [ln.strip() for ln in Path(log).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    errors = [ln for ln in lines if "[FTL]" in ln or "[ERR]" in ln or "error" in ln.lower()]
    return (errors or lines or ["empty log"])[-1][-200:]


def _stop(states: list[LabState]) -> None:
    """Servers of every given profile at once, then each profile's epmd."""
    procs = [p for s in states for p in s.procs]
    stop_all([p for p in procs if p.kind != "epmd"])
    stop_all([p for p in procs if p.kind == "epmd"])


def down(profile: str | None = None, root: Path | None = None, log: Callable[[str], None] = print) -> list[str]:
    """Stop one profile (or every running one) and remove its directory."""
    root = root or lab_root()
    if profile and profile not in PROFILES:
        raise ConfigError(f"unknown lab profile {profile!r} (known: {', '.join(PROFILES)})")
    states = [s for s in running_profiles(root) if profile in (None, s.profile)]
    _stop(states)
    for state in states:
        shutil.rmtree(state.path, ignore_errors=True)
        log(f"lab {state.profile}: down ({len(state.procs)} processes stopped)")
    _write_combined_topology(root)
    return [s.profile for s in states]


def status(root: Path | None = None) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for state in running_profiles(root):
        health = state.health()
        executors = lab_spark.executors(state.spark) if state.spark else {}
        for p in state.procs:
            ports = _ports(state, p.name)
            rows.append(
                {
                    "profile": state.profile,
                    "server": p.name,
                    "kind": p.kind,
                    "pid": p.pid,
                    "running": p.alive(),
                    "ports": ports,
                    "health": health.get(p.name, "ok" if p.alive() else "not running"),
                    "log": p.log,
                    **({"executors": executors[p.name]} if p.name in executors else {}),  # [{app_id, app, ...}]
                }
            )
    return rows


def _ports(state: LabState, name: str) -> dict[str, int]:
    for s in [s for d in state.nats for s in d] + state.rabbit:
        if s["name"] == name:
            return {k: v for k, v in s.items() if isinstance(v, int) and k != "index"}
    proc = state.proc(name)
    if proc.kind == "epmd":
        return {"port": int(proc.argv[2])}
    lb = state.lb or {}
    if name == "ferry-serve" and lb:
        return {"http": urlsplit(lb["serve"]).port or 0}
    if name == "haproxy" and lb:
        fronts = {f"{c}_{k}": urlsplit(u).port or 0 for c, urls in lb["clusters"].items() for k, u in urls.items()}
        return {**fronts, "stats": urlsplit(lb["stats"]).port or 0}
    if name == "prometheus" and "prometheus" in lb:
        return {"http": urlsplit(lb["prometheus"]).port or 0}
    if proc.kind == "spark":
        sp = state.spark
        urls = {"spark-master": {"spark": sp["master"], "ui": sp["master_ui"]}}
        urls["spark-connect"] = {"grpc": sp["connect"]}
        urls |= {f"spark-worker-{i}": {"ui": ui} for i, ui in enumerate(sp["workers_ui"], 1)}
        return {k: urlsplit(u).port or 0 for k, u in urls.get(name, {}).items()}
    return {}


def _write_combined_topology(root: Path) -> None:
    """<root>/topology.yaml: the union of every running profile's topology."""
    sites: dict[str, object] = {}
    for state in running_profiles(root):
        sites |= yaml.safe_load((state.path / "topology.yaml").read_text())["sites"]
    path = root / "topology.yaml"
    if sites:
        root.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump({"version": 1, "sites": sites}, sort_keys=False))
    elif path.exists():
        path.unlink()
