"""Paired statistics of the gate, checked against values computed by hand (in the comments)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from evals.stats import (
    FAIL,
    INCONCLUSIVE,
    PASS,
    GateThresholds,
    McNemarResult,
    SuiteComparison,
    compare_suite,
    items_needed,
    mcnemar_exact,
    paired_bootstrap_ci,
    recovery,
    resolution,
    verdict,
)

# Ten items: 1 pair (right, wrong), 6 pairs (wrong, right), 2 pairs (right, right), 1 pair (wrong, wrong).
BASELINE_10 = [1, 0, 0, 0, 0, 0, 0, 1, 1, 0]
CANDIDATE_10 = [0, 1, 1, 1, 1, 1, 1, 1, 1, 0]


# --- McNemar ------------------------------------------------------------------------------------


def test_mcnemar_b1_c6() -> None:
    # b = 1, c = 6, so 7 discordant pairs, X ~ Binomial(7, 1/2) under the null.
    # Two-sided exact p = 2 * P(X <= 1) = 2 * (C(7,0) + C(7,1)) / 2^7 = 2 * (1 + 7) / 128 = 0.125.
    result = mcnemar_exact([bool(v) for v in BASELINE_10], [bool(v) for v in CANDIDATE_10])
    assert result == McNemarResult(b=1, c=6, p_value=pytest.approx(0.125, abs=1e-12))


def test_mcnemar_direction_and_symmetry() -> None:
    # Swapping the engines swaps b and c; the two-sided p-value is unchanged.
    result = mcnemar_exact(CANDIDATE_10, BASELINE_10)
    assert (result.b, result.c) == (6, 1)
    assert result.p_value == pytest.approx(0.125, abs=1e-12)


def test_mcnemar_all_one_way() -> None:
    # b = 0, c = 5: p = 2 * P(X <= 0) = 2 * C(5,0) / 2^5 = 2 / 32 = 0.0625.
    result = mcnemar_exact([0] * 5 + [1] * 3, [1] * 5 + [1] * 3)
    assert (result.b, result.c) == (0, 5)
    assert result.p_value == pytest.approx(0.0625, abs=1e-12)


def test_mcnemar_no_discordant_pairs() -> None:
    # b = c = 0: nothing contradicts the null, p = 1 by definition.
    result = mcnemar_exact([True, False, True], [True, False, True])
    assert result == McNemarResult(b=0, c=0, p_value=1.0)


def test_mcnemar_balanced_discordance() -> None:
    # b = c = 3: P(X <= 3) for Binomial(6, 1/2) = (1 + 6 + 15 + 20) / 64 = 42/64; doubled > 1, capped: 1.
    result = mcnemar_exact([1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1])
    assert (result.b, result.c) == (3, 3)
    assert result.p_value == pytest.approx(1.0)


def test_mcnemar_rejects_non_binary() -> None:
    with pytest.raises(ValueError, match="bool or 0/1"):
        mcnemar_exact([1, 0, 0.5], [1, 0, 1])


# --- Paired bootstrap ---------------------------------------------------------------------------


def test_bootstrap_identical_inputs_is_zero() -> None:
    # Every per-item difference is 0, so every resample mean is 0.
    scores = [0.2, 0.9, 0.4, 1.0, 0.0]
    assert paired_bootstrap_ci(scores, scores, resamples=500) == (0.0, 0.0)


@pytest.mark.parametrize("shift", [0.25, -0.1, 0.3])
def test_bootstrap_constant_shift(shift: float) -> None:
    # candidate = baseline + d on every item: every resample mean is d (up to float rounding).
    baseline = np.linspace(0.0, 0.6, 37)
    low, high = paired_bootstrap_ci(baseline, baseline + shift, resamples=500)
    assert low == pytest.approx(shift, abs=1e-12)
    assert high == pytest.approx(shift, abs=1e-12)


def _simulated(n: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    # Baseline scores vary a lot between items (sd 0.2); the candidate is the same item's score
    # minus 0.03 plus small noise (sd 0.05). True mean difference -0.03; the paired standard error
    # is 0.05 / sqrt(1000) = 0.00158, the unpaired one would be about sqrt(0.2^2 + 0.206^2) /
    # sqrt(1000) = 0.0091.
    rng = np.random.default_rng(1234)
    baseline = rng.normal(0.5, 0.2, n)
    candidate = baseline - 0.03 + rng.normal(0.0, 0.05, n)
    return baseline, candidate


def test_bootstrap_covers_true_difference_and_keeps_pairs() -> None:
    baseline, candidate = _simulated()
    low, high = paired_bootstrap_ci(baseline, candidate)
    assert low < -0.03 < high
    observed = float((candidate - baseline).mean())
    assert low < observed < high
    # Width close to the paired normal-theory width 2 * 1.96 * sd(diff) / sqrt(n); resampling
    # the two sequences independently would give a width about 6 times larger.
    expected = 2 * 1.959964 * (candidate - baseline).std(ddof=1) / math.sqrt(baseline.size)
    assert (high - low) == pytest.approx(expected, rel=0.1)


def test_bootstrap_deterministic_for_seed() -> None:
    baseline, candidate = _simulated(200)
    first = paired_bootstrap_ci(baseline, candidate, resamples=2000, seed=7)
    assert paired_bootstrap_ci(baseline, candidate, resamples=2000, seed=7) == first
    assert paired_bootstrap_ci(baseline, candidate, resamples=2000, seed=8) != first


def test_bootstrap_wider_at_higher_confidence() -> None:
    baseline, candidate = _simulated(200)
    low90, high90 = paired_bootstrap_ci(baseline, candidate, confidence=0.90, resamples=2000)
    low99, high99 = paired_bootstrap_ci(baseline, candidate, confidence=0.99, resamples=2000)
    assert low99 < low90 < high90 < high99


# --- Recovery -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("baseline", "candidate", "expected"),
    [
        (0.8, 0.76, 0.95),  # 0.76 / 0.8
        (0.5, 0.6, 1.2),  # better than the baseline: above 1
        (0.4, 0.0, 0.0),
        (0.0, 0.0, 1.0),  # baseline 0: defined as 1.0 (nothing to lose)
        (0.0, 0.3, 1.0),
    ],
)
def test_recovery(baseline: float, candidate: float, expected: float) -> None:
    assert recovery(baseline, candidate) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("baseline", "candidate"), [(-0.1, 0.5), (0.5, -0.1), (math.nan, 0.5), (0.5, math.inf)]
)
def test_recovery_rejects_bad_scores(baseline: float, candidate: float) -> None:
    with pytest.raises(ValueError, match="finite, non-negative"):
        recovery(baseline, candidate)


# --- compare_suite ------------------------------------------------------------------------------


def test_compare_suite_binary() -> None:
    # Baseline right on 3 of 10 items (0.3), candidate on 8 of 10 (0.8): difference 0.5,
    # recovery 0.8 / 0.3 = 2.6667, McNemar b = 1, c = 6, p = 0.125 (see above).
    result = compare_suite(BASELINE_10, CANDIDATE_10, resamples=2000)
    assert result.n == 10
    assert result.baseline_mean == pytest.approx(0.3)
    assert result.candidate_mean == pytest.approx(0.8)
    assert result.difference == pytest.approx(0.5)
    assert result.recovery == pytest.approx(8 / 3)
    assert result.mcnemar == McNemarResult(b=1, c=6, p_value=pytest.approx(0.125))
    assert result.confidence == 0.95
    # Per-item differences: one -1, six +1, three 0; the mean of 10 of them lies on the 0.1 grid.
    assert -1.0 <= result.ci_low < 0.5 < result.ci_high <= 1.0
    assert (result.ci_low, result.ci_high) == paired_bootstrap_ci(BASELINE_10, CANDIDATE_10, resamples=2000)


def test_compare_suite_continuous_has_no_mcnemar() -> None:
    result = compare_suite([0.5, 0.7, 1.0], [0.5, 0.6, 1.0], resamples=200)
    assert result.mcnemar is None
    assert result.difference == pytest.approx(-0.1 / 3)
    assert result.recovery == pytest.approx(2.1 / 2.2)


# --- verdict ------------------------------------------------------------------------------------


def _comparison(
    ci_low: float = -0.01, recovery: float = 1.0, ci_high: float = 0.02, difference: float | None = None
) -> SuiteComparison:
    return SuiteComparison(
        n=500,
        baseline_mean=0.6,
        candidate_mean=0.6 * recovery,
        difference=0.6 * recovery - 0.6 if difference is None else difference,
        ci_low=ci_low,
        ci_high=ci_high,
        confidence=0.95,
        mcnemar=None,
        recovery=recovery,
    )


THRESHOLDS = GateThresholds(max_drop=0.03, min_recovery=0.95)


def test_verdict_pass() -> None:
    status, reasons = verdict(_comparison(), THRESHOLDS)
    assert status == PASS
    assert len(reasons) == 2  # one line per rule checked


def test_verdict_ci_boundary_passes() -> None:
    # ci_low == -max_drop still rules out a larger drop.
    assert verdict(_comparison(ci_low=-0.03), THRESHOLDS)[0] == PASS


def test_a_wide_ci_that_reaches_zero_is_inconclusive_not_fail() -> None:
    # The quick-suite case: -2.1 points, CI [-16.7, +12.5]: a large drop is not ruled out, but no
    # drop is shown either.
    status, reasons = verdict(_comparison(ci_low=-0.167, ci_high=0.125, difference=-0.021), THRESHOLDS)
    assert status == INCONCLUSIVE
    assert "not ruled out" in reasons[0] and "no regression is shown" in reasons[-1]


def test_right_wrong_scores_are_judged_significant_by_mcnemars_exact_test() -> None:
    # 7 pairs lost, 1 gained of 48 (-12.5 points): the bootstrap's 95% upper bound is below 0
    # (-2.1 points) but the exact p is 0.070, so no regression is shown; 12 lost and none
    # gained is one (p 0.0005).
    base = [1, 1, 0, 1] * 12
    few = compare_suite(base, [1, 0, 0, 1] * 6 + [1, 1, 0, 1] * 5 + [0, 1, 1, 1], resamples=2000)
    assert few.ci_high < 0 and few.mcnemar == McNemarResult(b=7, c=1, p_value=pytest.approx(0.0703125))
    assert verdict(few, GateThresholds(max_drop=0.15, min_recovery=0.85))[0] == INCONCLUSIVE
    many = compare_suite(base, [1, 0, 0, 1] * 12, resamples=2000)
    assert many.mcnemar is not None and many.mcnemar.p_value < 0.001
    assert verdict(many, GateThresholds(max_drop=0.15, min_recovery=0.85))[0] == FAIL


def test_a_significant_drop_beyond_max_drop_fails() -> None:
    status, reasons = verdict(_comparison(ci_low=-0.09, ci_high=-0.04, difference=-0.065), THRESHOLDS)
    assert status == FAIL
    assert len(reasons) == 1 and "significant drop larger than max_drop=0.03" in reasons[0]


def test_a_significant_drop_within_max_drop_but_not_ruled_out_is_inconclusive() -> None:
    status, reasons = verdict(_comparison(ci_low=-0.04, ci_high=-0.001, difference=-0.02), THRESHOLDS)
    assert status == INCONCLUSIVE
    assert "significant but within max_drop" in reasons[-1]


def test_a_drop_beyond_max_drop_that_is_not_significant_is_inconclusive() -> None:
    status, _ = verdict(_comparison(ci_low=-0.12, ci_high=0.01, difference=-0.05), THRESHOLDS)
    assert status == INCONCLUSIVE


def test_recovery_below_the_floor_fails_only_when_the_drop_is_significant() -> None:
    significant = _comparison(recovery=0.9, ci_low=-0.02, ci_high=-0.01, difference=-0.015)
    status, reasons = verdict(significant, THRESHOLDS)
    assert status == FAIL and "min_recovery=0.95" in reasons[0]
    status, reasons = verdict(_comparison(recovery=0.9, difference=-0.015), THRESHOLDS)
    assert status == INCONCLUSIVE and "min_recovery=0.95" in reasons[0]


def test_verdict_lists_every_broken_rule() -> None:
    broken = _comparison(ci_low=-0.3, ci_high=-0.1, recovery=0.5)
    status, reasons = verdict(broken, THRESHOLDS)
    assert status == FAIL
    assert len(reasons) == 2


def test_verdict_on_compare_suite() -> None:
    # Candidate loses 4 of 10 right answers: 0.6 -> 0.2, recovery 0.333. On 10 items McNemar's
    # exact p is 0.125 (INCONCLUSIVE); the same pattern on 40 items shows the regression.
    baseline = [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]
    candidate = [1, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    status, _ = verdict(compare_suite(baseline, candidate, resamples=1000), GateThresholds())
    assert status == INCONCLUSIVE
    status, reasons = verdict(compare_suite(baseline * 4, candidate * 4, resamples=1000), GateThresholds())
    assert status == FAIL
    assert len(reasons) == 2


def test_default_thresholds() -> None:
    assert GateThresholds() == GateThresholds(max_drop=0.05, min_recovery=0.95)


@pytest.mark.parametrize("kwargs", [{"max_drop": -0.01}, {"min_recovery": math.nan}, {"max_drop": math.inf}])
def test_thresholds_reject_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        GateThresholds(**kwargs)


# --- resolution ---------------------------------------------------------------------------------


def test_resolution_of_a_binary_suite_inverts_items_needed() -> None:
    # 300 items, 30 discordant (10%): the smallest drop McNemar's test sees with 80% power is the
    # d whose items_needed(d, 0.1) is 300, and max_drop=0.05 needs items_needed(0.05, 0.1).
    baseline = [1] * 200 + [0] * 100
    candidate = [0] * 15 + [1] * 185 + [1] * 15 + [0] * 85
    sized = resolution(baseline, candidate, max_drop=0.05)
    assert sized.discordance == pytest.approx(0.1)
    assert sized.items_needed == items_needed(0.05, 0.1)
    d = sized.minimum_detectable_drop
    assert items_needed(d, 0.1) <= 300 < items_needed(d * 0.99, 0.1)
    # four times the items halve the detectable drop (n ~ psi / d^2)
    quadrupled = resolution(baseline * 4, candidate * 4, max_drop=0.05)
    assert quadrupled.minimum_detectable_drop == pytest.approx(d / 2, rel=0.05)


def test_resolution_without_discordant_pairs_takes_the_drop_as_the_discordance() -> None:
    same = [1, 0] * 24  # 48 items, identical answers
    sized = resolution(same, same, max_drop=0.15)
    assert sized.discordance == 0.0
    assert sized.items_needed == items_needed(0.15, 0.15)
    assert 0.0 < sized.minimum_detectable_drop < 1.0


def test_resolution_of_continuous_scores_uses_the_differences_spread() -> None:
    rng = np.random.default_rng(0)
    baseline = rng.uniform(0, 1, 400)
    candidate = baseline + rng.normal(0, 0.1, 400)
    sized = resolution(baseline, candidate, max_drop=0.02)
    sd = float(np.std(candidate - baseline, ddof=1))
    z = 1.959964 + 0.841621
    assert sized.discordance is None and sized.score_sd == pytest.approx(sd)
    assert sized.minimum_detectable_drop == pytest.approx(z * sd / 20, rel=1e-4)
    assert sized.items_needed == math.ceil((z * sd / 0.02) ** 2)


def test_a_suite_too_small_for_any_drop_says_so() -> None:
    assert resolution([1, 0, 1], [0, 1, 1], max_drop=0.5).minimum_detectable_drop == 1.0


# --- items_needed -------------------------------------------------------------------------------


def test_items_needed_by_hand() -> None:
    # Connor (1987): n = (z_{1-a/2} sqrt(psi) + z_power sqrt(psi - d^2))^2 / d^2,
    # d = 0.05, psi = 0.2, alpha = 0.05, power = 0.8:
    #   z_0.975 = 1.959964, z_0.8 = 0.841621
    #   1.959964 * sqrt(0.2)    = 1.959964 * 0.447214 = 0.876523
    #   0.841621 * sqrt(0.1975) = 0.841621 * 0.444410 = 0.374025
    #   (0.876523 + 0.374025)^2 / 0.0025 = 1.563870 / 0.0025 = 625.55 -> 626 items.
    assert items_needed(0.05, 0.2) == 626
    # psi = 0.1: 1.959964 * 0.316228 = 0.619795; 0.841621 * sqrt(0.0975) = 0.841621 * 0.312250
    # = 0.262796; (0.882591)^2 / 0.0025 = 0.778967 / 0.0025 = 311.59 -> 312 items.
    assert items_needed(0.05, 0.1) == 312


def test_items_needed_grows_with_stricter_settings() -> None:
    base = items_needed(0.05, 0.2)
    assert items_needed(0.02, 0.2) > base  # smaller drop
    assert items_needed(0.05, 0.3) > base  # more discordance
    assert items_needed(0.05, 0.2, alpha=0.01) > base
    assert items_needed(0.05, 0.2, power=0.9) > base


@pytest.mark.parametrize(
    "kwargs",
    [
        {"drop": 0.0, "discordance": 0.2},
        {"drop": 0.05, "discordance": 0.01},  # fewer discordant pairs than the drop needs
        {"drop": 0.05, "discordance": 1.5},
        {"drop": 0.05, "discordance": 0.2, "alpha": 1.0},
        {"drop": 0.05, "discordance": 0.2, "power": 0.0},
    ],
)
def test_items_needed_rejects_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        items_needed(**kwargs)


# --- input validation ---------------------------------------------------------------------------


def test_rejects_different_lengths() -> None:
    with pytest.raises(ValueError, match="same items"):
        paired_bootstrap_ci([1.0, 0.0], [1.0])
    with pytest.raises(ValueError, match="same items"):
        mcnemar_exact([True], [True, False])
    with pytest.raises(ValueError, match="same items"):
        compare_suite([1.0, 0.0, 1.0], [1.0, 0.0])


def test_rejects_empty_input() -> None:
    with pytest.raises(ValueError, match="empty"):
        paired_bootstrap_ci([], [])
    with pytest.raises(ValueError, match="empty"):
        mcnemar_exact([], [])
    with pytest.raises(ValueError, match="empty"):
        compare_suite([], [])


@pytest.mark.parametrize("confidence", [0.0, 1.0, 1.5, -0.2])
def test_rejects_bad_confidence(confidence: float) -> None:
    with pytest.raises(ValueError, match="confidence"):
        paired_bootstrap_ci([1.0, 0.0], [1.0, 1.0], confidence=confidence)


def test_rejects_nan_and_bad_resamples() -> None:
    with pytest.raises(ValueError, match="NaN"):
        paired_bootstrap_ci([1.0, math.nan], [1.0, 1.0])
    with pytest.raises(ValueError, match="resamples"):
        paired_bootstrap_ci([1.0, 0.0], [1.0, 1.0], resamples=0)
