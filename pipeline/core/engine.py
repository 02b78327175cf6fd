"""The ``engine.json`` contract: what the export records about a decoder's inputs and outputs
(:class:`IOSpec`, in ``artifact.json``) and the file an engine folder is known by. The export
writes it, the builders (ONNX Runtime and TensorRT) copy it into the engine, and the runtime reads
it; so it lives in the kernel, below all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.artifacts import read_metadata
from pipeline.core.errors import EngineError

ENGINE_FILE = "engine.json"
KV_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8, "float8_e4m3fn": np.uint8}
# Cache types numpy has no dtype for: held on the host as their raw 8-bit codes (uint8) and
# handed to ONNX Runtime with the ONNX element type (onnx.TensorProto.FLOAT8E4M3FN = 17).
KV_ONNX_ELEMENT_TYPES = {"float8_e4m3fn": 17}
# The extra input of an int8-KV engine's prefill graph (``prefill_model_file``,
# passes/fusion/int8_prefill.py): [batch, k] indices into the step's tokens whose logits it computes.
LOGITS_POSITIONS = "logits_positions"


@dataclass(frozen=True)
class IOSpec:
    """Names and shapes of the decoder's inputs and outputs (ONNX Runtime GenAI convention)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    kv_dtype: str = "float32"
    has_position_ids: bool = True
    # False once attention is fused into a kernel that masks causally from sequence lengths only
    # (GroupQueryAttention): such a graph takes right padding, not left-padded batches.
    left_padding: bool = True
    # "concat": present = past + new tokens, a new tensor each step. "shared": one buffer per
    # layer of the engine's max_length, bound as past and present (updated in place).
    kv_layout: str = "concat"
    # Sliding-window attention bound (0: none); the graph enforces it, recorded for consumers.
    window: int = 0
    # Positions of a shared buffer that keeps only the window (0: the engine's max_length);
    # GroupQueryAttention evicts the oldest rows in place, so any length fits.
    kv_capacity: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IOSpec:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def past_names(self) -> list[str]:
        return [f"past_key_values.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]

    def present_names(self) -> list[str]:
        return [f"present.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]

    def kv_itemsize(self) -> int:
        """Bytes one cached key or value element takes."""
        return np.dtype(KV_NUMPY_DTYPES[self.kv_dtype]).itemsize


def graph_io(folder: Path) -> IOSpec:
    """The IO spec recorded in a graph or engine artifact folder."""
    metadata = read_metadata(folder)
    if "io" not in metadata:
        raise EngineError(f"{folder} records no IO spec (artifact.json): re-export it")
    return IOSpec.from_dict(metadata["io"])
