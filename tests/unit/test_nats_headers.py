"""The data plane's NATS header block parser and encoder agree with nats-py's (the oracle)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client

from ferry.pipeline._nats import encode_headers, parse_headers

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
