"""The data plane's NATS header block parser and encoder agree with nats-py's (the oracle)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client

from ferry.brokers.nats.reader import Range, ReadConfig, read_rows
from ferry.brokers.nats.wire import Msg
from ferry.brokers.nats.writer import WriteConfig, _messages
from ferry.headers import encode_headers, header_value, parse_headers

keys = st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"), min_size=1, max_size=20)
values = st.text(st.characters(exclude_categories=("Cs", "Cc", "Zl", "Zp")), max_size=40).map(str.strip)


def nats_py(block: bytes) -> dict[str, str]:
    return asyncio.run(Client()._process_headers(block)) or {}


@given(st.dictionaries(keys, values, max_size=8))
def test_round_trip_matches_nats_py(headers: dict[str, str]) -> None:
    block = encode_headers(headers)
    assert parse_headers(block) == nats_py(block) == headers


@pytest.mark.parametrize(
    "block",
    [
        b"NATS/1.0 503\r\n\r\n",
        b"NATS/1.0 404 No Messages\r\n\r\n",
        b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 3\r\n\r\n",
        b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 1016\r\nNats-Last-Stream: 1024\r\n\r\n",
        b"NATS/1.0\r\nNats-Msg-Id: a:1\r\nbad line\r\nx y: z\r\nK:v\r\n\r\n",
    ],
)
def test_status_lines_and_odd_lines_match_nats_py(block: bytes) -> None:
    assert parse_headers(block) == nats_py(block)


special = st.sampled_from(["Nats-Msg-Id", "Ferry-Source", "Ferry-Source-Seq", "Ferry-Origin-Site", "Ferry-Origin-Seq"])
plain_keys = keys.filter(lambda k: not k.startswith("Nats-Expected"))  # the reader drops those
row_headers = st.dictionaries(st.one_of(plain_keys, special), values, max_size=6)
configs = st.builds(
    WriteConfig,
    cluster=st.just("{}"),
    name=st.just("west"),
    stream=st.sampled_from([None, "DEST"]),
    subject_prefix=st.sampled_from(["", "relay."]),
    origin_headers=st.booleans(),
    origin_site=st.sampled_from(["", "nyc"]),
)


@given(configs, row_headers, st.integers(1, 10**12), st.sampled_from(["east/S", "", None]))
def test_a_received_header_block_is_published_as_its_parsed_headers_would_be(
    cfg: WriteConfig, headers: dict[str, str], seq: int, source: str | None
) -> None:
    """A copy passes a message's header block on with lines added instead of parsing and encoding
    it again: the headers it publishes are the same either way."""
    assert_published_as_parsed(cfg, encode_headers(headers), seq, source)


def assert_published_as_parsed(cfg: WriteConfig, block: bytes, seq: int, source: str | None = "east/S") -> None:
    """What is published for a row holding `block` as received is what is for its parsed headers."""
    headers = parse_headers(block)
    make = _messages(cfg)
    raw = make(("a.b", b"x", block, header_value(block, b"Nats-Msg-Id"), source, seq))
    parsed = make(("a.b", b"x", headers, headers.get("Nats-Msg-Id"), source, seq))
    assert raw[:2] == parsed[:2] and raw[3] == parsed[3]
    published = {**raw[2], "Nats-Msg-Id": raw[3]} if isinstance(raw[2], dict) else parse_headers(raw[2])
    assert published == {**parsed[2], "Nats-Msg-Id": parsed[3]}


spaced = special.flatmap(lambda k: st.sampled_from([k, f"{k} ", f" {k}"]))
lines = st.lists(st.tuples(st.one_of(plain_keys, spaced), values), max_size=6)


@given(configs, lines, st.sampled_from(["\r\n", ""]))
def test_a_received_block_with_repeated_or_spaced_keys_is_published_as_parsed(
    cfg: WriteConfig, pairs: list[tuple[str, str]], end: str
) -> None:
    """Blocks as other clients may write them (a key twice, spaces around a key, a missing last
    line end) publish what the parsed headers would, and a relay leaves out the same messages."""
    block = ("NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in pairs) + end).encode()
    assert_published_as_parsed(cfg, block, 7)

    async def relayed() -> list[tuple[Any, ...]]:
        async def lists() -> AsyncIterator[list[tuple[Msg, int, int]]]:
            yield [(Msg("a.b", "", b"x", raw=block), 7, 0)]

        rcfg = ReadConfig(cluster="{}", name="east", streams=("S",))
        return [row async for rows in read_rows(rcfg, Range("S", 7, 7), lists(), relayed=False) for row in rows]

    assert len(asyncio.run(relayed())) == (0 if "Ferry-Origin-Site" in parse_headers(block) else 1)


def _frames() -> tuple[bytes, list[tuple[str, str, bytes, bytes | None]]]:
    """What a server sends: messages with and without headers and reply subjects, a PING, one
    larger than a read (256 kB), a status message; and the (subject, reply, data, raw) expected."""
    want: list[tuple[str, str, bytes, bytes | None]] = []
    out = [b"INFO {}\r\n"]
    for i, size in enumerate([0, 1, 100, 300_000, 5, 1_000_000, 2]):
        body = bytes([65 + i % 26]) * size
        reply = f"$JS.ACK.S.C.1.{i}.{i}.17{i}.0" if i % 2 else ""
        if i % 3 == 0:
            out.append(b"MSG s.%d 1 %s%d\r\n%s\r\n" % (i, reply.encode() + b" " if reply else b"", size, body))
            want.append((f"s.{i}", reply, body, None))
        else:
            raw = encode_headers({"Nats-Msg-Id": f"m{i}"})
            head = b"HMSG s.%d 1 %s%d %d\r\n" % (i, reply.encode() + b" " if reply else b"", len(raw), len(raw) + size)
            out.append(head + raw + body + b"\r\n")
            want.append((f"s.{i}", reply, body, raw))
        out.append(b"PING\r\nMSG other 2 3\r\nabc\r\n")  # sid 2: nobody's
    status = b"NATS/1.0 404 No Messages\r\n\r\n"
    out.append(b"HMSG _INBOX.x 1 %d %d\r\n%s\r\n" % (len(status), len(status), status))
    want.append(("_INBOX.x", "", b"", status))
    return b"".join(out), want


@pytest.mark.parametrize("chunk", [1, 7, 4096, 262_144, 10_000_000])
def test_the_wire_parses_messages_however_the_bytes_arrive(chunk: int) -> None:
    from ferry.brokers.nats.wire import Wire, _Sub
    from ferry.topology import NatsCluster

    data, want = _frames()
    cluster = NatsCluster.model_validate({"kind": "nats", "brokers": [{"name": "n", "url": "nats://127.0.0.1:1"}]})

    async def run() -> tuple[list[Msg], list[bytes]]:
        w = Wire(cluster, "t", "t")
        got: list[Msg] = []
        sent: list[bytes] = []
        w._write = sent.append  # type: ignore[method-assign]
        w._subs[1] = _Sub(w, 1, ">", got.append)
        reader = asyncio.StreamReader()
        for i in range(0, len(data), chunk):
            reader.feed_data(data[i : i + chunk])
        reader.feed_eof()
        await w._read_loop(reader)
        return got, sent

    got, sent = asyncio.run(run())
    assert [(m.subject, m.reply, m.data, m.raw) for m in got] == want
    assert got[-1].headers == {"Status": "404", "Description": "No Messages"}
    assert sent == [b"PONG\r\n"] * (len(want) - 1)  # every PING answered


def test_a_process_that_opens_a_wire_collects_young_objects_less_often() -> None:
    import gc

    from ferry.brokers.nats.wire import _collect_less

    before = gc.get_threshold()
    try:
        cases = [((700, 10, 10), (10_000, 10, 10)), ((0, 5, 5), (0, 5, 5)), ((50_000, 3, 4), (50_000, 3, 4))]
        for given, want in cases:
            gc.set_threshold(*given)
            _collect_less()
            assert gc.get_threshold() == want
    finally:
        gc.set_threshold(*before)
