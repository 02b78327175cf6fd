"""SmoothQuant (torch stage) on the tiny random Llama: the fp32 function is unchanged, the weights
are not, the scales and recorded activation ranges match a reference computed here, and user
mistakes are one-line errors naming the knob."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from calibration.datasets import CalibrationConfig, token_windows
from passes.smoothquant import (
    ACTIVATIONS_FILE,
    SmoothQuantConfig,
    SmoothQuantPass,
    activation_ranges,
    collect_channel_absmax,
    smooth_model,
)
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.config import build_config
from pipeline.core.errors import CalibrationError, ConfigError, PassError
from pipeline.core.manager import check_against_model
from pipeline.core.placement import CPU_FLOAT32, ResolvedPlacement
from pipeline.core.torch_model import load_causal_lm, load_tokenizer
from tests.conftest import make_tiny_llama, run_pass

CALIBRATION = {"num_samples": 4, "seq_len": 32}
ALPHA = 0.6


def smooth(source: Artifact, out: Path, **config: object) -> tuple[Artifact, dict]:
    step = SmoothQuantPass(**{"alpha": ALPHA, "calibration": CALIBRATION, "weight_only": [], **config})
    return run_pass(step, source, out)


@pytest.fixture(scope="module")
def smoothed(tiny_source: Artifact, tmp_path_factory: pytest.TempPathFactory) -> tuple[Artifact, dict]:
    return smooth(tiny_source, tmp_path_factory.mktemp("smoothed"))


def reference_channel_absmax(model: torch.nn.Module, ids: np.ndarray) -> dict[str, torch.Tensor]:
    """max|x_j| of every nn.Linear input, collected here independently of the pass (one batch)."""
    found: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(_module: torch.nn.Module, args: tuple) -> None:
            found[name] = args[0].abs().flatten(0, -2).amax(0)

        return record

    handles = [
        module.register_forward_pre_hook(hook(name))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]
    with torch.no_grad():
        model(input_ids=torch.from_numpy(ids), use_cache=False)
    for handle in handles:
        handle.remove()
    return found


def windows(folder: Path) -> np.ndarray:
    return token_windows(load_tokenizer(folder), CalibrationConfig(**CALIBRATION))


def test_fp32_function_is_unchanged(tiny_source: Artifact, smoothed: tuple[Artifact, dict]) -> None:
    before, after = load_causal_lm(tiny_source.path), load_causal_lm(smoothed[0].path)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 7, 64, 128, 11, 300]])
    with torch.no_grad():
        a, b = before(ids).logits, after(ids).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (a - b).abs().max()
    assert (
        smoothed[1]["fp32_parity"]["top1_agreement"] == 1.0 and smoothed[1]["fp32_parity"]["relative"] < 1e-5
    )


def test_weights_change_and_the_tied_head_does_not(
    tiny_source: Artifact, smoothed: tuple[Artifact, dict]
) -> None:
    before, after = load_causal_lm(tiny_source.path), load_causal_lm(smoothed[0].path)
    b, a = dict(before.named_parameters()), dict(after.named_parameters())
    for name in [
        "model.layers.0.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    ]:
        assert not torch.allclose(b[name], a[name]), name
    assert torch.equal(b["model.embed_tokens.weight"], a["model.embed_tokens.weight"])
    assert torch.equal(b["model.norm.weight"], a["model.norm.weight"])
    assert after.lm_head.weight.data_ptr() == after.model.embed_tokens.weight.data_ptr()
    assert smoothed[1]["groups_smoothed"] == 2 * 4  # qkv, o, gate/up, down per layer


def test_output_folder_keeps_the_source_files(tiny_source: Artifact, smoothed: tuple[Artifact, dict]) -> None:
    result = smoothed[0]
    # The weights are written block by block as shards (issue 21), not as one model.safetensors.
    source_files = {p.name for p in tiny_source.path.iterdir() if p.name != "model.safetensors"}
    assert source_files <= {p.name for p in result.path.iterdir()}
    assert (result.path / "model.safetensors.index.json").is_file()
    assert (result.path / "extras" / "int8" / ACTIVATIONS_FILE).is_file()
    assert result.metadata["smoothquant"]["alpha"] == ALPHA


def test_scales_match_an_independent_reference(
    tiny_source: Artifact, smoothed: tuple[Artifact, dict]
) -> None:
    """s_j = max|X_j|^a / max|W_j|^(1-a), folded into the norms, v_proj rows (one scale per KV
    channel, max over the query heads that read it) and up_proj rows; ranges are max|X / s|."""
    before, after = load_causal_lm(tiny_source.path), load_causal_lm(smoothed[0].path)
    ids = windows(tiny_source.path)
    act = reference_channel_absmax(before, ids)
    b, a = dict(before.named_parameters()), dict(after.named_parameters())
    cfg = before.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // heads
    rep = heads // kv_heads

    def weight_max(*names: str) -> torch.Tensor:
        return torch.stack([b[n].abs().amax(0) for n in names]).amax(0)

    p = "model.layers.1"
    # input_layernorm -> q, k, v
    w = weight_max(*[f"{p}.self_attn.{x}_proj.weight" for x in "qkv"])
    s = act[f"{p}.self_attn.q_proj"] ** ALPHA / w ** (1 - ALPHA)
    torch.testing.assert_close(a[f"{p}.input_layernorm.weight"], b[f"{p}.input_layernorm.weight"] / s)
    torch.testing.assert_close(a[f"{p}.self_attn.k_proj.weight"], b[f"{p}.self_attn.k_proj.weight"] * s)
    # v_proj rows -> o_proj columns, explicitly head by head
    o_act, o_w = act[f"{p}.self_attn.o_proj"], b[f"{p}.self_attn.o_proj.weight"].abs().amax(0)
    s_kv = torch.empty(kv_heads * head_dim)
    for g in range(kv_heads):
        for d in range(head_dim):
            columns = [h * head_dim + d for h in range(heads) if h // rep == g]
            s_kv[g * head_dim + d] = o_act[columns].max() ** ALPHA / o_w[columns].max() ** (1 - ALPHA)
    v = b[f"{p}.self_attn.v_proj.weight"] * s  # columns from the qkv group, rows from this one
    torch.testing.assert_close(a[f"{p}.self_attn.v_proj.weight"], v / s_kv[:, None])
    s_o = torch.stack([s_kv[(h // rep) * head_dim + d] for h in range(heads) for d in range(head_dim)])
    torch.testing.assert_close(a[f"{p}.self_attn.o_proj.weight"], b[f"{p}.self_attn.o_proj.weight"] * s_o)
    # post_attention_layernorm -> gate, up; up_proj rows -> down_proj columns
    w = weight_max(f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight")
    s_gu = act[f"{p}.mlp.gate_proj"] ** ALPHA / w ** (1 - ALPHA)
    torch.testing.assert_close(a[f"{p}.mlp.gate_proj.weight"], b[f"{p}.mlp.gate_proj.weight"] * s_gu)
    s_d = act[f"{p}.mlp.down_proj"] ** ALPHA / weight_max(f"{p}.mlp.down_proj.weight") ** (1 - ALPHA)
    up = b[f"{p}.mlp.up_proj.weight"] * s_gu / s_d[:, None]
    torch.testing.assert_close(a[f"{p}.mlp.up_proj.weight"], up)
    torch.testing.assert_close(a[f"{p}.mlp.down_proj.weight"], b[f"{p}.mlp.down_proj.weight"] * s_d)

    # Recorded per-tensor ranges equal max|X| measured on the smoothed model itself.
    recorded = json.loads((smoothed[0].path / "extras" / "int8" / ACTIVATIONS_FILE).read_text())["absmax"]
    measured = reference_channel_absmax(after, ids)
    assert set(recorded) == set(measured)
    for name, value in measured.items():
        assert recorded[name] == pytest.approx(float(value.max()), rel=1e-4), name


def test_smooth_false_keeps_weights_and_records_ranges(tiny_source: Artifact, tmp_path: Path) -> None:
    result, metrics = smooth(tiny_source, tmp_path, smooth=False)
    assert metrics["groups_smoothed"] == 0
    before, after = load_causal_lm(tiny_source.path), load_causal_lm(result.path)
    for (name, x), (_, y) in zip(before.named_parameters(), after.named_parameters(), strict=True):
        assert torch.equal(x, y), name
    ranges = json.loads((result.path / "extras" / "int8" / ACTIVATIONS_FILE).read_text())["absmax"]
    measured = reference_channel_absmax(before, windows(tiny_source.path))
    assert ranges["lm_head"] == pytest.approx(float(measured["lm_head"].max()), rel=1e-5)


def test_weight_only_and_excluded_layers_are_not_smoothed(tiny_source: Artifact, tmp_path: Path) -> None:
    result, metrics = smooth(tiny_source, tmp_path, weight_only=["*.down_proj"], exclude=["*.o_proj"])
    assert metrics["groups_smoothed"] == 2 * 2  # qkv and gate/up only
    before, after = load_causal_lm(tiny_source.path), load_causal_lm(result.path)
    for name in ["model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"]:
        assert torch.equal(before.get_parameter(name), after.get_parameter(name))


@pytest.mark.parametrize(
    ("config", "error", "needle"),
    [
        ({"alpha": 1.5}, PassError, "quant.alpha=1.5 is outside [0, 1]"),
        ({"alpha": -0.1}, PassError, "quant.alpha=-0.1 is outside [0, 1]"),
        ({"alpha": float("nan")}, PassError, "quant.alpha=nan"),
        ({"calibration": {"num_samples": 0}}, CalibrationError, "quant.calibration.num_samples=0"),
        ({"calibration": {"seq_len": 1}}, CalibrationError, "quant.calibration.seq_len=1"),
        ({"batch_size": 0}, PassError, "quant.batch_size=0"),
    ],
)
def test_bad_config_is_a_one_line_error(
    tiny_source: Artifact, config: dict, error: type, needle: str
) -> None:
    with pytest.raises(error) as info:
        SmoothQuantPass(**config)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_exclude_typo_names_the_knob(tiny_source: Artifact, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"quant.exclude pattern 'lm_haed' matches no linear module"):
        check_against_model([SmoothQuantPass(calibration=CALIBRATION, exclude=["lm_haed"])], tiny_source)


def test_non_finite_statistics_are_a_calibration_error(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "broken")
    model = load_causal_lm(folder)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[3, :] = float("inf")
    model.save_pretrained(folder)
    with pytest.raises(CalibrationError, match=r"quant.calibration: the input statistics of .* NaN/inf"):
        SmoothQuantPass(calibration=CALIBRATION).run(Artifact.from_dir(Kind.TORCH, folder), tmp_path / "out")


# --------------------------------------------------------------------------------------------
# Block streaming and placement (issue 21)


def whole_model_smoothquant(
    folder: Path, config: dict, placement: ResolvedPlacement = CPU_FLOAT32
) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, float]]:
    """Today's whole-model path, kept as functions: statistics from one forward of the whole model
    (on ``placement``), smoothing of the float32 weights. The state dict, the smoothed ranges and
    the unsmoothed ones."""
    cfg = build_config(SmoothQuantConfig, config)
    ids = token_windows(load_tokenizer(folder), cfg.calibration)
    compute = load_causal_lm(folder, placement=placement)
    stats, _ = collect_channel_absmax(compute, ids, cfg.batch_size)
    model = load_causal_lm(folder)
    divided, _ = smooth_model(model, stats, cfg) if cfg.smooth else ({}, [])
    unsmoothed = {n: float(v.max()) for n, v in stats.items()}
    return model.state_dict(), activation_ranges(stats, divided), unsmoothed


def assert_streamed_equals_whole(result: Artifact, whole: tuple) -> None:
    state, ranges, unsmoothed = whole
    saved = load_causal_lm(result.path).state_dict()
    assert set(saved) == set(state)
    for name, value in state.items():
        # Same operations on the same float32 inputs in the same order: bitwise equal.
        assert torch.equal(saved[name], value), (name, (saved[name] - value).abs().max())
    recorded = json.loads((result.path / "extras" / "int8" / ACTIVATIONS_FILE).read_text())
    assert recorded["absmax"] == ranges
    assert recorded["absmax_unsmoothed"] == unsmoothed


@pytest.mark.parametrize("tied", [True, False])
def test_streamed_pass_equals_the_whole_model_path(tmp_path: Path, tied: bool) -> None:
    """Block by block (several calibration batches, tied and untied head) gives today's weights
    and ranges exactly: each block sees the unsmoothed outputs of the one before, as in the
    whole-model forward, and the smoothing runs the same float32 operations per group."""
    folder = make_tiny_llama(tmp_path / "source", seed=3, tie_word_embeddings=tied)
    config = {"alpha": ALPHA, "calibration": CALIBRATION, "batch_size": 3}
    result, metrics = smooth(Artifact.from_dir(Kind.TORCH, folder), tmp_path / "out", **config)
    assert_streamed_equals_whole(result, whole_model_smoothquant(folder, config))
    assert metrics["fp32_parity"]["relative"] < 1e-5
    assert not (result.path / "model.safetensors").exists()  # shards + index, written per block
    index = json.loads((result.path / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    assert json.loads((result.path / "config.json").read_text())["dtype"] == "float32"


def test_bfloat16_placement_computes_in_bfloat16(tiny_source: Artifact, tmp_path: Path) -> None:
    """pipeline.torch_dtype=bfloat16: the statistics are those of a bfloat16 forward (so this fails
    if the pass ignores its placement), the scales are folded into the float32 weights, which are
    written in float32, and the parity probe still holds in float32."""
    bf16 = ResolvedPlacement("cpu", "bfloat16")
    step = SmoothQuantPass(alpha=ALPHA, calibration=CALIBRATION, weight_only=[])
    step.placement = bf16
    metrics = step.run(tiny_source, tmp_path / "out")
    result = Artifact.from_dir(Kind.TORCH, tmp_path / "out")
    whole = whole_model_smoothquant(tiny_source.path, {"alpha": ALPHA, "calibration": CALIBRATION}, bf16)
    assert_streamed_equals_whole(result, whole)
    fp32 = whole_model_smoothquant(tiny_source.path, {"alpha": ALPHA, "calibration": CALIBRATION})
    assert whole[2] != fp32[2]  # bfloat16 statistics differ from float32 ones: the knob is seen
    assert all(v.dtype == torch.float32 for v in load_causal_lm(result.path).state_dict().values())
    assert metrics["fp32_parity"]["relative"] < 1e-5
    assert SmoothQuantPass.placement_knobs == ("device", "torch_dtype")
    assert SmoothQuantPass.memory_profile == "block"
