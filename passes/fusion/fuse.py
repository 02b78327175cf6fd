"""Fusion (graph stage): apply a target's rule set to the exported graph, so ONNX Runtime runs
fused kernels (RMSNorm, SkipRMSNorm, RoPE, GroupQueryAttention with packed QKV) instead of their
decompositions.

Algorithm: pattern rewriting over onnx-ir with onnxscript's rewriter (``onnxscript.rewriter.
pattern``): first onnxscript's optimizer (constant folding, shape inference) and common
subexpression elimination, so per-layer shape arithmetic collapses; then each rule family of
``fusion.rules`` in order; at the end dead nodes are removed and each shared
``DequantizeLinear`` gets one copy per consumer again (``qdq.py``: ONNX Runtime's integer and
FP8 kernels need it). The rule families live beside this module (``rms_norm.py``,
``rotary.py``, ``attention.py``, ``packed_qkv.py``, ``packed_gate_up.py``,
``onnx_attention.py``); which ones run is
data: the option of the ``fusion`` config group for the target (``configs/fusion/ort.yaml``:
ONNX Runtime contrib ops; ``tensorrt.yaml``: ONNX standard ops, the graph first converted to
the opset they need, ``RULE_OPSETS``).
When the KV-cache pass chose an fp16 or int8 cache, the attention nodes then store it so
(``kv_cache_dtype.py``). Every family reports how many sites it rewrote (``rewrites`` in the
run record); a family that rewrote nothing on this graph is a warning there. Model facts the
rules cannot read from the graph (head counts, positions) come from the checkpoint's
``config.json`` carried with the graph.

``ensures``: the fused graph against its input graph on a fixed prompt, prefill and greedy decode
steps fed to both (the decode path is where GroupQueryAttention appends the cache): max |logit
difference| and top-1 agreement; the pass fails below ``min_top1_agreement``.

The graph is read and written through ``pipeline/core/graph_io.py``: onnx-ir with the weights memory-
mapped (the rewriter and optimizer work on onnx-ir, so no protobuf copy), only rewritten tensors
(packed QKV / gate-up) in memory, unchanged data files hard-linked. One copy of the weights in
protobuf remains where ``ensures`` judges an approximate graph (``_exact_copy``: both graphs
re-saved without activation rounding, a temporary folder).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from passes.fusion.kv_cache_dtype import (
    CACHE_TYPES,
    IO_DTYPES,
    QDQ_CACHE_TYPES,
    quantize_cache_io,
    restore_fp32_cache,
    set_cache_dtype,
)
from passes.fusion.qdq import duplicate_shared_dequantize
from pipeline.core.artifacts import Artifact, Kind, read_metadata, write_metadata
from pipeline.core.base import Pass
from pipeline.core.config import register_pass
from pipeline.core.errors import PassError
from pipeline.core.families import family_of, head_dim, layer_windows
from pipeline.core.files import read_json
from pipeline.core.graph_io import (
    MODEL_FILE,
    check_data_files,
    link_folder_files,
    load_graph,
    load_proto,
    save_graph,
)
from pipeline.core.planned_model import PlannedModel
from pipeline.core.progress import phases
from pipeline.runtime.parity import PARITY_DECODE_STEPS, PARITY_PROMPT_IDS, compare_graphs

log = logging.getLogger(__name__)
# onnx-ir logs each node it cannot find a schema for (our contrib ops) at INFO with a stack trace;
# onnxscript's optimizer logs every slice it cannot fold.
for _noisy in ("onnx_ir", "onnxscript"):
    logging.getLogger(_noisy).setLevel(logging.WARNING)

# The parity check's prompt and decode steps: pipeline.core.graph_io.PARITY_PROMPT_IDS / PARITY_DECODE_STEPS.
__all__ = ["PARITY_DECODE_STEPS", "PARITY_PROMPT_IDS", "FusionPass", "ModelFacts"]


@dataclass(frozen=True)
class ModelFacts:
    """What the rules need to know about the model that the graph does not state."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    # Sliding-window attention from the KV-cache layout (0: unbounded).
    window: int = 0
    # The cache keeps only the window (shared layout with a window): GQA evicts in place.
    window_cache: bool = False
    # Each layer's window: its family's (Mistral's sliding_window), narrowed to ``window``.
    windows: tuple[int, ...] = ()
    # Per-head q/k norms between the projections and the attention (Qwen3).
    qk_norms: bool = False
    # longrope: the rotary's frequencies switch with the sequence length past this many
    # positions (``original_max_position_embeddings``; Phi-3.5-mini); 0: one table.
    rope_switch: int = 0

    @classmethod
    def from_config(cls, config: dict[str, Any], window: int = 0, window_cache: bool = False) -> ModelFacts:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim(config),
            max_positions=int(config.get("max_position_embeddings", 2048)),
            window=window,
            window_cache=window_cache,
            windows=layer_windows(config, window),
            qk_norms=family_of(config).qk_norms is not None,
            rope_switch=_rope_switch(config),
        )


def _rope_switch(config: dict[str, Any]) -> int:
    """Where longrope switches to its long factors (as transformers reads it), else 0."""
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if not (isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "longrope"):
        return 0
    return int(rope.get("original_max_position_embeddings") or config.get("max_position_embeddings", 2048))


def _rms_norm(model: Any, facts: ModelFacts) -> int:
    from passes.fusion.rms_norm import RMS_NORM_RULES

    return RMS_NORM_RULES.apply_to_model(model)


def _skip_rms_norm(model: Any, facts: ModelFacts) -> int:
    from passes.fusion.rms_norm import skip_rms_norm_rules

    return skip_rms_norm_rules(facts.hidden_size).apply_to_model(model)


def _rotary(model: Any, facts: ModelFacts) -> int:
    from passes.fusion.rotary import RotaryTables, rotary_rules

    tables = RotaryTables(model.graph, facts.max_positions, facts.rope_switch)
    return rotary_rules(tables).apply_to_model(model)


def _attention(model: Any, facts: ModelFacts) -> int:
    from passes.fusion.attention import (
        attention_rules,
        expose_head_norms,
        reroute_cache_outputs,
        set_layer_windows,
    )

    mask = next((v for v in model.graph.inputs if v.name == "attention_mask"), None)
    if mask is None:
        return 0
    expose_head_norms(model.graph)  # Qwen3's q/k norms: outside the kernel, before its rotary
    window = facts.window or -1  # ORT: the token and the window-1 before it (checked in tests)
    rules = attention_rules(mask, facts.num_heads, facts.num_kv_heads, window, facts.window_cache)
    count = rules.apply_to_model(model)
    if count:
        reroute_cache_outputs(model.graph)
        unknown = set_layer_windows(model.graph, facts.windows)
        if unknown and any(size != facts.window for size in facts.windows):  # the rule's own is wrong
            raise PassError(
                f"fusion: cannot tell which layer's window {unknown[0]} takes (its past key is not a "
                "past_key_values.<layer>.key input); the model's layers have sliding windows: rebuild "
                "without fusion"
            )
    return count


def _packed_qkv(model: Any, facts: ModelFacts) -> int:
    import onnx_ir.passes.common as common_passes

    from passes.fusion.packed_qkv import packed_qkv_rules

    common_passes.RemoveUnusedNodesPass()(model)  # the replaced attention still reads the projections
    return packed_qkv_rules(model.graph).apply_to_model(model)


def _packed_gate_up(model: Any, facts: ModelFacts) -> int | None:
    from passes.fusion.packed_gate_up import packed_gate_up_rules

    if not any(node.op_type == "MatMulNBits" for node in model.graph):
        return None  # MatMulNBits only (packed_gate_up.py): an fp32 graph keeps its two matmuls
    return packed_gate_up_rules(model.graph).apply_to_model(model)


def _onnx_rms_norm(model: Any, facts: ModelFacts) -> int:
    from passes.fusion.rms_norm import ONNX_RMS_NORM_RULES

    return ONNX_RMS_NORM_RULES.apply_to_model(model)


def _onnx_rotary(model: Any, facts: ModelFacts) -> int:
    from passes.fusion.rotary import RotaryTables, rotary_rules

    return rotary_rules(RotaryTables(model.graph, facts.max_positions), standard=True).apply_to_model(model)


def _onnx_attention(model: Any, facts: ModelFacts) -> int:
    from passes.fusion.onnx_attention import onnx_attention_rules, reroute_attention_cache

    mask = next((v for v in model.graph.inputs if v.name == "attention_mask"), None)
    if mask is None:
        return 0
    count = onnx_attention_rules(mask, facts.num_heads, facts.num_kv_heads).apply_to_model(model)
    if count:
        reroute_attention_cache(model.graph)
    return count


# Rule families by the name ``fusion.rules`` uses, in the order a target should list them. Each
# returns its rewrites, or None where the graph holds nothing it applies to (no warning then).
RULE_FAMILIES: dict[str, Callable[[Any, ModelFacts], int | None]] = {
    # ONNX Runtime's contrib kernels (target ort-cpu)
    "rms_norm": _rms_norm,
    "skip_rms_norm": _skip_rms_norm,
    "rotary_embedding": _rotary,
    "group_query_attention": _attention,
    "packed_qkv": _packed_qkv,
    "packed_gate_up": _packed_gate_up,
    # ONNX standard ops of opset 23 (targets that parse standard ops only: TensorRT)
    "onnx_rms_norm": _onnx_rms_norm,
    "onnx_rotary_embedding": _onnx_rotary,
    "onnx_attention": _onnx_attention,
}


# Why a rule family cannot run on a model, where a kernel lacks a feature the model has: the
# family is skipped with a warning in the record, and its sites stay as exported (still exact).
def _switched_rope(facts: ModelFacts) -> str | None:
    # Exact unfused (the export switches tables in the graph, pipeline/core/torch_model.py); the
    # contrib rotary reads switched caches (rotary.py), the standard one is not taught them yet.
    if facts.rope_switch:
        return "longrope switches its frequencies with the sequence length; this rule takes one cos/sin table"
    return None


def _rotary_outside(facts: ModelFacts) -> str | None:
    if facts.rope_switch:
        return "longrope's rotary runs before the attention kernel, on q and k apart"
    return None


RULE_LIMITS: dict[str, Callable[[ModelFacts], str | None]] = {
    "onnx_rotary_embedding": _switched_rope,
    "group_query_attention": lambda facts: (
        f"ONNX Runtime's GroupQueryAttention takes heads of a multiple of 16 values, this model's "
        f"have {facts.head_dim}"
        if facts.head_dim % 16
        else None
    ),
    "packed_qkv": lambda facts: (
        "the per-head q/k norms sit between the projections and the attention kernel"
        if facts.qk_norms
        else _rotary_outside(facts)
    ),
    "onnx_attention": lambda facts: (
        "ONNX Attention has no sliding window, which this model's layers have"
        if any(facts.windows)
        else _switched_rope(facts)
    ),
}
# The default-domain opset a family's ops need; the pass converts the graph up to it first.
RULE_OPSETS = {"onnx_rms_norm": 23, "onnx_rotary_embedding": 23, "onnx_attention": 23}
# Ops after which a graph no longer takes left-padded batches (causal masking from lengths only).
RIGHT_PADDING_OPS = frozenset({"GroupQueryAttention"})


@dataclass
class FusionConfig:
    """Which rewrite rules run, for the engine's target (``configs/fusion/*.yaml``)."""

    _target_: str = "passes.fusion.fuse.FusionPass"
    # Rule families, applied in this order (see RULE_FAMILIES).
    rules: list[str] = field(
        default_factory=lambda: [
            "rms_norm",
            "skip_rms_norm",
            "rotary_embedding",
            "group_query_attention",
            "packed_qkv",
        ]
    )
    # The pass fails when fewer greedy tokens than this agree with the unfused graph.
    min_top1_agreement: float = 0.99

    def validate(self) -> None:
        unknown = [rule for rule in self.rules if rule not in RULE_FAMILIES]
        if unknown:
            raise PassError(
                f"fusion.rules: unknown rule family {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(RULE_FAMILIES)}"
            )
        if not self.rules:
            raise PassError("fusion.rules is empty: list rule families, or choose fusion=none")


register_pass("fusion", "fusion", FusionConfig)  # fusion_schema: every target's rule set


class FusionPass(Pass):
    Config = FusionConfig
    name = "fusion"
    version = 5  # 5: longrope fused (switched rotary tables); 4: onnx-ir with lazy weights, linked data files
    memory_profile = "graph"  # weights memory-mapped; only rewritten (packed) ones in memory
    consumes = Kind.GRAPH
    produces = Kind.GRAPH

    def check_model(self, facts: PlannedModel) -> PlannedModel:
        if facts.fusion is not None:
            raise PassError(
                f"{self.name}: the graph is already fused ({list(facts.fusion)}); run one fusion pass"
            )
        return facts.replace(fusion=tuple(self.config.rules))

    def requires(self, source: Artifact) -> None:
        if not (source.path / MODEL_FILE).is_file():
            raise PassError(f"{self.name}: {source.path} holds no {MODEL_FILE}")
        if not (source.path / "config.json").is_file():
            raise PassError(f"{self.name}: {source.path} carries no config.json (model facts): re-export it")
        fused = source.metadata.get("fusion")
        if fused:
            raise PassError(f"{self.name}: the graph is already fused ({fused}); run one fusion pass")

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        import onnx_ir.passes.common as common_passes

        kv = source.metadata.get("kv_cache", {})
        window = int(kv.get("window", 0))
        cache_dtype = kv.get("dtype", "fp32")
        facts = ModelFacts.from_config(
            read_json(source.path / "config.json", what="a config.json"),
            window,
            window_cache=bool(kv.get("capacity")),
        )
        steps = [
            "optimize",
            *self.config.rules,
            *(["kv_cache_dtype"] if cache_dtype != "fp32" else []),
            "save",
        ]
        rewrites: dict[str, int] = {}
        not_applicable: list[str] = []
        with phases("fusion", len(steps)) as phase:
            phase("optimize")
            model = prepare(load_graph(source.path, MODEL_FILE))
            nodes_before = len(model.graph)
            opset = max((RULE_OPSETS.get(rule, 0) for rule in self.config.rules), default=0)
            if opset > model.opset_imports.get("", 0):
                from onnxscript import version_converter

                version_converter.convert_version(model, target_version=opset)
            skipped: list[str] = []
            for rule in self.config.rules:
                phase(rule)
                if limit := RULE_LIMITS.get(rule, lambda _: None)(facts):
                    skipped.append(f"fusion rule '{rule}' skipped: {limit}; its sites stay unfused")
                    continue
                count = RULE_FAMILIES[rule](model, facts)
                if count is None:
                    not_applicable.append(rule)
                else:
                    rewrites[rule] = count
            if cache_dtype != "fp32":
                phase("kv_cache_dtype")
                _store_cache_as(model, cache_dtype, kv, source.path, int(source.metadata["io"]["num_layers"]))
            phase("save")
            common_passes.RemoveUnusedNodesPass()(model)
            common_passes.CommonSubexpressionEliminationPass()(model)
            qdq_copies = duplicate_shared_dequantize(model.graph)  # after the last CSE
            has_positions = drop_unused_input(model.graph, "position_ids")
            ops = {node.op_type for node in model.graph}
            saved = save_graph(model, out_dir, source_dirs=[source.path])
        link_folder_files(source.path, out_dir)
        warnings = skipped + [
            f"fusion rule '{rule}' matched nothing on this graph"
            for rule, count in rewrites.items()
            if not count
        ]
        for warning in warnings:
            log.warning(warning)
        metadata = read_metadata(source.path)
        metadata["io"] = {
            **metadata["io"],
            "has_position_ids": has_positions,
            "left_padding": not (ops & RIGHT_PADDING_OPS),
            "kv_dtype": IO_DTYPES[cache_dtype],
        }
        metadata["fusion"] = rewrites
        write_metadata(out_dir, Kind.GRAPH, metadata)
        return {
            "rewrites": rewrites,
            "not_applicable": not_applicable,
            "warnings": warnings,
            "nodes": {"before": nodes_before, "after": len(model.graph)},
            "qdq_copies": qdq_copies,
            "disk": saved.as_dict(),
        }

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        check_data_files(result.path, self.name)
        metrics: dict[str, Any] = {}
        if _approximate_matmuls(source.path) or result.metadata["io"].get("kv_dtype", "float32") != "float32":
            # A graph that rounds activations (MatMulNBits accuracy_level > 0, activation Q/DQ)
            # turns a last-bit change of an activation into a flipped rounding, and a cache
            # stored in fp16/int8 rounds every key and value: judge the rewrite on copies of
            # both graphs without that rounding (fp32 caches); report as built too.
            metrics["parity_as_built"] = compare_graphs(source.path, result.path)
            with tempfile.TemporaryDirectory(prefix="fusion-exact-") as tmp:
                exact = [
                    _exact_copy(folder, Path(tmp) / name)
                    for folder, name in ((source.path, "a"), (result.path, "b"))
                ]
                # Session level "basic": at "all", ONNX Runtime may turn the dequantized weights'
                # MatMuls into integer kernels that round activations again.
                parity = compare_graphs(*exact, optimization="basic")
        else:
            parity = compare_graphs(source.path, result.path)
        if parity["top1_agreement"] < self.config.min_top1_agreement:
            raise PassError(
                f"{self.name}: the fused graph agrees with the unfused one on {parity['top1_agreement']:.1%} "
                f"of greedy tokens (max |logit diff| {parity['max_abs_diff']:.3g}); a rule is wrong: "
                f"rerun with fewer fusion.rules to find it"
            )
        return {"parity_vs_input_graph": parity, **metrics}


def _store_cache_as(model: Any, dtype: str, kv: dict[str, Any], folder: Path, layers: int) -> None:
    """The cache stored as ``dtype``: fp16/int8 by every layer's GroupQueryAttention
    (``set_cache_dtype``), fp8 by Q/DQ at the graph's cache IO (``quantize_cache_io``, any
    attention), with the kv_cache pass's calibrated amax."""
    if dtype not in CACHE_TYPES and dtype not in QDQ_CACHE_TYPES:
        raise PassError(f"fusion: kv_cache.dtype={dtype} is not a cache type this pass stores")
    amax = None
    if dtype in ("int8", *QDQ_CACHE_TYPES):
        if not (folder / kv.get("amax_file", "-")).is_file():
            raise PassError(
                f"fusion: kv_cache.dtype={dtype} but {folder} holds no calibrated amax: rerun kv_cache"
            )
        with np.load(folder / kv["amax_file"]) as stored:
            amax = {kind: stored[kind] for kind in stored.files}
    if dtype in QDQ_CACHE_TYPES:
        assert amax is not None
        per_head = kv.get("fp8_scale", "head") == "head"
        quantize_cache_io(model.graph, dtype, amax, model.opset_imports.get("", 0), per_head)
        return
    changed = set_cache_dtype(model.graph, dtype, amax)
    if changed != layers:
        raise PassError(
            f"fusion: kv_cache.dtype={dtype} needs every layer's attention fused to GroupQueryAttention "
            f"({changed} of {layers} are): keep group_query_attention in fusion.rules"
        )


def _approximate_matmuls(folder: Path) -> bool:
    """Whether the graph rounds activations: MatMulNBits at accuracy_level > 0 (int8 inputs) or
    Q/DQ pairs on activations (int8, FP8 recipes)."""
    import onnx

    graph = onnx.load(str(folder / MODEL_FILE), load_external_data=False).graph
    constants = {t.name for t in graph.initializer} | {
        o for n in graph.node if n.op_type == "Constant" for o in n.output
    }
    return any(
        (node.op_type == "MatMulNBits" and any(a.name == "accuracy_level" and a.i for a in node.attribute))
        or (node.op_type == "QuantizeLinear" and node.input[0] not in constants)
        for node in graph.node
    )


def _exact_copy(folder: Path, out: Path) -> Path:
    """``folder``'s graph without activation rounding: MatMulNBits at accuracy_level 0, every
    activation ``QuantizeLinear -> DequantizeLinear`` pair bypassed (weights stay quantized) and
    the KV cache in fp32."""
    import onnx_ir as ir

    model = load_proto(folder, MODEL_FILE)
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    bypass: dict[str, str] = {}
    for node in graph.node:
        for attribute in node.attribute:
            if node.op_type == "MatMulNBits" and attribute.name == "accuracy_level":
                attribute.i = 0
        source = producers.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if source is not None and source.op_type == "QuantizeLinear" and source.input[0] in producers:
            bypass[node.output[0]] = source.input[0]  # an activation Q/DQ pair (weights have no producer)
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name in bypass:
                node.input[index] = bypass[name]
    for output in graph.output:
        if output.name in bypass:
            raise PassError(f"fusion: graph output {output.name} is a dequantized activation")
    restore_fp32_cache(model)
    out.mkdir(parents=True)
    save_graph(ir.serde.deserialize_model(model), out)
    metadata = read_metadata(folder)
    write_metadata(out, Kind.GRAPH, {**metadata, "io": {**metadata["io"], "kv_dtype": "float32"}})
    return out


def prepare(model: Any) -> Any:
    """The graph as the rules expect it: contrib-op shapes annotated, shapes inferred, constants
    folded (onnxscript's optimizer) and common subexpressions eliminated."""
    import onnx_ir.passes.common as common_passes
    from onnxscript.optimizer import optimize

    annotate_contrib_shapes(model)
    common_passes.ShapeInferencePass()(model)
    optimize(model)
    common_passes.CommonSubexpressionEliminationPass()(model)
    return model


def annotate_contrib_shapes(model: Any) -> int:
    """Give ``MatMulNBits`` outputs their shape and type, which ONNX shape inference cannot
    infer for a contrib op, so inference carries on through quantized layers and the rules can
    check [batch, seq, hidden] operands. Returns how many outputs it annotated."""
    import onnx_ir as ir

    ids = next((v for v in model.graph.inputs if v.name == "input_ids"), None)
    tokens = list(ids.shape) if ids is not None and ids.shape is not None else None  # [batch, seq]
    annotated = 0
    for node in model.graph:
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
            continue
        x, scales, out = node.inputs[0], node.inputs[2], node.outputs[0]
        n = node.attributes.get_int("N")
        # Before inference reaches it, the input's shape is unknown; every linear layer of the
        # export maps [batch, seq, K] to [batch, seq, N].
        leading = list(x.shape[:-1]) if x.shape is not None else tokens
        if n is None or leading is None or scales is None or scales.dtype is None:
            continue
        out.shape = ir.Shape([*leading, n])
        out.type = ir.TensorType(scales.dtype)
        annotated += 1
    return annotated


def drop_unused_input(graph: Any, name: str) -> bool:
    """Remove graph input ``name`` if nothing reads it any more; return whether it remains."""
    value = next((v for v in graph.inputs if v.name == name), None)
    if value is None:
        return False
    if value.uses():
        return True
    graph.inputs.remove(value)
    return False
