"""Operations: one module per job (move, partition, failback), each plan -> preflight -> execute -> verify.

Every operation reports progress through an :data:`Emit` callback: ``emit("event", **data)``.
"""

from collections.abc import Callable
from typing import Any

Emit = Callable[..., None]


def no_emit(event: str, **data: Any) -> None:
    """An :data:`Emit` that reports nothing."""
