"""Pure parts of `ferry failback`: which policy applies to a queue, what may be printed."""

from __future__ import annotations

from ferry.brokers.rabbitmq import effective_policy
from ferry.errors import redact
from ferry.jobs.dr_failback.plan import public
from ferry.jobs.dr_failback.run import _duplicates


def _policy(name: str, pattern: str, priority: int = 0, apply_to: str = "queues", vhost: str = "/") -> dict:
    return {"vhost": vhost, "name": name, "pattern": pattern, "priority": priority, "apply-to": apply_to,
            "definition": {"federation-upstream": name}}  # fmt: skip


def test_the_highest_priority_matching_queue_policy_applies() -> None:
    policies = [
        _policy("low", "^fed", 0),
        _policy("high", "^fed-1", 5),
        _policy("exchanges-only", "^fed", 9, apply_to="exchanges"),
        _policy("other-vhost", "^fed", 9, vhost="v"),
    ]
    assert effective_policy(policies, "/", "fed-1")["name"] == "high"
    assert effective_policy(policies, "/", "fed-2")["name"] == "low"
    assert effective_policy(policies, "/", "x-fed-2") is None  # RabbitMQ patterns are searched, not anchored
    assert effective_policy([_policy("any", "fed")], "/", "x-fed-2")["name"] == "any"
    assert effective_policy([_policy("all", ".*", apply_to="all")], "/", "fed q/1#ü")["name"] == "all"


def test_passwords_never_printed() -> None:
    assert redact("amqp://ferry:s3cr%40t@10.0.0.1:5672/v") == "amqp://ferry:***@10.0.0.1:5672/v"
    assert redact("error at amqps://u:p@h/x and amqp://h2") == "error at amqps://u:***@h/x and amqp://h2"
    plan = {"upstreams": [{"vhost": "/", "name": "art", "value": {"uri": ["amqp://a:pw@h", "amqp://b:pw2@h2"]}}]}
    shown = public(plan)
    assert "pw" not in str(shown) and plan["upstreams"][0]["value"]["uri"][0] == "amqp://a:pw@h"  # journal intact


def test_a_queue_is_named_by_its_uri_path() -> None:
    """Messages and events name a queue VHOST/QUEUE with each part's % and / encoded: the default
    vhost's queue is %2F/orders (it printed as //orders), and the name splits back into its parts."""
    from urllib.parse import unquote

    from ferry.brokers.rabbitmq import queue_path

    assert queue_path("/", "orders") == "%2F/orders"
    assert queue_path("fb /#%ü", "fed q/0#ü") == "fb %2F#%25ü/fed q%2F0#ü"
    assert [unquote(p) for p in queue_path("a/%2F", "c%d/e").split("/")] == ["a/%2F", "c%d/e"]


def test_the_outcome_says_verified_and_possible_duplicates_apart() -> None:
    def row(queue: str, possible: int, target: str | None = None) -> dict[str, object]:
        return {"vhost": "v", "queue": queue, "target": target or queue, "possible_duplicates": possible}

    def check(queue: str, duplicates: int | None, sources: int = 1) -> dict[str, object]:
        return {"vhost": "v", "queue": queue, "duplicates": duplicates, "verdict": "x", "sources": ["s"] * sources}

    rows = [row("a", 16), row("b", 3), row("c", 0), row("d", 5)]
    said = _duplicates(rows, [check("a", 0), check("b", 2), check("c", 0), check("d", None)])
    assert said == ", with 2 duplicates on 1 queue and up to 5 duplicates on 1 queue"
    assert [r["duplicates"] for r in rows] == [0, 2, 0, None]  # a's 16 possible were checked: none
    assert _duplicates([row("a", 4)], []) == ", with up to 4 duplicates on 1 queue"  # --no-verify
    assert _duplicates([row("a", 4)], [check("a", 0)]) == ""
    shared = [row("a", 1, "t"), row("b", 0, "t")]  # --target-queue: known only for the target as a whole
    assert _duplicates(shared, [check("t", 1, sources=2)]) == ", with up to 1 duplicates on 1 queue"
