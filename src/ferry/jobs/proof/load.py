"""`ferry load`: publish a known workload and write a ledger of what was sent.

Targets:

- ``nats://CLUSTER``: core publish (fire and forget; the ledger says "not asked")
- ``jetstream://CLUSTER``: JetStream publish with an ack deadline; an ack that
  does not come is re-sent under the same ``Nats-Msg-Id`` until ``give_up_after``
  (``--no-retry``: one attempt, as a producer without retries would do)
- ``rabbitmq://CLUSTER/VHOST``: AMQP publish (with publisher confirms unless
  ``--no-confirms``) to the default exchange, routing key = the subject, or to
  ``--exchange``

Every message carries a unique id (``<run>-p<producer>-<seq>``), the send time
(ns) and the hash of its payload: headers ``Ferry-Id``, ``Ferry-Sent``,
``Ferry-Hash`` for NATS (plus ``Nats-Msg-Id`` unless ``--no-msg-id``), and
``message_id``, ``x-ferry-sent``, ``x-ferry-hash`` for RabbitMQ.

The ledger is a directory of Parquet parts, each written whole (a killed load
leaves every part up to the last flush readable): id, run, producer, seq,
subject, sent_ns, outcome (acked / error / not_asked), ack_ns, stored_seq,
error, hash, size.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import resource
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pyarrow as pa
import pyarrow.parquet as pq

from ferry.brokers.nats.publish import Ack, Pacer, Publisher
from ferry.brokers.nats.wire import Wire
from ferry.brokers.rabbitmq.wire import raw_connect
from ferry.errors import AuthError, BrokerUnavailable, ConfigError, FerryError, NotFound, UsageError
from ferry.jobs.shared.paths import check_writable
from ferry.topology import NatsCluster, Topology
from ferry.uris import masked

__all__ = ["LEDGER_SCHEMA", "Ledger", "LoadOptions", "LoadSummary", "payload_for", "run_load"]

LEDGER_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("run", pa.string()),
        ("producer", pa.int32()),
        ("seq", pa.int64()),
        ("subject", pa.string()),
        ("sent_ns", pa.int64()),
        ("outcome", pa.string()),
        ("ack_ns", pa.int64()),
        ("stored_seq", pa.int64()),
        ("error", pa.string()),
        ("hash", pa.string()),
        ("size", pa.int32()),
    ]
)


def payload_for(msg_id: str, size: int) -> bytes:
    """A deterministic payload for an id (so the ledger need not keep payloads)."""
    block = hashlib.blake2b(msg_id.encode(), digest_size=64).digest()
    return (block * (size // 64 + 1))[:size]


def payload_hash(payload: bytes) -> str:
    """The hash the audit recomputes from what a tier holds (first 16 hex digits of sha256)."""
    return hashlib.sha256(payload).hexdigest()[:16]


MAX_SIZE = 64 * 1024 * 1024
MAX_COUNT = 10**12


@dataclass
class LoadOptions:
    target: str
    subject: str = "load.{n}"  # {n} = 0 .. subjects-1
    subjects: int = 10
    producers: int = 1
    rate: float | None = None  # messages per second, all producers together
    duration: float | None = None  # seconds
    count: int | None = None
    size: int = 100
    ledger: Path = Path("ledger")
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    msg_id: bool = True
    retry: bool = True
    confirms: bool = True
    exchange: str | None = None
    url: str | None = None  # connect here (e.g. a load balancer) instead of the topology's brokers
    ack_timeout: float = 2.0
    give_up_after: float = 60.0

    def validate(self) -> None:
        if self.producers < 1 or self.subjects < 1 or self.size < 16:
            raise UsageError("--producers and --subjects must be >= 1, --size >= 16")
        if self.size > MAX_SIZE:
            raise UsageError(
                f"--size {self.size:,}: at most {MAX_SIZE:,} bytes (64 MiB, the largest payload NATS takes)"
            )
        if self.count is not None and not 0 < self.count <= MAX_COUNT:
            raise UsageError(f"--count {self.count:,}: give 1 to {MAX_COUNT:,}")
        if self.rate is not None and not 0 < self.rate < math.inf:
            raise UsageError("--rate must be positive and finite")
        if self.duration is not None and not 0 < self.duration < math.inf:
            raise UsageError("--duration must be positive and finite")
        files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if files != resource.RLIM_INFINITY and self.producers + 64 > files:
            raise UsageError(
                f"--producers {self.producers:,}: each opens a connection, and this process may open {files:,} "
                "files (ulimit -n)"
            )
        if not 0 < self.give_up_after < math.inf:
            raise UsageError("--give-up-after must be positive")
        if "{n}" not in self.subject and self.subjects > 1:
            raise UsageError("--subject must contain {n} when --subjects > 1")


@dataclass
class LoadSummary:
    run: str
    ledger: str
    sent: int = 0
    acked: int = 0
    errors: int = 0
    not_asked: int = 0
    retries: int = 0
    seconds: float = 0.0
    first_errors: list[str] = field(default_factory=list)
    interrupted: bool = False  # stopped (a signal) before its count or duration

    @property
    def rate(self) -> float:
        return self.sent / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "rate": round(self.rate)}


class Ledger:
    """Rows of the ledger, written as whole Parquet parts every `flush_rows` rows or `flush_s` seconds."""

    def __init__(self, path: Path, flush_rows: int = 50_000) -> None:
        self.path = path
        if path.exists() and any(path.iterdir()):
            raise ConfigError(f"ledger directory {path} is not empty")
        check_writable(f"ledger directory {path}", path)
        self.flush_rows = flush_rows
        self.rows: list[dict[str, Any]] = []
        self.parts = 0

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)

    def flush(self) -> None:
        if not self.rows:
            return
        self.path.mkdir(parents=True, exist_ok=True)  # at the first row: a load that fails before leaves none
        table = pa.Table.from_pylist(self.rows, schema=LEDGER_SCHEMA)
        tmp = self.path / f".part-{self.parts:05d}.tmp"
        pq.write_table(table, tmp)
        tmp.replace(self.path / f"part-{self.parts:05d}.parquet")
        self.parts += 1
        self.rows = []


def _parse_target(target: str) -> tuple[str, str, str, str | None]:
    """kind, cluster, vhost (RabbitMQ) and account (NATS: ``?account=NAME``) of a load's target."""
    parts, shown = urlsplit(target), masked(target)
    if parts.scheme not in ("nats", "jetstream", "rabbitmq") or not parts.netloc:
        raise ConfigError(f"{shown!r}: target must be nats://CLUSTER, jetstream://CLUSTER or rabbitmq://CLUSTER/VHOST")
    vhost = unquote(parts.path[1:]) if parts.path and parts.path != "/" else "/"
    if parts.scheme != "rabbitmq" and vhost != "/":
        raise ConfigError(f"{shown!r}: {parts.scheme}://CLUSTER takes no path (the subject says where messages go)")
    query = parse_qs(parts.query)
    if unknown := sorted(set(query) - ({"account"} if parts.scheme != "rabbitmq" else set())):
        raise ConfigError(f"{shown!r}: unknown option {unknown[0]!r} (known: account, for NATS)")
    return parts.scheme, parts.netloc, vhost, (query.get("account") or [None])[-1]


async def run_load(
    topology: Topology,
    opts: LoadOptions,
    stop: asyncio.Event | None = None,
    progress: Callable[[LoadSummary, int], None] | None = None,
) -> LoadSummary:
    """Publish until count, duration or `stop`; every message ends up in the ledger."""
    opts.validate()
    ledger = Ledger(opts.ledger)  # refused here when it cannot be written; made at its first row
    kind, cluster, vhost, account = _parse_target(opts.target)
    if kind == "rabbitmq":
        topology.rabbitmq(cluster)
        if opts.url and "," in opts.url:
            raise UsageError("--url: one URL for RabbitMQ (a list is for NATS: the first, then the others)")
    else:
        topology.nats(cluster, account)
        from ferry.subjects import tokens

        tokens(opts.subject.replace("{n}", "0"), literal=True)  # a publish needs a literal subject
        if kind == "jetstream":
            await _a_stream_takes(topology, cluster, account, opts.subject.replace("{n}", "0"))
    stop = stop or asyncio.Event()
    summary = LoadSummary(opts.run, str(opts.ledger))
    per_producer = None if opts.count is None else -(-opts.count // opts.producers)
    deadline = time.monotonic() + opts.duration if opts.duration else None
    inflight = [0]
    t0 = time.monotonic()
    refused = ""  # a permission violation a core publish got (the server drops such messages silently)

    def record(row: dict[str, Any]) -> None:
        outcome = row["outcome"]
        summary.acked += outcome == "acked"
        summary.errors += outcome == "error"
        summary.not_asked += outcome == "not_asked"
        if outcome == "error" and len(summary.first_errors) < 10:
            summary.first_errors.append(f"{row['id']}: {row['error']}")
        ledger.add(row)

    async def producer(p: int) -> None:
        nonlocal refused
        quota = per_producer if per_producer is None else min(per_producer, opts.count - p * per_producer)  # type: ignore[operator]
        pacer = Pacer(opts.rate / opts.producers if opts.rate else None)
        send = await _sender(kind, topology, cluster, vhost, account, opts, record, inflight)
        try:
            seq = 0
            while quota is None or seq < quota:
                if deadline and time.monotonic() >= deadline:
                    break
                if stop.is_set():
                    summary.interrupted = True  # before its count or duration
                    break
                await pacer.wait()
                seq += 1
                msg_id = f"{opts.run}-p{p}-{seq}"
                subject = opts.subject.replace("{n}", str((seq + p) % opts.subjects))
                payload = payload_for(msg_id, opts.size)
                row = {
                    "id": msg_id,
                    "run": opts.run,
                    "producer": p,
                    "seq": seq,
                    "subject": subject,
                    "sent_ns": time.time_ns(),
                    "outcome": "not_asked",
                    "ack_ns": None,
                    "stored_seq": None,
                    "error": None,
                    "hash": payload_hash(payload),
                    "size": opts.size,
                }
                await send.publish(row, payload)
                summary.sent += 1
        finally:
            await send.close()
            summary.retries += send.retries
            refused = refused or send.refused

    async def flusher() -> None:
        while True:
            await asyncio.sleep(1.0)
            summary.seconds = time.monotonic() - t0
            if progress:
                progress(summary, inflight[0])
            if len(ledger.rows) >= ledger.flush_rows or ledger.rows:
                ledger.flush()

    ticker = asyncio.create_task(flusher())
    # a ledger that cannot be written stops the producers: every message sent must be in it
    ticker.add_done_callback(lambda t: t.cancelled() or t.exception() is None or stop.set())
    try:
        await asyncio.gather(*(producer(p) for p in range(opts.producers)))
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
        summary.seconds = time.monotonic() - t0
        ledger.flush()
    ledger.path.mkdir(parents=True, exist_ok=True)  # a ledger, if an empty one
    if refused:
        raise AuthError(
            f"the server dropped messages of ferry's user: {refused} (the ledger {opts.ledger} lists them as "
            "sent without an ack)"
        )
    return summary


async def _a_stream_takes(topology: Topology, cluster: str, account: str | None, subject: str) -> None:
    """Refuse a JetStream load whose subject no stream takes: every publish would fail (after
    retries, a minute each) rather than at once."""
    from nats.js.errors import NotFoundError

    from ferry.brokers import nats as bnats

    async with bnats.session(topology.nats(cluster, account), name=cluster) as nc:
        try:
            await nc.jsm().find_stream_name_by_subject(subject)
        except NotFoundError:
            raise NotFound(
                f"no stream in cluster {cluster!r} takes {subject!r}: create one first (ferry stream add), "
                "or load nats:// for core publishes"
            ) from None


class _Sender:
    retries = 0
    refused = ""

    async def publish(self, row: dict[str, Any], payload: bytes) -> None: ...

    async def close(self) -> None: ...


async def _sender(
    kind: str,
    topology: Topology,
    cluster: str,
    vhost: str,
    account: str | None,
    opts: LoadOptions,
    record: Callable[[dict[str, Any]], None],
    inflight: list[int],
) -> _Sender:
    if kind == "rabbitmq":
        sender: _Sender = _RabbitSender(topology, cluster, vhost, opts, record, inflight)
    else:
        sender = _NatsSender(topology.nats(cluster, account), cluster, kind == "jetstream", opts, record, inflight)
    await sender.open()  # type: ignore[attr-defined]
    return sender


class _NatsSender(_Sender):
    def __init__(
        self,
        nats: NatsCluster,
        cluster: str,
        js: bool,
        opts: LoadOptions,
        record: Callable[[dict[str, Any]], None],
        inflight: list[int],
    ) -> None:
        self.nats, self.cluster, self.js, self.opts = nats, cluster, js, opts
        self.record, self.inflight = record, inflight

    async def open(self) -> None:
        self.nc = await Wire.open(
            self.nats,
            self.cluster,
            f"ferry-load-{self.opts.run}",
            urls=self.opts.url.split(",") if self.opts.url else None,
            timeout=5,
        )
        if self.js:
            give_up = self.opts.give_up_after if self.opts.retry else self.opts.ack_timeout
            self.pub = Publisher(
                self.nc,
                window=1024,
                ack_timeout=self.opts.ack_timeout,
                give_up_after=give_up,
                on_ack=self._on_ack,
                retry_codes=frozenset({503}) if self.opts.retry else frozenset(),
            )
            await self.pub.start()

    def _on_ack(self, ack: Ack) -> None:
        row = ack.ctx
        self.inflight[0] -= 1
        row["ack_ns"] = time.time_ns()
        if ack.error:
            row["outcome"], row["error"] = "error", ack.error
        else:
            row["outcome"], row["stored_seq"] = "acked", ack.seq
        self.record(row)

    async def publish(self, row: dict[str, Any], payload: bytes) -> None:
        headers = {"Ferry-Id": row["id"], "Ferry-Sent": str(row["sent_ns"]), "Ferry-Hash": row["hash"]}
        msg_id = row["id"] if self.opts.msg_id else None
        if self.js:
            self.inflight[0] += 1
            await self.pub.publish(row["subject"], payload, headers=headers, msg_id=msg_id, ctx=row)
            return
        if msg_id:
            headers["Nats-Msg-Id"] = msg_id
        try:
            await self.nc.publish(row["subject"], payload, headers=headers)
        except Exception as exc:  # disconnected and the reconnect buffer is full
            row["outcome"], row["error"] = "error", f"{type(exc).__name__}: {exc}"
        self.record(row)

    async def close(self) -> None:
        if self.js:
            await self.pub.flush()
            self.retries = self.pub.stats.retries
            await self.pub.close()
        with contextlib.suppress(Exception):
            await self.nc.flush(timeout=5)  # a violation comes before the flush's answer
            await self.nc.close()
        if not self.js:  # a JetStream publish refused fails with that reason (see Publisher)
            self.refused = next((d for d in self.nc.denied if "publish to" in d.lower()), "")


class _RabbitSender(_Sender):
    def __init__(
        self,
        topology: Topology,
        cluster: str,
        vhost: str,
        opts: LoadOptions,
        record: Callable[[dict[str, Any]], None],
        inflight: list[int],
    ) -> None:
        self.topology, self.cluster, self.vhost, self.opts = topology, cluster, vhost, opts
        self.record, self.inflight = record, inflight
        self.pending: dict[int, dict[str, Any]] = {}
        self.space = asyncio.Event()
        self.returned: str | None = None

    async def open(self) -> None:
        cluster = self.topology.rabbitmq(self.cluster)
        if self.opts.url:  # e.g. a load balancer
            via = cluster.brokers[0].model_copy(update={"url": self.opts.url})
            cluster = cluster.model_copy(update={"brokers": [via]})
        self.conn = await raw_connect(cluster, self.vhost, name=self.cluster)
        self.ch = await self.conn.channel()
        if self.opts.confirms:
            await self.ch.confirm_select()
            self.ch.on_confirm = self._on_confirm
            self.ch.on_return = self._on_return

    def _on_return(self, reply: str) -> None:
        self.returned = reply  # the confirm for that message follows: it is marked as an error there

    def _on_confirm(self, seq: int, multiple: bool, ok: bool) -> None:
        seqs = [s for s in self.pending if s <= seq] if multiple else [seq]
        now = time.time_ns()
        for s in seqs:
            row = self.pending.pop(s, None)
            if row is None:
                continue
            self.inflight[0] -= 1
            row["ack_ns"] = now
            if not ok or self.returned:
                row["outcome"], row["error"] = "error", ("nack" if not ok else f"unroutable: {self.returned}")
                self.returned = None
            else:
                row["outcome"] = "acked"
            self.record(row)
        self.space.set()

    async def _reconnect(self) -> None:
        """After the broker closed the connection (a node evacuated, restarted): connect again
        and re-send every unconfirmed message under its own message_id (at least once)."""
        resend = list(self.pending.values())
        self.pending.clear()
        self.inflight[0] -= len(resend)
        deadline = time.monotonic() + self.opts.give_up_after
        while True:
            try:
                await self.open()
                break
            except FerryError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        for row in resend:
            self.retries += 1
            await self.publish(row, payload_for(row["id"], row["size"]))

    async def publish(self, row: dict[str, Any], payload: bytes) -> None:
        from ferry.brokers.rabbitmq.queue_io import row_header

        props = {"message_id": row["id"], "delivery_mode": 2, "headers": None}
        header = row_header(
            {"properties": props, "headers": [("x-ferry-sent", str(row["sent_ns"])), ("x-ferry-hash", row["hash"])]},
            None,
            len(payload),
        )
        key = row["subject"]
        try:
            seq = self.ch.publish(self.opts.exchange or "", key, header, payload)
        except BrokerUnavailable:  # the broker closed the connection (write refuses at once)
            await self._reconnect()
            seq = self.ch.publish(self.opts.exchange or "", key, header, payload)
        if not self.opts.confirms:
            self.record(row)
            if seq % 256 == 0:
                await self.conn.drain()
            return
        self.pending[seq] = row
        self.inflight[0] += 1
        while len(self.pending) > 2000:
            self.space.clear()
            await self.conn.drain()
            try:
                await asyncio.wait_for(self.space.wait(), self.opts.give_up_after)
            except TimeoutError:
                break

    async def close(self) -> None:
        deadline = time.monotonic() + self.opts.give_up_after
        with contextlib.suppress(Exception):
            await self.conn.drain()
        while self.pending and time.monotonic() < deadline and not self.conn.closed:
            await asyncio.sleep(0.01)
        for row in self.pending.values():  # never confirmed
            row["outcome"], row["error"] = "error", f"no confirm ({self.conn.closed or 'timeout'})"
            self.record(row)
        self.pending.clear()
        await self.conn.close()
