"""NATS subject algebra: validation, matching, exact overlap and cover, and a routing trie.

A subject is dot-separated tokens. In a pattern, ``*`` matches exactly one
token and ``>`` (last token only) one or more trailing tokens. A token with
``*`` or ``>`` among other characters (``foo*``) is a literal, as in
nats-server: a stream may hold such subjects and a message may carry one. Only
an ownership map refuses it (``problem(..., strict=True)``): there it is almost
certainly a mistake, as NATS Streaming's partitioning also decided.

``overlaps(a, b)`` is exact: true if and only if some subject matches both
(``overlap_witness`` returns one). ``covers(a, b)``: every subject that
matches ``b`` matches ``a``. :class:`SubjectIndex` routes a literal subject to
the owners of the patterns it matches in time independent of how many
patterns there are (a token trie, like nats-server's sublist).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from ferry.errors import UsageError

__all__ = [
    "Capture",
    "SubjectError",
    "SubjectIndex",
    "covers",
    "is_literal",
    "matches",
    "overlap_witness",
    "overlaps",
    "problem",
    "tokens",
]

T = TypeVar("T")
_SPACE = frozenset(" \t\r\n\f\v")
_FILL = "x"  # stands for any token in a witness subject


class SubjectError(UsageError):
    """An invalid subject or pattern, or a pattern where a literal subject is required."""


def problem(subject: str, literal: bool = False, strict: bool = False) -> str | None:
    """Why `subject` is not a valid pattern (or literal subject, if `literal`); None when it is.
    `strict` also refuses a token that mixes a wildcard with other characters."""
    if not isinstance(subject, str) or subject == "":
        return "the subject is empty"
    shown = repr(subject)
    for pos, ch in enumerate(subject):
        if ch in _SPACE:
            return f"{shown} contains whitespace at position {pos}"
    if subject.startswith("."):
        return f"{shown} starts with a dot (empty first token)"
    if subject.endswith("."):
        return f"{shown} ends with a dot (empty last token)"
    toks = subject.split(".")
    for i, t in enumerate(toks, 1):
        if t == "":
            return f"{shown} has an empty token {i} (two dots in a row)"
        if strict and t not in ("*", ">") and ("*" in t or ">" in t):
            return f"{shown}: token {i} {t!r} mixes a wildcard with other characters ('*' and '>' must be whole tokens)"
        if t == ">" and i != len(toks):
            return f"{shown}: '>' must be the last token (it is token {i} of {len(toks)})"
    if literal and any(t in ("*", ">") for t in toks):
        return f"{shown} is a wildcard pattern; a literal subject is required here (a message has one subject)"
    return None


def stream_name_problem(name: str) -> str | None:
    """Why `name` cannot name a JetStream stream (the characters nats-py and the server refuse), or None."""
    if not name:
        return "a stream name cannot be empty"
    bad = sorted({c for c in name if c in ">*. /\\\t\r\n"})
    return f"invalid stream name {name!r}: no {' '.join(repr(c) for c in bad)} allowed" if bad else None


def tokens(subject: str, literal: bool = False) -> list[str]:
    """The tokens of a valid pattern (literal subject if `literal`); raises :class:`SubjectError`."""
    why = problem(subject, literal)
    if why:
        raise SubjectError(why)
    return subject.split(".")


def is_literal(subject: str) -> bool:
    return problem(subject, literal=True) is None


def _match_tokens(p: list[str], s: list[str]) -> bool:
    for i, t in enumerate(p):
        if t == ">":
            return len(s) > i
        if i >= len(s) or (t != "*" and t != s[i]):
            return False
    return len(s) == len(p)


def matches(pattern: str, subject: str) -> bool:
    """Does the literal `subject` match `pattern`?"""
    return _match_tokens(tokens(pattern), tokens(subject, literal=True))


class Capture:
    """Whether a stream of subjects `patterns` captures a literal subject; the subjects found so
    far are remembered (up to 10,000), so a writer can ask for every message."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = [tokens(p) for p in patterns]
        self.text = ", ".join(patterns) or "none"
        self._seen: set[str] = set()

    def __call__(self, subject: str) -> bool:
        if subject in self._seen:
            return True
        if not any(_match_tokens(p, tokens(subject, literal=True)) for p in self.patterns):
            return False
        if len(self._seen) >= 10_000:
            self._seen.clear()
        self._seen.add(subject)
        return True


def intersection(a: str, b: str) -> str | None:
    """The pattern matching exactly the subjects both patterns match, or None when none does."""
    ta, tb = tokens(a), tokens(b)
    out: list[str] = []
    for i in range(max(len(ta), len(tb))):
        if i >= len(ta) or i >= len(tb):
            return None  # one ended; the other needs more tokens (a '>' would have returned)
        x, y = ta[i], tb[i]
        if x == ">" or y == ">":
            return ".".join(out + (tb[i:] if x == ">" else ta[i:]))
        if x == "*":
            out.append(y)
        elif y == "*" or x == y:
            out.append(x)
        else:
            return None
    return ".".join(out)


def overlap_witness(a: str, b: str) -> str | None:
    """A literal subject matching both patterns, or None when no subject does."""
    both = intersection(a, b)
    return None if both is None else ".".join(_FILL if t in ("*", ">") else t for t in both.split("."))


def overlaps(a: str, b: str) -> bool:
    """Is there a subject that matches both patterns?"""
    return overlap_witness(a, b) is not None


def covers(a: str, b: str) -> bool:
    """Does every subject matching `b` match `a`?"""
    ta, tb = tokens(a), tokens(b)
    for i, y in enumerate(tb):
        if i >= len(ta):
            return False
        x = ta[i]
        if x == ">":
            return True  # b has at least one token from here on
        if y == ">" or (x != "*" and (y == "*" or x != y)):
            return False
    return len(ta) == len(tb)


class _Node:
    __slots__ = ("fwc", "here", "lit", "star")

    def __init__(self) -> None:
        self.lit: dict[str, _Node] = {}
        self.star: _Node | None = None
        self.fwc: list = []  # values of patterns ending in '>' here
        self.here: list = []  # values of patterns ending exactly here


class SubjectIndex(Generic[T]):
    """Patterns -> values; ``match(subject)`` finds the values of every pattern a subject matches."""

    def __init__(self, items: Iterable[tuple[str, T]] = ()) -> None:
        self._root = _Node()
        self._size = 0
        for pattern, value in items:
            self.insert(pattern, value)

    def __len__(self) -> int:
        return self._size

    def insert(self, pattern: str, value: T) -> None:
        node = self._root
        for t in tokens(pattern):
            if t == ">":
                node.fwc.append(value)
                break
            if t == "*":
                node.star = node.star or _Node()
                node = node.star
            else:
                node = node.lit.setdefault(t, _Node())
        else:
            node.here.append(value)
        self._size += 1

    def match(self, subject: str) -> list[T]:
        """Values of every pattern matching the literal `subject`."""
        toks = _literal_tokens(subject)
        n = len(toks)
        found: list[T] = []
        stack = [(self._root, 0)]
        while stack:
            node, i = stack.pop()
            if i == n:
                found += node.here
                continue
            if node.fwc:
                found += node.fwc
            child = node.lit.get(toks[i])
            if child is not None:
                stack.append((child, i + 1))
            if node.star is not None:
                stack.append((node.star, i + 1))
        return found

    def overlapping(self, pattern: str) -> list[T]:
        """Values of every stored pattern that some subject matching `pattern` also matches."""
        toks = tokens(pattern)
        found: list[T] = []
        stack = [(self._root, 0)]
        while stack:
            node, i = stack.pop()
            if i == len(toks):
                found += node.here
                continue
            found += node.fwc  # a stored 'prefix.>' meets any pattern with a token left here
            t = toks[i]
            if t == ">":  # meets every stored pattern below with at least one more token
                below = [*node.lit.values(), *([node.star] if node.star else [])]
                while below:
                    n = below.pop()
                    found += n.here + n.fwc
                    below += [*n.lit.values(), *([n.star] if n.star else [])]
                continue
            children = list(node.lit.values()) if t == "*" else [node.lit[t]] if t in node.lit else []
            if node.star is not None:
                children.append(node.star)
            stack += [(c, i + 1) for c in children]
        return found

    def route(self, subject: str) -> T | None:
        """The owner of the literal `subject`, None if no pattern matches.

        For an index of pairwise disjoint patterns (a checked partition map) the
        owner is unique and this returns as soon as it is found; otherwise it
        returns one of the matches (use :meth:`match` for all of them).
        """
        toks = _literal_tokens(subject)
        n = len(toks)
        others: list[tuple[_Node, int]] | None = None  # '*' branches still to try
        node, i = self._root, 0
        while True:
            if i == n:
                if node.here:
                    return node.here[0]
            else:
                if node.fwc:
                    return node.fwc[0]
                child, star = node.lit.get(toks[i]), node.star
                i += 1
                if child is not None:
                    if star is not None:
                        others = others or []
                        others.append((star, i))
                    node = child
                    continue
                if star is not None:
                    node = star
                    continue
            if not others:
                return None
            node, i = others.pop()


def _literal_tokens(subject: str) -> list[str]:
    """Split a literal subject, refusing an invalid one or a wildcard (fast path for valid input)."""
    if (
        not subject
        or "*" in subject
        or ">" in subject
        or ".." in subject
        or " " in subject
        or subject[0] == "."
        or subject[-1] == "."
        or not subject.isprintable()
    ):
        return tokens(subject, literal=True)  # raises with the precise reason
    return subject.split(".")
