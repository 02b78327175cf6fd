"""The sensitivity probe: restarting mid-model reproduces a full forward, the Fisher estimate
ranks like the exact scan at a cost linear in depth, and the fallback search keeps the fewest
most sensitive layers that meet the KL budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from calibration.sensitivity import (
    LayerQuantizer,
    SensitivityProbe,
    fallback_search,
    fisher_scores,
    fisher_sensitivity,
    layer_sensitivity,
)
from passes.formats.int4 import quantize_rtn
from pipeline.core.torch_model import load_causal_lm, untie_lm_head
from tests.conftest import make_tiny_llama

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


def test_fisher_estimate_ranks_like_the_exact_scan(probe: SensitivityProbe) -> None:
    quantizers = {n: rtn(16) for n in probe.linears}
    exact = layer_sensitivity(probe, quantizers, progress=False)
    estimate = fisher_scores(probe, quantizers, samples=8, progress=False)
    names = list(exact)
    for scores in (estimate.tokenwise, estimate.sequence):
        assert set(scores) == set(exact) and all(v >= 0 for v in scores.values())
        assert spearmanr([exact[n] for n in names], [scores[n] for n in names]).statistic > 0.8
        assert next(iter(scores)) == names[0]  # lm_head: the most sensitive layer of the tiny model
    # The second-order term estimates the KL itself (nats per token), not just its order.
    assert estimate.tokenwise[names[0]] == pytest.approx(exact[names[0]], rel=0.5)
    assert fisher_sensitivity(probe, quantizers, samples=8, progress=False) == estimate.tokenwise


def test_chunked_quantization_equals_the_whole_weight(
    probe: SensitivityProbe, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large weights are quantized in chunks of rows (bounded temporaries): forced here on the tiny
    model, the KL probe's result is the same and the Fisher scores agree to float rounding."""
    import calibration.sensitivity as sensitivity

    quantizers = {
        n: rtn(16) for n in ("lm_head", "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj")
    }
    whole_kl = probe.kl(quantizers)
    whole = fisher_scores(probe, quantizers, samples=2, progress=False)
    weight = probe.linears["lm_head"].weight.data
    monkeypatch.setattr(sensitivity, "FISHER_CHUNK_ELEMENTS", 5 * weight.shape[1])  # 5 rows a chunk
    assert torch.equal(sensitivity.quantized_weight(quantizers["lm_head"], weight), rtn(16).weight(weight))
    assert probe.kl(quantizers) == whole_kl
    chunked = fisher_scores(probe, quantizers, samples=2, progress=False)
    for name, value in whole.tokenwise.items():
        assert chunked.tokenwise[name] == pytest.approx(value, rel=1e-4), name
        assert chunked.sequence[name] == pytest.approx(whole.sequence[name], rel=1e-4), name


def test_fisher_estimate_is_seeded_and_leaves_the_model_as_it_was(probe: SensitivityProbe) -> None:
    quantizers = {n: rtn(16) for n in list(probe.linears)[:4]}
    before = {n: (p.requires_grad, p.detach().clone()) for n, p in probe.model.named_parameters()}
    first = fisher_sensitivity(probe, quantizers, samples=2, seed=3, progress=False)
    assert fisher_sensitivity(probe, quantizers, samples=2, seed=3, progress=False) == first
    assert fisher_sensitivity(probe, quantizers, samples=2, seed=4, progress=False) != first
    for name, parameter in probe.model.named_parameters():
        assert parameter.requires_grad == before[name][0] and parameter.grad is None, name
        assert torch.equal(parameter.detach(), before[name][1]), name
    assert probe.kl({}) == 0.0 and not any(m._forward_hooks for m in probe.linears.values())


def planted_outliers(weight: torch.Tensor, group: int) -> torch.Tensor:
    """``weight`` with one large entry per quantization group: the group's int4 step grows ~8x and
    every other entry of the group rounds to a coarse level, so the layer's int4 error is huge."""
    planted = weight.clone()
    planted[:, ::group] = 8 * weight.abs().max()
    return planted


# Layers writing to the residual stream: on the tiny random model lm_head is otherwise the most
# sensitive layer (ranked first by both methods, see above); the planted layer must overtake it.
@pytest.mark.parametrize("layer", ["model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj"])
def test_a_planted_very_sensitive_layer_ranks_first(tiny_llama: Path, layer: str) -> None:
    model = load_causal_lm(tiny_llama)
    untie_lm_head(model)
    module = dict(model.named_modules())[layer]
    module.weight.data = planted_outliers(module.weight.data, 16)
    probe = SensitivityProbe(model, WINDOWS, batch_size=2)
    quantizers = {n: rtn(16) for n in probe.linears}
    exact = list(layer_sensitivity(probe, quantizers, progress=False))
    estimate = list(fisher_sensitivity(probe, quantizers, samples=4, progress=False))
    assert exact[0] == layer and estimate[0] == layer


class BlockCalls:
    """Counts decoder-block forwards and the backwards through them (gradients of block outputs)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.forwards = self.backwards = 0

        def hook(_module: torch.nn.Module, _args: tuple, output: object) -> None:
            self.forwards += 1
            hidden = output[0] if isinstance(output, tuple) else output
            if hidden.requires_grad:
                hidden.register_hook(lambda grad: setattr(self, "backwards", self.backwards + 1))

        self.handles = [block.register_forward_hook(hook) for block in model.model.layers]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize("method", ["fisher", "exact"])
def test_cost_in_block_calls_against_depth(method: str, tmp_path: Path) -> None:
    """Structural, not timed: the Fisher estimate runs each block once forward and once backward
    per label sample and batch, whatever the depth; the exact scan restarts at every layer's block,
    so its block calls grow with depth squared."""
    calls = {}
    for depth in (2, 4):
        model = load_causal_lm(make_tiny_llama(tmp_path / str(depth), num_hidden_layers=depth))
        probe = SensitivityProbe(model, WINDOWS, batch_size=2)  # 2 batches: 2 + 1 windows
        quantizers = {n: rtn(16) for n in probe.linears}
        counter = BlockCalls(model)
        if method == "fisher":
            fisher_sensitivity(probe, quantizers, samples=3, progress=False)
        else:
            layer_sensitivity(probe, quantizers, progress=False)
        counter.close()
        calls[depth] = (counter.forwards, counter.backwards)
    if method == "fisher":
        assert calls == {2: (2 * 2, 2 * 2 * 3), 4: (2 * 4, 2 * 4 * 3)}  # batches x depth (x samples)
    else:  # 7 layers a block; a layer of block b runs blocks b..depth-1: 7 x depth(depth+1)/2 a batch
        assert calls == {2: (2 * 7 * 3, 0), 4: (2 * 7 * 10, 0)}


def test_fisher_estimate_with_activation_quantization(probe: SensitivityProbe) -> None:
    """An activation quantizer enters dy: zeroing one layer's input makes it the most sensitive."""
    name = "model.layers.1.mlp.down_proj"
    identity = {n: LayerQuantizer(lambda w: w.clone()) for n in probe.linears}
    assert max(fisher_sensitivity(probe, identity, samples=2, progress=False).values()) == 0.0
    zeroed = {**identity, name: LayerQuantizer(lambda w: w.clone(), lambda x: x * 0)}
    scores = fisher_sensitivity(probe, zeroed, samples=2, progress=False)
    assert next(iter(scores)) == name and scores[name] > 0
    assert all(v == 0.0 for n, v in scores.items() if n != name)
