"""JSON schemas of the kinds real APIs send as structured outputs and tool parameters."""

from __future__ import annotations

from typing import Any

_ADDRESS = {"type": "object", "properties": {"street": {"type": "string"},
                                             "city": {"type": "string"},
                                             "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("empty_object", {"type": "object", "additionalProperties": False}),
    ("one_string", {"type": "object", "properties": {"name": {"type": "string"}},
                    "required": ["name"], "additionalProperties": False}),
    ("weather_args", {"type": "object", "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["location", "unit"], "additionalProperties": False}),
    ("integer_bounds", {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["age"], "additionalProperties": False}),
    ("exclusive_bounds", {"type": "object", "properties": {
        "score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
        "required": ["score"], "additionalProperties": False}),
    ("number", {"type": "object", "properties": {"price": {"type": "number", "minimum": 0}},
                "required": ["price"], "additionalProperties": False}),
    ("boolean_null", {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                       "note": {"type": "null"}},
                      "required": ["ok", "note"], "additionalProperties": False}),
    ("enum_mixed", {"type": "object", "properties": {"v": {"enum": ["a", 1, True, None]}},
                    "required": ["v"], "additionalProperties": False}),
    ("const", {"type": "object", "properties": {"kind": {"const": "event"},
                                                "id": {"type": "integer"}},
               "required": ["kind", "id"], "additionalProperties": False}),
    ("array_of_strings", {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False}),
    ("array_exact", {"type": "object", "properties": {
        "rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255},
                "minItems": 3, "maxItems": 3}}, "required": ["rgb"],
        "additionalProperties": False}),
    ("top_level_array", {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                         "maxItems": 4}),
    ("nested_object", {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                  "name": {"type": "string"}},
                 "required": ["id", "name"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False}),
    ("deep_nesting", {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"],
              "additionalProperties": False}}, "required": ["b"],
        "additionalProperties": False}}, "required": ["a"], "additionalProperties": False}),
    ("array_of_objects", {"type": "object", "properties": {"items": {
        "type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": {"type": "string"},
                                             "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False}),
    ("optional_fields", {"type": "object", "properties": {
        "title": {"type": "string"}, "year": {"type": "integer"},
        "rating": {"type": "number"}}, "required": ["title"], "additionalProperties": False}),
    ("all_optional", {"type": "object", "properties": {"x": {"type": "integer"},
                                                       "y": {"type": "integer"}},
                      "additionalProperties": False}),
    ("any_of", {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]}},
        "required": ["value"], "additionalProperties": False}),
    ("one_of_objects", {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"},
                                          "r": {"type": "integer"}},
         "required": ["kind", "r"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"},
                                          "side": {"type": "integer"}},
         "required": ["kind", "side"], "additionalProperties": False}]}},
        "required": ["shape"], "additionalProperties": False}),
    ("nullable", {"type": "object", "properties": {"middle_name": {"type": ["string", "null"]}},
                  "required": ["middle_name"], "additionalProperties": False}),
    ("ref_defs", {"$defs": {"address": _ADDRESS}, "type": "object", "properties": {
        "home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"}},
        "required": ["home"], "additionalProperties": False}),
    ("ref_definitions", {"definitions": {"id": {"type": "integer", "minimum": 1}},
                         "type": "object", "properties": {"ids": {
                             "type": "array", "items": {"$ref": "#/definitions/id"},
                             "maxItems": 3}}, "required": ["ids"],
                         "additionalProperties": False}),
    ("pattern", {"type": "object", "properties": {
        "phone": {"type": "string", "pattern": "^\\+?[0-9]{3}-[0-9]{4}$"}},
        "required": ["phone"], "additionalProperties": False}),
    ("string_lengths", {"type": "object", "properties": {
        "code": {"type": "string", "minLength": 2, "maxLength": 4}},
        "required": ["code"], "additionalProperties": False}),
    ("format_date", {"type": "object", "properties": {"when": {"type": "string",
                                                               "format": "date"}},
                     "required": ["when"], "additionalProperties": False}),
    ("format_email", {"type": "object", "properties": {"email": {"type": "string",
                                                                 "format": "email"}},
                      "required": ["email"], "additionalProperties": False}),
    ("format_uuid", {"type": "object", "properties": {"id": {"type": "string",
                                                             "format": "uuid"}},
                     "required": ["id"], "additionalProperties": False}),
    ("format_date_time", {"type": "object", "properties": {
        "at": {"type": "string", "format": "date-time"}}, "required": ["at"],
        "additionalProperties": False}),
    ("additional_typed", {"type": "object", "additionalProperties": {"type": "integer"},
                          "maxProperties": 2}),
    ("open_object", {"type": "object", "properties": {"id": {"type": "integer"}},
                     "required": ["id"]}),
    ("search_tool", {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 8},
        "filters": {"type": "object", "properties": {
            "lang": {"type": "string", "enum": ["en", "de", "fr"]},
            "after": {"type": "string", "format": "date"}},
            "required": ["lang"], "additionalProperties": False},
        "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
        "required": ["query", "limit"], "additionalProperties": False}),
    ("calendar_event", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 6},
        "attendees": {"type": "array", "items": {"type": "string", "format": "email"},
                      "maxItems": 2},
        "priority": {"type": "string", "enum": ["low", "high"]},
        "all_day": {"type": "boolean"}},
        "required": ["title", "priority", "all_day"], "additionalProperties": False}),
    ("recursive_tree", {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 1}},
        "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/node"}),
    ("unique_enum_list", {"type": "object", "properties": {"days": {
        "type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "maxItems": 2}},
        "required": ["days"], "additionalProperties": False}),
]
