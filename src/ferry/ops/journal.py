"""Operation state kept in the JetStream KV bucket ``ferry_ops``, owned by one live ferry at a time.

Every NATS operation (move, evacuation, rebalance) journals its state under one
key. The owner (host, pid) refreshes a heartbeat with each save; another ferry
may take the key over once the heartbeat is older than ``stale_after`` or the
owner's pid is gone on this host. Every save is a compare-and-set on the key's
revision, so two drivers can never both believe they own it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from nats.aio.client import Client

from ferry.errors import Conflict

BUCKET = "ferry_ops"


async def bucket(nc: Client, replicas: int) -> Any:
    """The ``ferry_ops`` KV bucket, created on first use."""
    from nats.js.api import KeyValueConfig
    from nats.js.errors import BucketNotFoundError

    js = nc.jetstream()
    try:
        return await js.key_value(BUCKET)
    except BucketNotFoundError:
        return await js.create_key_value(KeyValueConfig(bucket=BUCKET, history=5, replicas=replicas))


def owner_alive(state: dict[str, Any], stale_after: float = 10.0) -> bool:
    """Whether the ferry that owns `state` is alive: a fresh heartbeat, and its pid running if on this host."""
    o = state.get("owner") or {}
    if not o or time.time() - state.get("heartbeat", 0) > stale_after:
        return False
    if o.get("host") == socket.gethostname():
        try:
            os.kill(int(o["pid"]), 0)
        except (ProcessLookupError, ValueError, KeyError):
            return False
        except PermissionError:
            return True
    return True


class Journal:
    """One operation's state under ``key`` in ``ferry_ops``."""

    def __init__(self, nc: Client, key: str, stale_after: float = 10.0) -> None:
        self.nc, self.key, self.stale_after = nc, key, stale_after
        self.kv: Any = None
        self.revision = 0
        self.state: dict[str, Any] = {}

    async def open(self, replicas: int) -> dict[str, Any] | None:
        """Open the bucket; the key's current state, or None."""
        from nats.js.errors import KeyNotFoundError

        self.kv = await bucket(self.nc, replicas)
        try:
            entry = await self.kv.get(self.key)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        self.revision = entry.revision
        return json.loads(entry.value)

    @staticmethod
    def owner() -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid()}

    def owner_alive(self, state: dict[str, Any]) -> bool:
        return owner_alive(state, self.stale_after)

    async def save(self, release: bool = False, **changes: Any) -> None:
        """Write the state (CAS); ``release`` gives up ownership so another ferry may adopt at once."""
        from nats.js.errors import KeyWrongLastSequenceError

        self.state.update(changes, owner=None if release else self.owner(), heartbeat=time.time())
        data = json.dumps(self.state).encode()
        try:
            if self.revision:
                self.revision = await self.kv.update(self.key, data, last=self.revision)
            else:
                self.revision = await self.kv.create(self.key, data)
        except KeyWrongLastSequenceError:
            raise Conflict(f"{self.key} was changed by another ferry (taken over or stopped)") from None

    async def delete(self) -> None:
        await self.kv.delete(self.key)
        self.revision = 0
