"""A minimal NATS connection for moving messages fast (private to the data plane).

Why not nats-py here: measured on the lab, nats-py spends about 50 µs of
Python per message that is pulled from one stream and published to another
with its ack (an awaited header parser, a ``Msg`` object, a queue and a task
switch per delivered message and per ack), which capped a relay near 5,000
msg/s and a copy near 20,000 per core. The hot path only pulls, publishes and
matches acks, so this connection speaks the text protocol directly: one parse
loop, synchronous callbacks, writes gathered into one send per event-loop pass.
Control requests (stream info, consumer create/delete) stay on nats-py.

It offers the part of nats-py's ``Client`` that :class:`ferry.brokers.nats.publish.Publisher`,
the jetstream reader and ``ferry load`` use (``new_inbox``, ``subscribe`` with a
*plain* callback, ``publish``, ``flush``, ``is_connected``, ``close``) and, like
nats-py, reconnects to the next server and subscribes again when its server
goes away, holding what is published meanwhile (up to 8 MB) until it is
connected again; what was in flight is the caller's to retry (acks time out,
pull requests are re-issued).

Supported: every credential of the topology (user and password, .creds file,
nkey seed, token: :mod:`ferry.brokers.nats.auth`), TLS as the cluster's ``tls``
block says (or when a server requires it: verified against the system's CAs),
headers, no-responders status messages, server PINGs. Not supported: TLS
before the server's INFO (``handshake_first``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import random
import secrets
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

from ferry.brokers.nats import auth
from ferry.errors import AuthError, BrokerUnavailable, ConfigError
from ferry.headers import encode_headers, parse_headers
from ferry.topology import NatsCluster

__all__ = ["Msg", "Wire", "wire"]


class Msg:
    """A delivered message; the attributes nats-py's ``Msg`` has that ferry reads. `raw` is its
    header block as it came (None: no headers, or edited ones), parsed on first use of ``headers``;
    a copy between streams passes it on as it is."""

    __slots__ = ("_headers", "data", "raw", "reply", "subject")

    def __init__(
        self, subject: str, reply: str, data: bytes, headers: dict[str, str] | None = None, raw: bytes | None = None
    ) -> None:
        self.subject, self.reply, self.data, self._headers, self.raw = subject, reply, data, headers, raw

    @property
    def headers(self) -> dict[str, str] | None:
        if self._headers is None and self.raw is not None:
            self._headers = parse_headers(self.raw)
        return self._headers


def _collect_less() -> None:
    """Python's cycle collector looks at the young objects every 700 new containers (objects,
    tuples, lists); moving a message makes several, none of them part of a cycle. Every 10,000
    instead: a relay's Python moved a message in 5.4-5.6 µs instead of 6.1-6.3 (its read task
    in-process on the lab). Set once for the whole process that opens a Wire (a Spark worker,
    which Spark reuses for later tasks, `ferry load`, `ferry move`'s guard); cyclic garbage lives
    a little longer."""
    young, *older = gc.get_threshold()
    if 0 < young < 10_000:
        gc.set_threshold(10_000, *older)


class _Sub:
    def __init__(self, wire: Wire, sid: int, subject: str, cb: Callable[[Msg], None]) -> None:
        self.wire, self.sid, self.subject, self.cb = wire, sid, subject, cb

    async def unsubscribe(self) -> None:
        if self.wire._subs.pop(self.sid, None) is not None and self.wire.is_connected:
            self.wire._write(b"UNSUB %d\r\n" % self.sid)


class Wire:
    """One NATS connection on the text protocol (see the module docstring)."""

    sync_callbacks = True  # subscribe() takes plain functions, not coroutines

    HOLD_LIMIT = 8_000_000  # bytes of publishes kept while reconnecting (nats-py keeps 2 MB)

    def __init__(
        self,
        cluster: NatsCluster,
        name: str,
        client_name: str,
        urls: list[str] | None = None,
        prefer: str = "",
        avoid: str = "",
    ) -> None:
        self.cluster, self.name, self.client_name = cluster, name, client_name
        self.urls = urls or cluster.urls  # e.g. a load balancer's address instead of the servers'
        self._subs: dict[int, _Sub] = {}
        self._next_sid = 0
        self._out: list[bytes] = []
        self._held: list[bytes] = []  # published while disconnected, sent after the reconnect
        self._held_size = 0
        self._pongs: deque[asyncio.Future[None]] = deque()
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._connected = False
        self._closed = False
        self.error = ""  # why it closed, when not by close()
        # seconds to wait after a small read before the next: a listener that may hear late (the
        # guard) reads many messages a time (at 10,000 msg/s from four producers it read about
        # one a time, each read with its event-loop turn)
        self.gather = 0.0
        self.denied: deque[str] = deque(maxlen=100)  # the server's permission violations (the last ones)
        self._inbox = f"_INBOX.{secrets.token_hex(11)}"
        self.server_name = self.server_cluster = ""  # the server connected to, and its cluster (its INFO)
        self._deaf = 0.0  # seconds between losing a connection and the next one (see deaf_s)
        self._dropped: float | None = None
        # `urls` given: in their order. Else first the server named `prefer` (a stream's or consumer's
        # leader: no hop between servers for every message), else any but the one named `avoid` (a
        # guard's: not the leader that may die with what it alone heard), spreading tasks over the
        # servers as nats-py does
        names = [b.name for b in cluster.brokers] if not urls else []
        others = [i for i, n in enumerate(names) if n != avoid] if avoid in names and len(names) > 1 else []
        if urls:
            self._server = 0
        elif prefer in names:
            self._server = names.index(prefer)
        else:
            self._server = random.choice(others) if others else random.randrange(len(self.urls))

    @classmethod
    async def open(
        cls,
        cluster: NatsCluster,
        name: str = "",
        client_name: str = "ferry-data",
        urls: list[str] | None = None,
        timeout: float = 30.0,
        prefer: str = "",
        avoid: str = "",
    ) -> Wire:
        """A connected Wire (close it when done); to the server named `prefer` first if it is one of
        the cluster's (the topology's broker names are the servers' ``server_name``), else not to
        the one named `avoid` while there is another."""
        _collect_less()
        w = cls(cluster, name or "nats", client_name, urls, prefer, avoid)
        await w.connect(timeout)
        return w

    # -- the nats-py subset ------------------------------------------------------------

    @property
    def is_connected(self) -> bool:
        return self._connected and not self._closed

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def deaf_s(self) -> float:
        """Seconds this connection was down after it first connected (all a subscriber missed)."""
        return self._deaf + (time.monotonic() - self._dropped if self._dropped is not None else 0.0)

    def new_inbox(self) -> str:
        return f"{self._inbox}.{secrets.token_hex(6)}"

    async def subscribe(self, subject: str, cb: Callable[[Msg], None], **_: Any) -> _Sub:
        self._next_sid += 1
        sub = self._subs[self._next_sid] = _Sub(self, self._next_sid, subject, cb)
        if self.is_connected:
            self._write(b"SUB %s %d\r\n" % (subject.encode(), sub.sid))
        return sub

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | bytes | None = None
    ) -> None:
        self.publish_raw(subject.encode(), reply.encode(), encode_headers(headers) if headers else b"", payload)
        if self._writer and self._writer.transport.get_write_buffer_size() > 8_000_000:
            self._flush()
            await self._writer.drain()

    def publish_raw(self, subject: bytes, reply: bytes, header: bytes, payload: bytes) -> None:
        """Queue one message (header: an encoded block, or b""); while reconnecting, hold it (up to
        HOLD_LIMIT bytes, then refuse it) and send it once connected again, as nats-py does."""
        if header:
            data = b"HPUB %s %s %d %d\r\n%s%s\r\n" % (
                subject,
                reply,
                len(header),
                len(header) + len(payload),
                header,
                payload,
            )
        else:
            data = b"PUB %s %s %d\r\n%s\r\n" % (subject, reply, len(payload), payload)
        if self.is_connected:
            self._write(data)
        elif self._closed or self._held_size + len(data) > self.HOLD_LIMIT:
            why = (self.error or "closed") if self._closed else "buffer full"
            raise BrokerUnavailable(f"{self.name}: not connected ({why})")
        else:
            self._held.append(data)
            self._held_size += len(data)

    async def flush(self, timeout: float = 5.0) -> None:
        """Wait until the server has read everything sent so far (a PING answered; while
        reconnecting, the next server)."""
        pong = asyncio.get_running_loop().create_future()
        self._pongs.append(pong)
        if self.is_connected:
            self._write(b"PING\r\n")
        else:  # after what is held: answered once the next server has read it
            self._held.append(b"PING\r\n")
        await asyncio.wait_for(pong, timeout)

    async def close(self) -> None:
        self._closed = True
        if self._task:
            self._task.cancel()
            await asyncio.wait({self._task})  # not `await`: its CancelledError would hide a cancel of this caller
        if self._writer:
            with contextlib.suppress(Exception):
                self._flush()
                self._writer.close()

    # -- connecting ----------------------------------------------------------------------

    async def connect(self, timeout: float) -> None:
        """Connect to the first server that answers; then keep the connection up in the background."""
        first = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(first))
        try:
            await asyncio.wait_for(asyncio.shield(first), timeout)
        except TimeoutError:
            await self.close()
            raise BrokerUnavailable(
                f"cluster {self.name!r}: no server answered at {', '.join(self.urls)} within {timeout:.0f}s"
            ) from None
        except BaseException:
            await self.close()
            raise

    async def _run(self, first: asyncio.Future[None]) -> None:
        """Connect, read until the connection drops, reconnect to the next server; forever."""
        while not self._closed:
            url = self.urls[self._server % len(self.urls)]
            self._server += 1
            try:
                reader, writer = await asyncio.wait_for(self._handshake(url), 2.0)
            except (AuthError, ConfigError) as exc:
                if not first.done():
                    first.set_exception(exc)
                return
            except (OSError, TimeoutError, BrokerUnavailable, ValueError):
                await asyncio.sleep(0.25 if self._server % len(self.urls) == 0 else 0)
                continue
            if self._closed:  # closed during the handshake: Python 3.11's wait_for can swallow the cancel
                writer.close()
                return
            self._writer = writer
            for sub in self._subs.values():  # again after a reconnect
                self._write(b"SUB %s %d\r\n" % (sub.subject.encode(), sub.sid))
            self._out += self._held
            self._held.clear()
            self._held_size = 0
            self._connected = True
            if self._out:  # _write schedules a send only when its queue was empty: held publishes go now
                asyncio.get_running_loop().call_soon(self._flush)
            if self._dropped is not None:
                self._deaf, self._dropped = self.deaf_s, None
            if not first.done():
                first.set_result(None)
            try:
                await self._read_loop(reader)
            except (OSError, asyncio.IncompleteReadError):
                pass
            except Exception as exc:  # a bug (a subscriber's callback, the parser): fail what follows, don't hang
                self._closed, self.error = True, f"reading failed: {type(exc).__name__}: {exc}"
            self._connected = False
            self._dropped = time.monotonic()
            self.server_name = self.server_cluster = ""
            self._out.clear()
            while self._pongs:
                self._pongs.popleft().cancel()
            with contextlib.suppress(Exception):
                writer.close()

    async def _handshake(self, url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname or "127.0.0.1", parts.port or 4222)
        try:
            line = await reader.readline()
            if not line.startswith(b"INFO "):
                raise BrokerUnavailable(f"{self.name}: {url} did not greet with INFO")
            info = json.loads(line[5:])
            tls = auth.tls_context(self.cluster, url) or (
                ssl.create_default_context() if info.get("tls_required") else None
            )
            if tls and not info.get("tls_required") and not info.get("tls_available"):
                raise ConfigError(f"cluster {self.name!r}: {url}: TLS asked for, but the server does not speak it")
            if tls:  # NATS greets in plaintext, then the client starts TLS
                server_name = auth.server_name(self.cluster, url) or parts.hostname
                try:
                    await writer.start_tls(tls, server_hostname=server_name)
                except ssl.SSLError as exc:
                    raise ConfigError(f"cluster {self.name!r}: {url}: {auth.tls_error(exc)}") from None
            options: dict[str, Any] = {
                "verbose": False,
                "pedantic": False,
                "lang": "python",
                "version": "ferry",
                "protocol": 1,
                "headers": True,
                "no_responders": True,
                "name": self.client_name,
            }
            creds = self.cluster.credentials
            options |= auth.connect_fields(creds, info.get("nonce", ""))
            writer.write(b"CONNECT %s\r\nPING\r\n" % json.dumps(options).encode())
            while True:
                line = await reader.readline()
                if line.startswith(b"PONG"):
                    self.server_name = info.get("server_name", "")
                    self.server_cluster = info.get("cluster", "")
                    return reader, writer
                if line.startswith(b"-ERR"):
                    text = line[4:].strip().strip(b"'").decode()
                    if "authorization" in text.lower():
                        raise AuthError(
                            f"cluster {self.name!r}: authorization violation for "
                            f"{creds.identity if creds else 'no credentials'}"
                        )
                    raise BrokerUnavailable(f"{self.name}: {url}: {text}")
                if not line:
                    raise BrokerUnavailable(f"{self.name}: {url} closed the connection")
        except BaseException:
            writer.close()
            raise

    # -- bytes out ------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        """Queue bytes; they leave in one send per event-loop pass (not one syscall per message)."""
        self._out.append(data)
        if len(self._out) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        if self._out and self._writer and self._connected:
            self._writer.write(b"".join(self._out))
        self._out.clear()

    # -- bytes in -------------------------------------------------------------------------

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        """Parse what the server sends. The buffer is bytes, so a message's parts are single slices
        (no bytearray slice copied again); a message larger than a read is gathered before parsing."""
        buf, parts, need = b"", [], 0
        subs = self._subs
        small = False
        while True:
            if small:  # a trickle: let more arrive, and read it in one go
                await asyncio.sleep(self.gather)
            data = await reader.read(262144)
            if not data:
                return
            small = len(data) < 65536 and self.gather > 0
            if need:  # the rest of a large message: join once it is all here
                parts.append(data)
                need -= len(data)
                if need > 0:
                    continue
                buf, parts, need = b"".join(parts), [], 0
            else:
                buf = buf + data if buf else data
            pos, end = 0, len(buf)
            while True:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                op = buf[pos]
                if op == 77 or op == 72:  # MSG, HMSG (nothing else the server sends starts so)
                    args = buf[pos:eol].split(b" ")
                    start = eol + 2
                    stop = start + int(args[-1])
                    if stop + 2 > end:
                        need = stop + 2 - end  # the payload has not all arrived
                        break
                    pos = stop + 2
                    sub = subs.get(int(args[2]))
                    if sub is None:
                        continue
                    if op == 72:
                        mid = start + int(args[-2])
                        reply = args[3].decode() if len(args) == 6 else ""
                        sub.cb(Msg(args[1].decode(), reply, buf[mid:stop], None, buf[start:mid]))  # not raw=: slower
                    else:
                        sub.cb(Msg(args[1].decode(), args[3].decode() if len(args) == 5 else "", buf[start:stop]))
                    continue
                line = buf[pos:eol]
                pos = eol + 2
                if line == b"PING":
                    self._write(b"PONG\r\n")
                elif line == b"PONG" and self._pongs:
                    pong = self._pongs.popleft()
                    if not pong.done():  # else its flush timed out
                        pong.set_result(None)
                elif line.startswith(b"-ERR"):
                    text = line[4:].strip().strip(b"'").decode()
                    if not text.lower().startswith("permissions violation"):
                        return  # the server closes the connection after any other error
                    self.denied.append(text)
            buf = buf[pos:]
            if need:  # `need` more bytes finish the message at the head of buf
                parts, buf = [buf], b""


@contextlib.asynccontextmanager
async def wire(
    cluster: NatsCluster, name: str = "", client_name: str = "ferry-data", timeout: float = 30.0, prefer: str = ""
) -> AsyncIterator[Wire]:
    """A connected :class:`Wire` to `cluster` (see :meth:`Wire.open`), closed on exit."""
    w = await Wire.open(cluster, name, client_name, timeout=timeout, prefer=prefer)
    try:
        yield w
    finally:
        await w.close()
