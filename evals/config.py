"""The quality numbers' config (``quality``): perplexity, token KL and top-1 agreement of an engine
against its reference engine on held-out text, as :mod:`evals.agreement` computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.core.config import MAX_TOKENS, _is_int, _show, check_int
from pipeline.core.errors import ConfigError

MAX_QUALITY_TOKENS = 1 << 24  # tokens scored in all: 16M, hours on any engine


@dataclass
class QualityConfig:
    """Quality numbers of every run: perplexity, token KL and top-1 agreement of the engine vs the
    reference engine (same source, no optimization passes) on held-out text (``evals/data/``)."""

    enabled: bool = True
    text: str = "gpl-3.0"
    # Tokens per window (capped by the engine's max_length) and tokens scored in all.
    window: int = 512
    max_tokens: int = 4096
    # Tokens fed per step: a window's first chunk is a prefill and each later chunk attends to
    # the KV cache the earlier ones stored, so a cache kept in fewer bits (kv_cache.dtype) shows
    # in the numbers (0: the whole window in one prefill, which never reads the cache).
    chunk: int = 128

    def validate(self) -> None:
        if not isinstance(self.text, str) or not self.text:
            raise ConfigError(f"quality.text={_show(self.text)}: name a held-out text (evals/data/)")
        check_int("quality.window", self.window, 2, MAX_TOKENS)
        check_int("quality.max_tokens", self.max_tokens, 2, MAX_QUALITY_TOKENS)
        if _is_int(self.chunk) and self.chunk < 0:
            raise ConfigError(
                f"quality.chunk={self.chunk}: use a positive number of tokens, or 0 for one prefill"
            )
        check_int("quality.chunk", self.chunk, 0, MAX_TOKENS)
