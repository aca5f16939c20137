"""kvcore.grammar's pure-Python bounds: each bound refuses the shape it is for with a ParamError
naming the field, lets ordinary constraints through, and the satisfiability analysis refuses
exactly the schemas and grammars that have no finite instance."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcore.config import ParamError
from kvcore.grammar import bounds
from kvcore.grammar.lark_shape import check_lark, lex
from kvcore.grammar.native import check_shape
from kvcore.grammar.schema_shape import check_schema

sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
from soak_constraints import array_chain, grammar_chain, schema_chain  # noqa: E402


def _refused(fn: Any, *args: Any, match: str) -> ParamError:
    with pytest.raises(ParamError, match=match) as info:
        fn(*args)
    return info.value


def test_reference_chains_past_the_depth_bound_are_refused() -> None:
    check_schema(schema_chain(bounds.MAX_SCHEMA_DEPTH - 1), "p")  # the bound itself passes
    error = _refused(check_schema, schema_chain(3000), "p", match="3001 deep, more than 128")
    assert error.param == "p"
    _refused(check_schema, array_chain(2000), "p", match="4000 deep")
    _refused(check_schema, schema_chain(30_000), "p", match="more than 10000 subschemas")
    check_lark(grammar_chain(bounds.MAX_GRAMMAR_DEPTH - 1), "g")
    _refused(check_lark, grammar_chain(3000), "g", match="rule references is 3001 deep")
    _refused(check_lark, grammar_chain(30_000), "g", match="30001 rules and terminals")


def test_inline_nesting_and_refs_anywhere_count() -> None:
    nested: dict[str, Any] = {"type": "integer"}
    for _ in range(bounds.MAX_SCHEMA_DEPTH + 1):
        nested = {"type": "object", "properties": {"a": nested}}
    _refused(check_schema, nested, "p", match="130 deep")
    # a chain hidden under an unknown keyword is found through the $refs that reach it
    hidden = {"x-defs": {f"d{i}": {"$ref": f"#/x-defs/d{i + 1}"} for i in range(500)},
              "$ref": "#/x-defs/d0"}
    _refused(check_schema, hidden, "p", match="deep, more than")
    anchored = {"$defs": {f"d{i}": {"$anchor": f"a{i}", "$ref": f"#a{i + 1}"}
                          for i in range(500)}, "$ref": "#a0"}
    _refused(check_schema, anchored, "p", match="deep, more than")
    # recursion is fine: a tree refers to its root
    check_schema({"type": "object", "properties": {"kids": {"type": "array",
                                                              "items": {"$ref": "#"}}}}, "p")


def test_literals_and_regexes_are_bounded() -> None:
    _refused(check_schema, {"const": "a" * 5000}, "p", match="the const at the root is 5000")
    _refused(check_schema, {"enum": ["ok", "b" * 5000]}, "p", match="an enum value")
    _refused(check_schema, {"type": "string", "pattern": "^a{50000}$"}, "p",
             match="forces a run of 50000")
    _refused(check_lark, 'start: "' + "c" * 5000 + '"', "g", match="a string literal")
    _refused(check_lark, "start: /x{5000}/", "g", match="forces a run of 5000")
    _refused(check_shape, "regex", "(" * 70 + "a" + ")" * 70, "r", match="nests 70 groups")
    _refused(check_shape, "regex", "(a{1,1000}){1,200}", "r", match="repeats up to 200000")
    _refused(check_shape, "choice", json.dumps(["x", "y" * 5000]), "c", match="a choice")
    assert bounds._regex_shape("(a{100}){100}") == (1, 10_000, 10_000)
    assert bounds._regex_shape(r"[a{]{5}\{9}x{,9}") == (0, 5, 9)
    check_shape("regex", r"(\w+\s?)*$", "r")
    check_shape("regex", "[0-9]{1,3}(,[0-9]{3})*", "r")


@pytest.mark.parametrize("schema", [
    {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                     "required": ["x"]}}, "$ref": "#/$defs/a"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
    {"allOf": [{"type": "string"}, {"$ref": "#/allOf/2"}, {"$ref": "#/allOf/1"}]},
    {"anyOf": [{"$ref": "#"}, {"$ref": "#"}]},
    {"type": "object", "required": ["a"], "additionalProperties": False},
    False,
], ids=["required-recursion", "ref-cycle", "array-recursion", "allof-cycle", "anyof-self",
        "required-not-allowed", "false"])
def test_schemas_without_a_finite_instance_are_refused(schema: Any) -> None:
    _refused(check_schema, schema, "p", match="no finite instance")


@pytest.mark.parametrize("schema", [
    {"$defs": {"n": {"type": "object", "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}, "required": ["next"]}},
     "$ref": "#/$defs/n"},
    {"type": "object", "properties": {"x": {"$ref": "#"}}},  # x is optional
    {"type": ["object", "null"], "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    {"properties": {"x": {"$ref": "#"}}, "required": ["x"]},  # no type: a number matches
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {"$ref": "https://example.com/elsewhere.json"},  # not ours to judge
    True,
], ids=["linked-list", "optional", "nullable", "untyped", "empty-array", "remote", "true"])
def test_recursive_schemas_with_a_base_case_pass(schema: Any) -> None:
    check_schema(schema, "p")


@pytest.mark.parametrize("grammar", ['start: a\na: a "x"', "start: start",
                                     'start: a b\na: "x"\nb: "y" b',
                                     'start: (a)+\na: "(" a ")"'],
                         ids=["self", "start-self", "second", "group"])
def test_grammars_without_a_finite_derivation_are_refused(grammar: str) -> None:
    _refused(check_lark, grammar, "g", match="no finite derivation")


@pytest.mark.parametrize("grammar", [
    'start: a\na: a "x" | "y"', 'start: a*\na: "(" a ")"', 'start: [a]\na: a "x"',
    'start: NUM " + " NUM\nNUM: /[0-9]{1,3}/',
    'start: a\na: "x"\n  | a "y"',  # a continuation line
    '%llguidance {}\nstart: call\ncall: <[12]> %json {"type": "object"}',
    'start: %lark { start: "x" }', 'start: "a"{0,3} b\nb: "b"',
    'start: a::_ | "x"\na::_: "y"',  # parametric: not followed, assumed productive
], ids=["base-case", "star", "maybe", "terminal", "continuation", "json", "nested", "range",
        "parametric"])
def test_ordinary_grammars_pass(grammar: str) -> None:
    check_lark(grammar, "g")


def test_embedded_json_schemas_are_checked_and_lexing_follows_llguidance() -> None:
    _refused(check_lark, 'start: %json ' + json.dumps(schema_chain(500)), "g", match="deep")
    toks = lex('start: "a\\"b" /c\\/d/i <|eos|> @sub x? y?z // note\nX: "1"..  "9"')
    assert toks is not None  # `?z` is a rule name, as llguidance's longest match reads it
    assert [t.kind for t in toks] == ["rule", ":", "string", "regexp", "special", "gref", "rule",
                                      "op", "rule", "rule", "nl", "token", ":", "string", "..",
                                      "string"]
    assert lex("start: $") is None  # llguidance's lexer refuses it too


def test_readme_states_the_limits() -> None:
    """README's limits table is these constants (a changed bound changes the table)."""
    from kvcore.grammar import cache, native, pool, worker

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    table = readme[readme.index("| limit | value |"):readme.index("Compiled constraints are")]
    for value in (native.MAX_SPEC_CHARS // 1024, bounds.MAX_SCHEMA_NODES,
                  bounds.MAX_SCHEMA_DEPTH, bounds.MAX_GRAMMAR_RULES, bounds.MAX_GRAMMAR_DEPTH,
                  bounds.MAX_LITERAL_CHARS, bounds.MAX_REGEX_NESTING, bounds.MAX_REGEX_FORCED,
                  bounds.MAX_REGEX_REPEAT, int(pool.COMPILE_TIMEOUT_S),
                  worker.MAX_ENTRY_BYTES >> 20, worker.MAX_FIRST_MASK_S):
        assert f"{value:,}" in table, value
    assert f"within {cache.CACHE_BYTES >> 20} MiB, a tenant" in readme.replace("\n", " ")
    assert cache.TENANT_SHARE == 0.5 and "holding at most half" in readme.replace("\n", " ")
    assert f"{native.COMPILE_STACK_BYTES >> 20} MiB stack" in readme.replace("\n", " ")
