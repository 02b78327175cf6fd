"""Integration: a JSON-syntax regression of the real default model is not passed by the generated
calls. The regression is ``benchmarks/gate_power.py``'s ``quotes`` build: the head's rows of each
double-quote token swapped with its single-quote twin, so the engine writes ``'`` where ``"``
belongs and reads text as before. Its token drift (KL 0.068 on held-out prose) is inside bits4's
bounds, so under ``family=bits4`` only the tool_call rules can stop it. A few items, to fit CI:
the whole quick rule FAILs it (``benchmarks/README.md``, gate_power)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from benchmarks.gate_power import modified_checkpoint
from evals.engine_scores import lm_eval_scores
from evals.gate import judge_suite
from evals.stats import FAIL, INCONCLUSIVE, GateThresholds
from pipeline.config import ModelConfig
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.cache import Cache
from pipeline.core.manager import PassManager
from pipeline.core.plugins import build_passes
from pipeline.sources import resolve_source
from tests.pipeline.recipe import compose_recipe

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO / "artifacts" / "models"  # shared with `python -m pipeline model=llama`
ITEMS = 12  # the first 12 calling items: the reference writes 4 valid calls among them
QUICK = GateThresholds(max_drop=0.15, min_recovery=0.85)  # configs/eval/quick.yaml


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The reference engine of the default model and the engine of its quote-swapped copy."""
    cfg = compose_recipe(["model=llama", "quant=none"])
    model = OmegaConf.to_object(cfg.model)
    assert isinstance(model, ModelConfig)
    source = resolve_source(model, MODELS_DIR)
    cache = Cache(tmp_path_factory.mktemp("cache"))
    reference, _ = PassManager(build_passes(cfg), cache).run(source)
    folder = modified_checkpoint(tmp_path_factory.mktemp("models"), "quotes", argparse.Namespace())
    quotes, _ = PassManager(build_passes(cfg), cache).run(Artifact.from_dir(Kind.TORCH, folder))
    return reference.path, quotes.path


def test_the_generated_calls_do_not_pass_a_quote_swap(engines: tuple[Path, Path]) -> None:
    reference, quotes = engines
    base = lm_eval_scores(reference, "tool_call_valid", "quick", "rank", limit=ITEMS, chat=True)
    cand = lm_eval_scores(quotes, "tool_call_valid", "quick", "rank", limit=ITEMS, chat=True)
    row = judge_suite("tool_call_valid", base, cand, QUICK, resamples=2000)
    assert row["baseline_mean"] >= 0.25, row  # the reference writes valid calls
    assert row["failures"]["candidate"] == {"parse": ITEMS}  # not one of the swap's calls parses
    assert row["difference"] <= -0.25 and row["verdict"] in (FAIL, INCONCLUSIVE), row
