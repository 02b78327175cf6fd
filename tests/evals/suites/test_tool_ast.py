"""BFCL-style AST matching of generated tool calls, and the tool_call suite's choices under it."""

from __future__ import annotations

import json

import pytest

from evals.suites import load_suite
from evals.suites.tool_ast import match_calls, parse_calls, score_reply, values_equal
from evals.suites.tool_call import BY_NAME

WEATHER = BY_NAME["get_weather"].schema()
TIMER = BY_NAME["set_timer"].schema()
TIP = BY_NAME["calculate_tip"].schema()
FLIGHTS = BY_NAME["search_flights"].schema()
EXPECTED = [{"name": "set_timer", "arguments": {"minutes": 30}}]


def test_exact_match() -> None:
    assert score_reply('[{"name": "set_timer", "arguments": {"minutes": 30}}]', EXPECTED, [TIMER])


def _timer(**arguments: object) -> str:
    return json.dumps([{"name": "set_timer", "arguments": arguments}])


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ('[{"name": "start_timer", "arguments": {"minutes": 30}}]', "wrong function: expected set_timer"),
        (_timer(), "missing required argument 'minutes'"),
        (_timer(minutes="30"), "'minutes' should be integer, got string"),
        (_timer(minutes=30.0), "'minutes' should be integer, got number"),
        (_timer(minutes=True), "'minutes' should be integer, got boolean"),
        (_timer(minutes=25), "'minutes' = 25, expected 30"),
        (_timer(minutes=30, sound="bell"), "unknown argument 'sound'"),
        (_timer(minutes=30, label="tea"), "'label' was not asked for"),
        ("[]", "expected 1 call(s), got 0"),
        ("I cannot set timers.", "no function call found"),
        (_timer(minutes=30)[:-1] + ", " + _timer(minutes=30)[1:], "expected 1 call(s), got 2"),
    ],
)
def test_mismatches_say_why(reply: str, reason: str) -> None:
    result = score_reply(reply, EXPECTED, [TIMER])
    assert not result.ok
    assert reason in result.reason


def test_wrong_type_is_caught_without_a_schema_too() -> None:
    result = score_reply('[{"name": "set_timer", "arguments": {"minutes": "30"}}]', EXPECTED)
    assert not result and "should be integer, got string" in result.reason


def test_text_around_the_json() -> None:
    for reply in (
        'Sure! Here is the call:\n```json\n[{"name": "set_timer", "arguments": {"minutes": 30}}]\n```\nDone.',
        'I will call {"name": "set_timer", "arguments": {"minutes": 30}} now.',
        'Note [1]. {"tool_calls": [{"function": {"name": "set_timer", "arguments": "{\\"minutes\\": 30}"}}]}',
        "set_timer(minutes=30)",
        "Calling [set_timer(minutes=30)] for you.",
    ):
        assert score_reply(reply, EXPECTED, [TIMER]), reply


def test_parameters_key_and_single_object() -> None:
    assert parse_calls('{"name": "set_timer", "parameters": {"minutes": 30}}') == EXPECTED


def test_unparseable_or_not_a_call() -> None:
    assert parse_calls("The answer is [1, 2, 3].") is None
    assert parse_calls('{"minutes": 30}') is None
    assert parse_calls("print() is not a call we count") is None
    assert parse_calls("[]") == []


@pytest.mark.parametrize("reply", ["[]", "None of these functions can help.", "No call needed: []", ""])
def test_irrelevance_right_when_no_call(reply: str) -> None:
    assert score_reply(reply, [], [WEATHER])


def test_irrelevance_wrong_when_a_call_is_made() -> None:
    result = score_reply('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', [], [WEATHER])
    assert not result and result.reason == "expected no call, got 1"


def test_parallel_calls_match_in_any_order() -> None:
    expected = [
        {"name": "get_weather", "arguments": {"city": "Oslo"}},
        {"name": "get_weather", "arguments": {"city": "Lima"}},
    ]
    reply = json.dumps(list(reversed(expected)))
    assert match_calls(parse_calls(reply), expected, [WEATHER])
    half = json.dumps([expected[0], expected[0]])
    assert not match_calls(parse_calls(half), expected, [WEATHER])


def test_values_types_and_defaults() -> None:
    expected = [{"name": "calculate_tip", "arguments": {"bill": 48.0, "percent": 15}}]
    assert score_reply(
        '[{"name": "calculate_tip", "arguments": {"bill": 48, "percent": 15}}]', expected, [TIP]
    )
    assert not score_reply(
        '[{"name": "calculate_tip", "arguments": {"bill": "48", "percent": 15}}]', expected, [TIP]
    )
    flight = {"origin": "Oslo", "destination": "Lima", "date": "2025-03-14"}
    expected = [{"name": "search_flights", "arguments": flight}]
    with_default = json.dumps([{"name": "search_flights", "arguments": {**flight, "nonstop": False}}])
    assert score_reply(with_default, expected, [FLIGHTS])  # an optional argument at its default
    nonstop = json.dumps([{"name": "search_flights", "arguments": {**flight, "nonstop": True}}])
    assert "'nonstop' was not asked for" in score_reply(nonstop, expected, [FLIGHTS]).reason
    celsius = [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]
    assert score_reply('[{"name": "get_weather", "arguments": {"city": "oslo "}}]', celsius, [WEATHER])
    kelvin = '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"}}]'
    assert "is not one of" in score_reply(kelvin, celsius, [WEATHER]).reason


def test_values_equal_is_type_strict() -> None:
    assert values_equal(5, 5.0) and not values_equal("5", 5) and not values_equal(True, 1)
    assert values_equal(["milk", "Eggs"], ["milk", "eggs"]) and not values_equal(
        ["eggs", "milk"], ["milk", "eggs"]
    )


def test_every_suite_choice_scores_as_labelled() -> None:
    """The right choice matches its target under the AST scorer and every semantic distractor
    fails. (The syntax distractors are judged by JSON's own parser, in test_tool_call: this
    scorer reads JSON out of prose, as BFCL's does, and may read a call out of a broken copy.)"""
    for item in load_suite("tool_call"):
        for i, choice in enumerate(item.choices):
            if item.meta["choice_kinds"][i].startswith("syntax_"):
                continue
            result = score_reply(choice, item.target, item.meta["functions"])
            assert result.ok == (i == item.answer), (
                item.id,
                item.meta["choice_kinds"][i],
                choice,
                result.reason,
            )
