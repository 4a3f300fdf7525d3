"""Every option of every command, fed what a fuzzer would (hypothesis): NaN, infinities, zero,
negatives and huge numbers for numeric options; odd Unicode for names. Each command line is run
in this process through ferry's own entry point up to the moment it would dial a broker or start
Spark (both are cut there): the outcome is a one-line refusal that changed nothing, or a command
that got as far as asking a broker. Never a traceback."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ferry import cli
from tests.helpers import VALID

MAP = "name: shop\npartitions:\n  - {name: eu, stream: P_EU, cluster: east, patterns: ['shop.eu.>']}\n"

# a command line each command accepts, but for the brokers it then asks ({d}: the example's folder)
BASE: dict[str, list[str]] = {
    "move": ["S", "--to", "west"],
    "failback": ["--from", "ltm", "--to", "ltm", "--target-queue", "q"],
    "copy": ["jetstream://east/X", "parquet://{d}/out"],
    "load": ["nats://east", "--count", "5", "--ledger", "{d}/ledger"],
    "snapshot": ["jetstream://east/X", "--out", "{d}/snap"],
    "audit": ["--ledger", "{d}", "--tier", "js=jetstream://east/X"],
    "repair consumers": ["S"],
    "node evacuate": ["east-1"],
    "node status": ["east-1"],
    "node stop": ["east-1"],
    "cluster rebalance": ["east", "--nodes", "east-1,east-2"],
    "cluster status": ["east"],
    "cluster stop": ["east"],
    "replicate start": ["--from", "east", "--to", "east"],
    "replicate stop": ["--from", "east", "--to", "east"],
    "replicate status": [],
    "site status": [],
    "site failover": ["--to", "lab"],
    "site failback": ["--to", "lab"],
    "partition check": ["{d}/map.yaml"],
    "partition route": ["shop.eu.1"],
    "partition plan": ["{d}/map.yaml"],
    "partition status": [],
    "partition apply": ["{d}/map.yaml"],
    "stream add": ["S", "--cluster", "east", "--subject", "s.>"],
    "stream info": ["S", "--cluster", "east"],
    "stream rm": ["S", "--cluster", "east"],
    "topology check": ["{d}/t.yaml"],
    "topology smoke": ["--stream-in", "east"],
    "lab haproxy-config": ["east"],
    "lab failback-setting": [],
}
# long-running or lab-starting commands: a process of their own in their own tests
SKIPPED = {"serve", "replicate run", "lab up", "lab down", "lab status"}


class Dialled(BaseException):
    """A command reached a broker (or Spark): cut there. A BaseException, so no retry loop takes it."""


def _options() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(command, option) of every numeric option, and of every name option and argument."""
    numeric, names = [], []

    def walk(cmd: Any, path: list[str]) -> None:
        subs = getattr(cmd, "commands", {})
        if not subs and " ".join(path) not in SKIPPED:
            name = " ".join(path)
            assert name in BASE, f"a new command {name!r}: give it a command line in BASE"
            for p in cmd.params:
                kind = str(getattr(getattr(p, "type_descriptor", None), "annotation", ""))
                if kind in ("<class 'int'>", "<class 'float'>"):
                    numeric.append((name, p.opts[0]))
                elif kind == "<class 'str'>" and p.param_type_name == "option" and "spark" not in p.opts[0]:
                    names.append((name, p.opts[0]))
                elif p.param_type_name == "argument" and p.name in ("stream", "node", "cluster", "name"):
                    names.append((name, f"#{p.name}"))
        for n, sub in subs.items():
            walk(sub, [*path, n])

    walk(cli.command(), [])
    return numeric, names


NUMERIC, NAMES = _options()
NUMBERS = st.sampled_from(["nan", "inf", "-inf", "0", "-1", "-0.5", "1e308", "99999999999999999999999", "1e-9"])
ODD = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]) | st.sampled_from("ÜÏ.>* \t$\u200b\u202e😀"),
    min_size=1,
    max_size=12,
).filter(lambda s: not s.startswith("-"))


@pytest.fixture
def cut(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Every broker connection and every Spark session raises Dialled; the example's folder."""

    def dial(*_: Any, **__: Any) -> Any:
        raise Dialled

    async def adial(*_: Any, **__: Any) -> Any:
        raise Dialled

    monkeypatch.setattr(socket, "create_connection", dial)
    monkeypatch.setattr(asyncio.BaseEventLoop, "create_connection", adial)
    monkeypatch.setattr(asyncio, "open_connection", adial)
    from ferry.spark import session

    monkeypatch.setattr(session, "factory", dial)
    monkeypatch.setattr(session, "get_session", dial)
    monkeypatch.setenv("FERRY_T_APP", "app-password")
    monkeypatch.setenv("FERRY_T_SYS", "sys-password")
    monkeypatch.setenv("FERRY_T_LTM", "ltm-password")
    monkeypatch.setenv("FERRY_TOPOLOGY", str(tmp_path / "t.yaml"))
    monkeypatch.setenv("FERRY_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _outcome(argv: list[str], d: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run `ferry ARGV` in this process: 'refused' (one line, nothing changed) or 'dialled'."""
    import shutil

    for f in d.iterdir():
        shutil.rmtree(f) if f.is_dir() else f.unlink()
    (d / "t.yaml").write_text(VALID)
    (d / "map.yaml").write_text(MAP)
    before = sorted(d.rglob("*"))
    old = sys.argv
    sys.argv = ["ferry", *argv]
    try:
        cli.main()
    except Dialled:
        return "dialled"
    except SystemExit as exit_:
        said = capsys.readouterr().err.strip().splitlines()
        if exit_.code == 0:
            return "dialled"  # answered without a broker (a check, a config printed)
        assert said and said[-1].startswith(("error: ", "Usage")), (argv, said)
        assert "Traceback" not in "\n".join(said), (argv, said)
        assert sorted(d.rglob("*")) == before, (argv, "changed files", said)
        return "refused"
    finally:
        sys.argv = old
        capsys.readouterr()
    return "dialled"


def _argv(command: str, d: Path, option: str, value: str) -> list[str]:
    base = [a.replace("{d}", str(d)) for a in BASE[command]]
    if option.startswith("#"):  # the command's first argument
        return [*command.split(), value, *base[1:]]
    return [*command.split(), *base, f"{option}={value}"]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(NUMERIC), value=NUMBERS)
def test_every_numeric_option_refuses_or_goes_on_never_a_traceback(
    which: tuple[str, str], value: str, cut: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command, option = which
    got = _outcome(_argv(command, cut, option, value), cut, capsys)
    if value in ("nan", "inf", "-inf"):
        assert got == "refused", (command, option, value)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(NAMES), value=ODD)
@example(which=("load", "--url"), value="\x85")  # U+0085 split "no server answered at ..." in two
def test_every_name_refuses_odd_unicode_in_one_line_or_goes_on(
    which: tuple[str, str], value: str, cut: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command, option = which
    _outcome(_argv(command, cut, option, value), cut, capsys)


def test_the_walk_found_the_options() -> None:
    assert len(NUMERIC) >= 30 and len(NAMES) >= 40, (len(NUMERIC), len(NAMES))
