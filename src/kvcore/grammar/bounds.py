"""Bounds on what a constraint may ask of llguidance, checked in pure Python before any native
code reads it: sizes, nesting, reference and rule-chain depths, forced-literal lengths, and the
constraints that can never finish (no finite instance). Each bound is a ParamError naming the
request field, so a request past one is a 400, never a crash or a stall of the server.

Why these numbers (measured with llguidance 1.9.1 on the default model's 49,152-token
vocabulary; docs/architecture.md, "Constraints"): native compile recursion costs 3-8 KB of
stack per level of a $ref / rule chain (a chain of ~2,500 $refs or ~2,600 Lark rules overflows
an 8 MiB thread stack), matching does not recurse (a 20,000-rule chain matched on a 256 KiB
stack) but its mask time grows with the square of a left-recursive chain (1 ms at 300 rules,
20 ms at 1,000, 90 ms at 3,000), and a forced literal costs ~2.6 us and ~400 bytes per
character at its first mask (a 200,000-character `const`: 0.24-0.6 s and 80 MiB)."""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

from kvcore.config import ParamError

MAX_SCHEMA_NODES = 10_000  # subschemas of one JSON schema ($defs included)
MAX_SCHEMA_DEPTH = 128  # longest chain of nesting and $ref hops from the root
MAX_GRAMMAR_RULES = 5_000  # rules and terminals of one Lark grammar
MAX_GRAMMAR_DEPTH = 256  # longest chain of rule references from `start`
MAX_LITERAL_CHARS = 4_096  # a const / enum value / choice / grammar string literal
MAX_REGEX_NESTING = 64  # nested groups of one regex
MAX_REGEX_FORCED = 4_096  # a regex's product of minimum repeat counts along its nesting
MAX_REGEX_REPEAT = 100_000  # ... and of maximum repeat counts

N = TypeVar("N", bound=Hashable)

_QUANTIFIER = re.compile(r"\{(\d*)(,?)(\d*)\}")


def check_literal(text: str, param: str, what: str) -> None:
    if len(text) > MAX_LITERAL_CHARS:
        raise ParamError(param, f"{param}: {what} is {len(text)} characters, more than the "
                                f"{MAX_LITERAL_CHARS} a literal may have")


def check_regex(pattern: str, param: str, what: str = "the regex") -> None:
    """Group nesting and repeat counts of a regex (its syntax is llguidance's to check)."""
    depth, forced, repeat = _regex_shape(pattern)
    if depth > MAX_REGEX_NESTING:
        raise ParamError(param, f"{param}: {what} nests {depth} groups deep, more than "
                                f"{MAX_REGEX_NESTING}")
    if forced > MAX_REGEX_FORCED:
        raise ParamError(param, f"{param}: {what} forces a run of {forced} repeats, more than "
                                f"{MAX_REGEX_FORCED}")
    if repeat > MAX_REGEX_REPEAT:
        raise ParamError(param, f"{param}: {what} repeats up to {repeat} times, more than "
                                f"{MAX_REGEX_REPEAT}")


def _regex_shape(pattern: str) -> tuple[int, int, int]:
    """(deepest group nesting, largest product of minimum repeat counts along a nesting path,
    the same of maximum counts; an open count `{n,}` counts n). One pass, a frame per open
    group holding the largest products inside it; escapes and classes are single atoms."""
    frames: list[list[int]] = [[1, 1]]
    depth = 0
    last = (1, 1)  # the products of the atom a quantifier would apply to
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "{" and (m := _QUANTIFIER.match(pattern, i)) and (m.group(1) or m.group(3)):
            low = int(m.group(1) or 0)
            high = int(m.group(3)) if m.group(3) else low
            last = (last[0] * low, last[1] * max(high, 1))
            _fold(frames[-1], last)
            i = m.end()
            continue
        if c == "(":
            frames.append([1, 1])
            depth = max(depth, len(frames) - 1)
        elif c == ")" and len(frames) > 1:
            inner = frames.pop()
            last = (inner[0], inner[1])
            _fold(frames[-1], last)
        elif c not in "*+?|^$":
            if c == "\\":
                i += 1
            elif c == "[":  # a class: one atom up to its closing bracket
                i += 2 if pattern.startswith("[^", i) else 1
                i += 1 if pattern.startswith("]", i) else 0
                while i < n and pattern[i] != "]":
                    i += 2 if pattern[i] == "\\" else 1
            last = (1, 1)
        i += 1
    return depth, frames[0][0], frames[0][1]


def _fold(frame: list[int], value: tuple[int, int]) -> None:
    frame[0] = max(frame[0], value[0])
    frame[1] = max(frame[1], value[1])


def longest_path(roots: Iterable[N], edges: Callable[[N], Iterable[N]]) -> int:
    """Nodes on the longest edge path from `roots` (an edge back into the current path, a
    cycle, adds nothing). Iterative: the graphs here come from untrusted input."""
    depth: dict[N, int] = {}
    on_path: set[N] = set()
    best = 0
    for root in roots:
        if root in depth:
            best = max(best, depth[root])
            continue
        stack: list[tuple[N, list[N]]] = [(root, list(edges(root)))]
        on_path.add(root)
        while stack:
            node, todo = stack[-1]
            while todo and (todo[-1] in depth or todo[-1] in on_path):
                todo.pop()
            if todo:
                child = todo.pop()
                on_path.add(child)
                stack.append((child, list(edges(child))))
                continue
            stack.pop()
            on_path.discard(node)
            depth[node] = 1 + max((depth.get(c, 0) for c in edges(node)), default=0)
        best = max(best, depth[root])
    return best


def productive(nodes: Iterable[N], depends: Callable[[N], Iterable[N]],
               holds: Callable[[N, set[N]], bool]) -> set[N]:
    """The least fixpoint of `holds`: the nodes with a finite derivation, given `holds(node,
    known)` (true when the node has one once the nodes in `known` do) and `depends(node)` (the
    nodes its answer reads). A worklist: each node is re-evaluated when one it reads turns."""
    readers: dict[N, list[N]] = {}
    todo = list(nodes)
    for node in todo:
        for dep in depends(node):
            readers.setdefault(dep, []).append(node)
    known: set[N] = set()
    while todo:
        node = todo.pop()
        if node in known or not holds(node, known):
            continue
        known.add(node)
        todo.extend(r for r in readers.get(node, ()) if r not in known)
    return known
