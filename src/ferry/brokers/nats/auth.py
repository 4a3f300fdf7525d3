"""Who ferry is on a NATS server and how it reaches it: the topology's credentials and TLS block
turned into nats-py's connect options (the control plane) and into the fields of the CONNECT
line the data plane's own client (:mod:`ferry.brokers.nats.wire`) sends.

Secrets are read when a connection is made and go nowhere else: not into messages, which name a
credential by where it lives (:attr:`Credentials.identity`), nor into anything kept.
"""

from __future__ import annotations

import base64
import json
import ssl
import time
from typing import Any
from urllib.parse import urlsplit

from ferry.brokers.base import tls_error
from ferry.errors import ConfigError, Unreadable
from ferry.topology import Credentials, NatsBroker, NatsCluster, Tls, broker_tls

__all__ = [
    "broker_at",
    "client_options",
    "connect_fields",
    "jwt_claims",
    "jwt_expired",
    "jwt_revoked",
    "server_name",
    "tls_context",
    "tls_error",
    "tls_for",
    "tls_groups",
]


def broker_at(cluster: NatsCluster, url: str) -> NatsBroker | None:
    """The topology's broker whose client or monitoring URL has `url`'s host and port."""
    at = urlsplit(url)
    for b in cluster.brokers:
        for mine in filter(None, (b.url, b.monitor_url)):
            if (urlsplit(mine).hostname, urlsplit(mine).port) == (at.hostname, at.port):
                return b
    return None


def tls_for(cluster: NatsCluster, url: str | None = None) -> Tls | None:
    """The TLS block ferry dials `url` with (default: the cluster's first broker): the cluster's,
    with the broker's own fields over it (a URL of no broker, say a load balancer's: the cluster's)."""
    if url is None:
        return broker_tls(cluster)
    broker = broker_at(cluster, url)
    return broker_tls(cluster, broker) if broker else cluster.tls


def server_name(cluster: NatsCluster, url: str | None = None) -> str | None:
    """The name the certificate at `url` must carry, when it is not the host dialled (its TLS block's
    ``server_name``), else None."""
    tls = tls_for(cluster, url)
    return tls.server_name if tls else None


def tls_context(cluster: NatsCluster, url: str | None = None) -> ssl.SSLContext | None:
    """The TLS context for dialling `url` (default: the cluster's first broker): from its TLS block
    (:func:`tls_for`), else a default verifying one when the cluster's URLs say ``tls://``, else
    None (plaintext, unless a server asks for TLS: then the default)."""
    if tls := tls_for(cluster, url):
        return tls.context()
    if any(urlsplit(u).scheme == "tls" for u in cluster.urls):
        return ssl.create_default_context()
    return None


def tls_groups(cluster: NatsCluster, urls: list[str]) -> list[list[str]]:
    """`urls` in groups that take the same TLS settings, in order: nats-py dials every server of a
    connection with one context and one ``tls_hostname``."""
    groups: dict[Tls | None, list[str]] = {}
    for url in urls:
        groups.setdefault(tls_for(cluster, url), []).append(url)
    return list(groups.values())


def client_options(cluster: NatsCluster, creds: Credentials | None, url: str | None = None) -> dict[str, Any]:
    """nats-py's connect() options for these credentials and the TLS of the broker at `url`
    (default: the cluster's first)."""
    options: dict[str, Any] = {}
    if ctx := tls_context(cluster, url):
        options["tls"] = ctx
        if name := server_name(cluster, url):
            options["tls_hostname"] = name
    if creds is None:
        return options
    if creds.user:
        options["user"], options["password"] = creds.user, creds.password()
    elif creds.creds_file:
        _key(creds)[1].wipe()  # readable and well-formed: nats-py would fail with a traceback
        options["user_credentials"] = str(creds.creds_file)
    elif creds.nkey_seed_file:
        _key(creds)[1].wipe()
        options["nkeys_seed"] = str(creds.nkey_seed_file)
    else:
        options["token"] = creds.token()
    return options


def connect_fields(creds: Credentials | None, nonce: str) -> dict[str, Any]:
    """The CONNECT fields that authenticate `creds`, signing the server's `nonce` with an nkey."""
    if creds is None:
        return {}
    if creds.user:
        return {"user": creds.user, "pass": creds.password()}
    if creds.token_env or creds.token_file:
        return {"auth_token": creds.token()}
    jwt, key = _key(creds)
    try:
        sig = base64.b64encode(key.sign(nonce.encode())).decode()
        return {"jwt": jwt, "sig": sig} if jwt else {"nkey": key.public_key.decode(), "sig": sig}
    finally:
        key.wipe()


def _key(creds: Credentials) -> tuple[str | None, Any]:
    """The user JWT (None for a bare nkey) and the nkey pair of a .creds or seed file."""
    import nkeys

    if problem := creds.missing():
        raise Unreadable(f"credentials: {problem}")
    if creds.creds_file:
        jwt, seed = _read_creds(creds)
    else:
        jwt, seed = None, creds.nkey_seed_file.read_bytes().strip()  # type: ignore[union-attr]
    try:
        return jwt, nkeys.from_seed(bytearray(seed))
    except Exception:
        raise ConfigError(f"credentials: {creds.identity} holds no valid nkey seed") from None


def _read_creds(creds: Credentials) -> tuple[str, bytes]:
    """A .creds file's user JWT and nkey seed (the blocks ``nsc`` writes)."""
    lines = creds.creds_file.read_bytes().splitlines()  # type: ignore[union-attr]
    found: dict[bytes, bytes] = {}
    for i, line in enumerate(lines[:-1]):
        for marker in (b"BEGIN NATS USER JWT", b"BEGIN USER NKEY SEED"):
            if marker in line:
                found[marker] = lines[i + 1].strip()
    if len(found) != 2 or not all(found.values()):
        raise ConfigError(f"credentials: {creds.identity} is not a NATS .creds file (a user JWT and an nkey seed)")
    return found[b"BEGIN NATS USER JWT"].decode(), found[b"BEGIN USER NKEY SEED"]


def jwt_claims(creds: Credentials | None) -> dict[str, Any] | None:
    """The claims of a .creds file's user JWT (public: who, issued and expires when; the seed is
    not read), else None."""
    if creds is None or not creds.creds_file:
        return None
    try:
        claims = creds.creds_file.read_bytes().split(b"BEGIN NATS USER JWT-----", 1)[1].split()[0].split(b".")[1]
        return json.loads(base64.urlsafe_b64decode(claims + b"=" * (-len(claims) % 4)))  # type: ignore[no-any-return]
    except (IndexError, ValueError, OSError):
        return None


def jwt_expired(creds: Credentials | None) -> str | None:
    """When the user JWT of a .creds file has expired: its expiry (``YYYY-MM-DD HH:MM UTC``), else
    None. The server only says "authorization violation"; this says why."""
    exp = (jwt_claims(creds) or {}).get("exp")
    if not exp or exp > time.time():
        return None
    return _utc(exp)


def jwt_revoked(user: dict[str, Any], account: dict[str, Any]) -> str | None:
    """When `account` (its JWT's claims, as the server's account info decodes them) revoked the
    user JWT whose claims are `user` (``YYYY-MM-DD HH:MM UTC``), else None. A revocation at T
    invalidates the user's JWTs issued at or before T; ``*`` stands for every user."""
    revocations = (account.get("nats") or {}).get("revocations") or {}
    at = max(revocations.get(user.get("sub"), 0), revocations.get("*", 0))
    return _utc(at) if at and user.get("iat", 0) <= at else None


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))
