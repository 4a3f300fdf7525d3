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
from ferry.errors import ConfigError
from ferry.topology import Credentials, NatsCluster

__all__ = ["client_options", "connect_fields", "jwt_expired", "tls_context", "tls_error"]


def tls_context(cluster: NatsCluster) -> ssl.SSLContext | None:
    """The TLS context for `cluster`: from its ``tls`` block, else a default verifying one when
    its URLs say ``tls://``, else None (plaintext, unless a server asks for TLS: then the
    default)."""
    if cluster.tls:
        return cluster.tls.context()
    if any(urlsplit(u).scheme == "tls" for u in cluster.urls):
        return ssl.create_default_context()
    return None


def client_options(cluster: NatsCluster, creds: Credentials | None) -> dict[str, Any]:
    """nats-py's connect() options for these credentials and the cluster's TLS."""
    options: dict[str, Any] = {}
    if ctx := tls_context(cluster):
        options["tls"] = ctx
        if cluster.tls and cluster.tls.server_name:
            options["tls_hostname"] = cluster.tls.server_name
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
        raise ConfigError(f"credentials: {problem}")
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


def jwt_expired(creds: Credentials | None) -> str | None:
    """When the user JWT of a .creds file has expired: its expiry (``YYYY-MM-DD HH:MM UTC``), else
    None. The server only says "authorization violation"; this says why."""
    if creds is None or not creds.creds_file:
        return None
    try:
        claims = creds.creds_file.read_bytes().split(b"BEGIN NATS USER JWT-----", 1)[1].split()[0].split(b".")[1]
        exp = json.loads(base64.urlsafe_b64decode(claims + b"=" * (-len(claims) % 4))).get("exp")
    except (IndexError, ValueError, OSError):
        return None
    if not exp or exp > time.time():
        return None
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(exp))
