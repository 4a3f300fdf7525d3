"""A running job's own figures for Prometheus (``--metrics-port PORT``): what only the process
running it knows, served on 127.0.0.1:PORT/metrics for as long as it runs. Made of the job's
events (:mod:`ferry.jobs.shared.events`): how many of each, when the last one came, and the
numbers it carried (eviction counts, messages left, reconciled counts). Only numeric fields
become samples, under their field names: no label carries a value a job reported, so no secret
reaches a scrape. `ferry serve`'s ``/metrics`` shows every operation on record from the
journals; this shows one process's own, between two journal saves."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from ferry.errors import ConfigError
from ferry.jobs.shared.events import Emit


def serve_metrics(collector: Any, port: int) -> None:
    """Serve `collector`'s families on 127.0.0.1:`port`/metrics from a thread, for the process's life."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    try:
        start_http_server(port, addr="127.0.0.1", registry=registry)
    except OSError as exc:
        raise ConfigError(f"--metrics-port {port}: {exc.strerror}") from None


class EventMetrics:
    """The events of job `job` as Prometheus families (label ``kind``, as in ``ferry_operations``;
    ``job`` is Prometheus's own), served on `port` (None: not served)."""

    def __init__(self, job: str, port: int | None) -> None:
        self.job = job
        self.counts: dict[str, int] = {}
        self.last: dict[str, tuple[float, dict[str, float]]] = {}  # event -> (time, its numeric fields)
        self.lock = threading.Lock()
        if port is not None:
            serve_metrics(self, port)

    def wrap(self, emit: Emit) -> Emit:
        """`emit`, recording each event here first."""

        def recorded(event: str, **data: Any) -> None:
            numbers = {k: float(v) for k, v in data.items() if isinstance(v, int | float) and not isinstance(v, bool)}
            with self.lock:
                self.counts[event] = self.counts.get(event, 0) + 1
                self.last[event] = (time.time(), numbers)
            emit(event, **data)

        return recorded

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        events = CounterMetricFamily("ferry_job_events", "Events the running job reported", labels=["kind", "event"])
        at = GaugeMetricFamily(
            "ferry_job_event_timestamp_seconds", "When the job last reported the event", labels=["kind", "event"]
        )
        figure = GaugeMetricFamily(
            "ferry_job_event_value",
            "A number the job's last event of the kind carried",
            labels=["kind", "event", "field"],
        )
        with self.lock:
            for event, n in sorted(self.counts.items()):
                events.add_metric([self.job, event], n)
                when, numbers = self.last[event]
                at.add_metric([self.job, event], when)
                for field, value in sorted(numbers.items()):
                    figure.add_metric([self.job, event, field], value)
        yield from (events, at, figure)
