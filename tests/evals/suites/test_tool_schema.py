"""Generated calls parsed by json and validated by jsonschema: parse and schema failures apart."""

from __future__ import annotations

import json
import random

import pytest

from evals.suites import load_suite
from evals.suites.tool_call import BY_NAME, SYNTAX_BREAKS, syntax_distractors
from evals.suites.tool_schema import PARSE, SCHEMA, check_calls

CONVERT = BY_NAME["convert_currency"].schema()
WEATHER = BY_NAME["get_weather"].schema()
RIGHT = (
    '[{"name": "convert_currency", "arguments": {"amount": 18.4, "from_currency": "CAD", '
    '"to_currency": "JPY"}}]'
)


def test_a_valid_call_list_passes_with_prose_around_it() -> None:
    assert check_calls(RIGHT, [CONVERT, WEATHER])
    assert check_calls(f"Sure:\n```json\n{RIGHT}\n```\nAnything else?", [CONVERT])
    assert check_calls(RIGHT + '\nRequest: and [{"name": broken', [CONVERT])  # the decode ran on
    assert check_calls("[]", [CONVERT])  # no call is a valid reply, unless a call is needed:
    needed = check_calls("[]", [CONVERT], min_calls=1)
    assert needed.failure == SCHEMA and "should be non-empty" in needed.reason, needed
    assert check_calls(RIGHT, [CONVERT], min_calls=1)
    assert check_calls(RIGHT[1:-1], [CONVERT])  # one call as a bare object, as serving parsers read it
    for stray in ("]", " }", ",", "\n:"):
        assert check_calls(RIGHT + stray, [CONVERT]).failure == PARSE, stray


@pytest.mark.parametrize("kind", sorted(SYNTAX_BREAKS))
def test_every_broken_copy_is_a_parse_failure(kind: str) -> None:
    k = list(SYNTAX_BREAKS).index(kind)
    for seed in range(10):
        ((broken, _),) = syntax_distractors(random.Random(seed), RIGHT, k, 1)
        result = check_calls(broken, [CONVERT])
        assert not result and result.failure == PARSE, broken


@pytest.mark.parametrize(
    ("reply", "needle"),
    [
        ('[{"name": "convert_currency", "arguments": {"amount": "18.4", "from_currency": "CAD", '
         '"to_currency": "JPY"}}]', "amount: '18.4' is not of type 'number'"),
        ('[{"name": "convert_currency", "arguments": {"amount": 18.4, "to_currency": "JPY"}}]',
         "'from_currency' is a required property"),
        ('[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"}}]',
         "unit: 'kelvin' is not one of"),
        ('[{"name": "book_taxi", "arguments": {}}]', "'book_taxi' is not an offered function"),
        ('[{"name": "convert_currency"}]', "'arguments' is a required property"),
        ('{"name": "convert_currency", "arguments": {}}', "'amount' is a required property"),
        ("[1]", "1 is not valid under any of the given schemas"),
    ],
)  # fmt: skip
def test_schema_failures_name_the_broken_rule(reply: str, needle: str) -> None:
    result = check_calls(reply, [CONVERT, WEATHER])
    assert not result and result.failure == SCHEMA, result
    assert needle in result.reason, result.reason


def test_no_json_at_all_is_a_parse_failure() -> None:
    result = check_calls("I would convert 18.4 CAD to JPY.", [CONVERT])
    assert not result and result.failure == PARSE and "no JSON value" in result.reason


def test_every_suite_item_accepts_its_right_call_and_refuses_its_broken_copy() -> None:
    for item in load_suite("tool_call", "quick"):
        functions = item.meta["functions"]
        assert check_calls(json.dumps(item.target), functions), item.id
        for choice, kind in zip(item.choices, item.meta["choice_kinds"], strict=True):
            if kind.startswith("syntax_"):
                assert check_calls(choice, functions).failure == PARSE, (item.id, choice)
            elif kind == "wrong_type":
                assert check_calls(choice, functions).failure == SCHEMA, (item.id, choice)
