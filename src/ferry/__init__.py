"""ferry: move message workloads between NATS JetStream and RabbitMQ clusters and sites
without losing a message, and prove it.

The safe publisher for applications is ``ferry.publish``: ``publish()`` and ``Publisher``."""

from __future__ import annotations

import zipimport
from typing import TYPE_CHECKING, Any

if isinstance(__loader__, zipimport.zipimporter):  # shipped to a Spark executor (ferry.spark.ship)
    from ferry.shipped import unpacked

    __path__[:] = [unpacked(__file__)]

from ferry.errors import FerryError

if TYPE_CHECKING:
    from ferry import publish
    from ferry.publish import Publisher

__all__ = ["FerryError", "Publisher", "publish"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # loaded on first use: the command line's entry point imports this package before it can
    # catch a Ctrl-C, and the publisher's imports (nats-py, pydantic) take a third of a second
    if name in ("publish", "Publisher"):
        import importlib

        module = importlib.import_module("ferry.publish")
        return module if name == "publish" else module.Publisher
    raise AttributeError(f"module 'ferry' has no attribute {name!r}")
