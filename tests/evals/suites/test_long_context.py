"""The long-context suite: prompts rebuilt from the shipped haystack, needles where they should
be, and lengths in real tokens of the default model's tokenizer."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from evals.suites import haystack, load_suite
from evals.suites.long_context import DEFAULT_TOKENIZER, LENGTHS, generate, measure_tokens


@pytest.fixture(scope="module")
def frozen():
    return load_suite("long_context")


def test_rebuilt_prompts_equal_the_generated_ones(frozen) -> None:
    generated = {item.id: item.prompt for item in generate("full")}
    assert {item.id: item.prompt for item in frozen} == generated


def test_shipped_haystack_is_clean() -> None:
    text = haystack.shipped_text()
    assert text == haystack.generate_text()
    assert not re.search(r"\d", text)
    assert not re.search(r"special|magic|VAR", text)
    assert len(text) > 5 * 36_000  # several disjoint 8k spans


def test_needles_and_answers_are_in_the_prompt(frozen) -> None:
    for item in frozen:
        if item.category == "common_words":
            continue
        assert all(target in item.prompt for target in item.target), item.id
        if item.category == "niah_multikey":  # the distractors are the other keys' values, all present
            assert all(choice in item.prompt for choice in item.choices), item.id
        if item.category == "niah_single":
            assert sum(choice in item.prompt for choice in item.choices) == 1, item.id


def test_variable_chains_resolve_to_the_target(frozen) -> None:
    for item in frozen:
        if item.category != "variable_tracking":
            continue
        assignments = re.findall(r"VAR (\w+) = (?:VAR )?(\w+)\.", item.prompt)
        value = re.search(r"assigned the value (\d+)", item.prompt)[1]
        holders = {value}
        for name, source in assignments:  # in text order: a chain is inserted in order
            if source in holders:
                holders.add(name)
        assert sorted(holders - {value}) == sorted(item.target), item.id


def test_common_words_are_the_most_frequent(frozen) -> None:
    for item in frozen:
        if item.category != "common_words":
            continue
        counts = Counter(re.findall(r"\d+\. ([a-z]+)", item.prompt))
        top = {w for w, _ in counts.most_common(len(item.target))}
        assert top == set(item.target), item.id
        assert min(counts[w] for w in item.target) > max(c for w, c in counts.items() if w not in top), (
            item.id
        )


@pytest.mark.skipif(
    not (DEFAULT_TOKENIZER / "tokenizer.json").is_file(),
    reason=f"no tokenizer at {DEFAULT_TOKENIZER}: run `python -m pipeline model=llama` once",
)
def test_lengths_in_real_tokens(frozen) -> None:
    counts = measure_tokens([item.prompt for item in frozen], Path(DEFAULT_TOKENIZER))
    for item, tokens in zip(frozen, counts, strict=True):
        nominal = LENGTHS[item.meta["length"]]
        assert item.meta["tokens"] == tokens, item.id  # the recorded measurement is current
        assert 0.90 * nominal <= tokens <= nominal, (item.id, tokens)
    longest = max(n for item, n in zip(frozen, counts, strict=True) if item.meta["length"] == "8k")
    assert longest + 64 + 128 <= 8192  # chat template and an answer fit the model's positions


def test_difficulty_parameters() -> None:
    items = generate(10, n_keys=6, cwe_swaps=2, vt_hops=2)
    keys = [i for i in items if i.category == "niah_multikey"]
    assert keys and all(len(i.meta["keys"]) == 6 for i in keys)
    assert all(len(i.target) == 3 for i in items if i.category == "variable_tracking")
    with pytest.raises(ValueError, match="unknown long_context parameters"):
        generate(2, haystack="essays")
