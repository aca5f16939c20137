"""Typed readers for JSON request fields: a value of the wrong JSON type is a 400 naming its field.

Ranges are not checked here: SamplingParams / BeamSearchParams check every sampling value."""

from __future__ import annotations

import math
from typing import Any

from kvcore.service.errors import bad_request

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(value), type(value).__name__)


def get_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {_type_name(value)}", name)
    return value


def as_int(value: Any, name: str, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    # JSON has one number type: 3.0 is accepted as 3 (as pydantic does), 3.5 is not
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {_type_name(value)}", name)
    if not lo <= value <= hi:
        bound = f"in [{lo}, {hi}]" if (lo, hi) != (INT64_MIN, INT64_MAX) else "a 64-bit integer"
        raise bad_request(f"{name} must be {bound}, got {value}", name)
    return value


def get_int(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    return default if value is None else as_int(value, name)


def get_str(body: dict[str, Any], name: str, *, non_empty: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string, got {_type_name(value)}", name)
    if non_empty and not value:
        raise bad_request(f"{name} must be a non-empty string", name)
    return value


def get_object(body: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be an object, got {_type_name(value)}", name)
    return value


def get_list(body: dict[str, Any], name: str, what: str) -> list[Any]:
    """An array (a bare string is one item, as OpenAI's `stop`); [] when absent."""
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise bad_request(f"{name} must be {what}, got {_type_name(value)}", name)
    return value


def get_logit_bias(body: dict[str, Any]) -> dict[int, Any] | None:
    """OpenAI sends token ids as JSON object keys, so as strings."""
    value = get_object(body, "logit_bias")
    if not value:
        return None
    try:
        return {int(key): bias for key, bias in value.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids", "logit_bias") from None
