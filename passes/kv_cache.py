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
  the build refuses it. With ``layout=shared`` it bounds memory too: the buffer holds
  ``capacity`` = window + window // 4 positions (recorded), and GroupQueryAttention evicts the
  oldest rows in place once it is full (its ``sliding_window_cache`` mode), so memory stays
  constant past the window. With ``layout=concat`` the cache still keeps every token.
- ``paged_block_size``: the block size a paged runtime (TensorRT's) allocates the cache in;
  recorded for that runtime, unused by ONNX Runtime on CPU.
- ``dtype``: what the cache stores: ``fp32``; ``fp16`` (half the memory); ``int8`` (a quarter)
  with one scale per KV head and channel; ``fp8`` (E4M3, a quarter) with one scale per KV
  head (``fp8_scale=head``) or per tensor (``fp8_scale=tensor``, for TensorRT, which quantizes
  activations per tensor). int8 and fp8 are calibrated here: the graph runs on ``calibration``
  windows and the largest ``|K|`` and ``|V|`` of every layer, head and channel (``amax``) is
  kept in ``kv_cache_amax.npz``; ``passes/fusion/kv_cache_dtype.py`` turns them into
  GroupQueryAttention's scales (fp16/int8, so they need ``fusion=ort``) or into Q/DQ at the
  graph's cache inputs and outputs (fp8: any fusion rule set, ``ort`` or ``tensorrt``; a concat
  cache only, since a shared buffer has no place between past and present for a Q/DQ pair).

The pass changes no node: it records the layout in the graph's metadata, which the fusion pass,
the build (``engine.json`` ``io.kv_layout``, ``genai_config.json``
``past_present_share_buffer``) and the runtime follow. The folder's files are hard-linked, not
copied (``pipeline/core/graph_io.py``: its loader accepts external data with several links).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from calibration.datasets import (
    CalibrationConfig,
    calibration_feeds,
    check_context,
    check_windows,
    recorded,
    token_windows,
)
from calibration.workload import CalibratesOnWindows
from pipeline.core.artifacts import ARTIFACT_FILE, Artifact, Kind, read_metadata, write_metadata
from pipeline.core.base import Pass, Workload
from pipeline.core.config import MAX_TOKENS, _is_int, register_pass
from pipeline.core.errors import PassError
from pipeline.core.families import layer_windows
from pipeline.core.files import read_json
from pipeline.core.graph_io import check_data_files, link_graph_folder
from pipeline.core.planned_model import PlannedModel


class Layout(enum.StrEnum):
    concat = "concat"
    shared = "shared"


class KvDtype(enum.StrEnum):
    fp32 = "fp32"
    fp16 = "fp16"
    int8 = "int8"
    fp8 = "fp8"  # E4M3 via Q/DQ at the cache IO (GroupQueryAttention's fp8 has no CPU kernel)


class Fp8Scale(enum.StrEnum):
    """How many scales an fp8 cache tensor has: one per KV head, or one for the tensor (the
    form TensorRT takes: it quantizes activations per tensor)."""

    head = "head"
    tensor = "tensor"


MAX_PAGED_BLOCK = 4096  # tokens a page: TensorRT-LLM's blocks are 16-128

# Where the int8 calibration keeps its per-layer, per-head, per-channel amax (graph folder).
AMAX_FILE = "kv_cache_amax.npz"


def _kv_calibration() -> CalibrationConfig:
    # 16 windows of 256 tokens: a channel's max over 4k tokens of text; the KV amax settles
    # long before the activation histograms of the fp8/int8 recipes need their 64 windows.
    return CalibrationConfig(num_samples=16)


@dataclass
class KvCacheConfig:
    """KV-cache layout recorded for fusion, build and runtime (``configs/kv_cache/``)."""

    _target_: str = "passes.kv_cache.KvCachePass"
    layout: Layout = Layout.concat
    dtype: KvDtype = KvDtype.fp32
    # fp8 only: one scale per KV head (head) or per layer's K or V (tensor; for target=tensorrt).
    fp8_scale: Fp8Scale = Fp8Scale.head
    # Sliding-window attention: tokens attend to at most this many positions (0: unbounded).
    window: int = 0
    # Block size (tokens) for a paged cache; recorded for the TensorRT runtime.
    paged_block_size: int = 0
    # Text the int8/fp8 scales are calibrated on (unused for fp32/fp16).
    calibration: CalibrationConfig = field(default_factory=_kv_calibration)

    def validate(self) -> None:
        if not _is_int(self.window) or self.window < 0 or self.window == 1 or self.window > MAX_TOKENS:
            raise PassError(
                f"kv_cache.window={self.window}: use 0 (unbounded) or from 2 to {MAX_TOKENS} positions "
                "(at most the model's context)"
            )
        if not _is_int(self.paged_block_size) or not 0 <= self.paged_block_size <= MAX_PAGED_BLOCK:
            raise PassError(
                f"kv_cache.paged_block_size={self.paged_block_size}: must be from 0 to {MAX_PAGED_BLOCK} "
                "tokens"
            )
        if self.dtype in (KvDtype.int8, KvDtype.fp8):
            check_windows(self.calibration, "kv_cache.calibration")
        if self.dtype == KvDtype.fp8 and self.layout == Layout.shared:
            raise PassError(
                "kv_cache.dtype=fp8 needs layout=concat: the fp8 cache is Q/DQ between past and present, "
                "which a shared buffer updated in place has no room for (GroupQueryAttention's own fp8 "
                "cache has no CPU kernel); use kv_cache=concat, or kv_cache.dtype=int8 with layout=shared"
            )


register_pass("kv_cache", "kv_cache", KvCacheConfig)

KINDS = ("key", "value")
ALREADY_FUSED = (
    "{name}: the graph is already fused; the KV-cache layout is chosen before fusion "
    "(pipeline.order: kv_cache before fusion)"
)  # present.<layer>.key, present.<layer>.value: the graph's output order


class KvCachePass(CalibratesOnWindows, Pass):
    Config = KvCacheConfig
    name = "kv_cache"
    knob_group = "kv_cache"
    version = 5  # 3: the input's files hard-linked, not copied; 4: a buffer per layer; 5: own windows
    memory_profile = "graph"  # files linked; int8/fp8 calibrate in an ONNX Runtime session
    consumes = Kind.GRAPH
    produces = Kind.GRAPH

    def workload(self) -> Workload | None:
        """Only the int8 and fp8 caches calibrate (their amax)."""
        if KvDtype(self.config.dtype) not in (KvDtype.int8, KvDtype.fp8):
            return None
        return super().workload()

    def drift_family(self) -> str:
        """A cache stored in fewer bits moves the attention it feeds: bits16 / bits8."""
        dtype = KvDtype(self.config.dtype)
        return {KvDtype.fp16: "bits16", KvDtype.int8: "bits8", KvDtype.fp8: "bits8"}.get(dtype, "fp32")

    def layout(self, config: dict[str, Any]) -> dict[str, Any]:
        """The ``kv_cache`` entry of the output's metadata, but for the calibrated scales.
        ``window``: ``kv_cache.window``, narrowed to the widest layer's window where every layer
        has one of its own (Mistral's ``sliding_window``), which the graph keeps either way.
        ``capacity``: with a shared layout, each windowed layer's buffer of its window (the
        model's own, as Gemma 3's local layers, or ``kv_cache.window``, whichever is shorter);
        0: a layer that attends to every position keeps the engine's max_length. The engine
        build drops the buffers at least as long as its max_length, which never evict."""
        window = self.config.window
        windows = layer_windows(config, window)
        if window:
            window = max(windows)
        layout: dict[str, Any] = {
            "layout": Layout(self.config.layout).value,
            "dtype": KvDtype(self.config.dtype).value,
            "window": window,
            "paged_block_size": self.config.paged_block_size,
        }
        if self.config.layout == Layout.shared and any(windows):
            layout["capacity"] = [window_capacity(size) if size else 0 for size in windows]
        if self.config.dtype == KvDtype.fp8:
            layout["fp8_scale"] = Fp8Scale(self.config.fp8_scale).value
        return layout

    def check_model(self, facts: PlannedModel) -> PlannedModel:
        if facts.fusion is not None:
            raise PassError(ALREADY_FUSED.format(name=self.name))
        context = facts.config.get("max_position_embeddings")
        if _is_int(context) and context > 0:
            for name in ("window", "paged_block_size"):
                value = getattr(self.config, name)
                if value > context:
                    raise PassError(
                        f"kv_cache.{name}={value}: more positions than the model's context of {context} "
                        f"tokens (max_position_embeddings); set kv_cache.{name} to at most {context}"
                        + (" or 0 (unbounded)" if name == "window" else "")
                    )
        if self.config.dtype in (KvDtype.int8, KvDtype.fp8):
            check_context(self.config.calibration, facts, "kv_cache.calibration")
        return facts.replace(kv_cache=self.layout(dict(facts.config)))

    def requires(self, source: Artifact) -> None:
        if "io" not in source.metadata:
            raise PassError(f"{self.name}: {source.path} records no IO spec; re-export it")
        if source.metadata.get("fusion"):
            raise PassError(ALREADY_FUSED.format(name=self.name))

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        link_graph_folder(source.path, out_dir, skip=(ARTIFACT_FILE, AMAX_FILE))
        layout = self.layout(read_json(source.path / "config.json", what="a config.json"))
        result: dict[str, Any] = {}
        if self.config.dtype in (KvDtype.int8, KvDtype.fp8):
            amax, tokens = calibrate_amax(source.path, self.config.calibration)
            np.savez(out_dir / AMAX_FILE, **amax)
            layout["amax_file"] = AMAX_FILE
            layout["calibration"] = {**recorded(self.config.calibration), "tokens": tokens}
            # The manifest keeps each layer's largest amax per head (the graph keeps every channel).
            result["amax_per_head"] = {
                kind: np.round(array.max(axis=-1), 4).tolist() for kind, array in amax.items()
            }
        metadata = read_metadata(source.path)
        metadata["kv_cache"] = layout
        write_metadata(out_dir, Kind.GRAPH, metadata)
        return {"kv_cache": layout, **result}

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        check_data_files(result.path, self.name)
        return {}


def window_capacity(window: int) -> int:
    """Positions of a windowed shared buffer: the window and a quarter more, so GroupQueryAttention
    compacts the buffer once every ``window // 4 + 1`` steps instead of at every step (ORT's
    ``sliding_window_cache``: rows evicted ``capacity - window + 1`` at a time)."""
    return window + window // 4


def calibrate_amax(folder: Path, calibration: CalibrationConfig) -> tuple[dict[str, np.ndarray], int]:
    """``{"key", "value"}: [layers, kv_heads, head_dim]`` largest ``|x|`` of the graph's
    ``present.*`` outputs over prefills of the calibration windows, and the tokens seen."""
    from tqdm import tqdm

    from pipeline.core.engine import graph_io
    from pipeline.core.torch_model import load_tokenizer
    from pipeline.runtime.ort import OrtModel

    io = graph_io(folder)
    if io.kv_dtype != "float32":
        raise PassError(f"kv_cache: {folder} already stores a {io.kv_dtype} cache; calibrate on fp32")
    windows = token_windows(load_tokenizer(folder), calibration, knob="kv_cache.calibration")
    model = OrtModel(folder / read_metadata(folder).get("model_file", "model.onnx"), io)
    amax = {kind: np.zeros((io.num_layers, io.num_kv_heads, io.head_dim), np.float32) for kind in KINDS}
    for feed in tqdm(calibration_feeds(windows, io), total=len(windows), desc="kv_cache: calibrate"):
        ids = feed["input_ids"]
        positions = np.arange(ids.shape[1], dtype=np.int64)[None]
        _, present = model.step(ids, feed["attention_mask"], positions, model.empty_cache(1))
        for index, value in enumerate(present):
            layer, kind = divmod(index, 2)
            np.maximum(
                amax[KINDS[kind]][layer], np.abs(value.numpy()).max(axis=(0, 2)), out=amax[KINDS[kind]][layer]
            )
    if not all(np.isfinite(a).all() for a in amax.values()):
        raise PassError("kv_cache: the calibration produced non-finite keys or values")
    return amax, int(windows.size)
