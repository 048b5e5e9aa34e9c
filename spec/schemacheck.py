"""A fast checker for the subset of JSON Schema that ``spec/schemas/`` uses.

``jsonschema`` takes about 10 ms per decision-log record (it builds an error
tree and a new validator per nested value), so a log of 10,000 steps took
a minute to load.  This module compiles a schema once into nested closures
that check a value and stop at the first problem, in the order ``jsonschema``
reports them (the object's own keywords before its properties), with the
same messages.  The schemas stay the single source of truth: the test suite
checks that this checker and ``jsonschema`` accept and refuse the same lines.

Supported keywords (everything the shipped schemas use): ``type``, ``enum``,
``const``, ``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``,
``minLength``, ``maxLength``, ``pattern``, ``items``, ``prefixItems``,
``minItems``, ``maxItems``, ``properties``, ``required``,
``additionalProperties``, ``propertyNames``, ``dependentRequired``, ``oneOf``,
``anyOf`` (of ``required`` alternatives) and the annotations (``title``,
``description``, ``$schema``, ``$id``).  An integer is an ``int`` that is not a
``bool`` (``10.0`` is not an integer here, unlike in JSON Schema).
"""
from __future__ import annotations

import re
from typing import Any, Callable

Check = Callable[[Any, tuple], None]

ANNOTATIONS = {"title", "description", "$schema", "$id"}


class SchemaError(Exception):
    """The first problem: the path to the value, the keyword that failed, jsonschema's message."""

    def __init__(self, path: tuple, validator: str, message: str, instance: Any = None, validator_value: Any = None):
        super().__init__(message)
        self.absolute_path, self.validator, self.message = path, validator, message
        self.instance, self.validator_value = instance, validator_value


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        return type(value) is int
    if name == "number":
        return type(value) in (int, float)
    if name == "string":
        return isinstance(value, str)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "null":
        return value is None
    raise ValueError(f"unsupported type {name!r}")


def _plural(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names) + (" was" if len(names) == 1 else " were") + " unexpected"


def compile_schema(schema: dict) -> Check:
    """A function ``check(value, path)`` raising :class:`SchemaError` on the first problem."""
    unknown = set(schema) - ANNOTATIONS - {
        "type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
        "pattern", "items", "prefixItems", "minItems", "maxItems", "properties", "required", "additionalProperties",
        "propertyNames", "dependentRequired", "oneOf", "anyOf"}
    if unknown:
        raise ValueError(f"schema keyword(s) not supported by spec.schemacheck: {sorted(unknown)}")
    leaf = _leaf(schema)
    if leaf is not None:
        return leaf
    checks: list[Check] = []
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        exact = {"integer": (int,), "number": (int, float), "string": (str,), "boolean": (bool,), "object": (dict,),
                 "array": (list,), "null": (type(None),)}
        allowed = frozenset(t for k in kinds for t in exact[k])  # exact types: a bool is no integer

        def check_type(v, p):
            if type(v) not in allowed:
                raise SchemaError(p, "type", f"{v!r} is not of type {', '.join(repr(k) for k in kinds)}", v, kind)

        checks.append(check_type)
    if "const" in schema:
        const = schema["const"]

        def check_const(v, p):
            if v != const or type(v) is not type(const):
                raise SchemaError(p, "const", f"{const!r} was expected", v, const)

        checks.append(check_const)
    if "enum" in schema:
        enum = schema["enum"]

        def check_enum(v, p):
            if not any(v == e and type(v) is type(e) for e in enum):
                raise SchemaError(p, "enum", f"{v!r} is not one of {enum!r}", v, enum)

        checks.append(check_enum)
    checks += _number_checks(schema) + _string_checks(schema) + _array_checks(schema) + _object_checks(schema)

    if len(checks) == 1:
        return checks[0]

    def check(value, path=()):
        for c in checks:
            c(value, path)

    return check


def _leaf(schema: dict) -> Check | None:
    """One closure for the schemas that are most of a log line: an integer with a minimum,
    an id string (length and pattern).  Same checks and messages as the general path."""
    keys = set(schema) - ANNOTATIONS
    if schema.get("type") == "integer" and keys <= {"type", "minimum"}:
        lo = schema.get("minimum")

        def integer(v, p):
            if type(v) is not int:
                raise SchemaError(p, "type", f"{v!r} is not of type 'integer'", v, "integer")
            if lo is not None and v < lo:
                raise SchemaError(p, "minimum", f"{v!r} is less than the minimum of {lo!r}", v, lo)

        return integer
    if schema.get("type") == "string" and keys <= {"type", "minLength", "maxLength", "pattern"}:
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        regex = re.compile(schema["pattern"]) if "pattern" in schema else None

        def string(v, p):
            if type(v) is not str:
                raise SchemaError(p, "type", f"{v!r} is not of type 'string'", v, "string")
            if len(v) < lo:
                raise SchemaError(p, "minLength", f"{v!r} should be non-empty" if lo == 1 else f"{v!r} is too short", v, lo)
            if hi is not None and len(v) > hi:
                raise SchemaError(p, "maxLength", f"{v!r} is too long", v, hi)
            if regex is not None and not regex.search(v):
                raise SchemaError(p, "pattern", f"{v!r} does not match {schema['pattern']!r}", v, schema["pattern"])

        return string
    return None


def _number_checks(schema: dict) -> list[Check]:
    out: list[Check] = []
    for key, fails, words in (("minimum", lambda v, m: v < m, "is less than the minimum of"),
                              ("maximum", lambda v, m: v > m, "is greater than the maximum of"),
                              ("exclusiveMinimum", lambda v, m: v <= m, "is less than or equal to the minimum of"),
                              ("exclusiveMaximum", lambda v, m: v >= m, "is greater than or equal to the maximum of")):
        if key in schema:
            bound = schema[key]

            def check(v, p, key=key, fails=fails, words=words, bound=bound):
                if type(v) in (int, float) and fails(v, bound):
                    raise SchemaError(p, key, f"{v!r} {words} {bound!r}", v, bound)

            out.append(check)
    return out


def _size_check(schema: dict, kind: type, min_key: str, max_key: str) -> list[Check]:
    """``minLength``/``maxLength`` (strings) or ``minItems``/``maxItems`` (arrays)."""
    lo, hi = schema.get(min_key), schema.get(max_key)
    if lo is None and hi is None:
        return []

    def check_size(v, p):
        if isinstance(v, kind):
            if lo is not None and len(v) < lo:
                raise SchemaError(p, min_key, f"{v!r} should be non-empty" if lo == 1 else f"{v!r} is too short", v, lo)
            if hi is not None and len(v) > hi:
                raise SchemaError(p, max_key, f"{v!r} is too long", v, hi)

    return [check_size]


def _string_checks(schema: dict) -> list[Check]:
    out = _size_check(schema, str, "minLength", "maxLength")
    pattern = schema.get("pattern")
    if pattern is not None:
        regex = re.compile(pattern)

        def check_pattern(v, p):
            if isinstance(v, str) and not regex.search(v):
                raise SchemaError(p, "pattern", f"{v!r} does not match {pattern!r}", v, pattern)

        out.append(check_pattern)
    return out


def _array_checks(schema: dict) -> list[Check]:
    out = _size_check(schema, list, "minItems", "maxItems")
    prefix = [compile_schema(s) for s in schema.get("prefixItems", [])]
    items = compile_schema(schema["items"]) if isinstance(schema.get("items"), dict) else None
    if prefix or items:
        def check_items(v, p):
            if isinstance(v, list):
                for i, item in enumerate(v):
                    if i < len(prefix):
                        prefix[i](item, p + (i,))
                    elif items is not None:
                        items(item, p + (i,))

        out.append(check_items)
    return out


OBJECT_KEYWORDS = ("required", "properties", "additionalProperties", "propertyNames", "dependentRequired", "oneOf", "anyOf")


def _object_checks(schema: dict) -> list[Check]:
    out: list[Check] = []
    if not any(k in schema for k in OBJECT_KEYWORDS):
        return out
    required = schema.get("required", [])
    props = {k: compile_schema(s) for k, s in schema.get("properties", {}).items()}
    extra = schema.get("additionalProperties", True)
    extra_check = compile_schema(extra) if isinstance(extra, dict) else None
    names = compile_schema(schema["propertyNames"]) if "propertyNames" in schema else None
    depends = schema.get("dependentRequired", {})
    one_of = [s.get("required", []) for s in schema.get("oneOf", [])]
    any_of = [s.get("required", []) for s in schema.get("anyOf", [])]
    for alternatives in (schema.get("oneOf", []), schema.get("anyOf", [])):
        if any(set(s) - {"required"} for s in alternatives):
            raise ValueError("spec.schemacheck supports oneOf / anyOf of required alternatives only")

    def check_object(v, p):
        if not isinstance(v, dict):
            return
        for name in required:
            if name not in v:
                raise SchemaError(p, "required", f"{name!r} is a required property", v, required)
        if extra is False:
            unexpected = [k for k in v if k not in props]
            if unexpected:
                raise SchemaError(p, "additionalProperties", f"Additional properties are not allowed ({_plural(unexpected)})", v, False)
        if one_of and sum(all(k in v for k in alt) for alt in one_of) != 1:
            raise SchemaError(p, "oneOf", f"{v!r} is not valid under exactly one of the given schemas", v, one_of)
        if any_of and not any(all(k in v for k in alt) for alt in any_of):
            raise SchemaError(p, "anyOf", f"{v!r} is not valid under any of the given schemas", v, any_of)
        for name, needs in depends.items():
            if name in v:
                for dep in needs:
                    if dep not in v:
                        raise SchemaError(p, "dependentRequired", f"{dep!r} is a dependency of {name!r}", v, needs)
        if names is not None:
            for k in v:
                try:
                    names(k, p)
                except SchemaError as e:
                    raise SchemaError(p, "propertyNames", e.message, k, e.validator_value) from None
        for k, item in v.items():
            c = props.get(k, extra_check)
            if c is not None:
                c(item, p + (k,))

    out.append(check_object)
    return out
