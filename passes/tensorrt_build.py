"""Build: ONNX graph (explicit Q/DQ) -> TensorRT engine (``target=tensorrt``).

TensorRT 11 builds only strongly typed networks: every tensor's precision comes from the graph
(its types and its QuantizeLinear/DequantizeLinear pairs), there are no FP16/INT8/FP8 builder
flags and no INT8 calibrator (TensorRT Developer Guide, "Strongly Typed Networks" and "Working
with Quantized Types"; TensorRT 11.0 release notes). So this pass adds no precision of its own:
it parses the graph our quantization passes wrote with TensorRT's ONNX parser and builds it.

Steps (TensorRT Python API, ``tensorrt`` 11.4, checked against the wheel's bindings):

- ``requires``: the CPU lint (:mod:`pipeline.core.lint`: ops the parser imports, Q/DQ rules, no ONNX
  Runtime contrib ops) passes; ``preflight``: TensorRT >= 11 imports and a CUDA GPU is visible,
  checked before any pass of the recipe runs.
- ``Builder.create_network(0)`` (always strongly typed), ``OnnxParser.parse_from_file``; a parse
  failure names each refused node (``ParserError.node_name/node_operator/desc``).
- Two optimization profiles over the KV-cache graph's dynamic axes (:func:`profile_shapes`):
  ``prefill`` (1..``max_input_length`` new tokens) and ``decode`` (1..``decode_tokens`` new tokens:
  one per step, ``k + 1`` when speculative decoding verifies), each with a cache of
  0..``max_length - 1`` positions and batch 1..``max_batch``.
- ``builder_optimization_level``, workspace pool limit and hardware compatibility from config; a
  timing cache file per TensorRT version and GPU, loaded before and merged after each build so
  later builds skip kernel timing.
- ``build_serialized_network`` -> ``model.plan``; ``engine.json`` records the target, IO, the
  profiles and what the engine is tied to (TensorRT version, GPU name and compute capability,
  CUDA), which the runtime checks before deserializing (:mod:`pipeline.runtime.tensorrt`).
- ``ensures``: the engine deserializes and a short forward gives finite logits.

Not run here: these machines have no GPU and no TensorRT, so the build and ``ensures`` have only
run where ``tests/passes/test_tensorrt_build.py``'s GPU tests run; on CPU, the lint, profiles,
configuration and the no-GPU refusal are tested.
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from passes.engine_common import (
    check_fp8_cache_applied,
    check_planned_cache,
    engine_max_length,
    gqa_cache_options,
    lint_or_refuse,
    metadata_model_file,
    profile_shapes,
)
from pipeline.core.artifacts import Artifact, Kind, read_metadata, write_json, write_metadata
from pipeline.core.base import Pass
from pipeline.core.config import register_pass
from pipeline.core.engine import ENGINE_FILE
from pipeline.core.errors import PassError
from pipeline.core.gpu import require_tensorrt, tensorrt_module
from pipeline.core.graph_io import link_folder_files
from pipeline.core.lint import table_disagreements
from pipeline.core.planned_model import PlannedModel
from pipeline.core.staging import check_lock_path

log = logging.getLogger(__name__)

PLAN_FILE = "model.plan"
# Files of the graph folder the engine keeps (the tokenizer and the model's own config); the
# ONNX graph itself is not needed to run the plan and is identified by its digest.
KEPT_SUFFIXES = (".json", ".jinja", ".txt", ".model")


class HardwareCompatibility(enum.StrEnum):
    """``IBuilderConfig.hardware_compatibility_level``: ``none`` ties the plan to the GPU model it
    was built on; ``same_compute_capability`` to any GPU of that compute capability (Turing and
    later); ``ampere_plus`` to any Ampere or later GPU (slower kernels)."""

    none = "none"
    same_compute_capability = "same_compute_capability"
    ampere_plus = "ampere_plus"


@dataclass
class TensorRtTargetConfig:
    """TensorRT engine settings (``target=tensorrt``)."""

    _target_: str = "passes.tensorrt_build.TensorRtBuildPass"
    name: str = "tensorrt"
    # Optimization profiles: batch 1..max_batch; prefill 1..max_input_length new tokens; decode
    # 1..decode_tokens new tokens (speculative decoding verifies k + 1); caches up to max_length
    # positions in all (0: the model's context length).
    max_batch: int = 1
    max_input_length: int = 2048
    decode_tokens: int = 8
    max_length: int = 0
    # IBuilderConfig.builder_optimization_level (0-5; TensorRT's default 3).
    builder_optimization_level: int = 3
    # The builder's workspace memory pool limit.
    workspace_gib: float = 8.0
    hardware_compatibility: HardwareCompatibility = HardwareCompatibility.none
    # Timing cache folder (one file per TensorRT version and GPU); "" keeps none. It saves build
    # time, not engine content, so it is not part of the pass's cache key.
    timing_cache_dir: str = "~/.cache/llm-pipeline/tensorrt"


register_pass("target", "tensorrt", TensorRtTargetConfig)


def timing_cache_file(folder: str, trt_version: str, gpu: dict[str, Any]) -> Path | None:
    """The timing cache of this TensorRT version on this GPU (None: keep no timing cache)."""
    if not folder:
        return None
    slug = "".join(c if c.isalnum() else "-" for c in str(gpu["name"])).strip("-").lower()
    return Path(folder).expanduser() / f"timing-trt{trt_version}-sm{gpu['compute_capability']}-{slug}.cache"


def parser_errors(parser: Any) -> list[str]:
    """One line per error of a failed ``OnnxParser.parse*``: node, operator, description."""
    lines = []
    for index in range(parser.num_errors):
        error = parser.get_error(index)
        lines.append(f"node '{error.node_name()}' ({error.node_operator()}): {error.desc()}")
    return lines


class TensorRtBuildPass(Pass):
    Config = TensorRtTargetConfig
    name = "tensorrt_build"
    version = 2  # 2: the tokenizer and config files hard-linked, not copied
    consumes = Kind.GRAPH
    produces = Kind.ENGINE

    def preflight(self) -> None:
        require_tensorrt()

    def config_dict(self) -> dict[str, Any]:
        """The config plus what the plan is tied to (TensorRT version, GPU): a plan built on
        another GPU or TensorRT is another output, so they key the cache. The timing cache
        folder shapes build time only and is left out."""
        data = super().config_dict()
        data.pop("timing_cache_dir", None)
        version, gpu = require_tensorrt()
        data["built_for"] = {
            "tensorrt": version,
            "gpu": gpu.name,
            "compute_capability": gpu.compute_capability,
        }
        return data

    def check_model(self, facts: PlannedModel) -> PlannedModel:
        check_planned_cache(facts, gqa=False)
        kv = facts.kv_cache
        if gqa_cache_options(kv):
            raise PassError(
                "build: kv_cache layout/window/dtype other than concat fp32 or fp8 relies on ONNX Runtime's "
                "GroupQueryAttention; for target=tensorrt use kv_cache=none or kv_cache=concat"
            )
        # An fp8 cache is explicit Q/DQ at the cache inputs and outputs, which a strongly typed
        # network takes as FP8 I/O tensors (written against TensorRT's API, not run here).
        if kv.get("dtype") == "fp8" and kv.get("fp8_scale", "head") != "tensor":
            raise PassError(
                "build: kv_cache.fp8_scale=head puts a per-head scale on the cache, an activation; "
                "TensorRT quantizes activations per tensor (python -m pipeline.lint flags it): "
                "set kv_cache.fp8_scale=tensor"
            )
        return facts

    def requires(self, source: Artifact) -> None:
        metadata = source.metadata
        if "io" not in metadata or "tokens" not in metadata:
            raise PassError(f"build: {source.path} records no IO spec in artifact.json; re-export it")
        check_fp8_cache_applied(source)
        lint_or_refuse(source.path / metadata_model_file(source), self.config.name)

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        trt = tensorrt_module()
        version, gpu = require_tensorrt()
        metadata = read_metadata(source.path)
        max_length = engine_max_length(metadata, self.config.max_length)
        profiles = profile_shapes(
            metadata["io"],
            self.config.max_batch,
            min(self.config.max_input_length, max_length),
            max_length,
            self.config.decode_tokens,
        )
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        network = builder.create_network(0)  # TensorRT 11: always strongly typed
        parser = trt.OnnxParser(network, logger)
        model_file = source.path / metadata_model_file(source)
        if not parser.parse_from_file(str(model_file)):
            errors = parser_errors(parser)
            raise PassError(
                f"build: TensorRT's ONNX parser refused {model_file.name}: {'; '.join(errors[:3])}"
                + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else "")
            )
        # The lint's support table (onnx-tensorrt's for 10.15) against this parser's own answer.
        lint_table_disagreements = table_disagreements(parser.supports_operator)
        if any(lint_table_disagreements.values()):
            log.warning(
                "build: pipeline/core/data/onnx_tensorrt_ops.json disagrees with TensorRT %s's parser: %s",
                version,
                lint_table_disagreements,
            )
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(self.config.workspace_gib * 2**30))
        config.builder_optimization_level = self.config.builder_optimization_level
        config.hardware_compatibility_level = getattr(
            trt.HardwareCompatibilityLevel,
            HardwareCompatibility(self.config.hardware_compatibility).name.upper(),
        )
        for profile_name, shapes in profiles.items():
            profile = builder.create_optimization_profile()
            for tensor, (low, opt, high) in shapes.items():
                profile.set_shape(tensor, low, opt, high)
            if config.add_optimization_profile(profile) < 0:
                raise PassError(f"build: TensorRT refused the {profile_name} optimization profile")
        cache_file = timing_cache_file(self.config.timing_cache_dir, version, gpu.to_dict())
        timing_hit = bool(cache_file and cache_file.is_file())
        timing = config.create_timing_cache(cache_file.read_bytes() if timing_hit else b"")  # type: ignore[union-attr]
        if not config.set_timing_cache(timing, False):  # written by another device or TensorRT
            log.warning("build: timing cache %s is from another GPU/TensorRT; starting anew", cache_file)
            timing_hit = False
            config.set_timing_cache(config.create_timing_cache(b""), False)
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise PassError("build: TensorRT could not build the engine; its log above says why")
        plan_bytes = bytes(plan)
        (out_dir / PLAN_FILE).write_bytes(plan_bytes)
        timing_saved = save_timing_cache(cache_file, config) if cache_file is not None else "off"
        # The tokenizer and config files, hard-linked (the plan replaces the graph and its data).
        others = [i.name for i in source.path.iterdir() if not (i.is_file() and i.suffix in KEPT_SUFFIXES)]
        link_folder_files(source.path, out_dir, skip=others)
        tensorrt_record = {
            "version": version,
            "compute_capability": gpu.compute_capability,  # what the registry's pull checks
            "gpu": gpu.to_dict(),
            "hardware_compatibility": str(self.config.hardware_compatibility),
            "builder_optimization_level": self.config.builder_optimization_level,
            "workspace_gib": self.config.workspace_gib,
            "profiles": {name: {t: list(s) for t, s in shapes.items()} for name, shapes in profiles.items()},
            "graph_digest": source.digest,
            "timing_cache_hit": timing_hit,
            "timing_cache_saved": timing_saved,
            "lint_table_disagreements": lint_table_disagreements,
        }
        kv = metadata.get("kv_cache", {})
        write_json(
            out_dir / ENGINE_FILE,
            {
                "schema_version": 1,
                "target": self.config.name,
                "model_file": PLAN_FILE,
                "io": {**metadata["io"], "kv_layout": "concat", "window": 0, "kv_capacity": []},
                "kv_cache": kv,
                "tokens": metadata["tokens"],
                "max_length": max_length,
                "tensorrt": tensorrt_record,
            },
        )
        write_metadata(
            out_dir,
            Kind.ENGINE,
            {**metadata, "target": self.config.name, "max_length": max_length, "tensorrt": tensorrt_record},
        )
        return {
            "max_length": max_length,
            "plan_mib": round(len(plan_bytes) / 2**20, 1),
            "timing_cache_hit": timing_hit,
        }

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        from pipeline.runtime import Engine

        model = Engine(result.path).model
        logits, _ = model.step(
            np.array([[1, 2, 3]]), np.ones((1, 3), np.int64), np.arange(3)[None], model.empty_cache(1)
        )
        if not np.isfinite(logits).all():
            raise PassError("build: the TensorRT engine produced non-finite logits on a 3-token prompt")
        return {"engine_check": "ok"}


def save_timing_cache(path: Path, config: Any) -> str:
    """Merge this build's timing cache into the file (``ITimingCache.combine``), atomically and
    under a lock, so concurrent builds on one machine add to it rather than overwrite it.

    Returns what happened: ``created``, ``merged``, or ``replaced`` when TensorRT refused the
    merge (``combine`` returns False: the file was written by another TensorRT or device, or is
    damaged). Then this build's timings replace the file's, with a warning, rather than being
    dropped while the unusable file is written back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    check_lock_path(Path(str(path) + ".lock"))  # FileLock would follow a planted symlink
    with FileLock(str(path) + ".lock"):
        cache = config.get_timing_cache()
        outcome = "created"
        if path.is_file():
            merged = config.create_timing_cache(path.read_bytes())
            if merged.combine(cache, False):
                cache, outcome = merged, "merged"
            else:
                outcome = "replaced"
                log.warning(
                    "build: TensorRT refused to merge this build's timings into %s (another TensorRT "
                    "or device wrote it, or it is damaged); replacing it with this build's",
                    path,
                )
        staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            staging.write_bytes(bytes(cache.serialize()))
            os.replace(staging, path)
        finally:
            staging.unlink(missing_ok=True)
    return outcome
