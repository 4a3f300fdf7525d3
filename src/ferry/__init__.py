"""ferry: move message workloads between NATS JetStream and RabbitMQ clusters and sites
without losing a message, and prove it."""

from ferry.errors import FerryError
from ferry.publish import Publisher, publish

__all__ = ["FerryError", "Publisher", "publish"]
__version__ = "0.1.0"
