"""Ctrl-C and SIGTERM while an operation runs: the first asks it to stop cleanly, a second exits at once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal


class StopOnSignal:
    """Ctrl-C / SIGTERM during a move: ask for a cancel (a second one exits at once)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.installed: list[int] = []

    def __enter__(self) -> StopOnSignal:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._on_signal)
                self.installed.append(sig)
        return self

    def _on_signal(self) -> None:
        if self.event.is_set():
            os.write(
                2,
                b"stopped at once: a move that had begun is on record; run the same command again to finish it "
                b"(a cancel journaled is carried out then)\n",
            )
            os._exit(130)
        self.event.set()

    def __exit__(self, *exc: object) -> None:
        loop = asyncio.get_running_loop()
        for sig in self.installed:
            loop.remove_signal_handler(sig)
