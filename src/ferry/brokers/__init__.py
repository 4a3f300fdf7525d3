"""Broker I/O, one package per broker kind (:mod:`.nats`, :mod:`.rabbitmq`) behind :mod:`.base`;
no job logic and no Spark here.

The kinds are registered by name (``KINDS``): what each can do and which of its library's errors
are transient is declared once, on its class, and read here by :func:`transient` (every retry
loop asks it) and :func:`translate` (library errors into ferry's tree, for the CLI's and the
API's one-line errors)."""

from __future__ import annotations

import asyncio

from ferry.brokers.base import BrokerKind, Probe, certificate_file_expiry, expiry_warnings
from ferry.brokers.nats import client as nats_client
from ferry.brokers.rabbitmq import client as rabbitmq_client
from ferry.errors import BrokerUnavailable, FerryError
from ferry.topology import NatsCluster, Topology, broker_tls

__all__ = ["KINDS", "BrokerKind", "Probe", "client_certificates", "kind", "probe_all", "transient", "translate"]

KINDS: dict[str, type[BrokerKind]] = {"nats": nats_client.Nats, "rabbitmq": rabbitmq_client.Rabbit}


def kind(name: str) -> type[BrokerKind]:
    """The broker kind registered as `name` ("nats", "rabbitmq"; "jetstream" is NATS)."""
    return KINDS["nats" if name == "jetstream" else name]


def transient(exc: BaseException) -> bool:
    """Whether trying again later may succeed: a ferry error that says so, or a library error one
    of the kinds declares retryable."""
    if isinstance(exc, FerryError):
        return exc.retryable
    return any(isinstance(exc, k.retryable) for k in KINDS.values())


def translate(exc: BaseException) -> FerryError | None:
    """A library error as a ferry error with one line to say, or None when it is not a broker's."""
    if isinstance(exc, FerryError):
        return exc
    for k in KINDS.values():
        if (err := k.translate(exc)) is not None:
            return err
    if isinstance(exc, TimeoutError):
        return BrokerUnavailable(f"a broker did not answer in time ({type(exc).__module__}.{type(exc).__name__})")
    return None


async def probe_all(topology: Topology) -> list[Probe]:
    """Probe every endpoint of every broker in the topology, concurrently."""
    tasks = [
        (nats_client.probe if isinstance(cluster, NatsCluster) else rabbitmq_client.probe)(name, cluster)  # type: ignore[arg-type]
        for _, name, cluster in topology.clusters()
    ]
    return [p for probes in await asyncio.gather(*tasks) for p in probes]


def client_certificates(topology: Topology) -> tuple[list[str], list[str]]:
    """The client certificates of the topology's ``tls`` blocks that expired (problems) or
    expire within a month (warnings)."""
    problems, warnings = [], []
    for _, name, cluster in topology.clusters():
        files = {tls.cert_file for b in cluster.brokers if (tls := broker_tls(cluster, b)) and tls.cert_file}
        for cert in sorted(files):  # a broker's own tls block may name another certificate
            days, date = certificate_file_expiry(cert)
            what = f"cluster {name}: the client certificate {cert}"
            if days < 0:
                problems.append(f"{what} expired on {date}")
            warnings += expiry_warnings(what, days, date) if days >= 0 else []
    return problems, warnings
