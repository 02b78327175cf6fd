"""Phi-3 checkpoints in Mistral's layout: ``qkv_proj`` and ``gate_up_proj`` split at import.

Phi-3, Phi-3.5-mini and Phi-4-mini (transformers' ``Phi3ForCausalLM``, ``model_type`` phi3) are a
Mistral block whose attention projections are one linear and whose MLP's gate and up are one
linear (transformers' ``modeling_phi3.py``):

- ``qkv_proj``'s output rows are the query heads, then the key heads, then the value heads
  (``query_pos = heads * head_dim``; ``key_states = qkv[..., query_pos : query_pos + kv_heads *
  head_dim]``; the rest are the values);
- ``gate_up_proj``'s output rows are gate, then up (``gate, up_states = up_states.chunk(2, dim=-1)``;
  ``up_states * act(gate)``);
- every layer attends within ``sliding_window`` where the config sets one, as Mistral's do.

Split by those rows, transformers' ``MistralForCausalLM`` computes exactly what ``Phi3ForCausalLM``
computes, so every pass sees the block it knows and records nothing new; the fused engine packs
q/k/v and gate/up again (``passes/fusion/packed_qkv.py``, ``packed_gate_up.py``). ONNX Runtime
GenAI's model builder does the same: ``make_attention_unpacked`` and ``make_mlp_unpacked``
(its base builder) slice ``qkv_proj`` and ``gate_up_proj`` into the q/k/v and gate/up of the
graph it builds for Mistral. longrope (Phi-3.5-mini) keeps its tables, the switch length moved
into them; the export follows the switch (``pipeline/core/torch_model.switched_longrope``). What
Mistral's block cannot compute is refused at start-up by ``pipeline/source_config.py``: a rotary
of part of a head (``partial_rotary_factor``, Phi-4-mini).

This module holds the pure mapping (the config, and the packed tensors' names and rows);
``pipeline/sources.py`` checks the folder, converts it once under ``models_dir`` and records
``converted_from``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.core.families import MISTRAL

QKV = "self_attn.qkv_proj.weight"
GATE_UP = "mlp.gate_up_proj.weight"
# Phi3Config keys Mistral's block has no use for, dropped from the converted config: dropout rates
# (inference runs none), the longrope training context (moved into the RoPE table, as_mistral),
# ``attention_bias`` (Phi3Attention builds qkv_proj without a bias whatever it says), the rotary
# fraction (refused below 1) and the checkpoint-code map of hub configs written before transformers
# had Phi-3's classes (never run: trust_remote_code is never set; transformers' own class is used).
DROPPED_KEYS = (
    "resid_pdrop",
    "embd_pdrop",
    "original_max_position_embeddings",
    "attention_bias",
    "partial_rotary_factor",
    "auto_map",
)


# What Phi3Config reads as longrope (older checkpoints name it "su"; Phi3Config maps "yarn" to it
# as well), and its default ``original_max_position_embeddings``.
LONGROPE_NAMES = ("longrope", "su", "yarn")
PHI3_ORIGINAL_MAX = 4096


def _head_dim(config: Mapping[str, Any]) -> int:
    return int(config["hidden_size"]) // int(config["num_attention_heads"])


def as_mistral(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of the converted checkpoint: Phi-3's fields under Mistral's
    ``model_type`` and architecture, ``head_dim`` spelled out (hidden / heads, as Phi-3 has it)."""
    converted = {key: value for key, value in config.items() if key not in DROPPED_KEYS}
    converted["model_type"] = MISTRAL.model_type
    converted["architectures"] = list(MISTRAL.architectures)
    converted["head_dim"] = _head_dim(config)
    converted.setdefault("num_key_value_heads", config["num_attention_heads"])
    for key in ("rope_parameters", "rope_scaling"):
        table = converted.get(key)
        if isinstance(table, dict):  # 1.0 (checked at start-up): Mistral rotates the whole head
            table = {k: v for k, v in table.items() if k != "partial_rotary_factor"}
            if table.get("rope_type", table.get("type")) in LONGROPE_NAMES:
                # where longrope switches to its long factors: Phi-3 keeps it beside the table
                original = config.get("original_max_position_embeddings") or PHI3_ORIGINAL_MAX
                table.setdefault("original_max_position_embeddings", original)
                table["rope_type"] = "longrope"
                table.pop("type", None)
            converted[key] = table
    return converted


def row_splits(name: str, config: Mapping[str, Any]) -> list[tuple[str, int]] | None:
    """The tensors a packed Phi-3 weight ``name`` becomes, each with its count of output rows, in
    row order; None for a tensor kept as it is."""
    if name.endswith("." + QKV):
        block = name[: -len(QKV)]  # "model.layers.3."
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        width = _head_dim(config)
        return [
            (f"{block}self_attn.q_proj.weight", heads * width),
            (f"{block}self_attn.k_proj.weight", kv_heads * width),
            (f"{block}self_attn.v_proj.weight", kv_heads * width),
        ]
    if name.endswith("." + GATE_UP):
        block = name[: -len(GATE_UP)]
        half = int(config["intermediate_size"])
        return [(f"{block}mlp.gate_proj.weight", half), (f"{block}mlp.up_proj.weight", half)]
    return None


def split_tensor(name: str, tensor: Any, config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The tensors (torch) ``name`` becomes: the packed weights' row blocks, each contiguous, in
    their own storage (safetensors refuses views that share one)."""
    parts = row_splits(name, config)
    if parts is None:
        return [(name, tensor)]
    rows = [count for _, count in parts]
    if tensor.shape[0] != sum(rows):
        raise ValueError(f"{name} has {tensor.shape[0]} rows, the config makes {sum(rows)}")
    blocks = tensor.split(rows, dim=0)
    return [(part, block.clone().contiguous()) for (part, _), block in zip(parts, blocks, strict=True)]
