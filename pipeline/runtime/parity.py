"""Parity of two graph folders: their logits on a fixed prompt and a few greedy decode steps, in
ONNX Runtime sessions stepped as the runtime steps an engine. Graph passes call
:func:`compare_graphs` in ``ensures`` to bound what they changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.artifacts import read_metadata
from pipeline.core.engine import graph_io
from pipeline.core.graph_io import model_file
from pipeline.runtime.ort import OrtModel

# A fixed text for graphs that carry their tokenizer (the export pass's default parity prompt).
PARITY_PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time, there was"
# A fixed prompt of token ids below any vocabulary we build (the tiny test model has 320).
PARITY_PROMPT_IDS = (1, 42, 7, 99, 3, 250, 17, 5, 64, 128, 11, 300, 23, 77, 9, 180)
PARITY_DECODE_STEPS = 6
PARITY_BUFFER = 256  # positions of a full layer's shared buffer in the parity check


def _parity_model(folder: Path, optimization: str) -> Any:
    """A graph in a session, stepped as the runtime will: a fused graph whose GroupQueryAttention
    keeps a window-sized buffer (kv_cache layout=shared with a window) needs that buffer bound."""
    io = graph_io(folder)
    metadata = read_metadata(folder)
    capacity = metadata.get("kv_cache", {}).get("capacity") or ()
    if capacity and metadata.get("fusion"):
        io = dataclasses.replace(io, kv_layout="shared", kv_capacity=capacity)
    return OrtModel(
        folder / model_file(folder),
        io,
        optimization=optimization,
        capacity=max((*io.kv_capacity, PARITY_BUFFER)),  # a full layer's buffer: the prompt and steps
        prepack=False,
    )


def prompt_ids(folder: Path, prompt: str | Sequence[int], vocab: int) -> np.ndarray:
    """``[1, n]`` token ids of ``prompt``: text through ``folder``'s tokenizer, or ids (mod vocab)."""
    if isinstance(prompt, str):
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)(prompt)["input_ids"]
    else:
        ids = [i % vocab for i in prompt]
    return np.array([ids], dtype=np.int64)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _decode(
    model: Any, ids: np.ndarray, steps: int, feed: list[int] | None
) -> tuple[list[np.ndarray], list[int]]:
    """Logits of a prefill of ``ids`` and ``steps`` decode steps, feeding ``feed`` (default: the
    model's own greedy tokens); returns the logits per step and the tokens fed."""
    cache = model.empty_cache(1)
    mask = np.ones_like(ids)
    positions = np.arange(ids.shape[1], dtype=np.int64)[None]
    logits, fed = [], []
    for step in range(steps + 1):
        out, cache = model.step(ids, mask, positions, cache)
        logits.append(np.array(out[0], dtype=np.float32))
        if step == steps:
            break
        token = feed[step] if feed is not None else int(out[0, -1].argmax())
        fed.append(token)
        ids = np.array([[token]], dtype=np.int64)
        mask = np.ones((1, mask.shape[1] + 1), dtype=np.int64)
        positions = np.array([[mask.shape[1] - 1]], dtype=np.int64)
    return logits, fed


def compare_graphs(
    reference: Path,
    candidate: Path,
    prompt: str | Sequence[int] = PARITY_PROMPT_IDS,
    steps: int = PARITY_DECODE_STEPS,
    optimization: str = "all",
) -> dict[str, Any]:
    """Logits of two graph folders on ``prompt`` (prefill) and ``steps`` decode steps of the
    reference's greedy tokens (fed to both, so the caches stay comparable), in ONNX Runtime, one
    session at a time (memory: one graph): ``max_abs_diff`` (largest |logit difference|), ``kl``
    (mean KL(reference || candidate) per position, nats), ``top1_agreement``, ``finite`` (the
    candidate's logits) and ``tokens``."""
    model = _parity_model(Path(reference), optimization)
    ids = prompt_ids(Path(reference), prompt, model.io.vocab_size)
    reference_logits, fed = _decode(model, ids, steps, None)
    del model
    model = _parity_model(Path(candidate), optimization)
    candidate_logits, _ = _decode(model, ids, steps, fed)
    del model
    ref, cand = np.concatenate(reference_logits), np.concatenate(candidate_logits)
    finite = bool(np.isfinite(cand).all())
    log_p, log_q = _log_softmax(ref), _log_softmax(cand)
    kl = float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean()) if finite else float("inf")
    return {
        "tokens": int(ref.shape[0]),
        "decode_steps": steps,
        "finite": finite,
        "max_abs_diff": float(np.abs(ref - cand).max()),
        "kl": kl,
        "top1_agreement": float((ref.argmax(-1) == cand.argmax(-1)).mean()),
    }
