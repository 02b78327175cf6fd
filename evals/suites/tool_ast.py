"""Generative scoring of tool calls: parse the calls out of a model's reply, then match them
against the expected calls by their abstract syntax, as the Berkeley Function-Calling
Leaderboard does (BFCL; Yan et al. 2024, gorilla.cs.berkeley.edu/leaderboard, "AST
evaluation"): the function name must be right, every required argument present, no unknown
argument given, each value of the declared type (an integer is not a string, a boolean is not
an integer; an integer is a valid ``number``) and equal to the expected value (strings compared
case- and space-insensitively, numbers numerically, lists in order). Parallel calls match in
any order. An irrelevance item (no call expected) is right when the reply holds no call.

``parse_calls`` accepts the JSON this project's prompts ask for (``[{"name", "arguments"}]``),
a single call object, ``{"tool_calls": [...]}`` or OpenAI-style ``{"function": {...}}``
entries, arguments given as a JSON string, ``parameters`` for ``arguments``; the JSON may sit
inside prose or a Markdown code fence. Failing JSON, it reads Python call syntax
(``get_weather(city="Paris")``, BFCL's own format) with literal keyword arguments (at least one,
so that prose such as "print()" is not taken for a call).
"""

from __future__ import annotations

import ast
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.core.files import loads_bounded

Call = dict[str, Any]

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}
_PY_CALL = re.compile(r"[A-Za-z_][\w.]*\s*\(")
_MISSING = object()


@dataclass(frozen=True)
class AstResult:
    """Whether the predicted calls match, and why not (``reason`` is "" on a match)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def _as_call(value: Any) -> Call | None:
    if not isinstance(value, Mapping):
        return None
    if "function" in value and isinstance(value["function"], Mapping):
        value = value["function"]
    name = value.get("name")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = loads_bounded(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, Mapping):
        return None
    return {"name": name, "arguments": dict(arguments)}


def _as_calls(value: Any) -> list[Call] | None:
    """The calls a decoded JSON value stands for, or None if it is not a call structure."""
    if isinstance(value, Mapping):
        for key in ("tool_calls", "calls", "function_calls"):
            if isinstance(value.get(key), list):
                return _as_calls(value[key])
        call = _as_call(value)
        return None if call is None else [call]
    if isinstance(value, list):
        calls = [_as_call(v) for v in value]
        if all(c is not None for c in calls):
            return calls  # type: ignore[return-value]
    return None


def _python_calls(text: str) -> list[Call] | None:
    """Calls written as Python (``f(a=1), g(b="x")``), keyword arguments with literal values."""
    calls: list[Call] = []
    position = 0
    while match := _PY_CALL.search(text, position):
        start = match.start()
        found = None
        for end in (i for i, ch in enumerate(text) if ch == ")" and i > start):
            try:
                node = ast.parse(text[start : end + 1].strip(), mode="eval").body
            except SyntaxError:
                continue
            if (
                isinstance(node, ast.Call)
                and not node.args
                and node.keywords
                and all(k.arg for k in node.keywords)
            ):
                try:
                    arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                except ValueError:
                    break
                found = ({"name": ast.unparse(node.func), "arguments": arguments}, end + 1)
            break
        if found is None:
            position = match.end()
            continue
        calls.append(found[0])
        position = found[1]
    return calls or None


def parse_calls(text: str) -> list[Call] | None:
    """The calls in a generated reply (``[]`` for an explicit empty list), or None when the reply
    holds no call at all. The first JSON value in the text that is a call structure wins."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"[\[{]", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        calls = _as_calls(value)
        if calls is not None:
            return calls
    return _python_calls(text)


def _normalize(text: str) -> str:
    return " ".join(text.casefold().split())


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _has_type(value: Any, json_type: str) -> bool:
    if isinstance(value, bool) and json_type != "boolean":
        return False
    if json_type == "number" and isinstance(value, float) and not math.isfinite(value):
        return False
    return isinstance(value, _JSON_TYPES.get(json_type, (object,)))


def values_equal(predicted: Any, expected: Any) -> bool:
    """Type-strict equality: ``5`` is not ``"5"``, ``True`` is not ``1``; ``5`` equals ``5.0``;
    strings ignore case and runs of spaces; lists compare in order, objects by key."""
    if isinstance(expected, bool) or isinstance(predicted, bool):
        return isinstance(expected, bool) and isinstance(predicted, bool) and expected == predicted
    if isinstance(expected, int | float):
        return isinstance(predicted, int | float) and math.isclose(
            predicted, expected, rel_tol=1e-9, abs_tol=1e-9
        )
    if isinstance(expected, str):
        return isinstance(predicted, str) and _normalize(predicted) == _normalize(expected)
    if isinstance(expected, list):
        return (
            isinstance(predicted, list)
            and len(predicted) == len(expected)
            and all(values_equal(p, e) for p, e in zip(predicted, expected, strict=True))
        )
    if isinstance(expected, dict):
        return (
            isinstance(predicted, dict)
            and set(predicted) == set(expected)
            and all(values_equal(predicted[k], v) for k, v in expected.items())
        )
    return predicted == expected


def match_call(predicted: Call, expected: Call, schema: Mapping[str, Any] | None = None) -> AstResult:
    """One call against one expected call (and, if given, the function's JSON schema)."""
    name = expected["name"]
    if predicted.get("name") != name:
        return AstResult(False, f"wrong function: expected {name}, got {predicted.get('name')}")
    args, want = predicted.get("arguments", {}), expected["arguments"]
    parameters = (schema or {}).get("parameters", {})
    properties: Mapping[str, Any] = parameters.get("properties", {})
    required: Sequence[str] = parameters.get("required", [])
    for arg in required:
        if arg not in args:
            return AstResult(False, f"{name}: missing required argument {arg!r}")
    for arg in want:
        if arg not in args:
            default = properties.get(arg, {}).get("default", _MISSING)
            if default is _MISSING or not values_equal(default, want[arg]):
                return AstResult(False, f"{name}: missing argument {arg!r}")
    for arg, value in args.items():
        spec = properties.get(arg)
        if schema is not None and spec is None:
            return AstResult(False, f"{name}: unknown argument {arg!r}")
        if spec is not None:
            json_type = spec.get("type")
            if json_type and not _has_type(value, json_type):
                return AstResult(
                    False, f"{name}: argument {arg!r} should be {json_type}, got {_type_name(value)}"
                )
            if "enum" in spec and not any(values_equal(value, e) for e in spec["enum"]):
                return AstResult(False, f"{name}: argument {arg!r} = {value!r} is not one of {spec['enum']}")
        if arg in want:
            if not values_equal(value, want[arg]):
                if _type_name(value) != _type_name(want[arg]) and not (
                    isinstance(value, int | float)
                    and isinstance(want[arg], int | float)
                    and not isinstance(value, bool)
                ):
                    wanted, got = _type_name(want[arg]), _type_name(value)
                    return AstResult(False, f"{name}: argument {arg!r} should be {wanted}, got {got}")
                return AstResult(False, f"{name}: argument {arg!r} = {value!r}, expected {want[arg]!r}")
        else:
            default = (spec or {}).get("default", _MISSING)
            if default is _MISSING or not values_equal(value, default):
                return AstResult(False, f"{name}: argument {arg!r} was not asked for")
    return AstResult(True)


def match_calls(
    predicted: Sequence[Call] | None,
    expected: Sequence[Call],
    functions: Sequence[Mapping[str, Any]] | None = None,
) -> AstResult:
    """Predicted calls (``parse_calls`` output) against the expected list, in any order.

    ``functions`` (the offered JSON schemas) turns on type, enum, required and unknown-argument
    checks against the declarations. With no call expected, no call (None or ``[]``) is right.
    """
    calls = list(predicted or [])
    if not expected:
        return AstResult(not calls, "" if not calls else f"expected no call, got {len(calls)}")
    if predicted is None:
        return AstResult(False, "no function call found in the reply")
    if len(calls) != len(expected):
        return AstResult(False, f"expected {len(expected)} call(s), got {len(calls)}")
    schemas = {f["name"]: f for f in functions or []}
    first_failure: AstResult | None = None
    orders = itertools.permutations(range(len(calls))) if len(calls) <= 6 else [tuple(range(len(calls)))]
    for order in orders:
        for i, j in enumerate(order):
            want = expected[i]
            result = match_call(calls[j], want, schemas.get(want["name"]) if functions is not None else None)
            if not result.ok:
                first_failure = first_failure or result
                break
        else:
            return AstResult(True)
    assert first_failure is not None
    return first_failure


def score_reply(
    reply: str, expected: Sequence[Call], functions: Sequence[Mapping[str, Any]] | None = None
) -> AstResult:
    """Parse a generated reply and match it: the generative score of a ``tool_call`` item is
    ``score_reply(text, item.target, item.meta["functions"]).ok``."""
    return match_calls(parse_calls(reply), expected, functions)
