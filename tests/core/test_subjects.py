"""Subject algebra: the vectors of nats-server's sublist tests and NATS Streaming's partition
tests (in our own words), then brute-force properties over small alphabets."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferry.subjects import (
    Capture,
    SubjectError,
    SubjectIndex,
    covers,
    intersection,
    is_literal,
    matches,
    overlap_witness,
    overlaps,
    problem,
    tokens,
)


@pytest.mark.parametrize(
    ("subject", "reason"),
    [
        ("", "empty"),
        (".", "starts with a dot"),
        (".foo", "starts with a dot"),
        ("foo.", "ends with a dot"),
        ("foo..bar", "empty token 2"),
        ("foo*", "token 1 'foo*' mixes a wildcard"),
        ("foo.*.", "ends with a dot"),
        ("foo.>.bar", "'>' must be the last token (it is token 2 of 3)"),
        ("foo.ba>r", "token 2 'ba>r' mixes a wildcard"),
        ("foo bar", "whitespace at position 3"),
        ("foo.\tbar", "whitespace at position 4"),
    ],
)
def test_invalid_patterns_say_why(subject: str, reason: str) -> None:
    why = problem(subject, strict=True)
    assert why is not None and reason in why
    if "mixes a wildcard" in reason:  # nats-server takes such a token as a literal: so does ferry, but in a map
        assert problem(subject) is None and problem(subject, literal=True) is None
        assert tokens(subject) == subject.split(".")
        return
    with pytest.raises(SubjectError) as raised:
        tokens(subject)
    assert str(raised.value) == why


def test_a_token_mixing_a_wildcard_is_literal_in_overlaps() -> None:
    assert overlap_witness("shop.*", "shop.*x") == "shop.*x"
    assert overlaps("shop.>", "shop.a>b.c")
    assert not overlaps("shop.a*", "shop.ab")


def test_literal_required() -> None:
    for ok in ("foo", "foo.bar", "a.b.c.d"):
        assert is_literal(ok)
    for wild in ("foo.*", "foo.>", "*", ">"):
        assert problem(wild) is None
        why = problem(wild, literal=True)
        assert why and "literal subject is required" in why
    with pytest.raises(SubjectError, match="wildcard pattern"):
        SubjectIndex([("foo.*", 1)]).match("foo.*")


@pytest.mark.parametrize(
    ("subject", "pattern", "expected"),
    [
        ("foo", "foo", True),
        ("foo", "bar", False),
        ("foo", "*", True),
        ("foo", ">", True),
        ("foo.bar", ">", True),
        ("foo.bar", "foo.>", True),
        ("foo.bar", "bar.>", False),
        ("stats.test.22", "stats.>", True),
        ("stats.test.22", "stats.*.*", True),
        ("foo.bar", "foo", False),
        ("stats.test.foos", "stats.test.foos", True),
        ("stats.test.foos", "stats.test.foo", False),
        ("stats.test", "stats.test.*", False),
        ("stats.test.foos", "stats.*", False),
        ("stats.test.foos", "stats.*.*.foos", False),
        ("foo", "foo.>", False),
    ],
)
def test_match_table(subject: str, pattern: str, expected: bool) -> None:
    assert matches(pattern, subject) is expected
    assert bool(SubjectIndex([(pattern, "owner")]).match(subject)) is expected


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("foo.*", "foo.bar", True),  # a partition of foo.* and one of foo.bar conflict
        ("foo.*", ">", True),
        ("foo", "bar", False),
        ("foo.*", "*.bar", True),
        ("foo.>", "foo", False),
        ("foo.>", "foo.*", True),
        ("foo.*.baz", "foo.bar.*", True),
        ("foo.*", "foo.*.*", False),
        ("*.>", "a", False),
        ("a.b.>", "a.*.c.d", True),
    ],
)
def test_overlap_table(a: str, b: str, expected: bool) -> None:
    assert overlaps(a, b) is expected and overlaps(b, a) is expected
    w = overlap_witness(a, b)
    if expected:
        assert w is not None and matches(a, w) and matches(b, w)
    else:
        assert w is None


def test_witness_examples() -> None:
    assert overlap_witness("foo.*", "*.bar") == "foo.bar"
    assert overlap_witness("orders.>", "*.eu.*") == "orders.eu.x"


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (">", "foo", True),
        (">", ">", True),
        ("foo.>", "foo.*.bar", True),
        ("foo.*", "foo.bar", True),
        ("foo.bar", "foo.*", False),
        ("*.>", ">", False),  # '>' matches one-token subjects, '*.>' does not
        ("foo.*", "foo.>", False),
        ("foo", "foo", True),
    ],
)
def test_covers_table(a: str, b: str, expected: bool) -> None:
    assert covers(a, b) is expected


# -- brute force over small alphabets --------------------------------------------------------

PATTERN_TOKENS = ["a", "b", "*"]
UNIVERSE = [".".join(t) for n in range(1, 5) for t in itertools.product("abc", repeat=n)]


def _pattern() -> st.SearchStrategy[str]:
    body = st.lists(st.sampled_from(PATTERN_TOKENS), min_size=0, max_size=3)
    return st.tuples(body, st.booleans()).map(lambda x: ".".join(x[0] + [">"] if x[1] else x[0])).filter(bool)


@settings(max_examples=400, deadline=None)
@given(_pattern(), _pattern())
def test_overlaps_is_exact(a: str, b: str) -> None:
    both = [s for s in UNIVERSE if matches(a, s) and matches(b, s)]
    assert overlaps(a, b) is bool(both)


@settings(max_examples=400, deadline=None)
@given(_pattern(), _pattern())
def test_intersection_is_exact(a: str, b: str) -> None:
    both = intersection(a, b)
    assert both == intersection(b, a)
    if both is None:
        assert not overlaps(a, b)
    else:
        assert all(matches(both, s) is (matches(a, s) and matches(b, s)) for s in UNIVERSE)


@settings(max_examples=400, deadline=None)
@given(_pattern(), _pattern())
def test_covers_is_exact(a: str, b: str) -> None:
    assert covers(a, b) is all(matches(a, s) for s in UNIVERSE if matches(b, s))


@settings(max_examples=100, deadline=None)
@given(st.lists(_pattern(), min_size=1, max_size=12))
def test_index_agrees_with_brute_force(patterns: list[str]) -> None:
    index = SubjectIndex((p, i) for i, p in enumerate(patterns))
    for s in UNIVERSE:
        assert sorted(index.match(s)) == [i for i, p in enumerate(patterns) if matches(p, s)]


@settings(max_examples=200, deadline=None)
@given(st.lists(_pattern(), min_size=1, max_size=12), _pattern())
def test_overlapping_agrees_with_pairwise_overlaps(stored: list[str], probe: str) -> None:
    index = SubjectIndex((p, i) for i, p in enumerate(stored))
    assert sorted(index.overlapping(probe)) == [i for i, p in enumerate(stored) if overlaps(p, probe)]


def test_route_many_disjoint_patterns() -> None:
    rng = random.Random(7)
    patterns = [f"t{i}.{rng.choice(['*', 'x', 'y'])}.>" for i in range(2000)]
    index = SubjectIndex((p, p) for p in patterns)
    for i in range(0, 2000, 97):
        subject = f"t{i}.x.z"
        expected = [p for p in patterns if matches(p, subject)]
        assert index.match(subject) == expected
        assert index.route(subject) == (expected[0] if expected else None)
    assert index.route("nobody.owns.this") is None
    assert SubjectIndex([("a.*", 1), ("*.b", 2)]).route("a.b") in (1, 2)


@settings(max_examples=200, deadline=None)
@given(st.lists(_pattern(), min_size=1, max_size=10, unique=True))
def test_route_finds_the_owner_among_disjoint_patterns(patterns: list[str]) -> None:
    disjoint: list[str] = []
    for p in patterns:
        if not any(overlaps(p, q) for q in disjoint):
            disjoint.append(p)
    index = SubjectIndex((p, p) for p in disjoint)
    for s in UNIVERSE:
        owners = [p for p in disjoint if matches(p, s)]
        assert index.route(s) == (owners[0] if owners else None)


def test_a_capture_answers_as_matches_does_for_each_subject_it_is_asked_again() -> None:
    capture = Capture(["rmq.>", "orders.*"])
    asked = ["rmq.a", "rmq.a.b", "rmq", "orders.eu", "orders.eu.x", "orders.eu", "rq-js", "rmq.a"]
    assert [capture(s) for s in asked] == [True, True, False, True, False, True, False, True]
    assert capture.text == "rmq.>, orders.*" and Capture([]).text == "none"
    assert not Capture([])("anything")
