"""Frozen suites: regeneration gives the same bytes, loading checks every hash, sizes share ids,
and bad input (hand edits, unknown names, a stale generator version) is a one-line error."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from evals.suites import DATA_DIR, SPECS, SUITES, SuiteError, check, item_hash, load_suite
from evals.suites.__main__ import main
from evals.suites.common import canonical_json, plan
from evals.suites.store import MANIFEST

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def data_copy(tmp_path: Path) -> Path:
    """A copy of the frozen files to tamper with."""
    folder = tmp_path / "data"
    shutil.copytree(DATA_DIR, folder)
    return folder


def _edit_line(path: Path, line: int, change) -> None:
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    record = json.loads(lines[line])
    change(record)
    lines[line] = canonical_json(record) + "\n"
    path.write_text("".join(lines), encoding="utf-8")


def _refresh_manifest(folder: Path, name: str) -> None:
    """What someone would do to sneak an edit past the sha256 check."""
    import hashlib

    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"][name]["sha256"] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_regeneration_matches_the_frozen_files() -> None:
    assert check() == []


def test_check_cli_from_another_directory_and_hash_seed(tmp_path: Path) -> None:
    """Data is found relative to the package, and no output depends on Python's str hashing."""
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "evals.suites", "--check"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "match" in result.stdout


def test_check_reports_drift_in_one_line(data_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _edit_line(data_copy / "reasoning.jsonl", 3, lambda r: r.update(target="999"))
    problems = check(data_copy)
    assert len(problems) == 1
    assert "reasoning.jsonl differs from its generator" in problems[0]
    assert "reasoning-arithmetic-0003" in problems[0]
    assert main(["--check", "--data-dir", str(data_copy)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "python -m evals.suites --write" in err


@pytest.mark.parametrize("name", sorted(SPECS))
def test_sizes(name: str) -> None:
    spec = SPECS[name]
    full, quick = load_suite(name, "full"), load_suite(name, "quick")
    assert len(full) == sum(spec.full.values())
    assert len(quick) == sum(plan("quick", spec.full, spec.quick).values())
    assert 40 <= len(quick) <= 60
    by_id = {item.id: item for item in full}
    assert len(by_id) == len(full)
    assert all(by_id[item.id] == item for item in quick)  # quick is a subset, same ids and content
    assert all(item.suite == name for item in full)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_no_prompt_repeats_within_a_category(name: str) -> None:
    # A repeated question would be counted twice by the gate's paired statistics.
    by_category: dict[str, list[str]] = {}
    for item in load_suite(name):
        by_category.setdefault(item.category, []).append(item.prompt)
    assert {c: len(set(p)) for c, p in by_category.items()} == {c: len(p) for c, p in by_category.items()}


def test_full_sizes_as_asked() -> None:
    assert Counter(i.category for i in load_suite("reasoning")) == {
        "arithmetic": 250,
        "word_problem": 350,
        "comparison": 100,
        "logic": 100,
    }
    assert Counter(i.category for i in load_suite("tool_call")) == dict.fromkeys(
        ("simple", "multiple", "parallel", "irrelevance"), 150
    )
    lengths = Counter(i.meta["length"] for i in load_suite("long_context"))
    assert lengths == {"1k": 100, "2k": 100, "4k": 50, "8k": 50}


@pytest.mark.parametrize("name", sorted(SUITES))
def test_deterministic_for_a_seed_and_different_across_seeds(name: str) -> None:
    first = [item_hash(i) for i in SUITES[name](12, 7)]
    again = [item_hash(i) for i in SUITES[name](12, 7)]
    other = [item_hash(i) for i in SUITES[name](12, 8)]
    assert first == again
    assert len(set(first) & set(other)) <= 1


@pytest.mark.parametrize("name", sorted(SUITES))
def test_an_item_does_not_depend_on_the_size(name: str) -> None:
    frozen = {item.id: item for item in load_suite(name, "quick")}
    small = SUITES[name](9 if name == "long_context" else 10)
    if name == "long_context":  # token counts are measurements attached to frozen prompts
        assert all(i.meta["tokens"] == frozen[i.id].meta["tokens"] for i in small if i.id in frozen)
    assert small and all(item == frozen[item.id] for item in small if item.id in frozen)
    assert sum(item.id in frozen for item in small) == len(small)


def test_plan_splits_numbers_by_share() -> None:
    assert plan(10, {"a": 150, "b": 250, "c": 100, "d": 100}, 12) == {"a": 2, "b": 4, "c": 2, "d": 2}
    assert sum(plan(7, {"a": 1, "b": 1, "c": 1}, 1).values()) == 7
    with pytest.raises(SuiteError, match="unknown size 'huge'"):
        plan("huge", {"a": 1}, 1)


def test_hand_edited_file_is_refused(data_copy: Path) -> None:
    path = data_copy / "tool_call.jsonl"
    _edit_line(path, 0, lambda r: r.update(answer=(r["answer"] + 1) % 4))
    with pytest.raises(SuiteError) as error:
        load_suite("tool_call", "quick", data_dir=data_copy)
    message = str(error.value)
    assert "\n" not in message
    assert "tool_call.jsonl" in message and "does not match MANIFEST.json" in message
    assert "python -m evals.suites --write" in message
    load_suite("reasoning", data_dir=data_copy)  # the other files still load


def test_edited_long_context_construction_fails_its_prompt_hash(data_copy: Path) -> None:
    path = data_copy / "long_context.jsonl"
    _edit_line(
        path, 5, lambda r: r["meta"]["construction"].update(offset=r["meta"]["construction"]["offset"] + 1)
    )
    _refresh_manifest(data_copy, "long_context.jsonl")
    with pytest.raises(
        SuiteError, match=r"long_context.jsonl: item long_context-1k-niah_single-0005: the rebuilt"
    ):
        load_suite("long_context", data_dir=data_copy)


def test_not_json_is_a_one_line_error(data_copy: Path) -> None:
    path = data_copy / "reasoning.jsonl"
    path.write_text(path.read_text().replace("}\n", "\n", 1))
    _refresh_manifest(data_copy, "reasoning.jsonl")
    with pytest.raises(SuiteError, match=r"reasoning.jsonl:1: not valid JSON"):
        load_suite("reasoning", data_dir=data_copy)


def test_stale_generator_version_is_refused(data_copy: Path) -> None:
    manifest = json.loads((data_copy / MANIFEST).read_text())
    manifest["generator_version"] = 0
    (data_copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SuiteError, match="frozen with generator version 0"):
        load_suite("reasoning", data_dir=data_copy)


def test_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(SuiteError, match=r"MANIFEST\.json is missing"):
        load_suite("reasoning", data_dir=tmp_path)


def test_unknown_suite_and_size() -> None:
    with pytest.raises(
        SuiteError, match="unknown suite 'maths': choose one of long_context, reasoning, tool_call"
    ):
        load_suite("maths")
    with pytest.raises(SuiteError, match="unknown size 'medium' for suite reasoning"):
        load_suite("reasoning", "medium")
    assert issubclass(SuiteError, ValueError)


@pytest.mark.parametrize("name", sorted(SUITES))
def test_choices_are_unique_and_the_answer_is_right(name: str) -> None:
    for item in load_suite(name):
        # reasoning: 3 choices (logic: True / False), tuned to its default model's skill
        expected = (2 if item.category == "logic" else 3) if name == "reasoning" else 4
        if name == "tool_call" and item.category != "irrelevance":
            expected += 1  # the right call with its JSON broken (its syntax distractor)
        assert len(item.choices) == expected, item.id
        assert len(set(item.choices)) == len(item.choices), item.id
        assert 0 <= item.answer < len(item.choices), item.id
        assert item.meta["choice_kinds"][item.answer] == "correct", item.id
        right = item.choices[item.answer]
        if name == "reasoning":  # a number answer is the last number of its equation or sentence
            assert right == item.target or re.search(rf"\b{item.target}\.?$", right), item.id
        elif name == "tool_call":
            assert json.loads(right) == item.target, item.id
        else:
            assert right == ", ".join(item.target), item.id


def test_answers_are_spread_over_positions() -> None:
    for name in SUITES:
        items = load_suite(name)
        positions = Counter(item.answer for item in items)
        # each position's share of the answers it could hold (tool_call: 4 or 5 choices an item)
        expected = Counter()
        for item in items:
            for p in range(len(item.choices)):
                expected[p] += 1 / len(item.choices)
        assert all(positions[p] > 0.72 * expected[p] for p in expected), (name, positions, expected)
