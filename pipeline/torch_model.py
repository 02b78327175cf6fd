"""Loading a torch artifact (HF Llama folder) safely: safetensors only, never remote code."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from pipeline.artifacts import ARTIFACT_FILE
from pipeline.errors import SourceError, first_line

# Files save_pretrained writes; copy_beside_weights leaves them to it.
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


def load_causal_lm(folder: Path, attn_implementation: str | None = None) -> Any:
    """Load an fp32 ``LlamaForCausalLM`` in eval mode; a corrupt checkpoint is a SourceError.

    ``attn_implementation`` picks transformers' attention code ("eager", "sdpa"; None: its default).
    """
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=torch.float32,
            use_safetensors=True,
            trust_remote_code=False,
            attn_implementation=attn_implementation,
        )
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise SourceError(
            f"cannot load the checkpoint in {folder} ({first_line(exc)}): re-save or re-download it"
        ) from None
    return model.eval()


def load_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise SourceError(
            f"cannot load the tokenizer in {folder} ({first_line(exc)}): save it beside the weights"
        ) from None


def copy_beside_weights(source: Path, out_dir: Path, skip: tuple[str, ...] = ()) -> None:
    """Copy what a checkpoint folder holds besides its weights (tokenizer, templates, extras of
    earlier passes) into ``out_dir``, where a torch pass then writes the weights with
    ``save_pretrained``; ``artifact.json`` and the names in ``skip`` are left out."""
    for path in source.iterdir():
        if path.name == ARTIFACT_FILE or path.name in skip or path.name.endswith(WEIGHT_SUFFIXES):
            continue
        if path.is_dir():
            shutil.copytree(path, out_dir / path.name)
        else:
            shutil.copy2(path, out_dir / path.name)
