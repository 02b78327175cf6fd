"""GPTQ: lower reconstruction error than round-to-nearest on the same weights, and the torch pass
on the tiny Llama (fake-quantized checkpoint == stored parameters, embedding untouched)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from calibration.datasets import CalibrationConfig
from passes.formats.int4 import INT4_DIR, group_params, load_params, quantize_rtn
from passes.gptq import GptqPass, Hessians, gptq_quantize
from passes.int4 import EXTRAS_DIR, first_layer_inputs, input_hooks
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.errors import CalibrationError
from pipeline.core.torch_model import load_causal_lm
from tests.conftest import make_tiny_llama, run_pass

CALIBRATION = {"num_samples": 8, "seq_len": 64}


def output_mse(x: torch.Tensor, weight: torch.Tensor, quantized: torch.Tensor) -> float:
    return float((x @ weight.T - x @ quantized.T).pow(2).mean())


def correlated_inputs(tokens: int = 2048, width: int = 128, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(width, width, generator=generator) / width**0.5
    x = torch.randn(tokens, width, generator=generator) @ mixing
    x[:, :4] *= 8.0  # a few outlier channels, as in LLM activations
    return x


@pytest.mark.parametrize(("act_order", "symmetric"), [(True, False), (False, False), (True, True)])
def test_gptq_beats_round_to_nearest(act_order: bool, symmetric: bool) -> None:
    x = correlated_inputs()
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    hessians = Hessians()
    hessians.add("w", x)
    gptq = gptq_quantize(weight, hessians.pop("w"), 32, symmetric=symmetric, act_order=act_order)
    rtn = quantize_rtn(weight, 32, symmetric)
    assert output_mse(x, weight, gptq.dequantize()) < 0.7 * output_mse(x, weight, rtn.dequantize())
    assert gptq.codes.dtype == torch.uint8 and int(gptq.codes.max()) <= 15
    if act_order:  # static groups: the grid is round-to-nearest's, only the rounding differs
        scales, zeros = group_params(weight, 32, symmetric)
        assert torch.equal(gptq.scales, scales) and torch.equal(gptq.zeros, zeros.to(torch.uint8))


def test_gptq_beats_round_to_nearest_on_tiny_llama_activations(tiny_llama: Path) -> None:
    """Layer-output MSE on real calibration inputs of every linear of decoder layer 0."""
    from calibration.datasets import token_windows
    from pipeline.core.torch_model import load_tokenizer

    model = load_causal_lm(tiny_llama)
    windows = token_windows(load_tokenizer(tiny_llama), CalibrationConfig(**CALIBRATION))
    layer = model.model.layers[0]
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in linears}
    hessians = Hessians()

    def record(name: str, x: torch.Tensor) -> None:
        inputs[name].append(x.reshape(-1, x.shape[-1]))
        hessians.add(name, x)

    with torch.no_grad(), input_hooks(linears, record):
        captured = first_layer_inputs(model, windows, 4)
        for hidden, kwargs in zip(captured.hidden, captured.kwargs, strict=True):
            layer(hidden, **kwargs)
    for name, module in linears.items():
        x, w = torch.cat(inputs[name]), module.weight.detach()
        gptq = gptq_quantize(w, hessians.pop(name), 32)
        rtn = quantize_rtn(w, 32, False)
        assert output_mse(x, w, gptq.dequantize()) < output_mse(x, w, rtn.dequantize()), name


@pytest.fixture(scope="module")
def gptq_model(tiny_source: Artifact, tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    step = GptqPass(group_size=32, calibration=CALIBRATION)
    result, metrics = run_pass(step, tiny_source, tmp_path_factory.mktemp("gptq"))
    assert metrics["quantized_layers"] == 15 and metrics["untied_lm_head"]
    return result


def test_checkpoint_holds_the_dequantized_parameters(tiny_source: Artifact, gptq_model: Artifact) -> None:
    info, layers = load_params(gptq_model.path / EXTRAS_DIR / INT4_DIR)
    assert info["algorithm"] == "gptq" and info["group_size"] == 32 and len(layers) == 15
    original, quantized = load_causal_lm(tiny_source.path), load_causal_lm(gptq_model.path)
    q_proj = quantized.model.layers[1].self_attn.q_proj.weight
    assert torch.equal(q_proj, layers["model.layers.1.self_attn.q_proj"].dequantize())
    # The head is untied and quantized; the embedding keeps its fp32 values.
    assert quantized.lm_head.weight is not quantized.model.embed_tokens.weight
    assert torch.equal(quantized.model.embed_tokens.weight, original.model.embed_tokens.weight)
    assert torch.equal(quantized.lm_head.weight, layers["lm_head"].dequantize())
    assert not torch.equal(quantized.lm_head.weight, original.lm_head.weight)
    # Norms are untouched by GPTQ; the tokenizer travels.
    assert torch.equal(quantized.model.norm.weight, original.model.norm.weight)
    assert (gptq_model.path / "tokenizer.json").is_file()
    assert gptq_model.metadata["quantization"]["algorithm"] == "gptq"
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        agree = (original(ids).logits.argmax(-1) == quantized(ids).logits.argmax(-1)).float().mean()
    assert agree > 0.5


def test_excluded_layers_stay_fp32(tiny_source: Artifact, tmp_path: Path) -> None:
    step = GptqPass(group_size=32, exclude=["lm_head", "*.mlp.*"], calibration=CALIBRATION)
    assert step.run(tiny_source, tmp_path)["untied_lm_head"] is False
    _, layers = load_params(tmp_path / EXTRAS_DIR / INT4_DIR)
    assert sorted(layers) == sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo")
    original, quantized = load_causal_lm(tiny_source.path), load_causal_lm(tmp_path)
    assert quantized.lm_head.weight is quantized.model.embed_tokens.weight  # still tied
    assert torch.equal(
        quantized.model.layers[0].mlp.up_proj.weight, original.model.layers[0].mlp.up_proj.weight
    )


def test_non_finite_statistics_are_a_calibration_error(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "nan")
    model = load_causal_lm(folder)
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[3] = float("inf")
    model.save_pretrained(folder, safe_serialization=True)
    source = Artifact.from_dir(Kind.TORCH, folder)
    with pytest.raises(
        CalibrationError, match=r"Hessian of model.layers.1.mlp.(gate|up)_proj contain NaN/inf"
    ):
        GptqPass(group_size=32, calibration=CALIBRATION).run(source, tmp_path / "out")


def test_calibration_text_shorter_than_one_sequence(tiny_source: Artifact, tmp_path: Path) -> None:
    step = GptqPass(group_size=32, calibration={"num_samples": 1, "seq_len": 1_000_000})
    with pytest.raises(
        CalibrationError, match=r"shorter than one sequence of quant.calibration.seq_len=1000000"
    ):
        step.run(tiny_source, tmp_path)


def test_hessian_is_the_mean_outer_product() -> None:
    x = torch.randn(3, 5, 4)
    hessians = Hessians()
    hessians.add("a", x[:2])
    hessians.add("a", x[2:])
    flat = x.reshape(-1, 4).numpy().astype(np.float64)
    np.testing.assert_allclose(hessians.pop("a").numpy(), 2 * flat.T @ flat / 15, rtol=1e-5)
