"""What ferry's Spark data sources and jobs share: option parsing (once, on the driver), async
reads driven from Spark's synchronous calls, one task per index, and the commit message a write
task returns."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from pyspark.sql.datasource import WriterCommitMessage

from ferry.brokers.base import WriteCounts
from ferry.errors import ConfigError, Unreadable
from ferry.topology import NatsCluster, load_topology

T = TypeVar("T")


def cluster_json(options: dict[str, str], kind: type[T]) -> str:
    """The cluster a data source talks to, as JSON (credential *references* only).

    Options: ``cluster`` is either that JSON (what ferry's jobs pass) or a cluster
    name resolved through ``topology`` (a file path; default: the usual lookup), as ferry's
    user in ``account`` (NATS: one of the cluster's ``accounts``; default: its credentials).
    """
    value = options.get("cluster")
    if not value:
        raise ConfigError("data source option 'cluster' is required")
    if value.lstrip().startswith("{"):
        return value
    cluster = load_topology(options.get("topology")).cluster(value)
    if not isinstance(cluster, kind):
        raise ConfigError(f"cluster {value!r} is {cluster.kind}, not {kind.__name__}")
    if isinstance(cluster, NatsCluster):
        cluster = cluster.in_account(options.get("account") or None, value)
    return cluster.model_dump_json()


@contextlib.contextmanager
def on_executor() -> Iterator[None]:
    """Around a Spark task's work: a topology file (credentials, TLS) it cannot read is named with
    this host, for on a cluster the files must be readable where the executors run."""
    try:
        yield
    except Unreadable as exc:
        where = f" (on Spark executor host {socket.gethostname()})"
        if where in str(exc):  # named already, by a task's inner step
            raise
        raise Unreadable(f"{exc}{where}") from None


def executor_task(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn`, a Spark task's function, run :func:`on_executor`."""

    @functools.wraps(fn)
    def task(*args: Any, **kwargs: Any) -> T:
        with on_executor():
            return fn(*args, **kwargs)

    return task


def iterate(agen: AsyncIterator[T]) -> Iterator[T]:
    """Drive an async generator from synchronous code (Spark's read/write calls)."""
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                with on_executor():
                    yield loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.run_until_complete(agen.aclose())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def per_index(spark: Any, n: int, batches: Callable[[int], Iterable[Any]], schema: Any) -> Any:
    """A DataFrame of `schema` holding batches(0) + ... + batches(n - 1), each index read by a Spark
    task of its own (Arrow record batches: one per stream range, queue, ...)."""

    def each(indices: Iterator[Any]) -> Iterator[Any]:
        for chunk in indices:
            for i in chunk.column(0).to_pylist():
                with on_executor():
                    yield from batches(i)

    return spark.range(0, n, 1, max(1, n)).mapInArrow(each, schema)


def opt_int(options: dict[str, str], key: str, default: int | None = None) -> int | None:
    value = options.get(key)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"option {key!r} must be an integer, got {value!r}") from None


def opt_bool(options: dict[str, str], key: str, default: bool = False) -> bool:
    value = options.get(key)
    if value in (None, ""):
        return default
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise ConfigError(f"option {key!r} must be true or false, got {value!r}")


COUNTS_DDL = "rows long, stored long, duplicates long, retries long, bytes long, errors array<string>"


@dataclass
class Committed(WriterCommitMessage):
    """What a write task hands back to the driver: its counts."""

    counts: WriteCounts
