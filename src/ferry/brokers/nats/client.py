"""NATS / JetStream adapter.

Features: client connections with bounded connect and error mapping, the
system account (server requests, CANCEL_MOVE, KICK), the monitoring endpoint
(varz, jsz, connz), JetStream admin and KV through nats-py.

Connection string: ``nats://host:4222`` (or ``tls://``) per broker in the topology;
who ferry is comes from the cluster's ``credentials`` (``system_credentials`` for
the system account): a user and password, a .creds file, an nkey seed or a token,
over TLS as the cluster's ``tls`` block says (:mod:`ferry.brokers.nats.auth`).

Options: ``timeout`` bounds the first connect (nats-py alone retries forever);
after that the client reconnects on its own, which an operation that outlives
a server restart needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
import nats
from nats.aio.client import Client
from nats.errors import AuthorizationError, NoRespondersError, NoServersError
from nats.errors import TimeoutError as NatsTimeout

from ferry.brokers.base import (
    Answer,
    BrokerKind,
    Probe,
    expiry_warnings,
    mqtt_probe,
    needed_by,
    timed_probe,
    tls_cause,
    tls_session,
)
from ferry.brokers.nats import auth
from ferry.errors import AuthError, BrokerUnavailable, ConfigError, FerryError, Forbidden, redact
from ferry.topology import Credentials, NatsBroker, NatsCluster

__all__ = ["Nats", "connect", "monitor_get", "probe", "refused", "session", "sys_request", "while_electing"]

# the permission violations each client was sent (the server sends no reply to a publish it refuses,
# only this, and goes on): a request that times out tells from them that it was refused
_DENIED: weakref.WeakKeyDictionary[Client, deque[str]] = weakref.WeakKeyDictionary()
_WHO: weakref.WeakKeyDictionary[Client, str] = weakref.WeakKeyDictionary()  # "cluster 'east' as creds file ..."
DENIALS: deque[str] = deque(maxlen=10)  # every client's, for a timeout that reaches the CLI without its client


class Nats(BrokerKind):
    kind = "nats"
    capabilities = frozenset({"replay", "msg-id-dedup", "system-account", "mqtt", "kv"})
    retryable = (BrokerUnavailable, NatsTimeout, NoServersError, ConnectionError)

    @classmethod
    def translate(cls, exc: BaseException) -> FerryError | None:
        if isinstance(exc, TimeoutError) and DENIALS:  # a request the server refused goes unanswered
            return Forbidden(f"a broker did not answer in time; the server had refused ferry's user: {DENIALS[-1]}")
        if not type(exc).__module__.startswith("nats."):
            return None
        if isinstance(exc, TimeoutError):
            return None  # said the same way for every kind
        if type(exc).__name__ == "ServiceUnavailableError":  # a 503 (no responders) has no description
            return BrokerUnavailable(
                "JetStream did not take a request (503: no responders; its API or a stream's leader was "
                "unavailable, as during an election): try again"
            )
        text = getattr(exc, "description", None) or str(exc) or type(exc).__name__
        if _is_auth(exc):
            return AuthError(text.splitlines()[0])
        return FerryError(text.splitlines()[0])


def _is_auth(err: BaseException | None) -> bool:
    return isinstance(err, AuthorizationError) or "authorization" in str(err).lower()


async def connect(
    cluster: NatsCluster,
    *,
    name: str = "",
    system: bool = False,
    urls: list[str] | None = None,
    timeout: float = 5.0,
    **options: Any,
) -> Client:
    """A connected client for `cluster` (system account if `system`)."""
    creds = cluster.system_credentials if system else cluster.credentials
    if system and creds is None:
        raise ConfigError(f"cluster {name!r} has no system_credentials in the topology")
    errors: deque[BaseException] = deque(maxlen=20)  # all, not the last: a refused server closes at once,
    denied: deque[str] = deque(maxlen=100)  # so the next attempt's connection reset may follow its -ERR

    servers = urls or cluster.urls
    if len(groups := auth.tls_groups(cluster, servers)) > 1:  # brokers with TLS settings of their own
        failed: BrokerUnavailable | None = None
        for group in groups:  # the first group that answers (a refused login is not tried again)
            try:
                return await connect(cluster, name=name, system=system, urls=group, timeout=timeout, **options)
            except BrokerUnavailable as exc:
                failed = exc
        raise failed  # type: ignore[misc]
    # a failed TLS handshake: nats-py reports the first one only and then waits out the timeout
    refused_tls = asyncio.Event()

    async def on_error(exc: Exception) -> None:
        errors.append(exc)
        if auth.tls_error(exc):
            refused_tls.set()
        if "permissions violation" in str(exc).lower():  # nats-py lowercases what the server said
            denied.append(str(exc))
            DENIALS.append(str(exc).removeprefix("nats: "))

    kwargs: dict[str, Any] = {
        "servers": servers,
        "name": options.pop("client_name", "ferry"),
        "connect_timeout": 2,
        "reconnect_time_wait": 0.25,
        "max_reconnect_attempts": -1,
        "error_cb": on_error,
        **options,
    }
    who = f"cluster {name!r}" if name else f"NATS at {redact(servers[0])}"
    broker = next((b.name for b in cluster.brokers if b.url == servers[0]), None)
    with needed_by(f"{who} ({broker})" if broker else who):
        kwargs |= auth.client_options(cluster, creds, servers[0])
    if "tls" in kwargs:
        await _refuse_plaintext(who, servers, timeout)
    try:
        nc = await _first(nats.connect(**kwargs), refused_tls, timeout)
        _DENIED[nc] = denied
        _WHO[nc] = f"{who} as {creds.identity if creds else 'no user'}"
        return nc
    except (TimeoutError, NoServersError, OSError, nats.errors.Error) as exc:
        cause = errors[-1] if errors else exc
        if _is_auth(exc) or any(_is_auth(e) for e in errors):
            if expired := auth.jwt_expired(creds):
                raise AuthError(f"{who}: the user JWT in {creds.identity} expired on {expired}") from None  # type: ignore[union-attr]
            if not system and (revoked := await _revoked(cluster, creds, servers, timeout)):
                raise AuthError(f"{who}: the user JWT in {creds.identity} was {revoked}") from None  # type: ignore[union-attr]
            raise AuthError(
                f"{who}: authorization violation for {creds.identity if creds else 'no credentials'}"
            ) from None
        if tls := next(filter(None, map(auth.tls_error, [*errors, exc])), None):
            raise BrokerUnavailable(f"{who}: {', '.join(kwargs['servers'])}: {tls}") from None
        detail = f"{type(cause).__name__}: {cause}".rstrip(": ") if str(cause) else type(cause).__name__
        raise BrokerUnavailable(
            f"{who}: no server answered at {', '.join(kwargs['servers'])} within {timeout:.0f}s ({detail})"
        ) from None


async def _revoked(cluster: NatsCluster, creds: Credentials | None, servers: list[str], timeout: float) -> str | None:
    """Whether the account of a refused user JWT revoked it ("revoked by account APP at ..."), as
    the servers' account info says through the system account; None when that cannot be told
    (no system credentials, no answer, not revoked)."""
    user = auth.jwt_claims(creds)
    if not user or cluster.system_credentials is None:
        return None
    account = (user.get("nats") or {}).get("issuer_account") or user.get("iss")
    try:
        async with session(cluster, system=True, urls=servers, timeout=timeout) as nc:
            info = await sys_request(nc, f"$SYS.REQ.ACCOUNT.{account}.INFO", timeout=timeout)
    except (FerryError, OSError, nats.errors.Error, ValueError):
        return None
    claims = (info.get("data") or {}).get("decoded_jwt") or {}
    if revoked := auth.jwt_revoked(user, claims):
        return f"revoked by account {claims.get('name') or account} at {revoked}"
    return None


async def _refuse_plaintext(who: str, servers: list[str], timeout: float) -> None:
    """nats-py starts TLS only when the server requires it, and sends its CONNECT (the credentials)
    in plaintext to one that merely offers it, or does not speak it: when ferry asks for TLS, each
    server's INFO is read first, and one that does not require TLS is refused."""

    async def info(url: str) -> dict[str, Any] | None:
        parts = urlsplit(url)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(parts.hostname or "127.0.0.1", parts.port or 4222), timeout
            )
        except (OSError, TimeoutError):
            return None  # not answering: nats-py says so in its own words
        try:
            line = await asyncio.wait_for(reader.readline(), timeout)
            return json.loads(line[5:]) if line.startswith(b"INFO ") else None
        except (OSError, TimeoutError, ValueError):
            return None
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    for url, got in zip(servers, await asyncio.gather(*map(info, servers)), strict=True):
        if got is not None and not got.get("tls_required"):
            offered = "offers TLS but does not require it" if got.get("tls_available") else "does not speak TLS"
            raise ConfigError(f"{who}: {redact(url)}: TLS asked for, but the server {offered}; nothing was sent")


async def _first(connecting: Awaitable[Client], give_up: asyncio.Event, timeout: float) -> Client:
    """The connected client, or TimeoutError after `timeout` or as soon as `give_up` is set."""
    task, stop = asyncio.ensure_future(connecting), asyncio.ensure_future(give_up.wait())
    try:
        await asyncio.wait({task, stop}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise TimeoutError
    return task.result()


@contextlib.asynccontextmanager
async def session(cluster: NatsCluster, **kwargs: Any) -> AsyncIterator[Client]:
    nc = await connect(cluster, **kwargs)
    try:
        yield nc
    except nats.js.errors.APIError as exc:
        raise jetstream_off(nc, exc.err_code) or exc from None
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


_JETSTREAM_OFF = 10039  # "JetStream not enabled for account"


def jetstream_off(nc: Client, err_code: int | None) -> ConfigError | None:
    """The error to raise when a JetStream API answered `err_code` 10039: the account `nc` is in
    has no JetStream (which account, and on which cluster), else None."""
    if err_code != _JETSTREAM_OFF:
        return None
    return ConfigError(f"{_WHO.get(nc, 'NATS')}: JetStream is not enabled for this account (err_code 10039)")


def refused(nc: Any, subject: str) -> AuthError | None:
    """The error to raise when the server refused `nc`'s publish to `subject`, or the subscription
    to its inbox, where replies come (a request then just goes unanswered), else None. `nc`: a
    nats-py client from :func:`connect`, or the data plane's ``Wire`` (its ``denied``)."""
    said = " ".join(getattr(nc, "denied", None) or _DENIED.get(nc, ())).lower()
    if f'publish to "{subject.lower()}"' in said:
        return Forbidden(f"the server refused ferry's user to publish to {subject} (permissions violation)")
    if 'subscription to "_inbox.' in said:
        return Forbidden(
            f"no answer to {subject}: the server refused ferry's user to subscribe to its inbox, where "
            "replies come (permissions violation; allow it to subscribe to _INBOX.>)"
        )
    return None


async def while_electing(
    call: Callable[[], Awaitable[Any]], within: float = 30.0, nc: Client | None = None, subject: str = ""
) -> Any:
    """`call` a stream's API (or write to it), again while the stream elects a leader (its leader
    stepped down or died: no responder, unavailable, or no answer in time), for at most `within`
    seconds. A write that timed out may have been stored after all: the caller must tell. Given
    the client and the subject `call` publishes to, a refused publish fails at its first timeout."""
    from nats.errors import NoRespondersError
    from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

    deadline = asyncio.get_running_loop().time() + within
    while True:
        try:
            return await call()
        except (NoStreamResponseError, NoRespondersError, ServiceUnavailableError, NatsTimeout):
            if nc is not None and (denial := refused(nc, subject)):
                raise denial from None
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.5)


async def sys_request(nc: Client, subject: str, payload: dict | bytes = b"", timeout: float = 5.0) -> dict:
    """A request on the system account (or a $JS.API request) answered with JSON."""
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    try:
        msg = await nc.request(subject, data, timeout=timeout)
    except NatsTimeout:
        raise refused(nc, subject) or BrokerUnavailable(f"no answer to {subject} within {timeout:.0f}s") from None
    return json.loads(msg.data) if msg.data else {}


async def monitor_get(
    url: str, path: str, timeout: float = 5.0, tls: ssl.SSLContext | None = None, **params: Any
) -> Any:
    """GET a monitoring endpoint (varz, jsz, connz, healthz ...) as JSON; over HTTPS verified with
    `tls` (the cluster's context, :func:`auth.tls_context`), else the system's CAs."""
    try:
        async with httpx.AsyncClient(timeout=timeout, verify=tls or True) as client:
            r = await client.get(f"{url}/{path.lstrip('/')}", params=params)
    except httpx.HTTPError as exc:
        why = tls_cause(exc)
        raise BrokerUnavailable(f"monitoring endpoint {url} not answering ({why or type(exc).__name__})") from None
    if r.status_code >= 400 and path.startswith("healthz"):
        raise BrokerUnavailable(f"{url}/{path}: {r.status_code} {r.text.strip()[:200]}")
    r.raise_for_status()
    return r.json()


async def probe(name: str, cluster: NatsCluster) -> list[Probe]:
    """Every endpoint of every broker: client (app account), system account, monitor, MQTT; for
    each the TLS session (version, certificate, expiry) and who the server says ferry is."""

    def tls_of(url: str) -> tuple[ssl.SSLContext | None, str | None]:
        return auth.tls_context(cluster, url), auth.server_name(cluster, url)

    async def client(url: str, system: bool) -> Answer:
        ctx, server_name = tls_of(url)
        async with session(
            cluster, name=name, urls=[url], system=system, timeout=3, max_reconnect_attempts=1, allow_reconnect=False
        ) as nc:
            info = nc._server_info
            identity, warnings = await _identity(nc)
        tls = None
        if ctx or info.get("tls_required"):
            tls = await tls_session(url, ctx or ssl.create_default_context(), server_name, clear_first_line=True)
        return Answer(f"{info.get('server_name', '?')} v{info.get('version', '?')}", tls, identity, warnings)

    async def monitor(url: str) -> Answer:
        ctx, server_name = tls_of(url)
        varz = await monitor_get(url, "varz", timeout=3, tls=ctx)
        js = "JetStream on" if varz.get("jetstream", {}).get("config") else "JetStream off"
        answer = Answer(f"{varz.get('server_name')} {varz.get('connections', 0)} conns, {js}")
        if url.startswith("https:"):
            answer.tls = await tls_session(url, ctx or ssl.create_default_context(), server_name)
        return answer

    async def mqtt(b: NatsBroker) -> Answer:
        ctx, server_name = tls_of(b.url)  # the broker's TLS settings
        creds = cluster.mqtt_credentials or cluster.credentials
        user, pw = None, None
        if creds and creds.user:
            user, pw = creds.user, creds.password()
        elif creds and (creds.token_env or creds.token_file):  # a bearer user JWT (operator mode)
            user, pw = "ferry", creds.token()
        return await mqtt_probe(b.mqtt_url or "", user, pw, tls=ctx, server_name=server_name)

    checks = []
    for b in cluster.brokers:
        checks.append(timed_probe(name, b.name, "client", b.url, client(b.url, False)))
        if cluster.system_credentials:
            checks.append(timed_probe(name, b.name, "system", b.url, client(b.url, True)))
        if b.monitor_url:
            checks.append(timed_probe(name, b.name, "monitor", b.monitor_url, monitor(b.monitor_url)))
        if b.mqtt_url:
            checks.append(timed_probe(name, b.name, "mqtt", b.mqtt_url, mqtt(b)))
    return list(await asyncio.gather(*checks))


async def _identity(nc: Client) -> tuple[str | None, list[str]]:
    """Who the server says `nc` is ("user ferry in account APP", from ``$SYS.REQ.USER.INFO``,
    nats-server 2.10 and later; None where it does not answer), and a warning when the user's
    JWT expires within a month."""
    try:
        data = (await sys_request(nc, "$SYS.REQ.USER.INFO", timeout=2)).get("data") or {}
    except (NoRespondersError, FerryError):
        return None, []
    user = data.get("user_name") or data.get("user") or "?"
    identity = f"user {user} in account {data.get('account_name') or data.get('account') or '?'}"
    expires = data.get("expires")  # nanoseconds left, for a user whose JWT expires
    if not expires:
        return identity, []
    left = int(expires / 86_400e9)
    until = time.strftime("%Y-%m-%d", time.gmtime(time.time() + expires / 1e9))
    return identity, expiry_warnings(f"the JWT of {identity}", left, until)


async def stream_add(
    cluster: NatsCluster,
    name: str,
    subjects: list[str],
    *,
    replicas: int = 3,
    placement: str | None = None,
    tags: list[str] | None = None,
    cluster_name: str = "",
    duplicate_window: float | None = None,
) -> dict:
    """Create a stream (placed in `placement` / on `tags`); refuses one that exists."""
    from nats.js.api import Placement, StreamConfig
    from nats.js.errors import APIError

    from ferry.errors import Conflict

    config = StreamConfig(
        name=name,
        subjects=subjects,
        num_replicas=replicas,
        placement=Placement(cluster=placement, tags=tags) if placement or tags else None,
        duplicate_window=duplicate_window,
    )
    async with session(cluster, name=cluster_name) as nc:
        jsm = nc.jsm()
        try:
            await jsm.stream_info(name)
            raise Conflict(f"stream {name!r} already exists", stream=name)
        except nats.js.errors.NotFoundError:
            pass
        try:
            info = await jsm.add_stream(config)
        except APIError as exc:  # refused: bad config, replicas on a server without a cluster...
            raise ConfigError(f"stream {name!r}: {exc.description or exc}") from None
    return _stream_summary(info)


async def stream_info(cluster: NatsCluster, name: str, cluster_name: str = "") -> dict:
    from ferry.errors import NotFound

    async with session(cluster, name=cluster_name) as nc:
        try:
            return _stream_summary(await nc.jsm().stream_info(name))
        except nats.js.errors.NotFoundError:
            raise NotFound(f"stream {name!r} not found", stream=name) from None


async def stream_delete(cluster: NatsCluster, name: str, cluster_name: str = "") -> None:
    from ferry.errors import NotFound

    async with session(cluster, name=cluster_name) as nc:
        try:
            await nc.jsm().delete_stream(name)
        except nats.js.errors.NotFoundError:
            raise NotFound(f"stream {name!r} not found", stream=name) from None


def leader_of(info: Any) -> str:
    """The server that leads a stream or consumer (nats-py's info), or "" when it has none."""
    return (info.cluster and info.cluster.leader) or ""


def _stream_summary(info: Any) -> dict:
    c = info.cluster
    return {
        "name": info.config.name,
        "subjects": info.config.subjects,
        "replicas": info.config.num_replicas,
        "cluster": c.name if c else None,
        "leader": c.leader if c else None,
        "peers": [r.name for r in (c.replicas or [])] if c else [],
        "messages": info.state.messages,
        "bytes": info.state.bytes,
        "first_seq": info.state.first_seq,
        "last_seq": info.state.last_seq,
    }
