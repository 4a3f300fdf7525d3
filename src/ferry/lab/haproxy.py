"""HAProxy in front of a cluster's client ports, asking `ferry serve` which nodes may take new clients.

Each server is checked in two steps (both must pass): the node's own health
(NATS: ``GET /healthz`` on its monitoring port; RabbitMQ: ``GET /`` on its
management port, which a node in maintenance mode stops answering) and ferry's
``GET /availability_check?node=<server name>`` — 503 while the node is evacuated
or a rebalance donor. Server names must be the topology's node names.
``balance leastconn`` sends reconnecting clients to the emptiest node, and the
long client/server timeouts keep idle NATS and MQTT connections open.

A cluster with a ``tls`` block is checked over TLS (its monitoring or management port is
HTTPS there): verified against its ``ca_file``, showing its client certificate when it has one.
HAProxy reads the client key from the certificate file itself or from ``<cert_file>.key``.
Clients' TLS passes through (``mode tcp``): they verify the node they land on.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ferry.errors import ConfigError
from ferry.topology import NatsCluster, RabbitCluster, broker_tls


@dataclass
class Frontend:
    name: str  # e.g. nats_east
    bind: str  # host:port
    servers: list[tuple[str, str, int, str]]  # node name, client host:port, health-check port, its TLS options
    check_uri: str = "/healthz"

    @property
    def check_tls(self) -> bool:
        """Whether the nodes' health ports are checked over TLS."""
        return any(tls for *_, tls in self.servers)


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or (shutil.which("haproxy", path="/usr/sbin:/sbin"))
    if not found:
        raise ConfigError("haproxy not found", hint="apt-get install haproxy, or run `make setup`")
    return found


def _hostport(url: str) -> str:
    u = urlsplit(url)
    return f"{u.hostname}:{u.port}"


def frontends(
    name: str, cluster: NatsCluster | RabbitCluster, client_bind: str, mqtt_bind: str | None
) -> list[Frontend]:
    """The client (NATS or AMQP) and MQTT frontends of one cluster, from its topology entry."""
    if isinstance(cluster, NatsCluster):
        kind, check_uri = "nats", "/healthz"

        def check_port(b: Any) -> int:
            if not b.monitor_url:
                raise ConfigError(f"cluster {name!r}: every broker needs a monitor_url for HAProxy's health check")
            return urlsplit(b.monitor_url).port or 8222

    else:
        kind, check_uri = "amqp", "/"

        def check_port(b: Any) -> int:
            return urlsplit(b.management_url).port or 15672

    out = [
        Frontend(
            f"{kind}_{name}",
            client_bind,
            [(b.name, _hostport(b.url), check_port(b), _check_tls(cluster, b)) for b in cluster.brokers],
            check_uri,
        )
    ]
    mqtt = [
        (b.name, _hostport(b.mqtt_url), check_port(b), _check_tls(cluster, b)) for b in cluster.brokers if b.mqtt_url
    ]
    if mqtt_bind and mqtt:
        out.append(Frontend(f"mqtt_{name}", mqtt_bind, mqtt, check_uri))
    return out


def _check_tls(cluster: NatsCluster | RabbitCluster, broker: Any) -> str:
    """The server options that verify a node's HTTPS health port (and show the client certificate):
    the broker's TLS settings (its cluster's, with its own over them)."""
    tls = broker_tls(cluster, broker)
    if tls is None:
        return ""
    opts = ["verify required", f"ca-file {tls.ca_file}" if tls.ca_file else "ca-file @system-ca"]
    if tls.cert_file:
        opts.append(f"crt {tls.cert_file}")
    if isinstance(cluster, NatsCluster) and tls.server_name:
        opts.append(f"verifyhost {tls.server_name}")
    return " ".join(opts)


def render(frontends: list[Frontend], serve: str, stats_bind: str | None = None) -> str:
    """An haproxy.cfg: one `listen` per frontend, health-checked through `serve` (host:port)."""
    serve_host, serve_port = serve.rsplit(":", 1)
    lines = [
        "global",
        "  maxconn 8000",  # two file descriptors per proxied connection
        "",
        "defaults",
        "  mode tcp",
        "  timeout connect 5s",
        "  timeout client 60m",
        "  timeout server 60m",
        "  default-server inter 1s fall 2 rise 2",
        "",
    ]
    if stats_bind:
        lines += ["listen stats", f"  bind {stats_bind}", "  mode http", "  stats enable", "  stats uri /stats", ""]
    for f in frontends:
        lines += [
            f"listen {f.name}",
            f"  bind {f.bind}",
            "  balance leastconn",
            "  option httpchk",
            "  # 1. the node itself is healthy",
            "  http-check connect ssl" if f.check_tls else "  http-check connect",
            f"  http-check send meth GET uri {f.check_uri}",
            "  http-check expect status 200",
            "  # 2. ferry says it may take new clients (503 while evacuated or a rebalance donor)",
            f"  http-check connect addr {serve_host} port {serve_port}",
            "  http-check send meth GET uri-lf /availability_check?node=%[srv_name]",
            "  http-check expect status 200",
        ]
        for node, addr, monitor, tls in f.servers:
            host = addr.rsplit(":", 1)[0]
            lines.append(f"  server {node} {addr} check addr {host} port {monitor}{' ' + tls if tls else ''}")
        lines.append("")
    return "\n".join(lines)
