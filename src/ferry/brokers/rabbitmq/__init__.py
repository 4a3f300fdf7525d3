"""RabbitMQ, without Spark: the management API and AMQP connections (:mod:`.client`), the lean
AMQP wire connection of the data plane (:mod:`.wire`), and the queue mover, its sinks and queue
snapshots (:mod:`.queue_io`). The client's names are named here."""

from ferry.brokers.rabbitmq.client import (
    FEDERATION_KEYS,
    Management,
    Rabbit,
    amqp_connect,
    amqp_uri,
    effective_policy,
    probe,
    q,
    queue_path,
)

__all__ = [
    "FEDERATION_KEYS",
    "Management",
    "Rabbit",
    "amqp_connect",
    "amqp_uri",
    "effective_policy",
    "probe",
    "q",
    "queue_path",
]
