"""AWQ: folding the scales leaves the fp32 model's function unchanged; the scale and clip
searches lower the reconstruction error of round-to-nearest; the torch pass on the tiny Llama."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from calibration.datasets import CalibrationConfig, token_windows
from passes.awq import (
    AwqPass,
    ErrorForm,
    ScaleGroup,
    fold_scales,
    input_stats,
    layer_groups,
    search_clip,
    search_scale,
)
from passes.formats.int4 import INT4_DIR, load_params, quantize_rtn
from passes.int4 import EXTRAS_DIR, first_layer_inputs
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.errors import ConfigError
from pipeline.core.families import LLAMA
from pipeline.core.torch_model import load_causal_lm, load_tokenizer, untie_lm_head
from tests.conftest import make_tiny_llama, run_pass

CALIBRATION = {"num_samples": 8, "seq_len": 64}
IDS = torch.tensor([[1, 5, 9, 42, 7, 100, 3, 64, 200, 11]])


def with_outliers(model: torch.nn.Module) -> torch.nn.Module:
    """Give the RMSNorm gains a few large channels: the activation outliers AWQ exists for."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[:3] = 12.0
            layer.post_attention_layernorm.weight[5:8] = 12.0
    return model


@pytest.fixture(scope="module")
def gqa_free_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As many KV heads as heads: v_proj's outputs are o_proj's inputs, so that pair folds too."""
    return make_tiny_llama(tmp_path_factory.mktemp("mha"), num_key_value_heads=4)


@pytest.mark.parametrize("mha", [False, True])
def test_folding_scales_keeps_the_fp32_function(tiny_llama: Path, gqa_free_llama: Path, mha: bool) -> None:
    folder = gqa_free_llama if mha else tiny_llama
    model = load_causal_lm(folder)
    windows = token_windows(load_tokenizer(folder), CalibrationConfig(num_samples=2, seq_len=32))
    with torch.no_grad():
        before = model(IDS).logits
        untie_lm_head(model)
        generator = torch.Generator().manual_seed(0)
        inputs = first_layer_inputs(model, windows, 2)
        folded = 0
        for layer in model.model.layers:
            groups, inputs.hidden = layer_groups(LLAMA, layer, inputs)
            for group in groups:
                if group.prev is None:
                    continue
                width = next(iter(group.linears.values())).in_features
                scales = torch.rand(width, generator=generator) * 4 + 0.25
                fold_scales(group.prev, list(group.linears.values()), scales)
                folded += 1
        fold_scales(model.model.norm, [model.lm_head], torch.rand(64, generator=generator) + 0.5)
        after = model(IDS).logits
        embedding_kept = torch.equal(
            model.model.embed_tokens.weight, load_causal_lm(folder).model.embed_tokens.weight
        )
    assert folded == (8 if mha else 6)  # qkv, gate/up, down per layer (+ v->o without GQA)
    assert embedding_kept
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


class Gain(torch.nn.Module):
    """Stand-in for an RMSNorm gain feeding the searched linears."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width), requires_grad=False)


def outlier_inputs(tokens: int = 512, width: int = 128) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, tokens // 2, width, generator=generator)
    x[..., :6] *= 20.0
    return x


@pytest.mark.parametrize(
    ("tokens", "sketch_rows", "form"),
    [(256, 0, ErrorForm.gram), (256, 128, ErrorForm.gram), (24, 64, ErrorForm.tokens)],
)
def test_exact_error_forms_are_the_linear_output_mse(tokens: int, sketch_rows: int, form: ErrorForm) -> None:
    x = outlier_inputs()[:, :tokens]  # width 128
    delta = torch.randn(16, 128, generator=torch.Generator().manual_seed(1)) * 0.01
    direct = float((x.reshape(-1, 128) @ delta.T).pow(2).sum(-1).mean())
    stats = input_stats([x[0], x[1]], sketch_rows, None)
    assert stats.form == form
    assert stats.error(delta) == pytest.approx(direct, rel=1e-4)
    assert stats.error(delta, chunk=5) == pytest.approx(direct, rel=1e-4)  # output rows in chunks


def test_sketched_error_is_unbiased_and_repeatable() -> None:
    """64 rows for 512 tokens of width 128: no exact form is cheap enough, so a CountSketch."""
    x = outlier_inputs()
    delta = torch.randn(16, 128, generator=torch.Generator().manual_seed(1)) * 0.01
    direct = float((x.reshape(-1, 128) @ delta.T).pow(2).sum(-1).mean())
    estimates = torch.tensor([input_stats([x], 64, None, seed=seed).error(delta) for seed in range(200)])
    assert input_stats([x], 64, None).form == ErrorForm.sketch
    assert input_stats([x], 64, None).error(delta) == input_stats([x], 64, None).error(delta)
    assert float(estimates.mean()) == pytest.approx(direct, rel=0.03)  # 200 draws: std of the mean ~1 %
    assert float(estimates.std()) / direct < 0.2  # measured 0.076


@pytest.mark.parametrize(("tokens", "sketch_rows"), [(256, 0), (256, 64), (24, 64)])
def test_rescaled_statistics_are_those_of_the_scaled_inputs(tokens: int, sketch_rows: int) -> None:
    x = outlier_inputs()[:, :tokens]
    scales = torch.rand(128, generator=torch.Generator().manual_seed(4)) + 0.5
    folded = input_stats([x[0], x[1]], sketch_rows, 32).rescaled(scales)
    direct = input_stats([x[0] / scales, x[1] / scales], sketch_rows, 32)
    for got, want in zip(folded.tensors(), direct.tensors(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_clip_blocks_are_the_gram_diagonal_blocks() -> None:
    x = outlier_inputs()
    stats = input_stats([x[0], x[1]], 0, 32)
    for g in range(4):
        window = slice(32 * g, 32 * (g + 1))
        torch.testing.assert_close(stats.clip_blocks[g], stats.gram[window, window], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("objective", ["block", "gram", "sketch"])
def test_scale_search_beats_round_to_nearest(objective: str) -> None:
    x = outlier_inputs()
    linear = torch.nn.Linear(128, 48, bias=False)
    torch.nn.init.normal_(linear.weight, std=0.05, generator=torch.Generator().manual_seed(2))
    original = linear.weight.detach().clone()
    block = (lambda v, _b: linear(v)) if objective == "block" else None
    group = ScaleGroup("g", Gain(128), {"fc": linear}, ["fc"], [x[0], x[1]], block)
    if objective == "sketch":
        group.stats = input_stats(group.inputs, 64, None)
        assert group.stats.form == ErrorForm.sketch
    with torch.no_grad():
        scales, ratio = search_scale(group, 20, 32, False, batches=2)
        assert torch.equal(linear.weight, original)  # the search leaves the weights as they were
        reference = linear(x)
        rtn_error = (x @ quantize_rtn(original, 32, False).dequantize().T - reference).pow(2).mean()
        scaled = quantize_rtn(original * scales, 32, False).dequantize() / scales
        awq_error = (x @ scaled.T - reference).pow(2).mean()
    assert 0 < ratio < 1
    assert awq_error < 0.8 * rtn_error


def test_clip_search_never_increases_the_group_error() -> None:
    x = outlier_inputs().reshape(-1, 128)[:, 6:70]  # no outliers: clipping has something to win
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) * 0.05
    weight[0, 0] = 1.0  # one outlier weight stretches its group's range
    bound = search_clip(weight, input_stats([x], None, 32).clip_blocks, 32, False)
    assert bound.shape == (32, 2) and bool((bound <= weight.view(32, 2, 32).abs().amax(-1) + 1e-7).all())
    clipped = torch.maximum(torch.minimum(weight.view(32, 2, 32), bound[..., None]), -bound[..., None])
    error = (x @ quantize_rtn(clipped.reshape(32, 64), 32, False).dequantize().T - x @ weight.T).pow(2).mean()
    rtn_error = (x @ quantize_rtn(weight, 32, False).dequantize().T - x @ weight.T).pow(2).mean()
    assert error <= rtn_error


@pytest.fixture(scope="module")
def outlier_llama(tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    folder = make_tiny_llama(tmp_path_factory.mktemp("outliers"))
    with_outliers(load_causal_lm(folder)).save_pretrained(folder, safe_serialization=True)
    return Artifact.from_dir(Kind.TORCH, folder)


def test_awq_layer_output_error_is_lower_than_round_to_nearest(
    outlier_llama: Artifact, tmp_path: Path
) -> None:
    """Decoder-layer output MSE on calibration inputs: AWQ's weights vs RTN of the same weights."""
    step = AwqPass(group_size=32, calibration=CALIBRATION, exclude=["lm_head"], grid=10)
    result, _ = run_pass(step, outlier_llama, tmp_path)
    original, awq = load_causal_lm(outlier_llama.path), load_causal_lm(result.path)
    rtn = load_causal_lm(outlier_llama.path)
    with torch.no_grad():
        for name, module in rtn.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(quantize_rtn(module.weight, 32, False).dequantize())
    windows = token_windows(load_tokenizer(outlier_llama.path), CalibrationConfig(**CALIBRATION))
    with torch.no_grad():
        inputs = first_layer_inputs(original, windows, 4)
        for index in range(2):
            errors = {}
            for label, model in (("awq", awq), ("rtn", rtn)):
                layer, reference = model.model.layers[index], original.model.layers[index]
                errors[label] = sum(
                    float((layer(h, **k) - reference(h, **k)).pow(2).mean())
                    for h, k in zip(inputs.hidden, inputs.kwargs, strict=True)
                )
            assert errors["awq"] < errors["rtn"], (index, errors)
            pairs = zip(inputs.hidden, inputs.kwargs, strict=True)
            inputs.hidden = [original.model.layers[index](h, **k) for h, k in pairs]
    # Scales were folded into the norms; the stored parameters are the checkpoint's weights.
    assert not torch.equal(
        awq.model.layers[0].input_layernorm.weight, original.model.layers[0].input_layernorm.weight
    )
    _, layers = load_params(result.path / EXTRAS_DIR / INT4_DIR)
    assert len(layers) == 14 and "lm_head" not in layers
    assert torch.equal(
        awq.model.layers[0].mlp.down_proj.weight, layers["model.layers.0.mlp.down_proj"].dequantize()
    )


def test_awq_quantizes_the_untied_head_through_the_final_norm(tiny_source: Artifact, tmp_path: Path) -> None:
    metrics = AwqPass(group_size=64, calibration=CALIBRATION, grid=4, search_samples=0).run(
        tiny_source, tmp_path
    )
    assert metrics["quantized_layers"] == 15 and metrics["untied_lm_head"]
    original, awq = load_causal_lm(tiny_source.path), load_causal_lm(tmp_path)
    assert torch.equal(awq.model.embed_tokens.weight, original.model.embed_tokens.weight)
    with torch.no_grad():
        agree = (original(IDS).logits.argmax(-1) == awq(IDS).logits.argmax(-1)).float().mean()
    assert agree > 0.5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"grid": 0}, r"quant.grid=0"),
        ({"search_samples": -1}, r"quant.search_samples=-1"),
        ({"sketch_rows": -1}, r"quant.sketch_rows=-1"),
    ],
)
def test_awq_config_errors(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AwqPass(**overrides)
