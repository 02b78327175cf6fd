"""The eval gate: the candidate engine vs the baseline engine on the same items, suite by suite.

Each engine is scored item by item (``ScoreFn``: 0/1 per item, keyed by item id and the item's
content hash); the two lists are paired by id, and a pair whose hashes differ is an error (the
suite changed between the two scorings). Per suite, ``evals/stats.py`` gives the paired
bootstrap CI of the score difference, McNemar's exact test and the recovery, and the suite's
thresholds give PASS (non-inferiority shown), FAIL (a regression shown) or INCONCLUSIVE
(neither), with the suite's resolution: the smallest drop it detects and the items that would
settle it. The token-level drift of the run's quality record (held-out KL, top-1 agreement,
perplexity ratio; ``evals/drift.py``) is judged against its recipe family's bounds. The gate
FAILs when any suite or the drift rule does, else is INCONCLUSIVE when any is, else PASSes.
A category the suite-validity report (``evals/validity.py``) finds the reference cannot score
above chance, or scores perfectly, is kept out of its rule's verdict and listed in the row.

Scores of one engine on one suite depend only on the engine's content, the frozen suite and the
scoring settings, so they are cached by those (the baseline of a nightly matrix is scored once).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from evals.drift import DriftRule, judge_drift
from evals.stats import FAIL, INCONCLUSIVE, PASS, GateThresholds, compare_suite, resolution, verdict
from evals.validity import categories_of, invalid_categories, rule_settings
from pipeline.core.cache import computing_once, load_record, write_record
from pipeline.core.errors import PipelineError

log = logging.getLogger(__name__)

OUTCOMES = (PASS, INCONCLUSIVE, FAIL)  # best first: the gate's outcome is its worst row's
# Gate rules scored one way whatever ``eval.scoring`` says, each by a task of its own: rule ->
# (the suite whose items it scores, its scoring). ``tool_call_valid``: generated calls parsed
# with json and checked against the offered schemas (``evals/tasks/tool_valid.py``).
FIXED_SCORING = {"tool_call_valid": ("tool_call", "valid")}


def rule_scoring(rule: str, scoring: str) -> str:
    """How a gate rule is scored: its ``FIXED_SCORING``, else the gate's ``scoring``."""
    return FIXED_SCORING[rule][1] if rule in FIXED_SCORING else scoring


def rule_suite(rule: str) -> str:
    """The suite whose items a gate rule scores: the rule's own name, or its suite in
    ``FIXED_SCORING``."""
    return FIXED_SCORING[rule][0] if rule in FIXED_SCORING else rule


class GateError(PipelineError, ValueError):
    """The two scorings cannot be paired (different items, a changed suite, ...)."""


@dataclass(frozen=True)
class ItemScore:
    """One engine's result on one item; ``failure``: why it failed where its task says (a
    generated call's ``parse`` or ``schema`` failure), else ""."""

    id: str
    hash: str
    score: float
    failure: str = ""


# (engine folder, suite name) -> per-item scores
ScoreFn = Callable[[Path, str], list[ItemScore]]


def pair_scores(
    suite: str, baseline: Sequence[ItemScore], candidate: Sequence[ItemScore]
) -> tuple[list[float], list[float]]:
    """Scores of the same items in the same order; raise GateError unless both hold the same items."""
    base = {s.id: s for s in baseline}
    cand = {s.id: s for s in candidate}
    if len(base) != len(baseline) or len(cand) != len(candidate):
        raise GateError(f"eval suite '{suite}': an item id occurs twice in one scoring")
    if base.keys() != cand.keys():
        missing = sorted(base.keys() ^ cand.keys())
        raise GateError(
            f"eval suite '{suite}': the engines were scored on different items ({len(missing)} unpaired, "
            f"e.g. {missing[0]}); score both with the same eval settings"
        )
    changed = [i for i in base if base[i].hash != cand[i].hash]
    if changed:
        raise GateError(
            f"eval suite '{suite}': item {changed[0]} differs between the two scorings "
            f"({len(changed)} items); the suite changed in between: score both again"
        )
    ids = sorted(base)
    return [base[i].score for i in ids], [cand[i].score for i in ids]


def judge_suite(
    suite: str,
    baseline: Sequence[ItemScore],
    candidate: Sequence[ItemScore],
    thresholds: GateThresholds,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> dict[str, Any]:
    """One row of the gate table: scores, difference with CI, McNemar, recovery, verdict, and the
    suite's resolution (minimum detectable drop, items needed) at its measured discordance."""
    base, cand = pair_scores(suite, baseline, candidate)
    comparison = compare_suite(base, cand, confidence=confidence, resamples=resamples, seed=seed)
    outcome, reasons = verdict(comparison, thresholds)
    row = asdict(comparison)
    row["p_value"] = comparison.mcnemar.p_value if comparison.mcnemar else None
    sized = None
    if 0.0 < thresholds.max_drop <= 1.0:  # a margin of 0 (or above the scale) sizes nothing
        sized = resolution(base, cand, thresholds.max_drop, alpha=1.0 - confidence)
    row["resolution"] = asdict(sized) if sized else None
    row["failures"] = failure_counts(baseline, candidate)
    if outcome == INCONCLUSIVE and sized is not None:
        reasons.append(
            f"at its discordance this suite detects drops of {sized.minimum_detectable_drop:.3f} or more "
            f"({sized.power:.0%} power); about {sized.items_needed} items would settle "
            f"max_drop={thresholds.max_drop:g} (it has {comparison.n}): run eval=full, or raise eval.limit"
        )
    row.update({"verdict": outcome, "reasons": reasons, "thresholds": asdict(thresholds)})
    return row


def failure_counts(
    baseline: Sequence[ItemScore], candidate: Sequence[ItemScore]
) -> dict[str, dict[str, int]] | None:
    """Failed items by reason, per engine (``{"baseline": {"parse": 3, ...}, ...}``), or None
    where the suite's task gives no reasons."""
    if not any(s.failure for s in (*baseline, *candidate)):
        return None
    counts: dict[str, dict[str, int]] = {}
    for name, scores in (("baseline", baseline), ("candidate", candidate)):
        counts[name] = dict(sorted(Counter(s.failure for s in scores if s.failure).items()))
    return counts


def overall(rows: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """The gate's verdict and one-line reason from its rows (suites, and the ``drift`` row)."""
    worst = max((row["verdict"] for row in rows.values()), key=OUTCOMES.index, default=PASS)
    if worst == PASS:
        return PASS, f"{len(rows)} rule(s) within thresholds"
    named = [name for name, row in rows.items() if row["verdict"] == worst]
    return worst, "; ".join(f"{name}: {rows[name]['reasons'][0]}" for name in named)


def suite_settings(settings: dict[str, Any], suite: str) -> dict[str, Any]:
    """``settings`` with its ``suites`` file hashes narrowed to the files of the suite that
    ``suite`` (a gate rule) scores (``<suite>.jsonl``, ``<suite>.tokens.json``): regenerating one
    suite keeps the scores of the others cached."""
    files = settings.get("suites")
    if not isinstance(files, dict):
        return settings
    source = rule_suite(suite)
    return {**settings, "suites": {name: h for name, h in files.items() if name.split(".")[0] == source}}


def cached_scores(
    score_fn: ScoreFn, engine: Path, digest: str, suite: str, settings: dict[str, Any], cache_dir: Path | None
) -> list[ItemScore]:
    """``score_fn(engine, suite)``, kept under ``cache_dir/eval/`` by engine digest, suite and settings."""
    if cache_dir is None:
        return score_fn(engine, suite)
    settings = suite_settings(settings, suite)
    key = json.dumps({"engine": digest, "suite": suite, "settings": settings}, sort_keys=True, default=str)
    name = hashlib.sha256(key.encode()).hexdigest()
    path = cache_dir / "eval" / f"{name}.json"
    expected = json.loads(key)
    scores = _recorded_scores(path, suite, digest, expected)
    if scores is not None:
        return scores
    # Jobs sharing the cache (a sweep) score an engine once: the others wait, then read it.
    with computing_once(cache_dir, f"eval-{name}", f"the {suite} scores of {digest[:12]}"):
        scores = _recorded_scores(path, suite, digest, expected)
        if scores is None:
            log.info("eval: scoring %s of %s", suite, digest[:12])
            started = time.monotonic()
            scores = score_fn(engine, suite)
            log.info(
                "eval: scored %s of %s: %d items in %.1f s",
                suite,
                digest[:12],
                len(scores),
                time.monotonic() - started,
            )
            record = {"key": expected, "items": [asdict(s) for s in scores]}
            problem = scores_problem(json.loads(json.dumps(record)), expected)
            if problem is not None:  # never cached: it would be read back as broken
                raise GateError(f"eval suite '{suite}': the scores of {engine} are unusable ({problem})")
            write_record(cache_dir, path, record)
    return scores


ITEM_FIELDS = {f.name for f in fields(ItemScore)}
OPTIONAL_ITEM_FIELDS = {"failure"}  # absent from records written before it existed
MAX_FAILURE = 40  # characters of a failure reason's name


def scores_problem(record: dict[str, Any], key: Any) -> str | None:
    """What is wrong with a cached score record for ``key`` (engine, suite, settings), or None:
    another key, or items that are not ``{id, hash, score}`` with text ids and hashes, each id once,
    and a finite score in [0, 1]."""
    if record.get("key") != key:
        return "it holds the scores of another engine, suite or settings"
    items = record.get("items")
    if not isinstance(items, list):
        return "its items are not a list"
    ids = set()
    for index, item in enumerate(items):
        if not isinstance(item, dict) or not ITEM_FIELDS - OPTIONAL_ITEM_FIELDS <= set(item) <= ITEM_FIELDS:
            return f"item #{index} is not an object of {', '.join(sorted(ITEM_FIELDS))}"
        failure = item.get("failure", "")
        if not isinstance(failure, str) or len(failure) > MAX_FAILURE:
            return f"item #{index}'s failure is not a short text"
        if not (isinstance(item["id"], str) and isinstance(item["hash"], str)):
            return f"item #{index}'s id or hash is not text"
        score = item["score"]
        if isinstance(score, bool) or not isinstance(score, int | float) or not 0.0 <= score <= 1.0:
            return f"item {item['id']!r} has a score of {score!r}, not a number in [0, 1]"
        if item["id"] in ids:
            return f"item {item['id']!r} occurs twice"
        ids.add(item["id"])
    return None


def _recorded_scores(path: Path, suite: str, digest: str, key: Any) -> list[ItemScore] | None:
    """The scores a record holds, or None (absent, or not fitting: removed and scored again)."""
    record = load_record(path, check=lambda record: scores_problem(record, key))
    if record is None:
        return None
    scores = [ItemScore(**entry) for entry in record["items"]]
    log.info("eval: %s scores of %s from the cache", suite, digest[:12])
    return scores


def run_gate(
    candidate: tuple[Path, str],
    baseline: tuple[Path, str],
    suites: Sequence[str],
    thresholds: dict[str, GateThresholds],
    score_fn: ScoreFn,
    settings: dict[str, Any],
    drift: tuple[str, DriftRule] | None = None,
    quality: dict[str, Any] | None = None,
    cache_dir: Path | None = None,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
    validity: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Score both engines (folder, content digest) on every suite and judge each, and judge the
    token-level drift of ``quality`` (the held-out comparison with the reference) by the rule of
    the recipe's family (``drift``: family, rule; None: the suites alone); the record the run
    manifest keeps as ``gate``. ``settings`` (suite size, scoring, ...) key the score cache.
    ``validity``: the suite-validity report (``evals.validity``) of the reference engine it
    names; where that is the baseline, the items of a category it marks invalid are kept out of
    the verdict, and each row lists them (``kept_out``). It describes what one model can do: the
    default model's report says nothing of another checkpoint's categories."""
    if validity is not None and validity.get("reference") != baseline[1]:
        log.info("gate: the suite-validity report measured another reference: no category is kept out")
        validity = None
    rows: dict[str, dict[str, Any]] = {}
    for number, suite in enumerate(suites, start=1):
        # A line as each suite starts and ends: scoring a long suite takes minutes on a loaded host.
        where = f"gate: suite {number}/{len(suites)} {suite}"
        same = candidate[1] == baseline[1]
        engines = (
            "the engine (baseline and candidate are one)" if same else "the baseline, then the candidate"
        )
        log.info("%s: scoring %s", where, engines)
        started = time.monotonic()
        base = cached_scores(score_fn, baseline[0], baseline[1], suite, settings, cache_dir)
        if same:
            cand = base  # the same engine: scored once
        else:
            cand = cached_scores(score_fn, candidate[0], candidate[1], suite, settings, cache_dir)
        base, cand, kept_out = keep_valid(suite, base, cand, settings, validity)
        row = judge_suite(suite, base, cand, thresholds[suite], confidence, resamples, seed)
        row["kept_out"] = kept_out
        rows[suite] = row
        log.info(
            "%s: done, %d items in %.1f s: baseline %.1f%%, candidate %.1f%%: %s",
            where,
            row["n"],
            time.monotonic() - started,
            100 * row["baseline_mean"],
            100 * row["candidate_mean"],
            row["verdict"],
        )
    token_row = judge_drift(quality, drift[1], drift[0]) if drift else None
    outcome, reason = overall({**rows, **({"token drift": token_row} if token_row else {})})
    return {
        "verdict": outcome,
        "reason": reason,
        "suites": rows,
        "drift": token_row,
        "settings": settings,
        "kl": ((token_row or {}).get("measured") or {}).get("kl"),
        "baseline": baseline[1],
        "candidate": candidate[1],
        "same_engine": candidate[1] == baseline[1],
    }


def keep_valid(
    rule: str,
    baseline: list[ItemScore],
    candidate: list[ItemScore],
    settings: dict[str, Any],
    validity: dict[str, Any] | None,
) -> tuple[list[ItemScore], list[ItemScore], list[dict[str, Any]]]:
    """Both scorings without the items of the categories ``validity`` marks invalid for ``rule``
    under ``settings``, and what was kept out: per category, the items, the reference's accuracy
    and the chance level (at full size, as the report measured them) and why."""
    scoring = rule_scoring(rule, str(settings.get("scoring")))
    invalid = invalid_categories(validity, rule, rule_settings(suite_settings(settings, rule), scoring))
    if not invalid:
        return baseline, candidate, []
    category = categories_of(rule_suite(rule), str(settings.get("size")))
    dropped = Counter(category.get(s.id) for s in baseline if category.get(s.id) in invalid)
    kept_out = [
        {"category": name, "items": count, **{k: invalid[name][k] for k in ("accuracy", "chance", "reason")}}
        for name, count in sorted(dropped.items())
    ]
    base = [s for s in baseline if category.get(s.id) not in invalid]
    cand = [s for s in candidate if category.get(s.id) not in invalid]
    if not base:
        raise GateError(
            f"eval rule '{rule}': every item scored is of a category kept out as invalid "
            f"({', '.join(sorted(dropped))}): raise eval.limit, or score another rule"
        )
    return base, cand, kept_out


def check_suites(suites: Sequence[str], thresholds: dict[str, Any], known: Sequence[str]) -> None:
    """A one-line GateError for an unknown suite name or a selected suite without thresholds."""
    for suite in suites:
        if suite not in known:
            raise GateError(f"eval.suites: unknown suite {suite!r}; choose from {', '.join(known)}")
        if suite not in thresholds:
            raise GateError(
                f"eval.thresholds has no entry for suite {suite!r}: add its max_drop and min_recovery"
            )
    if not suites:
        raise GateError("eval.suites is empty: name at least one suite, or set eval=none")
