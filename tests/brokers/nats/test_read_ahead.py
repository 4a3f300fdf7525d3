"""The read-ahead task behind every stream read stops when its reader is closed, even when the
cancel that stops it is swallowed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from ferry.brokers.nats.reader import read_ahead


def test_a_read_ahead_whose_cancel_was_swallowed_still_closes() -> None:
    """Python 3.11's ``wait_for`` returns the result instead of raising when what it waits for
    completes just as the cancel comes (a reader's connect, nats-py's requests). The read-ahead
    task then went on pulling into a full queue that no one read, and closing the reader waited
    for it for ever (a CI run's failed copy hung 600 s)."""
    closed = []

    async def lists() -> AsyncIterator[list[int]]:
        try:
            yield [0]
            with contextlib.suppress(asyncio.CancelledError):  # swallowed, as wait_for does
                await asyncio.sleep(10)
            for i in range(1, 10):
                yield [i]
        finally:
            closed.append(True)

    async def main() -> None:
        ahead = read_ahead(lists())
        assert await anext(ahead) == [0]
        await asyncio.sleep(0.05)  # the task now waits in the sleep that swallows the cancel
        closing = asyncio.create_task(ahead.aclose())
        await asyncio.wait({closing}, timeout=5)
        assert closing.done() and closed == [True]

    asyncio.run(main())
