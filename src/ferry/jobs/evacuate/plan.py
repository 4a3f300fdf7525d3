"""Evacuation and rebalance, the pure part: requests, EMQX's balance condition and proposal,
the pacing of evictions, the journal keys and what the availability check answers."""

from __future__ import annotations

import time
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ferry.jobs.shared.states import Machine

EvacuationState = Literal[
    "waiting_health_check", "evicting_conns", "waiting_takeover", "evicting_sessions", "prohibiting"
]
STATES: tuple[EvacuationState, ...] = get_args(EvacuationState)  # EMQX's, in their order
EVACUATION = Machine[EvacuationState](
    "evacuation",
    {
        None: {"waiting_health_check"},
        "waiting_health_check": {"evicting_conns"},
        "evicting_conns": {"waiting_takeover"},
        "waiting_takeover": {"evicting_sessions"},
        "evicting_sessions": {"prohibiting"},
        "prohibiting": set(),  # until `ferry node stop` deletes it
    },
)
REBALANCE = Machine[EvacuationState](
    "rebalance",
    {
        None: {"waiting_health_check", "evicting_sessions"},  # no client to move: no health check wait
        "waiting_health_check": {"evicting_conns"},
        "evicting_conns": {"waiting_takeover"},
        "waiting_takeover": {"evicting_sessions"},
        "evicting_sessions": set(),  # balanced, or aborted: the rebalance ends
    },
)
TICK = 0.1  # seconds between eviction steps
RETRY_AFTER = 5.0  # seconds before an evicted connection or moved leader still there is tried again


# -- balance condition and proposal (pure) ---------------------------------------------------------


def avg(values: list[int] | list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def within(donor_avg: float, recipient_avg: float, abs_threshold: float, rel_threshold: float) -> bool:
    """EMQX's balance condition."""
    return donor_avg < recipient_avg + abs_threshold or donor_avg < recipient_avg * rel_threshold


def split(counts: dict[str, int]) -> tuple[list[str], list[str]]:
    """Donors (above the average) and recipients (the rest)."""
    mean = avg(list(counts.values()))
    donors = [n for n, c in counts.items() if c > mean]
    return donors, [n for n in counts if n not in donors]


def propose(counts: dict[str, int], abs_threshold: float, rel_threshold: float) -> dict[str, int] | None:
    """The counts after a rebalance (moving one at a time from the fullest donor to the
    emptiest recipient until balanced), or None when already balanced or when no whole move
    brings it closer (4, 4, 3 with an absolute threshold of 1)."""
    donors, recipients = split(counts)
    after = dict(counts)

    def balanced() -> bool:
        return within(
            avg([after[d] for d in donors]), avg([after[r] for r in recipients]), abs_threshold, rel_threshold
        )

    if not donors or not recipients or balanced():
        return None
    while not balanced():
        d, r = max(donors, key=after.__getitem__), min(recipients, key=after.__getitem__)
        if after[d] <= after[r] + 1:
            break
        after[d] -= 1
        after[r] += 1
    return after if after != counts else None


def planned_moves(proposal: list[dict[str, Any]], what: str) -> dict[str, int]:
    """What each donor gives in the proposal (`what`: connections or sessions): a rebalance never
    evicts more. Counts can keep changing under it (clients making and dropping consumers, a
    step-down the server places elsewhere, clients reconnecting where they like): a rebalance
    chasing them would never end (a trial with a threshold of 1 made 246 moves for 5 planned),
    and one that went on past its plan overshot (0/5/4 became 6/2/1)."""
    return {row["node"]: max(0, row[what] - row[f"{what}_after"]) for row in proposal}


def why_nothing(what: str, counts: dict[str, int], abs_threshold: float, rel_threshold: float, flag: str) -> str:
    """Why a rebalance proposes no move of `what` (for the dry run): even counts, or the thresholds."""
    donors, recipients = split(counts)
    if not donors or not recipients:
        return f"{what}: even ({', '.join(f'{n} {c:,}' for n, c in counts.items())}): nothing to move"
    d, r = avg([counts[n] for n in donors]), avg([counts[n] for n in recipients])
    if within(d, r, abs_threshold, rel_threshold):
        return (
            f"{what}: the donors hold {d:,.1f} on average and the recipients {r:,.1f}, within "
            f"--abs-{flag}-threshold {abs_threshold:,g} or --rel-{flag}-threshold {rel_threshold:g}: "
            "nothing to move (lower them to balance)"
        )
    return f"{what}: no whole move brings the counts closer"


class Pacer:
    """At most `rate` actions per second, the first one at once. Allowance left unused (say while
    the node restarts) is kept for one second at most, as EMQX evicts at most `rate` per second."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.restart()

    def restart(self) -> None:
        self.at, self.allowance = time.monotonic(), 1.0

    def take(self, wanted: int) -> int:
        now = time.monotonic()
        self.allowance = min(max(1.0, self.rate), self.allowance + self.rate * (now - self.at))
        self.at = now
        n = max(0, min(wanted, int(self.allowance)))
        self.allowance -= n
        return n


# -- requests ---------------------------------------------------------------------------------------


class Rates(BaseModel):
    # a request names known fields only, with finite numbers (it may come over HTTP from `ferry serve`)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    wait_health_check: float = Field(60.0, ge=0)
    conn_evict_rate: int = Field(500, gt=0)
    wait_takeover: float = Field(60.0, ge=0)
    sess_evict_rate: int = Field(500, gt=0)
    guard: bool = True  # NATS: a capture guard hears each stream stepped down (core publishes in the election)


class EvacuateRequest(Rates):
    node: str
    cluster: str = ""
    migrate_to: list[str] = []
    redirect_to: list[str] = []
    relocate_rate: int | None = Field(None, gt=0)  # messages/s moving a classic queue; None: as fast as it goes
    dry_run: bool = False

    @field_validator("redirect_to")
    @classmethod
    def _no_redirect(cls, v: list[str]) -> list[str]:
        if v:
            raise ValueError(
                "--redirect-to needs MQTT 5 server redirection, which neither NATS nor RabbitMQ 3.10 offers; "
                "clients reconnect through the load balancer"
            )
        return v


class RebalanceRequest(Rates):
    cluster: str
    nodes: list[str] = []
    abs_conn_threshold: float = Field(1000, ge=1)
    rel_conn_threshold: float = 1.1
    abs_sess_threshold: float = Field(1000, ge=1)
    rel_sess_threshold: float = 1.1
    execute: bool = False

    @field_validator("rel_conn_threshold", "rel_sess_threshold")
    @classmethod
    def _above_one(cls, v: float) -> float:
        if v <= 1:
            raise ValueError(f"relative threshold must be > 1 (got {v})")
        return v


def evacuation_key(cluster: str, node: str) -> str:
    return f"evacuation.{cluster}.{node}"


def rebalance_key(cluster: str) -> str:
    return f"rebalance.{cluster}"


def unavailable(states: dict[str, dict[str, Any]], cluster: str, node: str) -> str:
    """Why the load balancer should not send `node` new clients ('' if it may)."""
    if st := states.get(evacuation_key(cluster, node)):
        return f"being evacuated ({st.get('state')}" + (", refused: driven by nobody)" if st.get("refused") else ")")
    st = states.get(rebalance_key(cluster))
    if st and node in st.get("donors", []) and not st.get("refused"):  # a refused one moves nobody: donors serve
        return f"donor in a rebalance ({st.get('state')})"
    return ""


def way_on(st: dict[str, Any]) -> str:
    """What to do about an operation on record whose driver the broker refused (see _Driver.run)."""
    stop = f"ferry node stop {st['node']}" if st.get("node") else f"ferry cluster stop {st['cluster']}"
    return f"run it again as a user with that permission, or `{stop}`"


def least_loaded(nodes: list[str], load: dict[str, int]) -> str:
    """The node of `nodes` with the least load, which is then counted one more."""
    node = min(nodes, key=lambda n: load.get(n, 0))
    load[node] = load.get(node, 0) + 1
    return node
