"""The reasoning suite: answers recomputed from the prompt text, balanced answers, difficulty
parameters."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from evals.suites import load_suite
from evals.suites.reasoning import DIV, MUL, TEMPLATES, generate


def _value(expression: str) -> int:
    return eval(expression.replace(MUL, "*").replace(DIV, "//"), {"__builtins__": {}})


def test_arithmetic_answers_recomputed_from_the_prompt() -> None:
    for item in load_suite("reasoning"):
        if item.category == "arithmetic":
            expression = re.fullmatch(r"What is (.+)\? Answer with the equation\.", item.prompt)[1]
            assert str(_value(expression)) == item.target, item.id
            assert all(c.startswith(f"{expression} = ") for c in item.choices), item.id
            assert item.choices[item.answer] == f"{expression} = {item.target}", item.id


def test_number_answers_are_positive_integers_and_templates_all_used() -> None:
    items = load_suite("reasoning", "quick")
    for item in items:
        if item.meta["match"] == "number":
            assert item.target.isdigit() and int(item.target) > 0, item.id
            numbers = [re.findall(r"\d+", c)[-1] for c in item.choices]
            assert numbers[item.answer] == item.target and len(set(numbers)) == len(numbers), item.id
    assert {i.meta["template"] for i in items if i.category == "word_problem"} == {
        t.name for t in TEMPLATES[:12]
    }
    full = load_suite("reasoning")
    assert {i.meta["template"] for i in full if i.category == "word_problem"} == {t.name for t in TEMPLATES}


def test_word_problem_equations_compute_the_target() -> None:
    for item in load_suite("reasoning"):
        if item.category == "word_problem":
            left = item.choices[item.answer].rsplit(" = ", 1)[0]
            if left.endswith(" rounded up"):
                a, b = map(int, left.removesuffix(" rounded up").split(f" {DIV} "))
                assert -(-a // b) == int(item.target), item.id
            else:
                assert _value(left) == int(item.target), item.id
            assert all(c.rsplit(" = ", 1)[0] == left for c in item.choices), item.id


def test_comparison_answers_are_the_neighbours() -> None:
    for item in load_suite("reasoning"):
        if item.category == "comparison":
            ask, n = re.fullmatch(r"Which number comes just (after|before) (\d+)\? .*", item.prompt).groups()
            assert int(item.target) == int(n) + (1 if ask == "after" else -1), item.id
    asks = Counter(i.meta["template"] for i in load_suite("reasoning", "quick") if i.category == "comparison")
    assert asks == {"after": 6, "before": 6}


def test_logic_values_and_balance() -> None:
    items = [i for i in load_suite("reasoning") if i.category == "logic"]
    for item in items:
        expression, value = item.choices[item.answer].rsplit(" = ", 1)
        assert str(eval(expression, {"__builtins__": {}})) == value, item.id
        assert {c.rsplit(" = ", 1)[1] for c in item.choices} == {"True", "False"}, item.id
    values = Counter(i.target.rsplit(" = ", 1)[1] for i in items)
    assert values["True"] == values["False"]


def test_every_choice_repeats_the_question_so_only_the_answer_differs() -> None:
    for item in load_suite("reasoning"):
        stems = {re.sub(r"(\d+|True|False)\.?$", "", c) for c in item.choices}
        assert len(stems) == 1, item.id


def test_difficulty_parameters() -> None:
    four = generate(8, n_choices=4)
    assert all(len(set(i.choices)) == len(i.choices) for i in four)
    assert {len(i.choices) for i in four if i.category in ("arithmetic", "word_problem")} == {4}
    wide = [i for i in generate(40, digits=3) if i.meta["template"] == "add"]
    assert wide and all(int(i.target) >= 200 for i in wide)
    with pytest.raises(ValueError, match="unknown reasoning parameters"):
        generate(4, distractors=9)
    with pytest.raises(ValueError, match="n_choices is 2 to 4"):
        generate(4, n_choices=5)
