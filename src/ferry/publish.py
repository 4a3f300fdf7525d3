"""The safe JetStream publisher for applications, under its public name: ``ferry.publish.publish()``
for one message, ``ferry.publish.Publisher`` for many (see :mod:`ferry.brokers.nats.publish`)."""

from ferry.brokers.nats.publish import Ack, BatchPublisher, Publisher, PublishError, PublishStats, publish

__all__ = ["Ack", "BatchPublisher", "PublishError", "PublishStats", "Publisher", "publish"]
