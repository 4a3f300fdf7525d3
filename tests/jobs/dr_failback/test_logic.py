"""Pure parts of `ferry failback`: which policy applies to a queue, what may be printed."""

from __future__ import annotations

from ferry.brokers.rabbitmq import effective_policy
from ferry.errors import redact
from ferry.jobs.dr_failback.plan import public


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
