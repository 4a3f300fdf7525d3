"""The `ferry` command line: one module per command group, each with ``register(app)``.

A command parses its options, calls its job (:mod:`ferry.jobs`), and renders the result
(:mod:`.render`): tables and lines for people, or one JSON document with ``--json``. The one
error policy is here (:func:`main`): an error a user can cause ends as one line on stderr and a
non-zero exit code, never a traceback.

Lifecycle verbs are the same wherever a job has the step: ``--dry-run`` prints the plan and
changes nothing; ``status`` shows what is on record; ``stop`` ends what runs. A command that only
reads, or that a user asks for by name (``move``, ``copy``, ``failback``, ``node evacuate``,
``partition apply``), runs at once; one that only proposes what to change across a cluster
(``cluster rebalance``, a repartition that moves stored messages) changes nothing without
``--execute``.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable
from typing import Annotated, Any

import pydantic
import typer
from rich.markup import escape

from ferry.cli import copy, failback, lab, move, node, partition, proof, replicate, serve, stream, topology
from ferry.cli.options import PLAIN, interrupt_spark
from ferry.cli.render import err, out, spark_event
from ferry.errors import FerryError, redact
from ferry.spark import on_session

try:  # typer vendors click since 0.2x; its errors are what a bad command line raises
    from typer._click.exceptions import BadParameter, ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover
    from click.exceptions import BadParameter, ClickException, NoArgsIsHelpError


app = typer.Typer(
    **PLAIN,
    name="ferry",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(show: bool) -> None:
    if show:
        from ferry import __version__

        out.print(f"ferry {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print ferry's version and exit.")
    ] = False,
) -> None:
    """Move message workloads between NATS JetStream and RabbitMQ clusters without losing a message.

    Every job has the same verbs where it has the step: --dry-run prints the plan and changes
    nothing; status (a subcommand, or --status) shows what is on record; stop (a subcommand, or
    --stop) ends what runs. A command does what you name at once (move, copy, failback, node
    evacuate, partition apply); where ferry itself works out what to change across a cluster
    (cluster rebalance, a repartition that moves stored messages) it only proposes until
    --execute. Add --json for one JSON document.
    """


# the five jobs first, then the proof and the tools around them
for group in (move, node, replicate, failback, partition, copy, proof, stream, topology, serve, lab):
    group.register(app)


def main() -> None:
    # client libraries log connection failures themselves; ferry reports them once, as one line
    for name in ("aiormq", "aio_pika", "nats", "py4j", "asyncio"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # py4j reports a call cut short by Ctrl-C on the root logger, with a traceback each time: the
    # root logger keeps quiet, and ferry's own loggers write their lines to stderr
    logging.getLogger().addHandler(logging.NullHandler())
    if not logging.getLogger("ferry").handlers:  # once (a test runs main() again in one process)
        logging.getLogger("ferry").addHandler(logging.StreamHandler())
    on_session(spark_event)  # each Spark session says its application id (and, on a cluster, what shipped)
    try:
        code = command()(standalone_mode=False)  # usage errors come here, to be reported on one line
    except NoArgsIsHelpError as exc:
        err.print(exc.format_message(), highlight=False, markup=False)
        sys.exit(2)
    except ClickException as exc:  # bad usage: one line, exit 2
        _error(redact(exc.format_message()))
        sys.exit(exc.exit_code)
    except typer.Abort:
        _interrupted()
    except FerryError as exc:
        _error(str(exc))
        sys.exit(exc.exit_code)
    except pydantic.ValidationError as exc:
        e = exc.errors()[0]
        where = ".".join(str(x) for x in e["loc"])
        _error(f"{where}: {redact(e['msg'].removeprefix('Value error, '))}")
        sys.exit(2)
    except KeyboardInterrupt:
        _interrupted()
    except TimeoutError as exc:  # an OSError, but a broker's: said as the broker kinds say it
        _failed(_translated(exc))
    except OSError as exc:  # a path that is not what the command needs (a file where a directory goes)
        where = f": {exc.filename}" if exc.filename else ""
        _error(f"{redact(exc.strerror or str(exc))}{where}")
        sys.exit(1)
    except Exception as exc:  # a broker's answer no command turned into a ferry error, or a Spark job's failure
        failure = _translated(exc)
        if failure is None:
            raise
        _failed(failure)
    if code == 130:  # typer's answer to Ctrl-C
        _interrupted()
    sys.exit(code if isinstance(code, int) else 0)  # a typer.Exit's code, else success


def command() -> Any:
    """The command line as click runs it: every option of every command refuses NaN and infinity
    (pydantic, which parses them, takes both: a rate of NaN ran flat out, a timeout of infinity
    never ended)."""

    def finite(callback: Callable[..., Any] | None) -> Callable[..., Any]:
        def check(ctx: Any, param: Any, value: Any) -> Any:
            if isinstance(value, float) and not math.isfinite(value):
                raise BadParameter(f"{value} is not a finite number", ctx=ctx, param=param)
            return callback(ctx, param, value) if callback else value

        return check

    def walk(cmd: Any) -> None:
        for param in cmd.params:
            param.callback = finite(param.callback)
        for sub in getattr(cmd, "commands", {}).values():
            walk(sub)

    root = typer.main.get_command(app)
    walk(root)
    return root


def _translated(exc: BaseException) -> FerryError | None:
    """A library's error as the broker kinds translate it, or a Spark job's failure as one line."""
    from ferry.brokers import translate

    if type(exc).__module__.startswith(("pyspark", "py4j")):
        from ferry.spark.session import spark_error

        return spark_error(exc)  # type: ignore[arg-type]
    return translate(exc)


def _failed(failure: FerryError | None) -> None:
    assert failure is not None
    _error(str(failure))
    sys.exit(failure.exit_code)


def _error(message: str) -> None:
    """An error as one line: a character that would break it or not show (a newline, U+0085 typed
    in a URL, a zero-width space) is written as its escape."""
    shown = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in message)
    err.print(f"[red]error:[/] {escape(shown)}", highlight=False)


def _interrupted() -> None:
    interrupt_spark()
    err.print("interrupted")
    sys.exit(130)
