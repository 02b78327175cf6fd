"""Token-level drift rules of the eval gate: the held-out KL, top-1 agreement and perplexity ratio
of the candidate against the reference engine (``evals/agreement.py``, the run's quality record),
judged against bounds per recipe family.

The statistics are the ones llama.cpp's ``llama-perplexity --kl-divergence`` reports for its
quant types (mean KL divergence, "same top p", perplexity ratio; tools/perplexity/README.md) and
the ones Dutta et al. (*Accuracy is Not All You Need*, 2024) show track answer flips where
accuracy does not. A suite of 50 items cannot see a model whose next-token distribution moved
far; these numbers, over thousands of tokens, can. So they are rules of the default verdict:
an engine whose drift is far outside what the recipes of its family produce FAILs, whatever the
suites say; one whose drift was not measured cannot PASS (INCONCLUSIVE).

Families, strictest first (``pipeline.config.DRIFT_FAMILIES``): a recipe's family is the
loosest of its passes' (``Pass.drift_family``; ``pipeline.run.drift_family``), so int4 weights
with an fp32 KV cache are ``bits4`` and a pruned model quantized to int8 is ``pruned``. The
bounds are in ``configs/eval/_drift.yaml``, with the numbers that justify them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from evals.stats import FAIL, INCONCLUSIVE, PASS


@dataclass(frozen=True)
class DriftRule:
    """Bounds on a family's held-out token statistics; None turns a bound off."""

    max_kl: float | None = None  # mean KL(reference || engine), nats per token
    min_top1: float | None = None  # share of positions whose argmax token agrees
    max_ppl_ratio: float | None = None  # engine perplexity / reference perplexity

    def __post_init__(self) -> None:
        for name in ("max_kl", "max_ppl_ratio"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value} must be null or a finite, non-negative number")
        if self.min_top1 is not None and not 0.0 <= self.min_top1 <= 1.0:
            raise ValueError(f"min_top1={self.min_top1} must be null or a share in [0, 1]")

    @property
    def empty(self) -> bool:
        return self.max_kl is None and self.min_top1 is None and self.max_ppl_ratio is None


def drift_numbers(quality: Mapping[str, Any] | None) -> dict[str, float] | None:
    """KL, top-1 and perplexity ratio of a quality record (``evals.agreement.compare``); None when
    the record is missing or holds no valid comparison with the reference."""
    if not quality:
        return None
    try:
        kl = float(quality["kl_mean"])
        top1 = float(quality["top1_agreement"])
        ratio = float(quality["perplexity"]) / float(quality["reference_perplexity"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if not all(math.isfinite(v) for v in (kl, top1, ratio)):
        return None
    return {"kl": kl, "top1": top1, "ppl_ratio": ratio}


def judge_drift(quality: Mapping[str, Any] | None, rule: DriftRule, family: str) -> dict[str, Any]:
    """The gate's token-level row: ``verdict`` PASS (every bound held), FAIL (one broken) or
    INCONCLUSIVE (bounds are set but nothing valid was measured), with one reason a bound."""
    measured = drift_numbers(quality)
    row: dict[str, Any] = {"family": family, "rule": rule.__dict__.copy(), "measured": measured}
    where = f"family {family}"
    if rule.empty:
        return {**row, "verdict": PASS, "reasons": [f"{where} sets no token-level bound"]}
    if measured is None:
        return {
            **row,
            "verdict": INCONCLUSIVE,
            "reasons": [
                f"{where} bounds the token-level drift, but no valid KL / top-1 / perplexity against the "
                "reference was measured (quality.enabled=false, or the gate's --no-kl)"
            ],
        }
    broken: list[str] = []
    held: list[str] = []
    bounds = (  # label, measured key, rule key, the bound, whether it is an upper bound
        ("KL", "kl", "max_kl", rule.max_kl, True),
        ("top-1 agreement", "top1", "min_top1", rule.min_top1, False),
        ("perplexity ratio", "ppl_ratio", "max_ppl_ratio", rule.max_ppl_ratio, True),
    )
    for label, measured_key, rule_key, bound, upper in bounds:
        if bound is None:
            continue
        value = measured[measured_key]
        ok = value <= bound if upper else value >= bound
        line = f"{label} {value:.4g} {'within' if ok else 'breaks'} {rule_key}={bound:g} ({where})"
        (held if ok else broken).append(line)
    if broken:
        return {**row, "verdict": FAIL, "reasons": broken}
    return {**row, "verdict": PASS, "reasons": held}
