"""How results and events are shown: tables and lines for people on stdout, progress on stderr,
one JSON document (``--json``) or JSON event lines."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.markup import escape

from ferry.jobs.shared.models import Model

out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)


def print_json(data: Any) -> None:
    """One JSON document on stdout: a job's model (or a list of them) as its :meth:`~Model.doc`."""
    out.print_json(json.dumps(data, default=_doc))


def _doc(value: Any) -> Any:
    return value.doc() if isinstance(value, Model) else str(value)


@contextlib.contextmanager
def busy(what: str, enabled: bool = True) -> Iterator[None]:
    """A spinner with the time so far, on stderr, for work that cannot count its progress; none
    when stderr is no terminal (rich would print only an empty line there when it ends)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True, disable=not (enabled and err.is_terminal)) as bar:
        bar.add_task(escape(what))
        yield


@contextlib.contextmanager
def progress_bar(total: int, what: str, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """A rich progress bar (messages, rate, ETA) fed with absolute counts."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if not enabled:
        yield lambda _: None
        return
    columns = [
        TextColumn("{task.description}"),  # `what` as text: a subject's braces or brackets are no format
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ]
    t0 = time.monotonic()
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task(escape(what), total=total or None, rate="")

        def advance(done: int) -> None:
            rate = done / max(1e-6, time.monotonic() - t0)
            bar.update(task, completed=done, rate=f"{rate:,.0f} msg/s")

        yield advance


JSON = False  # this command was given --json (options.JsonOpt sets it)


def spark_event(info: dict[str, Any]) -> None:
    """A Spark session began: with --json always (its application id), else on a cluster only."""
    if JSON:
        json_event("spark", **info)
        return
    from ferry.spark.ship import is_local

    if is_local(info.get("master"), info.get("remote")):
        return
    shipped = info.get("shipped")
    if shipped is None:
        how = "no Python tasks: nothing shipped"
    elif "zip" in shipped:
        how = f"ferry shipped ({shipped['bytes'] / 1e6:.1f} MB)"
    else:
        how = "ferry there already" if shipped.get("already") else "its --spark-archive"
    if shipped is not None:
        how += f", executors checked in {shipped['ship_s']:.1f}s"
    where = info.get("master") or info.get("remote")
    err.print(f"spark: {info.get('app_id', '?')} on {where}; {how}", highlight=False, markup=False)


def json_event(event: str, **data: Any) -> None:
    err.print(json.dumps({"event": event, "t": round(time.time(), 3), **data}, default=str), highlight=False)


def event_line(event: str, data: dict[str, Any]) -> str:
    """An event for people: ``event: key=value ...``, nested keys dotted (``placement.cluster=west``),
    lists comma-joined, None as ``-``; an event whose one value bears its name gives that value."""

    def flat(key: str, value: Any) -> Iterator[tuple[str, Any]]:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                yield from flat(f"{key}.{k}", v)
        elif isinstance(value, list | tuple):
            plain = all(not isinstance(v, dict | list | tuple) for v in value)
            yield key, ",".join(map(str, value)) if plain else json.dumps(value, default=str)
        else:
            yield key, "-" if value is None or value == {} else value

    pairs = [pair for k, v in data.items() for pair in flat(k, v)]
    if not pairs:
        return event
    if len(pairs) == 1 and pairs[0][0] == event:
        return f"{event}: {pairs[0][1]}"
    return f"{event}: " + " ".join(f"{k}={v}" for k, v in pairs)


def plain_event(event: str, **data: Any) -> None:
    err.print(event_line(event, data), highlight=False, markup=False)  # a glob's [a-z] is no markup


def redelivered_warning(n: int) -> str:
    """The warning for queue messages that came with the redelivered flag: RabbitMQ says only that
    they were delivered before, not by whom."""
    return (
        f"[yellow]{n:,} messages came redelivered (delivered before and not acked: an interrupted run, a "
        "snapshot, or another consumer): any an earlier run had stored is a duplicate at the destination "
        "(it carries x-ferry-transfer; `ferry audit` counts them)[/]"
    )


def count_or_unknown(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def per_stream(seqs: dict[str, int]) -> str:
    return ", ".join(f"{s} {n:,}" for s, n in seqs.items()) or "none"


def utc_time(epoch_s: int) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(epoch_s, UTC).strftime("%H:%M:%S")
