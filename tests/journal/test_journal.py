"""The journal's contract, which every job's resume relies on, against both real stores: a key of
NATS KV ``ferry_ops`` (KvJournal) and a RabbitMQ global parameter (ParamJournal)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from ferry import lab
from ferry.brokers import nats as bnats
from ferry.brokers.rabbitmq import Management
from ferry.errors import Conflict, NotFound
from ferry.journal import Journal, KvJournal, Lease, ParamJournal, owner_alive, process_start, running_here
from tests.conftest import profile_topology

STORES = ["kv", "param"]


@contextlib.asynccontextmanager
async def store(kind: str, supercluster: lab.LabState, rabbit_dr: lab.LabState) -> AsyncIterator[Callable[..., Any]]:
    """A factory of journals on one key of one real store: ``make(key, stale_after=...)``."""
    if kind == "kv":
        async with bnats.session(profile_topology(supercluster).nats("east")) as nc:

            async def make_kv(key: str, stale_after: float = 10.0) -> Journal:
                j = KvJournal(nc, key, stale_after=stale_after)
                await j.open()
                return j

            yield make_kv
        return
    async with Management(profile_topology(rabbit_dr).rabbitmq("pc1")) as m:

        async def make_param(key: str, stale_after: float = 10.0) -> Journal:
            j = ParamJournal(m, key, stale_after=stale_after)
            await j.open()
            return j

        yield make_param


def foreign(heartbeat: float) -> dict[str, Any]:
    """The owner fields of another ferry, on another host."""
    return {"owner": {"host": "elsewhere", "pid": 1, "started": "1"}, "heartbeat": heartbeat}


# -- pure: who owns a key -------------------------------------------------------------------------


def test_an_owner_is_alive_while_its_heartbeat_is_fresh_and_its_process_runs() -> None:
    me = {"owner": Journal.owner(), "heartbeat": time.time()}
    assert owner_alive(me) and running_here(me)
    assert not owner_alive({**me, "heartbeat": time.time() - 11}), "a stale heartbeat is no owner"
    assert owner_alive(foreign(time.time())) and not owner_alive(foreign(time.time() - 11))
    reused = {"owner": {**Journal.owner(), "started": "1"}, "heartbeat": time.time()}  # our pid, another process
    assert not running_here(reused) and not owner_alive(reused)
    assert not owner_alive({}), "a state nobody owns has no live owner"


def test_a_process_start_tells_a_reused_pid_apart() -> None:
    assert process_start(os.getpid()) == process_start(os.getpid()) is not None
    assert process_start(2**22 + 12345) is None  # above pid_max: never a process


# -- against the stores ----------------------------------------------------------------------------


@pytest.mark.lab
@pytest.mark.parametrize("kind", STORES)
async def test_saved_state_is_read_back_with_its_owner_from_another_journal(
    kind: str, supercluster: lab.LabState, rabbit_dr: lab.LabState
) -> None:
    key = f"test.{uuid.uuid4().hex[:8]}"
    async with store(kind, supercluster, rabbit_dr) as make:
        a = await make(key)
        assert await a.open() is None, "a new key holds nothing"
        await a.save(phase="one", n=1)
        b = await make(key)
        got = await b.open()
        assert got is not None and got["phase"] == "one" and got["n"] == 1
        assert got["owner"]["host"] == socket.gethostname() and got["owner"]["pid"] == os.getpid()
        assert b.owner_alive(got)
        await a.save(release=True, phase="two")
        released = await b.open()
        assert released is not None and released["owner"] is None and not b.owner_alive(released)
        assert key in await b.keys(["test.*"]) and key not in await b.keys(["other.*"])
        other = await make(key + "x")
        await other.save(phase="other")
        every = await b.all()  # one read of every key: what a get of each returns
        assert every[key] == await b.get(key) and every[key + "x"]["phase"] == "other"
        await a.delete()
        assert await b.open() is None
        assert key not in await b.all() and key + "x" in await b.all(), "a deleted key is left out"
        await other.delete()


@pytest.mark.lab
@pytest.mark.parametrize("kind", STORES)
async def test_a_version_stays_while_nothing_changes_and_moves_on_every_write(
    kind: str, supercluster: lab.LabState, rabbit_dr: lab.LabState
) -> None:
    """What lets `ferry serve` read a journal in full only when it changed: a put, a save of the
    same key and a delete each move the version; reads do not. A store that cannot tell says None."""
    key = f"test.{uuid.uuid4().hex[:8]}"
    async with store(kind, supercluster, rabbit_dr) as make:
        a = await make(key)
        first = await a.version()
        if kind == "param":
            assert first is None
            return
        await a.all()
        assert await a.version() == first, "a read moved the version"
        seen = [first]
        for write in (lambda: a.save(phase="one"), lambda: a.save(phase="two"), a.delete):
            await write()
            now = await a.version()
            assert now not in seen, (seen, now)
            seen.append(now)


@pytest.mark.lab
async def test_kv_saves_are_compare_and_set(supercluster: lab.LabState, rabbit_dr: lab.LabState) -> None:
    """Two drivers of one key: the one whose revision is old cannot write, whatever the timing."""
    key = f"test.{uuid.uuid4().hex[:8]}"
    async with store("kv", supercluster, rabbit_dr) as make:
        a, b = await make(key), await make(key)
        await a.save(phase="a")
        with pytest.raises(Conflict, match="changed by another ferry"):
            await b.save(phase="b")  # b opened before a's write: its revision is old
        assert (await (await make(key)).open())["phase"] == "a"
        both = await asyncio.gather(
            *(j.save(phase=p) for j, p in ((await make(key), "x"), (await make(key), "y"))), return_exceptions=True
        )
        assert sum(isinstance(r, Conflict) for r in both) == 1, both  # of two at once, exactly one wins
        await a.delete()


@pytest.mark.lab
async def test_one_drivers_heartbeats_and_saves_never_race(supercluster: lab.LabState, rabbit_dr: lab.LabState) -> None:
    """A background heartbeat (save_soon) that starts while a save writes: both go out, in turn. A
    repartition's journal once failed its own save ("changed by another ferry") so."""
    key = f"test.{uuid.uuid4().hex[:8]}"
    async with store("kv", supercluster, rabbit_dr) as make:
        j = await make(key)
        await j.save(n=0)

        async def beat() -> None:
            for _ in range(200):
                j.save_soon()
                await asyncio.sleep(0)

        await asyncio.gather(beat(), *(j.save(n=i) for i in range(1, 30)))
        await j.save(n=30)
        assert (await (await make(key)).open())["n"] == 30
        await j.delete()


@pytest.mark.lab
async def test_a_request_changes_fields_without_taking_ownership(
    supercluster: lab.LabState, rabbit_dr: lab.LabState
) -> None:
    key = f"test.{uuid.uuid4().hex[:8]}"
    async with store("kv", supercluster, rabbit_dr) as make:
        owner = await make(key)
        await owner.save(desired="running")
        operator = await make(key)
        state = await operator.request(desired="stopped")
        assert state["desired"] == "stopped" and state["owner"] == Journal.owner()
        lease = Lease(owner, interval=1.0)  # the owner's next save sees the request and keeps the key
        await lease.save(state="relaying")
        assert lease.stop_requested.is_set() and not lease.lost.is_set()
        with pytest.raises(NotFound):
            await (await make(f"test.{uuid.uuid4().hex[:8]}")).request(desired="stopped")
        await owner.delete()


@pytest.mark.lab
@pytest.mark.parametrize("kind", STORES)
async def test_stop_makes_the_drivers_next_save_fail(
    kind: str, supercluster: lab.LabState, rabbit_dr: lab.LabState
) -> None:
    key = f"test.{uuid.uuid4().hex[:8]}"
    async with store(kind, supercluster, rabbit_dr) as make:
        driver = await make(key)
        await driver.save(state="evicting")
        await (await make(key)).stop()
        with pytest.raises(Conflict):
            await driver.save(state="still evicting")
        assert await (await make(key)).open() is None, "a stopped key is not written back"


@pytest.mark.lab
@pytest.mark.parametrize("kind", STORES)
async def test_a_live_owner_is_not_taken_over_and_a_stale_one_is(
    kind: str, supercluster: lab.LabState, rabbit_dr: lab.LabState
) -> None:
    key = f"test.{uuid.uuid4().hex[:8]}"
    async with store(kind, supercluster, rabbit_dr) as make:
        other = await make(key)  # a state written as if by another ferry, alive
        if kind == "kv":
            await other.save(release=True, phase="x")
            await other.request(**foreign(time.time()))
        else:
            value = {"phase": "x", **foreign(time.time())}
            await other.m.put(other._path(key), {"name": other.prefix + key, "value": value})
        me = await make(key, stale_after=2.0)
        state = await me.open()
        assert state is not None and me.owner_alive(state), "another host's fresh heartbeat is a live owner"
        if kind == "param":  # no compare-and-set: a save refuses a live foreign owner itself
            with pytest.raises(Conflict, match="taken over"):
                await me.save(phase="mine")
        await asyncio.sleep(2.2)
        stale = await me.open()
        assert stale is not None and not me.owner_alive(stale), "a heartbeat older than stale_after is no owner"
        me.state = stale
        await me.save(phase="adopted")
        assert (await (await make(key)).open())["owner"] == Journal.owner()
        await me.delete()


@pytest.mark.lab
@pytest.mark.parametrize("kind", STORES)
async def test_hold_is_exclusive_while_the_block_runs(
    kind: str, supercluster: lab.LabState, rabbit_dr: lab.LabState
) -> None:
    key = f"test.{uuid.uuid4().hex[:8]}"
    async with store(kind, supercluster, rabbit_dr) as make:

        def hold(j: Any) -> Any:
            return j.hold("busy here") if kind == "kv" else j.hold("/", "busy here")

        first, second = await make(key), await make(key)
        async with hold(first):
            with pytest.raises(Conflict, match="busy here"):
                async with hold(second):
                    pass
        async with hold(second):  # released: free again
            pass


@pytest.mark.lab
async def test_a_lease_is_lost_when_its_key_is_stopped(supercluster: lab.LabState, rabbit_dr: lab.LabState) -> None:
    key = f"test.{uuid.uuid4().hex[:8]}"
    async with store("kv", supercluster, rabbit_dr) as make:
        j = await make(key, stale_after=4.0)
        async with j.hold("busy") as lease:
            await (await make(key)).stop()
            deadline = time.monotonic() + 10
            while not lease.lost.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert lease.lost.is_set(), "a holder whose key was deleted must stop"
        assert await (await make(key)).open() is None
