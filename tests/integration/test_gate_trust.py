"""Integration: the gate on a planted regression and on a benign rebuild of the real default
model, judged as the pipeline's gate judges them (``pipeline.gate.gate_fn``, quick thresholds, a
few items a rule to fit CI; the whole quick rules: ``benchmarks/README.md``, gate_power).

- ``quotes`` (gate_power's JSON-syntax regression): the head's rows of each double-quote token
  swapped with its single-quote twin, so the engine writes ``'`` where ``"`` belongs and reads
  text as before. Its token drift (KL 0.068 on held-out prose) is inside bits4's bounds, so
  under ``family=bits4`` only the tool_call rules can stop it: its generated calls must not pass.
- ``bf16`` (gate_power's round trip): every weight rounded to bfloat16 and saved in float32
  again, a benign rebuild: it must PASS every default rule and the token drift, under the family
  its build records (fp32) and under bits4.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from benchmarks.gate_power import modified_checkpoint
from evals.agreement import compare
from evals.stats import FAIL, INCONCLUSIVE, PASS
from pipeline.config import ModelConfig, QualityConfig
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.cache import Cache
from pipeline.core.manager import PassManager
from pipeline.core.plugins import build_passes
from pipeline.gate import gate_fn, load_eval_config
from pipeline.runtime import Engine
from pipeline.sources import resolve_source
from pipeline.summary import gate_verdict_lines
from tests.pipeline.recipe import compose_recipe

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO / "artifacts" / "models"  # shared with `python -m pipeline model=llama`
ITEMS = 12  # a rule's first 12 items (of tool_call_valid: the reference writes 4 valid calls)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Artifact]:
    """The reference engine of the default model and the engines of its edited copies."""
    cfg = compose_recipe(["model=llama", "quant=none"])
    model = OmegaConf.to_object(cfg.model)
    assert isinstance(model, ModelConfig)
    cache = Cache(tmp_path_factory.mktemp("cache"))
    built = {"reference": PassManager(build_passes(cfg), cache).run(resolve_source(model, MODELS_DIR))[0]}
    models = tmp_path_factory.mktemp("models")
    for name in ("quotes", "bf16"):
        folder = modified_checkpoint(models, name, argparse.Namespace())
        built[name] = PassManager(build_passes(cfg), cache).run(Artifact.from_dir(Kind.TORCH, folder))[0]
    return built


@pytest.fixture(scope="module")
def scores(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The gate's score cache, shared: the reference is scored once for both tests."""
    return tmp_path_factory.mktemp("scores")


def test_the_generated_calls_do_not_pass_a_quote_swap(engines: dict[str, Artifact], scores: Path) -> None:
    config = load_eval_config("quick", [f"limit={ITEMS}", "suites=[tool_call_valid]", "resamples=2000"])
    record = gate_fn(engines["quotes"], engines["reference"], config, None, "bits4", scores)
    row = record["suites"]["tool_call_valid"]
    assert row["baseline_mean"] >= 0.25, row  # the reference writes valid calls
    assert row["failures"]["candidate"] == {"parse": ITEMS}  # not one of the swap's calls parses
    assert row["difference"] <= -0.25 and row["verdict"] in (FAIL, INCONCLUSIVE), row


def test_a_bf16_round_trip_passes_every_rule(engines: dict[str, Artifact], scores: Path) -> None:
    reference, bf16 = engines["reference"], engines["bf16"]
    quality = compare(Engine(bf16.path), Engine(reference.path), QualityConfig())
    for family in ("fp32", "bits4"):
        config = load_eval_config("quick", [f"limit={ITEMS}", f"family={family}"])
        record = gate_fn(bf16, reference, config, quality, family, scores)
        assert set(record["suites"]) == {"reasoning", "tool_call", "long_context", "tool_call_valid"}
        assert record["verdict"] == PASS, "\n".join(gate_verdict_lines(record))
