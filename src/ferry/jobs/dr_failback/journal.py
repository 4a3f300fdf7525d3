"""A DR fail-back's record and lock, on the source broker, through ferry's journal
(:class:`ferry.journal.ParamJournal`): the global parameter ``ferry-failback`` (the plan, every
upstream's full definition, the counts before and the phase), written before any upstream is
deleted; and the journal's exclusive hold, the queue ``ferry-failback-lock``, which the broker
drops if ferry dies."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from ferry.brokers.rabbitmq import Management
from ferry.errors import ConfigError
from ferry.jobs.dr_failback.plan import JOURNAL
from ferry.journal import ParamJournal

_JOURNAL_KEYS = ("id", "source", "target", "phase", "started", "queues", "upstreams")


def record(m: Management) -> ParamJournal:
    """The fail-back's journal on the source broker `m` (one per broker)."""
    return ParamJournal(m, JOURNAL, prefix="")


async def read_journal(m: Management) -> dict[str, Any] | None:
    """The fail-back on record at `m`, None when there is none; a parameter of that name that is not
    ferry's is refused (never overwritten)."""
    got = await m.get(f"/global-parameters/{JOURNAL}", ok404=True)
    if got is None:
        return None
    value = got["value"]
    missing = [k for k in _JOURNAL_KEYS if not isinstance(value, dict) or k not in value]
    if missing:
        raise ConfigError(
            f"{m.name}: global parameter {JOURNAL!r} is not a ferry journal (no {', '.join(missing)}); "
            "inspect and delete it by hand"
        )
    return value


async def write_journal(m: Management, journal: dict[str, Any]) -> None:
    """Save `journal` (the hold, not a heartbeat, keeps a second fail-back out: released on every save)."""
    journal["updated"] = datetime.now(UTC).isoformat(timespec="seconds")
    j = record(m)
    j.state = journal
    await j.save(release=True)
