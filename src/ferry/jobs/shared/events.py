"""How a job reports progress: an :data:`Emit` callback, ``emit("event", **data)``.

The CLI prints events for people (or as JSON lines with ``--json``), ``ferry serve``
keeps the last ones per operation; a job never prints itself.
"""

from collections.abc import Callable
from typing import Any

Emit = Callable[..., None]


def no_emit(event: str, **data: Any) -> None:
    """An :data:`Emit` that reports nothing."""
