"""KV-cache layout (graph stage): how the engine keeps keys and values between decode steps.

- ``layout=concat``: past and present are separate tensors; each step's present is the past
  with the new tokens appended (the export's own graph, any attention).
- ``layout=shared``: one buffer per layer of ``max_length`` positions, preallocated and bound
  once as both past input and present output (IOBinding); ONNX Runtime's GroupQueryAttention
  writes the new tokens into it in place (``past_present_share_buffer``, its documented shared
  mode: ``docs/ContribOperators.md``). Needs the attention fused to GroupQueryAttention
  (``fusion=ort``); the build pass checks that the graph has it.
- ``window=N``: sliding-window attention (Beltagy et al. 2020, "Longformer"; Mistral's
  ``sliding_window``): each token attends to itself and the N-1 tokens before it. The fusion
  pass gives GroupQueryAttention ``local_window_size``; an unfused graph cannot honour it and
  the build refuses it. It bounds attention, not memory (yet): the cache still keeps every token
  (concat) or ``max_length`` positions (shared).
- ``paged_block_size``: the block size a paged runtime (TensorRT's) allocates the cache in;
  recorded for that runtime, unused by ONNX Runtime on CPU.

The pass changes no node: it records the layout in the graph's metadata, which the fusion pass,
the build (``engine.json`` ``io.kv_layout``, ``genai_config.json``
``past_present_share_buffer``) and the runtime follow. (The folder is copied, not hard-linked:
onnx-ir refuses external data with several links.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from passes.fp8 import copy_graph_folder
from pipeline.artifacts import ARTIFACT_FILE, Artifact, Kind, read_metadata, write_metadata
from pipeline.base import Pass
from pipeline.config import register_pass
from pipeline.errors import PassError


class Layout(enum.StrEnum):
    concat = "concat"
    shared = "shared"


class KvDtype(enum.StrEnum):
    # int8/fp8 caches with calibrated per-head scales are not built yet (issue 5).
    fp32 = "fp32"


@dataclass
class KvCacheConfig:
    """KV-cache layout recorded for fusion, build and runtime (``configs/kv_cache/``)."""

    _target_: str = "passes.kv_cache.KvCachePass"
    layout: Layout = Layout.concat
    dtype: KvDtype = KvDtype.fp32
    # Sliding-window attention: tokens attend to at most this many positions (0: unbounded).
    window: int = 0
    # Block size (tokens) for a paged cache; recorded for the TensorRT runtime.
    paged_block_size: int = 0


register_pass("kv_cache", "kv_cache", KvCacheConfig)


class KvCachePass(Pass):
    Config = KvCacheConfig
    name = "kv_cache"
    version = 1
    consumes = Kind.GRAPH
    produces = Kind.GRAPH

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        if self.config.window < 0 or self.config.window == 1:
            raise PassError(
                f"kv_cache.window={self.config.window}: use 0 (unbounded) or at least 2 positions"
            )
        if self.config.paged_block_size < 0:
            raise PassError(f"kv_cache.paged_block_size={self.config.paged_block_size} must be >= 0")

    def requires(self, source: Artifact) -> None:
        if "io" not in source.metadata:
            raise PassError(f"{self.name}: {source.path} records no IO spec; re-export it")
        if source.metadata.get("fusion"):
            raise PassError(
                f"{self.name}: the graph is already fused; the KV-cache layout is chosen before fusion "
                "(pipeline.order: kv_cache before fusion)"
            )

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        copy_graph_folder(source.path, out_dir, skip=(ARTIFACT_FILE,))
        layout = {
            "layout": Layout(self.config.layout).value,
            "dtype": KvDtype(self.config.dtype).value,
            "window": self.config.window,
            "paged_block_size": self.config.paged_block_size,
        }
        metadata = read_metadata(source.path)
        metadata["kv_cache"] = layout
        write_metadata(out_dir, Kind.GRAPH, metadata)
        return {"kv_cache": layout}
