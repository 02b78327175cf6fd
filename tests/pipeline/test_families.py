"""A family description names what transformers builds (issue 51, step 1): every module path of
Llama's description resolves on transformers' own Llama, its smoothing groups are the ones the
smoothing passes have always used, and an unknown model_type is one line naming the families."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.errors import SourceError
from pipeline.core.families import (
    FAMILIES,
    IMPORTED,
    LLAMA,
    SMOOTHING_KINDS,
    family_of,
    head_dim,
    layer_windows,
    supported,
)
from pipeline.core.planned_model import PlannedModel

# Llama's smoothing groups of a decoder block, as SmoothQuant and AWQ have grouped them since
# they were written (and llm-compressor's default mapping): (name, kind, producer, consumers).
LLAMA_GROUPS = [
    ("qkv", "norm", "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("o", "v", "self_attn.v_proj", ("self_attn.o_proj",)),
    ("gate_up", "norm", "post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("down", "up", "mlp.up_proj", ("mlp.down_proj",)),
]


@pytest.fixture(scope="module")
def skeleton(tiny_llama: Path) -> object:
    plan = PlannedModel.of(Artifact.from_dir(Kind.TORCH, tiny_llama))
    assert plan is not None
    return plan.skeleton


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_module_a_family_names_is_one_transformers_builds(family: str, skeleton: object) -> None:
    import torch

    described = FAMILIES[family]
    if described is not LLAMA:
        pytest.skip("each family's own test builds its checkpoint")
    root = skeleton.get_submodule  # type: ignore[attr-defined]
    assert isinstance(root(described.embeddings), torch.nn.Embedding)
    assert isinstance(root(described.head), torch.nn.Linear)
    assert root(described.final_norm) is not None and root(described.rotary) is not None
    layers = root(described.layers)
    assert len(layers) == 2
    block = root(described.layer(1))
    for name in described.projections:
        assert isinstance(block.get_submodule(name), torch.nn.Linear), name
    for name in described.norms:
        assert block.get_submodule(name) is not None
    for group in described.smoothing:
        assert group.kind in SMOOTHING_KINDS
        for name in (group.producer, *group.consumers, *([group.scored_by] if group.scored_by else [])):
            assert block.get_submodule(name) is not None, name
    assert described.qk_norms is None and described.fixed_biases == () and described.window_key is None


def test_llamas_smoothing_groups_are_the_ones_the_passes_have_used() -> None:
    assert [(g.name, g.kind, g.producer, g.consumers) for g in LLAMA.smoothing] == LLAMA_GROUPS
    assert [g.scored_by for g in LLAMA.smoothing] == ["self_attn", None, "mlp", "mlp.down_proj"]
    assert LLAMA.layer(3) == "model.layers.3"


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"hidden_size": 576, "num_attention_heads": 9}, 64),  # SmolLM2-135M
        ({"hidden_size": 576, "num_attention_heads": 9, "head_dim": None}, 64),
        ({"hidden_size": 1024, "num_attention_heads": 16, "head_dim": 128}, 128),  # Qwen3-0.6B
    ],
)
def test_head_dim_is_the_configs_or_the_quotient(config: dict, expected: int) -> None:
    assert head_dim(config) == expected


def test_the_window_of_a_layer_follows_the_config() -> None:
    llama = {"model_type": "llama", "num_hidden_layers": 2, "sliding_window": 4096}
    assert layer_windows(llama) == (0, 0)  # Llama has none, whatever the config says
    assert layer_windows(llama, 16) == (16, 16)  # kv_cache.window
    qwen2 = {"model_type": "qwen2", "num_hidden_layers": 3, "sliding_window": 64, "max_window_layers": 1}
    assert layer_windows(qwen2) == (0, 0, 0)  # use_sliding_window is false by default
    assert layer_windows({**qwen2, "use_sliding_window": True}) == (0, 64, 64)
    assert layer_windows({**qwen2, "use_sliding_window": True}, 16) == (16, 16, 16)
    mistral = {"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 8}
    assert layer_windows(mistral) == (8, 8)
    # MistralModel windows every layer and ignores layer_types (transformers warns)
    assert layer_windows({**mistral, "layer_types": ["full_attention", "sliding_attention"]}) == (8, 8)
    assert layer_windows({"model_type": "mistral", "sliding_window": 8}) == (8,) * 32  # transformers' default


def test_head_dim_defaults_to_the_familys_own() -> None:
    assert (
        head_dim({"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4}) == 128
    )  # Qwen3Config
    assert head_dim({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4}) == 16


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", None, 7, "LLAMA"])
def test_an_unknown_model_type_is_one_line_naming_the_families(model_type: object) -> None:
    with pytest.raises(SourceError) as error:
        family_of({"model_type": model_type}, where="/m/config.json")
    message = str(error.value)
    assert message == (
        f"/m/config.json declares model_type {model_type!r}: the supported families are {supported()}"
    )
    assert "Llama (LlamaForCausalLM)" in message and family_of({"model_type": "llama"}) is LLAMA


def test_every_family_has_its_config_bounds_and_every_bound_its_family() -> None:
    from pipeline.source_config import BOUNDS

    assert set(BOUNDS) == set(FAMILIES) | set(IMPORTED)


def test_a_planned_model_knows_its_family(tiny_llama: Path) -> None:
    plan = PlannedModel.of(Artifact.from_dir(Kind.TORCH, tiny_llama))
    assert plan is not None and plan.family is LLAMA


def test_gemmas_gain_is_divided_not_its_weight_in_any_dtype() -> None:
    """Gemma's gain 1 + w divided by s, for a bfloat16 weight near -1 and large scales: the gain
    is the float32 quotient up to the weight's own bf16 rounding (one rounding, at the store);
    Llama's gain, the weight itself, is divided as it is."""
    import torch

    from pipeline.core.families import divide_gain

    weight = torch.tensor([-0.9, 0.5, -0.999], dtype=torch.bfloat16)
    scales = torch.tensor([8.0, 0.5, 3.0])
    expected = (weight.float() + 1) / scales - 1
    divide_gain(weight, scales, 1.0)
    assert weight.dtype == torch.bfloat16
    gain, wanted = weight.float() + 1, expected + 1
    assert torch.allclose(gain, wanted, rtol=0.05, atol=1e-3), (gain, wanted)
    plain = torch.tensor([2.0, 4.0])
    divide_gain(plain, torch.tensor([2.0, 8.0]), 0.0)  # Llama's gain is the weight
    assert plain.tolist() == [1.0, 0.5]
