"""Raw content-header rewriting keeps every property and typed header (pamqp is the oracle)."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from hypothesis import given
from hypothesis import strategies as st
from pamqp import commands
from pamqp.header import ContentHeader

from ferry.brokers.rabbitmq.queue_io import headers_from_json, headers_to_json
from ferry.brokers.rabbitmq.wire import with_header

keys = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=20)


def _scalars(float_width: int) -> st.SearchStrategy:
    return st.one_of(
        st.booleans(),
        st.integers(-(2**31), 2**31 - 1),
        st.integers(2**40, 2**50),
        st.floats(allow_nan=False, allow_infinity=False, width=float_width),
        st.text(max_size=30),
        st.binary(max_size=20).map(bytearray),
        st.decimals(min_value=-1000, max_value=1000, places=2, allow_nan=False),
        st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(2100, 1, 1)).map(
            lambda d: d.replace(microsecond=0, tzinfo=UTC)
        ),
        st.none(),
    )


def _tables(float_width: int) -> st.SearchStrategy:
    values = st.recursive(
        _scalars(float_width),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
        max_leaves=8,
    )
    return st.dictionaries(keys, values, max_size=6)


wire_tables = _tables(32)  # pamqp sends floats as 32-bit
tables = _tables(64)


def _decode(raw: bytes) -> ContentHeader:
    h = ContentHeader()
    h.unmarshal(raw)
    return h


@given(wire_tables, st.booleans(), st.booleans(), st.text(max_size=40))
def test_with_header_adds_or_replaces_one_entry(headers, content_type, encoding, value) -> None:
    props = commands.Basic.Properties(
        content_type="text/plain" if content_type else None,
        content_encoding="gzip" if encoding else None,
        headers=headers or None,
        delivery_mode=2,
        priority=5,
        message_id="m-1",
        app_id="app",
    )
    raw = ContentHeader(0, 123, props).marshal()
    original = _decode(raw).properties.headers or {}  # as a broker would deliver it (pamqp sends floats as 32-bit)
    out = _decode(with_header(raw, "x-ferry-transfer", value))
    assert out.body_size == 123
    assert out.properties.headers == {**original, "x-ferry-transfer": value}
    for name in ("content_type", "content_encoding", "delivery_mode", "priority", "message_id", "app_id"):
        assert getattr(out.properties, name) == getattr(props, name)
    again = _decode(with_header(with_header(raw, "x-ferry-transfer", "a"), "x-ferry-transfer", value))
    assert again.properties.headers == out.properties.headers


@given(tables)
def test_typed_header_json_round_trip(headers) -> None:
    assert headers_from_json(headers_to_json(headers)) == (headers or {})


def test_typed_header_json_keeps_types() -> None:
    headers = {"d": Decimal("1.50"), "b": bytearray(b"\x00"), "t": datetime(2020, 1, 1, tzinfo=UTC), "i": 3, "f": 3.0}
    back = headers_from_json(headers_to_json(headers))
    assert back == headers and isinstance(back["f"], float) and isinstance(back["b"], bytearray)
