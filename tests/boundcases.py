"""Requests at and just past every declared bound of an API, derived from its OpenAPI schema (which
FastAPI builds from the pydantic models' field metadata), so a new field or a new bound is covered
without editing a list.

For each operation: one valid request (required fields at a valid value), then one request per
(field, value) with the field set to a boundary value: the minimum and maximum, just below and just
above them (the next float, a relative 1e-8, 5x and 10x the maximum), non-finite and huge numbers,
the wrong type, strings at and past their length and off their pattern, arrays at and past their
item limits, every enum value and one that is not. Nested objects are walked the same way.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Case", "operation_cases", "boundary_values", "valid_value", "NAN"]

NAN = object()  # stands for the JSON token NaN (Python's json accepts it: the server must refuse it)
_INF, _NINF = object(), object()
_TOKENS = {id(NAN): "NaN", id(_INF): "Infinity", id(_NINF): "-Infinity"}
_WRONG_TYPES: list[Any] = ["x", [], {}, True]


@dataclass
class Case:
    method: str
    path: str  # with path parameters filled in
    query: dict[str, str] = field(default_factory=dict)
    body: Any = None  # JSON value (may hold NAN / infinity markers); None = no body
    has_body: bool = False
    where: str = ""  # "body.lr", "query.before", ...
    value: Any = None

    def content(self) -> bytes:
        return dumps(self.body).encode()


def dumps(value: Any) -> str:
    """JSON with the non-finite markers written as the tokens a lenient parser accepts."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    if id(value) in _TOKENS:
        return _TOKENS[id(value)]
    return json.dumps(value)


def _deref(schema: dict, components: dict) -> dict:
    while "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def _branches(schema: dict, components: dict) -> list[dict]:
    schema = _deref(schema, components)
    if "anyOf" in schema or "oneOf" in schema:
        return [b for s in schema.get("anyOf", schema.get("oneOf", [])) for b in _branches(s, components)]
    if "allOf" in schema and len(schema["allOf"]) == 1:
        return _branches(schema["allOf"][0], components)
    return [schema]


def _pattern_string(pattern: str, seed: int = 0) -> str:
    """A short string matching ``pattern`` (tries a few obvious shapes, then hypothesis)."""
    for cand in (f"n{seed}", f"a{seed}", str(seed), "a" * 32, "0" * 32, "0123456789abcdef" * 4, "1.0.0", "a"):
        if re.fullmatch(pattern, cand):
            return cand
    return _shrunk_match(pattern)


@functools.cache
def _shrunk_match(pattern: str) -> str:
    """Hypothesis's smallest string matching ``pattern``: the same string every time, so it is found
    once per pattern (a search takes ~10 s on 2 cores; the fleet schema asks for one pattern at
    every signed field, hundreds of times). The explain phase only annotates failures: skipped."""
    from hypothesis import Phase, find, settings
    from hypothesis import strategies as st

    return find(st.from_regex(pattern, fullmatch=True), lambda s: True,
                settings=settings(phases=[Phase.generate, Phase.shrink], database=None))


def valid_value(schema: dict, components: dict, seed: int = 0) -> Any:
    """A value the schema accepts (the smallest sensible one)."""
    branches = [b for b in _branches(schema, components) if b.get("type") != "null"]
    if not branches:
        return None
    s = branches[0]
    if "default" in schema and schema["default"] is not None:
        return schema["default"]
    if "enum" in s:
        return s["enum"][0]
    if "const" in s:
        return s["const"]
    t = s.get("type")
    if t in ("integer", "number"):
        lo = s.get("minimum", s.get("exclusiveMinimum"))
        v: float = 1 if lo is None else (lo if "minimum" in s else lo + (1 if t == "integer" else 0.5))
        hi = s.get("maximum", s.get("exclusiveMaximum"))
        if hi is not None and v > hi:
            v = hi
        return int(v) if t == "integer" else float(v)
    if t == "string":
        if "pattern" in s:
            return _pattern_string(s["pattern"], seed)
        return "a" * max(1, s.get("minLength", 1))
    if t == "boolean":
        return False
    if t == "array":
        return [valid_value(s.get("items", {}), components, seed + i) for i in range(s.get("minItems", 0))]
    if t == "object":
        props = s.get("properties", {})
        return {k: valid_value(props[k], components, seed) for k in s.get("required", [])}
    return None


def boundary_values(schema: dict, components: dict) -> list[Any]:
    """Values at and just past the bounds the schema declares, and values of the wrong kind."""
    out: list[Any] = []
    for s in _branches(schema, components):
        t = s.get("type")
        if "enum" in s:
            out += list(s["enum"]) + ["not-a-" + str(s["enum"][0])]
        elif t == "integer":
            out += _int_bounds(s)
        elif t == "number":
            out += _float_bounds(s)
        elif t == "string":
            out += _string_bounds(s)
        elif t == "array":
            out += _array_bounds(s, components)
        elif t == "boolean":
            out += [True, False]
        elif t == "null":
            out.append(None)
    out += _WRONG_TYPES
    unique: list[Any] = []
    for v in out:  # keep the order, drop repeats (1 == 1.0 == True are different JSON)
        if not any(type(v) is type(u) and v == u for u in unique):
            unique.append(v)
    return unique


def _int_bounds(s: dict) -> list[Any]:
    out: list[Any] = [0, -1, 2**31, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**30, 1.5, "1"]
    for key, step in (("minimum", 0), ("exclusiveMinimum", 1), ("maximum", 0), ("exclusiveMaximum", -1)):
        if key in s:
            b = int(s[key]) + step
            out += [b - 1, b, b + 1]
    if "maximum" in s:
        out += [int(s["maximum"]) * 5, int(s["maximum"]) * 10]
    return out


def _float_bounds(s: dict) -> list[Any]:
    out: list[Any] = [0.0, -0.0, -1.0, 1e-300, 1e308, -1e308, NAN, _INF, _NINF, "1", 2**64]
    for key in ("minimum", "exclusiveMinimum"):
        if key in s:
            b = float(s[key])
            out += [b, math.nextafter(b, -math.inf), math.nextafter(b, math.inf), b - abs(b) * 1e-8 - 1e-300]
    for key in ("maximum", "exclusiveMaximum"):
        if key in s:
            b = float(s[key])
            out += [b, math.nextafter(b, math.inf), math.nextafter(b, -math.inf),
                    float(f"{b * (1 + 1e-8):.10g}"), b * 5, b * 10]
    return out


def _string_bounds(s: dict) -> list[Any]:
    out: list[Any] = ["", " ", "a/b#+", "\u00b2", "x" * 5000, 7]
    if "maxLength" in s:
        out += ["a" * s["maxLength"], "a" * (s["maxLength"] + 1)]
    if "minLength" in s and s["minLength"] > 0:
        out += ["a" * (s["minLength"] - 1)]
    if "pattern" in s:
        ok = _pattern_string(s["pattern"])
        out += [ok, ok + "/", "-" + ok, ok * 40]
    return out


def _array_bounds(s: dict, components: dict) -> list[Any]:
    items = s.get("items", {})
    distinct = [valid_value(items, components, seed=i) for i in range((s.get("maxItems") or 3) + 1)]
    out: list[Any] = [[], distinct[:1], "x"]
    if "maxItems" in s:
        out += [distinct[:s["maxItems"]], distinct[:s["maxItems"] + 1]]
    if s.get("minItems", 0) > 0:
        out += [distinct[:s["minItems"] - 1]]
    out += [[v] for v in boundary_values(items, components)[:40]]
    return out


def _object_cases(schema: dict, components: dict, prefix: str) -> Iterator[tuple[str, Any, Any]]:
    """(where, body, value): the valid body with one property (at any depth) set to a boundary value."""
    s = next((b for b in _branches(schema, components) if b.get("type") == "object"), None)
    if s is None:
        return
    base = valid_value(s, components)
    for name, prop in s.get("properties", {}).items():
        for v in boundary_values(prop, components):
            yield f"{prefix}.{name}", base | {name: v}, v
        nested = next((b for b in _branches(prop, components) if b.get("type") == "object"
                       and b.get("properties")), None)
        if nested is not None:
            for where, body, v in _object_cases(nested, components, f"{prefix}.{name}"):
                yield where, base | {name: body}, v
    yield f"{prefix}.<unknown field>", base | {"zz_unknown": 1}, 1


def _query_value(v: Any) -> str | None:
    if v is None or isinstance(v, (list, dict)):
        return None
    if id(v) in _TOKENS:
        return _TOKENS[id(v)].lower().replace("infinity", "inf")
    return json.dumps(v) if isinstance(v, bool) else str(v)


def operation_cases(openapi: dict, skip: set[str] = frozenset()) -> Iterator[Case]:
    """Every boundary case of every operation of ``openapi`` (operations as "METHOD /path" in ``skip``
    are left out)."""
    components = openapi.get("components", {}).get("schemas", {})
    for path, ops in openapi["paths"].items():
        for method, op in ops.items():
            label = f"{method.upper()} {path}"
            if label in skip:
                continue
            params = op.get("parameters", [])
            path_vals = {p["name"]: valid_value(p.get("schema", {}), components) or "x"
                         for p in params if p["in"] == "path"}
            query_ok = {p["name"]: _query_value(valid_value(p["schema"], components))
                        for p in params if p["in"] == "query" and p.get("required")}
            body_schema = (op.get("requestBody", {}).get("content", {}).get("application/json", {})
                           .get("schema"))
            body = valid_value(body_schema, components) if body_schema else None
            has_body = body_schema is not None

            def case(where: str, value: Any, *, pv: dict = path_vals, q: dict = query_ok, b: Any = body,
                     m: str = method, p: str = path, hb: bool = has_body) -> Case:
                return Case(m.upper(), p.format(**pv), {k: v for k, v in q.items() if v is not None}, b, hb,
                            where, value)

            yield case("valid", None)
            for prm in params:
                for v in boundary_values(prm.get("schema", {}), components):
                    qv = _query_value(v)
                    if qv is None:
                        continue
                    if prm["in"] == "query":
                        yield case(f"query.{prm['name']}", v, q=query_ok | {prm["name"]: qv})
                    elif prm["in"] == "path" and "/" not in qv and qv not in ("", ".", ".."):
                        yield case(f"path.{prm['name']}", v, pv=path_vals | {prm["name"]: qv})
            if body_schema is not None:
                for where, b, v in _object_cases(body_schema, components, "body"):
                    yield case(where, v, b=b)
                for v in boundary_values(body_schema, components):
                    yield case("body", v, b=v)
