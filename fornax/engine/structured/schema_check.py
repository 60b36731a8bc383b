"""Refuse a JSON schema that xgrammar 0.2.9 would not enforce, rather than loosen it silently.

Over 500 lines: one walk over a schema with a rule per JSON Schema keyword; split, the rules
would each need the walk's state passed in, and the evidence below maps onto this one file.

xgrammar compiles most JSON schemas, but where it cannot express a keyword it usually drops it
with a log line (or nothing) and constrains generation to a larger language than the schema
allows. fornax answers such a request with a 400 naming the keyword instead. The rules below
come from feeding xgrammar 0.2.9, token by token on the default model's vocabulary, an instance
that violates each keyword (tests/structured/test_schema_check.py keeps that evidence and fails
if a future xgrammar stops enforcing a keyword allowed here).

What xgrammar 0.2.9 ignores, and this check therefore refuses:
  * uniqueItems, contains/minContains/maxContains, not, if/then/else, dependentRequired,
    dependentSchemas, dependencies, contentEncoding/contentMediaType/contentSchema, $anchor and
    $dynamic*/$recursive* references, remote $refs ("https://..."), unknown keywords (a typo such
    as "minimun" would drop the bound), formats outside _ENFORCED_FORMATS;
  * allOf with more than one subschema (xgrammar logs "Support for allOf with multiple options
    is still ongoing" and lets instances violating a subschema through);
  * oneOf whose subschemas may overlap (it falls back to anyOf); oneOf is allowed when this
    check can prove the subschemas disjoint, where anyOf semantics are exact;
  * every sibling of anyOf/oneOf/allOf/$ref other than annotations (e.g. "type": "string"
    beside "anyOf" is dropped);
  * keywords beside "enum"/"const" (a "type" is honoured only if every value has that type);
  * type-specific keywords (minLength, pattern, format, minimum, maxItems, minProperties, ...)
    in a schema without an explicit "type" naming that type;
  * a "required" name not declared in "properties";
  * "propertyNames" beside "properties" or "patternProperties";
  * "multipleOf" unless the type is integer (not number) and the value an integer;
  * regex features in "pattern"/"patternProperties": lookahead, "^"/"$" anchors anywhere but the
    ends of a top-level alternative, and escapes it takes literally (\\Z, \\A, \\G, \\K, \\Q, ...).

xgrammar is stricter than JSON Schema in some places, which this check allows (it can only make
generation narrower, never violate the schema): without "additionalProperties" an object gets no
undeclared keys; "pattern" must match the whole string; "enum"/"const" objects and arrays must be
written compactly; JSON string escapes ("\\u0061") do not count as the character they stand for.
Schemas that xgrammar cannot compile at all (lookbehind, "\\p{L}", "(?i)", boolean
exclusiveMinimum, float bounds on an integer, a `false` property schema, circular $refs, ...)
raise there, which is not silent either: the caller must turn that error into a 400 as well.

For comparison, llguidance 1.9.1 (same probes): it raises at grammar construction for what it
does not implement (uniqueItems, contains, not, if/then/else, dependent*, propertyNames,
unevaluated*, overlapping oneOf, remote $ref, lookarounds, formats it does not know, and
min/maxProperties unless every listed property is required) and follows JSON Schema where
xgrammar drops keywords (untyped keywords, required-but-undeclared names, allOf, siblings of
anyOf/$ref, enum beside type, multipleOf on numbers). Like xgrammar it silently ignores unknown
keywords (typos) and contentEncoding/contentMediaType/contentSchema.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any, NoReturn

__all__ = ["UnsupportedSchemaError", "check_schema"]


class UnsupportedSchemaError(ValueError):
    """A schema keyword (or shape) the structured-output engine would not enforce."""

    def __init__(self, keyword: str, path: str, message: str) -> None:
        where = f"at '{path}'" if path else "at the schema root"
        super().__init__(f"{message} (keyword '{keyword}' {where})")
        self.keyword = keyword
        self.path = path
        self.message = message


# ---- what is allowed, and why -------------------------------------------------------------------

# Annotations: they assert nothing about an instance, so neither engine has anything to enforce.
# "discriminator" is OpenAPI's hint on a oneOf (pydantic emits it); the oneOf itself is checked.
# "$id" is allowed at the root only: in a subschema it would change what its $refs resolve to.
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$schema",
        "discriminator",
    }
)
# Containers of subschemas for $ref to point into; they assert nothing by themselves.
_DEFINITIONS = frozenset({"$defs", "definitions"})
# Enforced by xgrammar 0.2.9 whatever the type (checked by tests/structured/test_schema_check.py).
_GENERIC = frozenset({"type", "enum", "const"})
# Applicators enforced by xgrammar 0.2.9, under the restrictions in _check_applicator.
_APPLICATORS = frozenset({"anyOf", "oneOf", "allOf", "$ref"})
# Enforced by xgrammar 0.2.9 only in a schema whose "type" names the type they apply to (or, for
# string keywords, inside "propertyNames"); without one, xgrammar drops them.
_TYPED = {
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "numeric": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems", "unevaluatedItems"}),
    "object": frozenset(
        {
            "properties",
            "required",
            "additionalProperties",
            "patternProperties",
            "propertyNames",
            "minProperties",
            "maxProperties",
            "unevaluatedProperties",
        }
    ),
}
_KIND_TYPES = {
    "string": {"string"},
    "numeric": {"integer", "number"},
    "array": {"array"},
    "object": {"object"},
}
_KIND_OF = {kw: kind for kind, kws in _TYPED.items() for kw in kws}
# What a "propertyNames" schema may use: xgrammar 0.2.9 enforces these on property names, with
# or without "type": "string" (and string keywords need no "type" there).
_PROPERTY_NAME_KEYWORDS = _TYPED["string"] | {"type", "enum", "const"} | _ANNOTATIONS

# Known JSON Schema keywords that xgrammar 0.2.9 compiles but does not enforce (or mangles).
_REFUSED = {
    "uniqueItems": "uniqueItems is not enforced by the grammar engine",
    "contains": "contains is not enforced by the grammar engine",
    "minContains": "minContains is not enforced by the grammar engine",
    "maxContains": "maxContains is not enforced by the grammar engine",
    "not": "not is not enforced by the grammar engine",
    "if": "if/then/else is not enforced by the grammar engine",
    "then": "if/then/else is not enforced by the grammar engine",
    "else": "if/then/else is not enforced by the grammar engine",
    "dependentRequired": "dependentRequired is not enforced by the grammar engine",
    "dependentSchemas": "dependentSchemas is not enforced by the grammar engine",
    "dependencies": "dependencies is not enforced by the grammar engine",
    "additionalItems": "additionalItems is not supported; use prefixItems with items",
    "contentEncoding": "contentEncoding is not enforced by the grammar engine",
    "contentMediaType": "contentMediaType is not enforced by the grammar engine",
    "contentSchema": "contentSchema is not enforced by the grammar engine",
    "$anchor": "$anchor is not supported; use $ref to '#/$defs/...'",
    "$dynamicRef": "$dynamicRef is not supported",
    "$dynamicAnchor": "$dynamicAnchor is not supported",
    "$recursiveRef": "$recursiveRef is not supported",
    "$recursiveAnchor": "$recursiveAnchor is not supported",
    "$vocabulary": "$vocabulary is not supported",
    "id": "id (draft-04) is not supported",
    "nullable": 'nullable (OpenAPI) is not JSON Schema; use "type": [..., "null"]',
}

# Formats whose violations xgrammar 0.2.9 rejects; it ignores every other value (idn-email,
# idn-hostname, iri, iri-reference, regex, and OpenAPI's int32/int64/float/double/byte/binary/...).
_ENFORCED_FORMATS = frozenset(
    {
        "date",
        "time",
        "date-time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uri-reference",
        "uri-template",
        "uuid",
        "json-pointer",
        "relative-json-pointer",
    }
)

_TYPE_NAMES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})
# Regex escapes xgrammar 0.2.9 gives their ECMA-262 meaning (letters not listed are taken literally
# or refused at compile); any escaped non-alphanumeric character stands for itself.
_REGEX_ESCAPES = frozenset("dDwWsStnrfvxu")


# ---- the check ------------------------------------------------------------------------------------

Path = tuple[str, ...]


def check_schema(schema: Any, max_depth: int = 64, max_nodes: int = 10_000) -> None:
    """Raise UnsupportedSchemaError unless xgrammar 0.2.9 enforces every keyword of `schema`.

    `schema` is parsed JSON (dicts, lists, str, int, float, bool, None). `max_depth` bounds its
    nesting (every JSON container counts a level) and `max_nodes` the number of JSON values in it.
    """
    _check_size(schema, max_depth, max_nodes)
    walker = _Walker(schema)
    walker.walk(schema, (), names=False)
    walker.finish()


def _fail(keyword: str, parts: Path, message: str) -> NoReturn:
    raise UnsupportedSchemaError(keyword, ".".join(parts), message)


def _check_size(schema: Any, max_depth: int, max_nodes: int) -> None:
    nodes = 0
    stack: list[tuple[Any, int, Path]] = [(schema, 1, ())]
    while stack:
        value, depth, parts = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            _fail("(size)", (), f"schema has more than {max_nodes} JSON values")
        if depth > max_depth:
            _fail("(depth)", parts, f"schema nests deeper than {max_depth} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    _fail("(key)", parts, "object keys must be strings")
                stack.append((item, depth + 1, (*parts, key)))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, (*parts, str(n))) for n, item in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            _fail(parts[-1] if parts else "(value)", parts, "numbers must be finite")
        elif value is not None and not isinstance(value, (str, int, float, bool)):
            _fail(parts[-1] if parts else "(value)", parts, f"{type(value).__name__} is not a JSON value")


class _Walker:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.schema_paths: set[Path] = set()  # every location walked as a schema
        self.refs: list[tuple[str, Path]] = []
        self.one_ofs: list[tuple[list[Any], Path]] = []

    # -- one schema

    def walk(self, schema: Any, parts: Path, names: bool) -> None:
        """Check `schema` at `parts` and everything under it; `names`: it is a propertyNames schema."""
        self.schema_paths.add(parts)
        if isinstance(schema, bool):
            return
        if not isinstance(schema, dict):
            kind = _json_type_name(schema)
            _fail(_holder(parts), parts, f"a schema must be an object or a boolean, not {kind}")
        for key in schema:
            self._check_known(key, parts)
            if names and key not in _PROPERTY_NAME_KEYWORDS:
                _fail(
                    key,
                    parts,
                    f"'{key}' inside propertyNames is not supported; use type, enum, const and "
                    "string keywords there",
                )
        types = self._check_type(schema, parts)
        if names and types is not None and types != {"string"}:
            _fail("type", parts, "property names are strings")
        for key in schema:
            kind = _KIND_OF.get(key)
            if kind is None:
                continue
            wanted = " or ".join(sorted(_KIND_TYPES[kind]))
            if types is None and not (names and kind == "string"):
                _fail(
                    key,
                    parts,
                    f"'{key}' needs an explicit \"type\" ({wanted}) in the same schema; "
                    "the grammar engine ignores it otherwise",
                )
            if types is not None and not types & _KIND_TYPES[kind]:
                _fail(key, parts, f"'{key}' applies to {wanted} but \"type\" is {sorted(types)}")
        self._check_values(schema, types, parts)
        self._check_applicator(schema, parts)
        self._check_strings(schema, parts)
        self._check_numbers(schema, types, parts)
        self._check_arrays(schema, parts)
        self._check_objects(schema, parts)
        for sub, sub_parts, sub_names in _subschemas(schema, parts):
            self.walk(sub, sub_parts, sub_names)

    def _check_known(self, key: str, parts: Path) -> None:
        if key in _REFUSED:
            _fail(key, parts, _REFUSED[key])
        if key == "$id":
            if parts:
                _fail(key, parts, "$id is only supported at the schema root")
            return
        if not any(key in group for group in (_ANNOTATIONS, _DEFINITIONS, _GENERIC, _APPLICATORS, _KIND_OF)):
            _fail(key, parts, f"unknown schema keyword '{key}'")

    def _check_type(self, schema: dict[str, Any], parts: Path) -> set[str] | None:
        if "type" not in schema:
            return None
        declared = schema["type"]
        names = declared if isinstance(declared, list) else [declared]
        if not names or not all(isinstance(n, str) and n in _TYPE_NAMES for n in names):
            _fail("type", parts, f'"type" must be one of {sorted(_TYPE_NAMES)} or a non-empty list of them')
        return set(names)

    def _allowed_beside(self, keyword: str, parts: Path) -> frozenset[str]:
        """What may stand beside enum/const/anyOf/oneOf/allOf/$ref without being dropped."""
        return _ANNOTATIONS | _DEFINITIONS | {keyword} | ({"$id"} if not parts else set())

    def _check_values(self, schema: dict[str, Any], types: set[str] | None, parts: Path) -> None:
        keyword = "enum" if "enum" in schema else "const" if "const" in schema else None
        if keyword is None:
            return
        extra = [k for k in schema if k not in self._allowed_beside(keyword, parts) | {"type"}]
        if extra:
            _fail(
                extra[0],
                parts,
                f"'{extra[0]}' beside '{keyword}' is not enforced by the grammar engine; "
                f"list only the allowed values in '{keyword}'",
            )
        values = schema["enum"] if keyword == "enum" else [schema["const"]]
        if keyword == "enum" and (not isinstance(values, list) or not values):
            _fail("enum", parts, '"enum" must be a non-empty list')
        for value in values if types is not None else ():
            if not _value_has_type(value, types):
                _fail(
                    keyword,
                    parts,
                    f'{keyword} value {json.dumps(value)[:40]} is not of "type" '
                    f"{sorted(types)}; the grammar engine would allow it",
                )

    def _check_applicator(self, schema: dict[str, Any], parts: Path) -> None:
        keyword = next((k for k in ("anyOf", "oneOf", "allOf", "$ref") if k in schema), None)
        if keyword is None:
            return
        extra = [k for k in schema if k not in self._allowed_beside(keyword, parts)]
        if extra:
            _fail(
                extra[0],
                parts,
                f"'{extra[0]}' beside '{keyword}' is not enforced by the grammar engine; "
                "move it into the subschemas",
            )
        if keyword == "$ref":
            if _pointer(schema["$ref"]) is None:
                _fail("$ref", parts, "only local references ('#' or '#/...') are supported")
            self.refs.append((schema["$ref"], parts))
            return
        branches = schema[keyword]
        if not isinstance(branches, list) or not branches:
            _fail(keyword, parts, f'"{keyword}" must be a non-empty list of schemas')
        if keyword == "allOf" and len(branches) > 1:
            _fail("allOf", parts, "allOf with more than one subschema is not enforced by the grammar engine")
        if keyword == "oneOf":
            self.one_ofs.append((branches, parts))

    def _check_strings(self, schema: dict[str, Any], parts: Path) -> None:
        for key in ("minLength", "maxLength"):
            if key in schema:
                _need_count(schema[key], key, parts)
        if "pattern" in schema:
            _check_pattern(schema["pattern"], "pattern", parts)
        if "format" in schema and schema["format"] not in _ENFORCED_FORMATS:
            fmt = json.dumps(schema["format"])[:40]
            _fail(
                "format",
                parts,
                f"format {fmt} is not enforced by the grammar engine "
                f"(enforced: {', '.join(sorted(_ENFORCED_FORMATS))})",
            )

    def _check_numbers(self, schema: dict[str, Any], types: set[str] | None, parts: Path) -> None:
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
            if key in schema and not _is_number(schema[key]):
                _fail(key, parts, f'"{key}" must be a number')
        if "multipleOf" in schema:
            value = schema["multipleOf"]
            if types is None or "number" in types or not isinstance(value, int) or value <= 0:
                _fail(
                    "multipleOf",
                    parts,
                    'multipleOf is only enforced as a positive integer with "type": "integer"',
                )

    def _check_arrays(self, schema: dict[str, Any], parts: Path) -> None:
        for key in ("minItems", "maxItems"):
            if key in schema:
                _need_count(schema[key], key, parts)
        if isinstance(schema.get("items"), list):
            _fail("items", parts, '"items" as a list is not supported; use prefixItems')
        prefix = schema.get("prefixItems", [None])
        if not isinstance(prefix, list) or not prefix:
            _fail("prefixItems", parts, '"prefixItems" must be a non-empty list')

    def _check_objects(self, schema: dict[str, Any], parts: Path) -> None:
        for key in ("minProperties", "maxProperties"):
            if key in schema:
                _need_count(schema[key], key, parts)
        for key in ("properties", "patternProperties"):
            if key in schema and not isinstance(schema[key], dict):
                _fail(key, parts, f'"{key}" must be an object')
        for pattern in schema.get("patternProperties", {}):
            _check_pattern(pattern, "patternProperties", parts)
        if "required" in schema:
            required = schema["required"]
            if not isinstance(required, list) or not all(isinstance(n, str) for n in required):
                _fail("required", parts, '"required" must be a list of strings')
            missing = [n for n in required if n not in schema.get("properties", {})]
            if missing:
                name = json.dumps(missing[0])[:40]
                _fail(
                    "required",
                    parts,
                    f'required property {name} is not declared in "properties"; '
                    "the grammar engine would not require it",
                )
        if "propertyNames" in schema and ("properties" in schema or "patternProperties" in schema):
            _fail(
                "propertyNames",
                parts,
                "propertyNames beside properties/patternProperties is not enforced by the grammar engine",
            )

    # -- after the walk: references and oneOf

    def finish(self) -> None:
        for ref, parts in self.refs:
            target = _pointer(ref)
            if target is None or _resolve(self.root, target) is _MISSING:
                _fail("$ref", parts, f"reference {ref[:60]!r} does not resolve")
            if target not in self.schema_paths:
                _fail("$ref", parts, f"reference {ref[:60]!r} does not point at a schema")
        for branches, parts in self.one_ofs:
            for i in range(len(branches)):
                for j in range(i + 1, len(branches)):
                    if not self._disjoint(branches[i], branches[j]):
                        _fail(
                            "oneOf",
                            parts,
                            f"oneOf subschemas {i} and {j} may overlap, and the grammar "
                            "engine would then accept an instance matching both; make them "
                            "disjoint (different types, or a property both require with "
                            "different const/enum values) or use anyOf",
                        )

    def _deref(self, schema: Any, hops: int = 32) -> Any:
        while isinstance(schema, dict) and "$ref" in schema:
            target = _pointer(schema["$ref"])
            if target is None or hops == 0:
                return _MISSING
            schema, hops = _resolve(self.root, target), hops - 1
        return schema

    def _types(self, schema: Any, hops: int = 16) -> set[str] | None:
        """A superset of the JSON types an instance of `schema` can have (None: any type)."""
        schema = self._deref(schema)
        if schema is False:
            return set()
        if not isinstance(schema, dict) or hops == 0:
            return None
        if "type" in schema:
            declared = schema["type"]
            types = set(declared if isinstance(declared, list) else [declared])
        elif "const" in schema:
            types = {_json_type_name(schema["const"])}
        elif "enum" in schema:
            types = {_json_type_name(v) for v in schema["enum"]}
        elif any(k in schema for k in ("anyOf", "oneOf", "allOf")):
            types = set()
            for branch in schema.get("anyOf") or schema.get("oneOf") or schema.get("allOf"):
                branch_types = self._types(branch, hops - 1)
                if branch_types is None:
                    return None
                types |= branch_types
        else:
            return None
        if "number" in types:
            types.add("integer")  # every integer is a number
        return types

    def _values(self, schema: dict[str, Any], name: str) -> set[str] | None:
        """The values (canonical JSON) required property `name` of object schema `schema` may
        take, when const/enum limits them; else None."""
        if name not in schema.get("required", []):
            return None
        prop = self._deref(schema.get("properties", {}).get(name))
        if not isinstance(prop, dict):
            return None
        if "const" in prop:
            return {_canonical(prop["const"])}
        if "enum" in prop:
            return {_canonical(v) for v in prop["enum"]}
        return None

    def _disjoint(self, a: Any, b: Any) -> bool:
        """Whether no instance can satisfy both `a` and `b` (False when this cannot tell)."""
        types_a, types_b = self._types(a), self._types(b)
        if types_a is not None and types_b is not None and not types_a & types_b:
            return True
        # Objects only, and a property both require takes different const/enum values in each.
        da, db = self._deref(a), self._deref(b)
        if not (isinstance(da, dict) and isinstance(db, dict) and types_a == types_b == {"object"}):
            return False
        for name in set(da.get("required", [])) & set(db.get("required", [])):
            values_a, values_b = self._values(da, name), self._values(db, name)
            if values_a is not None and values_b is not None and not values_a & values_b:
                return True
        return False


# ---- helpers ----------------------------------------------------------------------------------------

_MISSING = object()
# Keywords holding their subschemas one level down, under a name or an index.
_CONTAINERS = frozenset(
    {
        "properties",
        "patternProperties",
        "$defs",
        "definitions",
        "prefixItems",
        "anyOf",
        "oneOf",
        "allOf",
    }
)


def _subschemas(schema: dict[str, Any], parts: Path) -> Iterator[tuple[Any, Path, bool]]:
    """Every subschema of `schema`: (subschema, its path, whether it describes property names)."""
    for key in ("items", "additionalProperties", "unevaluatedItems", "unevaluatedProperties"):
        if key in schema:
            yield schema[key], (*parts, key), False
    if "propertyNames" in schema:
        yield schema["propertyNames"], (*parts, "propertyNames"), True
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        for n, sub in enumerate(schema.get(key, ())):
            yield sub, (*parts, key, str(n)), False
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if key in schema:
            if not isinstance(schema[key], dict):
                _fail(key, (*parts, key), f'"{key}" must be an object')
            for name, sub in schema[key].items():
                yield sub, (*parts, key, name), False


def _holder(parts: Path) -> str:
    """The keyword a subschema at `parts` sits under ('properties' for properties.a.properties.b)."""
    if len(parts) > 1 and parts[-2] in _CONTAINERS:
        return parts[-2]
    return parts[-1] if parts else "(schema)"


def _need_count(value: Any, key: str, parts: Path) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        _fail(key, parts, f'"{key}" must be a non-negative integer')


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _value_has_type(value: Any, types: set[str]) -> bool:
    name = _json_type_name(value)
    return name in types or (name == "integer" and "number" in types)


def _canonical(value: Any) -> str:
    """JSON text equal for equal JSON values (1 and 1.0 alike, key order ignored)."""

    def norm(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v

    return json.dumps(norm(value), sort_keys=True)


def _pointer(ref: Any) -> Path | None:
    """A local $ref as path parts ('#/$defs/a~1b' -> ('$defs', 'a/b')), or None if not local."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    if ref == "#":
        return ()
    return tuple(p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/"))


def _resolve(root: Any, parts: Path) -> Any:
    node = root
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _check_pattern(pattern: Any, keyword: str, parts: Path) -> None:
    if not isinstance(pattern, str):
        _fail(keyword, parts, f'"{keyword}" must be a string regex')
    problem = regex_problem(pattern)
    if problem:
        _fail(keyword, parts, f"regex {pattern[:60]!r}: {problem}")


def regex_problem(p: str) -> str | None:
    """Why xgrammar 0.2.9 would not enforce regex `p` exactly as written, or None."""
    n, i, depth = len(p), 0, 0
    in_class = False
    alternative_start = True  # nothing consumed yet in the current top-level alternative
    while i < n:
        c = p[i]
        starts_alternative = False
        if c == "\\":
            if i + 1 >= n:
                return "ends with a lone backslash"
            e = p[i + 1]
            if e.isalnum() and e not in _REGEX_ESCAPES:
                return f"escape \\{e} is not supported by the grammar engine"
            i += 2
            alternative_start = False
            continue
        if in_class:
            in_class = c != "]"
            i += 1
            continue
        if c == "[":
            j = i + 1 + (p[i + 1 : i + 2] == "^")
            if p[j : j + 1] == "]":
                return "'[]' and '[^]' are read differently by different regex engines"
            in_class = True
            i = j
            alternative_start = False
            continue
        if c == "(":
            if p.startswith("(?", i):
                if p.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
                    return "lookaround assertions are not supported by the grammar engine"
                if not (p.startswith("(?:", i) or p.startswith("(?P<", i) or p.startswith("(?<", i)):
                    return f"group {p[i : i + 3]!r} is not supported by the grammar engine"
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|":
            starts_alternative = depth == 0
        elif c == "^" and not (depth == 0 and alternative_start):
            return "'^' is only supported at the start of the pattern or of a top-level alternative"
        elif c == "$" and not (depth == 0 and (i == n - 1 or p[i + 1] == "|")):
            return "'$' is only supported at the end of the pattern or of a top-level alternative"
        alternative_start = starts_alternative
        i += 1
    return None
