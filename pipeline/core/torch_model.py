"""Loading a torch artifact (HF Llama folder) safely: safetensors only, never remote code
(``trust_remote_code=False`` on every load; sources with ``auto_map`` are refused earlier, in
``pipeline/sources.py``). A file transformers cannot read is a one-line SourceError."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from pipeline.core.artifacts import ARTIFACT_FILE
from pipeline.core.errors import SourceError
from pipeline.core.files import (
    copy_regular,
    link_root,
    loads_bounded,
    read_regular_text,
    regular_size,
    walk_regular,
)
from pipeline.core.placement import CPU_FLOAT32, ResolvedPlacement

# Readers of a bad checkpoint file raise many types (OSError, ValueError, TypeError, KeyError,
# huggingface_hub's validation errors, tokenizers' plain Exception, ...), some over many lines.
MAX_REASON = 300


def _reason(exc: BaseException) -> str:
    """The exception's message on one line, shortened."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


# Files save_pretrained writes; copy_beside_weights leaves them to it.
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


def load_causal_lm(
    folder: Path, attn_implementation: str | None = None, placement: ResolvedPlacement = CPU_FLOAT32
) -> Any:
    """Load a ``LlamaForCausalLM`` in eval mode on ``placement``'s device and dtype (default: the
    CPU in float32); a corrupt checkpoint is a SourceError.

    ``attn_implementation`` picks transformers' attention code ("eager", "sdpa"; None: its default).
    """
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=placement.dtype,
            device_map=None if placement.device == "cpu" else placement.device,
            use_safetensors=True,
            trust_remote_code=False,
            attn_implementation=attn_implementation,
        )
    except Exception as exc:  # see MAX_REASON
        raise SourceError(
            f"cannot load the checkpoint in {folder} ({_reason(exc)}): re-save or re-download it"
        ) from None
    return model.eval()


def load_tokenizer(folder: Path) -> Any:
    """The checkpoint's tokenizer (never its code); a missing or corrupt one is a SourceError."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as exc:  # see MAX_REASON
        raise SourceError(
            f"cannot load the tokenizer in {folder} ({_reason(exc)}): save it beside the weights"
        ) from None


def copy_beside_weights(source: Path, out_dir: Path, skip: tuple[str, ...] = ()) -> None:
    """Copy what a checkpoint folder holds besides its weights (tokenizer, templates, extras of
    earlier passes) into ``out_dir``, where a torch pass then writes the weights with
    ``save_pretrained``; ``artifact.json`` and the names in ``skip`` are left out. Only regular
    files (or symlinks to them) and real folders are copied: a FIFO, a device (a symlink to
    ``/dev/zero`` would be copied forever) or a symlinked folder is refused in one line, before
    anything is copied."""
    top = [
        path
        for path in sorted(source.iterdir())
        if not (path.name == ARTIFACT_FILE or path.name in skip or path.name.endswith(WEIGHT_SUFFIXES))
    ]
    for path in top:  # everything is checked (stat only: nothing blocks) before anything is copied
        if path.is_dir() and not path.is_symlink():
            list(walk_regular(path, what="a checkpoint file copied"))
        else:
            regular_size(path, what="a checkpoint file copied")
    root = link_root(source)  # where a link may lead, checked again as each file is opened

    def copy(src: str | Path, dst: str | Path) -> None:
        copy_regular(Path(src), Path(dst), within=root, what="a checkpoint file copied")

    for path in top:
        if path.is_dir():
            shutil.copytree(path, out_dir / path.name, copy_function=copy)
        else:
            copy(path, out_dir / path.name)


LM_HEAD = "lm_head"


def linear_layers(model: Any) -> dict[str, Any]:
    """Every ``nn.Linear`` of a causal LM by module name (decoder projections and ``lm_head``)."""
    import torch

    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def meta_model(folder: Path) -> Any:
    """The model skeleton (no weights) of a checkpoint: module names and shapes, in milliseconds;
    the planned model's (its ``config.json`` read bounded, regular files only)."""
    from pipeline.core.planned_model import CONFIG_MAX_BYTES, PlannedModel

    path = Path(folder) / "config.json"
    try:
        config = loads_bounded(read_regular_text(path, max_bytes=CONFIG_MAX_BYTES, what="a config.json"))
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else _reason(exc)
        raise SourceError(f"cannot read {path} ({reason}): re-save or re-download the checkpoint") from None
    if not isinstance(config, dict):
        raise SourceError(f"{path} holds no JSON object: re-save or re-download the checkpoint")
    return PlannedModel(config=config, where=str(path)).skeleton


def untie_lm_head(model: Any) -> bool:
    """Give ``lm_head`` its own copy of a tied embedding (the embedding is not changed)."""
    import torch

    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head.weight is embed.weight or head.weight.data_ptr() == embed.weight.data_ptr()
    if tied:
        head.weight = torch.nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    return tied


def rebuild_computed_buffers(model: Any, config: Any, device: Any = "cpu") -> None:
    """Give a model built on ``meta`` the buffers that no checkpoint stores, computed from its
    config: the rotary embedding's frequencies (every ``*inv_freq`` buffer: Llama's ``inv_freq``,
    Gemma 3's one per layer type) and Gemma's embedding scale (``embed_scale``, sqrt(hidden)).
    Any other buffer left on ``meta`` is one line naming it: a module the export and the
    streaming loader do not know how to compute."""
    import torch

    for name, module in list(model.named_modules()):
        meta = [key for key, buffer in module._buffers.items() if buffer is not None and buffer.is_meta]
        if not meta:
            continue
        if all(key.endswith("inv_freq") for key in meta):
            with torch.device("cpu"):
                fresh = type(module)(config=config)  # transformers' rotary: computed from the config
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, fresh.to(device))
        elif meta == ["embed_scale"] and hasattr(module, "scalar_embed_scale"):
            module._buffers["embed_scale"] = torch.tensor(float(module.scalar_embed_scale), device=device)
        else:
            raise SourceError(
                f"cannot compute the buffer {name}.{meta[0]} of {type(module).__name__}: it is not "
                "in the checkpoint and not a rotary or embedding scale this build knows"
            )


def switched_longrope(config: Any) -> Any:
    """A traceable stand-in for transformers' longrope rotary (Phi-3.5-mini, Phi-3-128k), a torch
    module. transformers picks the short or the long factors in Python, per forward, from
    ``max(position_ids) + 1 > original_max_position_embeddings`` (``dynamic_rope_update``,
    ``longrope_frequency_update``), which a trace would freeze at the traced length. This module
    holds both frequency tables (transformers' own ``_compute_longrope_parameters``) and chooses
    with a ``Where`` on the same condition, so the graph switches as transformers does, step by
    step; cos and sin carry the same attention factor."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = config.rope_parameters
    original = int(rope.get("original_max_position_embeddings") or config.max_position_embeddings)
    short, scaling = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=original + 1)

    class SwitchedLongRope(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("short_inv_freq", short.float(), persistent=False)
            self.register_buffer("long_inv_freq", long.float(), persistent=False)

        def forward(self, x: Any, position_ids: Any) -> tuple[Any, Any]:
            use_long = position_ids.max() + 1 > original
            inv_freq = torch.where(use_long, self.long_inv_freq, self.short_inv_freq)
            freqs = position_ids[..., None].float() * inv_freq
            angles = torch.cat((freqs, freqs), dim=-1)
            cos, sin = angles.cos() * float(scaling), angles.sin() * float(scaling)
            return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    return SwitchedLongRope()


def switch_longrope(model: Any, rotary_name: str) -> bool:
    """Replace the model's longrope rotary (module ``rotary_name``) with :func:`switched_longrope`
    before a trace; False (nothing changed) for any other RoPE."""
    rope = getattr(model.config, "rope_parameters", None)
    if not (isinstance(rope, dict) and rope.get("rope_type") == "longrope"):
        return False
    parent, _, child = rotary_name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, switched_longrope(model.config))
    return True
