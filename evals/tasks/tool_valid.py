"""The ``tool_call_valid`` tasks: generated tool calls checked as a program would check them.

Each item of the ``tool_call`` suite that expects calls (simple, multiple, parallel; not
``irrelevance``) is put to the model with the suite's own prompt, after two worked examples of
the answer format; the greedy reply is parsed with ``json`` and validated against the offered
functions with ``jsonschema`` (``evals.suites.tool_schema.check_calls``). An item scores 1 when
its reply holds a valid, schema-correct call list of at least one call (every scored item's
request needs one: ``[]`` is valid JSON, but a program given it does nothing the user asked);
the ``parsed`` metric says whether its JSON parsed at all, so the gate reports parse and schema
failures apart.

Why worked examples (lm-eval's few-shot, ``fewshot_split: demos``): with the prompt alone the
default model (SmolLM2-135M-Instruct) answers in prose or Python and writes no JSON call in 36
of 36 quick items; after two examples, as chat turns, it writes JSON that parses in 23 of 36.
The examples use functions that no suite item offers (``find_hotel``, ``get_time``), so they
teach the format and never the answer. They are part of every item's hash: changing them
changes the items, and the gate refuses to pair scores across the change.

The rank-scored ``tool_call`` suite measures which call the model prefers among written ones;
this task measures whether the model can write one, which damage to JSON punctuation breaks.

Why ``irrelevance`` is not scored here (its right reply is ``[]``): the default model never
writes it. On the 12 quick irrelevance items its greedy reply is a call, or prose, never ``[]``,
with these two examples and with a third that answers an unfitting request with ``[]`` (0 of 12
either way, measured 2026-12-07); and where it writes no call at all (3 of 12) it does as often
on the items that need one (10 of 36), so "the reply holds no call" would not tell engines
apart either. The rank task scores the category, and the validity report keeps it out.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import datasets

from evals.suites import load_suite
from evals.suites.common import canonical_json, sha256_text
from evals.suites.tool_call import prompt_for
from evals.suites.tool_schema import SCHEMA, check_calls
from evals.tasks.docs import decode, to_doc

SUITE = "tool_call"
NO_CALL_CATEGORY = "irrelevance"  # its right reply is [] (scored by the rank task)

FIND_HOTEL = {
    "name": "find_hotel",
    "description": "Find hotels in a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "City name"},
            "nights": {"type": "integer", "description": "Number of nights"},
        },
        "required": ["city", "nights"],
    },
}
GET_TIME = {
    "name": "get_time",
    "description": "Get the local time in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "City name"}},
        "required": ["city"],
    },
}
# (offered functions, request, the right calls): one simple call, then two parallel ones.
DEMOS: tuple[tuple[list[dict[str, Any]], str, list[dict[str, Any]]], ...] = (
    (
        [FIND_HOTEL],
        "Find a hotel in Rome for 3 nights.",
        [{"name": "find_hotel", "arguments": {"city": "Rome", "nights": 3}}],
    ),
    (
        [GET_TIME, FIND_HOTEL],
        "What time is it in Tokyo and in Lima?",
        [
            {"name": "get_time", "arguments": {"city": "Tokyo"}},
            {"name": "get_time", "arguments": {"city": "Lima"}},
        ],
    ),
)
DEMOS_HASH = sha256_text(canonical_json([list(demo) for demo in DEMOS]))
# What an item's score means, part of its hash like the examples: scores of an earlier check
# (which let ``[]`` pass) are never paired with this one's.
CHECK = "json, then jsonschema of the offered functions; at least one call"


def demo_docs() -> list[dict[str, Any]]:
    """The worked examples as docs (the ``demos`` split): the suite's prompt and the calls."""
    return [
        {"id": f"demo-{n}", "prompt": prompt_for(functions, request), "reference": json.dumps(calls)}
        for n, (functions, request, calls) in enumerate(DEMOS)
    ]


@lru_cache(maxsize=4)
def _docs(size: str) -> tuple[dict[str, Any], ...]:
    docs = []
    for item in load_suite(SUITE, size):
        if item.category == NO_CALL_CATEGORY:
            continue
        doc = to_doc(item)
        doc["hash"] = sha256_text(doc["hash"] + DEMOS_HASH + CHECK)  # the examples and the check too
        doc["match"] = "valid"
        docs.append(doc)
    return tuple(docs)


def docs(size: str = "full") -> list[dict[str, Any]]:
    """The scored docs at a size: the suite's items that expect calls, in frozen order."""
    return [dict(doc) for doc in _docs(size)]


def load(size: str = "full", **_: Any) -> dict[str, datasets.Dataset]:
    """``custom_dataset`` of the tasks: the scored items (``test``) and the examples (``demos``)."""
    return {"test": datasets.Dataset.from_list(docs(size)), "demos": datasets.Dataset.from_list(demo_docs())}


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """``acc``: the reply's calls, at least one, are valid JSON and match the offered schemas;
    ``parsed``: the reply's JSON parsed (a schema failure parsed, a parse failure did not)."""
    _, meta = decode(doc)
    result = check_calls(results[0], meta["functions"], min_calls=1)
    return {"acc": float(result.ok), "parsed": float(result.ok or result.failure == SCHEMA)}
