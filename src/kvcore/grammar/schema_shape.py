"""A JSON schema's shape before llguidance reads it: its subschemas (a graph of nesting and
$ref edges), the longest chain through them, its literals and patterns, and whether it has any
finite instance. Everything is iterative: the input is untrusted."""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator
from typing import Any

from kvcore.config import ParamError
from kvcore.grammar.bounds import (
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    check_literal,
    check_regex,
    longest_path,
    productive,
)

# keywords whose value is one subschema, a map of them, or a list of them
_ONE = ("additionalProperties", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedProperties", "unevaluatedItems", "contentSchema")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _children(node: Any) -> Iterator[tuple[str, Any]]:
    """(pointer suffix, subschema) of a schema object's direct subschemas."""
    if not isinstance(node, dict):
        return
    for key in _ONE:
        if isinstance(node.get(key), dict | bool):
            yield f"/{key}", node[key]
    for key in _MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                if isinstance(sub, dict | bool):
                    yield f"/{key}/{_escape(name)}", sub
    for key in (*_LISTS, "items"):
        value = node.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                if isinstance(sub, dict | bool):
                    yield f"/{key}/{i}", sub
        elif key == "items" and isinstance(value, dict | bool):
            yield "/items", value


class SchemaShape:
    """The subschemas of `doc`, found from the root and from every $ref target, by JSON
    pointer ("" is the root). ParamError (naming `param`) past MAX_SCHEMA_NODES."""

    def __init__(self, doc: Any, param: str) -> None:
        self.doc = doc
        self.param = param
        self.nodes: dict[str, Any] = {}
        self.kids: dict[str, list[str]] = {}
        self.refs: dict[str, str | None] = {}  # pointer -> its $ref's target (None: unknown)
        self._ids: dict[str, str] = {}  # $id / "#anchor" -> pointer
        self._add("", doc)
        unresolved = list(self.refs)
        while unresolved:  # a $ref may point anywhere in the document: walk its target too
            ptr = unresolved.pop()
            target = self._resolve(self.nodes[ptr]["$ref"])
            self.refs[ptr] = target
            if target is not None and target not in self.nodes:
                before = set(self.refs)
                self._add(target, self._at(target))
                unresolved += [p for p in self.refs if p not in before]

    def _add(self, root: str, value: Any) -> None:
        stack = [(root, value)]
        while stack:
            ptr, node = stack.pop()
            if ptr in self.nodes:
                continue
            self.nodes[ptr] = node
            if len(self.nodes) > MAX_SCHEMA_NODES:
                raise ParamError(self.param, f"{self.param}: the schema has more than "
                                             f"{MAX_SCHEMA_NODES} subschemas")
            kids = [(ptr + suffix, sub) for suffix, sub in _children(node)]
            self.kids[ptr] = [k for k, _ in kids]
            stack += kids
            if isinstance(node, dict):
                if isinstance(node.get("$ref"), str):
                    self.refs[ptr] = None
                for key in ("$anchor", "$dynamicAnchor"):
                    if isinstance(node.get(key), str):
                        self._ids["#" + node[key]] = ptr
                if isinstance(node.get("$id"), str):
                    self._ids[node["$id"].rstrip("#")] = ptr

    def _at(self, ptr: str) -> Any:
        value = self.doc
        for part in ptr.split("/")[1:]:
            key = part.replace("~1", "/").replace("~0", "~")
            value = value[int(key)] if isinstance(value, list) else value[key]
        return value

    def _resolve(self, ref: str) -> str | None:
        """The pointer a $ref names within this document (None: elsewhere, or not there)."""
        base, _, fragment = ref.partition("#")
        if base:
            if base not in self._ids:
                return None
            prefix = self._ids[base]
        elif fragment and not fragment.startswith("/"):
            return self._ids.get("#" + fragment)
        else:
            prefix = ""
        if fragment and not fragment.startswith("/"):
            return None
        ptr = prefix + urllib.parse.unquote(fragment)
        try:
            target = self._at(ptr)
        except (KeyError, IndexError, ValueError, TypeError):
            return None
        return ptr if isinstance(target, dict | bool) else None

    def edges(self, ptr: str) -> list[str]:
        target = self.refs.get(ptr)
        return self.kids.get(ptr, []) + ([target] if target is not None else [])


def check_schema(doc: Any, param: str) -> None:
    """Every bound of a JSON schema, and that it has a finite instance: ParamError naming
    `param` otherwise."""
    shape = SchemaShape(doc, param)
    depth = longest_path([""], shape.edges)
    if depth > MAX_SCHEMA_DEPTH:
        raise ParamError(param, f"{param}: the schema's nesting and $ref chain is {depth} deep, "
                                f"more than {MAX_SCHEMA_DEPTH}")
    for ptr, node in shape.nodes.items():
        if not isinstance(node, dict):
            continue
        where = f"#{ptr}" if ptr else "the root"
        if "const" in node:
            check_literal(_literal(node["const"]), param, f"the const at {where}")
        if isinstance(node.get("enum"), list):
            for value in node["enum"]:
                check_literal(_literal(value), param, f"an enum value at {where}")
        if isinstance(node.get("pattern"), str):
            check_regex(node["pattern"], param, f"the pattern at {where}")
        if isinstance(node.get("patternProperties"), dict):
            for pattern in node["patternProperties"]:
                check_regex(pattern, param, f"a patternProperties key at {where}")
    finite = productive(shape.nodes, shape.edges, lambda p, known: _finite(shape, p, known))
    if "" not in finite:
        stuck = sorted((p for p in shape.refs if p not in finite), key=len)
        at = f" (the $ref at #{stuck[0]} never reaches a base case)" if stuck else ""
        raise ParamError(param, f"{param}: the schema has no finite instance: a required "
                                f"property, item or $ref recurses forever{at}")


def _literal(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def _finite(shape: SchemaShape, ptr: str, known: set[str]) -> bool:
    """Whether the subschema at `ptr` has a finite instance once those in `known` do. Claims
    "no" only where that is certain: unknown keywords and unresolved $refs count as "yes"."""
    node = shape.nodes[ptr]
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True
    target = shape.refs.get(ptr)
    if target is not None and target not in known:
        return False
    kids = set(shape.kids[ptr])
    if isinstance(node.get("allOf"), list) and any(
            f"{ptr}/allOf/{i}" in kids and f"{ptr}/allOf/{i}" not in known
            for i in range(len(node["allOf"]))):
        return False
    for key in ("anyOf", "oneOf"):
        options = [f"{ptr}/{key}/{i}" for i in range(len(node.get(key) or []))
                   if isinstance(node.get(key), list)]
        if options and all(o in kids and o not in known for o in options):
            return False
    if "const" in node or "enum" in node:
        return True
    types = node.get("type")
    if types is None:
        return True  # any JSON value: a number satisfies object or array keywords
    types = types if isinstance(types, list) else [types]
    return any(t not in ("object", "array") or (_object_finite(node, ptr, kids, known)
                                                if t == "object"
                                                else _array_finite(node, ptr, kids, known))
               for t in types)


def _object_finite(node: dict[str, Any], ptr: str, kids: set[str], known: set[str]) -> bool:
    required = node.get("required")
    if not isinstance(required, list):
        return True
    properties = node["properties"] if isinstance(node.get("properties"), dict) else {}
    for name in required:
        if not isinstance(name, str):
            continue
        if name in properties:
            sub = f"{ptr}/properties/{_escape(name)}"
        elif node.get("patternProperties"):
            continue  # which pattern applies is llguidance's to decide
        elif node.get("additionalProperties") is False:
            return False
        else:
            sub = f"{ptr}/additionalProperties"
        if sub in kids and sub not in known:
            return False
    return True


def _array_finite(node: dict[str, Any], ptr: str, kids: set[str], known: set[str]) -> bool:
    min_items = node.get("minItems", 0)
    if not isinstance(min_items, int) or min_items <= 0:
        return True
    prefix_key = "prefixItems" if isinstance(node.get("prefixItems"), list) else "items"
    prefix = node[prefix_key] if isinstance(node.get(prefix_key), list) else []
    for i in range(min(min_items, len(prefix))):
        sub = f"{ptr}/{prefix_key}/{i}"
        if sub in kids and sub not in known:
            return False
    if min_items > len(prefix):
        rest = "additionalItems" if prefix_key == "items" and prefix else "items"
        if node.get(rest) is False:
            return False
        sub = f"{ptr}/{rest}"
        if sub in kids and sub not in known:
            return False
    return True
