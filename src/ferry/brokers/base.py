"""What every broker adapter shares: probe results, capabilities, URL masking."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import ClassVar
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
    """Declared once per broker kind: what it can do and which errors are retryable."""

    kind: ClassVar[str]
    capabilities: ClassVar[frozenset[str]]
    retryable: ClassVar[tuple[type[BaseException], ...]] = (BrokerUnavailable,)


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
