"""Endpoint URIs for `ferry copy` and friends.

- ``jetstream://CLUSTER/STREAM[?subject=FILTER&start_seq=N&end_seq=M&account=NAME]``: ``account``
  names one of the cluster's ``accounts`` in the topology (default: the cluster's ``credentials``)
- ``rabbitmq://CLUSTER/VHOST/QUEUE``: VHOST and QUEUE URL-encoded (``%2F`` is
  the default vhost ``/``); QUEUE ``*`` is every queue of the vhost (``orders-*``: those matching), VHOST ``*``
  every vhost. As a destination, QUEUE may be omitted or ``*`` (same names as
  the source), or ``?exchange=NAME`` publishes to an exchange instead.
- ``parquet:///absolute/dir`` or ``parquet://relative/dir``

Names resolve through the topology file.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, parse_qsl, unquote, urlsplit

from ferry.errors import ConfigError
from ferry.subjects import stream_name_problem

__all__ = ["Endpoint", "parse_uri"]

_KNOWN_QUERY = {
    "jetstream": {"subject", "start_seq", "end_seq", "account"},
    "rabbitmq": {"exchange"},
    "parquet": set(),
}


@dataclass(frozen=True)
class Endpoint:
    kind: str  # jetstream | rabbitmq | parquet
    uri: str
    cluster: str | None = None
    stream: str | None = None
    subject: str | None = None
    start_seq: int | None = None
    end_seq: int | None = None
    vhost: str | None = None
    queue: str | None = None  # None or "*" = every queue / same names
    exchange: str | None = None
    path: str | None = None
    account: str | None = None  # a NATS account of the cluster's in the topology (None: the default)

    def __str__(self) -> str:
        return self.uri


def parse_uri(uri: str) -> Endpoint:
    parts, shown = urlsplit(uri), masked(uri)  # an option's value may be a secret typed in the wrong place
    kind = parts.scheme
    if kind not in _KNOWN_QUERY:
        raise ConfigError(
            f"{shown!r}: unknown scheme {kind + '://' if kind else '(none)'}; use jetstream://, rabbitmq:// or parquet://"
        )
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = set(query) - _KNOWN_QUERY[kind]
    if unknown:
        raise ConfigError(
            f"{shown!r}: unknown option {sorted(unknown)[0]!r} "
            f"(known: {', '.join(sorted(_KNOWN_QUERY[kind])) or 'none'})"
        )
    if kind == "parquet":
        path = (parts.netloc + parts.path) if parts.netloc else parts.path
        if not path:
            raise ConfigError(f"{shown!r}: no directory given (parquet:///absolute/dir)")
        return Endpoint(kind, uri, path=unquote(path))
    if not parts.netloc:
        raise ConfigError(f"{shown!r}: no cluster name ({kind}://CLUSTER/...)")
    if "@" in parts.netloc:
        raise ConfigError(
            f"{kind}://{parts.netloc.rpartition('@')[2]}...: a URI names a cluster of the topology, "
            "which holds its credentials; give none here"
        )
    segments = parts.path.split("/")[1:] if parts.path else []
    if kind == "jetstream":
        if len(segments) != 1 or not segments[0]:
            raise ConfigError(f"{shown!r}: expected jetstream://CLUSTER/STREAM")
        stream = unquote(segments[0])
        if why := stream_name_problem(stream):
            raise ConfigError(f"{shown!r}: {why}")
        start, end = _int(shown, query, "start_seq"), _int(shown, query, "end_seq")
        if start and end and end < start:
            raise ConfigError(f"{shown!r}: end_seq {end} is before start_seq {start} (the range is inclusive)")
        return Endpoint(
            kind,
            uri,
            cluster=parts.netloc,
            stream=stream,
            subject=query.get("subject") or None,
            start_seq=start,
            end_seq=end,
            account=query.get("account") or None,
        )
    # rabbitmq
    if not segments or not segments[0] or len(segments) > 2:
        raise ConfigError(f"{shown!r}: expected rabbitmq://CLUSTER/VHOST/QUEUE (vhost '/' is %2F)")
    queue = unquote(segments[1]) if len(segments) == 2 and segments[1] else None
    return Endpoint(
        kind, uri, cluster=parts.netloc, vhost=unquote(segments[0]), queue=queue, exchange=query.get("exchange") or None
    )


def masked(uri: str) -> str:
    """`uri` with the values of its query masked: an option ferry does not know may be a secret
    typed where it does not belong (``?password=...``)."""
    parts = urlsplit(uri)
    if not parts.query:
        return uri
    query = "&".join(f"{k}=***" for k, _ in parse_qsl(parts.query, keep_blank_values=True))
    return parts._replace(query=query).geturl()


def _int(shown: str, query: dict[str, str], key: str) -> int | None:
    if key not in query:
        return None
    try:
        value = int(query[key])
    except ValueError:
        raise ConfigError(f"{shown!r}: {key} must be an integer") from None
    if value < 1:
        raise ConfigError(f"{shown!r}: {key} must be >= 1")
    return value
