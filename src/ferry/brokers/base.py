"""What every broker adapter shares: probe results, capabilities, the counts of a write."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlsplit

from ferry.errors import AuthError, BrokerUnavailable, FerryError, redact


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


async def timed_probe(cluster: str, broker: str, endpoint: str, url: str, check: Awaitable[str]) -> Probe:
    """Run one endpoint check; any ferry error becomes a failed probe with its one-line reason."""
    t0 = time.perf_counter()
    try:
        detail = await check
        ok = True
    except FerryError as exc:
        detail, ok = str(exc), False
    except (TimeoutError, OSError) as exc:
        detail, ok = f"{type(exc).__name__}: {exc}".rstrip(": "), False
    return Probe(cluster, broker, endpoint, redact(url), ok, detail, (time.perf_counter() - t0) * 1000)


async def mqtt_probe(url: str, user: str | None, password: str | None, timeout: float = 3.0) -> str:
    """An MQTT 3.1.1 CONNECT answered by CONNACK, with paho-mqtt in a thread."""
    import paho.mqtt.client as mqtt

    parts = urlsplit(url)
    result: dict[str, object] = {}

    def run() -> None:
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="ferry-probe", protocol=mqtt.MQTTv311)
        if user:
            client.username_pw_set(user, password)
        client.on_connect = lambda c, u, f, rc, p=None: result.setdefault("rc", rc)
        client.connect(parts.hostname or "127.0.0.1", parts.port or 1883, keepalive=10)
        deadline = time.monotonic() + timeout
        while "rc" not in result and time.monotonic() < deadline:
            client.loop(timeout=0.1)
        client.disconnect()

    try:
        await asyncio.to_thread(run)
    except OSError as exc:
        raise BrokerUnavailable(f"MQTT {parts.hostname}:{parts.port}: {exc.strerror or exc}") from None
    rc = result.get("rc")
    if rc is None:
        raise BrokerUnavailable(f"MQTT {parts.hostname}:{parts.port}: no CONNACK within {timeout:.0f}s")
    if getattr(rc, "is_failure", False):
        if "auth" in str(rc).lower() or "password" in str(rc).lower():
            raise AuthError(f"MQTT {parts.hostname}:{parts.port}: {rc}")
        raise BrokerUnavailable(f"MQTT {parts.hostname}:{parts.port}: {rc}")
    return "CONNACK accepted"


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
