"""A job's states and the steps between them, declared in one place (each job's states are a
``Literal``); a step the job does not allow raises, so a journal that says something impossible
(or a bug) stops the job instead of driving it somewhere undefined."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Generic, TypeVar

from ferry.errors import OperationFailed

S = TypeVar("S", bound=str)


class IllegalTransition(OperationFailed):
    """A job was asked to go from one state to a state that cannot follow it."""


class Machine(Generic[S]):
    """The states of one job (`job`, for messages) and, for each, the states that may follow it
    (``None``: where a new operation of the job may begin)."""

    def __init__(self, job: str, steps: Mapping[S | None, Iterable[S]]) -> None:
        self.job = job
        self.steps: dict[S | None, frozenset[S]] = {k: frozenset(v) for k, v in steps.items()}

    @property
    def states(self) -> frozenset[S]:
        return frozenset(s for s in self.steps if s is not None)

    def step(self, current: str | None, new: S) -> S:
        """`new`, once checked to follow `current`; :class:`IllegalTransition` otherwise."""
        if new not in self.steps.get(current, frozenset()):  # type: ignore[call-overload]
            allowed = ", ".join(sorted(self.steps.get(current, frozenset()))) or "nothing"  # type: ignore[call-overload]
            raise IllegalTransition(
                f"{self.job}: {current or 'a new operation'} cannot go on to {new} (only to {allowed})",
                state=current,
            )
        return new
