"""The command line as a shell runs it: bad input is one line and exit 2; lab haproxy-config."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from ferry.cli import BadParameter, app, command
from ferry.cli.render import event_line
from tests.helpers import FERRY, UNREACHABLE, VALID


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["node", "evacuate", "east-1", "--conn-evict-rate", "-5"], "--conn-evict-rate"),
        (["move", "S", "--to", "west", "--timeout", "soon"], "--timeout"),
        (["node", "evacuate"], "Missing argument"),
        (["no-such-command"], "No such command"),
        (["stream", "info", "a b", "-c", "east"], "invalid stream name 'a b': no ' ' allowed"),
        (["move", "bad.name", "--to", "west"], "invalid stream name 'bad.name': no '.' allowed"),
        (["repair", "consumers", "x>"], "invalid stream name 'x>'"),
    ],
)
def test_bad_command_lines_get_one_line_and_exit_2(args: list[str], expected: str) -> None:
    """The real entry point, not typer's test runner."""
    r = subprocess.run([*FERRY, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    assert len(r.stderr.strip().splitlines()) == 1 and expected in r.stderr, r.stderr
    assert r.stderr.startswith("error: ") and not r.stdout


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--rate", "-5"),
        ("--rate", "nan"),
        ("--rate", "inf"),
        ("--duration", "-5"),
        ("--duration", "nan"),
        ("--producers", "0"),
        ("--producers", "2000000000"),  # a connection each: more than any open-file limit
        ("--size", "8"),
        ("--size", "1000000000000"),
        ("--count", "100000000000000000000000"),
        ("--give-up-after", "0"),
    ],
)
def test_bad_load_options_are_refused_before_anything_is_written(tmp_path, option: str, value: str) -> None:
    topo = tmp_path / "t.yaml"
    topo.write_text(VALID)
    args = ["load", "nats://east", "--ledger", str(tmp_path / "ledger"), "--count", "5", option, value]
    r = subprocess.run([*FERRY, *args, "--topology", str(topo)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and option in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "ledger").exists()


def test_every_number_option_of_every_command_refuses_nan_and_infinity() -> None:
    """Parsed by pydantic, a float option takes NaN and infinity (a rate of NaN ran flat out): each
    one, found by walking the command tree, is refused where it is parsed."""
    root = command()
    found: list[tuple[list[str], str]] = []

    def walk(cmd: Any, path: list[str]) -> None:
        for p in cmd.params:
            if "float" in str(getattr(getattr(p, "type_descriptor", None), "annotation", "")):
                found.append((path, p.opts[0]))
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, [*path, name])

    walk(root, [])
    assert len(found) >= 15, found
    for path, option in found:
        for bad in ("nan", "inf", "-inf"):
            with pytest.raises(BadParameter) as refused:
                root.main([*path, f"{option}={bad}"], prog_name="ferry", standalone_mode=False)
            # (pydantic refuses NaN itself where the option has bounds: "greater than or equal to 1")
            assert f"Invalid value for '{option}'" in refused.value.format_message(), (path, option, bad)


def test_a_load_that_fails_before_its_first_message_leaves_no_ledger(tmp_path) -> None:
    topo = tmp_path / "t.yaml"
    topo.write_text(UNREACHABLE)
    args = ["load", "jetstream://east", "--count", "5", "--ledger", str(tmp_path / "ledger"), "--topology", str(topo)]
    env = {**os.environ, "FERRY_T_APP": "secret"}
    r = subprocess.run([*FERRY, *args], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1 and "no server answered" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "ledger").exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["copy", "jetstream://east/X?start_seq=10&end_seq=2", "parquet:///tmp/x"], "end_seq 2 is before start_seq 10"),
        (["copy", "jetstream://east/X?password=hunter2", "parquet:///tmp/x"], "'jetstream://east/X?password=***'"),
        (["load", "jetstream://east?pw=hunter2", "--count", "1", "--ledger", "/tmp/x"], "unknown option 'pw'"),
        (["copy", "jetstream://east/X", "parquet:///proc/x"], "'parquet:///proc/x': cannot write under /proc"),
        (["snapshot", "jetstream://east/X", "--out", "/proc/x"], "cannot write under /proc"),
        (
            ["load", "nats://east", "--count", "1", "--ledger", "/proc/x"],
            "ledger directory /proc/x: cannot write under",
        ),
        (["serve", "--port", "99999"], "--port"),
        (["serve", "--port=-1"], "--port"),
    ],
)
def test_bad_input_is_refused_before_any_broker_is_asked(tmp_path, args: list[str], expected: str) -> None:
    """Nothing listens where the topology points: each of these is refused before ferry dials."""
    topo = tmp_path / "t.yaml"
    topo.write_text(UNREACHABLE)
    r = subprocess.run([*FERRY, *args, "--topology", str(topo)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert expected in r.stderr and "hunter2" not in r.stderr, r.stderr


def test_a_topology_that_is_not_text_is_one_line(tmp_path) -> None:
    topo = tmp_path / "t.yaml"
    topo.write_bytes(b"\xff\xfe\x00binary")
    for args in (["topology", "check", str(topo)], ["stream", "info", "X", "-c", "east"]):
        r = subprocess.run(
            [*FERRY, *args], capture_output=True, text=True, timeout=60, env={**os.environ, "FERRY_TOPOLOGY": str(topo)}
        )
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            f"error: {topo}: not a text file (byte 0: not UTF-8); a topology is YAML"
        ], r.stderr


def test_a_nats_load_target_with_a_stream_in_it_is_refused(tmp_path) -> None:
    """The subject says where a NATS load goes: a path (a stream's name, say) would be ignored."""
    topo = tmp_path / "t.yaml"
    topo.write_text(VALID)
    args = ["load", "jetstream://east/ORDERS", "--subject", "o.{n}", "--count", "5", "--ledger", str(tmp_path / "l")]
    r = subprocess.run([*FERRY, *args, "--topology", str(topo)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "'jetstream://east/ORDERS': jetstream://CLUSTER takes no path" in r.stderr, r.stderr
    assert not (tmp_path / "l").exists()


@pytest.mark.parametrize("broken", ["ledger", "tier"])
def test_an_audit_input_that_is_not_parquet_is_one_line(tmp_path, broken: str) -> None:
    ledger, tier = audit_inputs(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "notes.txt").write_text("not a table")
    ledger, tier = (bad, tier) if broken == "ledger" else (ledger, bad)
    args = ["audit", "--ledger", str(ledger), "--tier", f"t={tier}", "--html", str(tmp_path / "r.html")]
    r = subprocess.run([*FERRY, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"error: {broken} '{bad}' is not Parquet") and not (tmp_path / "r.html").exists()


def audit_inputs(root):  # type: ignore[no-untyped-def]
    """An empty ledger and an empty snapshot, as `ferry load` and `ferry snapshot` write them."""
    import pyarrow.parquet as pq

    from ferry.jobs.proof.load import LEDGER_SCHEMA
    from ferry.schema import ARROW_SCHEMA

    for name, schema in (("ledger", LEDGER_SCHEMA), ("tier", ARROW_SCHEMA)):
        (root / name).mkdir()
        pq.write_table(schema.empty_table(), root / name / "part-0.parquet")
    return root / "ledger", root / "tier"


def test_a_ledger_for_a_snapshot_or_an_empty_directory_is_named_before_spark_runs(tmp_path) -> None:
    ledger, tier = audit_inputs(tmp_path)
    (tmp_path / "empty").mkdir()
    cases = [
        (["--ledger", str(tier), "--tier", f"t={tier}"], f"ledger '{tier}' is not a ledger (`ferry load --ledger`): "),
        (["--ledger", str(ledger), "--tier", f"t={ledger}"], f"tier '{ledger}' is not a snapshot (`ferry snapshot`)"),
        (["--ledger", str(tmp_path / "empty"), "--tier", f"t={tier}"], "holds no Parquet file"),
    ]
    audit = [*FERRY, "audit"]
    for args, expected in cases:
        r = subprocess.run([*audit, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and expected in r.stderr, r.stderr


def test_one_load_given_twice_or_one_tier_name_twice_is_refused_before_spark_runs(tmp_path) -> None:
    """Both used to be audited: a ledger and its copy doubled every count, a second tier of one name
    replaced the first."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from ferry.jobs.proof.load import LEDGER_SCHEMA

    ledger, tier = audit_inputs(tmp_path)
    row = {n: [None] for n in LEDGER_SCHEMA.names} | {"id": ["r1-p0-1"], "run": ["r1"], "sent_ns": [1]}
    pq.write_table(pa.table(row, schema=LEDGER_SCHEMA), ledger / "part-0.parquet")
    shutil.copytree(ledger, tmp_path / "copy")
    cases = [
        (["--ledger", str(ledger), "--ledger", str(tmp_path / "copy"), "--tier", f"t={tier}"], "both hold load r1"),
        (["--ledger", str(ledger), "--tier", f"t={tier}", "--tier", f"t={tier}"], "--tier t: given twice"),
    ]
    audit = [*FERRY, "audit", "--html", str(tmp_path / "r.html")]
    for args, expected in cases:
        r = subprocess.run([*audit, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and expected in r.stderr, r.stderr
        assert not (tmp_path / "r.html").exists()


def test_haproxy_config_for_a_topology_cluster(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("FERRY_T_APP", "FERRY_T_SYS", "FERRY_T_LTM"):
        monkeypatch.setenv(var, "secret-" + var)
    topo = tmp_path / "t.yaml"
    topo.write_text(VALID)
    result = CliRunner().invoke(
        app, ["lab", "haproxy-config", "east", "--serve", "ferry:9000", "--topology", str(topo)]
    )
    assert result.exit_code == 0, result.output
    cfg = result.output
    assert "server east-1 127.0.0.1:4222 check addr 127.0.0.1 port 8222" in cfg
    assert "http-check connect addr ferry port 9000" in cfg and "secret-" not in cfg
    result = CliRunner().invoke(app, ["lab", "haproxy-config", "ltm", "--topology", str(topo)])
    assert result.exit_code == 0 and "server ltm-1 127.0.0.1:5672" in result.output, result.output
    assert "http-check connect ssl" not in cfg + result.output  # plain health ports: plain checks
    tls = "        tls: {ca_file: /etc/ca.pem, cert_file: /etc/c.pem, key_file: /etc/k.pem, server_name: nats-a}\n"
    topo.write_text(
        VALID.replace("    kind: nats\n", "    kind: nats\n" + tls).replace(
            "http://127.0.0.1:8222", "https://127.0.0.1:8222"
        )
    )
    result = CliRunner().invoke(
        app, ["lab", "haproxy-config", "east", "--serve", "ferry:9000", "--topology", str(topo)]
    )
    assert result.exit_code == 0, result.output
    assert (
        "  http-check connect ssl\n" in result.output and "http-check connect addr ferry port 9000\n" in result.output
    )
    assert (
        "server east-1 127.0.0.1:4222 check addr 127.0.0.1 port 8222 verify required ca-file /etc/ca.pem "
        "crt /etc/c.pem verifyhost nats-a"
    ) in result.output


@pytest.mark.parametrize(
    ("event", "data", "line"),
    [
        ("placement", {"placement": {"cluster": "west"}}, "placement: placement.cluster=west"),
        ("guard", {"subjects": ["orders.>", "x.*"], "file": "/f"}, "guard: subjects=orders.>,x.* file=/f"),
        ("state", {"state": "evicting_conns"}, "state: evicting_conns"),
        ("relaying", {}, "relaying"),
        ("active", {"previous": None}, "active: previous=-"),
        ("peers", {"peers": [{"name": "a"}]}, 'peers: [{"name": "a"}]'),
    ],
)
def test_events_read_as_text_not_python_values(event: str, data: dict, line: str) -> None:
    assert event_line(event, data) == line


def test_version() -> None:
    from ferry import __version__

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"ferry {__version__}"


def test_ctrl_c_while_the_command_line_loads_is_one_line() -> None:
    """The `ferry` script's entry point catches a Ctrl-C during its imports (about a second): the
    interrupt is sent as the import of ferry.cli begins, where a user's Ctrl-C lands."""
    script = """
import os, signal, sys
class Interrupt:
    def find_spec(self, name, path, target=None):
        if name == "ferry.cli":
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, Interrupt())
sys.argv = ["ferry", "--help"]
from ferry.__main__ import main
main()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr, result.stdout) == (130, "interrupted\n", "")


def test_no_module_defines_a_function_twice() -> None:
    """A second top-level definition silently replaces the first for every caller (ruff's F811
    misses it once the first is used): the move's event printer was replaced that way once."""
    import ast
    from collections import Counter
    from pathlib import Path

    import ferry

    twice = {}
    for path in Path(ferry.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = Counter(n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
        if dups := [n for n, k in names.items() if k > 1]:
            twice[path.name] = dups
    assert twice == {}


def test_ctrl_c_reaches_remote_spark_jobs_before_their_threads_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command whose Spark job runs in a thread (failback, the relay): on Ctrl-C, `run` interrupts
    Spark Connect jobs at once; asyncio.run would first wait for the thread, i.e. the whole job."""
    import asyncio
    import os
    import signal
    import threading
    import time

    from ferry.cli import options

    called: list[float] = []
    monkeypatch.setattr(options, "interrupt_spark", lambda: called.append(time.monotonic()))
    job_over = threading.Event()

    def job() -> None:  # a remote job: it ends once interrupted (or after 10 s)
        deadline = time.monotonic() + 10
        while not called and time.monotonic() < deadline:
            time.sleep(0.05)
        job_over.set()

    async def command() -> None:
        asyncio.get_running_loop().call_later(0.3, os.kill, os.getpid(), signal.SIGINT)
        await asyncio.to_thread(job)

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        options.run(command())
    assert called and called[0] - t0 < 3, "the interrupt waited for the job"
    assert job_over.is_set()


def test_a_command_after_an_interrupted_one_may_start_spark_jobs() -> None:
    """An interrupt stops this process's Spark jobs; the next command of the process (the API's
    callers run several) starts with the flag cleared."""
    import asyncio

    from ferry.cli.options import run
    from ferry.spark import session

    session.interrupt()
    assert session._interrupted.is_set()
    run(asyncio.sleep(0))
    assert not session._interrupted.is_set()


def test_a_path_that_is_not_what_a_command_needs_is_one_line(tmp_path) -> None:
    """A directory for a file: one line, exit 2; an HTML report's missing directory is
    found before the audit's Spark job, not after it."""
    cli = FERRY
    r = subprocess.run([*cli, "topology", "check", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"error: {tmp_path}: cannot read the topology file (Is a directory)"
    ledger, tier = audit_inputs(tmp_path)
    args = ["audit", "--ledger", str(ledger), "--tier", f"t={tier}", "--html", "/no/such/dir/a.html"]
    r = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "error: --html '/no/such/dir/a.html': no such directory '/no/such/dir'"


def test_route_by_a_map_with_an_overlap_is_refused(tmp_path) -> None:
    """Two owners of one subject would route it to either: the map is refused, as apply refuses it."""
    m = tmp_path / "m.yaml"
    m.write_text(
        "name: m\npartitions:\n"
        "  - {name: a, stream: A, patterns: ['a.>']}\n"
        "  - {name: b, stream: B, patterns: ['a.x']}\n"
    )
    r = subprocess.run(
        [*FERRY, "partition", "route", "a.x", "--map", str(m)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and not r.stdout, r
    assert r.stderr.strip() == "error: map 'm': partition 'a' 'a.>' overlaps partition 'b' 'a.x': both own 'a.x'", (
        r.stderr
    )


@pytest.mark.parametrize(
    ("engine", "begun", "says"),
    [
        ("shovel", [("journal", {"upstreams": 2})], "unfinished: ltm's federation upstreams may be partly off."),
        ("shovel", [("journal", {"upstreams": 2}), ("upstream-disabled", {})], "unfinished: ltm's federation ups"),
        (
            "shovel",
            [("journal", {"upstreams": 2}), ("upstream-disabled", {}), ("upstream-disabled", {})],
            "unfinished: its shovels may still move messages, and ltm's federation upstreams stay off.",
        ),
        (
            "spark",
            [("resume", {"phase": "transferring", "upstreams": 1})],
            "unfinished: ltm's federation upstreams stay off.",
        ),
        ("spark", [("resume", {"phase": "disabling", "upstreams": 3})], "upstreams may be partly off."),
        (
            "spark",
            [("resume", {"phase": "restoring", "upstreams": 2}), ("upstream-restored", {})],
            "upstreams may be partly off.",
        ),
    ],
)
def test_an_interrupted_failback_says_what_it_left(engine: str, begun: list, says: str) -> None:
    """Interrupted after its journal was written, a failback is on record: it used to print only
    "interrupted" until an upstream was disabled, and "stay off" once one of several was."""
    from ferry.cli.failback import interrupted_note

    said = interrupted_note("ltm", "pc1", engine, begun)
    assert said.startswith("the failback from ltm to pc1 is on record, unfinished: ") and says in said, said
    assert said.endswith("or add --abort to drop it and restore its upstreams")
    assert ("stay off" in said) == ("upstreams stay off" in says), said


def test_replicate_status_says_why_a_site_did_not_answer_in_its_state(tmp_path) -> None:
    from ferry.lab.procs import free_ports

    nyc, sfo = free_ports(2)  # nobody listens there
    topology = tmp_path / "topology.yaml"

    def site(name: str, port: int) -> dict:
        cluster = {"kind": "nats", "credentials": {"user": "app", "password_env": "T_PW"}}
        return {"clusters": {name: {**cluster, "brokers": [{"name": f"{name}-1", "url": f"nats://127.0.0.1:{port}"}]}}}

    topology.write_text(yaml.safe_dump({"version": 1, "sites": {"nyc": site("nyc", nyc), "sfo": site("sfo", sfo)}}))
    env = {**os.environ, "FERRY_TOPOLOGY": str(topology), "T_PW": "x", "COLUMNS": "400"}
    r = subprocess.run([*FERRY, "replicate", "status"], env=env, capture_output=True, text=True, timeout=60)
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in r.stdout.splitlines() if "unreachable" in line]
    assert [(row[1].split(":")[0], row[-1]) for row in rows] == [("unreachable", "")] * 2, r.stdout
    assert f"no server answered at nats://127.0.0.1:{sfo}" in rows[1][1], rows


def test_a_moves_done_line_tells_its_time_from_the_time_to_move_its_group(capsys: pytest.CaptureFixture[str]) -> None:
    from ferry.cli.move import _print_event

    done = {"outcome": "moved", "cluster": "west", "peers": ["w1", "w2"], "took_s": 9.921, "moved_in_s": 7.007}
    _print_event("done", stream="S", **done)
    said = capsys.readouterr().out.replace("\n", " ")
    assert "moved: S now in west on w1, w2 in 9.92s (7.01s to move its group, the rest to reconcile and verify)" in said
