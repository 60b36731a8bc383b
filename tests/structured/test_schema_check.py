"""fornax.engine.structured.schema_check against xgrammar itself.

* Every keyword check_schema allows is shown enforced: xgrammar compiles a schema using it, accepts
  valid instances and rejects violating ones token by token (a future xgrammar that stops enforcing
  one fails here).
* Every keyword or shape it refuses raises UnsupportedSchemaError naming the keyword.
* Tripwire: for the refusals that exist because xgrammar compiles a keyword and then ignores it,
  xgrammar still accepts a violating instance. When one of these fails, xgrammar has started
  enforcing that keyword and check_schema may allow it (add it to the enforced cases).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from fornax.engine.structured.schema_check import UnsupportedSchemaError, check_schema
from tests.structured.engines import xgrammar_accepts

J = json.dumps
INTEGER: dict[str, Any] = {"type": "integer"}
S: dict[str, Any] = {"type": "string"}


def obj(props: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, **kw}


def texts(*values: Any) -> list[str]:
    return [J(v) for v in values]


# (id, schema, instances that satisfy it, instances that violate the keyword under test)
ENFORCED: list[tuple[str, Any, list[str], list[str]]] = [
    ("type-integer", INTEGER, texts(5, -3), texts("x", 1.5, True, None)),
    ("type-number", {"type": "number"}, texts(1.5, 2), texts("1", None)),
    ("type-string", S, texts("a"), texts(1, None)),
    ("type-boolean", {"type": "boolean"}, texts(True, False), texts(0, "true")),
    ("type-null", {"type": "null"}, texts(None), texts(0, "")),
    ("type-array", {"type": "array"}, texts([], [1, "x"]), texts({}, "[]")),
    ("type-object", {"type": "object"}, texts({}, {"a": 1}), texts([], "{}")),
    ("type-list", {"type": ["string", "null"]}, texts("a", None), texts(5, [])),
    ("true-schema", True, texts(1, "x", {"a": [1]}), []),
    ("empty-schema", {}, texts(1, "x", None), []),
    ("properties", obj({"a": INTEGER}), texts({"a": 1}), texts({"a": "x"})),
    (
        "required",
        obj({"a": INTEGER, "b": INTEGER}, required=["a"]),
        texts({"a": 1}, {"a": 1, "b": 2}),
        texts({"b": 1}, {}),
    ),
    (
        "additionalProperties-false",
        obj({"a": INTEGER}, additionalProperties=False),
        texts({"a": 1}),
        texts({"a": 1, "z": 2}),
    ),
    (
        "additionalProperties-schema",
        {"type": "object", "additionalProperties": INTEGER},
        texts({"x": 1}),
        texts({"x": "s"}),
    ),
    (
        "additionalProperties-true",
        obj({"a": INTEGER}, additionalProperties=True),
        texts({"a": 1, "z": "s"}),
        texts({"a": "x"}),
    ),
    ("items", {"type": "array", "items": INTEGER}, texts([], [1, 2]), texts([1, "x"])),
    ("items-false", {"type": "array", "prefixItems": [INTEGER], "items": False}, texts([1]), texts([1, 2])),
    ("prefixItems", {"type": "array", "prefixItems": [INTEGER, S]}, texts([1, "x"]), texts(["x", 1], [1, 2])),
    (
        "prefixItems+items",
        {"type": "array", "prefixItems": [S], "items": INTEGER},
        texts(["a", 1, 2]),
        texts(["a", "b"]),
    ),
    (
        "minItems",
        {"type": "array", "items": INTEGER, "minItems": 2},
        texts([1, 2], [1, 2, 3]),
        texts([1], []),
    ),
    ("maxItems", {"type": "array", "items": INTEGER, "maxItems": 2}, texts([], [1, 2]), texts([1, 2, 3])),
    (
        "unevaluatedItems",
        {"type": "array", "prefixItems": [S], "unevaluatedItems": INTEGER},
        texts(["a", 1]),
        texts(["a", "b"]),
    ),
    (
        "unevaluatedItems-false",
        {"type": "array", "prefixItems": [INTEGER], "unevaluatedItems": False},
        texts([1]),
        texts([1, 2]),
    ),
    ("enum", {"enum": ["red", "green", 3, None]}, texts("red", 3, None), texts("blue", 4, "3")),
    ("enum+type", {"type": "string", "enum": ["a", "b"]}, texts("a"), texts("c", 1)),
    ("const", {"const": "x"}, texts("x"), texts("y", 1)),
    ("const+type", {"type": "integer", "const": 3}, texts(3), texts(4)),
    ("anyOf", {"anyOf": [INTEGER, {"type": "boolean"}]}, texts(1, True), texts("x", None)),
    (
        "anyOf+annotations",
        {"anyOf": [INTEGER, {"type": "null"}], "title": "t", "default": None},
        texts(1, None),
        texts("x"),
    ),
    (
        "oneOf-types",
        {"oneOf": [S, {"type": "integer", "minimum": 0}, {"type": "null"}]},
        texts("s", 1, None),
        texts(1.5, True, -1),
    ),
    (
        "oneOf-const-discriminator",
        {
            "oneOf": [
                obj({"kind": {"const": "a"}, "x": INTEGER}, required=["kind", "x"]),
                obj({"kind": {"type": "string", "enum": ["b", "c"]}, "y": S}, required=["kind", "y"]),
            ]
        },
        texts({"kind": "a", "x": 1}, {"kind": "c", "y": "s"}),
        texts({"kind": "a", "y": "s"}, {"kind": "d", "x": 1}),
    ),
    (
        "oneOf-$ref-discriminator",
        {
            "$defs": {
                "cat": obj(
                    {"kind": {"type": "string", "const": "cat"}, "lives": INTEGER}, required=["kind", "lives"]
                ),
                "dog": obj(
                    {"kind": {"type": "string", "const": "dog"}, "good": {"type": "boolean"}},
                    required=["kind", "good"],
                ),
            },
            "oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}],
            "discriminator": {"propertyName": "kind"},
        },
        texts({"kind": "cat", "lives": 9}, {"kind": "dog", "good": True}),
        texts({"kind": "cat", "good": True}),
    ),
    (
        "allOf-single",
        {"allOf": [{"type": "integer", "minimum": 5}], "description": "d"},
        texts(5, 6),
        texts(4),
    ),
    (
        "$ref-$defs",
        {"$defs": {"n": INTEGER}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}},
        texts({"a": 1}),
        texts({"a": "x"}),
    ),
    (
        "$ref-definitions",
        {"definitions": {"n": INTEGER}, "type": "object", "properties": {"a": {"$ref": "#/definitions/n"}}},
        texts({"a": 1}),
        texts({"a": "x"}),
    ),
    (
        "$ref-escaped",
        {"$defs": {"a/b": INTEGER}, "type": "object", "properties": {"a": {"$ref": "#/$defs/a~1b"}}},
        texts({"a": 1}),
        texts({"a": "x"}),
    ),
    (
        "$ref-to-properties",
        obj({"a": INTEGER, "b": {"$ref": "#/properties/a"}}),
        texts({"a": 1, "b": 2}),
        texts({"b": "x"}),
    ),
    (
        "$ref-root+$defs",
        {"$defs": {"s": {"type": "string", "maxLength": 2}}, "$ref": "#/$defs/s"},
        texts("ab"),
        texts("abc", 1),
    ),
    (
        "$ref-recursive",
        {
            "$defs": {
                "node": obj(
                    {"v": INTEGER, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                    required=["v", "next"],
                )
            },
            "$ref": "#/$defs/node",
        },
        texts({"v": 1, "next": {"v": 2, "next": None}}),
        texts({"v": 1, "next": {"v": "x", "next": None}}),
    ),
    (
        "pattern",
        {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        texts("ABC-1234"),
        texts("abc-1234", "ABC-123"),
    ),
    ("pattern-alternatives", {"type": "string", "pattern": "^a$|^b$"}, texts("a", "b"), texts("ab", "c")),
    (
        "pattern-classes",
        {"type": "string", "pattern": "^\\d+\\w\\s[^a]\\.[\\-+]$"},
        texts("12a b.-"),
        texts("12a a.-", "a"),
    ),
    ("minLength", {"type": "string", "minLength": 3}, texts("abc"), texts("ab", "")),
    ("maxLength", {"type": "string", "maxLength": 3}, texts("abc", ""), texts("abcd")),
    ("length-with-null", {"type": ["string", "null"], "minLength": 2}, texts("ab", None), texts("a")),
    ("minimum-integer", {"type": "integer", "minimum": 5}, texts(5, 6), texts(4, -1)),
    ("maximum-integer", {"type": "integer", "maximum": 5}, texts(5, -3), texts(6, 100)),
    ("exclusiveMinimum-integer", {"type": "integer", "exclusiveMinimum": 5}, texts(6), texts(5)),
    ("exclusiveMaximum-integer", {"type": "integer", "exclusiveMaximum": 5}, texts(4), texts(5)),
    ("minimum-number", {"type": "number", "minimum": 1.5}, texts(1.5, 2), texts(1.4, 1)),
    ("maximum-number", {"type": "number", "maximum": 1.5}, texts(1.5, 1), texts(1.6, 2)),
    (
        "exclusiveMinimum-number",
        {"type": "number", "exclusiveMinimum": 0},
        texts(0.5, 1),
        texts(0, 0.0, -0.1),
    ),
    ("exclusiveMaximum-number", {"type": "number", "exclusiveMaximum": 1}, texts(0.5), texts(1, 1.0, 2)),
    ("range-with-null", {"type": ["integer", "null"], "minimum": 3}, texts(3, None), texts(2)),
    (
        "multipleOf",
        {"type": "integer", "multipleOf": 5, "minimum": 3, "maximum": 30},
        texts(5, 30),
        texts(4, 7),
    ),
    (
        "minProperties",
        {"type": "object", "additionalProperties": INTEGER, "minProperties": 2},
        texts({"a": 1, "b": 2}),
        texts({"a": 1}),
    ),
    (
        "maxProperties",
        obj({"a": INTEGER, "b": INTEGER}, maxProperties=1),
        texts({"a": 1}),
        texts({"a": 1, "b": 2}),
    ),
    (
        "patternProperties",
        {"type": "object", "patternProperties": {"^x_[a-z]+$": INTEGER}},
        texts({"x_a": 1}),
        texts({"x_a": "s"}, {"y": 1}),
    ),
    (
        "propertyNames-pattern",
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": INTEGER},
        texts({"ab": 1}),
        texts({"AB": 1}),
    ),
    (
        "propertyNames-length",
        {
            "type": "object",
            "propertyNames": {"type": "string", "maxLength": 2},
            "additionalProperties": INTEGER,
        },
        texts({"ab": 1}),
        texts({"abc": 1}),
    ),
    (
        "propertyNames-enum",
        {"type": "object", "propertyNames": {"enum": ["a", "b"]}, "additionalProperties": INTEGER},
        texts({"a": 1}),
        texts({"c": 1}),
    ),
    (
        "unevaluatedProperties",
        obj({"a": INTEGER}, unevaluatedProperties=False),
        texts({"a": 1}),
        texts({"a": 1, "z": 2}),
    ),
    (
        "unevaluatedProperties-schema",
        obj({"a": INTEGER}, unevaluatedProperties=INTEGER),
        texts({"a": 1, "z": 2}),
        texts({"a": 1, "z": "s"}),
    ),
    (
        "annotations",
        {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "https://example.com/s",
            "title": "T",
            "description": "d",
            "default": 1,
            "examples": [1],
            "$comment": "c",
            "deprecated": False,
            "readOnly": True,
            "writeOnly": False,
            "type": "integer",
        },
        texts(1),
        texts("x"),
    ),
]

FORMATS: dict[str, tuple[list[str], list[str]]] = {
    "date": (["2024-02-29"], ["2024-1-1", "24-01-01", "2024-01-32", "2024-00-10", "nope"]),
    "time": (["23:59:59+01:00", "12:30:00Z"], ["24:00:00Z", "12:30", "12:60:00Z"]),
    "date-time": (
        ["2024-01-31T12:30:00.5+02:00"],
        ["2024-01-31 12:30:00Z", "2024-01-31T25:00:00Z", "2024-01-31"],
    ),
    "duration": (["P1Y2M3DT4H5M6S", "PT1H"], ["P", "PT", "1Y"]),
    "email": (["john.doe@example.org"], ["john@", "@x.com", "a b@c.d"]),
    "hostname": (["a.example.com"], ["a..b", "a_b.com", "-a.com"]),
    "ipv4": (["192.168.1.255"], ["256.1.1.1", "1.2.3", "1.2.3.4.5"]),
    "ipv6": (["2001:db8::1", "::1"], ["2001:db8:::1", "12345::", "g::1"]),
    "uri": (["https://example.com/a?b=c#d"], ["/relative", "http://exa mple.com"]),
    "uri-reference": (["../a/b?c", "/a/b"], ["a b", "http://x/<>"]),
    "uri-template": (["http://x/{id}"], ["http://x/{id", "{}"]),
    "uuid": (["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000", "xyz"]),
    "json-pointer": (["", "/a~1b/0"], ["a/b", "/a~2"]),
    "relative-json-pointer": (["1/a", "0#"], ["/a", "-1/a"]),
}
for _fmt, (_ok, _bad) in FORMATS.items():
    ENFORCED.append((f"format-{_fmt}", {"type": "string", "format": _fmt}, texts(*_ok), texts(*_bad)))

# (id, schema, the keyword check_schema must name)
REFUSED: list[tuple[str, Any, str]] = [
    ("uniqueItems", {"type": "array", "items": INTEGER, "uniqueItems": True}, "uniqueItems"),
    ("contains", {"type": "array", "contains": S}, "contains"),
    ("minContains", {"type": "array", "minContains": 2}, "minContains"),
    ("maxContains", {"type": "array", "maxContains": 1}, "maxContains"),
    ("not", {"type": "integer", "not": {"const": 3}}, "not"),
    ("if", {"type": "integer", "if": {"type": "integer", "minimum": 10}}, "if"),
    ("then", {"type": "integer", "then": {"type": "integer"}}, "then"),
    ("else", {"type": "integer", "else": {"type": "integer"}}, "else"),
    (
        "dependentRequired",
        obj({"a": INTEGER, "b": INTEGER}, dependentRequired={"a": ["b"]}),
        "dependentRequired",
    ),
    (
        "dependentSchemas",
        obj({"a": INTEGER, "b": INTEGER}, dependentSchemas={"a": {"required": ["b"]}}),
        "dependentSchemas",
    ),
    ("dependencies", obj({"a": INTEGER, "b": INTEGER}, dependencies={"a": ["b"]}), "dependencies"),
    ("additionalItems", {"type": "array", "additionalItems": False}, "additionalItems"),
    ("items-list", {"type": "array", "items": [INTEGER, S]}, "items"),
    ("contentEncoding", {"type": "string", "contentEncoding": "base64"}, "contentEncoding"),
    ("contentMediaType", {"type": "string", "contentMediaType": "application/json"}, "contentMediaType"),
    ("contentSchema", {"type": "string", "contentSchema": INTEGER}, "contentSchema"),
    ("$anchor", {"$defs": {"n": {"$anchor": "num", "type": "integer"}}, "type": "integer"}, "$anchor"),
    ("$dynamicRef", {"$dynamicRef": "#x"}, "$dynamicRef"),
    ("typo", {"type": "integer", "minimun": 5}, "minimun"),
    ("nullable", {"type": "string", "nullable": True}, "nullable"),
    ("x-extension", {"type": "string", "x-guidance": {"lenient": True}}, "x-guidance"),
    ("allOf-two", {"allOf": [INTEGER, {"type": "integer", "minimum": 5}]}, "allOf"),
    ("allOf+sibling", {"type": "integer", "allOf": [{"type": "integer", "minimum": 5}]}, "type"),
    ("oneOf-overlap-types", {"oneOf": [INTEGER, {"type": "number"}]}, "oneOf"),
    ("oneOf-overlap-objects", {"oneOf": [obj({"a": INTEGER}), obj({"b": INTEGER})]}, "oneOf"),
    (
        "oneOf-discriminator-not-objects",
        {
            "oneOf": [
                {"type": ["object", "string"], "properties": {"k": {"const": "a"}}, "required": ["k"]},
                {"type": ["object", "string"], "properties": {"k": {"const": "b"}}, "required": ["k"]},
            ]
        },
        "oneOf",
    ),
    ("oneOf-untyped-branch", {"oneOf": [S, {}]}, "oneOf"),
    ("anyOf+type", {"type": "string", "anyOf": [{"type": "string", "minLength": 3}]}, "type"),
    ("anyOf+minLength", {"anyOf": [S], "minLength": 3}, "minLength"),
    ("$ref+maxLength", {"$defs": {"s": S}, "$ref": "#/$defs/s", "maxLength": 2}, "maxLength"),
    ("$ref-remote", obj({"a": {"$ref": "https://example.com/x.json"}}), "$ref"),
    ("$ref-anchor", obj({"a": {"$ref": "#num"}}), "$ref"),
    ("$ref-missing", obj({"a": {"$ref": "#/$defs/nope"}}), "$ref"),
    ("$ref-not-a-schema", {"examples": [{"type": "integer"}], "$ref": "#/examples/0"}, "$ref"),
    ("enum+minLength", {"type": "string", "enum": ["a", "bb"], "minLength": 2}, "minLength"),
    ("const+enum", {"const": "a", "enum": ["a", "b"]}, "const"),
    ("enum-type-mismatch", {"type": "string", "enum": ["a", 1]}, "enum"),
    ("const-type-mismatch", {"type": "integer", "const": "1"}, "const"),
    ("enum-empty", {"enum": []}, "enum"),
    ("minLength-untyped", {"minLength": 3}, "minLength"),
    ("pattern-untyped", {"pattern": "^a$"}, "pattern"),
    ("format-untyped", {"format": "date"}, "format"),
    ("minimum-untyped", {"minimum": 5}, "minimum"),
    ("exclusiveMaximum-untyped", {"exclusiveMaximum": 5}, "exclusiveMaximum"),
    ("maxItems-untyped", {"maxItems": 1}, "maxItems"),
    ("items-untyped", {"items": INTEGER}, "items"),
    ("properties-untyped", {"properties": {"a": INTEGER}}, "properties"),
    ("minProperties-untyped", {"minProperties": 1}, "minProperties"),
    ("patternProperties-untyped", {"patternProperties": {"^a$": INTEGER}}, "patternProperties"),
    ("propertyNames-untyped", {"propertyNames": {"maxLength": 1}}, "propertyNames"),
    ("keyword-for-other-type", {"type": "string", "minimum": 1}, "minimum"),
    ("multipleOf-number", {"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ("multipleOf-fraction", {"type": "integer", "multipleOf": 1.5}, "multipleOf"),
    ("multipleOf-untyped", {"multipleOf": 3}, "multipleOf"),
    ("required-undeclared", obj({"a": INTEGER}, required=["b"]), "required"),
    ("required-undeclared-open", obj({"a": INTEGER}, required=["b"], additionalProperties=True), "required"),
    (
        "propertyNames+properties",
        {"type": "object", "properties": {"abc": INTEGER}, "propertyNames": {"maxLength": 2}},
        "propertyNames",
    ),
    ("propertyNames-anyOf", {"type": "object", "propertyNames": {"anyOf": [S]}}, "anyOf"),
    ("format-idn-email", {"type": "string", "format": "idn-email"}, "format"),
    ("format-idn-hostname", {"type": "string", "format": "idn-hostname"}, "format"),
    ("format-iri", {"type": "string", "format": "iri"}, "format"),
    ("format-iri-reference", {"type": "string", "format": "iri-reference"}, "format"),
    ("format-regex", {"type": "string", "format": "regex"}, "format"),
    ("format-byte", {"type": "string", "format": "byte"}, "format"),
    ("format-int32", {"type": "string", "format": "int32"}, "format"),
    ("format-unknown", {"type": "string", "format": "made-up"}, "format"),
    ("pattern-lookahead", {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{3}$"}, "pattern"),
    ("pattern-negative-lookahead", {"type": "string", "pattern": "^(?!b)[a-z]$"}, "pattern"),
    ("pattern-lookbehind", {"type": "string", "pattern": "a(?<=a)"}, "pattern"),
    ("pattern-mid-dollar", {"type": "string", "pattern": "a$b"}, "pattern"),
    ("pattern-mid-caret", {"type": "string", "pattern": "a^b"}, "pattern"),
    ("pattern-escape-Z", {"type": "string", "pattern": "^a\\Z"}, "pattern"),
    ("pattern-escape-A", {"type": "string", "pattern": "\\Aa$"}, "pattern"),
    ("pattern-backreference", {"type": "string", "pattern": "^(a)\\1$"}, "pattern"),
    ("pattern-word-boundary", {"type": "string", "pattern": "^a\\b"}, "pattern"),
    ("pattern-flags", {"type": "string", "pattern": "(?i)^abc$"}, "pattern"),
    (
        "patternProperties-lookahead",
        {"type": "object", "patternProperties": {"^(?!x)": INTEGER}},
        "patternProperties",
    ),
    ("nested-path", obj({"tags": {"type": "array", "items": {"type": "string", "format": "iri"}}}), "format"),
    ("$id-nested", obj({"a": {"$id": "https://example.com/a", "type": "integer"}}), "$id"),
    (
        "exclusiveMinimum-boolean",
        {"type": "integer", "minimum": 5, "exclusiveMinimum": True},
        "exclusiveMinimum",
    ),
    ("maxLength-string", {"type": "string", "maxLength": "3"}, "maxLength"),
    ("minItems-negative", {"type": "array", "minItems": -1}, "minItems"),
    ("type-unknown", {"type": "str"}, "type"),
    ("not-a-schema", obj({"a": 5}), "properties"),
    ("not-a-schema-items", {"type": "array", "items": "string"}, "items"),
    ("bad-anyOf", {"anyOf": {"type": "string"}}, "anyOf"),
]

# Refusals whose reason is that xgrammar compiles the keyword and lets a violating instance
# through: (id, schema as written, an instance violating it).
XGRAMMAR_IGNORES: list[tuple[str, Any, str]] = [
    ("uniqueItems", {"type": "array", "items": INTEGER, "uniqueItems": True}, J([1, 1])),
    ("contains", {"type": "array", "items": {"type": ["string", "integer"]}, "contains": S}, J([1, 2])),
    ("not", {"type": ["string", "integer"], "not": S}, J("x")),
    (
        "if/then/else",
        {"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}, "else": {"maximum": 5}},
        J(7),
    ),
    ("dependentRequired", obj({"a": INTEGER, "b": INTEGER}, dependentRequired={"a": ["b"]}), J({"a": 1})),
    (
        "dependentSchemas",
        obj({"a": INTEGER, "b": INTEGER}, dependentSchemas={"a": {"required": ["b"]}}),
        J({"a": 1}),
    ),
    ("dependencies", obj({"a": INTEGER, "b": INTEGER}, dependencies={"a": ["b"]}), J({"a": 1})),
    ("contentEncoding", {"type": "string", "contentEncoding": "base64"}, J("!!!")),
    (
        "$anchor",
        {
            "$defs": {"n": {"$anchor": "num", "type": "integer"}},
            "type": "object",
            "properties": {"a": {"$ref": "#num"}},
        },
        J({"a": "x"}),
    ),
    ("$ref-remote", obj({"a": {"$ref": "https://example.com/x.json"}}), J({"a": "x"})),
    ("typo", {"type": "integer", "minimun": 5}, J(3)),
    (
        "allOf-two",
        {"allOf": [obj({"a": INTEGER}, required=["a"]), obj({"b": INTEGER}, required=["b"])]},
        J({"a": 1}),
    ),
    ("allOf+sibling", {"type": "integer", "allOf": [{"minimum": 5}]}, J(3)),
    ("oneOf-overlap", {"oneOf": [INTEGER, {"type": "number", "minimum": 0}]}, J(2)),
    (
        "anyOf+sibling",
        {
            "type": "string",
            "minLength": 3,
            "anyOf": [{"type": "string", "pattern": "^x.*$"}, {"type": "string", "pattern": "^y.*$"}],
        },
        J("xa"),
    ),
    ("$ref+sibling", {"$defs": {"s": S}, "$ref": "#/$defs/s", "maxLength": 2}, J("abcd")),
    ("enum+type", {"type": "string", "enum": ["a", 1]}, J(1)),
    ("const+minLength", {"type": "string", "const": "ab", "minLength": 5}, J("ab")),
    ("minLength-untyped", {"minLength": 3}, J("ab")),
    ("minimum-untyped", {"minimum": 5}, J(3)),
    ("pattern-untyped", {"pattern": "^a$"}, J("b")),
    ("maxItems-untyped", {"maxItems": 1}, J([1, 2])),
    ("multipleOf-number", {"type": "number", "multipleOf": 0.5}, J(1.25)),
    ("multipleOf-fraction", {"type": "integer", "multipleOf": 1.5}, J(4)),
    ("required-undeclared", obj({"a": INTEGER}, required=["b"], additionalProperties=True), J({"a": 1})),
    (
        "propertyNames+properties",
        {"type": "object", "properties": {"abc": INTEGER}, "propertyNames": {"maxLength": 2}},
        J({"abc": 1}),
    ),
    ("format-idn-email", {"type": "string", "format": "idn-email"}, J("not an email")),
    ("format-iri", {"type": "string", "format": "iri"}, J("not a uri")),
    ("format-regex", {"type": "string", "format": "regex"}, J("(")),
    ("format-int32", {"type": "string", "format": "int32"}, J("x")),
    ("pattern-lookahead", {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{3}$"}, J("abc")),
    ("pattern-mid-caret", {"type": "string", "pattern": "a^b"}, J("ab")),
    ("pattern-escape-Z", {"type": "string", "pattern": "^a\\Z"}, J("aZ")),
]


@pytest.mark.parametrize(("case", "schema", "valid", "invalid"), ENFORCED, ids=[c[0] for c in ENFORCED])
def test_allowed_keyword_is_enforced(case, schema, valid, invalid, vocab, xgr_compiler):
    check_schema(schema)
    compiled = xgr_compiler.compile_json_schema(J(schema))
    for text in valid:
        assert xgrammar_accepts(compiled, vocab, text), f"{case}: xgrammar rejects valid {text}"
    for text in invalid:
        assert not xgrammar_accepts(compiled, vocab, text), f"{case}: xgrammar accepts violating {text}"


@pytest.mark.parametrize(("case", "schema", "keyword"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_keyword_is_named(case, schema, keyword):
    with pytest.raises(UnsupportedSchemaError) as info:
        check_schema(schema)
    assert info.value.keyword == keyword
    assert keyword in str(info.value)


@pytest.mark.parametrize(
    ("case", "schema", "violating"), XGRAMMAR_IGNORES, ids=[c[0] for c in XGRAMMAR_IGNORES]
)
def test_xgrammar_still_ignores(case, schema, violating, vocab, xgr_compiler):
    with pytest.raises(UnsupportedSchemaError):
        check_schema(schema)
    compiled = xgr_compiler.compile_json_schema(J(schema))
    assert xgrammar_accepts(compiled, vocab, violating), (
        f"xgrammar now rejects {violating} for {case}: it may enforce this keyword now; "
        "consider allowing it in schema_check"
    )


def test_error_path_names_the_location():
    schema = obj({"tags": {"type": "array", "items": {"type": "string", "format": "iri"}}})
    with pytest.raises(UnsupportedSchemaError) as info:
        check_schema(schema)
    assert info.value.path == "properties.tags.items"
    assert isinstance(info.value, ValueError)
    with pytest.raises(UnsupportedSchemaError) as info:
        check_schema(obj({"a": {"anyOf": [S, {"type": "string", "minimun": 1}]}}))
    assert (info.value.keyword, info.value.path) == ("minimun", "properties.a.anyOf.1")


def test_limits():
    deep: Any = INTEGER
    for _ in range(40):
        deep = obj({"a": deep})
    check_schema(deep, max_depth=200)
    with pytest.raises(UnsupportedSchemaError) as info:
        check_schema(deep)  # 81 levels of JSON nesting > 64
    assert info.value.keyword == "(depth)"
    wide = obj({f"p{n}": INTEGER for n in range(2000)})
    check_schema(wide)
    with pytest.raises(UnsupportedSchemaError) as info:
        check_schema(obj({f"p{n}": {"type": "string", "maxLength": 3} for n in range(5000)}))
    assert info.value.keyword == "(size)"
    deep_value = {"const": [[[[[[[[1]]]]]]]]}
    with pytest.raises(UnsupportedSchemaError):
        check_schema(deep_value, max_depth=5)
    with pytest.raises(UnsupportedSchemaError):
        check_schema({"type": "number", "minimum": float("nan")})


def test_non_schemas_refused():
    for schema in (5, "string", None, [INTEGER], {"type": "object", "properties": []}):
        with pytest.raises(UnsupportedSchemaError):
            check_schema(schema)
    check_schema(True)
    check_schema(False)
