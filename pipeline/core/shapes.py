"""The shapes of a checkpoint, read from its ``config.json``: what the memory estimates
(:mod:`pipeline.core.memory`) and a pass's own :meth:`~pipeline.core.base.Pass.estimate_memory`
compute with. Its own module so that the pass contract and the estimates can both name it
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.families import head_dim
from pipeline.core.files import loads_bounded

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}


@dataclass(frozen=True)
class ModelShapes:
    """What the estimates need from a Llama checkpoint's ``config.json``."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool
    source_dtype: str = "float32"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShapes:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32").removeprefix("torch.")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim(config),
            vocab_size=int(config["vocab_size"]),
            tied=bool(config.get("tie_word_embeddings", False)),
            source_dtype=dtype if dtype in DTYPE_BYTES else "float32",
        )

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tied else self.vocab_size * self.hidden_size

    @property
    def block_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = h * self.num_heads * self.head_dim * 2 + h * kv * 2  # q, o; k, v
        return attention + 3 * h * self.intermediate_size + 2 * h  # gate, up, down; two norms

    @property
    def parameters(self) -> int:
        return (
            self.embedding_params
            + self.lm_head_params
            + self.num_layers * self.block_params
            + self.hidden_size
        )

    @property
    def graph_bytes(self) -> int:
        """The exported fp32 graph's weights: the export unties a tied lm_head (one more copy)."""
        return (self.parameters + (self.vocab_size * self.hidden_size if self.tied else 0)) * 4

    def kv_bytes(self, tokens: int, batch: int = 1, bytes_per_value: int = 4) -> int:
        """The KV cache of ``tokens`` positions for ``batch`` sequences."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * tokens * batch * bytes_per_value

    def forward_bytes(self, windows: int, seq_len: int, logits: bool = True) -> int:
        """Transient fp32 activations of one forward over ``windows`` x ``seq_len`` tokens: one
        block's intermediates (hidden states, q/k/v, MLP, attention scores) and the logits
        (not computed by a pass that streams the decoder blocks)."""
        tokens = windows * seq_len
        block = tokens * (4 * self.hidden_size + 3 * self.intermediate_size)
        scores = windows * self.num_heads * seq_len * seq_len
        return 4 * (block + scores + (tokens * self.vocab_size if logits else 0))


def model_shapes(folder: Path) -> ModelShapes | None:
    """The shapes of the checkpoint in ``folder``; None without a readable Llama ``config.json``
    (a source the estimate cannot size: the preflight then only logs that it skipped)."""
    try:
        config = loads_bounded((folder / "config.json").read_text())
        return ModelShapes.from_config(config)
    except (OSError, ValueError, KeyError, TypeError):
        return None
