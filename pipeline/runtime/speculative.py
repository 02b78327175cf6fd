"""Speculative decoding with a draft model, greedy acceptance: Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding" (section 2.3 with argmax for sampling),
and Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling".

Each round the draft proposes ``k`` tokens one by one; the target scores the last accepted token
plus the ``k`` proposals in one forward of ``k + 1`` positions. The longest prefix of proposals
that equal the target's own argmax is accepted, followed by the target's token at the first
mismatch (or its next token when all ``k`` were accepted), so every emitted token is the
target's greedy choice given the tokens before it: the output is token for token the target's
greedy decode. Both KV caches are then cut back to the accepted tokens
(:meth:`StepModel.truncate_cache`).

Timings follow :mod:`pipeline.runtime.generate`: ``prefill_seconds`` is the prefill of both
models (the target's gives the first token; the draft reads the prompt right after, so TTFT
grows by the draft's prefill), and each round's wall time is spread evenly over the tokens the
round emitted, so the mean of ``step_seconds`` is the effective time per output token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from pipeline.runtime.generate import GenerationResult, StepModel, prompt_step


class CacheModel(StepModel, Protocol):
    """A step model whose cache can be cut back to its first ``length`` positions."""

    def truncate_cache(self, cache: Any, length: int) -> Any: ...


@dataclass
class DraftStats:
    """How the draft did: tokens proposed, accepted by the target, verification rounds."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens emitted per target forward after the prefill (accepted + the target's own)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "rounds": self.rounds,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_round": round(self.tokens_per_round, 3),
        }


class _Stepper:
    """One model's cache and the length of the sequence it holds."""

    def __init__(self, model: CacheModel) -> None:
        self.model = model
        self.cache = model.empty_cache(1)
        self.length = 0

    def feed(self, tokens: Sequence[int], prompt: bool = False) -> np.ndarray:
        """Append ``tokens``; return their logits [len(tokens), vocab]. ``prompt``: they are the
        prompt (``prompt_step``, the last token's logits only); verified draft tokens take the
        decode path, whose result is the target's own token for token."""
        ids = np.asarray([tokens], dtype=np.int64)
        end = self.length + len(tokens)
        mask = np.ones((1, end), dtype=np.int64)
        positions = np.arange(self.length, end, dtype=np.int64)[None, :]
        if prompt:  # the prompt's last logits only: the first new token
            last = np.array([len(tokens) - 1])
            logits, self.cache = prompt_step(self.model, ids, mask, positions, self.cache, last)
        else:
            logits, self.cache = self.model.step(ids, mask, positions, self.cache)
        self.length = end
        return logits[0]

    def truncate(self, length: int) -> None:
        if length < self.length:
            self.cache = self.model.truncate_cache(self.cache, length)
            self.length = length


def speculative_generate(
    target: CacheModel,
    draft: CacheModel,
    prompt: Sequence[int],
    k: int,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    stop_at_eos: bool = True,
    on_token: Callable[[int], None] | None = None,
) -> tuple[GenerationResult, DraftStats]:
    """Greedy-decode ``prompt`` (one sequence) with the target, ``k`` draft tokens per round."""
    if k < 1:
        raise ValueError(f"speculative k must be at least 1, got {k}")
    if not prompt:
        raise ValueError("every prompt needs at least one token")
    eos = set(eos_ids) if stop_at_eos else set()
    stats = DraftStats()
    verifier, proposer = _Stepper(target), _Stepper(draft)
    sequence = list(prompt)
    emitted: list[int] = []
    step_seconds: list[float] = []

    def emit(tokens: list[int]) -> bool:
        """Record tokens up to the budget or an end of sequence; True when decoding is over."""
        for token in tokens:
            emitted.append(token)
            sequence.append(token)
            if on_token is not None:
                on_token(token)
            if token in eos or len(emitted) == max_new_tokens:
                return True
        return False

    start = time.perf_counter()
    first = int(verifier.feed(sequence, prompt=True)[-1].argmax())
    done = emit([first]) or max_new_tokens <= 1
    if not done:  # the draft reads the prompt too: part of the prefill, not of any decode step
        proposer.feed(sequence[:-1], prompt=True)
    prefill_seconds = time.perf_counter() - start
    # The target's cache holds every token but the last emitted one, which the next round feeds.
    while not done:
        start = time.perf_counter()
        budget = min(k, max_new_tokens - len(emitted) - 1)
        proposal: list[int] = []
        if budget > 0:
            pending = sequence[proposer.length :]
            for _ in range(budget):
                proposal.append(int(proposer.feed(pending)[-1].argmax()))
                pending = proposal[-1:]
        before = len(sequence)
        choices = verifier.feed([sequence[-1], *proposal]).argmax(-1)
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == choices[accepted]:
            accepted += 1
        stats.rounds += 1
        stats.proposed += len(proposal)
        stats.accepted += accepted
        new = [*proposal[:accepted], int(choices[accepted])]
        count_before = len(emitted)
        done = emit(new)
        seconds = time.perf_counter() - start
        made = len(emitted) - count_before
        step_seconds.extend([seconds / made] * made)
        # Keep only the tokens both models saw that are now part of the sequence.
        verifier.truncate(before + accepted)
        proposer.truncate(before + accepted)
    return GenerationResult([emitted], prefill_seconds, step_seconds), stats
