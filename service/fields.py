"""Typed readers for JSON request fields: each bad value is a 400 that names its parameter."""

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
        if hi == INT64_MAX:
            bound = f">= {lo}" if lo > INT64_MIN else "a 64-bit integer"
        elif lo == INT64_MIN:
            bound = f"<= {hi}"
        else:
            bound = f"in [{lo}, {hi}]"
        raise bad_request(f"{name} must be {bound}, got {value}", name)
    return value


def get_int(body: dict[str, Any], name: str, default: int | None, lo: int = INT64_MIN,
            hi: int = INT64_MAX) -> int | None:
    value = body.get(name)
    return default if value is None else as_int(value, name, lo, hi)


def get_float(body: dict[str, Any], name: str, default: float, lo: float = -math.inf,
              hi: float = math.inf, *, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"{name} must be a number, got {_type_name(value)}", name)
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        raise bad_request(f"{name} is out of range, got {value}", name) from None
    if not math.isfinite(number):
        raise bad_request(f"{name} must be finite, got {value}", name)
    if number < lo or number > hi or (lo_open and number == lo):
        left = "(" if lo_open else "["
        raise bad_request(f"{name} must be in {left}{lo:g}, {hi:g}], got {value}", name)
    return number


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


def get_stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("stop must be a string or an array of strings", "stop")
    if any(not s for s in items):
        raise bad_request("stop strings must be non-empty", "stop")
    return tuple(items)


def get_token_ids(body: dict[str, Any], name: str, vocab_size: int) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_request(f"{name} must be an array of token ids, got {_type_name(value)}", name)
    return tuple(as_int(t, name, 0, vocab_size - 1) for t in value)


def get_logit_bias(body: dict[str, Any], vocab_size: int) -> dict[int, float] | None:
    value = get_object(body, "logit_bias")
    if not value:
        return None
    bias: dict[int, float] = {}
    for key, raw in value.items():
        # OpenAI sends token ids as JSON object keys, so as strings
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                              "logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"logit_bias token id {token_id} is outside the vocabulary "
                              f"[0, {vocab_size})", "logit_bias")
        bias[token_id] = get_float({"logit_bias": raw}, "logit_bias", 0.0, -100.0, 100.0)
    return bias
