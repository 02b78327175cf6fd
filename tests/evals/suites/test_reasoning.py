"""The reasoning suite: answers recomputed from the prompt text, difficulty parameters."""

from __future__ import annotations

import re

import pytest

from evals.suites import load_suite
from evals.suites.reasoning import DIV, MUL, RELATIONS, TEMPLATES, generate


def test_arithmetic_answers_recomputed_from_the_prompt() -> None:
    for item in load_suite("reasoning"):
        if item.category == "arithmetic":
            expression = re.fullmatch(r"What is (.+)\? Answer with a number\.", item.prompt)[1]
            value = eval(expression.replace(MUL, "*").replace(DIV, "//"), {"__builtins__": {}})
            assert str(value) == item.target, item.id


def test_number_answers_are_positive_integers_and_templates_all_used() -> None:
    items = load_suite("reasoning", "quick")
    for item in items:
        if item.meta["match"] == "number":
            assert item.target.isdigit() and int(item.target) > 0, item.id
            assert all(c.isdigit() and int(c) > 0 for c in item.choices), item.id
    assert {i.meta["template"] for i in items if i.category == "word_problem"} == {
        t.name for t in TEMPLATES[:12]
    }
    full = load_suite("reasoning")
    assert {i.meta["template"] for i in full if i.category == "word_problem"} == {t.name for t in TEMPLATES}


def test_order_answers_follow_from_the_facts() -> None:
    words = {more: 1 for _, more, *_ in RELATIONS} | {less: -1 for _, _, less, *_ in RELATIONS}
    for item in load_suite("reasoning"):
        if not item.meta["template"].startswith("order_"):
            continue
        above: dict[str, str] = {}  # person -> the one just above
        for a, word, b in re.findall(r"(\w+) is (\w+) than (\w+)\.", item.prompt):
            upper, lower = (a, b) if words[word] > 0 else (b, a)
            above[lower] = upper
        people = set(above) | set(above.values())
        top = (people - set(above)).pop()
        order = [top]
        while len(order) < len(people):
            order.append(next(p for p, up in above.items() if up == order[-1]))
        ask = item.meta["template"]
        expected = {"order_most": order[0], "order_least": order[-1], "order_second": order[1]}[ask]
        assert item.target == expected, item.id


def test_decimal_answers() -> None:
    for item in load_suite("reasoning"):
        if item.meta["template"].startswith("decimal_"):
            pick = max if item.meta["template"] == "decimal_largest" else min
            assert item.target == pick(item.choices, key=float), item.id


def test_difficulty_parameters() -> None:
    three = generate(8, n_choices=3)
    assert all(len(i.choices) == 3 and len(set(i.choices)) == 3 for i in three)
    wide = [i for i in generate(40, digits=3) if i.meta["template"] == "add"]
    assert wide and all(int(i.target) >= 200 for i in wide)
    with pytest.raises(ValueError, match="unknown reasoning parameters"):
        generate(4, distractors=9)
