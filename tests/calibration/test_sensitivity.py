"""The sensitivity probe: restarting mid-model reproduces a full forward, and the fallback search
keeps the fewest most sensitive layers that meet the KL budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from calibration.sensitivity import LayerQuantizer, SensitivityProbe, fallback_search, layer_sensitivity
from passes.int4 import quantize_rtn, untie_lm_head
from pipeline.torch_model import load_causal_lm

WINDOWS = np.random.default_rng(0).integers(3, 320, size=(3, 24)).astype(np.int64)


def rtn(group: int = 32) -> LayerQuantizer:
    return LayerQuantizer(lambda w: quantize_rtn(w, group, False).dequantize())


@pytest.fixture(scope="module")
def probe(tiny_llama: Path) -> SensitivityProbe:
    model = load_causal_lm(tiny_llama)
    untie_lm_head(model)
    return SensitivityProbe(model, WINDOWS, batch_size=2)  # two batches: 2 + 1 windows


def full_forward_kl(model: torch.nn.Module, changes: dict[str, torch.Tensor]) -> float:
    """KL(fp32 || changed) computed from scratch: two complete forwards, no cached inputs."""
    ids = torch.from_numpy(WINDOWS)
    modules = dict(model.named_modules())
    with torch.inference_mode():
        reference = torch.log_softmax(model(input_ids=ids, use_cache=False).logits, -1)
        saved = {name: modules[name].weight.data for name in changes}
        for name, weight in changes.items():
            modules[name].weight.data = weight
        try:
            candidate = torch.log_softmax(model(input_ids=ids, use_cache=False).logits, -1)
        finally:
            for name, weight in saved.items():
                modules[name].weight.data = weight
    return float((reference.exp() * (reference - candidate)).sum(-1).mean())


def test_unquantized_restart_reproduces_the_reference(probe: SensitivityProbe) -> None:
    identity = LayerQuantizer(lambda w: w.clone())
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"):
        assert abs(probe.kl({name: identity})) < 1e-7, name
    assert probe.kl({}) == 0.0


@pytest.mark.parametrize(
    "names",
    [
        ["model.layers.1.mlp.up_proj"],
        ["lm_head"],
        ["model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"],
    ],
)
def test_kl_matches_a_full_forward(probe: SensitivityProbe, names: list[str]) -> None:
    changes = {n: quantize_rtn(probe.linears[n].weight.data, 32, False).dequantize() for n in names}
    expected = full_forward_kl(probe.model, changes)
    assert expected > 1e-7  # the quantization does change the output
    assert probe.kl({n: rtn() for n in names}) == pytest.approx(expected, rel=1e-3)


def test_activation_quantizer_applies_to_the_layer_input(probe: SensitivityProbe) -> None:
    name = "model.layers.1.mlp.down_proj"
    assert probe.input_absmax[name] > 0
    weight_only = probe.kl({name: LayerQuantizer(lambda w: w.clone())})
    zeroed_input = probe.kl({name: LayerQuantizer(lambda w: w.clone(), lambda x: x * 0)})
    assert zeroed_input > 1000 * max(weight_only, 1e-9)


def test_fallback_keeps_the_fewest_most_sensitive_layers(probe: SensitivityProbe) -> None:
    quantizers = {n: rtn(16) for n in probe.linears}
    scores = layer_sensitivity(probe, quantizers, progress=False)
    ranking = list(scores)
    assert list(scores.values()) == sorted(scores.values(), reverse=True)
    everything = probe.kl(quantizers)
    budget = everything * 0.5
    result = fallback_search(probe, quantizers, ranking, budget, max_layers=len(ranking))
    assert result.budget_met and result.kl <= budget
    count = len(result.modules)
    assert 0 < count < len(ranking) and result.modules == ranking[:count]
    shorter = {n: q for n, q in quantizers.items() if n not in ranking[: count - 1]}
    assert probe.kl(shorter) > budget  # one layer fewer misses the budget: the prefix is minimal
    assert result.trials[0] == pytest.approx(everything)


def test_fallback_reports_a_budget_it_cannot_meet(probe: SensitivityProbe) -> None:
    quantizers = {n: rtn(16) for n in probe.linears}
    ranking = list(layer_sensitivity(probe, quantizers, progress=False))
    result = fallback_search(probe, quantizers, ranking, budget=1e-12, max_layers=2)
    assert not result.budget_met and result.modules == ranking[:2] and result.kl > 1e-12
