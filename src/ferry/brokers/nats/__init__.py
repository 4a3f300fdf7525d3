"""NATS and JetStream, without Spark: the client and system-account helpers (:mod:`.client`), the
JetStream API as raw JSON (:mod:`.jsapi`), the lean wire connection of the data plane
(:mod:`.wire`), stream readers and writers (:mod:`.reader`, :mod:`.writer`, :mod:`.relay`), and the
safe publisher applications use (:mod:`.publish`). The client's functions are named here."""

from ferry.brokers.nats.client import (
    DENIALS,
    Nats,
    connect,
    jetstream_off,
    leader_of,
    monitor_get,
    probe,
    refused,
    session,
    stream_add,
    stream_delete,
    stream_info,
    sys_request,
    while_electing,
)

__all__ = [
    "DENIALS",
    "Nats",
    "connect",
    "jetstream_off",
    "leader_of",
    "monitor_get",
    "probe",
    "refused",
    "session",
    "stream_add",
    "stream_delete",
    "stream_info",
    "sys_request",
    "while_electing",
]
