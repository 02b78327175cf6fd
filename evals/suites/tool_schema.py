"""Generated tool calls checked as a program that consumes them would check them: the reply's
JSON parsed by ``json`` (strictly: no repair, no second try from another brace), then the call
list validated against the offered functions' JSON Schemas with ``jsonschema`` (Draft 2020-12):
each call an object ``{"name", "arguments"}`` naming an offered function, its arguments holding
every required one, each of its declared type and, where the schema lists them, one of its enum
values.

This is the validity of a call, not its correctness: ``evals/suites/tool_ast.py`` matches the
calls against the expected ones (BFCL's AST rules) and reads calls out of prose, as BFCL does,
so it may read a call out of broken JSON. Here a reply that a JSON parser refuses is a
``parse`` failure, and one that parses but breaks a schema is a ``schema`` failure, reported
apart. One call written as a bare object (``{"name": ..., "arguments": ...}``, the form that
serving engines' tool parsers read, such as vLLM's Hermes and Llama-3 JSON parsers) counts as a
list of that call. Prose before the JSON (and a Markdown code fence around it) is allowed, as is text after
the first complete JSON value (a greedy decode runs on past the answer until its stop
sequence), unless that text opens with JSON punctuation that cannot follow a value (``]``,
``}``, ``,``, ``:``): then the JSON written was unbalanced.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

PARSE = "parse"
SCHEMA = "schema"
_START = re.compile(r"[\[{]")
_STRAY = re.compile(r"\s*([\]},:])")  # JSON punctuation that cannot follow a complete value


@dataclass(frozen=True)
class CallValidity:
    """Whether a reply's calls are valid, and if not which check failed first (``parse`` or
    ``schema``) and why."""

    ok: bool
    failure: str = ""
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def reply_schema(functions: Sequence[Mapping[str, Any]], min_calls: int = 0) -> dict[str, Any]:
    """The JSON Schema of a reply that calls ``functions`` (the offered schemas, as in an item's
    ``meta["functions"]``): a list of at least ``min_calls`` calls, each matching one offered
    function."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"],
        }
        for f in functions
    ]
    return {"type": "array", "items": {"anyOf": calls} if calls else False, "minItems": min_calls}


def _first_json(reply: str) -> Any:
    """The first JSON value of ``reply``, decoded from its first ``[`` or ``{``; raises
    ValueError (json's own message) where that text is not JSON."""
    start = _START.search(reply)
    if start is None:
        raise ValueError("no JSON value in the reply")
    value, end = json.JSONDecoder().raw_decode(reply, start.start())
    stray = _STRAY.match(reply, end)
    if stray:  # "[...]]", "{...},": the value closed early, so the JSON written is unbalanced
        raise ValueError(f"{stray.group(1)!r} right after the JSON value at char {stray.start(1)}")
    return value


def _schema_reason(
    value: Any, validator: Draft202012Validator, functions: Sequence[Mapping[str, Any]]
) -> str:
    """The most useful of the errors: for a call naming an offered function, that function's
    own error (a missing argument, a wrong type), not anyOf's "matches none"."""
    by_name = {f["name"]: f for f in functions}
    if isinstance(value, list):
        for index, call in enumerate(value):
            if isinstance(call, Mapping) and call.get("name") in by_name:
                own = Draft202012Validator(
                    {
                        "type": "object",
                        "properties": {"arguments": by_name[call["name"]]["parameters"]},
                        "required": ["name", "arguments"],
                    }
                )
                error = next(iter(sorted(own.iter_errors(call), key=lambda e: list(e.path))), None)
                if error is not None:
                    where = "/".join(str(p) for p in error.path)
                    return f"call {index} ({call['name']}) {where}: {error.message}"
            elif isinstance(call, Mapping) and "name" in call:
                return f"call {index}: {call['name']!r} is not an offered function"
    error = next(iter(sorted(validator.iter_errors(value), key=lambda e: list(e.path))), None)
    return "" if error is None else f"{'/'.join(str(p) for p in error.path) or 'reply'}: {error.message}"


def check_calls(reply: str, functions: Sequence[Mapping[str, Any]], min_calls: int = 0) -> CallValidity:
    """Parse ``reply``'s calls with ``json`` and validate them against ``functions``; fewer than
    ``min_calls`` calls (``[]`` where the request needs a call) is a schema failure."""
    try:
        value = _first_json(reply)
    except ValueError as error:
        return CallValidity(False, PARSE, str(error))
    try:
        validator = Draft202012Validator(reply_schema(functions, min_calls))
        validator.check_schema(validator.schema)
    except SchemaError as error:  # an offered schema that is not a JSON Schema: a suite bug
        raise ValueError(f"the offered functions are not valid JSON Schema: {error.message}") from error
    if isinstance(value, dict):  # one call, unwrapped
        value = [value]
    if validator.is_valid(value):
        return CallValidity(True)
    return CallValidity(False, SCHEMA, _schema_reason(value, validator, functions))
