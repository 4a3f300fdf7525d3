"""Test helpers: build streams and queues on the lab, run the ferry CLI, read things back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from nats.js.api import Placement, StreamConfig

from ferry.brokers import nats as bnats
from ferry.brokers.nats.publish import Publisher
from ferry.brokers.nats.reader import Range, ReadConfig, read_range, stream_states
from ferry.brokers.rabbitmq import Management, amqp_connect, q
from ferry.brokers.rabbitmq.queue_io import snapshot_queue
from ferry.topology import Topology, load_topology

FERRY = [sys.executable, "-m", "ferry"]


def also_on_the_spark_lab(test: Callable[..., Any]) -> Callable[..., Any]:
    """The test as it is and, as a cell of ``make test-faults``, again with its ferry commands'
    Spark jobs on the ``spark`` lab's standalone cluster (mark ``cluster``: workers that have never
    seen ferry). One such test per Spark job (issue 48); ``make test`` runs the copy's there."""
    cluster = pytest.param("cluster", marks=[pytest.mark.cluster, pytest.mark.faults])
    test = pytest.mark.usefixtures("spark_at")(test)
    return pytest.mark.parametrize("spark_at", ["here", cluster], indirect=True)(test)


def cmdlines_while(proc: subprocess.Popen, timeout: float) -> set[str]:
    """Every process's command line (Spark's JVM and Python workers too), read every 0.2 s until
    `proc` exits."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the job did not finish"
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                seen.add(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        time.sleep(0.2)
    return seen


def ferry(
    *args: str,
    topology: Path,
    timeout: float = 300,
    check: bool = False,
    cwd: Path | None = None,
    record: list[str] | None = None,
    watch: set[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess (its own Spark driver); its stdout and stderr are appended
    to `record` (a module's outputs, searched for secrets at its end), and every process's command
    line while it runs to `watch`."""
    env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
    argv = [*FERRY, *args]
    if watch is None:
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    else:
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err, text=True, cwd=cwd)
            try:
                watch |= cmdlines_while(proc, timeout)
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            out.seek(0)
            err.seek(0)
            result = subprocess.CompletedProcess(argv, proc.returncode, out.read(), err.read())
    if record is not None:
        record.extend((result.stdout, result.stderr))
    if check and result.returncode != 0:
        raise AssertionError(f"ferry {' '.join(args)} failed ({result.returncode}): {result.stderr[-2000:]}")
    return result


def acked_ids(ledger: Path) -> set[str]:
    """The ids a load's ledger records as acked."""
    import pyarrow.parquet as pq

    return {r["id"] for r in pq.read_table(ledger).to_pylist() if r["outcome"] == "acked"}


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    """cond()'s first true value, polled every 0.2 s; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)
    return got


def ferry_killed_when(
    condition: Callable[[], bool], *args: str, topology: Path, timeout: float = 120, sig: int = signal.SIGKILL
) -> tuple[int, str]:
    """Start the CLI, signal its whole process group (driver, JVM, workers: as Ctrl-C does) once
    `condition()` holds; its exit code and stderr."""
    if sig == signal.SIGKILL and os.environ.get("FERRY_SPARK_REMOTE"):
        raise AssertionError("a killed ferry's job runs on on the Connect server: no connect mark on this test")
    env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
    proc = subprocess.Popen(
        [*FERRY, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.monotonic() + timeout
    try:
        while not condition():
            if proc.poll() is not None:
                raise AssertionError(f"ferry exited ({proc.returncode}) before the kill: {proc.stderr.read()[-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError("condition for the kill never held")
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        _, stderr = proc.communicate(timeout=60)
    return proc.returncode, stderr.decode()


def haproxy_servers(state: Any, proxy: str) -> dict[str, dict[str, str]]:
    """HAProxy's own view of one proxy's servers (its stats CSV): server name -> its row (status,
    check_status, scur: current sessions, ...)."""
    import csv
    import io

    text = httpx.get(state.lb["stats"] + ";csv", timeout=5).text.lstrip("# ")
    rows = csv.DictReader(io.StringIO(text))
    return {r["svname"]: r for r in rows if r["pxname"] == proxy and r["svname"] not in ("FRONTEND", "BACKEND")}


def started_json(*args: str, topology: Path, cwd: Path | None = None) -> subprocess.Popen[str]:
    """`ferry ARGS --json` started in a process group of its own (stdout and stderr piped)."""
    env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
    argv = [*FERRY, *args, "--json"]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=cwd)  # fmt: skip


def wait_event(proc: subprocess.Popen[str], event: str, nth: int = 1, timeout: float = 120) -> list[dict[str, Any]]:
    """Until `proc` (started by :func:`started_json`) has emitted `event` `nth` times (its stderr is
    read meanwhile); the events it emitted so far."""
    import queue
    import threading

    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr or []] + [lines.put("")], daemon=True).start()
    said: list[str] = []
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while sum(e["event"] == event for e in events) < nth:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        assert line, f"ferry ended ({proc.wait()}) before {event} #{nth}: {''.join(said)[-2000:]}"
        said.append(line)
        if line.startswith('{"event": '):
            events.append(json.loads(line))
    return events


def restart_node(state: Any, name: str, down: float) -> None:
    """SIGKILL a server of the lab `state`, start it again `down` seconds later, wait until it answers."""
    node = state.proc(name)
    node.signal(signal.SIGKILL)
    wait_for(lambda: not node.group_alive(), 30, f"{name} to die")
    time.sleep(down)
    node.start()
    state.save()
    wait_for(lambda: state.health().get(name) == "ok", 120, f"{name} to answer again")


def killed_at_event(event: str, nth: int, *args: str, topology: Path, cwd: Path | None = None) -> list[dict[str, Any]]:
    """`ferry ARGS --json` (run in `cwd`), its process group (driver, JVM, workers) SIGKILLed once
    it has emitted `event` `nth` times; the events it emitted."""
    proc = started_json(*args, topology=topology, cwd=cwd)
    try:
        return wait_event(proc, event, nth)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


async def make_stream(
    topo: Topology,
    cluster: str,
    name: str,
    subjects: list[str],
    replicas: int = 3,
    placement: str | None = None,
    **config: Any,
) -> None:
    async with bnats.session(topo.nats(cluster)) as nc:
        jsm = nc.jsm()
        with contextlib.suppress(Exception):
            await jsm.delete_stream(name)
        await jsm.add_stream(
            StreamConfig(
                name=name,
                subjects=subjects,
                num_replicas=replicas,
                placement=Placement(cluster=placement) if placement else None,
                **config,
            )
        )


async def fill_stream(
    topo: Topology,
    cluster: str,
    n: int,
    subject: Callable[[int], str],
    payload: Callable[[int], bytes],
    headers: Callable[[int], dict[str, str]] | None = None,
    msg_id: Callable[[int], str] | None = None,
) -> None:
    async with bnats.session(topo.nats(cluster)) as nc, Publisher(nc, window=1024) as pub:
        for i in range(n):
            await pub.publish(
                subject(i), payload(i), headers=headers(i) if headers else None, msg_id=msg_id(i) if msg_id else None
            )
    assert pub.stats.failed == 0, pub.stats.errors


async def stream_leader(topo: Topology, cluster: str, stream: str) -> str:
    async with bnats.session(topo.nats(cluster)) as nc:
        return bnats.leader_of(await nc.jsm().stream_info(stream))


def stream_count(topo: Topology, cluster: str, stream: str) -> int:
    return asyncio.run(stream_states(topo.nats(cluster), [stream], name=cluster))[stream]["messages"]


async def read_stream(topo: Topology, cluster: str, stream: str) -> list[dict[str, Any]]:
    cfg = ReadConfig(cluster=topo.nats(cluster).model_dump_json(), name=cluster, streams=(stream,))
    st = (await stream_states(topo.nats(cluster), [stream], name=cluster))[stream]
    rows: list[dict[str, Any]] = []
    async for batch in read_range(cfg, Range(stream, st["first_seq"], st["last_seq"], 2000)):
        rows += batch.to_pylist()
    return rows


async def make_queues(topo: Topology, cluster: str, vhost: str, names: list[str], quorum: set[str]) -> None:
    async with Management(topo.rabbitmq(cluster)) as m:
        if vhost != "/":
            await m.put(f"/vhosts/{q(vhost)}", {})
            await m.put(
                f"/permissions/{q(vhost)}/{q(topo.rabbitmq(cluster).credentials.user)}",  # type: ignore[union-attr]
                {"configure": ".*", "write": ".*", "read": ".*"},
            )
        for name in names:
            await m.delete(f"/queues/{q(vhost)}/{q(name)}")
            args = {"x-queue-type": "quorum"} if name in quorum else {}
            await m.put(f"/queues/{q(vhost)}/{q(name)}", {"durable": True, "arguments": args})


async def queue_messages(topo: Topology, cluster: str, vhost: str, queue: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    async for batch in snapshot_queue(topo.rabbitmq(cluster), cluster, vhost, queue):
        rows += batch.to_pylist()
    return rows


async def queue_depth(topo: Topology, cluster: str, vhost: str, queue: str) -> int:
    conn = await amqp_connect(topo.rabbitmq(cluster), vhost=vhost)
    async with conn:
        ch = await conn.channel()
        declared = await ch.declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count)


def snapshot_here(spark: Any, topology: Path, source: str, out: Path) -> dict[str, Any]:
    """`ferry snapshot` in the tests' own Spark session (no JVM start per call; the command itself
    has its tests in test_proof)."""
    from ferry.jobs.proof.snapshot import snapshot

    return snapshot(load_topology(topology), lambda: spark, source, out)


def judge(
    spark: Any, topology: Path, ledgers: Path | list[Path], tier: str, html: Path, max_dup: int = 0
) -> dict[str, Any]:
    """The audit of one tier (a snapshot directory or a jetstream:// URI) against the ledgers, in
    the tests' own Spark session (the CLI's audit has its tests in test_proof); writes the HTML
    report next to the test's files and fails on any loss or more than `max_dup` extra copies."""
    from ferry.jobs.proof.audit import audit, tier_frame, verdict
    from ferry.jobs.proof.report import render_html
    from ferry.topology import load_topology

    paths = [str(p) for p in ([ledgers] if isinstance(ledgers, Path) else ledgers)]
    report = audit(spark, paths, {"t": tier_frame(spark, load_topology(topology), tier)})
    failures = verdict(report, 0, max_dup)
    html.write_text(render_html(report, failures))
    if failures and tier.startswith("jetstream://"):  # the broker's loss or the reader's? a second opinion
        cluster, stream = tier.removeprefix("jetstream://").split("/")[:2]
        lost = set(report["tiers"]["t"].get("lost_ids") or [])
        failures.append(asyncio.run(_second_read(load_topology(topology), cluster, stream, lost)))
    assert not failures, f"{failures}; report {html}"
    return report["tiers"]["t"]


async def _second_read(topo: Topology, cluster: str, stream: str, lost: set[str]) -> str:
    """The stream's own counts, and how many of the `lost` ids nats-py's ordered consumer finds in it."""
    async with bnats.session(topo.nats(cluster)) as nc:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        state, found, seen = info.state, 0, 0
        sub = await js.subscribe(info.config.subjects[0], stream=stream, ordered_consumer=True)
        while seen < state.messages:
            m = await sub.next_msg(timeout=10)
            seen += 1
            found += (m.headers or {}).get("Ferry-Id") in lost
        await sub.unsubscribe()
    held = f"{state.messages} ({state.first_seq}-{state.last_seq})"
    return f"second read: {stream} holds {held}; {found} of the {len(lost)} listed lost ids are in it"


def as_nats_user(state: Any, user: str, root: Path) -> Path:
    """A copy of lab `state`'s topology whose NATS clusters use the lab's user `user` (one of
    ``ferry.lab.nats.LIMITED_USERS``, which share the app password) instead of ``app``."""
    path = root / f"{user}.yaml"
    path.write_text((state.path / "topology.yaml").read_text().replace("user: app", f"user: {user}"))
    return path


async def as_rabbit_user(state: Any, cluster: str, user: str, tags: str, path: Path, configure: str = ".*") -> Path:
    """A copy of lab `state`'s topology at `path` whose `cluster` credentials are `user`'s, made on
    that cluster with the same password, `tags`, and every permission on vhost / but `configure`."""
    topology = state.path / "topology.yaml"
    c = load_topology(topology).rabbitmq(cluster)
    async with Management(c) as m:
        await m.put(f"/users/{user}", {"password": c.credentials.password(), "tags": tags})
        await m.put(f"/permissions/%2F/{user}", {"configure": configure, "write": ".*", "read": ".*"})
    path.write_text(topology.read_text().replace(f"user: {c.credentials.user}", f"user: {user}"))
    return path


# -- shared by several test modules --------------------------------------------------------------

RATE = 3500  # msg/s of the producers that test moves, evacuations and repartitions under load

VALID = textwrap.dedent(
    """\
    version: 1
    sites:
      lab:
        clusters:
          east:
            kind: nats
            credentials: {user: app, password_env: FERRY_T_APP}
            system_credentials: {user: sys, password_env: FERRY_T_SYS}
            brokers:
              - name: east-1
                url: nats://127.0.0.1:4222
                monitor_url: http://127.0.0.1:8222
      dr:
        clusters:
          ltm:
            kind: rabbitmq
            credentials: {user: ferry, password_env: FERRY_T_LTM}
            brokers:
              - name: ltm-1
                url: amqp://127.0.0.1:5672
                management_url: http://127.0.0.1:15672
    """
)

# the same clusters where nothing listens: what is refused before ferry dials, and what answers without a broker
UNREACHABLE = VALID.replace(":4222", ":1").replace(":5672", ":1").replace(":15672", ":1")


def start_load(
    topology: Path, target: str, subject: str, ledger: Path, seconds: float, *extra: str
) -> subprocess.Popen:
    env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
    args = [
        "load",
        target,
        "--subject",
        subject,
        "--rate",
        str(RATE),
        "--duration",
        str(seconds),
        "--ledger",
        str(ledger),
    ]
    return subprocess.Popen([*FERRY, *args, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen) -> str:
    """Wait for a load to end; its summary (JSON with `--json`)."""
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    return stdout


class Relay:
    """One `ferry replicate run --json` process; its events read from a file."""

    def __init__(self, topology: Path, tmp: Path, source: str, dest: str, *extra: str) -> None:
        self.log = tmp / f"relay-{source}-{dest}-{time.monotonic_ns()}.log"
        env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
        args = [*FERRY, "replicate", "run", "--from", source, "--to", dest, "--json", *extra]
        with self.log.open("w") as f:
            self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=f, start_new_session=True)

    def events(self) -> list[dict[str, Any]]:
        lines = self.log.read_text().splitlines()
        return [json.loads(x) for x in lines if x.startswith('{"event"')]

    def event(self, name: str, timeout: float = 120) -> dict[str, Any]:
        def seen() -> dict[str, Any] | None:
            if self.proc.poll() is not None and self.proc.returncode:
                raise AssertionError(f"relay exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            return next((e for e in self.events() if e["event"] == name), None)

        return wait_for(seen, timeout, f"relay event {name!r}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        os.killpg(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self.proc.wait(timeout=30)


def load(topology: Path, site: str, subject: str, ledger: Path, rate: int, seconds: float | None) -> subprocess.Popen:
    """`ferry load` at `rate` for `seconds` (None: until it gets SIGTERM)."""
    env = {**os.environ, "FERRY_TOPOLOGY": str(topology)}
    # until a signal: a publish not acked within 5 s is given up (the test kills the site under it)
    until = ["--duration", str(seconds)] if seconds else ["--until-signal", "--give-up-after", "5"]
    args = ["load", f"jetstream://{site}", "--subject", subject, "--rate", str(rate), *until]
    args += ["--producers", "4", "--ledger", str(ledger), "--json"]
    return subprocess.Popen([*FERRY, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# -- the console's dashboard, asked of a real Prometheus (tests/api/test_console.py, the fail-back tests)

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "dashboards" / "ferry.json"
# panels whose series need a DR fail-back on record (the RabbitMQ labs): asked in the fail-back tests' lab
FAILBACK_PANELS = {"DR fail-back: messages left", "DR fail-back: possible duplicates"}


def panel_queries() -> dict[str, str]:
    doc = json.loads(DASHBOARD.read_text())
    return {f"{p['title']} [{t['refId']}]": t["expr"] for p in doc["panels"] for t in p["targets"]}


def prom_query(base: str, expr: str) -> list[dict[str, Any]]:
    got = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert got["status"] == "success", got
    return got["data"]["result"]


def served(topo: Topology, *clusters: str) -> list[dict[str, Any]]:
    """The operations `ferry serve` reads from the journals of `clusters` (one read of each; ``nyc@SALES``:
    another account's), as its console lists them."""
    from ferry.api.audits import Audits
    from ferry.api.console import view
    from ferry.api.watch import Registry

    async def read() -> list[dict[str, Any]]:
        reg = Registry(topo)
        reg.first_read = {c: asyncio.Event() for c in clusters}
        tasks = [asyncio.create_task(reg.watch(c, reg.journals[c])) for c in clusters]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in reg.first_read.values())), 30)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return view(reg, Audits(None))["operations"]

    return asyncio.run(read())


# -- certificates the secure labs' servers do not trust (their bad-input tests) -------------------


def other_ca(d: Path) -> str:
    """A CA file of another CA than the lab's (its servers' certificates fail to verify)."""
    import trustme

    trustme.CA().cert_pem.write_to_path(str(d / "other-ca.pem"))
    return str(d / "other-ca.pem")


def foreign_client(d: Path) -> dict[str, str]:
    """A tls block's client certificate and key that another CA issued (the servers reject it)."""
    import trustme

    cert = trustme.CA().issue_cert("ferry")
    cert.cert_chain_pems[0].write_to_path(str(d / "foreign-cert.pem"))
    cert.private_key_pem.write_to_path(str(d / "foreign-key.pem"))
    return {"cert_file": str(d / "foreign-cert.pem"), "key_file": str(d / "foreign-key.pem")}


class NetSplit:
    """A TCP proxy on 127.0.0.1 to `target` ("host:port") that a network split can cut: from
    `split()` until `heal()` nothing crosses it either way and nothing is closed (each side's
    bytes wait, as TCP retransmits them through a split; new connections are accepted and hear
    nothing), so a process behind it runs on while its peers hear nothing from it, and what it
    sent during the split arrives once the split heals."""

    def __init__(self, target: str) -> None:
        import socket
        import threading

        self._socket = socket
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._open: list[Any] = []
        self._thread = threading.Thread
        self._thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                upstream = self._socket.create_connection(self.target, timeout=5)
            except OSError:  # the target is down: the client sees its connection end
                client.close()
                continue
            upstream.settimeout(None)
            self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                self._thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a: Any, b: Any) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                self._flowing.wait()
                b.sendall(data)
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(self._socket.SHUT_RDWR)

    def split(self) -> None:
        self._flowing.clear()

    def heal(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._listener.close()
        for s in self._open:
            with contextlib.suppress(OSError):
                s.close()
        self._flowing.set()
