"""tool_call's syntax distractors: the right call with its JSON broken, one per item of every
category but irrelevance, each kind in turn, refused by JSON's own parser."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest

from evals.suites import load_suite
from evals.suites.tool_call import SYNTAX_BREAKS, generate, syntax_distractors

WORDS = re.compile(r"[\w.]+")  # the names and values of a call text, without its punctuation


def test_each_item_offers_one_broken_copy_of_the_right_call() -> None:
    for item in load_suite("tool_call"):
        kinds = item.meta["choice_kinds"]
        broken = [i for i, kind in enumerate(kinds) if kind.startswith("syntax_")]
        assert len(broken) == (0 if item.category == "irrelevance" else 1), item.id
        assert len(item.choices) == 4 + len(broken), item.id
        right = item.choices[item.answer]
        for i, choice in enumerate(item.choices):
            if i in broken:
                with pytest.raises(ValueError):
                    json.loads(choice)
                assert WORDS.findall(choice) == WORDS.findall(right), (item.id, choice)
                assert not right.startswith(choice), (item.id, choice)
            else:
                json.loads(choice)  # every other choice is well-formed: only its meaning is wrong


def test_every_kind_is_in_every_category_of_the_quick_suite() -> None:
    seen = Counter((i.category, k) for i in load_suite("tool_call", "quick") for k in i.meta["choice_kinds"])
    for category in ("simple", "multiple", "parallel"):
        assert all(seen[(category, kind)] >= 2 for kind in SYNTAX_BREAKS), (category, seen)
    assert not any(k.startswith("syntax_") for (c, k) in seen if c == "irrelevance")


@pytest.mark.parametrize("kind", sorted(SYNTAX_BREAKS))
def test_each_break_is_refused_by_json_on_every_call_shape(kind: str) -> None:
    shapes = [
        '[{"name": "set_timer", "arguments": {"minutes": 40}}]',
        '[{"name": "f", "arguments": {"a": [1, 2], "b": true}}, {"name": "f", "arguments": {"a": []}}]',
    ]
    k = list(SYNTAX_BREAKS).index(kind)  # item k's first break is the k-th kind
    for text in shapes:
        for seed in range(20):
            ((broken, got),) = syntax_distractors(random.Random(seed), text, k, 1)
            assert got == kind and not text.startswith(broken)  # a prefix ranks as the right call
            with pytest.raises(ValueError):
                json.loads(broken)


def test_n_syntax_zero_gives_the_semantic_choices_alone_and_a_bad_count_is_refused() -> None:
    plain = generate(8, n_syntax=0)
    assert all(
        len(i.choices) == 4 and not any(k.startswith("syntax_") for k in i.meta["choice_kinds"])
        for i in plain
    )
    with_syntax = {i.id: i for i in generate(8)}
    for item in plain:  # the same semantic distractors, with the broken copy added
        other = with_syntax[item.id]
        semantic = {
            c
            for c, k in zip(other.choices, other.meta["choice_kinds"], strict=True)
            if not k.startswith("syntax_")
        }
        assert semantic == set(item.choices), item.id
    with pytest.raises(ValueError, match="n_syntax is 0 to 5"):
        generate(4, n_syntax=6)
