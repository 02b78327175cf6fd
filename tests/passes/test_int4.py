"""INT4 group quantization shared by GPTQ and AWQ: parameters against an independent numpy
reference, packing against ONNX Runtime's own packer, the extras contract, config errors."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from calibration.datasets import CalibrationConfig, token_windows
from calibration.streaming import StreamedCheckpoint
from passes.awq import AwqPass
from passes.formats.int4 import (
    INT4_DIR,
    QuantizedLinear,
    fake_quantize_rtn,
    load_params,
    matmulnbits_tensors,
    pack_uint4,
    qdq_tensors,
    quantize_rtn,
    save_params,
    unpack_uint4,
)
from passes.gptq import GptqPass
from passes.int4 import EXTRAS_DIR, TorchInt4Pass
from passes.recipes import Int4GptqRecipe
from pipeline.core.artifacts import Artifact
from pipeline.core.errors import ConfigError
from pipeline.core.manager import check_against_model
from pipeline.core.placement import CPU_FLOAT32, ResolvedPlacement
from pipeline.core.plugins import build_passes
from pipeline.core.torch_model import load_causal_lm, load_tokenizer, untie_lm_head
from tests.conftest import run_pass
from tests.pipeline.recipe import compose_recipe


def numpy_reference(weight: np.ndarray, group: int, symmetric: bool = False) -> tuple[np.ndarray, ...]:
    """Plain per-group min/max asymmetric uint4 (range widened to contain 0), written out anew."""
    out, width = weight.shape
    codes = np.zeros((out, width), np.uint8)
    scales = np.zeros((out, width // group), np.float32)
    zeros = np.zeros((out, width // group), np.uint8)
    for r in range(out):
        for g in range(width // group):
            block = weight[r, g * group : (g + 1) * group]
            lo, hi = min(float(block.min()), 0.0), max(float(block.max()), 0.0)
            if symmetric:
                hi = max(-lo, hi)
                lo = -hi
            if lo == hi == 0:  # an all-zero group: any grid represents it; GPTQ takes [-1, 1]
                lo, hi = -1.0, 1.0
            scale = np.float32((np.float32(hi) - np.float32(lo)) / np.float32(15))
            zero = 8 if symmetric else int(np.round(np.float32(-lo) / scale))
            q = np.clip(np.round(block / scale) + zero, 0, 15)
            codes[r, g * group : (g + 1) * group] = q
            scales[r, g], zeros[r, g] = scale, zero
    return codes, scales, zeros


def random_weight(out: int = 12, width: int = 128, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((out, width)).astype(np.float32)
    weight[0, :32] = np.abs(weight[0, :32]) + 0.5  # a group with no negative value
    weight[1, 32:64] = 0.0  # an all-zero group
    return weight


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, 64])
def test_rtn_parameters_match_a_numpy_reference(group: int, symmetric: bool) -> None:
    weight = random_weight()
    layer = quantize_rtn(torch.from_numpy(weight), group, symmetric)
    codes, scales, zeros = numpy_reference(weight, group, symmetric)
    np.testing.assert_allclose(layer.scales.numpy(), scales, rtol=1e-6)
    np.testing.assert_array_equal(layer.zeros.numpy(), zeros)
    assert (layer.codes.numpy() != codes).mean() < 1e-3  # ties may round apart
    assert layer.codes.dtype == torch.uint8 and int(layer.codes.max()) <= 15
    dequantized = layer.dequantize().numpy()
    assert (
        np.abs(dequantized - weight).max()
        <= layer.scales.numpy().max() * (0.5 if not symmetric else 1.0) + 1e-6
    )
    assert np.all(dequantized[1, 32:64] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [False, True])
def test_fake_quantization_is_the_dequantized_rtn_bit_for_bit(symmetric: bool, dtype: torch.dtype) -> None:
    weight = torch.from_numpy(random_weight()).to(dtype)  # with an all-zero and a positive group
    fake = fake_quantize_rtn(weight, 32, symmetric)
    assert fake.dtype == torch.float32
    assert torch.equal(fake, quantize_rtn(weight, 32, symmetric).dequantize())


def test_rtn_and_packing_match_onnxruntime() -> None:
    """ONNX Runtime's MLAS packer on the same weights gives the same MatMulNBits tensors."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    weight_t = random_weight(out=10, width=128)[2:].T.copy()  # the graph's [in, out]; MLAS zeroes an
    # all-zero group's scale where we keep GPTQ's [-1, 1] grid, so that row is left out
    k, n, block = weight_t.shape[0], weight_t.shape[1], 32
    assert n == 8
    packed = np.zeros((n, k // block, block // 2), np.uint8)
    scales = np.zeros((n, k // block), np.float32)
    zeros = np.zeros((n, (k // block + 1) // 2), np.uint8)
    quantize_matmul_4bits(packed, weight_t, scales, zeros, block, n, k, False)
    ours = matmulnbits_tensors(quantize_rtn(torch.from_numpy(weight_t.T.copy()), block, False))
    np.testing.assert_array_equal(ours[0], packed)
    np.testing.assert_allclose(ours[1], scales, rtol=1e-6)
    np.testing.assert_array_equal(ours[2], zeros)


def test_pack_unpack_round_trip_and_nibble_order() -> None:
    codes = np.array([[1, 2, 3, 4, 5]], np.uint8)
    packed = pack_uint4(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x05]]
    np.testing.assert_array_equal(unpack_uint4(packed, 5), codes)


def test_qdq_tensors_dequantize_to_the_same_weight() -> None:
    """Evaluate the block-wise DequantizeLinear with ONNX's reference implementation."""
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    weight = random_weight(out=6, width=64)
    for symmetric in (False, True):
        layer = quantize_rtn(torch.from_numpy(weight), 32, symmetric)
        codes, scales, zeros = qdq_tensors(layer, symmetric)
        kind = TensorProto.INT4 if symmetric else TensorProto.UINT4
        inits = [
            helper.make_tensor("q", kind, [64, 6], codes.tobytes(), raw=True),
            helper.make_tensor("s", TensorProto.FLOAT, list(scales.shape), scales.ravel()),
        ]
        inputs = ["q", "s"]
        if zeros is not None:
            inits.append(helper.make_tensor("z", kind, list(scales.shape), zeros.tobytes(), raw=True))
            inputs.append("z")
        node = helper.make_node("DequantizeLinear", inputs, ["w"], axis=0, block_size=32)
        output = helper.make_tensor_value_info("w", TensorProto.FLOAT, [64, 6])
        graph = helper.make_graph([node], "dq", [], [output], initializer=inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
        (result,) = ReferenceEvaluator(model).run(None, {})
        np.testing.assert_allclose(result, layer.dequantize().numpy().T, rtol=0, atol=1e-6)


def test_params_round_trip_through_extras(tmp_path) -> None:  # type: ignore[no-untyped-def]
    layer = quantize_rtn(torch.from_numpy(random_weight(out=4, width=64)), 32, False)
    save_params(tmp_path, {"lm_head": layer}, {"algorithm": "rtn", "group_size": 32, "symmetric": False})
    info, layers = load_params(tmp_path)
    assert info["modules"] == ["lm_head"] and info["bits"] == 4
    loaded = layers["lm_head"]
    assert isinstance(loaded, QuantizedLinear)
    assert torch.equal(loaded.codes, layer.codes) and torch.equal(loaded.zeros, layer.zeros)
    assert torch.equal(loaded.dequantize(), layer.dequantize())
    assert load_params(tmp_path / "missing") == ({}, {})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"group_size": 96}, r"quant.group_size=96 is not supported: choose one of 32, 64, 128"),
        ({"calibration": {"num_samples": 0}}, r"quant.calibration.num_samples=0: at least one"),
        ({"calibration": {"seq_len": 1}}, r"quant.calibration.seq_len=1: must be at least 2"),
        ({"accuracy_level": 7}, r"quant.accuracy_level=7"),
        ({"damp_percent": -0.1}, r"quant.damp_percent=-0.1"),
    ],
)
def test_recipe_config_errors(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Int4GptqRecipe(**overrides).passes()


def test_group_size_must_divide_every_input_width(tiny_source: Artifact) -> None:
    gptq = GptqPass(group_size=128, calibration=CalibrationConfig(num_samples=2, seq_len=16))
    with pytest.raises(
        ConfigError, match=r"quant.group_size=128 does not divide the input width 64 of model"
    ):
        check_against_model([gptq], tiny_source)
    check_against_model([GptqPass(group_size=128, exclude=["*"])], tiny_source)  # nothing to divide


def test_hydra_recipe_expands_around_export() -> None:
    scan = "quant.sensitivity.enabled=true"  # for the record: by default only fallback=auto scans
    cfg = compose_recipe(["quant=int4_gptq", "quant.group_size=32", "quant.exclude=[lm_head]", scan])
    passes = build_passes(cfg)
    assert [p.name for p in passes] == ["sensitivity", "gptq", "export", "int4_lowering", "ort_build"]
    assert passes[1].config.group_size == 32 and passes[3].config.exclude == ["lm_head"]
    assert passes[1].config.calibration == CalibrationConfig()
    assert passes[0].config.group_size == 32 and passes[0].config.exclude == ["lm_head"]
    cfg = compose_recipe(["quant=int4_awq", "quant.lowering=qdq", "quant.calibration.num_samples=8", scan])
    passes = build_passes(cfg)
    assert [p.name for p in passes] == ["sensitivity", "awq", "export", "int4_lowering", "ort_build"]
    assert passes[1].config.calibration.num_samples == 8 and passes[3].config.lowering == "qdq"


# --------------------------------------------------------------------------------------------
# The torch passes stream the checkpoint one decoder block at a time (calibration/streaming.py);
# their results must equal the same algorithm run on the model held whole, as before streaming.

STREAMED = {
    "awq": (AwqPass, {"group_size": 32, "grid": 4, "calibration": {"num_samples": 4, "seq_len": 32}}),
    # lm_head excluded: the output keeps the tied head (no lm_head tensor written)
    "gptq": (
        GptqPass,
        {"group_size": 32, "exclude": ["lm_head"], "calibration": {"num_samples": 4, "seq_len": 32}},
    ),
}
BF16 = ResolvedPlacement("cpu", "bfloat16")


@functools.cache
def whole_model_reference(
    algorithm: str, folder: Path, placement: ResolvedPlacement
) -> tuple[dict[str, Any], dict[str, QuantizedLinear]]:
    """The state dict and parameters of ``algorithm`` run on the model loaded whole (load_causal_lm)
    on ``placement``: the code path before streaming."""
    cls, kwargs = STREAMED[algorithm]
    step = cls(**kwargs)
    step.placement = placement
    model = load_causal_lm(folder, placement=placement)
    targets = step.targets(model, folder)
    if "lm_head" in targets:
        untie_lm_head(model)
    windows = token_windows(load_tokenizer(folder), step.config.calibration)
    with torch.no_grad():
        layers = step.quantize_model(model, windows, targets)
    return model.state_dict(), layers


def saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def run_streamed(
    algorithm: str, source: Artifact, out: Path, placement: ResolvedPlacement, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, dict[str, Any], dict[str, QuantizedLinear]]:
    """Run the pass through the manager; check it never holds two decoder blocks at once; its
    output folder, metrics and parameters."""
    cls, kwargs = STREAMED[algorithm]
    step = cls(**kwargs)
    step.placement = placement
    resident: list[int] = []
    materialize = StreamedCheckpoint.materialize

    def counting(self: StreamedCheckpoint, prefix: str) -> Any:
        module = materialize(self, prefix)
        layers = self.model.model.layers
        resident.append(sum(not next(layer.parameters()).is_meta for layer in layers))
        return module

    monkeypatch.setattr(StreamedCheckpoint, "materialize", counting)
    result, metrics = run_pass(step, source, out)
    assert max(resident) == 1 and resident.count(1) == 2  # each of the 2 blocks alone, once
    return result.path, metrics, load_params(result.path / EXTRAS_DIR / INT4_DIR)[1]


def assert_same_parameters(streamed: dict[str, QuantizedLinear], whole: dict[str, QuantizedLinear]) -> None:
    assert sorted(streamed) == sorted(whole)
    for name, layer in whole.items():
        assert torch.equal(streamed[name].codes, layer.codes), name
        assert torch.equal(streamed[name].scales, layer.scales.cpu()), name
        assert torch.equal(streamed[name].zeros, layer.zeros.cpu()), name


@pytest.mark.parametrize("algorithm", ["awq", "gptq"])
def test_streamed_pass_equals_the_whole_model(
    algorithm: str, tiny_source: Artifact, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output, metrics, layers = run_streamed(algorithm, tiny_source, tmp_path, CPU_FLOAT32, monkeypatch)
    state, reference = whole_model_reference(algorithm, tiny_source.path, CPU_FLOAT32)
    assert_same_parameters(layers, reference)  # bit for bit: the same ops in the same order
    assert metrics["quantized_layers"] == len(reference) == (15 if algorithm == "awq" else 14)
    saved = saved_tensors(output)
    tied = algorithm == "gptq"  # lm_head excluded: still tied, stored once
    assert set(saved) == set(state) - ({"lm_head.weight"} if tied else set())
    for name, value in saved.items():
        assert value.dtype == torch.float32 and torch.equal(value, state[name]), name
    # The output loads as a whole model again (sharded, with an index).
    loaded = load_causal_lm(output)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tied


@pytest.mark.parametrize("algorithm", ["awq", "gptq"])
def test_the_pass_computes_on_the_placement(
    algorithm: str, tiny_source: Artifact, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16 compute: the parameters are those of the whole model in bfloat16 and differ from
    float32's (a pass ignoring the placement would give float32's); weights are saved in float32."""
    assert STREAMED[algorithm][0].placement_knobs == ("device", "torch_dtype")
    assert STREAMED[algorithm][0].memory_profile == "block"
    output, _, layers = run_streamed(algorithm, tiny_source, tmp_path, BF16, monkeypatch)
    assert_same_parameters(layers, whole_model_reference(algorithm, tiny_source.path, BF16)[1])
    _, fp32 = whole_model_reference(algorithm, tiny_source.path, CPU_FLOAT32)
    assert any(not torch.equal(layers[name].codes, fp32[name].codes) for name in fp32)
    saved = saved_tensors(output)
    assert {v.dtype for v in saved.values()} == {torch.float32}
    # Tensors the pass does not change keep their stored float32 values (not rounded to bfloat16).
    original = load_causal_lm(tiny_source.path).state_dict()
    assert torch.equal(saved["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    if algorithm == "gptq":
        assert torch.equal(saved["model.norm.weight"], original["model.norm.weight"])
        norm = "model.layers.0.input_layernorm.weight"
        assert torch.equal(saved[norm], original[norm])
    assert issubclass(STREAMED[algorithm][0], TorchInt4Pass)
