"""`ferry lab up | haproxy-config | failback-setting | status | down`."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.table import Table

from ferry.cli.options import PLAIN, DirOpt, JsonOpt, TopologyOpt, host_port_arg, lab_dir_arg, open_topology, run
from ferry.cli.render import err, out, print_json

lab_app = typer.Typer(**PLAIN, help="Real brokers on 127.0.0.1 for demos, tests and benchmarks.", no_args_is_help=True)


# -- lab ---------------------------------------------------------------------------------


@lab_app.command("up")
def lab_up(
    profile: Annotated[str, typer.Argument(help="supercluster | sites | rabbit-dr | rabbit-cluster | spark")],
    dir: DirOpt = None,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds to wait for health.")] = 180.0,
    haproxy: Annotated[
        bool,
        typer.Option("--haproxy", help="Put HAProxy (checked through `ferry serve`) in front of the lab's clusters."),
    ] = False,
    secure: Annotated[
        bool,
        typer.Option(
            "--secure",
            help="TLS on every port with client certificates required, the lab's own CA; NATS in operator "
            "mode (accounts APP, SALES, SYS; .creds files), RabbitMQ with TLS-only AMQP and management.",
        ),
    ] = False,
) -> None:
    """Start a profile's servers on 127.0.0.1 and wait until they are healthy."""
    from ferry import lab

    t0 = time.perf_counter()
    state = lab.up(
        profile, lab_dir_arg(dir), timeout=timeout, log=lambda m: err.print(m), haproxy=haproxy, secure=secure
    )
    out.print(f"lab {profile}: {len(state.procs)} processes healthy in {time.perf_counter() - t0:.1f}s")
    if state.spark:
        sp = state.spark
        out.print(f"Spark master: {sp['master']}  UI: {sp['master_ui']}  Spark Connect: {sp['connect']}")
        out.print(f"executors' Python (no ferry in it): {sp['python']}")
        out.print(f"for ferry's commands: set -a; . {sp['env_file']}; set +a")
        return
    out.print(f"topology: {(lab_dir_arg(dir) or lab.lab_root()) / 'topology.yaml'}")
    if state.lb:
        out.print(f"ferry serve: {state.lb['serve']}  HAProxy stats: {state.lb['stats']}")
        out.print(f"console: {state.lb['serve']}/  (bearer token in {state.lb['token_file']})")
        out.print(f"its state directory (moves it adopts): FERRY_STATE_DIR={state.lb['state_dir']}")
        if "prometheus" in state.lb:
            out.print(
                f"Prometheus: {state.lb['prometheus']}  (scrapes ferry serve every second, ferry's alerts loaded)"
            )
        for name, urls in state.lb["clusters"].items():
            out.print(f"through HAProxy: {name}: {' '.join(urls.values())}")


def _host_port(help: str) -> Any:
    """An option written into haproxy.cfg as it is: HOST:PORT, checked."""
    return typer.Option(help=help, callback=host_port_arg)


@lab_app.command("haproxy-config")
def lab_haproxy_config(
    cluster: Annotated[str, typer.Argument(help="The NATS or RabbitMQ cluster to front.")],
    serve: Annotated[str, _host_port("host:port of `ferry serve` (the availability check).")] = "127.0.0.1:8377",
    nats_bind: Annotated[str, _host_port("Where HAProxy listens for NATS clients.")] = "*:4222",
    amqp_bind: Annotated[str, _host_port("Where HAProxy listens for AMQP clients.")] = "*:5672",
    mqtt_bind: Annotated[str, _host_port("Where HAProxy listens for MQTT clients ('' for none).")] = "*:1883",
    topology: TopologyOpt = None,
) -> None:
    """Print an haproxy.cfg for a cluster of the topology: leastconn, node health + ferry's availability check."""
    from ferry.lab import haproxy

    c = open_topology(topology).cluster(cluster)
    fronts = haproxy.frontends(cluster, c, nats_bind if c.kind == "nats" else amqp_bind, mqtt_bind or None)
    out.print(haproxy.render(fronts, serve, stats_bind="127.0.0.1:8404"), highlight=False, markup=False)


@lab_app.command("failback-setting")
def lab_failback_setting(
    queues: Annotated[int, typer.Option(min=1, help="Federated queues fed-0 .. fed-N-1 (in vhost /).")] = 4,
    messages: Annotated[int, typer.Option(min=0, help="Messages left on each of ltm's federated queues.")] = 500,
    topology: TopologyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """On the rabbit-dr lab: upstream art federates queues to pc1 and ltm, and ltm's hold messages
    nobody consumed (what `ferry failback --from ltm --to pc1` brings home). Run again, it adds as
    many messages again."""
    from ferry.lab.scenarios import dr_federation, fill_queue

    topo = open_topology(topology)
    for name in ("art", "pc1", "ltm"):
        topo.rabbitmq(name)  # a one-line error on another lab's topology
    names = [f"fed-{i}" for i in range(queues)]

    async def go() -> dict[str, Any]:
        setting = await dr_federation(topo, ["/"], names, prefix="fed-")
        for queue in names:
            await fill_queue(topo, "ltm", "/", queue, messages)
        return {**setting, "ltm_messages_per_queue": messages}

    result = run(go())
    if as_json:
        print_json(result)
        return
    out.print(
        f"art federates {', '.join(names)} (vhost /) to pc1 and ltm; each of them on ltm holds {messages:,} "
        "messages more, left behind as after a DR\n"
        "next: ferry failback --from ltm --to pc1 --dry-run"
    )


@lab_app.command("status")
def lab_status(dir: DirOpt = None, as_json: JsonOpt = False) -> None:
    """Each lab server: pid, ports, health."""
    from ferry import lab

    root = lab_dir_arg(dir)
    rows = lab.status(root)
    if as_json:
        print_json(rows)
        return
    if not rows:
        out.print(f"no lab is running under {root or lab.lab_root()}")
        return
    table = Table("profile", "server", "kind", "pid", "ports", "health")
    if any("executors" in r for r in rows):
        table.add_column("executors")
    for r in rows:
        ports = " ".join(f"{k}={v}" for k, v in r["ports"].items())
        health = "[green]ok[/]" if r["health"] == "ok" else f"[red]{r['health']}[/]"
        running = ", ".join(f"{e['app_id']}/{e['executor']} ({e['app']})" for e in r.get("executors", []))
        extra = [running or ("none" if "executors" in r else "")] if len(table.columns) > 6 else []
        table.add_row(r["profile"], r["server"], r["kind"], str(r["pid"]), ports, health, *extra)
    out.print(table)


@lab_app.command("down")
def lab_down(
    profile: Annotated[str | None, typer.Argument(help="Profile to stop (default: all).")] = None,
    dir: DirOpt = None,
) -> None:
    """Stop exactly the processes the lab started and remove its files."""
    from ferry import lab

    stopped = lab.down(profile, lab_dir_arg(dir), log=lambda m: out.print(m))
    if not stopped:
        out.print("nothing to stop")


def register(app: typer.Typer) -> None:
    """Add lab's commands to `app`."""
    app.add_typer(lab_app, name="lab")
