"""Suite-category validity: can each category of each gate rule tell engines apart?

A category is valid when the reference engine (the unoptimized default model) scores it
significantly above chance and below ceiling at full size. A category the reference cannot score
(the ``irrelevance`` calls no model of 135M ranks first) is a block of items every engine fails
alike: it dilutes the rule's mean and its recovery without ever adding evidence; one the
reference gets entirely right has no room to show that a candidate does as well by luck.

- Chance, per item: a guesser's probability of scoring it. Ranked choices and a named choice
  (``meta["match"] == "choice"``): 1 / the number of choices; a free answer (a number, needles,
  a call checked by its AST) and a generated call checked by json and jsonschema: 0.
- Above chance: the exact one-sided test of the reference's number of right items against the
  Poisson-binomial distribution of a guesser's (the items' chances may differ;
  ``scipy.stats.poisson_binom``), at ``1 - confidence`` split over every category of the report
  (Bonferroni, Dunn 1961: the report makes one claim per category).
- Below ceiling: the reference misses at least one item.

The report (``REPORT``, written by ``python -m pipeline.gate --validity``) holds, per rule, the
settings its scores were measured under and, per category, the items, the reference's right
ones, its accuracy, the chance level, the p-value, the outcome and the reference's 0/1 score of
each item in id order. The gate keeps the items of a category the report marks invalid out of its
verdict when the rule's settings (suite file, scoring, rank metric, chat format) are those the
report measured, and reports them apart. Data only: numbers and records in and out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import poisson_binom

from evals.suites import Item, load_suite
from pipeline.core.artifacts import write_json
from pipeline.core.errors import PipelineError
from pipeline.core.files import loads_bounded, read_regular_text

REPORT = Path(__file__).resolve().parent / "data" / "suite_validity.json"
REPORT_VERSION = 1
# The settings a rule's scores depend on besides the engine and the suite's size: a report
# applies to a gate whose settings agree on these (``rank_metric`` only where scoring is rank).
MATCHED = ("suites", "scoring", "rank_metric", "chat")
MAX_ITEMS = 100_000  # items of one category in a report: far above the full suites' 350


class ValidityError(PipelineError, ValueError):
    """A validity report that cannot be used (unreadable, mistyped, out of range)."""


@dataclass(frozen=True)
class CategoryValidity:
    """One category of one rule as the reference scored it; ``reason``: why it is invalid, or ""."""

    category: str
    n: int
    correct: int
    accuracy: float
    chance: float
    p_value: float
    valid: bool
    reason: str
    scores: str  # the reference's score of each item, "0" or "1", in item-id order


def item_chance(item: Item, scoring: str) -> float:
    """A guesser's probability of scoring ``item`` under ``scoring`` (rank, gen, valid)."""
    if scoring == "rank" or (scoring == "gen" and item.meta.get("match") == "choice"):
        return 1.0 / len(item.choices)
    return 0.0


def above_chance_p(correct: int, chances: Sequence[float]) -> float:
    """P(a guesser scores ``correct`` or more items), each item right with its own chance."""
    return float(poisson_binom(np.asarray(chances, dtype=np.float64)).sf(correct - 1))


def judge_category(
    category: str, items: Sequence[Item], scores: Mapping[str, float], scoring: str, alpha: float
) -> CategoryValidity:
    """The validity of one category from the reference's 0/1 ``scores`` (by item id) of ``items``;
    ``alpha``: the level of this category's test (Bonferroni's share already taken)."""
    ordered = sorted(items, key=lambda item: item.id)
    missing = [item.id for item in ordered if item.id not in scores]
    if missing:
        raise ValidityError(f"category {category!r}: the reference has no score for {missing[0]}")
    bits = [scores[item.id] for item in ordered]
    if any(bit not in (0.0, 1.0) for bit in bits):
        raise ValidityError(f"category {category!r}: validity needs 0/1 scores")
    n, correct = len(bits), int(sum(bits))
    chances = [item_chance(item, scoring) for item in ordered]
    chance = float(np.mean(chances))
    p_value = above_chance_p(correct, chances)
    reason = ""
    if p_value >= alpha:
        reason = (
            f"the reference is not above chance ({correct}/{n} right, chance {chance:.1%}, p {p_value:.2g})"
        )
    elif correct == n:
        reason = f"the reference is at ceiling ({n}/{n} right): no room to see a candidate match it by luck"
    return CategoryValidity(
        category=category,
        n=n,
        correct=correct,
        accuracy=correct / n,
        chance=chance,
        p_value=p_value,
        valid=not reason,
        reason=reason,
        scores="".join(str(int(bit)) for bit in bits),
    )


def rule_items(items: Sequence[Item], scores: Mapping[str, float]) -> list[Item]:
    """The items of the categories a rule scores: those with at least one item in ``scores``
    (``tool_call_valid`` scores no ``irrelevance`` item; the rank rule does)."""
    scored = {item.category for item in items if item.id in scores}
    return [item for item in items if item.category in scored]


def judge_rule(
    items: Sequence[Item], scores: Mapping[str, float], scoring: str, alpha: float
) -> dict[str, CategoryValidity]:
    """Every category of one rule's ``items`` that it scores (category -> validity, in name
    order); a category scored in part is an error."""
    groups: dict[str, list[Item]] = {}
    for item in rule_items(items, scores):
        groups.setdefault(item.category, []).append(item)
    return {name: judge_category(name, groups[name], scores, scoring, alpha) for name in sorted(groups)}


def build_report(
    rules: Mapping[str, tuple[dict[str, Any], Sequence[Item], Mapping[str, float]]],
    reference: str,
    confidence: float,
) -> dict[str, Any]:
    """The report of the reference engine (content digest ``reference``): per rule, (its settings,
    as ``rule_settings`` gives them; its items at full size; the reference's scores by id)."""
    tests = sum(
        len({item.category for item in rule_items(items, scores)}) for _, items, scores in rules.values()
    )
    alpha = (1.0 - confidence) / max(tests, 1)
    report: dict[str, Any] = {
        "version": REPORT_VERSION,
        "reference": reference,
        "confidence": confidence,
        "alpha": alpha,
        "rules": {},
    }
    for rule, (settings, items, scores) in rules.items():
        judged = judge_rule(items, scores, settings["scoring"], alpha)
        report["rules"][rule] = {
            "settings": settings,
            "categories": {name: _category_record(v) for name, v in judged.items()},
        }
    return report


def _category_record(validity: CategoryValidity) -> dict[str, Any]:
    record = asdict(validity)
    del record["category"]  # the key
    return record


def rule_settings(settings: Mapping[str, Any], scoring: str) -> dict[str, Any]:
    """What of a gate rule's score settings (as the gate's cache key holds them, narrowed to the
    rule's suite files) a report must match: ``MATCHED``, with the rule's own ``scoring``."""
    matched = {"suites": dict(settings.get("suites") or {}), "scoring": scoring, "chat": settings.get("chat")}
    if scoring == "rank":
        matched["rank_metric"] = settings.get("rank_metric")
    return matched


def read_report(path: Path = REPORT) -> dict[str, Any]:
    """A report, checked: its fields typed and ranged (it is read from disk); a ValidityError
    names what is wrong."""
    try:
        report = loads_bounded(read_regular_text(path, what="a suite-validity report"))
    except (OSError, UnicodeDecodeError, ValueError, PipelineError) as exc:
        raise ValidityError(f"{path}: unreadable suite-validity report ({exc})") from None
    problem = report_problem(report)
    if problem:
        raise ValidityError(f"{path}: {problem}; write it again: python -m pipeline.gate --validity {path}")
    return report


def report_problem(report: Any) -> str | None:
    """What is wrong with a report's shape, or None."""
    if not isinstance(report, dict) or report.get("version") != REPORT_VERSION:
        return f"not a version-{REPORT_VERSION} report"
    if not isinstance(report.get("rules"), dict):
        return "its rules are not an object"
    for rule, entry in report["rules"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("settings"), dict):
            return f"rule {rule!r} has no settings"
        categories = entry.get("categories")
        if not isinstance(categories, dict) or not categories:
            return f"rule {rule!r} has no categories"
        for name, record in categories.items():
            problem = _record_problem(record)
            if problem:
                return f"rule {rule!r}, category {name!r}: {problem}"
    return None


def _record_problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return "not an object"
    n, correct, scores = record.get("n"), record.get("correct"), record.get("scores")
    if not (isinstance(n, int) and 0 < n <= MAX_ITEMS and isinstance(correct, int) and 0 <= correct <= n):
        return "its item counts are not 0 <= correct <= n"
    if not (isinstance(scores, str) and len(scores) == n and set(scores) <= {"0", "1"}):
        return "its scores are not a 0/1 text of n characters"
    if scores.count("1") != correct:
        return "its scores do not add up to its right items"
    for key in ("accuracy", "chance", "p_value"):
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
            return f"its {key} is not a number in [0, 1]"
    if not isinstance(record.get("valid"), bool) or not isinstance(record.get("reason"), str):
        return "its outcome is not a boolean with a reason"
    if record["valid"] == bool(record["reason"]):
        return "an invalid category needs a reason, a valid one none"
    return None


def invalid_categories(
    report: Mapping[str, Any] | None, rule: str, settings: Mapping[str, Any]
) -> dict[str, Any]:
    """The categories of ``rule`` the report marks invalid (name -> record), where the report
    measured the rule under ``settings`` (``rule_settings``); {} where it did not, or no report."""
    entry = (report or {}).get("rules", {}).get(rule)
    if not entry or not _same_settings(entry["settings"], settings):
        return {}
    return {name: record for name, record in entry["categories"].items() if not record["valid"]}


def _same_settings(recorded: Mapping[str, Any], settings: Mapping[str, Any]) -> bool:
    return all(recorded.get(key) == settings.get(key) for key in MATCHED)


def recorded_scores(report: Mapping[str, Any], rule: str, suite: str) -> dict[str, float]:
    """The reference's score of each item of ``rule`` (scoring the items of ``suite``) as the
    report recorded it, by item id."""
    categories = report["rules"][rule]["categories"]
    groups: dict[str, list[str]] = {}
    for item in load_suite(suite, "full"):
        groups.setdefault(item.category, []).append(item.id)
    scores: dict[str, float] = {}
    for name, record in categories.items():
        ids = groups.get(name, [])
        if record["n"] != len(ids):
            raise ValidityError(
                f"the report's {rule!r} holds {record['n']} items of {name!r}, the suite {len(ids)}"
            )
        scores.update(zip(sorted(ids), (float(bit) for bit in record["scores"]), strict=True))
    return scores


def categories_of(suite: str, size: str) -> dict[str, str]:
    """Item id -> category of a suite's items at ``size``."""
    return {item.id: item.category for item in load_suite(suite, size)}


def report_table(report: Mapping[str, Any]) -> list[str]:
    """The report as text lines: rule, category, reference accuracy, chance, p, outcome."""
    lines = [f"{'rule':<16} {'category':<18} {'right':>9} {'accuracy':>8} {'chance':>7} {'p':>9}  outcome"]
    for rule, entry in report["rules"].items():
        for name, record in entry["categories"].items():
            outcome = "valid" if record["valid"] else f"INVALID: {record['reason']}"
            lines.append(
                f"{rule:<16} {name:<18} {record['correct']:>4}/{record['n']:<4} {record['accuracy']:>8.1%} "
                f"{record['chance']:>7.1%} {_p_text(record['p_value']):>9}  {outcome}"
            )
    return lines


def _p_text(p_value: float) -> str:
    return "<1e-15" if p_value < 1e-15 else f"{p_value:.2g}"


def write_report(path: Path, report: Mapping[str, Any]) -> None:
    """``report`` as sorted, indented JSON (one diff line per changed field), replaced at once:
    nothing half-written after a crash or Ctrl-C."""
    write_json(path, dict(report))
