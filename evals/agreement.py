"""Token-level agreement of a candidate engine with the reference engine on held-out text:
perplexity of each, mean KL(reference || candidate) of the next-token distributions, and top-1
agreement (the fraction of positions where both pick the same greedy token).

Both engines run through the real runtime (``pipeline.runtime``), window by window, on the
same tokens: the shipped held-out text (``evals/data/``) cut into consecutive windows. Each
window is fed ``chunk`` tokens a step, so all but its first chunk are scored through the KV
cache the engine stored (a prefill alone never reads the cache, and would hide an fp8 or int8
cache's rounding).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from evals.config import QualityConfig
from pipeline.core.errors import EngineError
from pipeline.runtime import Engine
from pipeline.runtime.generate import prompt_step

DATA_DIR = Path(__file__).resolve().parent / "data"
TEXTS = {"gpl-3.0": "gpl-3.0.txt"}


def held_out_windows(engine: Engine, config: QualityConfig) -> np.ndarray:
    """``[n, window]`` token ids: the first ``max_tokens`` tokens of the text, in windows."""
    if config.text not in TEXTS:
        raise EngineError(
            f"quality.text={config.text!r} is unknown: choose one of {', '.join(sorted(TEXTS))}"
        )
    text = (DATA_DIR / TEXTS[config.text]).read_text()
    ids = np.asarray(engine.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    window = min(config.window, engine.max_length)
    count = min(len(ids), config.max_tokens) // window
    if count == 0:
        raise EngineError(f"quality.window={window} is longer than the {len(ids)}-token held-out text")
    return ids[: count * window].reshape(count, window)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _logits(engine: Engine, window: np.ndarray, chunk: int) -> np.ndarray:
    """The window's logits, fed ``chunk`` tokens a step through the engine's KV cache; a one-line
    error if one is NaN or infinite (a broken engine's score is never recorded, nor cached)."""
    model = engine.model
    cache = model.empty_cache(1)
    step = chunk or len(window)
    pieces = []
    for start in range(0, len(window), step):
        ids = window[None, start : start + step]
        end = start + ids.shape[1]
        logits, cache = prompt_step(
            model, ids, np.ones((1, end), np.int64), np.arange(start, end)[None], cache
        )
        if not np.isfinite(logits).all():
            raise EngineError(
                f"quality: the engine {engine.folder} gives non-finite logits at positions {start}-{end - 1} "
                "of a held-out window: it is broken (a diverged or overflowing pass); rebuild it"
            )
        pieces.append(logits[0])
    return np.concatenate(pieces)


def compare(candidate: Engine, reference: Engine | None, config: QualityConfig) -> dict[str, Any]:
    """Score ``candidate`` (and ``reference``, unless None: the candidate is the reference)."""
    windows = held_out_windows(candidate, config)
    nll_candidate: list[float] = []
    nll_reference: list[float] = []
    kl: list[float] = []
    agree: list[float] = []
    for window in tqdm(windows, desc="quality", unit="window"):
        targets = window[1:]
        cand = _log_softmax(_logits(candidate, window, config.chunk))[:-1]
        nll_candidate.append(float(-cand[np.arange(len(targets)), targets].sum()))
        if reference is None:
            continue
        ref = _log_softmax(_logits(reference, window, config.chunk))[:-1]
        nll_reference.append(float(-ref[np.arange(len(targets)), targets].sum()))
        kl.append(float((np.exp(ref) * (ref - cand)).sum(-1).sum()))
        agree.append(float((ref.argmax(-1) == cand.argmax(-1)).sum()))
    scored = windows.shape[0] * (windows.shape[1] - 1)
    # Finite logits give finite sums; a perplexity beyond float64 still overflows np.exp (to inf).
    result: dict[str, Any] = {
        "text": config.text,
        "tokens_scored": scored,
        "windows": int(windows.shape[0]),
        "window": int(windows.shape[1]),
        "chunk": config.chunk,
        "perplexity": round(float(np.exp(sum(nll_candidate) / scored)), 4),
    }
    if reference is None:
        result.update(
            reference_perplexity=result["perplexity"], kl_mean=0.0, top1_agreement=1.0, same_engine=True
        )
    else:
        result.update(
            reference_perplexity=round(float(np.exp(sum(nll_reference) / scored)), 4),
            kl_mean=round(sum(kl) / scored, 6),
            top1_agreement=round(sum(agree) / scored, 6),
            same_engine=False,
        )
    return result
