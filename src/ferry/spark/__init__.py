"""Spark only: the one session factory (:mod:`.session`), ferry's data sources (:mod:`.jetstream`,
:mod:`.rabbitmq`), option parsing (:mod:`.options`) and the building blocks of its Spark jobs
(:mod:`.tasks`). Broker I/O is in :mod:`ferry.brokers`; the jobs are in :mod:`ferry.jobs`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

listeners: list[Callable[[dict[str, Any]], None]] = []


def on_session(listener: Callable[[dict[str, Any]], None]) -> None:
    """Call `listener` with each new session's application id, name, master (or remote) and, on a
    cluster, what :func:`ferry.spark.ship.ship` did: the command line's ``spark`` event. (Here, not
    in :mod:`.session`: the command line registers it without loading Spark's side.)"""
    if listener not in listeners:
        listeners.append(listener)
