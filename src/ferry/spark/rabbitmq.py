"""The ``rabbitmq`` data source: write rows of the common schema to a RabbitMQ queue or exchange.

Name: ``rabbitmq`` (write only: reading a queue is destructive, so a retried task
would read different messages; ferry moves queues with
:func:`ferry.brokers.rabbitmq.queue_io.move_queue`, one Spark task per queue).

Options (all strings): ``cluster`` (name from ``topology``, or JSON), ``vhost``
(default ``/``), ``queue`` (publish to this queue through the default exchange)
or ``exchange`` (publish there with each row's ``subject`` as routing key),
``transfer_id`` (added as ``x-ferry-transfer``), ``window`` (unconfirmed
publishes in flight, 512), ``rate`` (messages per second per task).

Guarantees: every row is published mandatory with publisher confirms; a nack
or an unroutable message fails the task. At-least-once.

Example::

    df.write.format("rabbitmq").option("cluster", "pc1").option("queue", "orders").mode("append").save()
"""

from __future__ import annotations

import asyncio
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage

from ferry.brokers.rabbitmq.queue_io import WriteConfig, write_rows
from ferry.errors import ConfigError
from ferry.schema import SPARK_DDL
from ferry.spark.options import Committed, cluster_json, executor_task, opt_int
from ferry.topology import RabbitCluster

__all__ = ["RabbitMQDataSource", "write_config"]


class RabbitMQDataSource(DataSource):
    """Spark data source ``rabbitmq`` (write only; see the module docstring)."""

    @classmethod
    def name(cls) -> str:
        return "rabbitmq"

    def schema(self) -> str:
        return SPARK_DDL

    def writer(self, schema: Any, overwrite: bool) -> _Writer:
        return _Writer(write_config(dict(self.options)))

    def streamWriter(self, schema: Any, overwrite: bool) -> _StreamWriter:
        return _StreamWriter(write_config(dict(self.options)))


class _Writer(DataSourceArrowWriter):
    def __init__(self, cfg: WriteConfig) -> None:
        self.cfg = cfg

    @executor_task
    def write(self, iterator: Any) -> Committed:
        return Committed(asyncio.run(write_rows(self.cfg, iterator)))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Every message was confirmed by the broker before its task returned."""


class _StreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, cfg: WriteConfig) -> None:
        self.cfg = cfg

    @executor_task
    def write(self, iterator: Any) -> Committed:
        return Committed(asyncio.run(write_rows(self.cfg, iterator)))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Every message was confirmed by the broker before its task returned."""


def write_config(options: dict[str, str]) -> WriteConfig:
    cfg = WriteConfig(
        cluster=cluster_json(options, RabbitCluster),
        vhost=options.get("vhost") or "/",
        queue=options.get("queue") or None,
        exchange=options.get("exchange") or None,
        transfer_id=options.get("transfer_id") or None,
        window=opt_int(options, "window", 512) or 512,
        rate=float(options["rate"]) if options.get("rate") else None,
    )
    if bool(cfg.queue) == bool(cfg.exchange):
        raise ConfigError("rabbitmq: give exactly one of the options 'queue' or 'exchange'")
    return cfg
