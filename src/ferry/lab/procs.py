"""Processes the lab starts: spawn detached, remember by (pid, start time), stop by group.

A pid alone is not an identity (pids are reused), so each record keeps the
process start time from /proc and nothing is signalled unless both match.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from contextlib import ExitStack, suppress
from pathlib import Path

from pydantic import BaseModel

from ferry.errors import FerryError


class Proc(BaseModel):
    """Everything needed to find, stop and restart one lab process."""

    name: str
    kind: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    user: str | None = None
    log: str
    pid: int = 0
    start_time: int = 0

    def alive(self) -> bool:
        return self.pid > 0 and _start_time(self.pid) == self.start_time

    def start(self) -> None:
        log = open(self.log, "ab")  # noqa: SIM115 - handed to the child
        with log:
            p = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=self.cwd,
                user=self.user,
                group=self.user,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives `ferry lab up`; its own process group
            )
        self.pid = p.pid
        self.start_time = _start_time(p.pid) or 0

    def signal(self, sig: int) -> None:
        """Signal the process group (the process and what it spawned)."""
        if self.alive():
            with suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def group_alive(self) -> bool:
        return bool(group_members(self.pid)) if self.pid else False

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the group, wait up to `timeout`, then SIGKILL what is left."""
        if not self.pid:
            return
        if self.alive():
            self.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in group_members(self.pid):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.group_alive():
            raise FerryError(f"{self.name}: process group {self.pid} did not exit after SIGKILL")

    def kill(self) -> None:
        """SIGKILL at once (fault injection)."""
        self.stop(timeout=0)


def stop_all(procs: list[Proc], timeout: float = 30.0) -> None:
    """Stop many processes at once: SIGTERM every group, then wait for them together."""
    for p in procs:
        if p.alive():
            p.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(p.group_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in procs:
        p.stop(timeout=0)


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def free_ports(n: int, exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1, below the kernel's ephemeral range.

    Ports from bind(0) come from the ephemeral range, where an outgoing connection
    (a route or gateway dialling out while the lab starts) can take a port before
    the server meant to listen on it is up. Ports are held open together so none repeats;
    `exclude` holds ports already planned for servers not started yet.
    """
    low, high = 20000, _ephemeral_low()
    rng = random.SystemRandom()
    with ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < n:
            port = rng.randrange(low, high)
            if port in ports or port in exclude:
                continue
            s = stack.enter_context(socket.socket())
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
        return ports


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(low, 21000)


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
