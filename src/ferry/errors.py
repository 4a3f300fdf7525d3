"""ferry's error tree.

One root, :class:`FerryError`. Everything a user can cause (bad config, wrong
credentials, unreachable broker, unknown stream, invalid subject) raises a
subclass; the CLI prints ``str(error)`` on one line and exits non-zero, never a
traceback. Messages say what to do next and never contain a secret.

Whether trying again may help is decided here, once, by two mix-ins:
:class:`Transient` (a broker that did not answer in time, a leader election)
and :class:`Terminal` (a name, a credential or a setting that must change
first). Retry code asks :func:`ferry.brokers.transient`, which reads
``retryable`` from these classes and from the library errors each broker kind
declares. Library errors are translated into this tree at the broker boundary
(:mod:`ferry.brokers`). An error keeps its hint and fields when pickled (a
Spark task's error reaches the driver so).
"""

from __future__ import annotations

import re
from typing import Any

_SECRETS = (
    (re.compile(r"(//[^/\s:@'\"]*):[^/@\s'\"]*@"), r"\1:***@"),  # scheme://user:password@host
    (re.compile(r"(\btoken=)[^;&\s'\"]+", re.IGNORECASE), r"\1***"),  # Spark Connect's ;token=...
)


def redact(text: str) -> str:
    """`text` with the passwords of URLs and tokens masked (a broker echoes the URI it refused)."""
    for pattern, mask in _SECRETS:
        text = pattern.sub(mask, text)
    return text


class Transient:
    """Mix-in: trying again later may succeed (the broker may answer, a leader be elected)."""

    retryable = True


class Terminal:
    """Mix-in: trying again cannot succeed until something changes (a name, a credential, a setting)."""

    retryable = False


class FerryError(Exception):
    """Root of every error ferry raises on purpose."""

    retryable = False
    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None, **fields: object) -> None:
        self.message = redact(message)
        self.hint = redact(hint) if hint else hint
        self.fields = {k: v for k, v in fields.items() if v is not None}
        super().__init__(self.message)

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.hint, self.fields))


def _rebuild(cls: type[FerryError], message: str, hint: str | None, fields: dict[str, object]) -> FerryError:
    return cls(message, hint=hint, **fields)


class ConfigError(Terminal, FerryError):
    """A topology file, partition map or option is invalid."""

    exit_code = 2


class Unreadable(ConfigError):
    """A credential or TLS file (or environment variable) the topology names cannot be read
    where ferry runs: in a Spark task, the message names the executor's host."""


class UsageError(Terminal, FerryError):
    """A command was asked to do something it cannot do as asked."""

    exit_code = 2


class NotFound(Terminal, FerryError):
    """A named cluster, stream, queue, node or operation does not exist."""


class BrokerUnavailable(Transient, FerryError):
    """A broker did not answer (refused, timed out, no leader)."""


class AuthError(Terminal, FerryError):
    """A broker refused the credentials, or what they asked for (a permission)."""


class Forbidden(AuthError):
    """A broker took the credentials but refused what they asked for: a permission the user lacks."""


class Conflict(Terminal, FerryError):
    """Another operation or owner holds what was asked for (it stops, or is stopped, first)."""


class PreflightFailed(Terminal, FerryError):
    """An operation's preflight check refused to start; nothing was changed."""


class OperationFailed(Terminal, FerryError):
    """An operation step failed; its state is journaled and it can be resumed."""
