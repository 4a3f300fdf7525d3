"""The topology file: sites -> clusters -> brokers.

Example::

    sites:
      lab:
        clusters:
          east:
            kind: nats
            credentials: {user: app, password_env: FERRY_EAST_PASSWORD}
            system_credentials: {user: sys, password_file: /run/secrets/sys}
            brokers:
              - {name: east-1, url: "nats://10.0.0.1:4222", monitor_url: "http://10.0.0.1:8222"}
      dr:
        clusters:
          ltm:
            kind: rabbitmq
            credentials: {user: ferry, password_env: FERRY_LTM_PASSWORD}
            # only for moving quorum queue leaders (ferry node evacuate / cluster rebalance):
            erlang: {cookie_file: /var/lib/rabbitmq/.erlang.cookie, epmd_port: 4369}
            brokers:
              - {name: ltm-1, url: "amqp://10.1.0.1:5672", management_url: "http://10.1.0.1:15672"}

Secrets are never inline: a credential names an environment variable
(``password_env``) or a file (``password_file``). Unknown keys are rejected and
every error names the file, the line and the key.
"""

from __future__ import annotations

import functools
import os
import re
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from ferry.errors import ConfigError, NotFound, Unreadable

__all__ = [
    "Credentials",
    "ErlangAccess",
    "NatsBroker",
    "NatsCluster",
    "OutboundTls",
    "RabbitBroker",
    "RabbitCluster",
    "Site",
    "Tls",
    "Topology",
    "broker_tls",
    "default_topology_path",
    "lab_root",
    "load_topology",
]

_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.@-]*$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _url(value: str, schemes: tuple[str, ...]) -> str:
    parts = urlsplit(value)
    if parts.password:
        raise ValueError("URL carries a password; use credentials.password_env or password_file instead")
    if parts.scheme not in schemes:
        raise ValueError(f"invalid URL {value!r}: scheme must be one of {', '.join(schemes)}")
    if not parts.hostname:
        raise ValueError(f"invalid URL {value!r}: no host")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"invalid URL {value!r}: bad port") from exc
    if port is None:
        raise ValueError(f"invalid URL {value!r}: no port")
    return value.rstrip("/")


class Credentials(_Model):
    """Who ferry is on a cluster and where its secret lives (never the secret itself), one of:

    - ``user`` with ``password_env`` or ``password_file`` (NATS and RabbitMQ);
    - ``creds_file``: a NATS user's JWT and nkey seed, as ``nsc`` writes them (operator mode);
    - ``nkey_seed_file``: a NATS nkey user's seed;
    - ``token_env`` or ``token_file``: a NATS token.
    """

    user: str | None = None
    password_env: str | None = None
    password_file: Path | None = None
    creds_file: Path | None = None
    nkey_seed_file: Path | None = None
    token_env: str | None = None
    token_file: Path | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Credentials:
        if self.password_env and self.password_file:
            raise ValueError("give password_env or password_file, not both")
        if self.token_env and self.token_file:
            raise ValueError("give token_env or token_file, not both")
        if (self.password_env or self.password_file) and not self.user:
            raise ValueError("a password needs its user")
        kinds = [k for k in ("user", "creds_file", "nkey_seed_file") if getattr(self, k)]
        kinds += ["token_env or token_file"] if self.token_env or self.token_file else []
        if len(kinds) != 1:
            raise ValueError(
                "give exactly one of user (with password_env or password_file), creds_file, nkey_seed_file, "
                f"token_env or token_file (got {' and '.join(kinds) if kinds else 'none'})"
            )
        return self

    @property
    def identity(self) -> str:
        """How this credential names itself in messages: no secret, only where it lives."""
        if self.user:
            return f"user {self.user!r}"
        if self.creds_file:
            return f"creds file {self.creds_file}"
        if self.nkey_seed_file:
            return f"nkey seed file {self.nkey_seed_file}"
        return f"token in {self.token_file or '$' + str(self.token_env)}"

    def missing(self) -> str | None:
        """Why the secret cannot be read, or None."""
        for env in (self.password_env, self.token_env):
            if env and env not in os.environ:
                return f"environment variable {env} is not set"
        for key in ("password_file", "creds_file", "nkey_seed_file", "token_file"):
            if problem := _unreadable(getattr(self, key)):
                return f"{key.replace('_file', '').replace('_', ' ')} file {problem}"
        return None

    def _read(self, env: str | None, file: Path | None) -> str | None:
        problem = self.missing()
        if problem:
            raise Unreadable(f"credentials: {problem}")
        if env:
            return os.environ[env]
        if file:
            return file.read_text().strip()
        return None

    def password(self) -> str | None:
        return self._read(self.password_env, self.password_file)

    def token(self) -> str | None:
        return self._read(self.token_env, self.token_file)


class Tls(_Model):
    """TLS to a cluster's brokers (every field optional): ``ca_file`` verifies the servers against a
    private CA (else the system's CAs), ``cert_file`` + ``key_file`` present a client certificate
    (mutual TLS), ``server_name`` is the name the servers' certificates carry when it is not the
    host dialled. Verification is never off."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None

    @model_validator(mode="after")
    def _pair(self) -> Tls:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("a client certificate needs both cert_file and key_file")
        return self

    def missing(self) -> str | None:
        for key in ("ca_file", "cert_file", "key_file"):
            if problem := _unreadable(getattr(self, key)):
                return f"tls.{key} {problem}"
        return None

    def context(self) -> ssl.SSLContext:
        """A client context that verifies the server (and presents the client certificate)."""
        return _tls_context(self)

    def over(self, base: Tls | None) -> Tls:
        """This block laid over `base` (a broker's over its cluster's): the fields it sets win."""
        if base is None:
            return self
        return Tls.model_validate(base.model_dump(exclude_none=True) | self.model_dump(exclude_none=True))


def broker_tls(cluster: NatsCluster | RabbitCluster, broker: NatsBroker | RabbitBroker | None = None) -> Tls | None:
    """The TLS settings ferry dials `broker` with (default: the cluster's first): the cluster's
    ``tls`` with the broker's own ``tls`` fields over it."""
    broker = broker or cluster.brokers[0]
    return broker.tls.over(cluster.tls) if broker.tls else cluster.tls


def _unreadable(path: Path | None) -> str | None:
    """Why `path` cannot be read (it does not exist, or is not readable), else None (None for no path)."""
    if path and not os.access(path, os.R_OK):
        return f"{path} {'is not readable' if path.exists() else 'does not exist'}"
    return None


@functools.cache
def _tls_context(tls: Tls) -> ssl.SSLContext:
    if problem := tls.missing():
        raise Unreadable(problem)
    try:
        ctx = ssl.create_default_context(cafile=str(tls.ca_file) if tls.ca_file else None)
    except ssl.SSLError as exc:
        raise ConfigError(f"tls.ca_file {tls.ca_file}: not a PEM certificate ({exc.reason})") from None
    if tls.cert_file:
        try:
            ctx.load_cert_chain(str(tls.cert_file), str(tls.key_file))
        except ssl.SSLError as exc:
            raise ConfigError(
                f"tls.cert_file {tls.cert_file} / key_file {tls.key_file}: not a matching PEM pair ({exc.reason})"
            ) from None
    return ctx


class NatsBroker(_Model):
    """A NATS server; its ``tls`` fields override its cluster's for this server (e.g. the
    ``server_name`` its own certificate carries)."""

    name: str = Field(pattern=_NAME)
    url: str
    monitor_url: str | None = None
    mqtt_url: str | None = None
    tls: Tls | None = None

    _v_url = field_validator("url")(lambda v: _url(v, ("nats", "tls")))
    _v_mon = field_validator("monitor_url")(lambda v: v and _url(v, ("http", "https")))
    _v_mqtt = field_validator("mqtt_url")(lambda v: v and _url(v, ("mqtt", "mqtts", "tcp")))


class RabbitBroker(_Model):
    """A RabbitMQ node; its ``tls`` fields override its cluster's for this node."""

    name: str = Field(pattern=_NAME)
    node: str | None = None
    url: str
    management_url: str
    mqtt_url: str | None = None
    tls: Tls | None = None

    _v_url = field_validator("url")(lambda v: _url(v, ("amqp", "amqps")))
    _v_mgmt = field_validator("management_url")(lambda v: _url(v, ("http", "https")))
    _v_mqtt = field_validator("mqtt_url")(lambda v: v and _url(v, ("mqtt", "mqtts", "tcp")))


def _unique_brokers(brokers: list[Any]) -> list[Any]:
    names = [b.name for b in brokers]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"duplicate broker name {dups[0]!r}")
    if not brokers:
        raise ValueError("a cluster needs at least one broker")
    return brokers


class NatsCluster(_Model):
    """A NATS cluster. ``credentials`` are ferry's user in the default account (where streams
    named without an account live); ``accounts`` names more: ``{SALES: {creds_file: ...}}``, a
    user in each other account whose streams ferry may work on (``jetstream://east/S?account=SALES``,
    ``--account SALES``). ``mqtt_credentials``: how ferry's MQTT probes log in when not as
    ``credentials``' user and password; in operator mode MQTT clients cannot sign the server's
    nonce and send a bearer user JWT as their password: ``{token_file: mqtt.jwt}``."""

    kind: Literal["nats"]
    brokers: list[NatsBroker]
    credentials: Credentials | None = None
    system_credentials: Credentials | None = None
    accounts: dict[str, Credentials] = Field(default_factory=dict)
    mqtt_credentials: Credentials | None = None
    tls: Tls | None = None

    _v_brokers = field_validator("brokers")(_unique_brokers)

    @field_validator("accounts")
    @classmethod
    def _account_names(cls, accounts: dict[str, Credentials]) -> dict[str, Credentials]:
        for name in accounts:
            if not name or any(c.isspace() or c in "?&=/" for c in name):
                raise ValueError(f"bad account name {name!r}")
        return accounts

    @property
    def urls(self) -> list[str]:
        return [b.url for b in self.brokers]

    def in_account(self, account: str | None, cluster_name: str = "") -> NatsCluster:
        """This cluster as ferry's user in `account` sees it (None: the default account's
        ``credentials``); one line naming the accounts the topology has when it has not this one."""
        if account is None:
            return self
        if account not in self.accounts:
            known = ", ".join(sorted(self.accounts)) or "none"
            where = f"cluster {cluster_name!r}"
            raise ConfigError(f"{where} has no account {account!r} in the topology (accounts: {known})")
        return self.model_copy(update={"credentials": self.accounts[account]})


class ErlangAccess(_Model):
    """How ferry reaches a RabbitMQ cluster's nodes with the Erlang CLI tools (``rabbitmqctl``,
    ``rabbitmq-upgrade``), needed only to move quorum queue leaders during an evacuation or a
    rebalance: where the Erlang cookie lives (never inline) and epmd's port."""

    cookie_env: str | None = None
    cookie_file: Path | None = None
    epmd_port: int = Field(4369, gt=0, lt=65536)

    @model_validator(mode="after")
    def _one_source(self) -> ErlangAccess:
        if bool(self.cookie_env) == bool(self.cookie_file):
            raise ValueError("give cookie_env or cookie_file (exactly one)")
        return self

    def cookie(self) -> str:
        if self.cookie_env:
            if self.cookie_env not in os.environ:
                raise ConfigError(f"Erlang cookie: environment variable {self.cookie_env} is not set")
            return os.environ[self.cookie_env]
        try:
            return self.cookie_file.read_text().strip()  # type: ignore[union-attr]
        except OSError as exc:
            raise ConfigError(f"Erlang cookie file {self.cookie_file}: {exc.strerror}") from None


class OutboundTls(_Model):
    """Files on a RabbitMQ cluster's own nodes (paths on the broker hosts, never read by ferry)
    that its shovels and federation links use to dial an ``amqps://`` broker: ``ca_file`` verifies
    the broker dialled (``verify_peer``, against its URL's host), ``cert_file`` + ``key_file``
    show the node's client certificate, ``server_name`` is the DNS name the dialled broker's
    certificate carries when it is not the URL's host (sent as SNI and checked instead). Written
    into the URIs as RabbitMQ's ``cacertfile``, ``certfile``, ``keyfile`` and
    ``server_name_indication`` query parameters."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    @model_validator(mode="after")
    def _check(self) -> OutboundTls:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("a client certificate needs both cert_file and key_file")
        for key in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, key)
            if path is not None and not path.startswith("/"):
                raise ValueError(f"{key} must be an absolute path on the broker hosts, got {path!r}")
        return self


class RabbitCluster(_Model):
    """A RabbitMQ cluster. ``tls`` verifies its ``amqps://`` and ``https://`` endpoints against a
    private CA and shows a client certificate (the servers are verified against the host of each
    URL: ``server_name`` is for NATS clusters). ``outbound_tls``: what its own nodes use when a
    shovel or federation link of theirs dials an ``amqps://`` broker. ``x509_login``: AMQP logins
    to this cluster (ferry's, and the shovels' and federation links' ferry writes) show the client
    certificate instead of a password (SASL EXTERNAL: the brokers run
    ``rabbitmq_auth_mechanism_ssl`` and name the user after the certificate); the management API
    still takes ``credentials``."""

    kind: Literal["rabbitmq"]
    brokers: list[RabbitBroker]
    credentials: Credentials | None = None
    tls: Tls | None = None
    outbound_tls: OutboundTls | None = None
    x509_login: bool = False
    erlang: ErlangAccess | None = None

    _v_brokers = field_validator("brokers")(_unique_brokers)

    @model_validator(mode="after")
    def _x509(self) -> RabbitCluster:
        if self.x509_login and not all((t := broker_tls(self, b)) and t.cert_file for b in self.brokers):
            raise ValueError("x509_login needs a client certificate: tls.cert_file and tls.key_file")
        if self.x509_login and not all(b.url.startswith("amqps://") for b in self.brokers):
            raise ValueError("x509_login needs amqps:// broker URLs")
        return self

    @model_validator(mode="after")
    def _no_server_name(self) -> RabbitCluster:
        for tls in [self.tls, *(b.tls for b in self.brokers)]:
            if tls and tls.server_name:
                raise ValueError("server_name is for NATS; RabbitMQ brokers are verified against their URL's host")
        return self

    @field_validator("credentials")
    @classmethod
    def _user_password(cls, v: Credentials | None) -> Credentials | None:
        if v and not v.user:
            raise ValueError("RabbitMQ credentials are a user with password_env or password_file")
        return v


Cluster = Annotated[NatsCluster | RabbitCluster, Field(discriminator="kind")]


class Site(_Model):
    clusters: dict[str, Cluster]

    @field_validator("clusters")
    @classmethod
    def _names(cls, v: dict[str, Any]) -> dict[str, Any]:
        for name in v:
            if not _valid_name(name):
                raise ValueError(f"invalid cluster name {name!r}")
        return v


def _valid_name(name: str) -> bool:
    return bool(re.match(_NAME, name))


class Topology(_Model):
    version: Literal[1] = 1
    sites: dict[str, Site]
    _account: str | None = PrivateAttr(None)

    @property
    def account(self) -> str | None:
        """The NATS account this view's `nats()` answers in by default (None: each cluster's
        ``credentials``); see :meth:`in_account`."""
        return self._account

    def in_account(self, account: str | None) -> Topology:
        """This topology as ferry's user in NATS `account` sees it: `nats(name)` gives every NATS
        cluster with that account's credentials (one line naming the cluster that lacks it), so a
        job run on the view works in that account throughout, its journal included."""
        view = self.model_copy()
        view._account = account
        return view

    def duplicates(self) -> list[tuple[tuple[Any, ...], str]]:
        """(location, message) of every cluster or broker name used twice across sites."""
        found = []
        seen_clusters: dict[str, str] = {}
        seen_brokers: dict[str, str] = {}
        for site_name, site in self.sites.items():
            for cname, cluster in site.clusters.items():
                if cname in seen_clusters:
                    found.append(
                        (
                            ("sites", site_name, "clusters", cname),
                            f"duplicate cluster name (also in site {seen_clusters[cname]!r})",
                        )
                    )
                seen_clusters.setdefault(cname, site_name)
                for i, b in enumerate(cluster.brokers):
                    if b.name in seen_brokers and seen_brokers[b.name] != cname:
                        found.append(
                            (
                                ("sites", site_name, "clusters", cname, "brokers", i, "name"),
                                f"duplicate broker name {b.name!r} (also in cluster {seen_brokers[b.name]!r})",
                            )
                        )
                    seen_brokers.setdefault(b.name, cname)
        return found

    # -- lookups ---------------------------------------------------------------

    def clusters(self) -> Iterator[tuple[str, str, NatsCluster | RabbitCluster]]:
        """Yield (site, cluster name, cluster) for every cluster."""
        for site_name, site in self.sites.items():
            for cname, cluster in site.clusters.items():
                yield site_name, cname, cluster

    def cluster(self, name: str) -> NatsCluster | RabbitCluster:
        """A cluster by name; a site with exactly one cluster also answers to its own name."""
        for _, cname, cluster in self.clusters():
            if cname == name:
                return cluster
        site = self.sites.get(name)
        if site and len(site.clusters) == 1:
            return next(iter(site.clusters.values()))
        known = ", ".join(sorted(c for _, c, _ in self.clusters())) or "none"
        raise NotFound(f"unknown cluster {name!r} (known: {known})", cluster=name)

    def nats(self, name: str, account: str | None = None) -> NatsCluster:
        """NATS cluster `name`, as ferry's user in `account` (None: this view's account, else the
        default account)."""
        cluster = self.cluster(name)
        if not isinstance(cluster, NatsCluster):
            raise ConfigError(f"cluster {name!r} is {cluster.kind}, not nats")
        return cluster.in_account(account or self._account, name)

    def rabbitmq(self, name: str) -> RabbitCluster:
        cluster = self.cluster(name)
        if not isinstance(cluster, RabbitCluster):
            raise ConfigError(f"cluster {name!r} is {cluster.kind}, not rabbitmq")
        return cluster

    def site_of(self, cluster_name: str) -> str:
        for site_name, cname, _ in self.clusters():
            if cname == cluster_name:
                return site_name
        if cluster_name in self.sites:
            return cluster_name
        raise NotFound(f"unknown cluster {cluster_name!r}", cluster=cluster_name)

    def credential_problems(self) -> list[str]:
        """One line per credential or TLS file that cannot be read now (missing env var or file)."""
        problems = []
        for site_name, cname, cluster in self.clusters():
            creds: list[tuple[str, Credentials | Tls | None]] = [("credentials", cluster.credentials)]
            if isinstance(cluster, NatsCluster):
                creds += [("system_credentials", cluster.system_credentials), ("tls", cluster.tls)]
                creds += [("mqtt_credentials", cluster.mqtt_credentials)]
                creds += [(f"accounts.{a}", c) for a, c in cluster.accounts.items()]
            else:
                creds += [("tls", cluster.tls)]
            creds += [(f"brokers.{b.name}.tls", b.tls) for b in cluster.brokers]
            for key, cred in creds:
                problem = cred.missing() if cred else None
                if problem:
                    problems.append(f"sites.{site_name}.clusters.{cname}.{key}: {problem.removeprefix('tls.')}")
        return problems


# -- loading with line numbers -------------------------------------------------------


def default_topology_path() -> Path:
    """--topology, else $FERRY_TOPOLOGY, else the lab's topology file."""
    env = os.environ.get("FERRY_TOPOLOGY")
    if env:
        return Path(env)
    return lab_root() / "topology.yaml"


def lab_root() -> Path:
    """Where `ferry lab` keeps its servers and the topology it writes: $FERRY_LAB_DIR, else ./.ferry-lab."""
    return Path(os.environ.get("FERRY_LAB_DIR", ".ferry-lab")).absolute()


def load_topology(path: Path | str | None = None) -> Topology:
    path = Path(path) if path else default_topology_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: topology file not found",
            hint="pass --topology FILE, set FERRY_TOPOLOGY, or run `ferry lab up PROFILE`",
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text file (byte {exc.start}: not UTF-8); a topology is YAML") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the topology file ({exc.strerror})") from None
    return parse_topology(text, str(path))


def parse_topology(text: str, filename: str = "<topology>") -> Topology:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"{mark.line + 1}" if mark else "?"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{filename}:{line}: invalid YAML: {problem}") from None
    if root is None:
        raise ConfigError(f"{filename}:1: empty topology file")
    _reject_duplicate_keys(root, filename, ())
    data = yaml.safe_load(text)
    try:
        topology = Topology.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc, msg = tuple(err["loc"]), err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden" and loc[-1] in ("password", "pass"):
                msg = "a password never goes in the topology file: give password_env or password_file"
            elif err["type"] == "extra_forbidden":
                msg = "unknown key"
            elif err["type"] == "missing":
                msg = "required key is missing"
            elif err["type"] == "union_tag_invalid":
                loc, msg = (*loc, "kind"), f"unknown kind {err['ctx']['tag']!r} (expected nats or rabbitmq)"
            problems.append((loc, msg))
        raise ConfigError(_located(root, filename, problems)) from None
    if dups := topology.duplicates():
        raise ConfigError(_located(root, filename, dups))
    return topology


def _located(root: yaml.Node, filename: str, problems: list[tuple[tuple[Any, ...], str]]) -> str:
    lines = []
    for loc, msg in problems:
        node, path = _locate(root, loc)
        lines.append(f"{filename}:{node.start_mark.line + 1}: {_dotted(path) or '(top)'}: {msg}")
    return "; ".join(lines)


def _dotted(path: tuple[Any, ...]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _locate(root: yaml.Node, loc: tuple[Any, ...]) -> tuple[yaml.Node, tuple[Any, ...]]:
    """Walk the YAML node tree along a pydantic error location.

    Returns the deepest node found (a missing key stays at its parent mapping)
    and the path to print, without the discriminated-union tags pydantic adds.
    """
    node, shown = root, []
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            child = next((v for k, v in node.value if k.value == key), None)
            if child is None and key in ("nats", "rabbitmq"):
                continue  # union tag, not in the file
            shown.append(key)
            if child is not None:
                node = child
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            shown.append(key)
            node = node.value[key]
        else:
            shown.append(key)
    return node, tuple(shown)


def _reject_duplicate_keys(node: yaml.Node, filename: str, path: tuple[Any, ...]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for k, v in node.value:
            if k.value in seen:
                raise ConfigError(f"{filename}:{k.start_mark.line + 1}: {_dotted((*path, k.value))}: duplicate key")
            seen.add(k.value)
            _reject_duplicate_keys(v, filename, (*path, k.value))
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _reject_duplicate_keys(v, filename, (*path, i))
