"""`ferry move`: move a JetStream stream to another cluster of a super-cluster, losing nothing.

The server does the move (a placement update); ferry makes it safe:

1. **Preflight** (:mod:`.plan`, nothing changed when refused): destination known
   and with enough healthy servers (online, not lame duck, storage free), no move
   in progress, the stream led and in quorum, a meta leader.
2. **Journal**: the move's state lives in the JetStream KV bucket ``ferry_ops``
   (key ``move.<stream>``) with an owner heartbeat, so one move runs per stream
   and the same command run again (from anywhere) resumes a move whose owner died.
3. **Capture guard** (:mod:`ferry.jobs.shared.guard`): while the stream moves,
   ferry hears its subjects and re-publishes afterwards exactly what it missed.
4. **Leader handoff** (nats-server 2.15+): once the destination peers have
   caught up, ferry asks the origin leader to step down to one of them instead
   of waiting for the server's sampled check to pass (``handoff_candidate``).
5. **Progress** (:mod:`.run`): peers, lag, leader changes, leaderless time; the
   unavailability window is measured from the traffic itself: the longest time
   during which publishes arrived and the stream stored none of them.
6. **Timeout / Ctrl-C / ``move stop``**: the system account's CANCEL_MOVE puts
   the stream back where it was; ferry waits for it to be healthy there.
7. **Verify** (:mod:`.verify`): messages, first/last sequence, per-subject counts
   unchanged but for new publishes; every durable consumer keeps its
   configuration and ack floor and none points past the last sequence.
"""

from ferry.jobs.move.plan import MovePlan, MoveRequest, preflight
from ferry.jobs.move.repair import repair_consumers
from ferry.jobs.move.run import MoveRecord, MoveResult, cancel, move, move_many, status
from ferry.jobs.move.verify import verify

__all__ = [
    "MovePlan",
    "MoveRecord",
    "MoveRequest",
    "MoveResult",
    "cancel",
    "move",
    "move_many",
    "preflight",
    "repair_consumers",
    "status",
    "verify",
]
