"""Token generation over a step function: greedy or seeded sampling, padded batches, a
streaming callback, and per-step timings (TTFT = prefill, TPOT = each decode step).

A batch of prompts of unequal length is padded on the left for graphs that mask with the
attention mask (the unfused export), and on the right for GroupQueryAttention graphs, which
take each row's length from the mask (``seqlens_k``) and keep each row's KV at positions
0..length-1: every row's next token is then fed at its own position."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass
class GenerationConfig:
    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    # False for benchmarks: decode exactly max_new_tokens even past an end-of-sequence token.
    stop_at_eos: bool = True


@dataclass
class GenerationResult:
    """Generated token ids per row (prompt excluded) and the wall-clock timings."""

    tokens: list[list[int]]
    prefill_seconds: float
    step_seconds: list[float] = field(default_factory=list)


class StepModel(Protocol):
    def empty_cache(self, batch: int) -> Any: ...

    def step(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, cache: Any
    ) -> tuple[np.ndarray, Any]: ...


def prompt_step(
    model: StepModel,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    position_ids: np.ndarray,
    cache: Any,
    logits_at: np.ndarray | None = None,
) -> tuple[np.ndarray, Any]:
    """``model.step`` for prompt tokens (not tokens the model generated): a model with a
    ``prompt_step`` (an int8-KV ONNX Runtime engine's prefill graph, ``pipeline/runtime/ort.py``)
    runs them there. ``logits_at`` [batch]: return only each row's logits at that index of the
    step's tokens, as [batch, 1, vocab] (a prefill graph then computes no others)."""
    if hasattr(model, "prompt_step"):
        return model.prompt_step(input_ids, attention_mask, position_ids, cache, logits_at=logits_at)
    logits, cache = model.step(input_ids, attention_mask, position_ids, cache)
    return select_logits(logits, logits_at), cache


def select_logits(logits: np.ndarray, logits_at: np.ndarray | None) -> np.ndarray:
    """``logits`` [batch, seq, vocab] at one position per row (``logits_at`` [batch]) as [batch,
    1, vocab]; all of them when ``logits_at`` is None."""
    if logits_at is None:
        return logits
    return logits[np.arange(logits.shape[0]), np.asarray(logits_at).reshape(-1)][:, None]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


# Tokens a step when a context is prefilled only for its KV cache (evals/lm_model.py scoring).
# One step over a long context materializes [heads, T, T] attention scores and [T, vocab] logits
# nothing reads (8k tokens: 1.6 GB of logits); in 512-token steps the default fp32 model
# prefills 8000 tokens in 17.8 s instead of 38.9 s, 2000 in 2.3 s instead of 3.1 (2 cores;
# benchmarks/prefill_chunks.py; 1024-token steps: 18.6 and 2.6 s).
PREFILL_CHUNK = 512


def prefill(
    model: StepModel, tokens: Sequence[int], cache: Any, start: int = 0, chunk: int = PREFILL_CHUNK
) -> Any:
    """``cache`` with ``tokens`` appended at positions ``start``.., run in steps of at most
    ``chunk`` tokens (0: one step); the logits are dropped. Equal to one step to float rounding:
    every position attends to the same keys, split across steps."""
    ids = np.asarray(tokens, dtype=np.int64)
    step = chunk if chunk > 0 else max(len(ids), 1)
    for offset in range(0, len(ids), step):
        part = ids[offset : offset + step]
        end = start + offset + len(part)
        mask = np.ones((1, end), dtype=np.int64)
        _, cache = prompt_step(
            model,
            part[None],
            mask,
            np.arange(start + offset, end)[None],
            cache,
            logits_at=np.array([len(part) - 1]),
        )
    return cache


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Stack prompts to one batch, padding on the left; return ids and attention mask."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def right_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Stack prompts to one batch, padding on the right; return ids and attention mask."""
    ids, mask = left_pad([list(p)[::-1] for p in prompts], pad_id)
    return np.ascontiguousarray(ids[:, ::-1]), np.ascontiguousarray(mask[:, ::-1])


def right_padded_mask(lengths: np.ndarray) -> np.ndarray:
    """The attention mask of rows holding ``lengths`` positions each, padded on the right."""
    return (np.arange(int(lengths.max())) < lengths[:, None]).astype(np.int64)


def sample_next(logits: np.ndarray, config: GenerationConfig, rng: np.random.Generator) -> np.ndarray:
    """Pick one token per row from ``logits`` [batch, vocab]."""
    if not config.do_sample:
        return logits.argmax(-1).astype(np.int64)
    scores = logits.astype(np.float64) / max(config.temperature, 1e-6)
    if 0 < config.top_k < scores.shape[-1]:
        kth = np.partition(scores, -config.top_k, axis=-1)[:, -config.top_k][:, None]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    if config.top_p < 1.0:
        order = np.argsort(-probs, axis=-1)
        sorted_probs = np.take_along_axis(probs, order, -1)
        keep_sorted = (np.cumsum(sorted_probs, -1) - sorted_probs) < config.top_p
        keep_sorted[:, 0] = True  # the most likely token always stays
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, -1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(-1, keepdims=True)
    return np.array([rng.choice(probs.shape[-1], p=row) for row in probs], dtype=np.int64)


def generate(
    model: StepModel,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig,
    pad_id: int,
    eos_ids: Sequence[int] = (),
    on_tokens: Callable[[np.ndarray], None] | None = None,
    right_padded: bool = False,
    cache: Any = None,
    past: int = 0,
) -> GenerationResult:
    """Decode up to ``config.max_new_tokens`` tokens for each prompt (one batch, padded on the
    left, or on the right for a GroupQueryAttention graph: see the module docstring). ``cache``
    holding ``past`` positions already (one prompt's prefix, prefilled once for several
    prompts): the prompt is the tokens after them, fed at positions ``past``.."""
    if past and len(prompts) != 1:
        raise ValueError("a prefilled cache (past > 0) holds one prompt's prefix: pass one prompt")
    rng = np.random.default_rng(config.seed)
    ids, mask = (right_pad if right_padded else left_pad)(prompts, pad_id)
    if past:
        mask = np.ones((1, past + ids.shape[1]), dtype=np.int64)
    lengths = mask.sum(-1)
    positions = np.clip(mask.cumsum(-1) - 1, 0, None)[:, -ids.shape[1] :]
    cache = model.empty_cache(len(prompts)) if cache is None else cache
    eos = np.array(list(eos_ids), dtype=np.int64)
    finished = np.zeros(len(prompts), dtype=bool)
    generated: list[list[int]] = [[] for _ in prompts]
    step_seconds: list[float] = []

    start = time.perf_counter()
    last_index = lengths - 1 - past if right_padded else np.full(len(prompts), ids.shape[1] - 1)
    logits, cache = prompt_step(model, ids, mask, positions, cache, logits_at=last_index)
    last = logits[:, 0]
    prefill_seconds = 0.0
    for index in range(config.max_new_tokens):
        next_tokens = sample_next(last, config, rng)
        now = time.perf_counter()
        if index == 0:
            prefill_seconds = now - start
        else:
            step_seconds.append(now - start)
        for row, token in enumerate(next_tokens):
            if not finished[row]:
                generated[row].append(int(token))
        if on_tokens is not None:
            on_tokens(np.where(finished, -1, next_tokens))
        if config.stop_at_eos and eos.size:
            finished |= np.isin(next_tokens, eos)
            if finished.all():
                break
        if index + 1 == config.max_new_tokens:
            break
        start = time.perf_counter()
        next_tokens = np.where(finished, pad_id, next_tokens)
        if right_padded:
            positions, lengths = lengths[:, None].copy(), lengths + 1
            mask = right_padded_mask(lengths)
        else:
            mask = np.concatenate([mask, np.ones((len(prompts), 1), dtype=np.int64)], axis=1)
            positions = positions[:, -1:] + 1
        logits, cache = model.step(next_tokens[:, None], mask, positions, cache)
        last = logits[:, -1]
    return GenerationResult(generated, prefill_seconds, step_seconds)
