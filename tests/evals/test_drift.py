"""The gate's token-level drift rule: each bound, an unmeasured engine, bad bounds."""

from __future__ import annotations

import math

import pytest

from evals.drift import DriftRule, drift_numbers, judge_drift
from evals.stats import FAIL, INCONCLUSIVE, PASS

RULE = DriftRule(max_kl=0.08, min_top1=0.85, max_ppl_ratio=1.06)
GOOD = {"kl_mean": 0.04, "top1_agreement": 0.889, "perplexity": 25.54, "reference_perplexity": 24.925}


def test_a_recipe_inside_every_bound_passes_with_one_line_a_bound() -> None:
    row = judge_drift(GOOD, RULE, "bits8")
    assert row["verdict"] == PASS and len(row["reasons"]) == 3
    assert row["measured"] == {"kl": 0.04, "top1": 0.889, "ppl_ratio": pytest.approx(25.54 / 24.925)}
    assert row["family"] == "bits8" and row["rule"]["max_kl"] == 0.08


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"kl_mean": 0.30}, "KL 0.3 breaks max_kl=0.08"),
        ({"top1_agreement": 0.80}, "top-1 agreement 0.8 breaks min_top1=0.85"),
        ({"perplexity": 30.0}, "perplexity ratio 1.204 breaks max_ppl_ratio=1.06"),
    ],
)
def test_each_bound_alone_fails_the_engine(change: dict[str, float], needle: str) -> None:
    row = judge_drift({**GOOD, **change}, RULE, "bits8")
    assert row["verdict"] == FAIL and len(row["reasons"]) == 1
    assert row["reasons"][0].startswith(needle) and row["reasons"][0].endswith("(family bits8)")


def test_a_bound_set_to_null_is_not_checked() -> None:
    rule = DriftRule(max_kl=None, min_top1=0.85, max_ppl_ratio=None)
    row = judge_drift({**GOOD, "kl_mean": 5.0, "perplexity": 99.0}, rule, "bits8")
    assert row["verdict"] == PASS and len(row["reasons"]) == 1
    assert judge_drift(None, DriftRule(), "fp32")["verdict"] == PASS  # a family without bounds


@pytest.mark.parametrize(
    "quality",
    [None, {}, {"kl_mean": 0.01}, {**GOOD, "kl_mean": math.nan}, {**GOOD, "reference_perplexity": 0.0}],
)
def test_an_unmeasured_drift_cannot_pass(quality: dict[str, float] | None) -> None:
    row = judge_drift(quality, RULE, "bits8")
    assert row["verdict"] == INCONCLUSIVE and row["measured"] is None
    assert "no valid KL" in row["reasons"][0]


def test_the_same_engine_measures_no_drift() -> None:
    same = {"kl_mean": 0.0, "top1_agreement": 1.0, "perplexity": 24.9, "reference_perplexity": 24.9}
    assert drift_numbers(same) == {"kl": 0.0, "top1": 1.0, "ppl_ratio": 1.0}
    assert judge_drift(same, DriftRule(0.005, 0.97, 1.01), "fp32")["verdict"] == PASS


@pytest.mark.parametrize("kwargs", [{"max_kl": -0.1}, {"min_top1": 1.5}, {"max_ppl_ratio": math.inf}])
def test_bad_bounds_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        DriftRule(**kwargs)
