"""Held-out agreement through real engines, checked against torch computed independently."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from evals.agreement import compare, held_out_windows
from evals.config import QualityConfig
from passes.export import ExportPass
from passes.ort_build import OrtCpuBuildPass
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.config import build_config
from pipeline.core.errors import ConfigError, EngineError
from pipeline.core.torch_model import load_causal_lm
from pipeline.runtime import Engine
from tests.conftest import make_tiny_llama

CONFIG = QualityConfig(window=64, max_tokens=256)


@pytest.fixture(scope="module")
def other_engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A second tiny Llama (other seed, same tokenizer) built into an engine."""
    root = tmp_path_factory.mktemp("other")
    model = make_tiny_llama(root / "model", seed=1)
    source = Artifact.from_dir(Kind.TORCH, model)
    (root / "graph").mkdir()
    ExportPass().run(source, root / "graph")
    (root / "engine").mkdir()
    OrtCpuBuildPass().run(Artifact.from_dir(Kind.GRAPH, root / "graph"), root / "engine")
    return model, root / "engine"


def torch_log_probs(model_dir: Path, windows: np.ndarray) -> torch.Tensor:
    model = load_causal_lm(model_dir)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor(windows)).logits[:, :-1].double(), -1)


def test_windows_are_capped_by_the_engine(tiny_engine: Artifact) -> None:
    engine = Engine(tiny_engine.path)
    windows = held_out_windows(engine, QualityConfig(window=10_000, max_tokens=2048))
    assert windows.shape == (2048 // 256, 256)


def test_same_engine_scores_perplexity_only(tiny_engine: Artifact, tiny_llama: Path) -> None:
    engine = Engine(tiny_engine.path)
    result = compare(engine, None, CONFIG)
    windows = held_out_windows(engine, CONFIG)
    log_probs = torch_log_probs(tiny_llama, windows)
    targets = torch.tensor(windows[:, 1:])
    nll = -log_probs.gather(-1, targets[..., None]).mean()
    assert result["perplexity"] == pytest.approx(float(torch.exp(nll)), rel=1e-4)
    assert result["same_engine"] and result["kl_mean"] == 0.0 and result["top1_agreement"] == 1.0
    assert result["tokens_scored"] == 4 * 63


def test_kl_and_agreement_against_another_model(
    tiny_engine: Artifact, tiny_llama: Path, other_engine: tuple[Path, Path]
) -> None:
    other_model, other_dir = other_engine
    reference = Engine(tiny_engine.path)
    result = compare(Engine(other_dir), reference, CONFIG)
    windows = held_out_windows(reference, CONFIG)
    ref = torch_log_probs(tiny_llama, windows)
    cand = torch_log_probs(other_model, windows)
    kl = (ref.exp() * (ref - cand)).sum(-1).mean()
    agreement = (ref.argmax(-1) == cand.argmax(-1)).double().mean()
    assert result["kl_mean"] == pytest.approx(float(kl), rel=1e-3)
    assert result["top1_agreement"] == pytest.approx(float(agreement), abs=1e-6)
    assert result["kl_mean"] > 0 and not result["same_engine"]


def test_unknown_text_is_refused(tiny_engine: Artifact) -> None:
    with pytest.raises(EngineError, match=r"quality\.text='wiki' is unknown"):
        held_out_windows(Engine(tiny_engine.path), QualityConfig(text="wiki"))


def _fused_engine(graph: Artifact, out: Path, **kv: object) -> Engine:
    from passes.fusion.fuse import FusionPass
    from passes.kv_cache import KvCachePass

    for name in ("kv", "fused", "engine"):
        (out / name).mkdir(parents=True)
    KvCachePass(**kv, calibration={"num_samples": 4, "seq_len": 64}).run(graph, out / "kv")
    FusionPass().run(Artifact.from_dir(Kind.GRAPH, out / "kv"), out / "fused")
    OrtCpuBuildPass(max_length=256).run(Artifact.from_dir(Kind.GRAPH, out / "fused"), out / "engine")
    return Engine(out / "engine")


@pytest.mark.parametrize("layout", ["concat", "shared"])
def test_chunks_read_the_cache_and_score_what_one_prefill_scores(
    tiny_graph: Artifact, tiny_engine: Artifact, tmp_path: Path, layout: str
) -> None:
    """Fed 16 tokens a step, an fp32 engine (unfused, and fused with either cache layout) scores
    what one prefill scores; an fp8 cache, invisible to one prefill (nothing reads the cache),
    shows as KL once the chunks read it."""
    reference = Engine(tiny_engine.path)
    fused = _fused_engine(tiny_graph, tmp_path / "fp32", layout=layout)
    for engine in (reference, fused):
        prefill, chunked = (
            compare(engine, None, QualityConfig(window=64, max_tokens=256, chunk=c)) for c in (0, 16)
        )
        assert chunked["perplexity"] == pytest.approx(prefill["perplexity"], rel=1e-4)
    if layout == "shared":
        return
    fp8 = _fused_engine(tiny_graph, tmp_path / "fp8", dtype="fp8")
    blind, seen = (
        compare(fp8, reference, QualityConfig(window=64, max_tokens=256, chunk=c))["kl_mean"] for c in (0, 16)
    )
    assert blind == 0.0 < seen  # kl_mean is rounded to 1e-6: the tiny model's fp8 KL is ~1e-6


def test_a_negative_chunk_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"quality\.chunk=-1"):  # when the settings are built
        build_config(QualityConfig, {"chunk": -1})
