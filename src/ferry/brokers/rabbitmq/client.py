"""RabbitMQ adapter.

Features: the management HTTP API (queues, parameters, policies, shovels,
federation links, connections) with every name URL-encoded, AMQP connections
through aio-pika with bounded connect and error mapping.

Connection string: ``amqp://host:5672`` and ``http://host:15672`` per broker in
the topology; the user and password come from the cluster's ``credentials``
and serve both.

Options: ``timeout`` for every HTTP call and the AMQP connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
from typing import Any
from urllib.parse import quote, urlsplit

import aio_pika
import aiormq
import httpx
from pamqp import constants as _pamqp_constants

from ferry.brokers.base import (
    Answer,
    BrokerKind,
    Probe,
    mqtt_probe,
    needed_by,
    timed_probe,
    tls_cause,
    tls_session,
)
from ferry.errors import AuthError, BrokerUnavailable, ConfigError, FerryError, Forbidden, NotFound, redact
from ferry.topology import RabbitBroker, RabbitCluster, Topology, broker_tls

__all__ = ["Management", "Rabbit", "amqp_connect", "amqp_login", "amqp_uri", "probe", "q"]


# pamqp (under aio-pika and ferry's raw frames) refuses queue and exchange names outside
# [a-zA-Z0-9-_.:@#,/+ ]; RabbitMQ takes any UTF-8 name of up to 255 bytes (`%`, `ü`, ...).
for _kind in ("queue-name", "exchange-name"):
    _pamqp_constants.DOMAIN_REGEX[_kind] = re.compile(r"^[^\x00]*$")


class Rabbit(BrokerKind):
    kind = "rabbitmq"
    capabilities = frozenset({"destructive-read", "publisher-confirms", "shovel", "federation", "mqtt"})
    retryable = (BrokerUnavailable, aiormq.exceptions.AMQPConnectionError, ConnectionError)

    @classmethod
    def translate(cls, exc: BaseException) -> FerryError | None:
        if not type(exc).__module__.startswith(("aiormq.", "aio_pika.", "pamqp.")):
            return None
        # AMQP's args: (403, "ACCESS_REFUSED - access to queue ...")
        text = next((a for a in reversed(exc.args) if isinstance(a, str) and a), None) or str(exc) or type(exc).__name__
        if isinstance(exc, aiormq.exceptions.ChannelAccessRefused | aiormq.exceptions.ProbableAuthenticationError):
            return Forbidden(text.splitlines()[0])
        return FerryError(text.splitlines()[0])


def q(name: str) -> str:
    """URL-encode one path segment of the management API (vhost '/' is '%2F')."""
    return quote(name, safe="")


def queue_path(vhost: str, queue: str) -> str:
    """A queue as ferry names it in messages and events: VHOST/QUEUE, each part's ``%`` and ``/``
    encoded as in a ``rabbitmq://`` URI (``%2F/orders`` for the default vhost's queue, not
    ``//orders``); other characters stay as they are, to be read."""
    return "/".join(part.replace("%", "%25").replace("/", "%2F") for part in (vhost, queue))


class Management:
    """The management HTTP API of one broker (any node of a cluster answers for all)."""

    def __init__(
        self, cluster: RabbitCluster, broker: RabbitBroker | None = None, *, name: str = "", timeout: float = 10.0
    ) -> None:
        self.cluster, self.broker = cluster, broker or cluster.brokers[0]
        self.name = name or self.broker.name
        creds = cluster.credentials
        self.user = creds.user if creds else ""
        with needed_by(self.name):
            auth = (creds.user, creds.password() or "") if creds else None
            verify = tls_context(cluster, self.broker) or True
        url = f"{self.broker.management_url}/api"
        self._http = httpx.AsyncClient(base_url=url, auth=auth, timeout=timeout, verify=verify)

    async def __aenter__(self) -> Management:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(self, method: str, path: str, *, ok404: bool = False, **kwargs: Any) -> Any:
        try:
            r = await self._http.request(method, path, **kwargs)
        except (httpx.HTTPError, ssl.SSLError) as exc:  # a refused client certificate: a bare SSLError
            why = tls_cause(exc) or type(exc).__name__
            if isinstance(exc, httpx.RemoteProtocolError) and self.broker.management_url.startswith("http:"):
                why += "; a TLS port? then https://"
            where = f"{self.name}: management API {self.broker.management_url}"
            raise BrokerUnavailable(f"{where} not answering ({why})") from None
        if r.status_code == 401:  # the credentials, or a tag or vhost permission the user lacks
            why = ""
            with contextlib.suppress(ValueError, AttributeError):
                why = r.json().get("reason") or ""
            if not why or why.lower().startswith("login failed"):
                raise AuthError(f"{self.name}: management API refused the credentials of user {self.user!r}")
            raise Forbidden(f"{self.name}: management API refused {method} {path} to user {self.user!r}: {why}")
        if r.status_code == 404:
            if ok404:
                return None
            raise NotFound(f"{self.name}: {method} {path}: not found")
        if r.status_code >= 400:
            raise FerryError(f"{self.name}: {method} {path}: {r.status_code} {redact(r.text.strip())[:300]}")
        return r.json() if r.content else None

    async def get(self, path: str, **kwargs: Any) -> Any:
        return await self.request("GET", path, **kwargs)

    async def put(self, path: str, body: Any, timeout: Any = httpx.USE_CLIENT_DEFAULT) -> Any:
        return await self.request("PUT", path, json=body, timeout=timeout)

    async def delete(self, path: str, ok404: bool = True, timeout: Any = httpx.USE_CLIENT_DEFAULT) -> Any:
        """`timeout`: for a request whose work the broker does while it answers (and stops where a
        client that gave up cut it), longer than the client's default."""
        return await self.request("DELETE", path, ok404=ok404, timeout=timeout)


def amqp_login(cluster: RabbitCluster) -> tuple[str, str] | None:
    """ferry's (user, password) for an AMQP PLAIN login to `cluster`; None when its client
    certificate logs in (``x509_login``, SASL EXTERNAL)."""
    if cluster.x509_login:
        return None
    creds = cluster.credentials
    return (creds.user if creds else None) or "guest", (creds.password() if creds else None) or "guest"


def amqp_uri(topo: Topology, target: str, vhost: str, *, dialer: str) -> str:
    """The URI by which a node of cluster `dialer` reaches cluster `target`'s first broker in
    `vhost` (a shovel's destination, a federation upstream), with ferry's credentials there. To an
    ``amqps://`` broker it carries the TLS files of the dialer's ``outbound_tls`` (paths on the
    dialer's nodes) and ``verify=verify_peer``. It carries the password: never print it."""
    cluster = topo.rabbitmq(target)
    parts = urlsplit(cluster.brokers[0].url)
    query, tls = "", None
    if parts.scheme == "amqps":  # without cacertfile and verify_peer RabbitMQ would dial it unverified: refuse
        tls = topo.rabbitmq(dialer).outbound_tls
        if tls is None:
            raise ConfigError(
                f"{dialer}: its shovels and federation links to {target}'s amqps:// broker need the CA file on "
                f"{dialer}'s nodes: give cluster {dialer!r} an outbound_tls block (ca_file, and cert_file + "
                f"key_file if {target} asks for a client certificate)"
            )
        files = {"cacertfile": tls.ca_file, "certfile": tls.cert_file, "keyfile": tls.key_file}
        # the node checks the certificate against the URI's host (an IP address against the
        # certificate's IP names), or against server_name_indication (a DNS name) when given
        given = {**files, "server_name_indication": tls.server_name}
        query = "?" + "&".join([f"{k}={quote(v, safe='/')}" for k, v in given.items() if v] + ["verify=verify_peer"])
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname  # IPv6
    login = amqp_login(cluster)
    if login is None:  # the dialling node's certificate logs in: no password in the URI
        if not (tls and tls.cert_file):
            raise ConfigError(
                f"{dialer}: {target} takes certificate logins only (x509_login): give {dialer}'s outbound_tls "
                "a cert_file and key_file (on its nodes)"
            )
        return f"{parts.scheme}://{host}:{parts.port}/{q(vhost)}{query}&auth_mechanism=external"
    user, password = (quote(x, safe="") for x in login)
    return f"{parts.scheme}://{user}:{password}@{host}:{parts.port}/{q(vhost)}{query}"


async def amqp_connect(
    cluster: RabbitCluster,
    broker: RabbitBroker | None = None,
    *,
    vhost: str = "/",
    timeout: float = 5.0,
    robust: bool = False,
    name: str = "ferry",
) -> aio_pika.abc.AbstractConnection:
    """An AMQP connection to one broker of `cluster` (the first by default)."""
    broker = broker or cluster.brokers[0]
    parts = urlsplit(broker.url)
    with needed_by(broker.name):
        ctx, login = tls_context(cluster, broker), amqp_login(cluster)
    kwargs: dict[str, Any] = {
        "host": parts.hostname,
        "port": parts.port,
        "virtualhost": vhost,
        "ssl": parts.scheme == "amqps",
        "ssl_context": ctx,
        "timeout": timeout,
        "client_properties": {"connection_name": name},
    }
    if login is None:  # SASL EXTERNAL: the client certificate is the login
        kwargs["auth"] = "external"
    else:
        kwargs["login"], kwargs["password"] = login
    connect = aio_pika.connect_robust if robust else aio_pika.connect
    try:
        return await asyncio.wait_for(connect(**kwargs), timeout + 1)
    except aiormq.exceptions.ProbableAuthenticationError:
        who = f"user {login[0]!r}" if login else "the client certificate (x509_login)"
        raise AuthError(f"{broker.name}: AMQP login refused for {who}") from None
    except aiormq.exceptions.InvalidFrameError as exc:
        # the broker closed the handshake: most often the vhost is missing or not permitted
        reply = getattr(exc.args[0] if exc.args else None, "reply_text", None) or _close_reply(exc)
        if reply and "vhost" in reply:
            raise AuthError(f"{broker.name}: {reply.split(' - ', 1)[-1]}") from None
        raise BrokerUnavailable(f"{broker.name}: AMQP handshake refused ({reply or exc})") from None
    except (aiormq.exceptions.AMQPConnectionError, OSError, TimeoutError) as exc:
        text = str(exc)
        if "access" in text.lower() and "vhost" in text.lower():
            raise NotFound(f"{broker.name}: vhost {vhost!r} does not exist or is not permitted") from None
        reset = any(isinstance(e, ConnectionResetError) for e in (exc, exc.__cause__, exc.__context__))
        why = tls_cause(exc) or certificate_hint(cluster, broker, reset)
        raise BrokerUnavailable(
            f"{broker.name}: AMQP {parts.hostname}:{parts.port} not answering ({why or type(exc).__name__})"
        ) from None


def certificate_hint(cluster: RabbitCluster, broker: RabbitBroker, reset: bool) -> str | None:
    """Why an amqps connection was `reset` in its handshake when ferry showed no client certificate:
    a broker that requires one rejects it with an alert that the reset often overtakes."""
    if reset and broker.url.startswith("amqps:") and not ((tls := broker_tls(cluster, broker)) and tls.cert_file):
        return "reset in the TLS handshake: does the broker require a client certificate? (tls.cert_file and key_file)"
    return None


def tls_context(cluster: RabbitCluster, broker: RabbitBroker | None = None) -> ssl.SSLContext | None:
    """The TLS context of a broker's ``amqps://`` and ``https://`` endpoints (default: the
    cluster's first broker): from its cluster's ``tls`` block with the broker's own over it (a
    private CA, a client certificate), else None (the system's CAs)."""
    tls = broker_tls(cluster, broker)
    return tls.context() if tls else None


def _close_reply(exc: BaseException) -> str | None:
    frame = getattr(exc, "frame", None) or next((a for a in exc.args if hasattr(a, "reply_text")), None)
    return getattr(frame, "reply_text", None)


async def probe(name: str, cluster: RabbitCluster) -> list[Probe]:
    """Every endpoint of every broker: AMQP, management API, MQTT."""

    async def amqp(b: RabbitBroker) -> Answer:
        conn = await amqp_connect(cluster, b, timeout=3)
        props = conn.transport.connection.server_properties if conn.transport else {}
        await conn.close()
        ctx = tls_context(cluster, b) or ssl.create_default_context()
        tls = await tls_session(b.url, ctx) if b.url.startswith("amqps:") else None
        return Answer(f"RabbitMQ {props.get('version', '?')}", tls)

    async def management(b: RabbitBroker) -> Answer:
        async with Management(cluster, b, name=b.name, timeout=3) as m:
            ov = await m.get("/overview")
            me = await m.get("/whoami")
        tags = me.get("tags") or []
        tags = ",".join(tags) if isinstance(tags, list) else str(tags)
        identity = f"user {me.get('name')} (tags {tags or '-'})"
        ctx = tls_context(cluster, b) or ssl.create_default_context()
        tls = await tls_session(b.management_url, ctx) if b.management_url.startswith("https:") else None
        return Answer(f"{ov.get('node')} cluster {ov.get('cluster_name')}", tls, identity)

    async def mqtt(b: RabbitBroker) -> Answer:
        creds = cluster.credentials
        login = (creds.user, creds.password()) if creds else (None, None)
        return await mqtt_probe(b.mqtt_url or "", *login, tls=tls_context(cluster, b))

    checks = []
    for b in cluster.brokers:
        checks.append(timed_probe(name, b.name, "client", b.url, amqp(b)))
        checks.append(timed_probe(name, b.name, "management", b.management_url, management(b)))
        if b.mqtt_url:
            checks.append(timed_probe(name, b.name, "mqtt", b.mqtt_url, mqtt(b)))
    return list(await asyncio.gather(*checks))


FEDERATION_KEYS = ("federation-upstream", "federation-upstream-set")  # a policy's keys that federate a queue


def effective_policy(policies: list[dict[str, Any]], vhost: str, name: str) -> dict[str, Any] | None:
    """The policy RabbitMQ applies to queue `name`: the highest-priority one whose pattern matches.

    Computed from the policies rather than read from the queue listing, which
    shows a new policy only after the next statistics emission (seconds later).
    """
    matching = [
        p
        for p in policies
        if p["vhost"] == vhost and p.get("apply-to", "all") in ("all", "queues") and re.search(p["pattern"], name)
    ]
    return max(matching, key=lambda p: p.get("priority", 0), default=None)
