"""Ten JSON schemas of the kinds extraction and classification jobs use (nested objects, arrays,
enums, bounded numbers, optional fields, string patterns), shared by ``bench.structured``,
``bench.grammar_engines`` and the structured-output tests."""

from __future__ import annotations

from typing import Any

SCHEMAS: list[dict[str, Any]] = [
    {  # 0: flat object, required fields
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {  # 1: enum classification
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["label", "confidence"],
        "additionalProperties": False,
    },
    {  # 2: bounded integers
        "type": "object",
        "properties": {
            "priority": {"type": "integer", "minimum": 1, "maximum": 5},
            "count": {"type": "integer", "minimum": -10, "maximum": 10},
        },
        "required": ["priority", "count"],
        "additionalProperties": False,
    },
    {  # 3: arrays of strings with bounds
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {  # 4: nested objects
        "type": "object",
        "properties": {
            "customer": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 12},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["customer"],
        "additionalProperties": False,
    },
    {  # 5: optional fields
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 16},
            "subtitle": {"type": "string", "maxLength": 16},
            "pages": {"type": "integer", "minimum": 1, "maximum": 999},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    {  # 6: string patterns (a date and a currency code)
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
        },
        "required": ["date", "currency"],
        "additionalProperties": False,
    },
    {  # 7: array of objects
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {  # 8: booleans, nullable and const
        "type": "object",
        "properties": {
            "kind": {"const": "ticket"},
            "urgent": {"type": "boolean"},
            "assignee": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]},
        },
        "required": ["kind", "urgent", "assignee"],
        "additionalProperties": False,
    },
    {  # 9: invoice extraction (name / date / amount)
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "amount": {"type": "number", "minimum": 0, "maximum": 1000000},
        },
        "required": ["name", "date", "amount"],
        "additionalProperties": False,
    },
]

#: Schema features beyond :data:`SCHEMAS` whose support the engine comparison reports.
COVERAGE_SCHEMAS: dict[str, dict[str, Any]] = {
    "format_date": {"type": "string", "format": "date"},
    "format_email": {"type": "string", "format": "email"},
    "ref_defs": {
        "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
    },
    "recursive_ref": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
            }
        },
        "$ref": "#/$defs/node",
    },
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    "allOf": {
        "allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]
    },
    "exclusive_bounds": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "pattern_properties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
    "min_max_properties": {"type": "object", "minProperties": 1, "maxProperties": 2},
    "if_then_else": {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
}
