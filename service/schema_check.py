"""JSON-schema keywords llguidance accepts but cannot enforce while decoding (it compiles JSON
schemas leniently: uniqueItems, contains / minContains / maxContains, dependentRequired, ...):
checked on the finished answer instead. A violation is counted
(`kvcore:structured_output_unenforced_violations_total`) and logged; the answer is returned as
generated, as the anchors (vLLM, SGLang) return it."""

from __future__ import annotations

import json
from typing import Any

UNENFORCED = ("uniqueItems", "contains", "minContains", "maxContains", "dependentRequired",
              "not", "if", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
              "dependentSchemas")
MAX_DEPTH = 64


def uses_unenforced(schema_text: str) -> bool:
    return any(f'"{key}"' in schema_text for key in UNENFORCED)


def violations(schema: Any, value: Any) -> list[str]:
    """The checkable unenforced keywords `value` breaks (uniqueItems, contains counts,
    dependentRequired), where the schema says for sure which subschema applies."""
    out: list[str] = []
    _walk(schema, value, schema, "$", out, 0)
    return out


def _walk(schema: Any, value: Any, root: Any, where: str, out: list[str], depth: int) -> None:
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        _walk(target, value, root, where, out, depth + 1)
    for sub in schema.get("allOf") or []:
        _walk(sub, value, root, where, out, depth + 1)
    if isinstance(value, list):
        if schema.get("uniqueItems") is True:
            seen = [json.dumps(v, sort_keys=True) for v in value]
            if len(set(seen)) != len(seen):
                out.append(f"{where}: uniqueItems")
        prefix = schema.get("prefixItems") or []
        for i, item in enumerate(value):
            sub = prefix[i] if i < len(prefix) else schema.get("items")
            _walk(sub, item, root, f"{where}[{i}]", out, depth + 1)
    elif isinstance(value, dict):
        for key, names in (schema.get("dependentRequired") or {}).items():
            if key in value and any(n not in value for n in names):
                out.append(f"{where}: dependentRequired")
        props = schema.get("properties") or {}
        for key, item in value.items():
            sub = props.get(key, schema.get("additionalProperties"))
            _walk(sub, item, root, f"{where}.{key}", out, depth + 1)


def answer_violations(call: Any, text: str) -> list[str]:
    """The violations of one choice's whole text: a JSON answer against its response format,
    each tool call's arguments against its tool's parameters."""
    out: list[str] = []
    tools = call.tools
    answer_schema = tools.answer if tools is not None else None
    constraint = call.params.constraint
    if tools is None and constraint is not None and constraint.kind == "json_schema":
        answer_schema = json.loads(constraint.spec)
    content = text
    if tools is not None:
        content, calls = call.tool_format.parse(text)
        params = {t.name: t.parameters for t in tools.tools}
        for c in calls:
            try:
                arguments = json.loads(c["function"]["arguments"])
            except ValueError:
                continue  # cut by length: nothing to check
            out += violations(params.get(c["function"]["name"]), arguments)
    if answer_schema is not None and content:
        try:
            value = json.loads(content)
        except ValueError:
            return out  # cut by length: nothing to check
        out += violations(answer_schema, value)
    return out


def needs_check(call: Any) -> bool:
    """Whether a call's constraint uses a keyword that is checked after generation."""
    if call.tools is not None:
        return uses_unenforced(json.dumps([t.parameters for t in call.tools.tools])) or (
            call.tools.answer is not None and uses_unenforced(json.dumps(call.tools.answer)))
    constraint = call.params.constraint
    return constraint is not None and constraint.kind == "json_schema" and uses_unenforced(
        constraint.spec)
