"""The capture guard: listen to a stream's subjects while something moves it, then re-publish
exactly what the stream missed.

While a stream moves (``ferry move``) or its subjects change owner (``ferry
partition apply --execute``), the guard subscribes to the stream's subjects and
appends what it hears to an Arrow file (memory stays bounded). Afterwards
:func:`reconcile` reads the stream from the sequence the operation began at and
re-publishes exactly the captured messages the stream does not hold, in capture
order, marked ``Ferry-Reinjected: <operation id>``. Identity is ``Nats-Msg-Id``
when present (the re-publish keeps it, so the stream's de-duplication absorbs a
producer's own late retry), else subject + headers + payload, counted as a
multiset.

Limits (said plainly): the guard only hears what reaches a subscription on its
connection, so messages published while it was disconnected or not running are
not guarded; the comparison covers the stream from the operation's first
sequence, so a stream whose limits discard messages meanwhile may see a
discarded one re-published; two identical messages without ``Nats-Msg-Id`` are
told apart only by count.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from bisect import bisect_left, bisect_right
from collections import Counter
from itertools import pairwise
from pathlib import Path
from statistics import median
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from nats.aio.client import Client

from ferry.brokers.nats.jsapi import stream_info, ts_ns
from ferry.brokers.nats.publish import Publisher
from ferry.brokers.nats.wire import Msg as WireMsg
from ferry.brokers.nats.wire import Wire
from ferry.errors import AuthError, BrokerUnavailable, FerryError
from ferry.headers import (
    MSG_ID,
    REINJECTED,
    SOURCE_HDR,
    SOURCE_SEQ_HDR,
    encode_headers,
    header_value,
    parse_headers,
)
from ferry.jobs.shared.events import Emit
from ferry.topology import NatsCluster

CAPTURE_SCHEMA = pa.schema(
    [
        ("recv_ns", pa.int64()),
        ("subject", pa.string()),
        ("header_block", pa.binary()),  # as it came (null: none): parsed only to re-publish
        ("payload", pa.binary()),
        ("identity", pa.string()),  # computed as heard, so the comparison after the move hashes only the stream
    ]
)


# -- capture guard --------------------------------------------------------------------------------

GATHER = 0.005  # seconds the guard lets a trickle of messages gather between reads (Wire.gather)


def identity(subject: str, headers: dict[str, str] | None, payload: bytes) -> str:
    """A message's identity: its Nats-Msg-Id, else a digest of subject, headers and payload.

    What ferry's data plane adds to a copy (``Ferry-Source*``, and the ``<source>:<seq>``
    id it gives a message that had none) is not part of the identity, so a copy and
    the original heard live are the same message.
    """
    headers = headers or {}
    msg_id = headers.get(MSG_ID)
    if msg_id and msg_id != f"{headers.get(SOURCE_HDR)}:{headers.get(SOURCE_SEQ_HDR)}":
        return "id:" + msg_id
    h = hashlib.blake2b(digest_size=16)
    h.update(subject.encode() + b"\0")
    for k, v in sorted(headers.items()):
        if k not in (REINJECTED, MSG_ID, SOURCE_HDR, SOURCE_SEQ_HDR) and not k.startswith("Nats-Expected"):
            h.update(f"{k}\0{v}\0".encode())
    h.update(payload)
    return "c:" + h.hexdigest()


def identity_of(m: WireMsg) -> str:
    """``identity(m.subject, m.headers, m.data)`` for a message off the data plane's connection,
    without parsing its header block when that holds one plain ``Nats-Msg-Id`` (and no
    ``Ferry-Source``): then the identity is that id. Half the time of reading a stream back
    went into parsing headers."""
    raw = m.raw
    if raw is not None and raw.count(b"Nats-Msg-Id") == 1 and b"Ferry-Source" not in raw:
        msg_id = header_value(raw, MSG_ID.encode())
        if msg_id:
            return "id:" + msg_id
    return identity(m.subject, m.headers, m.data)


def _deaf(violation: str) -> AuthError:
    return AuthError(
        f"the capture guard may not listen to the stream's subjects: the server says "
        f"{violation!r} (ferry's user must be allowed to subscribe to them)"
    )


async def check_listen(cluster: NatsCluster, subjects: list[str]) -> None:
    """Raise AuthError when ferry's user may not subscribe to `subjects`, where a capture guard
    will listen: for an operation that changes things before its guard starts."""
    conn = await Wire.open(cluster, client_name="ferry-guard")
    try:
        for s in subjects:
            await conn.subscribe(s, lambda m: None)
        await conn.flush(timeout=5)
        if conn.denied:
            raise _deaf(conn.denied[0])
    finally:
        await conn.close()


class Guard:
    """Listens to a stream's subjects and appends what it hears to an Arrow IPC file.

    It has a connection of its own, the data plane's lean one (``Wire``): at 24,000 msg/s nats-py
    took more than a core, on the same event loop and connection as the move's polls, which
    then answered late."""

    def __init__(self, cluster: NatsCluster, subjects: list[str], path: Path, flush_every: float = 0.2) -> None:
        self.cluster, self.subjects, self.path, self.flush_every = cluster, subjects, path, flush_every
        self.rows: dict[str, list[Any]] = {n: [] for n in CAPTURE_SCHEMA.names}
        self._conn: Wire | None = None
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._sink: Any = None
        self._flusher: asyncio.Task[None] | None = None
        self.waited = False  # whether start() waited blindly for gateway interest
        self.server = ""  # the server it listened on (the first)
        self.deaf_s = 0.0  # seconds its connection was down while it listened: what it cannot have heard

    async def start(self, led_in: str = "", servers: dict[str, dict[str, str]] | None = None, avoid: str = "") -> None:
        """Listen; return once every server that may take a publish passes the subjects on to the guard.

        `led_in` names the NATS cluster that leads the stream: when the guard's server is in it,
        the other clusters' servers already send it the stream's subjects (the stream listens on
        them there). Otherwise they learn the guard's interest through the gateways: then each
        server of the other clusters in `servers` (name -> cluster and client URL, as
        :func:`survey` finds them) is probed too. When one of them cannot be (no URL, no
        connection, no probe heard) or `servers` is not given, the guard waits until 0.3 s have
        passed since it subscribed (`self.waited`), the time gateway interest took on the lab.
        It listens on a server other than `avoid` (the stream's leader) where the cluster has one:
        a leader that dies takes with it what only it had heard, and the guard would be deaf until
        it reconnected.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # messages: for ferry's user only
        self.path.touch(mode=0o600)
        self._sink = pa.OSFile(str(self.path), "wb")
        self._writer = pa.ipc.new_stream(self._sink, CAPTURE_SCHEMA)
        try:
            self._conn = await Wire.open(self.cluster, client_name="ferry-guard", avoid=avoid)
            self._conn.gather = GATHER
            self.server = self._conn.server_name
            subscribed = time.monotonic()
            for s in self.subjects:
                await self._conn.subscribe(s, self._on_msg)
            await self._conn.flush(timeout=5)  # the server answers a subscription it refuses before this
            if self._conn.denied:  # a guard that hears nothing would prove nothing
                raise _deaf(self._conn.denied[0])
            own = self._conn.server_cluster
            remote = [s["url"] for s in (servers or {}).values() if s["cluster"] != own]
            checks = [self._reached(self.cluster.urls)]
            if own != led_in:  # the other clusters learn of the guard through the gateways
                probeable = bool(remote) and all(remote)  # a server without a client URL cannot be probed
                checks.append(self._reached(remote, remote=True) if probeable else asyncio.sleep(0, False))
            self.waited = not all(await asyncio.gather(*checks))
            if self.waited:
                await asyncio.sleep(max(0.0, subscribed + 0.3 - time.monotonic()))
        except BaseException:
            await self.stop()
            raise
        self._flusher = asyncio.create_task(self._flush_loop())

    async def _reached(self, urls: list[str], remote: bool = False, timeout: float = 2.0) -> bool:
        """Whether each server at `urls` routes the guard's subjects to it. A server passes a
        connection's subscriptions on to the others in order (to its routes and gateways), so a
        probe subject subscribed after them (in the guard's inbox, which a user may subscribe to)
        is published from every server until the guard hears it from each, for `timeout` seconds
        at most (a user may be denied publishing there). A server of the guard's own cluster that
        ferry cannot connect to is left out (no producer reaches it either); one of another
        cluster (`remote`: another site's network, perhaps) fails the check, after 0.5 s at most."""
        assert self._conn is not None
        heard: set[str] = set()
        probe = self._conn.new_inbox()
        await self._conn.subscribe(probe, lambda m: heard.add(m.data.decode()))
        await self._conn.flush(timeout=5)

        async def reach(url: str) -> bool:
            try:
                w = await Wire.open(
                    self.cluster, urls=[url], client_name="ferry-guard-probe", timeout=0.5 if remote else 2
                )
            except BrokerUnavailable:
                return not remote
            except FerryError:  # another cluster's TLS or credentials, not the guard's: wait instead
                if remote:
                    return False
                raise
            try:
                async with asyncio.timeout(timeout):
                    while url not in heard:
                        w.publish_raw(probe.encode(), b"", b"", url.encode())
                        await asyncio.sleep(0.01)
                return True
            except (TimeoutError, FerryError):
                return False
            finally:
                await w.close()

        return all(await asyncio.gather(*(reach(u) for u in urls)))

    def _on_msg(self, m: WireMsg) -> None:
        """Every message heard, at the rate producers publish: its header block is kept as it came
        (parsing it, and Arrow's map of the pairs, took a seventh of the guard's CPU)."""
        raw = m.raw
        if raw is not None and b"Ferry-Reinjected" in raw:
            return  # a copy ferry re-published (acked, with retries): never a message to guard twice
        r = self.rows
        r["recv_ns"].append(time.time_ns())
        r["subject"].append(m.subject)
        r["header_block"].append(raw)
        r["payload"].append(m.data)
        r["identity"].append(identity_of(m))

    def _flush(self) -> None:
        if self.rows["recv_ns"] and self._writer:
            batch = pa.RecordBatch.from_pydict(self.rows, schema=CAPTURE_SCHEMA)
            self.rows = {n: [] for n in CAPTURE_SCHEMA.names}
            self._writer.write_batch(batch)
            self._sink.flush()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_every)
            self._flush()

    async def stop(self) -> None:
        if self._conn:
            with contextlib.suppress(Exception):
                await self._conn.flush(timeout=5)  # what the server sent before now has been heard
            await self._conn.close()
            self.deaf_s = round(self._conn.deaf_s, 3)
            self._conn = None
        if self._flusher:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        self._flush()
        if self._writer:
            self._writer.close()
            self._sink.close()
            self._writer = None


STANDBY = "standby"  # the first word of a standby guard's capture file


def read_captures(directory: Path) -> pa.Table:
    """Every capture file of an operation, a killed writer's tail dropped, in the order heard.

    The files of its drivers (``capture-*``: one per run, one after the other) add up. A standby
    guard (``standby-<host>-<pid>-*``, ``ferry serve``'s, :mod:`ferry.jobs.move.standby`) listened at
    the same time as they did: its rows count only beyond what the drivers heard, identity by
    identity (each identity as often as the guard that heard it most often)."""
    lineages: dict[str, list[pa.RecordBatch]] = {}
    for f in sorted(directory.glob("*.arrow")):
        # standby-<host>-<pid>-<time>.arrow: one lineage per standby process
        lineage = f.name.rsplit("-", 1)[0] if f.name.startswith(STANDBY + "-") else "capture"
        lineages.setdefault(lineage, []).extend(_batches(f))
    tables = [_in_order(pa.Table.from_batches(b, schema=CAPTURE_SCHEMA)) for _, b in sorted(lineages.items())]
    if len(tables) < 2:
        return tables[0] if tables else CAPTURE_SCHEMA.empty_table()
    heard: Counter[str] = Counter(tables[0].column("identity").to_pylist())
    kept = [tables[0]]
    for table in tables[1:]:
        seen: Counter[str] = Counter()
        rows = []
        for row, ident in enumerate(table.column("identity").to_pylist()):
            seen[ident] += 1
            if seen[ident] > heard[ident]:
                rows.append(row)
        heard |= seen  # the larger count of each
        kept.append(table.take(pa.array(rows, pa.int64())))
    return _in_order(pa.concat_tables(kept))


def _batches(f: Path) -> list[pa.RecordBatch]:
    batches = []
    with contextlib.suppress(pa.ArrowInvalid, OSError):
        reader = pa.ipc.open_stream(pa.memory_map(str(f)))
        while True:
            try:
                batch = reader.read_next_batch()
            except (StopIteration, pa.ArrowInvalid, OSError):
                break
            if "header_block" not in batch.schema.names:  # an older ferry's (a move resumed after an upgrade)
                batch = _upgraded(batch)
            batches.append(batch)
    return batches


def _upgraded(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A batch of an older ferry's capture (headers as pairs; before that, no identity) in this one's schema."""
    d = batch.to_pydict()
    heads = [dict(h) if h else None for h in d["headers"]]
    ids = d.get("identity") or [identity(s, h, p) for s, h, p in zip(d["subject"], heads, d["payload"], strict=True)]
    blocks = [encode_headers(h) if h else None for h in heads]
    return pa.RecordBatch.from_pydict({**d, "header_block": blocks, "identity": ids}, schema=CAPTURE_SCHEMA)


def _in_order(table: pa.Table) -> pa.Table:
    recv = table.column("recv_ns")
    if len(recv) > 1 and not pc.all(pc.less_equal(recv[:-1], recv[1:])).as_py():
        table = table.sort_by("recv_ns")  # several files, or the clock stepped back: a copy of every payload
    return table


class Stored:
    """Reads back what a stream stored, range after range, on one consumer: a range that starts
    where the last one ended goes on with it, so reading the tail after the head sets up nothing."""

    def __init__(self, cluster: NatsCluster, stream: str, operation: str = "") -> None:
        from ferry.brokers.nats.reader import ReadConfig

        self.cfg = ReadConfig(cluster=cluster.model_dump_json(), name="move", streams=(stream,))
        self.stream = stream
        self._reader: Any = None
        # the messages read that `operation` re-published already (a run of it killed after that)
        self.operation = operation
        self.reinjected = 0

    async def since(self, seq0: int, last: int) -> list[tuple[str, int]]:
        """(identity, store time ns) of every message with seq0 < seq <= last."""
        from ferry.brokers.nats.reader import Range, Reader, read_ahead

        if last <= seq0:
            return []
        self._reader = self._reader or await Reader.open(self.cfg, self.stream)
        lists = read_ahead(self._reader.lists(Range(self.stream, seq0 + 1, last, fetch=2000), keep=True))
        out = []
        async with contextlib.aclosing(lists):
            async for got in lists:
                for m, _, ts_ns in got:
                    out.append((identity_of(m), ts_ns))
                    raw = m.raw
                    if raw is not None and b"Ferry-Reinjected" in raw and self.operation:
                        self.reinjected += header_value(raw, REINJECTED.encode()) == self.operation
        return out

    async def __aenter__(self) -> Stored:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._reader:
            await self._reader.close()


def missing(captured: pa.Table, stored: list[tuple[str, int]]) -> tuple[list[int], dict[str, int]]:
    """Row numbers of captured messages the stream does not hold (capture order), and identity -> first row."""
    held = Counter(i for i, _ in stored)
    ids = captured.column("identity").to_pylist()
    first: dict[str, int] = {}
    seen: Counter[str] = Counter()
    out = []
    for row, ident in enumerate(ids):
        first.setdefault(ident, row)
        if ident.startswith("id:"):
            if row == first[ident] and held[ident] == 0:
                out.append(row)  # a re-sent msg id counts once
            continue
        seen[ident] += 1
        if seen[ident] > held[ident]:
            out.append(row)
    return out, first


def unavailable_window(capture_ns: list[int], stored_ns: list[int], offset_ns: int) -> float:
    """Seconds: the longest gap between two stored messages during which publishes were heard.

    `offset_ns` maps capture clock to store clock (median store - capture delay of
    matched messages), so the figure does not depend on the two clocks agreeing.
    """
    if len(stored_ns) < 2 or not capture_ns:
        return 0.0
    s = sorted(stored_ns)
    c = sorted(x + offset_ns for x in capture_ns)
    best = 0
    for a, b in pairwise(s):
        if b - a > best and bisect_left(c, b) > bisect_right(c, a):
            best = b - a
    return best / 1e9


def measured_window(captured: pa.Table, stored: list[tuple[str, int]], first: dict[str, int]) -> float:
    """The unavailability window of a move, the capture clock mapped onto the store clock
    through the messages both saw (`first`: identity -> first capture row, from :func:`missing`)."""
    recv = captured.column("recv_ns").to_pylist()
    when = dict(stored)
    pairs = [when[ident] - recv[row] for ident, row in first.items() if ident in when]
    offset = int(median(pairs)) if pairs else 0
    return unavailable_window(recv, [ts for _, ts in stored], offset)


# -- the move ----------------------------------------------------------------------------------------


def state_root(given: Path | None = None) -> Path:
    """Where ferry keeps capture files: `given`, else $FERRY_STATE_DIR, else ~/.local/state/ferry."""
    if given:
        return given
    env = os.environ.get("FERRY_STATE_DIR")
    return Path(env) if env else Path.home() / ".local" / "state" / "ferry"


async def reconcile(
    cluster: NatsCluster, nc: Client, stream: str, st: dict[str, Any], capture_dir: Path, emit: Emit
) -> dict[str, Any]:
    """Compare what the guard heard with what the stream holds; re-publish what it lacks."""
    stop_ns = time.time_ns()
    # what the stream holds now is read back while the captures are read and it settles, the rest after
    held = max(st["seq0"], (await stream_info(nc, stream))["state"]["last_seq"])
    async with Stored(cluster, stream, st["move_id"]) as reader:
        head = asyncio.ensure_future(reader.since(st["seq0"], held))
        try:
            captured = await asyncio.to_thread(read_captures, capture_dir)
            heard_last = captured["recv_ns"][-1].as_py() if captured.num_rows else 0
            await _settle(nc, stream, stop_ns, heard_last)
            last = (await stream_info(nc, stream))["state"]["last_seq"]
            stored = await head + await reader.since(held, last)
        finally:
            head.cancel()
            await asyncio.gather(head, return_exceptions=True)  # off the reader before it closes
    rows, first = missing(captured, stored)
    window = measured_window(captured, stored, first)
    reinjected = already = 0
    if rows:
        async with Publisher(nc, window=256, ack_timeout=2.0, give_up_after=60.0) as pub:
            for m in captured.take(rows).to_pylist():
                parsed = parse_headers(m["header_block"]) if m["header_block"] else {}
                headers = {k: v for k, v in parsed.items() if not k.startswith("Nats-Expected")}
                headers[REINJECTED] = st["move_id"]
                await pub.publish(m["subject"], m["payload"], headers=headers, msg_id=headers.get(MSG_ID))
            stats = await pub.flush()  # the publisher gives up on what it cannot store
        if stats.failed:
            raise FerryError(f"re-publishing {len(rows)} missed messages: {stats.failed} failed ({stats.errors[:1]})")
        reinjected, already = stats.stored, stats.duplicates
    before = reader.reinjected  # re-published by a run of the operation killed since
    out = {
        "captured": captured.num_rows,
        "missed": len(rows) + before,
        "reinjected": reinjected + before,
        "already_stored": already,  # a producer's own retry got there first (same Nats-Msg-Id)
        "unavailable_s": round(window, 4),
    }
    emit("guard", **out)
    return out


async def _settle(nc: Client, stream: str, stop_ns: int, heard_last: int) -> None:
    """A publish heard just before the guard stopped may still be on its way to the stream: wait
    (2 s at most) until the stream holds something stored after that, or (the producers stopped
    too) until it has stored nothing new for half a second."""
    last_seq, still = -1, 0
    for _ in range(40 if heard_last > stop_ns - 500_000_000 else 0):
        info = await stream_info(nc, stream)
        if ts_ns(info["state"].get("last_ts", "")) > stop_ns + 200_000_000:
            return
        still = still + 1 if info["state"]["last_seq"] == last_seq else 0
        if still >= 10:
            return
        last_seq = info["state"]["last_seq"]
        await asyncio.sleep(0.05)
