"""What every broker adapter shares: probe results, capabilities, the counts of a write."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import ssl
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

from ferry.errors import AuthError, BrokerUnavailable, ConfigError, FerryError, redact


@dataclass
class Probe:
    """One endpoint of one broker, and whether it answered."""

    cluster: str
    broker: str
    endpoint: str  # client, monitor, management, mqtt, system
    url: str
    ok: bool
    detail: str
    ms: float
    tls: dict[str, Any] | None = None  # version, subject, expires, days_left (see tls_session)
    identity: str | None = None  # who the server says ferry is there
    warnings: list[str] = field(default_factory=list)


@dataclass
class Answer:
    """What an endpoint check found: a line, and where known the TLS session and ferry's identity."""

    detail: str
    tls: dict[str, Any] | None = None
    identity: str | None = None
    warnings: list[str] = field(default_factory=list)


class BrokerKind:
    """Declared once per broker kind (as kombu's transports do): what it can do, which of its
    library's errors are worth retrying, and how its library's other errors read as ferry's.

    Capabilities ferry reads: ``replay`` (a source can be read again: exactly-once copies),
    ``destructive-read`` (reading consumes: one mover task per queue, at-least-once),
    ``msg-id-dedup``, ``system-account``, ``kv``, ``shovel``, ``federation``, ``mqtt``."""

    kind: ClassVar[str]
    capabilities: ClassVar[frozenset[str]]
    retryable: ClassVar[tuple[type[BaseException], ...]] = (BrokerUnavailable,)

    @classmethod
    def translate(cls, exc: BaseException) -> FerryError | None:
        """`exc`, one of this kind's library errors, as a ferry error (None: not this kind's)."""
        return None


@contextlib.contextmanager
def needed_by(where: str) -> Iterator[None]:
    """A setting that cannot be used (a credential or TLS file missing or unreadable, a malformed
    .creds) said with the broker that needed it: ``cluster 'east' (east-1): credentials: ...``."""
    try:
        yield
    except ConfigError as exc:
        raise type(exc)(f"{where}: {exc.message}", hint=exc.hint, **exc.fields) from None


async def timed_probe(cluster: str, broker: str, endpoint: str, url: str, check: Awaitable[str | Answer]) -> Probe:
    """Run one endpoint check; any ferry error becomes a failed probe with its one-line reason."""
    t0 = time.perf_counter()
    try:
        got = await check
        answer = got if isinstance(got, Answer) else Answer(got)
        ok = True
    except FerryError as exc:
        answer, ok = Answer(str(exc)), False
    except (TimeoutError, OSError) as exc:
        answer, ok = Answer(f"{type(exc).__name__}: {exc}".rstrip(": ")), False
    if answer.tls:
        answer.warnings += expiry_warnings("the server's certificate", answer.tls["days_left"], answer.tls["expires"])
    ms = (time.perf_counter() - t0) * 1000
    return Probe(cluster, broker, endpoint, redact(url), ok, ms=ms, **answer.__dict__)


# a certificate that expires within this many days gets a warning from `ferry topology check`
EXPIRY_WARNING_DAYS = 30
_NAMES = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU", "countryName": "C"}


async def tls_session(
    url: str, ctx: ssl.SSLContext, server_name: str | None = None, *, clear_first_line: bool = False
) -> dict[str, Any]:
    """The TLS session `url` offers ferry: protocol version, the server certificate's subject, its
    expiry and the days left (an expired certificate is an error). `clear_first_line`: the
    protocol speaks one line before TLS starts (a NATS server's INFO)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or {"https": 443, "amqps": 5671, "mqtts": 8883}.get(parts.scheme, 4222)
    timeout = 3.0
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        if clear_first_line:
            await asyncio.wait_for(reader.readline(), timeout)
        await asyncio.wait_for(writer.start_tls(ctx, server_hostname=server_name or host), timeout)
        tls = writer.get_extra_info("ssl_object")
        cert = tls.getpeercert() or {}
    finally:
        writer.close()
    subject = [(_NAMES.get(k, k), v) for rdn in cert.get("subject", ()) for k, v in rdn]
    cn = [f"{k}={v}" for k, v in subject if k == "CN"]
    not_after = ssl.cert_time_to_seconds(cert["notAfter"]) if cert.get("notAfter") else None
    facts = {
        "version": tls.version(),
        "subject": ",".join(cn or [f"{k}={v}" for k, v in subject]),
        "expires": time.strftime("%Y-%m-%d", time.gmtime(not_after)) if not_after else None,
        "days_left": int((not_after - time.time()) // 86400) if not_after else None,
    }
    if facts["days_left"] is not None and facts["days_left"] < 0:
        raise FerryError(f"TLS: the server's certificate ({facts['subject']}) expired on {facts['expires']}")
    return facts


def expiry_warnings(what: str, days_left: int | None, expires: str | None) -> list[str]:
    """A warning when `what` expires within EXPIRY_WARNING_DAYS days."""
    if days_left is None or days_left >= EXPIRY_WARNING_DAYS:
        return []
    return [f"{what} expires in {days_left} days ({expires})"]


def certificate_file_expiry(path: Path) -> tuple[int, str]:
    """Days left and the expiry date (YYYY-MM-DD) of the PEM certificate at `path`."""
    from cryptography import x509

    not_after = x509.load_pem_x509_certificate(path.read_bytes()).not_valid_after_utc
    return int((not_after.timestamp() - time.time()) // 86400), not_after.strftime("%Y-%m-%d")


async def mqtt_probe(
    url: str,
    user: str | None,
    password: str | None,
    timeout: float = 3.0,
    tls: ssl.SSLContext | None = None,
    server_name: str | None = None,
) -> Answer:
    """An MQTT 3.1.1 CONNECT answered by CONNACK, with paho-mqtt in a thread; over TLS for an
    ``mqtts://`` URL (with `tls`, else the system's CAs), and then the TLS session it offers
    (:func:`tls_session`, checked against `server_name` when given)."""
    import paho.mqtt.client as mqtt

    parts = urlsplit(url)
    result: dict[str, object] = {}

    def run() -> None:
        # an id of its own: probes of one account's servers at once would take each other's session over
        client_id = f"ferry-probe-{os.getpid()}-{secrets.token_hex(4)}"
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311)
        if parts.scheme == "mqtts":
            client.tls_set_context(tls or ssl.create_default_context())
        if user:
            client.username_pw_set(user, password)
        client.on_connect = lambda c, u, f, rc, p=None: result.setdefault("rc", rc)
        client.connect(
            parts.hostname or "127.0.0.1", parts.port or (8883 if parts.scheme == "mqtts" else 1883), keepalive=10
        )
        deadline = time.monotonic() + timeout
        while "rc" not in result and time.monotonic() < deadline:
            client.loop(timeout=0.1)
        client.disconnect()

    try:
        await asyncio.to_thread(run)
    except OSError as exc:  # ssl.SSLError included
        why = tls_error(exc) or exc.strerror or str(exc)
        raise BrokerUnavailable(f"MQTT {parts.hostname}:{parts.port}: {why}") from None
    rc = result.get("rc")
    if rc is None:
        raise BrokerUnavailable(f"MQTT {parts.hostname}:{parts.port}: no CONNACK within {timeout:.0f}s")
    if getattr(rc, "is_failure", False):
        if "auth" in str(rc).lower() or "password" in str(rc).lower():
            raise AuthError(f"MQTT {parts.hostname}:{parts.port}: {rc}")
        raise BrokerUnavailable(f"MQTT {parts.hostname}:{parts.port}: {rc}")
    secure = parts.scheme == "mqtts"
    return Answer(
        "CONNACK accepted", await tls_session(url, tls or ssl.create_default_context(), server_name) if secure else None
    )


Batches = Iterable[Any] | AsyncIterable[Any]  # of Arrow record batches: Spark's (sync) or a reader's


async def each_batch(batches: Batches) -> AsyncIterator[Any]:
    """The batches of a synchronous or an asynchronous iterable, asynchronously."""
    if isinstance(batches, AsyncIterable):
        async for batch in batches:
            yield batch
    else:
        for batch in batches:
            yield batch


@dataclass
class WriteCounts:
    """What one write task did; the driver sums these."""

    rows: int = 0
    stored: int = 0
    duplicates: int = 0
    retries: int = 0
    bytes: int = 0
    errors: list[str] = field(default_factory=list)

    def __add__(self, other: WriteCounts) -> WriteCounts:
        return WriteCounts(
            self.rows + other.rows,
            self.stored + other.stored,
            self.duplicates + other.duplicates,
            self.retries + other.retries,
            self.bytes + other.bytes,
            (self.errors + other.errors)[:20],
        )

    def as_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()

    @staticmethod
    def arrow_schema() -> Any:
        """COUNTS_DDL as an Arrow schema."""
        import pyarrow as pa

        fields = [(name, pa.int64()) for name in ("rows", "stored", "duplicates", "retries", "bytes")]
        return pa.schema([*fields, ("errors", pa.list_(pa.string()))])

    def as_batch(self) -> Any:
        """One Arrow row with the COUNTS_DDL schema (what a counting Spark task yields)."""
        import pyarrow as pa

        return pa.RecordBatch.from_pylist([self.as_dict()], self.arrow_schema())


def tls_error(exc: BaseException) -> str | None:
    """One line for a failed TLS handshake ("TLS: certificate verify failed: ..."), else None."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        reason = str(exc.reason or exc).replace("_", " ").lower()
        if "certificate required" in reason:
            return f"TLS: the server requires a client certificate (tls.cert_file and tls.key_file; {reason})"
        if "alert" in reason and any(w in reason for w in ("unknown ca", "bad certificate", "certificate unknown")):
            return f"TLS: the server rejected the client certificate (tls.cert_file; {reason})"
        return f"TLS: {reason}"
    return None


def tls_cause(exc: BaseException | None, depth: int = 0) -> str | None:
    """:func:`tls_error` of `exc` or of what caused it (libraries wrap the SSL error, or carry it
    in their arguments), else None."""
    if exc is None or depth > 6:
        return None
    inner = [a for a in exc.args if isinstance(a, BaseException)]
    return tls_error(exc) or next(
        filter(None, (tls_cause(e, depth + 1) for e in (exc.__cause__ or exc.__context__, *inner))), None
    )
