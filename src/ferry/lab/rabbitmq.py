"""RabbitMQ nodes for the lab (Debian's rabbitmq-server 3.10).

Several nodes on one host, each with its own node name, ports, data, log and
config; a private epmd per profile on a free port so nothing outlives
`ferry lab down`. Nodes run as user ``rabbitmq`` when ferry runs as root (the
Debian layout expects it), so the lab directories are given to that user.
A cluster forms at first boot with classic-config peer discovery.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx

from ferry.errors import ConfigError, FerryError
from ferry.lab.procs import Proc, free_ports, port_open
from ferry.lab.secure import Secure, client_context

RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
MEMORY_WATERMARK = 0.2  # of the machine's memory, per node
PLUGINS = [
    "rabbitmq_management",
    "rabbitmq_shovel",
    "rabbitmq_shovel_management",
    "rabbitmq_federation",
    "rabbitmq_federation_management",
    "rabbitmq_mqtt",
]
ADMIN_USER = "ferry"


@dataclass
class RabbitNode:
    name: str
    cluster: str
    amqp: int
    management: int
    mqtt: int
    dist: int
    tls_dir: str = ""  # a secure lab's: AMQP and management over TLS only, clients show certificates, MQTT too

    @property
    def node(self) -> str:
        return f"{self.name}@localhost"

    @property
    def url(self) -> str:
        return f"{'amqps' if self.tls_dir else 'amqp'}://127.0.0.1:{self.amqp}"

    @property
    def management_url(self) -> str:
        return f"{'https' if self.tls_dir else 'http'}://127.0.0.1:{self.management}"


def run_user() -> str | None:
    """'rabbitmq' when running as root, else None (run as ourselves)."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("rabbitmq")
    except KeyError:
        return None
    return "rabbitmq"


def check_installed() -> None:
    if not Path(RABBITMQ_SERVER).exists():
        raise ConfigError(
            "rabbitmq-server is not installed",
            hint="run `make setup` (apt-get install rabbitmq-server) as root",
        )


def plan_nodes(clusters: dict[str, list[str]], tls_dir: str = "") -> list[RabbitNode]:
    nodes: list[RabbitNode] = []
    planned: set[int] = set()  # no node is listening yet: a port must not be handed out twice
    for cname, names in clusters.items():
        for name in names:
            amqp, management, mqtt, dist = ports = free_ports(4, exclude=planned)
            planned.update(ports)
            nodes.append(RabbitNode(name, cname, amqp, management, mqtt, dist, tls_dir))
    return nodes


def render_config(node: RabbitNode, peers: list[RabbitNode], password: str) -> str:
    if node.tls_dir:  # TLS only: no plaintext AMQP, HTTP or MQTT port; clients must show a certificate
        d = Path(node.tls_dir)
        files = {"cacertfile": d / "ca.pem", "certfile": d / "server-cert.pem", "keyfile": d / "server-key.pem"}
        listen = ["listeners.tcp = none", f"listeners.ssl.1 = 127.0.0.1:{node.amqp}", "mqtt.listeners.tcp = none"]
        listen += [f"mqtt.listeners.ssl.1 = 127.0.0.1:{node.mqtt}"]  # with ssl_options, as AMQP
        for prefix in ("ssl_options", "management.ssl"):
            listen += [f"{prefix}.{k} = {v}" for k, v in files.items()]
            listen += [f"{prefix}.verify = verify_peer", f"{prefix}.fail_if_no_peer_cert = true"]
        # certificate logins (SASL EXTERNAL, rabbitmq_auth_mechanism_ssl): the user is the certificate's CN
        listen += [f"auth_mechanisms.{i} = {m}" for i, m in enumerate(("PLAIN", "AMQPLAIN", "EXTERNAL"), 1)]
        listen += ["ssl_cert_login_from = common_name"]
        listen += [f"management.ssl.port = {node.management}", "management.ssl.ip = 127.0.0.1"]
    else:
        listen = [
            f"listeners.tcp.1 = 127.0.0.1:{node.amqp}",
            f"management.tcp.port = {node.management}",
            "management.tcp.ip = 127.0.0.1",
            f"mqtt.listeners.tcp.1 = 127.0.0.1:{node.mqtt}",
        ]
    lines = [
        *listen,
        f"default_user = {ADMIN_USER}",
        f"default_pass = {password}",
        "default_user_tags.administrator = true",
        "default_permissions.configure = .*",
        "default_permissions.read = .*",
        "default_permissions.write = .*",
        "loopback_users = none",
        "disk_free_limit.absolute = 50MB",
        f"vm_memory_high_watermark.relative = {MEMORY_WATERMARK}",
        f"cluster_name = {node.cluster}",
        "collect_statistics_interval = 1000",
    ]
    if len(peers) > 1:
        lines.append("cluster_formation.peer_discovery_backend = classic_config")
        lines += [f"cluster_formation.classic_config.nodes.{i} = {p.node}" for i, p in enumerate(peers, 1)]
    return "\n".join(lines) + "\n"


def make_procs(nodes: list[RabbitNode], root: Path, password: str, epmd_port: int) -> list[Proc]:
    """The profile's epmd first, then one process per node."""
    check_installed()
    user = run_user()
    cookie = root / ".erlang.cookie"
    if not cookie.exists():
        cookie.write_text(secrets.token_hex(20))
    cookie.chmod(0o400)
    base_env = {
        "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": str(root),  # the profile's own Erlang cookie
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "ERL_EPMD_PORT": str(epmd_port),
        "ERL_EPMD_ADDRESS": "127.0.0.1",
    }
    procs = [
        Proc(
            name="epmd",
            kind="epmd",
            argv=[shutil.which("epmd") or "/usr/bin/epmd", "-port", str(epmd_port), "-address", "127.0.0.1"],
            env=base_env,
            cwd=str(root),
            user=user,
            log=str(root / "epmd.log"),
        )
    ]
    for node in nodes:
        d = root / node.name
        for sub in ("mnesia", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        peers = [n for n in nodes if n.cluster == node.cluster]
        conf = d / "rabbitmq.conf"
        conf.write_text(render_config(node, peers, password))
        conf.chmod(0o600)
        plugins = [*PLUGINS, "rabbitmq_auth_mechanism_ssl"] if node.tls_dir else PLUGINS
        (d / "enabled_plugins").write_text(f"[{','.join(plugins)}].\n")
        (d / "rabbitmq-env.conf").write_text("")
        env = {
            **base_env,
            "RABBITMQ_NODENAME": node.node,
            "RABBITMQ_DIST_PORT": str(node.dist),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_LOGS": "-",  # to stdout, which the lab captures in server.log
            "RABBITMQ_CONFIG_FILE": str(conf),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
            "RABBITMQ_PID_FILE": str(d / "rabbitmq.pid"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }
        procs.append(
            Proc(
                name=node.name,
                kind="rabbitmq",
                argv=[RABBITMQ_SERVER],
                env=env,
                cwd=str(d),
                user=user,
                log=str(d / "server.log"),
            )
        )
    if user:
        shutil.chown(root, user, user)
        for path in root.rglob("*"):
            if path.name != "secrets" and "secrets" not in path.parts:
                shutil.chown(path, user, user)
    return procs


def tool(proc: Proc, name: str, *args: str) -> None:
    """Run a RabbitMQ CLI tool against a running lab node (its environment, its user), e.g.
    ``tool(p, "rabbitmq-plugins", "disable", "--online", "rabbitmq_shovel_management")``."""
    env = {**proc.env}
    argv = [str(Path(RABBITMQ_SERVER).with_name(name)), "-n", env["RABBITMQ_NODENAME"], *args]
    if proc.user:
        argv = ["runuser", "-u", proc.user, "--", "env", *[f"{k}={v}" for k, v in env.items()], *argv]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=proc.cwd, timeout=120, env=env)
    if result.returncode != 0:
        raise FerryError(f"{name} {' '.join(args)} on {proc.name} failed: {result.stderr.strip()[-300:]}")


def topology_cluster(
    nodes: list[RabbitNode], cluster: str, secrets_dir: Path, root: Path, epmd_port: int, secure: Secure | None = None
) -> dict[str, object]:
    brokers: list[dict[str, object]] = [
        {"name": n.name, "node": n.node, "url": n.url, "management_url": n.management_url}
        | {"mqtt_url": f"{'mqtts' if secure else 'mqtt'}://127.0.0.1:{n.mqtt}"}
        for n in nodes
        if n.cluster == cluster
    ]
    return {
        "kind": "rabbitmq",
        "credentials": {"user": ADMIN_USER, "password_file": str(secrets_dir / "rabbitmq")},
        # the nodes dial other clusters (shovels, federation) with the same files: on the lab they are on
        # this host, owned by the nodes' user; they check the name the certificates carry beside 127.0.0.1
        **(
            {"tls": secure.client_tls(), "outbound_tls": {**secure.client_tls(), "server_name": "localhost"}}
            if secure
            else {}
        ),
        # on a secure lab the client certificate (CN ferry) logs in, except to rabbit-dr's upstream art,
        # whose shovels' and federation links' URIs keep a password: both kinds of login are exercised
        **({"x509_login": True} if secure and cluster != "art" else {}),
        "erlang": {"cookie_file": str(root / ".erlang.cookie"), "epmd_port": epmd_port},
        "brokers": brokers,
    }


def health(nodes: list[RabbitNode], password: str) -> dict[str, str]:
    """Per node: 'ok' when its AMQP and MQTT listeners accept, its management API
    answers, the shovel and federation plugins answer, and its cluster reports
    every member running."""
    out = {}
    auth = (ADMIN_USER, password)
    for n in nodes:
        size = sum(1 for m in nodes if m.cluster == n.cluster)
        listeners = (("AMQP", n.amqp), ("MQTT", n.mqtt))  # plain or TLS: the MQTT plugin opens its own late
        closed = [name for name, port in listeners if not port_open(port)]
        if closed:
            out[n.name] = f"{' and '.join(closed)} listener not open yet"
            continue
        try:
            verify = client_context(n.tls_dir)
            r = httpx.get(f"{n.management_url}/api/nodes", auth=auth, timeout=3, verify=verify)
            if r.status_code != 200:
                out[n.name] = f"management API answered {r.status_code}"
                continue
            running = [x["name"] for x in r.json() if x.get("running")]
            if len(running) != size:
                out[n.name] = f"{len(running)} of {size} cluster nodes running"
                continue
            for path in ("/api/shovels", "/api/federation-links"):
                if httpx.get(f"{n.management_url}{path}", auth=auth, timeout=3, verify=verify).status_code != 200:
                    out[n.name] = f"{path} not answering (plugin missing?)"
                    break
            else:
                out[n.name] = "ok"
        except httpx.HTTPError as exc:
            out[n.name] = f"management API not answering ({type(exc).__name__})"
    return out


# RabbitMQ 3.10's MQTT plugin tracks client ids in a Raft cluster of its own (mqtt_node) that a
# node joins once, as it boots; a join that reaches a leader elected a moment before is refused
# (cluster_change_not_permitted) and never tried again, and every MQTT connect to that node then
# fails (its log: "client ID registration timed out"; CONNACK "server unavailable"). Seen in 2 of
# 6 boots of the lab's cluster on two busy cores (and in CI). The node is added to the members
# the others agree on.
_JOIN_MQTT_NODE = (
    "Me = mqtt_node:node_id(), {ok, Members, _} = ra:members(mqtt_node:all_node_ids() -- [Me]), "
    "ra:add_member(Members, Me)."
)


def settle_mqtt(nodes: list[RabbitNode], procs: list[Proc], password: str, tries: int = 4) -> None:
    """Each node of a cluster of several answers an MQTT connect, its client-id tracking joined
    to the others' where it was left out at boot; a FerryError naming the node if it never does."""
    import asyncio

    from ferry.brokers.base import mqtt_probe
    from ferry.errors import BrokerUnavailable

    for n in nodes:
        if sum(1 for m in nodes if m.cluster == n.cluster) < 2:
            continue
        url = f"{'mqtts' if n.tls_dir else 'mqtt'}://127.0.0.1:{n.mqtt}"
        tls = client_context(n.tls_dir) if n.tls_dir else None
        for attempt in range(tries):
            try:  # past the plugin's own 5 s registration timeout
                asyncio.run(mqtt_probe(url, ADMIN_USER, password, timeout=7, tls=tls))  # type: ignore[arg-type]
                break
            except BrokerUnavailable as exc:
                if attempt == tries - 1:
                    raise FerryError(f"lab: MQTT on {n.name} does not answer: {exc}") from None
                proc = next(p for p in procs if p.name == n.name)
                with contextlib.suppress(FerryError):  # no leader to join yet: the next attempt tries again
                    tool(proc, "rabbitmqctl", "eval", _JOIN_MQTT_NODE)


def reachable_by(user: str, path: Path) -> Path | None:
    """The first ancestor of `path` that `user` cannot traverse, or None."""
    pw = pwd.getpwnam(user)
    for parent in [*reversed(path.resolve().parents)]:
        st = parent.stat()
        if st.st_uid == pw.pw_uid:
            continue
        if st.st_gid == pw.pw_gid and st.st_mode & 0o010:
            continue
        if not st.st_mode & 0o001:
            return parent
    return None
