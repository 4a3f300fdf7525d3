"""What a secure lab is made of: a CA and certificates (``trustme``), and a NATS operator with its
accounts and users (``nats-jwt``), as production NATS deployments in operator mode have them.

Everything is written under the profile's directory: ``tls/`` (the CA, the servers' certificate
and key, a client certificate and key) and ``secrets/`` (``<account>.creds``: a user's JWT and
nkey seed, as ``nsc`` writes them; ``mqtt.jwt``: a bearer user JWT of the first account, allowed
MQTT connections only, which MQTT clients send as their password since they cannot sign the
server's nonce; mode 0600). The servers get the operator's JWT and, through a memory resolver,
every account's JWT.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from ferry.errors import ConfigError

# the accounts of a secure lab: two for applications (JetStream on), the system account
APP_ACCOUNTS = ("APP", "SALES")
SYS_ACCOUNT = "SYS"


@dataclass(frozen=True)
class Secure:
    tls_dir: Path
    operator_jwt: Path
    system_account: str  # its public key
    accounts: dict[str, str]  # public key -> account JWT (the resolver's preload)
    creds: dict[str, Path]  # account name -> a user's .creds file
    mqtt_jwt: Path  # a bearer user JWT of APP_ACCOUNTS[0] for MQTT clients (their password)

    @property
    def ca(self) -> Path:
        return self.tls_dir / "ca.pem"

    def server_tls(self) -> dict[str, object]:
        """A server's tls block: its certificate, the CA, and client certificates required."""
        d = self.tls_dir
        return {
            "cert_file": str(d / "server-cert.pem"),
            "key_file": str(d / "server-key.pem"),
            "ca_file": str(self.ca),
            "verify": True,
            "timeout": 5,
        }

    def client_tls(self) -> dict[str, str]:
        """The topology's tls block for ferry (mutual TLS)."""
        d = self.tls_dir
        return {"ca_file": str(self.ca), "cert_file": str(d / "client-cert.pem"), "key_file": str(d / "client-key.pem")}


def client_context(tls_dir: str) -> ssl.SSLContext | bool:
    """How the lab's own checks reach a server of a secure lab (its CA, the client certificate);
    True (the system's CAs) for a lab that is not secure."""
    if not tls_dir:
        return True
    d = Path(tls_dir)
    ctx = ssl.create_default_context(cafile=str(d / "ca.pem"))
    ctx.load_cert_chain(str(d / "client-cert.pem"), str(d / "client-key.pem"))
    return ctx


def creds_file(secrets: Path, account: str) -> Path:
    """Where a secure lab keeps the .creds file of its user in `account` (under ``secrets/``)."""
    return secrets / f"{account.lower()}.creds"


def make(pdir: Path) -> Secure:
    """A CA, certificates for 127.0.0.1, an operator, its accounts and one user in each."""
    try:
        import trustme
        from nats_jwt.nkeys_ext.nkeys2 import create_operator_pair
        from nats_jwt.v2.operator_claims import OperatorClaims
        from nats_jwt.v2.snippets import Operator
    except ImportError as exc:
        raise ConfigError(f"a secure lab needs {exc.name}", hint="pip install 'ferry-mq[lab]'") from None

    tls_dir, sdir = pdir / "tls", pdir / "secrets"
    tls_dir.mkdir(exist_ok=True)
    sdir.mkdir(mode=0o700, exist_ok=True)
    ca = trustme.CA(organization_name="ferry lab")
    ca.cert_pem.write_to_path(str(tls_dir / "ca.pem"))
    for who, names in (("server", ("127.0.0.1", "localhost")), ("client", ("ferry",))):
        cert = ca.issue_cert(*names, common_name=names[0])
        cert.private_key_pem.write_to_path(str(tls_dir / f"{who}-key.pem"))
        cert.cert_chain_pems[0].write_to_path(str(tls_dir / f"{who}-cert.pem"))
        (tls_dir / f"{who}-key.pem").chmod(0o600)
    # HAProxy's health checks read the client key beside its certificate (`<crt>.key`)
    key = tls_dir / "client-cert.pem.key"
    key.write_bytes((tls_dir / "client-key.pem").read_bytes())
    key.chmod(0o600)

    pair = create_operator_pair()
    operator = Operator(claims=OperatorClaims(pair.public_key.decode(), "ferry-lab"), seed=pair.seed)
    accounts, creds, system = {}, {}, ""
    for name in (*APP_ACCOUNTS, SYS_ACCOUNT):
        account = operator.create_account(name)
        if name == SYS_ACCOUNT:
            system = operator.claims.nats.system_account = account.claims.sub
        else:
            limits = account.claims.nats.limits
            limits.memory_storage = limits.disk_storage = limits.streams = limits.consumer = -1
        user = account.create_user("ferry")
        path = creds_file(sdir, name)
        path.write_text(
            f"-----BEGIN NATS USER JWT-----\n{user.jwt}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{user.key_pair.seed.decode()}\n------END USER NKEY SEED------\n"
        )
        path.chmod(0o600)
        if name == APP_ACCOUNTS[0]:
            mqtt = account.create_user("mqtt")
            mqtt.claims.nats.bearer_token = True
            mqtt.claims.nats.allowed_connection_types = ["MQTT"]
            (sdir / "mqtt.jwt").write_text(mqtt.jwt + "\n")
            (sdir / "mqtt.jwt").chmod(0o600)
        accounts[account.claims.sub], creds[name] = account.jwt, path
    (pdir / "operator.jwt").write_text(operator.jwt)
    return Secure(tls_dir, pdir / "operator.jwt", system, accounts, creds, sdir / "mqtt.jwt")
