"""Writing to JetStream fast, without Spark: exactly-once in effect, optionally in exact order.

Every message carries ``Nats-Msg-Id`` (its own, else ``<source>:<seq>``); an ack
that does not come within ``ack_timeout`` is re-sent under the same id, and a
publish that still fails fails the write (nothing is dropped silently). Ordered
mode publishes each message expecting its predecessor as the stream's last
(``Nats-Expected-Last-Sequence``): exactly-once and order-preserving
regardless of the window. Writes add ``Ferry-Source`` / ``Ferry-Source-Seq``
unless ``origin_headers`` is false, and a relay's ``Ferry-Origin-*``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from ferry.brokers import nats as bnats
from ferry.brokers.base import Batches, WriteCounts, each_batch
from ferry.brokers.nats import while_electing
from ferry.brokers.nats.publish import Ack, BatchPublisher, Pacer, Publisher, PublishError
from ferry.brokers.nats.wire import Wire, wire
from ferry.errors import ConfigError, FerryError
from ferry.headers import (
    EXPECTED,
    MSG_ID,
    ORIGIN_MSG_ID_HDR,
    ORIGIN_SEQ_HDR,
    ORIGIN_SITE_HDR,
    ORIGIN_STREAM_HDR,
    SOURCE_HDR,
    SOURCE_SEQ_HDR,
    parse_headers,
)
from ferry.subjects import Capture
from ferry.topology import NatsCluster

_ORIGIN_SITE_LINE = f"\r\n{ORIGIN_SITE_HDR}:".encode()  # in an encoded header block
_WRONG_LAST_SEQ = 10071


@dataclass(frozen=True)
class WriteConfig:
    cluster: str
    name: str
    stream: str | None = None
    window: int = 512
    ack_timeout: float = 2.0
    give_up_after: float = 120.0
    ordered: bool = False
    batched: bool = False  # fast batch publishing (the stream must allow it)
    origin_headers: bool = True
    subject_prefix: str = ""
    origin_site: str = ""
    rate: float | None = None  # messages per second for this task
    leader: str = ""  # the stream's leader when planned: its server is the one to publish to
    subjects: tuple[str, ...] | None = None  # the stream's subjects, when known: a subject not among them is refused

    def nats(self) -> NatsCluster:
        return NatsCluster.model_validate_json(self.cluster)


# -- writing ------------------------------------------------------------------------------------


def _rows(batch: pa.RecordBatch) -> Iterator[tuple[Any, ...]]:
    cols = [
        batch.column(n).to_pylist() if n in batch.schema.names else [None] * batch.num_rows
        for n in ("subject", "payload", "headers", "msg_id", "source", "source_seq")
    ]
    return zip(*cols, strict=True)


async def _row_lists(batches: Batches) -> AsyncGenerator[list[tuple[Any, ...]]]:
    async for batch in each_batch(batches):
        yield list(_rows(batch))


async def write_batches(cfg: WriteConfig, batches: Batches) -> WriteCounts:
    """Publish every row of `batches`; raise if any message could not be stored."""
    return await write_rows(cfg, _row_lists(batches))


async def write_rows(
    cfg: WriteConfig, rows: AsyncGenerator[list[tuple[Any, ...]]], dest: Wire | None = None
) -> WriteCounts:
    """Publish every row (subject, payload, headers as a dict, pairs or an encoded block, msg id,
    source, seq) of `rows`, which come a list at a time, on `dest` if given (else a connection of
    its own); raise if any message could not be stored.

    `rows` is closed before this returns or raises: a reader's read-ahead task and connections
    must not be left to ``asyncio.run``'s teardown, which cancels the connections' own tasks with
    them (a failed copy's reader then waited for ever to delete its consumer)."""
    counts = WriteCounts()
    async with (
        contextlib.aclosing(rows),
        contextlib.nullcontext(dest) if dest else wire(cfg.nats(), cfg.name, prefer=cfg.leader) as w,
    ):
        if cfg.ordered:
            async with bnats.session(cfg.nats(), name=cfg.name, timeout=30) as nc:
                await _write_ordered(nc, w, cfg, rows, counts)
        else:
            pub = _publisher(w, cfg)
            pacer, message = Pacer(cfg.rate), _messages(cfg)
            async with pub:
                async for got in rows:
                    messages = [message(row) for row in got]
                    counts.rows += len(messages)
                    counts.bytes += sum(len(m[1]) for m in messages)
                    if pacer.interval:
                        for subject, payload, headers, msg_id in messages:
                            await pacer.wait()
                            await pub.publish(subject, payload, headers=headers, msg_id=msg_id)
                    else:
                        await pub.publish_many(messages)
            counts.stored, counts.duplicates = pub.stats.stored, pub.stats.duplicates
            counts.retries, counts.errors = pub.stats.retries, pub.stats.errors[:20]
            if pub.stats.failed:
                raise FerryError(
                    f"jetstream write to {cfg.name}/{cfg.stream or '*'}: {pub.stats.failed} of {counts.rows} "
                    f"messages not stored, first: {pub.stats.errors[0] if pub.stats.errors else '?'}"
                )
    return counts


def _publisher(
    w: Wire, cfg: WriteConfig, on_failure: Callable[[Ack], None] | None = None
) -> Publisher | BatchPublisher:
    """The publisher `cfg` asks for. With `on_failure`, a writer that keeps order: each failed
    message is reported (per-message acks), or the first refusal stops the batches (it raises
    :class:`PublishError`)."""
    if cfg.batched:
        return BatchPublisher(
            w, ack_timeout=cfg.ack_timeout, give_up_after=cfg.give_up_after, stop_on_refusal=on_failure is not None
        )
    return Publisher(
        w,
        window=cfg.window,
        ack_timeout=cfg.ack_timeout,
        give_up_after=cfg.give_up_after,
        on_ack=(lambda a: on_failure(a) if a.error else None) if on_failure else None,
    )


_Message = tuple[str, bytes, dict[str, str] | bytes, str]  # subject, payload, headers, msg id


def _messages(cfg: WriteConfig) -> Callable[[tuple[Any, ...]], _Message]:
    """What to publish for a row under `cfg`: (subject, payload, headers, msg id). A row that came
    with a header block that only needs lines added keeps it, with the lines (made once per
    source here) added; else the headers are parsed and encoded again."""
    prefix = cfg.subject_prefix
    expect = f"Nats-Expected-Stream: {cfg.stream}\r\n".encode() if cfg.stream else b""
    lines: dict[str | None, tuple[bytes, bytes]] = {}  # per source: what goes before the sequence
    origin_id, own_id = f"{ORIGIN_MSG_ID_HDR}: %s\r\n".encode(), f"{MSG_ID}: %s\r\n".encode()

    def message(row: tuple[Any, ...]) -> _Message:
        subject, payload, block, msg_id, source, seq = row
        if not isinstance(block, bytes) or seq is None:
            return _parsed(cfg, row)
        # the block publishes what its parsed headers would if its msg id (if any) is one plain line,
        # its keys have no spaces around the ones read here, there are no Ferry-Source lines to
        # replace, and it ends as usual (find, not `in`: on bytes it costs half as much)
        relayed = block.find(b"Ferry-Origin-Site") >= 0
        if (
            not block.endswith(b"\r\n\r\n")
            or msg_id == ""
            or block.count(b"Nats-Msg-Id") != (0 if msg_id is None else 1)
            or (relayed and block.find(_ORIGIN_SITE_LINE) < 0)
            or (cfg.origin_headers and block.find(b"Ferry-Source") >= 0)
        ):
            return _parsed(cfg, row)
        if source not in lines:
            stream = (source or "").partition("/")[2]
            copied = f"{SOURCE_HDR}: {source}\r\n{SOURCE_SEQ_HDR}: "
            relay = f"{ORIGIN_SITE_HDR}: {cfg.origin_site}\r\n{ORIGIN_STREAM_HDR}: {stream}\r\n{ORIGIN_SEQ_HDR}: "
            lines[source] = (
                copied.encode() if cfg.origin_headers and source is not None else b"",
                relay.encode() if cfg.origin_site else b"",
            )
        source_lines, site_lines = lines[source]
        block = block[:-2]
        if source_lines:
            block += b"%s%d\r\n" % (source_lines, seq)
        if site_lines and not relayed:
            block += b"%s%d\r\n" % (site_lines, seq)
            if msg_id:
                block += origin_id % msg_id.encode()
        if not msg_id:
            msg_id = f"{source}:{seq}"
            block += own_id % msg_id.encode()
        return prefix + subject, payload or b"", block + expect + b"\r\n", msg_id

    if cfg.subjects is None:
        return message
    captured = Capture(cfg.subjects)

    def checked(row: tuple[Any, ...]) -> _Message:
        made = message(row)
        if not captured(made[0]):  # else no stream answers: publishes wait for acks that never come
            raise FerryError(
                f"jetstream write to {cfg.stream}: subject {made[0]!r} is not one of {cfg.stream}'s subjects: "
                f"--subject-prefix maps them (it takes {captured.text})"
            )
        return made

    return checked


def _parsed(cfg: WriteConfig, row: tuple[Any, ...]) -> _Message:
    """What :func:`_messages` publishes for a row, from its headers parsed (a dict)."""
    subject, payload, headers, msg_id, source, seq = row
    if isinstance(headers, bytes):
        headers = parse_headers(headers)
        msg_id = headers.get(MSG_ID)
    pairs = headers.items() if isinstance(headers, dict) else headers or ()
    hdrs = {k: v for k, v in pairs if k not in EXPECTED and k != MSG_ID}
    if cfg.origin_headers and source is not None and seq is not None:
        hdrs[SOURCE_HDR] = source
        hdrs[SOURCE_SEQ_HDR] = str(seq)
    if cfg.origin_site and ORIGIN_SITE_HDR not in hdrs:
        hdrs[ORIGIN_SITE_HDR] = cfg.origin_site
        hdrs[ORIGIN_STREAM_HDR] = (source or "").partition("/")[2]
        hdrs[ORIGIN_SEQ_HDR] = str(seq)
        if msg_id:
            hdrs[ORIGIN_MSG_ID_HDR] = msg_id
    if cfg.stream:
        hdrs["Nats-Expected-Stream"] = cfg.stream
    return cfg.subject_prefix + subject, payload or b"", hdrs, msg_id or f"{source}:{seq}"


def _with(headers: dict[str, str] | bytes, key: str, value: str) -> dict[str, str] | bytes:
    """`headers` (a dict, or an encoded block) and key: value."""
    if isinstance(headers, bytes):
        return headers[:-2] + f"{key}: {value}\r\n\r\n".encode()
    return {**headers, key: value}


async def _write_ordered(
    nc: Any, w: Wire, cfg: WriteConfig, rows: AsyncIterator[list[tuple[Any, ...]]], counts: WriteCounts
) -> None:
    """Pipelined publishes on `w`, each expecting its predecessor as the stream's last message
    (stream info on `nc`).

    A failure (timeout, leader change, another writer) stops the pipeline; the
    stream's last sequence then says exactly which messages are stored, and
    publishing resumes right after them.
    """
    if not cfg.stream:
        raise ConfigError("jetstream: ordered writes need the destination 'stream' option")
    jsm = nc.jsm(timeout=10)

    async def last_seq() -> int:
        return int((await while_electing(lambda: jsm.stream_info(cfg.stream), 60)).state.last_seq)

    pending: list[_Message] = []  # unconfirmed, in order
    base = await last_seq()  # pending[0] expects `base`
    failures: list[Ack] = []

    stalled = 0
    pacer = Pacer(cfg.rate)

    async def drain() -> None:
        nonlocal base, pending, stalled
        while pending:
            failures.clear()
            # after an attempt that stored nothing, one publish at a time: a batch takes an id that the
            # leader holds "in process" (its proposal lost in a leader change) for stored; a publish waits
            pub = _publisher(w, replace(cfg, batched=False) if stalled else cfg, on_failure=failures.append)
            sent = 0
            try:
                async with pub:
                    for subject, payload, hdrs, msg_id in pending:
                        if failures:
                            break
                        await pacer.wait()
                        headers = _with(hdrs, "Nats-Expected-Last-Sequence", str(base + sent))
                        await pub.publish(subject, payload, headers=headers, msg_id=msg_id)
                        sent += 1
            except PublishError as exc:  # batched: the stream refused a message; what it holds decides
                code = int(exc.fields.get("err_code") or 0)  # type: ignore[call-overload]
                failures.append(Ack(str(exc.fields.get("subject", "")), None, error=str(exc), err_code=code))
            now = await last_seq()
            stored = now - base
            if stored and 0 < stored <= len(pending):
                last = await while_electing(functools.partial(jsm.get_msg, cfg.stream, now), 60)
                if (last.headers or {}).get(MSG_ID) != pending[stored - 1][3]:
                    stored = -1
            if stored < 0 or stored > len(pending):
                raise FerryError(
                    f"jetstream ordered write to {cfg.stream}: the stream changed under the copy "
                    f"(last seq {now}, expected {base}..{base + len(pending)}); another writer?"
                )
            counts.stored += stored
            counts.retries += pub.stats.retries + max(0, sent - stored)  # sent, not stored: sent again
            pending, base = pending[stored:], now
            stalled = 0 if stored else stalled + 1
            bad = [a for a in failures if a.err_code != _WRONG_LAST_SEQ]
            if pending and stored == 0 and (bad or stalled >= 10):
                reason = bad[0].error if bad else "no progress after 10 attempts"
                if "expected stream does not match" in reason:  # the subject is another stream's, or none's
                    reason += f" ({bad[0].subject!r} is not one of {cfg.stream}'s subjects: --subject-prefix maps them)"
                raise FerryError(f"jetstream ordered write to {cfg.stream}: {reason}")
            if stalled:  # a leader election refuses quick attempts: back off (5.5 s before the 10th)
                await asyncio.sleep(min(1.0, 0.05 * 2 ** (stalled - 1)))

    make = _messages(cfg)
    async for got in rows:
        for row in got:
            message = make(row)
            counts.rows += 1
            counts.bytes += len(message[1])
            pending.append(message)
            if len(pending) >= max(20_000, 10 * cfg.window):  # a resync point per chunk, not per window
                await drain()
    await drain()
