"""Build: ONNX graph -> ONNX Runtime engine folder (graph stage -> engine), for ``target=ort-cpu``
(the default), ``ort-cuda`` (CUDA execution provider) and ``ort-trt`` (TensorRT execution
provider, CUDA for what TensorRT does not take). ``target=tensorrt`` (a serialized TensorRT
engine) is ``passes/tensorrt_build.py``.

For ONNX Runtime the engine is the graph plus how to run it: ``engine.json`` (our
runtime's contract: target, providers and their options, session options, IO shape, special tokens) and a
``genai_config.json`` following the ONNX Runtime GenAI spec (``model.decoder`` inputs/outputs,
``search`` defaults), so onnxruntime-genai and lm-eval's ``onnxruntime-genai`` backend can load
the folder. Graph optimizations run when the session is created on the serving machine:
ORT's offline-optimized models at level "all" are tied to the hardware they were made on.

The engine folder holds the graph's files as hard links (``pipeline.core.graph_io.link_graph_folder``;
copies only across file systems): a build adds the two JSON files to disk, not the weights. An
``ort-cpu`` engine with an int8 KV cache also gets its prefill graph, ``model.prefill.onnx``
(``passes/fusion/int8_prefill.py``: prompt tokens attend on the fp32 path over the values the
int8 cache holds; the same weights file), named in ``engine.json`` as ``prefill_model_file``.

``ensures``: no unreferenced external-data file; the folder loads in a real ONNX Runtime session
whose inputs and outputs are exactly the declared names, and a short forward gives finite logits
(through the prefill graph too, which must agree with the engine's top-1 token).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from passes.engine_common import (
    check_fp8_cache_applied,
    check_planned_cache,
    engine_max_length,
    gqa_cache_options,
    lint_or_refuse,
    metadata_model_file,
    needs_gqa,
    profile_shapes,
    window_buffers,
)
from passes.fusion.int8_prefill import PREFILL_MODEL_FILE, prefill_model
from pipeline.core.artifacts import ARTIFACT_FILE, Artifact, Kind, read_metadata, write_json, write_metadata
from pipeline.core.base import Pass
from pipeline.core.config import register_pass
from pipeline.core.engine import ENGINE_FILE, LOGITS_POSITIONS
from pipeline.core.errors import PassError
from pipeline.core.gpu import require_ort_provider
from pipeline.core.graph_io import check_data_files, graph_ops, link_graph_folder
from pipeline.core.planned_model import PlannedModel
from pipeline.runtime.ort import Engine

GENAI_CONFIG = "genai_config.json"


class OptimizationLevel(enum.StrEnum):
    disable = "disable"
    basic = "basic"
    extended = "extended"
    all = "all"


@dataclass
class OrtCpuTargetConfig:
    """ONNX Runtime CPU engine settings (recorded in engine.json, used by the runtime)."""

    _target_: str = "passes.ort_build.OrtCpuBuildPass"
    name: str = "ort-cpu"
    # ONNX Runtime intra-op threads when serving (0: one per physical core).
    intra_op_num_threads: int = 0
    graph_optimization_level: OptimizationLevel = OptimizationLevel.all
    # Longest prompt + generation the engine accepts (0: the model's context length).
    max_length: int = 0

    def validate(self) -> None:
        for knob in ("intra_op_num_threads", "max_length"):
            if getattr(self, knob) < 0:
                raise PassError(f"target.{knob}={getattr(self, knob)}: must be 0 (the default) or more")


@dataclass
class OrtCudaTargetConfig(OrtCpuTargetConfig):
    """ONNX Runtime on an NVIDIA GPU through the CUDA execution provider (onnxruntime-gpu)."""

    _target_: str = "passes.ort_build.OrtCudaBuildPass"
    name: str = "ort-cuda"
    device_id: int = 0


@dataclass
class OrtTrtTargetConfig(OrtCudaTargetConfig):
    """ONNX Runtime's TensorRT execution provider: TensorRT builds engines for the subgraphs it
    takes when the session is created, on the serving machine, and keeps them (and its timing
    cache) in the runtime's cache folder (``PIPELINE_ORT_TRT_CACHE``, default
    ``~/.cache/llm-pipeline/ort-trt``); CUDA runs the rest. Options as in ONNX Runtime's
    TensorRT EP documentation (``trt_*``)."""

    _target_: str = "passes.ort_build.OrtTrtBuildPass"
    name: str = "ort-trt"
    builder_optimization_level: int = 3
    workspace_gib: float = 8.0
    # One optimization profile: batch 1..max_batch, 1..max_input_length new tokens, and a
    # cache of up to max_length positions.
    max_batch: int = 1
    max_input_length: int = 2048
    # The graph must lint clean for TensorRT (python -m pipeline.lint); false accepts a graph
    # whose unsupported nodes ONNX Runtime then runs on CUDA instead.
    lint: bool = True


register_pass("target", "ort_cpu", OrtCpuTargetConfig)
register_pass("target", "ort_cuda", OrtCudaTargetConfig)
register_pass("target", "ort_trt", OrtTrtTargetConfig)


def genai_config(
    metadata: dict[str, Any],
    max_length: int,
    threads: int,
    genai_providers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``genai_config.json`` in the ONNX Runtime GenAI schema for a decoder-only model
    (``genai_providers``: its ``provider_options``, e.g. ``[{"cuda": {}}]``; none: CPU)."""
    io, tokens = metadata["io"], metadata["tokens"]
    eos = tokens["eos_token_ids"]
    session_options: dict[str, Any] = {
        "log_id": "onnxruntime-genai",
        "provider_options": genai_providers or [],
    }
    if threads:
        session_options["intra_op_num_threads"] = threads
    return {
        "model": {
            "bos_token_id": tokens.get("bos_token_id"),
            "context_length": max_length,
            "decoder": {
                "session_options": session_options,
                "filename": metadata["model_file"],
                "head_size": io["head_dim"],
                "hidden_size": metadata["hidden_size"],
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    **({"position_ids": "position_ids"} if io.get("has_position_ids", True) else {}),
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": metadata["num_attention_heads"],
                "num_hidden_layers": io["num_layers"],
                "num_key_value_heads": io["num_kv_heads"],
            },
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": tokens["pad_token_id"],
            "type": metadata.get("model_type", "llama"),
            "vocab_size": io["vocab_size"],
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": max_length,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": metadata.get("kv_cache", {}).get("layout") == "shared",
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


class OrtCpuBuildPass(Pass):
    Config = OrtCpuTargetConfig
    name = "ort_build"
    version = 3  # 3: an int8-KV ort-cpu engine gets its prefill graph; 2: graph files hard-linked
    memory_profile = "graph"  # files linked; ensures opens one ONNX Runtime session
    consumes = Kind.GRAPH
    produces = Kind.ENGINE

    def check_model(self, facts: PlannedModel) -> PlannedModel:
        check_planned_cache(facts, gqa=True)
        return facts

    def requires(self, source: Artifact) -> None:
        if "io" not in source.metadata or "tokens" not in source.metadata:
            raise PassError(f"build: {source.path} records no IO spec in artifact.json; re-run export")
        # The graph itself: a fusion that found no attention pattern writes no GroupQueryAttention.
        wanted = gqa_cache_options(source.metadata.get("kv_cache", {}))
        if wanted and "GroupQueryAttention" not in graph_ops(source.path / metadata_model_file(source)):
            raise PassError(needs_gqa(wanted))
        check_fp8_cache_applied(source)

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        metadata = read_metadata(source.path)
        # The graph's files (model, external data, tokenizer) hard-linked, never copied; not its
        # folders (extras/: what the passes before needed).
        folders = tuple(item.name for item in source.path.iterdir() if item.is_dir())
        linked = link_graph_folder(source.path, out_dir, skip=(ARTIFACT_FILE, *folders))
        max_length = engine_max_length(metadata, self.config.max_length)
        threads = self.config.intra_op_num_threads
        write_json(
            out_dir / GENAI_CONFIG, genai_config(metadata, max_length, threads, self.genai_providers())
        )
        kv = metadata.get("kv_cache", {})
        buffers = window_buffers(kv, metadata["io"]["num_layers"], max_length)
        prefill = {}
        if self.writes_prefill_graph(kv, buffers):
            prefill = {"prefill_model_file": PREFILL_MODEL_FILE}
            write_prefill_graph(out_dir / metadata["model_file"], out_dir / PREFILL_MODEL_FILE)
        write_json(
            out_dir / ENGINE_FILE,
            {
                "schema_version": 1,
                "target": self.config.name,
                "providers": self.providers(),
                # GPU targets only: an ort-cpu engine.json stays as it was (same digest, same cache)
                **(
                    {"provider_options": options}
                    if any(options := self.provider_options(metadata, max_length))
                    else {}
                ),
                "model_file": metadata["model_file"],
                **prefill,
                "io": {
                    **metadata["io"],
                    "kv_layout": kv.get("layout", "concat"),
                    "window": kv.get("window", 0),
                    # each layer's window-sized shared buffer (0, or none: max_length positions)
                    "kv_capacity": buffers,
                },
                "kv_cache": kv,
                "tokens": metadata["tokens"],
                "max_length": max_length,
                "session": {
                    "intra_op_num_threads": threads,
                    "graph_optimization_level": OptimizationLevel(self.config.graph_optimization_level).value,
                },
            },
        )
        write_metadata(
            out_dir, Kind.ENGINE, {**metadata, "target": self.config.name, "max_length": max_length}
        )
        return {"max_length": max_length, "disk": linked.as_dict()}

    def providers(self) -> list[str]:
        return ["CPUExecutionProvider"]

    def writes_prefill_graph(self, kv: dict[str, Any], buffers: list[int]) -> bool:
        """An int8 cache on ONNX Runtime's CPU kernel, which prefills slowly (int8_prefill.py);
        not with window ``buffers`` (:func:`window_buffers`), which the kernel evicts in place.
        CUDA has its own int8 kernels."""
        return self.providers()[0] == "CPUExecutionProvider" and kv.get("dtype") == "int8" and not buffers

    def genai_providers(self) -> list[dict[str, Any]]:
        """ONNX Runtime GenAI's ``provider_options`` for this target (empty: CPU)."""
        return []

    def provider_options(self, metadata: dict[str, Any], max_length: int) -> list[dict[str, Any]]:
        return [{}]

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        check_data_files(result.path, self.name)
        # A check, not a server: the weights stay memory-mapped (no MLAS prepacking, which would
        # copy them), so a 3B fp32 engine is not held twice.
        engine = Engine(result.path, prepack=False)
        session = engine.model.session
        active = session.get_providers()
        if active[0] != self.providers()[0]:  # ONNX Runtime falls back quietly when an EP fails
            raise PassError(
                f"build: ONNX Runtime did not register {self.providers()[0]} (the session runs on "
                f"{', '.join(active)}); its log says why (missing CUDA/TensorRT libraries, driver)"
            )
        positions = {"position_ids"} if engine.io.has_position_ids else set()
        expected_in = {"input_ids", "attention_mask", *positions, *engine.io.past_names()}
        expected_out = {"logits", *engine.io.present_names()}
        actual_in = {i.name for i in session.get_inputs()}
        actual_out = {o.name for o in session.get_outputs()}
        if actual_in != expected_in or actual_out != expected_out:
            raise PassError(
                f"build: engine IO {sorted(actual_in ^ expected_in) + sorted(actual_out ^ expected_out)} "
                "does not match the GenAI names"
            )
        logits, _ = engine.model.step(
            np.array([[1, 2, 3]]), np.ones((1, 3), np.int64), np.arange(3)[None], engine.model.empty_cache(1)
        )
        if not np.isfinite(logits).all():
            raise PassError("build: the engine produced non-finite logits on a 3-token prompt")
        if engine.model.prefill_session is None:
            return {"session_check": "ok"}
        return {"session_check": "ok", "prefill_graph": check_prefill_graph(engine, logits)}


def write_prefill_graph(model_path: Path, out: Path) -> int:
    """Write the prefill graph of the int8-KV graph ``model_path`` to ``out`` (same folder: it
    reads the same external-data file); returns the attention nodes rewritten."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    rewritten = prefill_model(model)
    onnx.save(model, str(out))
    return rewritten


def check_prefill_graph(engine: Engine, logits: np.ndarray) -> dict[str, Any]:
    """The prefill graph on the same 3-token prompt: the engine's IO names (and
    ``logits_positions``), finite logits, the engine's top-1 token at every position, and the
    last position alone equal to it among all; returns the largest logit difference."""

    def io_names(session: Any) -> set[str]:
        return {value.name for value in (*session.get_inputs(), *session.get_outputs())}

    names = io_names(engine.model.prefill_session)
    expected = io_names(engine.model.session) | {LOGITS_POSITIONS}
    if names != expected:
        raise PassError(
            f"build: the prefill graph's IO differs from the engine's: {sorted(names ^ expected)}"
        )
    prompt, mask, positions = np.array([[1, 2, 3]]), np.ones((1, 3), np.int64), np.arange(3)[None]
    prefilled, _ = engine.model.prompt_step(prompt, mask, positions, engine.model.empty_cache(1))
    last, _ = engine.model.prompt_step(
        prompt, mask, positions, engine.model.empty_cache(1), logits_at=np.array([2])
    )
    if (
        not np.isfinite(prefilled).all()
        or (prefilled.argmax(-1) != logits.argmax(-1)).any()
        or np.abs(last[:, 0] - prefilled[:, -1]).max() > 1e-4 * np.ptp(prefilled)
    ):
        raise PassError(
            "build: the int8-KV prefill graph disagrees with the engine on a 3-token prompt "
            f"(max |logit diff| {np.abs(prefilled - logits).max():.3g}); see passes/fusion/int8_prefill.py"
        )
    return {"max_abs_diff": float(np.abs(prefilled - logits).max())}


class OrtCudaBuildPass(OrtCpuBuildPass):
    """``target=ort-cuda``: the ONNX Runtime engine folder for the CUDA execution provider."""

    Config = OrtCudaTargetConfig

    def preflight(self) -> None:
        require_ort_provider("CUDAExecutionProvider")

    def providers(self) -> list[str]:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    def genai_providers(self) -> list[dict[str, Any]]:
        return [{"cuda": {"device_id": str(self.config.device_id)}}]

    def provider_options(self, metadata: dict[str, Any], max_length: int) -> list[dict[str, Any]]:
        return [{"device_id": self.config.device_id}, {}]


class OrtTrtBuildPass(OrtCudaBuildPass):
    """``target=ort-trt``: the engine folder for ONNX Runtime's TensorRT execution provider,
    with the TensorRT-compatibility lint (``pipeline.core.lint``) as its precondition."""

    Config = OrtTrtTargetConfig

    def preflight(self) -> None:
        require_ort_provider("TensorrtExecutionProvider")

    def requires(self, source: Artifact) -> None:
        super().requires(source)
        if self.config.lint:
            lint_or_refuse(source.path / metadata_model_file(source), "ort-trt", "target.lint=false")

    def providers(self) -> list[str]:
        return ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]

    def provider_options(self, metadata: dict[str, Any], max_length: int) -> list[dict[str, Any]]:
        (profile,) = profile_shapes(
            metadata["io"], self.config.max_batch, min(self.config.max_input_length, max_length), max_length
        ).values()
        shapes = [
            ",".join(f"{name}:{'x'.join(map(str, dims[i]))}" for name, dims in profile.items())
            for i in range(3)
        ]
        device = {"device_id": self.config.device_id}
        trt = {
            **device,
            "trt_max_workspace_size": int(self.config.workspace_gib * 2**30),
            "trt_builder_optimization_level": self.config.builder_optimization_level,
            "trt_engine_cache_enable": True,
            "trt_timing_cache_enable": True,
            # resolved by the runtime on the serving machine (pipeline.runtime.ort)
            "trt_engine_cache_path": "{cache}",
            "trt_timing_cache_path": "{cache}",
            "trt_profile_min_shapes": shapes[0],
            "trt_profile_opt_shapes": shapes[1],
            "trt_profile_max_shapes": shapes[2],
        }
        return [trt, device, {}]
