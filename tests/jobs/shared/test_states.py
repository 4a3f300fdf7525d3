"""Each job's states in one place, and an illegal step raising instead of driving a job astray."""

from __future__ import annotations

import itertools
from typing import get_args

import pytest

from ferry.jobs.dr_failback.plan import FAILBACK, FailbackPhase
from ferry.jobs.evacuate.plan import EVACUATION, REBALANCE, STATES, EvacuationState
from ferry.jobs.move.plan import MOVE, MovePhase
from ferry.jobs.replicate.plan import RELAY, RelayState
from ferry.jobs.shared.states import IllegalTransition, Machine


@pytest.mark.parametrize(
    ("machine", "states"),
    [
        (MOVE, MovePhase),
        (EVACUATION, EvacuationState),
        (REBALANCE, EvacuationState),
        (FAILBACK, FailbackPhase),
        (RELAY, RelayState),
    ],
)
def test_every_state_of_a_job_is_its_literal_and_every_step_leads_to_one(machine: Machine, states: object) -> None:
    declared = set(get_args(states))
    assert machine.states <= declared, machine.states - declared
    for follows in machine.steps.values():
        assert follows <= declared


def test_a_job_goes_through_its_states_in_order_and_no_other_way() -> None:
    path = [None, *STATES]
    for a, b in itertools.pairwise(path):
        assert EVACUATION.step(a, b) == b
    with pytest.raises(IllegalTransition, match="evacuation: evicting_conns cannot go on to prohibiting"):
        EVACUATION.step("evicting_conns", "prohibiting")  # sessions first
    with pytest.raises(IllegalTransition):
        EVACUATION.step("prohibiting", "evicting_conns")
    assert MOVE.step("done", "starting") == "starting", "a stream moved once may move again"
    with pytest.raises(IllegalTransition, match="move: a new operation cannot go on to moving"):
        MOVE.step(None, "moving")
    with pytest.raises(IllegalTransition):
        FAILBACK.step("restoring", "transferring")  # not with upstreams back: a consumer makes links pull
    assert FAILBACK.step("restoring", "disabling") == "disabling", "messages that came back move again"
    assert REBALANCE.step(None, "evicting_sessions") == "evicting_sessions"  # no client to move
    with pytest.raises(IllegalTransition):
        RELAY.step("relaying", "defined")
