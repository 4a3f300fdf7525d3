"""The headers ferry reads and writes, and the NATS header block codec.

Names: ``Nats-Msg-Id`` (JetStream de-duplication) and what ferry adds itself: a
copy's ``Ferry-Source`` / ``Ferry-Source-Seq``, a relay's ``Ferry-Origin-*``
(where a message was first stored), a move's ``Ferry-Reinjected`` (a message
the capture guard re-published) and, on RabbitMQ, ``x-ferry-transfer`` (the
transfer that moved a queue message).

Codec: a NATS header block is ``NATS/1.0[ status]\r\nKey: value\r\n...\r\n``.
"""

from __future__ import annotations

__all__ = [
    "EXPECTED",
    "MSG_ID",
    "ORIGIN_MSG_ID_HDR",
    "ORIGIN_SEQ_HDR",
    "ORIGIN_SITE_HDR",
    "ORIGIN_STREAM_HDR",
    "REINJECTED",
    "SOURCE_HDR",
    "SOURCE_SEQ_HDR",
    "TRANSFER_HDR",
    "encode_headers",
    "header_value",
    "parse_headers",
]

MSG_ID = "Nats-Msg-Id"
SOURCE_HDR = "Ferry-Source"  # what ferry's data plane adds to a copy: where it came from
SOURCE_SEQ_HDR = "Ferry-Source-Seq"
# what a replication relay adds (ferry replicate): the site, stream and sequence a message was first stored at
ORIGIN_SITE_HDR = "Ferry-Origin-Site"
ORIGIN_STREAM_HDR = "Ferry-Origin-Stream"
ORIGIN_SEQ_HDR = "Ferry-Origin-Seq"
ORIGIN_MSG_ID_HDR = "Ferry-Origin-Msg-Id"
REINJECTED = "Ferry-Reinjected"  # a message a move's capture guard re-published: the move's id
# publish-time directives: the server stores them with a message, but they are not message data
EXPECTED = (
    "Nats-Expected-Stream",
    "Nats-Expected-Last-Sequence",
    "Nats-Expected-Last-Subject-Sequence",
    "Nats-Expected-Last-Msg-Id",
)
TRANSFER_HDR = "x-ferry-transfer"  # RabbitMQ: the transfer (copy, fail-back) that moved a queue message


def parse_headers(block: bytes) -> dict[str, str]:
    """``NATS/1.0[ status[ description]]\\r\\nKey: value\\r\\n...`` as nats-py presents it: the
    status under ``Status`` and ``Description``, the last value of a repeated key."""
    first, _, rest = block.decode(errors="replace").partition("\r\n")
    out: dict[str, str] = {}
    status = first[8:].strip()
    if status:
        code, _, desc = status.partition(" ")
        out["Status"] = code
        if desc:
            out["Description"] = desc
    for line in rest.split("\r\n"):
        key, sep, value = line.partition(":")
        if sep:
            key = key.strip()
            if key and " " not in key and "\t" not in key:
                out[key] = value.strip()
    return out


def header_value(block: bytes, key: bytes) -> str | None:
    """The first value of `key` in an encoded header block, without parsing the rest."""
    at = block.find(b"\r\n" + key + b":")
    if at < 0:
        return None
    start = at + len(key) + 3
    return block[start : block.index(b"\r\n", start)].decode(errors="replace").strip()


def encode_headers(headers: dict[str, str] | bytes) -> bytes:
    """A header block (one already encoded is returned as it is)."""
    if isinstance(headers, bytes):
        return headers
    if not headers:
        return b"NATS/1.0\r\n\r\n"
    return ("NATS/1.0\r\n" + "\r\n".join([f"{k}: {v}" for k, v in headers.items()]) + "\r\n\r\n").encode()
