"""Build: ONNX graph -> ``ort-cpu`` engine folder (graph stage -> engine).

For ONNX Runtime on CPU the engine is the graph plus how to run it: ``engine.json`` (our
runtime's contract: target, provider, session options, IO shape, special tokens) and a
``genai_config.json`` following the ONNX Runtime GenAI spec (``model.decoder`` inputs/outputs,
``search`` defaults), so onnxruntime-genai and lm-eval's ``onnxruntime-genai`` backend can load
the folder. Graph optimizations run when the session is created on the serving machine:
ORT's offline-optimized models at level "all" are tied to the hardware they were made on.

``ensures``: the folder loads in a real ONNX Runtime session whose inputs and outputs are
exactly the declared names, and a short forward gives finite logits.
"""

from __future__ import annotations

import enum
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.artifacts import Artifact, Kind, read_metadata, write_json, write_metadata
from pipeline.base import Pass
from pipeline.config import register_pass
from pipeline.errors import PassError
from pipeline.runtime.ort import ENGINE_FILE, Engine, graph_ops

GENAI_CONFIG = "genai_config.json"


class OptimizationLevel(enum.StrEnum):
    disable = "disable"
    basic = "basic"
    extended = "extended"
    all = "all"


@dataclass
class OrtCpuTargetConfig:
    """ONNX Runtime CPU engine settings (recorded in engine.json, used by the runtime)."""

    _target_: str = "passes.build.OrtCpuBuildPass"
    name: str = "ort-cpu"
    # ONNX Runtime intra-op threads when serving (0: one per physical core).
    intra_op_num_threads: int = 0
    graph_optimization_level: OptimizationLevel = OptimizationLevel.all
    # Longest prompt + generation the engine accepts (0: the model's context length).
    max_length: int = 0


register_pass("target", "ort_cpu", OrtCpuTargetConfig)


def genai_config(metadata: dict[str, Any], max_length: int, threads: int) -> dict[str, Any]:
    """``genai_config.json`` in the ONNX Runtime GenAI schema for a decoder-only model."""
    io, tokens = metadata["io"], metadata["tokens"]
    eos = tokens["eos_token_ids"]
    session_options: dict[str, Any] = {"log_id": "onnxruntime-genai", "provider_options": []}
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


def metadata_model_file(source: Artifact) -> str:
    return str(source.metadata.get("model_file", "model.onnx"))


class OrtCpuBuildPass(Pass):
    Config = OrtCpuTargetConfig
    name = "build"
    version = 1
    consumes = Kind.GRAPH
    produces = Kind.ENGINE

    def requires(self, source: Artifact) -> None:
        if "io" not in source.metadata or "tokens" not in source.metadata:
            raise PassError(f"build: {source.path} records no IO spec in artifact.json; re-run export")
        kv = source.metadata.get("kv_cache", {})
        wanted = [
            option
            for option, asked in (
                ("kv_cache=shared", kv.get("layout") == "shared"),
                (f"kv_cache.window={kv.get('window')}", bool(kv.get("window"))),
                (f"kv_cache.dtype={kv.get('dtype')}", kv.get("dtype", "fp32") != "fp32"),
            )
            if asked
        ]
        if wanted and "GroupQueryAttention" not in graph_ops(source.path / metadata_model_file(source)):
            raise PassError(
                f"build: {', '.join(wanted)} needs the attention fused to GroupQueryAttention (it updates "
                "the buffer in place, bounds the window and stores fp16/int8 caches); add fusion=ort"
            )

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        metadata = read_metadata(source.path)
        for item in source.path.iterdir():
            if item.is_file() and item.name != "artifact.json":
                shutil.copy2(item, out_dir / item.name)
        model_max = int(metadata.get("max_length", 2048))
        max_length = min(self.config.max_length, model_max) if self.config.max_length else model_max
        threads = self.config.intra_op_num_threads
        write_json(out_dir / GENAI_CONFIG, genai_config(metadata, max_length, threads))
        kv = metadata.get("kv_cache", {})
        write_json(
            out_dir / ENGINE_FILE,
            {
                "schema_version": 1,
                "target": self.config.name,
                "providers": ["CPUExecutionProvider"],
                "model_file": metadata["model_file"],
                "io": {
                    **metadata["io"],
                    "kv_layout": kv.get("layout", "concat"),
                    "window": kv.get("window", 0),
                    # a window-sized shared buffer (0, the default: max_length positions)
                    "kv_capacity": kv.get("capacity", 0),
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
        return {"max_length": max_length}

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        engine = Engine(result.path)
        session = engine.model.session
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
        return {"session_check": "ok"}
