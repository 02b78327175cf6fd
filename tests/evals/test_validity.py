"""Suite-category validity (``evals/validity.py``) and the gate keeping invalid categories out of
its verdict: scores given as data over the real frozen suites' items (no engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from scipy.stats import binomtest

from evals.gate import ItemScore, rule_scoring, rule_suite, run_gate
from evals.stats import FAIL, PASS, GateThresholds
from evals.suites import DATA_DIR, load_suite
from evals.tasks.tool_valid import NO_CALL_CATEGORY
from evals.validity import (
    REPORT,
    ValidityError,
    above_chance_p,
    build_report,
    invalid_categories,
    item_chance,
    judge_category,
    judge_rule,
    read_report,
    recorded_scores,
    report_table,
    rule_settings,
    write_report,
)
from pipeline.config import EvalConfig
from pipeline.summary import gate_table, gate_verdict_lines

TOOL_CALL = load_suite("tool_call", "full")
REASONING = load_suite("reasoning", "full")
SETTINGS = {"size": "full", "scoring": "rank", "rank_metric": "acc_norm", "chat": True, "suites": {}}


def category(items: list[Any], name: str) -> list[Any]:
    return [item for item in items if item.category == name]


def right(items: list[Any], count: int) -> dict[str, float]:
    """The first ``count`` items (by id) right, the others wrong."""
    ordered = sorted(items, key=lambda item: item.id)
    return {item.id: float(k < count) for k, item in enumerate(ordered)}


def test_chance_is_one_over_the_choices_where_a_guess_can_score() -> None:
    logic, arithmetic = category(REASONING, "logic")[0], category(REASONING, "arithmetic")[0]
    simple = category(TOOL_CALL, "simple")[0]
    assert item_chance(logic, "rank") == 1 / len(logic.choices) == 0.5
    assert item_chance(simple, "rank") == 1 / len(simple.choices) == 0.2
    assert item_chance(logic, "gen") == 0.5  # a named choice
    assert item_chance(arithmetic, "gen") == 0.0  # a free number
    assert item_chance(simple, "valid") == 0.0  # a generated call


def test_the_test_against_chance_is_the_exact_binomial_where_chances_are_equal() -> None:
    for correct in (0, 40, 55, 150):
        expected = binomtest(correct, 150, 0.25, alternative="greater").pvalue
        assert above_chance_p(correct, [0.25] * 150) == pytest.approx(expected, rel=1e-9)
    assert above_chance_p(0, [0.0] * 10) == 1.0 and above_chance_p(1, [0.0] * 10) == 0.0


def test_a_category_is_valid_above_chance_and_below_ceiling() -> None:
    simple = category(TOOL_CALL, "simple")  # 150 items, chance 20%
    valid = judge_category("simple", simple, right(simple, 60), "rank", alpha=0.01)
    assert valid.valid and valid.reason == "" and valid.accuracy == 0.4 and valid.chance == pytest.approx(0.2)
    assert valid.scores == "1" * 60 + "0" * 90 and valid.p_value < 1e-6
    at_chance = judge_category("simple", simple, right(simple, 33), "rank", alpha=0.01)
    assert not at_chance.valid and "not above chance (33/150 right, chance 20.0%" in at_chance.reason
    ceiling = judge_category("simple", simple, right(simple, 150), "rank", alpha=0.01)
    assert not ceiling.valid and "at ceiling (150/150 right)" in ceiling.reason
    nothing = judge_category("simple", simple, right(simple, 0), "valid", alpha=0.01)
    assert not nothing.valid and nothing.chance == 0.0 and nothing.p_value == 1.0
    with pytest.raises(ValidityError, match="no score for tool_call-simple-0149"):
        judge_category("simple", simple, right(simple[:-1], 3), "rank", alpha=0.01)


def report(tmp_path: Path, irrelevance_right: int = 0) -> tuple[dict[str, Any], Path]:
    scores = {
        **right(category(TOOL_CALL, "simple"), 60),
        **right(category(TOOL_CALL, "multiple"), 70),
        **right(category(TOOL_CALL, "parallel"), 50),
        **right(category(TOOL_CALL, "irrelevance"), irrelevance_right),
    }
    matched = rule_settings(SETTINGS, "rank")
    built = build_report({"tool_call": (matched, TOOL_CALL, scores)}, "digest", confidence=0.95)
    path = tmp_path / "validity.json"
    write_report(path, built)
    return built, path


def test_a_report_is_bonferroni_corrected_written_read_and_printed(tmp_path: Path) -> None:
    built, path = report(tmp_path)
    assert built["alpha"] == pytest.approx(0.05 / 4)  # four categories: four claims
    assert read_report(path) == json.loads(path.read_text())
    categories = built["rules"]["tool_call"]["categories"]
    assert [name for name, c in categories.items() if not c["valid"]] == ["irrelevance"]
    lines = report_table(built)
    assert any(line.startswith("tool_call        irrelevance") and "INVALID" in line for line in lines)
    assert any("simple" in line and "40.0%" in line and "20.0%" in line for line in lines)


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda r: r["rules"]["tool_call"]["categories"]["simple"].update(correct=61), "do not add up"),
        (lambda r: r["rules"]["tool_call"]["categories"]["simple"].update(scores="2" * 150), "0/1 text"),
        (lambda r: r["rules"]["tool_call"]["categories"]["simple"].update(chance=1.5), "chance is not"),
        (lambda r: r["rules"]["tool_call"]["categories"]["irrelevance"].update(reason=""), "needs a reason"),
        (lambda r: r.update(version=0), "not a version-1 report"),
    ],
)
def test_a_damaged_report_is_a_one_line_error(tmp_path: Path, damage: Any, needle: str) -> None:
    built, path = report(tmp_path)
    damage(built)
    path.write_text(json.dumps(built))
    with pytest.raises(ValidityError, match=needle) as error:
        read_report(path)
    assert "\n" not in str(error.value) and "python -m pipeline.gate --validity" in str(error.value)


def test_a_report_applies_only_to_the_settings_it_measured(tmp_path: Path) -> None:
    built, _ = report(tmp_path)
    assert set(invalid_categories(built, "tool_call", rule_settings(SETTINGS, "rank"))) == {"irrelevance"}
    raw = {**SETTINGS, "chat": False}
    assert invalid_categories(built, "tool_call", rule_settings(raw, "rank")) == {}
    assert invalid_categories(built, "tool_call", rule_settings(SETTINGS, "gen")) == {}
    assert invalid_categories(built, "reasoning", rule_settings(SETTINGS, "rank")) == {}
    assert invalid_categories(None, "tool_call", rule_settings(SETTINGS, "rank")) == {}


def item_scores(items: list[Any], right_ids: set[str]) -> list[ItemScore]:
    return [ItemScore(item.id, "h" + item.id, float(item.id in right_ids)) for item in items]


def test_the_gate_keeps_invalid_categories_out_of_its_verdict(tmp_path: Path) -> None:
    """A candidate that loses every irrelevance item the reference got right: a FAIL while the
    category counts, a PASS once the report of this baseline marks it invalid (kept out and
    listed)."""
    built, _ = report(tmp_path, irrelevance_right=0)
    quick = load_suite("tool_call", "quick")
    base_right = {item.id for item in quick}  # the reference right on every quick item
    cand_right = {item.id for item in quick if item.category != "irrelevance"}
    scorings = {"b": item_scores(quick, base_right), "c": item_scores(quick, cand_right)}
    kwargs: dict[str, Any] = {
        "suites": ["tool_call"],
        "thresholds": {"tool_call": GateThresholds(0.15, 0.85)},
        "score_fn": lambda engine, suite: scorings[engine.name],
        "settings": {**SETTINGS, "size": "quick"},
    }
    counted = run_gate((tmp_path / "c", "d-c"), (tmp_path / "b", "digest"), **kwargs)
    assert counted["verdict"] == FAIL and counted["suites"]["tool_call"]["kept_out"] == []
    # the report of another reference (another model) keeps nothing out
    other = run_gate((tmp_path / "c", "d-c"), (tmp_path / "b", "d-b"), **kwargs, validity=built)
    assert other["verdict"] == FAIL and other["suites"]["tool_call"]["kept_out"] == []
    record = run_gate((tmp_path / "c", "d-c"), (tmp_path / "b", "digest"), **kwargs, validity=built)
    row = record["suites"]["tool_call"]
    assert record["verdict"] == PASS and row["n"] == 36
    assert row["kept_out"] == [
        {
            "category": "irrelevance",
            "items": 12,
            "accuracy": 0.0,
            "chance": 0.25,
            "reason": built["rules"]["tool_call"]["categories"]["irrelevance"]["reason"],
        }
    ]
    shown = "irrelevance kept out (12 items; reference 0.0% at full, chance 25.0%)"
    assert shown in str(gate_table(record).caption)
    assert any(shown in line for line in gate_verdict_lines(record))


def test_the_projects_report_is_current_and_follows_from_its_scores() -> None:
    """``evals/data/suite_validity.json`` was measured on the suites as they are (file hashes),
    under the gate's default settings for the default model (rank scoring by acc_norm, its chat
    format), holds every category of every default rule, and each outcome follows from the
    reference's scores it records. Measure it again when this fails (docs/gate.md)."""
    report = read_report(REPORT)
    files = json.loads((DATA_DIR / "MANIFEST.json").read_text())["files"]
    default = EvalConfig()
    rules = list(default.suites)
    assert sorted(report["rules"]) == sorted(rules)
    expected = {rule: {item.category for item in load_suite(rule_suite(rule), "full")} for rule in rules}
    if "tool_call_valid" in expected:  # its items are the calling ones
        expected["tool_call_valid"] -= {NO_CALL_CATEGORY}
    assert {rule: set(entry["categories"]) for rule, entry in report["rules"].items()} == expected
    total = sum(len(categories) for categories in expected.values())
    assert report["alpha"] == pytest.approx((1 - report["confidence"]) / total)
    for rule in rules:
        suite, entry = rule_suite(rule), report["rules"][rule]
        current = {name: f["sha256"] for name, f in files.items() if name.split(".")[0] == suite}
        scoring = rule_scoring(rule, str(default.scoring))
        assert entry["settings"]["suites"] == current, f"{rule}: measured on other suite files"
        assert entry["settings"] == rule_settings(
            {"suites": current, "chat": True, "rank_metric": default.rank_metric}, scoring
        )
        judged = judge_rule(
            load_suite(suite, "full"), recorded_scores(report, rule, suite), scoring, report["alpha"]
        )
        for name, validity in judged.items():
            record = entry["categories"][name]
            assert (validity.valid, validity.reason, validity.correct) == (
                record["valid"],
                record["reason"],
                record["correct"],
            )
            assert validity.p_value == pytest.approx(record["p_value"], rel=1e-9, abs=1e-300)
            assert validity.chance == pytest.approx(record["chance"])
