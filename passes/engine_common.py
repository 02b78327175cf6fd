"""What both engine builds (``passes/ort_build.py`` for ONNX Runtime, ``passes/tensorrt_build.py``
for TensorRT) check and size the same way: the engine's max length, the KV-cache options a graph
records and which runtime implements them, the TensorRT compatibility lint, and the optimization
profiles TensorRT builds for (its own builder and ONNX Runtime's TensorRT execution provider).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from passes.fusion.kv_cache_dtype import CACHE_TYPES as GQA_CACHE_TYPES
from pipeline.core.artifacts import Artifact
from pipeline.core.errors import PassError
from pipeline.core.lint import lint
from pipeline.core.planned_model import PlannedModel

GQA_RULE = "group_query_attention"  # the fusion rule family that writes GroupQueryAttention


def engine_max_length(metadata: dict[str, Any], configured: int) -> int:
    """The engine's max_length: the configured one (0: none) capped by the model's context."""
    model_max = int(metadata.get("max_length", 2048))
    return min(configured, model_max) if configured else model_max


def window_buffers(kv_cache: dict[str, Any], layers: int, max_length: int) -> list[int]:
    """Each layer's shared-buffer positions an engine of ``max_length`` keeps (``io.kv_capacity``):
    the kv_cache pass's window buffer where shorter than ``max_length`` (it evicts in place), else
    0 (the whole ``max_length``, never full); [] where no layer's buffer is shorter. A record
    written before buffers were per layer holds one int for every layer."""
    capacity = kv_cache.get("capacity") or []
    sizes = [capacity] * layers if isinstance(capacity, int) else list(capacity)
    kept = [size if 0 < size < max_length else 0 for size in sizes]
    return kept if any(kept) else []


FP8_CACHE_UNFUSED = (
    "build: kv_cache.dtype=fp8 is stored by the fusion pass, which did not run on this graph: "
    "add fusion=ort (or fusion=tensorrt)"
)


def check_fp8_cache_applied(source: Artifact) -> None:
    """Refuse a graph whose kv_cache pass asked for an fp8 cache that no fusion pass stored: the
    fusion pass writes its Q/DQ (``passes/fusion/kv_cache_dtype.py``), with either rule set."""
    if source.metadata.get("kv_cache", {}).get("dtype") == "fp8" and (
        source.metadata["io"].get("kv_dtype") != "float8_e4m3fn"
    ):
        raise PassError(FP8_CACHE_UNFUSED)


def check_planned_cache(facts: PlannedModel, gqa: bool) -> None:
    """Before any pass runs: refuse the recipe's KV-cache options that no pass before the build
    will implement. ``gqa``: whether the target runs ONNX Runtime's GroupQueryAttention."""
    kv, fusion = facts.kv_cache, facts.fusion
    if kv.get("dtype") == "fp8" and fusion is None:
        raise PassError(FP8_CACHE_UNFUSED)
    wanted = gqa_cache_options(kv)
    if wanted and gqa and GQA_RULE not in (fusion or ()):
        raise PassError(needs_gqa(wanted))


def needs_gqa(wanted: list[str]) -> str:
    """Why a graph without GroupQueryAttention cannot give the ``wanted`` cache options."""
    return (
        f"build: {', '.join(wanted)} needs the attention fused to GroupQueryAttention (it updates "
        "the buffer in place, bounds the window and stores fp16/int8 caches); add fusion=ort"
    )


def metadata_model_file(source: Artifact) -> str:
    return str(source.metadata.get("model_file", "model.onnx"))


def gqa_cache_options(kv: dict[str, Any]) -> list[str]:
    """The recorded ``kv_cache`` options that only ONNX Runtime's GroupQueryAttention implements
    (in-place buffer, window bound, fp16/int8 storage), spelled as the user sets them."""
    return [
        option
        for option, asked in (
            ("kv_cache=shared", kv.get("layout") == "shared"),
            (f"kv_cache.window={kv.get('window')}", bool(kv.get("window"))),
            (f"kv_cache.dtype={kv.get('dtype')}", kv.get("dtype") in GQA_CACHE_TYPES),
        )
        if asked
    ]


def lint_or_refuse(model_file: Path, target: str, escape: str = "") -> None:
    """Raise a :class:`PassError` naming the first TensorRT-lint error and how many there are."""
    errors = [finding for finding in lint(model_file) if finding.severity == "error"]
    if errors:
        first = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        hint = f", or {escape}" if escape else ""
        raise PassError(
            f"build: {model_file.name} is not TensorRT-compatible for target={target}: {first.rule} at "
            f"node {first.node} ({first.op}): {first.message}{more}; see python -m pipeline.lint "
            f"{model_file}{hint}"
        )


def profile_shapes(
    io: dict[str, Any],
    max_batch: int,
    max_input_length: int,
    max_length: int,
    decode_tokens: int | None = None,
) -> dict[str, dict[str, tuple[list[int], list[int], list[int]]]]:
    """Optimization profiles: name -> input -> (min, opt, max) shape.

    Without ``decode_tokens`` one profile (``all``) covers every shape; with it, ``prefill``
    takes 1..``max_input_length`` new tokens and ``decode`` 1..``decode_tokens`` (opt 1, with
    a half-full cache). Every profile takes 0..``max_length - 1`` cached positions.
    """
    if not 1 <= max_input_length <= max_length:
        raise PassError(
            f"build: max_input_length={max_input_length} must be between 1 and max_length={max_length}"
        )
    if max_batch < 1:
        raise PassError(f"build: max_batch={max_batch} must be at least 1")
    heads, dim = int(io["num_kv_heads"]), int(io["head_dim"])
    batch = (1, 1, max_batch)

    def profile(new: tuple[int, int, int], past: tuple[int, int, int]) -> dict[str, Any]:
        total = tuple(min(n + p, max_length) for n, p in zip(new, past, strict=True))
        shapes = {
            "input_ids": [[b, n] for b, n in zip(batch, new, strict=True)],
            "attention_mask": [[b, t] for b, t in zip(batch, total, strict=True)],
        }
        if io.get("has_position_ids", True):
            shapes["position_ids"] = shapes["input_ids"]
        for layer in range(int(io["num_layers"])):
            for kind in ("key", "value"):
                shapes[f"past_key_values.{layer}.{kind}"] = [
                    [b, heads, p, dim] for b, p in zip(batch, past, strict=True)
                ]
        return {name: tuple(dims) for name, dims in shapes.items()}

    longest_past = max_length - 1
    if decode_tokens is None:
        return {"all": profile((1, min(512, max_input_length), max_input_length), (0, 0, longest_past))}
    if not 1 <= decode_tokens <= max_input_length:
        raise PassError(
            f"build: decode_tokens={decode_tokens} must be between 1 and max_input_length={max_input_length}"
        )
    return {
        "prefill": profile((1, min(512, max_input_length), max_input_length), (0, 0, longest_past)),
        "decode": profile((1, 1, decode_tokens), (0, max_length // 2, longest_past)),
    }
