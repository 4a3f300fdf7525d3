"""ferry's error tree.

One root, :class:`FerryError`. Everything a user can cause (bad config, wrong
credentials, unreachable broker, unknown stream, invalid subject) raises a
subclass; the CLI prints ``str(error)`` on one line and exits non-zero, never a
traceback. Messages say what to do next and never contain a secret.

``retryable`` is decided here, once: transient errors (a broker that did not
answer in time) may be retried by the caller; terminal ones may not.
"""

from __future__ import annotations

import re

_SECRETS = (
    (re.compile(r"(//[^/\s:@'\"]*):[^/@\s'\"]*@"), r"\1:***@"),  # scheme://user:password@host
    (re.compile(r"(\btoken=)[^;&\s'\"]+", re.IGNORECASE), r"\1***"),  # Spark Connect's ;token=...
)


def redact(text: str) -> str:
    """`text` with the passwords of URLs and tokens masked (a broker echoes the URI it refused)."""
    for pattern, mask in _SECRETS:
        text = pattern.sub(mask, text)
    return text


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


class ConfigError(FerryError):
    """A topology file, partition map or option is invalid."""

    exit_code = 2


class UsageError(FerryError):
    """A command was asked to do something it cannot do as asked."""

    exit_code = 2


class NotFound(FerryError):
    """A named cluster, stream, queue, node or operation does not exist."""


class BrokerUnavailable(FerryError):
    """A broker did not answer (refused, timed out, no leader)."""

    retryable = True


class AuthError(FerryError):
    """A broker refused the credentials, or what they asked for (a permission)."""


class Forbidden(AuthError):
    """A broker took the credentials but refused what they asked for: a permission the user lacks."""


class Conflict(FerryError):
    """Another operation or owner holds what was asked for."""


class PreflightFailed(FerryError):
    """An operation's preflight check refused to start; nothing was changed."""


class OperationFailed(FerryError):
    """An operation step failed; its state is journaled and it can be resumed."""
