"""A corpus of 20 small, realistic JSON schemas, each with an instance that satisfies it.

Used by tests/structured/ (every example validates with jsonschema, and both xgrammar and
llguidance accept it token by token) and by benchmarks/grammar_engines.py (compile time and
per-token mask time on the default model's vocabulary). Each schema is small enough for a 135M
model to fill in well under 150 tokens. Every schema passes fornax's schema check, so the
corpus sticks to keywords xgrammar enforces: an explicit "type" wherever a type-specific keyword
is used, every required name declared in "properties", no siblings beside anyOf/oneOf/$ref.

SCHEMAS: (name, schema, valid_example). PROMPTS: instruction prompts taking `name`.
"""

from __future__ import annotations

from typing import Any

_STR: dict[str, Any] = {"type": "string"}
_NAME: dict[str, Any] = {"type": "string", "minLength": 1, "maxLength": 40}
_NULLABLE_STR: dict[str, Any] = {"type": ["string", "null"]}


def _obj(
    properties: dict[str, Any], required: list[str] | None = None, closed: bool = True, **extra: Any
) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
    }
    if closed:
        schema["additionalProperties"] = False
    return {**schema, **extra}


SCHEMAS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (
        "person",
        _obj(
            {
                "name": _NAME,
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": {"type": "string", "format": "email"},
                "is_student": {"type": "boolean"},
            },
            required=["name", "age"],
        ),
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "is_student": False},
    ),
    (
        "invoice",
        _obj(
            {
                "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
                "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
                "lines": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": _obj(
                        {
                            "description": {"type": "string", "maxLength": 60},
                            "quantity": {"type": "integer", "minimum": 1},
                            "unit_price": {"type": "number", "exclusiveMinimum": 0},
                        }
                    ),
                },
                "total": {"type": "number", "minimum": 0},
            }
        ),
        {
            "invoice_id": "INV-004213",
            "currency": "EUR",
            "lines": [{"description": "Consulting", "quantity": 3, "unit_price": 120.5}],
            "total": 361.5,
        },
    ),
    (
        "weather report",
        _obj(
            {
                "city": _NAME,
                "temperature_c": {"type": "number", "minimum": -90, "maximum": 60},
                "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow", "fog"]},
                "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
                "wind": _obj(
                    {
                        "speed_kmh": {"type": "number", "minimum": 0},
                        "direction": {"type": "string", "enum": ["N", "NE", "E", "SE", "S", "SW", "W", "NW"]},
                    }
                ),
            }
        ),
        {
            "city": "Oslo",
            "temperature_c": -3.5,
            "conditions": "snow",
            "humidity": 81,
            "wind": {"speed_kmh": 14, "direction": "NW"},
        },
    ),
    (
        "product list",
        _obj(
            {
                "products": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": _obj(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                            "name": _NAME,
                            "price": {"type": "number", "exclusiveMinimum": 0},
                            "in_stock": {"type": "boolean"},
                        }
                    ),
                },
            }
        ),
        {
            "products": [
                {"sku": "KBD-1001", "name": "Keyboard", "price": 49.99, "in_stock": True},
                {"sku": "MOU-2002", "name": "Mouse", "price": 19.5, "in_stock": False},
            ]
        },
    ),
    (
        "calendar event",
        _obj(
            {
                "title": _NAME,
                "date": {"type": "string", "format": "date"},
                "start_time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
                "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
                "attendees": {"type": "array", "maxItems": 4, "items": _NAME},
                "location": _NULLABLE_STR,
            }
        ),
        {
            "title": "Design review",
            "date": "2025-03-14",
            "start_time": "14:30",
            "duration_minutes": 45,
            "attendees": ["Grace", "Linus"],
            "location": None,
        },
    ),
    (
        "book",
        _obj(
            {
                "title": _NAME,
                "author": _NAME,
                "isbn": {"type": "string", "pattern": "^97[89]-[0-9]{10}$"},
                "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
                "genres": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "string",
                        "enum": ["fiction", "science", "history", "poetry", "biography"],
                    },
                },
            }
        ),
        {
            "title": "Dune",
            "author": "Frank Herbert",
            "isbn": "978-0441172719",
            "year": 1965,
            "genres": ["fiction", "science"],
        },
    ),
    (
        "shipping order",
        {
            "$defs": {
                "address": _obj(
                    {
                        "street": {"type": "string", "maxLength": 60},
                        "city": _NAME,
                        "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                    }
                )
            },
            **_obj(
                {
                    "order_id": {"type": "integer", "minimum": 1},
                    "billing": {"$ref": "#/$defs/address"},
                    "shipping": {"$ref": "#/$defs/address"},
                    "express": {"type": "boolean"},
                }
            ),
        },
        {
            "order_id": 1042,
            "billing": {"street": "1 Main St", "city": "Springfield", "postcode": "12345"},
            "shipping": {"street": "9 Elm Rd", "city": "Shelbyville", "postcode": "54321"},
            "express": True,
        },
    ),
    (
        "recipe",
        _obj(
            {
                "name": _NAME,
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "vegetarian": {"type": "boolean"},
                "ingredients": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": _obj(
                        {
                            "item": _NAME,
                            "amount": {"type": "number", "exclusiveMinimum": 0},
                            "unit": {"type": "string", "enum": ["g", "ml", "tsp", "tbsp", "cup", "piece"]},
                        }
                    ),
                },
            }
        ),
        {
            "name": "Pancakes",
            "servings": 4,
            "vegetarian": True,
            "ingredients": [
                {"item": "flour", "amount": 200, "unit": "g"},
                {"item": "milk", "amount": 300, "unit": "ml"},
            ],
        },
    ),
    (
        "movie review",
        _obj(
            {
                "schema_version": {"const": "1.0"},
                "movie": _NAME,
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                "recommend": {"type": "boolean"},
                "summary": {"type": "string", "minLength": 10, "maxLength": 200},
            }
        ),
        {
            "schema_version": "1.0",
            "movie": "Arrival",
            "rating": 5,
            "recommend": True,
            "summary": "A quiet, clever film about language and time.",
        },
    ),
    (
        "log entry",
        _obj(
            {
                "timestamp": {"type": "string", "format": "date-time"},
                "level": {"type": "string", "enum": ["debug", "info", "warning", "error"]},
                "service": {"type": "string", "pattern": "^[a-z][a-z0-9-]{1,20}$"},
                "message": {"type": "string", "maxLength": 120},
                "status_code": {"type": ["integer", "null"], "minimum": 100, "maximum": 599},
            }
        ),
        {
            "timestamp": "2025-01-02T03:04:05Z",
            "level": "error",
            "service": "auth-api",
            "message": "token expired",
            "status_code": 401,
        },
    ),
    (
        "contact card",
        _obj(
            {
                "full_name": _NAME,
                "phone": {"anyOf": [{"type": "string", "pattern": "^\\+[0-9]{7,15}$"}, {"type": "null"}]},
                "company": _NULLABLE_STR,
                "tags": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {"type": "string", "minLength": 2, "maxLength": 15},
                },
            }
        ),
        {"full_name": "Alan Turing", "phone": "+441234567890", "company": None, "tags": ["math", "crypto"]},
    ),
    (
        "geo location",
        _obj(
            {
                "latitude": {"type": "number", "minimum": -90, "maximum": 90},
                "longitude": {"type": "number", "minimum": -180, "maximum": 180},
                "label": {"type": ["string", "null"], "maxLength": 50},
                "accuracy_m": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10000},
            }
        ),
        {"latitude": 48.8584, "longitude": 2.2945, "label": "Eiffel Tower", "accuracy_m": 12},
    ),
    (
        "user settings",
        _obj(
            {
                "theme": {"type": "string", "enum": ["light", "dark", "system"]},
                "language": {"type": "string", "pattern": "^[a-z]{2}$"},
                "font_size": {"type": "integer", "minimum": 8, "maximum": 32},
                "notifications": _obj(
                    {"email": {"type": "boolean"}, "sms": {"type": "boolean"}, "push": {"type": "boolean"}}
                ),
            }
        ),
        {
            "theme": "dark",
            "language": "en",
            "font_size": 14,
            "notifications": {"email": True, "sms": False, "push": True},
        },
    ),
    (
        "flight booking",
        _obj(
            {
                "flight": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3,4}$"},
                "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "cabin": {"type": "string", "enum": ["economy", "premium", "business", "first"]},
                "passengers": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": _obj(
                        {
                            "name": _NAME,
                            "seat": {"type": "string", "pattern": "^[0-9]{1,2}[A-F]$"},
                        }
                    ),
                },
            }
        ),
        {
            "flight": "LH1234",
            "origin": "FRA",
            "destination": "JFK",
            "cabin": "economy",
            "passengers": [{"name": "Marie Curie", "seat": "23C"}],
        },
    ),
    (
        "todo list",
        _obj(
            {
                "owner": _NAME,
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 5,
                    "items": _obj(
                        {
                            "task": {"type": "string", "minLength": 1, "maxLength": 50},
                            "done": {"type": "boolean"},
                            "priority": {"type": "string", "enum": ["low", "medium", "high"]},
                        }
                    ),
                },
            }
        ),
        {
            "owner": "Sam",
            "items": [
                {"task": "Buy milk", "done": False, "priority": "low"},
                {"task": "File taxes", "done": True, "priority": "high"},
            ],
        },
    ),
    (
        "bank transaction",
        _obj(
            {
                "transaction_id": {"type": "string", "format": "uuid"},
                "account": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{8,20}$"},
                "direction": {"type": "string", "enum": ["credit", "debit"]},
                "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000000},
                "note": {"type": ["string", "null"], "maxLength": 80},
            }
        ),
        {
            "transaction_id": "123e4567-e89b-12d3-a456-426614174000",
            "account": "DE89370400440532013000",
            "direction": "debit",
            "amount": 42.0,
            "note": None,
        },
    ),
    (
        "survey response",
        _obj(
            {
                "respondent_age": {"type": "integer", "minimum": 18, "maximum": 120},
                "scores": {
                    "type": "array",
                    "minItems": 3,
                    "maxItems": 3,
                    "items": {"type": "integer", "minimum": 1, "maximum": 5},
                },
                "would_return": {"type": "boolean"},
                "comment": _NULLABLE_STR,
            },
            required=["scores", "would_return"],
        ),
        {"respondent_age": 34, "scores": [4, 5, 3], "would_return": True, "comment": "Friendly staff."},
    ),
    (
        "drawing",
        _obj(
            {
                "canvas": _obj(
                    {
                        "width": {"type": "integer", "minimum": 1, "maximum": 4096},
                        "height": {"type": "integer", "minimum": 1, "maximum": 4096},
                    }
                ),
                "shapes": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "anyOf": [
                            _obj(
                                {
                                    "kind": {"const": "circle"},
                                    "radius": {"type": "number", "exclusiveMinimum": 0},
                                }
                            ),
                            _obj(
                                {
                                    "kind": {"const": "rectangle"},
                                    "width": {"type": "number", "exclusiveMinimum": 0},
                                    "height": {"type": "number", "exclusiveMinimum": 0},
                                }
                            ),
                        ]
                    },
                },
            }
        ),
        {
            "canvas": {"width": 640, "height": 480},
            "shapes": [{"kind": "circle", "radius": 10}, {"kind": "rectangle", "width": 20, "height": 5.5}],
        },
    ),
    (
        "employee record",
        {
            "$defs": {"person_ref": _obj({"id": {"type": "integer", "minimum": 1}, "name": _NAME})},
            **_obj(
                {
                    "employee": {"$ref": "#/$defs/person_ref"},
                    "department": {"type": "string", "enum": ["engineering", "sales", "support", "finance"]},
                    "manager": {"anyOf": [{"$ref": "#/$defs/person_ref"}, {"type": "null"}]},
                    "start_date": {"type": "string", "format": "date"},
                    "remote": {"type": "boolean"},
                }
            ),
        },
        {
            "employee": {"id": 7, "name": "Katherine Johnson"},
            "department": "engineering",
            "manager": {"id": 2, "name": "Dorothy Vaughan"},
            "start_date": "2021-09-01",
            "remote": False,
        },
    ),
    (
        "api request",
        _obj(
            {
                "method": {"type": "string", "enum": ["GET", "POST", "PUT", "DELETE"]},
                "path": {"type": "string", "pattern": "^/[a-z0-9/_-]{0,40}$"},
                "request_id": {
                    "oneOf": [{"type": "integer", "minimum": 0}, {"type": "string", "maxLength": 16}]
                },
                "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 60},
                "retry": {"type": "boolean"},
            },
            required=["method", "path", "request_id"],
        ),
        {"method": "POST", "path": "/v1/orders", "request_id": "req-77", "timeout_s": 2.5, "retry": True},
    ),
]

PROMPTS: list[str] = [
    "Write a JSON object describing a {name}.",
    "Generate an example {name} as JSON. Reply with the JSON only.",
    "Invent realistic data for a {name} and return it as a single JSON object.",
]
