"""A Lark grammar's shape before llguidance reads it: its rules and terminals, the longest
chain of rule references from `start`, its literals, regexes and embedded JSON schemas, and
whether `start` has any finite derivation (a productivity analysis of the rule graph).

The lexer follows llguidance's token set (lark/lexer.rs); a grammar this reader cannot follow
is llguidance's to refuse (a syntax error costs no recursion). Rules whose body it cannot
follow count as productive: "no finite derivation" is only claimed where it is certain."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvcore.config import ParamError
from kvcore.grammar.bounds import (
    MAX_GRAMMAR_DEPTH,
    MAX_GRAMMAR_RULES,
    check_literal,
    check_regex,
    longest_path,
    productive,
)
from kvcore.grammar.schema_shape import check_schema

MAX_NESTING = 30  # llguidance's own limit on nested groups and %lark blocks

_LEX = re.compile(r"""
    (?P<skip>(?:\#|//)[^\n]*|[ \t]+)
  | (?P<nl>(?:\r?\n)+[ \t]*)
  | (?P<kw>%[a-z]+)
  | (?P<string>"(?:\\(?:["\\/bfnrt]|u[a-fA-F0-9]{4}|x[a-fA-F0-9]{2})|[^"\\\x00-\x1f\x7f])*"i?)
  | (?P<regexp>/(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<special><[^<>\s]+>)
  | (?P<gref>@[a-zA-Z0-9_\-]+)
  | (?P<number>0[xX][0-9a-fA-F]+|[+-]?[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)
  | (?P<punct>\.\.|::|->)
  | (?P<rule>!?[_?]?[a-z][_a-z0-9\-]*)
  | (?P<token>_?[A-Z][_A-Z0-9\-]*)
  | (?P<op>[+*?])
  | (?P<punct1>[:,.(){}\[\]~|&=\#_])
""", re.VERBOSE)
_JSON_VALUE_KWS = ("%json", "%regex", "%llguidance")
_ENDS = frozenset({"nl", "|", "->", ")", "]", "}", "&", "%if"})


@dataclass(slots=True)
class Tok:
    kind: str  # nl, kw, string, regexp, special, gref, number, rule, token, op, or the punctuation
    text: str
    value: Any = None  # the JSON value after %json / %regex / %llguidance


@dataclass(slots=True)
class Grammar:
    bodies: dict[str, list[Tok]] = field(default_factory=dict)  # defined name -> its body
    names: set[str] = field(default_factory=set)  # defined, imported or declared names


def lex(text: str) -> list[Tok] | None:
    """llguidance's lexemes of `text` (None where its lexer would fail: a syntax error)."""
    toks: list[Tok] = []
    decoder = json.JSONDecoder()
    pos, n = 0, len(text)
    while pos < n:
        for m in _LEX.finditer(text, pos):  # restarted after each JSON value
            if m.start() != pos:
                return None
            pos = m.end()
            kind = m.lastgroup
            if kind == "skip":
                continue
            word = m.group()
            if kind == "punct" or kind == "punct1":
                kind = word
            tok = Tok(kind or "", word)
            toks.append(tok)
            if kind == "kw" and word in _JSON_VALUE_KWS:
                while pos < n and text[pos] in " \t\r\n":
                    pos += 1
                try:
                    tok.value, pos = decoder.raw_decode(text, pos)
                except (ValueError, RecursionError):
                    return None
                break
        else:
            if pos < n:
                return None
    return toks


def read_grammar(toks: list[Tok], param: str, depth: int = 0) -> Grammar:
    """Split into items (a rule, a terminal or a statement per line; `|` lines continue the
    one before) and check what they embed: literals, regexes, %json schemas, %lark blocks."""
    if depth > MAX_NESTING:
        raise ParamError(param, f"{param}: %lark blocks nest more than {MAX_NESTING} deep")
    grammar = Grammar()
    items: list[list[Tok]] = [[]]
    i = 0
    while i < len(toks):
        tok = toks[i]
        if tok.kind == "kw" and tok.text == "%lark" and i + 1 < len(toks) and \
                toks[i + 1].kind == "{":
            end = _closing(toks, i + 1)
            read_grammar(toks[i + 2:end], param, depth + 1)  # its own namespace
            items[-1].append(Tok("%lark", "%lark"))
            i = end + 1
            continue
        if tok.kind == "nl" and not (i + 1 < len(toks) and toks[i + 1].kind == "|"):
            items.append([])
        elif tok.kind != "nl":
            items[-1].append(tok)
            _check_lexeme(tok, param)
        i += 1
    for item in items:
        _define(grammar, item)
    return grammar


def _closing(toks: list[Tok], start: int) -> int:
    level = 0
    for j in range(start, len(toks)):
        level += {"{": 1, "}": -1}.get(toks[j].kind, 0)
        if level == 0:
            return j
    return len(toks)


def _check_lexeme(tok: Tok, param: str) -> None:
    if tok.kind == "string":
        check_literal(tok.text.rstrip("i")[1:-1], param, "a string literal")
    elif tok.kind == "regexp":
        check_regex(tok.text[1:tok.text.rindex("/")], param, f"the regex {tok.text[:40]}")
    elif tok.kind == "kw" and tok.text == "%json":
        check_schema(tok.value, param)


def _define(grammar: Grammar, item: list[Tok]) -> None:
    if not item:
        return
    head = item[1:] if item[0].text == "%override" else item
    if head and head[0].kind in ("rule", "token"):
        name = head[0].text.lstrip("!").lstrip("?")
        level = 0
        for j, tok in enumerate(head):
            level += {"[": 1, "{": 1, "]": -1, "}": -1}.get(tok.kind, 0)
            if tok.kind == ":" and level == 0:
                grammar.bodies[name] = head[j + 1:]
                break
        grammar.names.add(name)
    elif item[0].text in ("%import", "%declare"):
        grammar.names.update(t.text for t in item[1:] if t.kind in ("rule", "token"))


def check_lark(text: str, param: str) -> None:
    """Every bound of a Lark grammar, and that `start` has a finite derivation: ParamError
    naming `param` otherwise."""
    toks = lex(text)
    if toks is None:
        return  # llguidance's lexer refuses it with its own message
    grammar = read_grammar(toks, param)
    bodies = grammar.bodies
    if len(bodies) > MAX_GRAMMAR_RULES:
        raise ParamError(param, f"{param}: the grammar has {len(bodies)} rules and terminals, "
                                f"more than {MAX_GRAMMAR_RULES}")
    refs = {name: sorted({t.text for t in body if t.kind in ("rule", "token")} & bodies.keys())
            for name, body in bodies.items()}
    roots = ["start"] if "start" in bodies else list(bodies)
    depth = longest_path(roots, lambda name: refs[name])
    if depth > MAX_GRAMMAR_DEPTH:
        raise ParamError(param, f"{param}: the grammar's chain of rule references is {depth} "
                                f"deep, more than {MAX_GRAMMAR_DEPTH}")
    if "start" not in bodies:
        return
    trees = {name: _tree(body) for name, body in bodies.items()}
    finite = productive(bodies, lambda name: refs[name],
                        lambda name, known: _finite(trees[name], known, bodies.keys()))
    if "start" not in finite:
        stuck = [n for n in sorted(bodies) if n not in finite][:5]
        raise ParamError(param, f"{param}: rule start has no finite derivation: every "
                                f"alternative of {', '.join(stuck)} recurses forever")


# --- the body's structure, for productivity: ("alt", [conjunct lists]) of sequences ---

class _Unread(Exception):
    """A body this reader does not follow (its rule counts as productive)."""


def _tree(body: list[Tok]) -> Any:
    try:
        tree, pos = _expansions(body, 0, 0)
    except (_Unread, IndexError):
        return None
    return tree if pos == len(body) else None


def _expansions(toks: list[Tok], pos: int, depth: int) -> tuple[Any, int]:
    if depth > MAX_NESTING:
        raise _Unread
    aliases = []
    while True:
        conjuncts = []
        while True:
            seq, pos = _sequence(toks, pos, depth)
            conjuncts.append(seq)
            if pos < len(toks) and toks[pos].kind == "&":
                pos += 1
                continue
            break
        if pos < len(toks) and toks[pos].kind == "->":
            pos += 2
        if pos < len(toks) and toks[pos].text == "%if":
            raise _Unread  # parametric conditions
        aliases.append(conjuncts)
        if pos < len(toks) and toks[pos].kind == "|":
            pos += 1
            continue
        return ("alt", aliases), pos


def _sequence(toks: list[Tok], pos: int, depth: int) -> tuple[list[Any], int]:
    items = []
    while pos < len(toks) and toks[pos].kind not in _ENDS and toks[pos].text not in _ENDS:
        atom, pos = _atom(toks, pos, depth)
        optional = False
        if pos < len(toks) and toks[pos].kind == "op":
            optional = toks[pos].text in "*?"
            pos += 1
        elif pos + 1 < len(toks) and toks[pos].kind == "~" and toks[pos + 1].kind == "number":
            optional = toks[pos + 1].text.lstrip("+") in ("0", "-0")
            pos += 4 if pos + 2 < len(toks) and toks[pos + 2].kind == ".." else 2
        elif pos < len(toks) and toks[pos].kind == "{":
            end = _closing(toks, pos)
            optional = pos + 1 < end and toks[pos + 1].kind in (",",) or \
                (pos + 1 < end and toks[pos + 1].text == "0")
            pos = end + 1
        items.append(True if optional else atom)
    return items, pos


def _atom(toks: list[Tok], pos: int, depth: int) -> tuple[Any, int]:
    tok = toks[pos]
    if tok.kind == "~":
        _, pos = _atom(toks, pos + 1, depth)
        return True, pos  # a negation: assumed to match something
    if tok.kind in ("(", "["):
        inner, pos = _expansions(toks, pos + 1, depth + 1)
        if toks[pos].kind != {"(": ")", "[": "]"}[tok.kind]:
            raise _Unread
        return (True if tok.kind == "[" else inner), pos + 1
    if tok.kind in ("rule", "token"):
        if pos + 1 < len(toks) and toks[pos + 1].kind in ("::",) or \
                pos + 2 < len(toks) and toks[pos + 1].kind == "{" and \
                toks[pos + 2].kind not in (",", "number"):
            raise _Unread  # templates and parametric references
        return ("ref", tok.text), pos + 1
    if tok.kind == "string" and pos + 2 < len(toks) and toks[pos + 1].kind == "..":
        return True, pos + 3
    if tok.kind in ("string", "regexp", "special", "gref", "%lark") or tok.text in ("%json",
                                                                                     "%regex"):
        return True, pos + 1
    raise _Unread


def _finite(tree: Any, known: set[str], defined: Any) -> bool:
    if tree is None or tree is True:
        return True
    if tree[0] == "ref":
        return tree[1] in known or tree[1] not in defined
    return any(all(all(_finite(item, known, defined) for item in seq) for seq in conjuncts)
               for conjuncts in tree[1])
