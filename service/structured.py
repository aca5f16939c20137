"""The request fields that constrain the output: OpenAI's `response_format`, vLLM's
`structured_outputs` (and its older `guided_*` names), translated into one engine Constraint."""

from __future__ import annotations

import json
from typing import Any

from kvcore.config import ParamError
from kvcore.engine import EngineClient
from kvcore.grammar.pool import CompilerUnavailable
from kvcore.sampling.constraints import Constraint
from kvcore.service.errors import APIError, bad_request

# vLLM's structured_outputs keys -> the constraint kind; the older top-level names alike
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar", "json_object": "json_object"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def parse_constraint(body: dict[str, Any]) -> Constraint | None:
    """The one constraint a body asks for (None: free text); a 400 naming the field when a
    value is malformed or two fields ask for different constraints."""
    found: list[Constraint] = []
    try:
        response_format = _response_format(body.get("response_format"))
        if response_format is not None:
            found.append(response_format)
        structured = body.get("structured_outputs")
        if structured is not None:
            if not isinstance(structured, dict):
                raise bad_request("structured_outputs must be an object", "structured_outputs")
            found += _structured(structured, "structured_outputs.")
        guided = {key: body[old] for old, key in _GUIDED.items() if body.get(old) is not None}
        if guided:
            found += _structured(guided, "guided_")
    except ParamError as e:
        raise bad_request(str(e), e.param) from None
    if len(found) > 1:
        raise bad_request("only one of response_format, structured_outputs and the guided_* "
                          "fields may constrain the output", found[1].param)
    return found[0] if found else None


async def prepare_constraint(engine: EngineClient, constraint: Constraint | None, tenant: str,
                             cache_salt: str | None) -> object:
    """Compile a call's constraint (any API's: response formats, structured outputs, tools)
    before its requests reach the engine: off the event loop, tenants taking turns, a 400
    naming the field when it is refused (too large, too deep, no finite instance, a crash or
    a timeout of its compile worker). Hold the result until the call ends."""
    try:
        return await engine.prepare(constraint, tenant, cache_salt)
    except ParamError as e:
        raise bad_request(str(e), e.param) from None
    except CompilerUnavailable as e:
        raise APIError(503, str(e), headers={"Retry-After": "1"}) from None


def _response_format(value: Any) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint("json_object", "", "response_format")
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be text, json_object or json_schema, "
                          f"got {kind!r}", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with a schema",
                          "response_format.json_schema")
    if not isinstance(spec.get("strict", False), bool | None):
        raise bad_request(f"response_format.json_schema.strict must be a boolean, got "
                          f"{spec['strict']!r}", "response_format.json_schema.strict")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: an absent schema is any object
    return Constraint.json_schema(schema, "response_format.json_schema.schema")


def _structured(fields: dict[str, Any], prefix: str) -> list[Constraint]:
    unknown = sorted(set(fields) - set(_STRUCTURED_KEYS) - {"disable_any_whitespace",
                                                              "disable_additional_properties",
                                                              "whitespace_pattern",
                                                              "structural_tag"})
    if unknown:
        raise bad_request(f"{prefix}{unknown[0]} is not a supported constraint",
                          f"{prefix}{unknown[0]}")
    if fields.get("structural_tag") is not None:
        raise bad_request("structural_tag is not supported; use tools with tool_choice",
                          f"{prefix}structural_tag")
    out = []
    for key, kind in _STRUCTURED_KEYS.items():
        value = fields.get(key)
        if value is None or (key == "json_object" and value is False):
            continue
        param = f"{prefix}{key}"
        if kind == "json_schema":
            if isinstance(value, str):  # vLLM accepts the schema as JSON text too
                value = _json_text(value, param)
            out.append(Constraint.json_schema(value, param))
        elif kind == "choice":
            out.append(Constraint.choice(value, param))
        elif kind == "json_object":
            out.append(Constraint("json_object", "", param))
        else:
            if not isinstance(value, str):
                raise bad_request(f"{param} must be a string", param)
            out.append(Constraint(kind, value, param))
    return out


def _json_text(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise bad_request(f"{param} is not valid JSON: {e}", param) from None
