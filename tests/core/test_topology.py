"""Topology files: valid ones load; each kind of bad one gives one line naming file, line and key."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ferry.brokers.rabbitmq import amqp_uri
from ferry.cli import app
from ferry.errors import ConfigError, FerryError, NotFound, redact
from ferry.topology import Topology, parse_topology
from ferry.uris import parse_uri
from tests.helpers import VALID


def test_valid_file_loads_and_resolves_names() -> None:
    topo = parse_topology(VALID, "t.yaml")
    assert topo.nats("east").brokers[0].name == "east-1"
    assert topo.rabbitmq("ltm").brokers[0].management_url == "http://127.0.0.1:15672"
    assert topo.site_of("ltm") == "dr"
    assert topo.cluster("dr") is topo.cluster("ltm")  # a one-cluster site answers to its name
    with pytest.raises(NotFound, match="unknown cluster 'nope'"):
        topo.cluster("nope")
    with pytest.raises(ConfigError, match="is rabbitmq, not nats"):
        topo.nats("ltm")


def _error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_topology(text, "t.yaml")
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "    kind: nats\n",
            "    kind: nats\n        colour: blue\n",
            "t.yaml:7: sites.lab.clusters.east.colour: unknown key",
        ),
        (
            "url: nats://127.0.0.1:4222",
            "url: nats//127.0.0.1:4222",
            "t.yaml:11: sites.lab.clusters.east.brokers[0].url: invalid URL",
        ),
        ("url: nats://127.0.0.1:4222", "url: http://127.0.0.1:4222", "scheme must be one of nats, tls"),
        (
            "url: amqp://127.0.0.1:5672",
            "url: amqp://127.0.0.1",
            "t.yaml:20: sites.dr.clusters.ltm.brokers[0].url: invalid URL 'amqp://127.0.0.1': no port",
        ),
        ("url: amqp://127.0.0.1:5672", "url: amqp://u:hunter2@127.0.0.1:5672", "URL carries a password"),
        # invalid otherwise too: the password is refused before the URL is quoted in an error
        ("url: amqp://127.0.0.1:5672", "url: amqp://u:hunter2@127.0.0.1", "URL carries a password"),
        ("url: nats://127.0.0.1:4222", "url: http://u:hunter2@127.0.0.1:4222", "URL carries a password"),
        ("kind: rabbitmq", "kind: kafka", "t.yaml:16: sites.dr.clusters.ltm.kind: unknown kind 'kafka'"),
        ("  dr:\n", "  lab:\n", "t.yaml:13: sites.lab: duplicate key"),
        (
            "name: ltm-1",
            "name: east-1",
            "t.yaml:19: sites.dr.clusters.ltm.brokers[0].name: duplicate broker name 'east-1'",
        ),
        ("{user: ferry, password_env: FERRY_T_LTM}", "{user: ferry, password_env: X, password_file: /y}", "not both"),
        (
            "{user: ferry, password_env: FERRY_T_LTM}",
            "{user: ferry, password: hunter2}",
            "password: a password never goes in the topology file: give password_env or password_file",
        ),
        (
            "        management_url: http://127.0.0.1:15672\n",
            "",
            "t.yaml:19: sites.dr.clusters.ltm.brokers[0].management_url: required key is missing",
        ),
        # NATS credentials are one of a user, a .creds file, an nkey seed or a token
        (
            "{user: app, password_env: FERRY_T_APP}",
            "{user: app, creds_file: /x.creds}",
            "t.yaml:7: sites.lab.clusters.east.credentials: give exactly one of user (with password_env or "
            "password_file), creds_file, nkey_seed_file, token_env or token_file (got user and creds_file)",
        ),
        ("{user: app, password_env: FERRY_T_APP}", "{password_env: FERRY_T_APP}", "a password needs its user"),
        (
            "{user: app, password_env: FERRY_T_APP}",
            "{token_env: T, token_file: /t}",
            "token_env or token_file, not both",
        ),
        ("{user: app, password_env: FERRY_T_APP}", "{token: hunter2}", "token: unknown key"),
        ("{user: ferry, password_env: FERRY_T_LTM}", "{creds_file: /x.creds}", "RabbitMQ credentials are a user"),
        (
            "    kind: nats\n",
            "    kind: nats\n        tls: {cert_file: /c.pem}\n",
            "t.yaml:7: sites.lab.clusters.east.tls: a client certificate needs both cert_file and key_file",
        ),
        ("    kind: nats\n", "    kind: nats\n        tls: {insecure: true}\n", "tls.insecure: unknown key"),
        (
            "    kind: nats\n",
            "    kind: nats\n        accounts: {'A B': {token_env: T}}\n",
            "t.yaml:7: sites.lab.clusters.east.accounts: bad account name 'A B'",
        ),
        ("    kind: nats\n", "    kind: nats\n        accounts: {SALES: {}}\n", "clusters.east.accounts.SALES"),
    ],
)
def test_bad_files_name_line_and_key(old: str, new: str, expected: str) -> None:
    assert old in VALID
    message = _error(VALID.replace(old, new))
    assert expected in message
    assert "hunter2" not in message


def test_duplicate_cluster_across_sites() -> None:
    text = VALID.replace("      ltm:\n", "      east:\n")
    assert _error(text).startswith("t.yaml:16: sites.dr.clusters.east: duplicate cluster name (also in site 'lab')")


def test_invalid_yaml_names_line() -> None:
    assert _error("sites:\n  lab: [\n").startswith("t.yaml:3: invalid YAML")


def test_missing_env_var_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_T_APP", "x")
    monkeypatch.delenv("FERRY_T_SYS", raising=False)
    monkeypatch.setenv("FERRY_T_LTM", "y")
    topo = parse_topology(VALID)
    assert topo.credential_problems() == [
        "sites.lab.clusters.east.system_credentials: environment variable FERRY_T_SYS is not set"
    ]
    with pytest.raises(ConfigError, match="FERRY_T_SYS is not set"):
        topo.nats("east").system_credentials.password()  # type: ignore[union-attr]


def test_cli_check_exit_codes(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in (("FERRY_T_APP", "a"), ("FERRY_T_SYS", "s"), ("FERRY_T_LTM", "l")):
        monkeypatch.setenv(var, value)
    good = tmp_path / "good.yaml"
    good.write_text(VALID)
    result = CliRunner().invoke(app, ["topology", "check", str(good), "--no-probe"])
    assert result.exit_code == 0, result.output
    assert "2 sites, 2 clusters, 2 brokers" in result.output

    monkeypatch.delenv("FERRY_T_LTM")
    result = CliRunner().invoke(app, ["topology", "check", str(good), "--no-probe"])
    assert result.exit_code == 1
    assert "FERRY_T_LTM is not set" in result.output


def test_erlang_access_needs_exactly_one_cookie_source(monkeypatch: pytest.MonkeyPatch) -> None:
    with_erlang = VALID.replace(
        "credentials: {user: ferry, password_env: FERRY_T_LTM}",
        "credentials: {user: ferry, password_env: FERRY_T_LTM}\n        erlang: {cookie_env: FERRY_T_COOKIE}",
    )
    access = parse_topology(with_erlang, "t.yaml").rabbitmq("ltm").erlang
    assert access is not None and access.epmd_port == 4369
    monkeypatch.setenv("FERRY_T_COOKIE", "s3cret")
    assert access.cookie() == "s3cret"
    monkeypatch.delenv("FERRY_T_COOKIE")
    with pytest.raises(ConfigError, match="FERRY_T_COOKIE is not set"):
        access.cookie()
    for bad in ("{}", "{cookie_env: A, cookie_file: /x}"):
        with pytest.raises(ConfigError, match="exactly one"):
            parse_topology(with_erlang.replace("{cookie_env: FERRY_T_COOKIE}", bad), "t.yaml")


def test_errors_mask_passwords_and_tokens() -> None:
    """A broker may echo the URI it refused (RabbitMQ's 400 on a shovel's dest-uri), and a Spark
    Connect URL may carry a token: no error ferry raises shows either."""
    message = str(
        FerryError('400 "amqp://ferry:hunter2@[::1]:5672/%2F" not a valid URI', hint="sc://h:1/;token=hunter2")
    )
    assert "hunter2" not in message and "amqp://ferry:***@[::1]:5672" in message and "token=***" in message
    assert redact("amqp://guest@h:1/ and http://h:15672/api") == "amqp://guest@h:1/ and http://h:15672/api"


def test_a_uri_with_credentials_is_refused_without_echoing_them() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_uri("jetstream://app:hunter2@east/ORDERS")
    assert "hunter2" not in str(exc.value) and "give none here" in str(exc.value)


def _rabbit_sites(**clusters: dict[str, object]) -> Topology:
    return Topology.model_validate({"version": 1, "sites": {n: {"clusters": {n: c}} for n, c in clusters.items()}})


def _rabbit(url: str, **extra: object) -> dict[str, object]:
    host = url.split("://")[1].rsplit(":", 1)[0]
    broker = {"name": "b-1", "url": url, "management_url": f"http://{host}:15672"}
    return {
        "kind": "rabbitmq",
        "credentials": {"user": "ferry", "password_env": "FERRY_T_PW"},
        "brokers": [broker],
        **extra,
    }


def test_an_ipv6_broker_keeps_its_brackets_in_a_shovel_uri(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_T_PW", "pw")
    topo = _rabbit_sites(v6=_rabbit("amqp://[::1]:5672"), dr=_rabbit("amqp://127.0.0.1:5672"))
    assert amqp_uri(topo, "v6", "/", dialer="dr") == "amqp://ferry:pw@[::1]:5672/%2F"


def test_a_shovel_uri_to_a_tls_broker_carries_the_dialling_nodes_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_T_PW", "p/w")
    files = {"ca_file": "/etc/rabbitmq/ca.pem", "cert_file": "/etc/rabbitmq/my cert.pem", "key_file": "/k.pem"}
    topo = _rabbit_sites(main=_rabbit("amqps://main.example:5671"), dr=_rabbit("amqp://dr:5672", outbound_tls=files))
    assert amqp_uri(topo, "main", "v h", dialer="dr") == (
        "amqps://ferry:p%2Fw@main.example:5671/v%20h?cacertfile=/etc/rabbitmq/ca.pem"
        "&certfile=/etc/rabbitmq/my%20cert.pem&keyfile=/k.pem&verify=verify_peer"
    )
    bare = _rabbit_sites(main=_rabbit("amqps://main.example:5671"), dr=_rabbit("amqp://dr:5672"))
    with pytest.raises(
        ConfigError, match=r"^dr: its shovels .* to main's amqps:// .* give cluster 'dr' an outbound_tls"
    ):
        amqp_uri(bare, "main", "/", dialer="dr")
    x509 = {"x509_login": True, "tls": {"ca_file": "/dev/null", "cert_file": "/c.pem", "key_file": "/k.pem"}}
    topo = _rabbit_sites(
        main=_rabbit("amqps://main.example:5671", **x509), dr=_rabbit("amqp://dr:5672", outbound_tls=files)
    )
    assert amqp_uri(topo, "main", "/", dialer="dr") == (  # the dialling node's certificate logs in: no password
        "amqps://main.example:5671/%2F?cacertfile=/etc/rabbitmq/ca.pem&certfile=/etc/rabbitmq/my%20cert.pem"
        "&keyfile=/k.pem&verify=verify_peer&auth_mechanism=external"
    )
    sni = _rabbit("amqp://dr:5672", outbound_tls={"ca_file": "/ca.pem", "server_name": "main.internal"})
    assert amqp_uri(_rabbit_sites(main=_rabbit("amqps://10.0.0.9:5671"), dr=sni), "main", "/", dialer="dr") == (
        "amqps://ferry:p%2Fw@10.0.0.9:5671/%2F?cacertfile=/ca.pem&server_name_indication=main.internal&verify=verify_peer"
    )
    ca_only = _rabbit("amqp://dr:5672", outbound_tls={"ca_file": "/ca.pem"})
    with pytest.raises(
        ConfigError, match=r"^dr: main takes certificate logins only .* give dr's outbound_tls a cert_file"
    ):
        amqp_uri(_rabbit_sites(main=_rabbit("amqps://main.example:5671", **x509), dr=ca_only), "main", "/", dialer="dr")
    with pytest.raises(ValueError, match="x509_login needs a client certificate"):
        _rabbit_sites(main=_rabbit("amqps://main.example:5671", x509_login=True))
    with pytest.raises(ValueError, match="x509_login needs amqps:// broker URLs"):
        _rabbit_sites(main=_rabbit("amqp://main.example:5672", **x509))
    with pytest.raises(ValueError, match="ca_file must be an absolute path on the broker hosts"):
        _rabbit_sites(dr=_rabbit("amqp://dr:5672", outbound_tls={"ca_file": "ca.pem"}))


@pytest.mark.parametrize(
    ("src", "dst", "refused"),
    [
        ("jetstream://east/ORDERS", "jetstream://east/ORDERS", True),
        ("jetstream://east/ORDERS?subject=orders.a", "jetstream://east/ORDERS", True),
        ("jetstream://east/ORDERS", "jetstream://west/ORDERS", False),
        ("jetstream://east/ORDERS?account=SALES", "jetstream://east/ORDERS", False),  # another account's
        ("jetstream://east/ORDERS?account=SALES", "jetstream://east/ORDERS?account=SALES", True),
        ("rabbitmq://ltm/%2F/q0", "rabbitmq://ltm/%2F/q0", True),
        ("rabbitmq://ltm/%2F/q0", "rabbitmq://ltm/%2F", True),  # the same names
        ("rabbitmq://ltm/%2F/q0", "rabbitmq://ltm/%2F?exchange=x", False),  # an exchange routes anywhere
        ("rabbitmq://ltm/%2F/q0", "rabbitmq://ltm/other/q0", False),
        ("parquet:///tmp/x", "parquet:///tmp/x/", True),
    ],
)
def test_a_copy_into_itself_is_refused_before_anything_is_asked(src: str, dst: str, refused: bool) -> None:
    from ferry.errors import UsageError
    from ferry.jobs.copy.plan import CopyOptions, _into_itself, plan_copy

    assert _into_itself(parse_uri(src), parse_uri(dst)) is refused
    if refused:  # no broker is asked: the topology's are not reachable from here
        with pytest.raises(UsageError, match="copying it into itself would store it twice"):
            plan_copy(parse_topology(VALID, "t.yaml"), src, dst, CopyOptions())


def test_unreadable_nats_secrets_and_tls_files_are_named(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_T_LTM", "y")
    seed = tmp_path / "user.nk"
    seed.write_text("SU...")
    text = VALID.replace("{user: app, password_env: FERRY_T_APP}", f"{{nkey_seed_file: {seed}}}")
    text = text.replace("{user: sys, password_env: FERRY_T_SYS}", f"{{creds_file: {tmp_path / 'sys.creds'}}}")
    text = text.replace("    kind: nats\n", f"    kind: nats\n        tls: {{ca_file: {tmp_path / 'ca.pem'}}}\n")
    topo = parse_topology(text)
    assert topo.credential_problems() == [
        f"sites.lab.clusters.east.system_credentials: creds file {tmp_path / 'sys.creds'} does not exist",
        f"sites.lab.clusters.east.tls: ca_file {tmp_path / 'ca.pem'} does not exist",
    ]
    assert topo.nats("east").credentials.identity == f"nkey seed file {seed}"  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"^tls.ca_file .*ca.pem does not exist$"):
        topo.nats("east").tls.context()  # type: ignore[union-attr]
    (tmp_path / "ca.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"^tls.ca_file .*ca.pem: not a PEM certificate"):
        parse_topology(text).nats("east").tls.context()  # type: ignore[union-attr]


def test_a_cluster_seen_from_another_account_has_that_accounts_credentials(tmp_path) -> None:
    text = VALID.replace(
        "    kind: nats\n", f"    kind: nats\n        accounts: {{SALES: {{creds_file: {tmp_path / 's.creds'}}}}}\n"
    )
    topo = parse_topology(text)
    sales = topo.nats("east", "SALES")
    assert sales.credentials.identity == f"creds file {tmp_path / 's.creds'}"  # type: ignore[union-attr]
    assert sales.brokers == topo.nats("east").brokers and topo.nats("east").credentials.user == "app"  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"^cluster 'east' has no account 'NOPE' in the topology \(accounts: SALES"):
        topo.nats("east", "NOPE")
    assert f"sites.lab.clusters.east.accounts.SALES: creds file {tmp_path / 's.creds'} does not exist" in (
        topo.credential_problems()
    )
    assert parse_uri("jetstream://east/ORDERS?account=SALES").account == "SALES"
    assert parse_uri("jetstream://east/ORDERS").account is None
    view = topo.in_account("SALES")  # what a job run with --account SALES sees everywhere
    assert view.account == "SALES" and topo.account is None
    assert view.nats("east").credentials == sales.credentials and view.nats("east", "SALES") == sales
    with pytest.raises(ConfigError, match=r"^cluster 'east' has no account 'NOPE'"):
        topo.in_account("NOPE").nats("east")


def test_a_brokers_tls_fields_override_its_clusters(tmp_path) -> None:
    from ferry.brokers.nats.auth import tls_for, tls_groups
    from ferry.topology import broker_tls

    (tmp_path / "ca.pem").write_text("x")
    text = VALID.replace(
        "    kind: nats\n", f"    kind: nats\n        tls: {{ca_file: {tmp_path / 'ca.pem'}, server_name: nats}}\n"
    ).replace(
        "            monitor_url: http://127.0.0.1:8222\n",
        "            monitor_url: http://127.0.0.1:8222\n"
        "            tls: {server_name: east-1.example, cert_file: /c.pem, key_file: /k.pem}\n"
        "          - {name: east-2, url: 'nats://127.0.0.1:4223'}\n",
    )
    topo = parse_topology(text)
    east = topo.nats("east")
    one, two = (broker_tls(east, b) for b in east.brokers)
    assert (one.ca_file, one.server_name, one.cert_file) == (tmp_path / "ca.pem", "east-1.example", Path("/c.pem"))
    assert two == east.tls  # no tls of its own: the cluster's
    assert tls_for(east, "nats://127.0.0.1:4222") == one and tls_for(east, "http://127.0.0.1:8222") == one
    assert tls_for(east, "tls://lb.example:4222") == east.tls  # a load balancer's URL: the cluster's
    assert tls_groups(east, east.urls) == [["nats://127.0.0.1:4222"], ["nats://127.0.0.1:4223"]]
    assert "sites.lab.clusters.east.brokers.east-1.tls: cert_file /c.pem does not exist" in topo.credential_problems()
    mgmt = "            management_url: http://127.0.0.1:15672\n"
    assert "server_name is for NATS" in _error(VALID.replace(mgmt, mgmt + "            tls: {server_name: x}\n"))
