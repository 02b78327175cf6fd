"""FP8 E4M3 quantization as explicit Q/DQ in the graph (``quant=fp8``; graph stage).

Format: FP8 E4M3 (``FLOAT8E4M3FN``: 4 exponent bits, 3 mantissa bits, no infinities, largest
magnitude 448), Micikevicius et al. 2022, "FP8 Formats for Deep Learning". Scheme of NVIDIA
ModelOpt's ``FP8_DEFAULT_CFG`` (static per-tensor activations, ``lm_head`` left out) with
per-channel instead of per-tensor weight scales, in the Q/DQ form of TensorRT's strongly typed
FP8 networks:

- weights: per output channel, ``scale = amax / 448`` (``amax`` = max ``|w|`` of the channel by
  default); the ``[in, out]`` weight is stored as a FLOAT8E4M3FN initializer and restored by
  ``DequantizeLinear(w_fp8, scale[out], axis=1)``;
- activations: per tensor, static: ``QuantizeLinear(x, scale, zero_point: FLOAT8E4M3FN) ->
  DequantizeLinear -> MatMul`` on the input of every linear layer, ``scale = amax / 448`` with
  ``amax`` from an observer over calibration text (``calibration/observers.py``);
- everything else (embeddings, norms, attention, the KV cache, excluded layers) stays fp32.

Spec: ONNX QuantizeLinear/DequantizeLinear, opset >= 19 for float8 (round to nearest even,
saturate). TensorRT 11 builds FP8 kernels from this form; ONNX Runtime on CPU runs it as a
simulation (no FP8 kernel: FP8 values, fp32 arithmetic), so the gate judges the GPU's rounding,
up to accumulation order. It is slower than fp32 on CPU: every weight is dequantized per step.

The recipe is two graph -> graph passes, each cached on its own:

1. ``calibrate-activations``: runs the exported graph on ``calibration`` windows and stores, for
   the input of every linear MatMul (excluded ones too), min, max and a histogram of ``|x|`` in
   ``extras/calibration/activations.json`` (metadata ``calibration``). It depends only on the
   graph and ``quant.calibration``/``quant.num_bins``, so changing the observer, percentile or
   exclusions reuses it: every observer is computed from the same histograms. With
   ``quant.calibration.num_processes`` > 1 each rank runs its windows in its own session, its
   histograms started at the bins rank 0's first window set (as the first window sets them in one
   process); min, max, counts and histograms (coarsened to the widest rank's bins, pairs of bins
   merged as the histogram itself merges them) are then reduced: one process's statistics.
2. ``fp8-qdq``: computes the scales and rewrites the graph (metadata ``quantization``).

``quant.activations=false`` skips calibration: FP8 weights only.

Both read and write the graph through ``pipeline/core/graph_io.py`` (onnx-ir, weights memory-mapped;
unchanged files hard-linked; ``ensures`` compares with the input by prefill and decode steps).
"""

from __future__ import annotations

import enum
import json
import logging
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
    shard,
    token_windows,
)
from calibration.observers import DEFAULT_BINS, FP8_E4M3, Observer, TensorStats, channel_amax, compute_amax
from calibration.workload import CalibratesInRanks
from passes.selection import check_patterns, select_modules
from pipeline.core.artifacts import ARTIFACT_FILE, Artifact, Kind, read_metadata, write_metadata
from pipeline.core.base import Pass
from pipeline.core.config import check_int, check_number
from pipeline.core.distributed import Group
from pipeline.core.engine import graph_io
from pipeline.core.errors import CalibrationError, PassError
from pipeline.core.files import read_json
from pipeline.core.graph_io import (
    check_data_files,
    check_model,
    link_folder_files,
    link_graph_folder,
    load_graph,
    new_initializer,
    save_graph,
)
from pipeline.core.planned_model import PlannedModel
from pipeline.runtime.parity import PARITY_PROMPT_TEXT, compare_graphs

log = logging.getLogger(__name__)

MIN_OPSET = 19  # FLOAT8E4M3FN QuantizeLinear/DequantizeLinear
DATA_FILE = "model.onnx.data"
STATS_FILE = "extras/calibration/activations.json"
ZERO_POINT = "fp8_e4m3fn_zero_point"


class WeightObserver(enum.StrEnum):
    minmax = "minmax"
    percentile = "percentile"
    mse = "mse"


def check_opset(source: Artifact, minimum: int = MIN_OPSET, who: str = "quant=fp8") -> None:
    """Raise a one-line PassError when the graph's opset (metadata and model) is below ``minimum``."""
    import onnx

    opsets = [int(source.metadata.get("opset", minimum))]
    model_file = source.path / source.metadata.get("model_file", "model.onnx")
    if model_file.is_file():
        model = onnx.load(str(model_file), load_external_data=False)
        opsets += [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    check_opset_value(min(opsets), minimum, who)


def check_opset_value(opset: int | None, minimum: int = MIN_OPSET, who: str = "quant=fp8") -> None:
    """Raise a one-line PassError when ``opset`` (None: not known yet) is below ``minimum``."""
    if opset is not None and opset < minimum:
        raise PassError(
            f"{who} needs export.opset >= {minimum} (got {opset}): set export.opset={minimum} or higher"
        )


def linear_matmuls(graph: Any, linear_weights: dict[str, str]) -> dict[str, Any]:
    """Module name -> the MatMul node that applies its weight (``<module>.weight_t``)."""
    by_weight = {n.input[1]: n for n in graph.node if n.op_type == "MatMul" and len(n.input) == 2}
    found = {module: by_weight[weight] for module, weight in linear_weights.items() if weight in by_weight}
    missing = sorted(set(linear_weights) - set(found))
    if missing:
        raise PassError(f"graph has no MatMul applying the weight of {missing[0]} (linear_weights is stale)")
    return found


def activation_labels(graph: Any, linear_weights: dict[str, str]) -> dict[str, str]:
    """Input tensor of each linear MatMul -> label for messages (its first consumer's name)."""
    labels: dict[str, str] = {}
    for node in linear_matmuls(graph, linear_weights).values():
        labels.setdefault(node.input[0], f"{node.name} input")
    return labels


def load_stats(folder: Path) -> dict[str, TensorStats]:
    data = read_json(folder / STATS_FILE, what="the FP8 activation statistics")
    return {name: TensorStats.from_dict(entry) for name, entry in data["tensors"].items()}


MAX_BINS = 1 << 20  # histogram bins a tensor (grown as needed from DEFAULT_BINS)


def validate_fp8(config: Any, where: str = "quant") -> None:
    """The FP8 knobs that need no model (each config that has them): the observer's percentile,
    the histogram bins, the parity guard and the opset the recipe needs."""
    if hasattr(config, "percentile"):
        check_number(f"{where}.percentile", config.percentile, above=0, high=100)
    if hasattr(config, "num_bins"):
        check_int(f"{where}.num_bins", config.num_bins, 2, MAX_BINS)
    if hasattr(config, "min_top1_agreement"):
        check_number(f"{where}.min_top1_agreement", config.min_top1_agreement, low=0, high=1)
    if hasattr(config, "min_opset"):
        check_int(f"{where}.min_opset", config.min_opset, MIN_OPSET, 23)
    if hasattr(config, "calibration") and getattr(config, "activations", True):
        check_windows(config.calibration, f"{where}.calibration")


# --- pass 1: calibration ------------------------------------------------------------------------


@dataclass
class CalibrateConfig:
    _target_: str = "passes.fp8.CalibratePass"
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    num_bins: int = DEFAULT_BINS
    # Opset the recipe will need, checked before the (long) calibration run.
    min_opset: int = MIN_OPSET
    recipe: str = "quant=fp8"

    def validate(self) -> None:
        validate_fp8(self)


class CalibratePass(CalibratesInRanks, Pass):
    """graph -> graph: the same graph plus activation statistics of every linear MatMul input."""

    Config = CalibrateConfig
    name = "calibrate-activations"
    version = 2  # 2: the input's files hard-linked, not copied
    memory_profile = "graph"  # the graph in an ONNX Runtime session; its files linked
    consumes = Kind.GRAPH
    produces = Kind.GRAPH

    def check_model(self, facts: PlannedModel) -> PlannedModel:
        check_opset_value(facts.opset, self.config.min_opset, self.config.recipe)
        check_context(self.config.calibration, facts, f"{self.config_group or 'quant'}.calibration")
        return facts

    def requires(self, source: Artifact) -> None:
        if "linear_weights" not in source.metadata:
            raise PassError(f"{self.config.recipe}: {source.path} records no linear_weights; re-run export")
        check_opset(source, self.config.min_opset, self.config.recipe)

    def run_rank(self, source: Artifact, out_dir: Path, group: Group) -> dict[str, Any]:
        """The pass in one rank of ``group`` (all of it for one process): rank 0 writes and
        returns the metrics, the others return {}."""
        import onnx
        from transformers import AutoTokenizer

        metadata = read_metadata(source.path)
        model_file = source.path / metadata.get("model_file", "model.onnx")
        graph = onnx.load(str(model_file), load_external_data=False).graph
        labels = activation_labels(graph, metadata["linear_weights"])
        tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=False)
        windows = token_windows(tokenizer, self.config.calibration)
        stats = self._collect(model_file, windows, labels, graph_io(source.path), group)
        if not group.main:
            return {}
        link_graph_folder(source.path, out_dir, skip=(ARTIFACT_FILE,))
        (out_dir / STATS_FILE).unlink(missing_ok=True)  # a linked older file: replaced, not written through
        (out_dir / STATS_FILE).parent.mkdir(parents=True, exist_ok=True)
        calibration = {
            **recorded(self.config.calibration),
            "num_bins": self.config.num_bins,
            "tokens": int(windows.size),
            "tensors": len(stats),
            "file": STATS_FILE,
        }
        payload = {"calibration": calibration, "tensors": {n: s.to_dict() for n, s in sorted(stats.items())}}
        (out_dir / STATS_FILE).write_text(json.dumps(payload, sort_keys=True, separators=(",", ":")))
        write_metadata(out_dir, Kind.GRAPH, {**metadata, "calibration": calibration})
        return {"tensors": len(stats), "windows": len(windows), "tokens": int(windows.size)}

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        check_data_files(result.path, self.name)
        return {}

    def _collect(
        self, model_file: Path, windows: np.ndarray, labels: dict[str, str], io: Any, group: Group
    ) -> dict[str, TensorStats]:
        """Every tensor's statistics over all windows. In several ranks: rank 0's first window sets
        each histogram's bins (the first batch does in one process) and every rank starts there,
        runs its windows in a session of its share of the cores, and the ranks merge the result."""
        import torch

        from calibration.observers import collect_stats, reduce_stats
        from pipeline.core.distributed import max_processes

        num_bins = self.config.num_bins
        if group.world == 1:
            feeds = calibration_feeds(windows, io)
            return collect_stats(model_file, feeds, labels, num_bins=num_bins, total=len(windows))
        mine = shard(windows, group.rank, group.world, 1)
        threads = max(1, max_processes("cpu") // group.world)
        names = sorted(labels)
        stats = None
        if group.main:
            first = calibration_feeds(mine[:1], io)
            stats = collect_stats(
                model_file, first, labels, num_bins=num_bins, progress=False, threads=threads
            )
        started = [stats[n].width if stats else 0.0 for n in names]  # rank 0's; 0 elsewhere
        widths = group.sum(torch.tensor(started, dtype=torch.float64))
        if not all(widths > 0):
            raise CalibrationError(
                f"{self.config_group or 'quant'}.calibration.num_processes={group.world}: the first "
                "calibration window leaves a tensor all zeros, so it cannot set the histograms' bins "
                "for every process; calibrate in one process"
            )
        if stats is None:
            stats = {n: TensorStats(labels[n], num_bins=num_bins) for n in names}
            for name, width in zip(names, widths.tolist(), strict=True):
                stats[name].start_at(width)
        rest = mine[1:] if group.main else mine
        feeds = calibration_feeds(rest, io)
        stats = collect_stats(
            model_file, feeds, labels, num_bins=num_bins, total=len(rest), progress=group.main,
            threads=threads, stats=stats,
        )  # fmt: skip
        reduce_stats(stats, group)
        return stats


# --- pass 2: Q/DQ -------------------------------------------------------------------------------


@dataclass
class Fp8QdqConfig:
    _target_: str = "passes.fp8.Fp8QdqPass"
    observer: Observer = Observer.minmax
    percentile: float = 99.99
    weight_observer: WeightObserver = WeightObserver.minmax
    activations: bool = True
    exclude: list[str] = field(default_factory=lambda: ["lm_head"])
    min_top1_agreement: float = 0.5

    def validate(self) -> None:
        validate_fp8(self)


class Fp8QdqPass(Pass):
    """graph -> graph: FP8 weights + DequantizeLinear, Q/DQ on linear activations (module doc)."""

    Config = Fp8QdqConfig
    name = "fp8-qdq"
    drift = "bits8"
    version = 2  # 2: onnx-ir with lazy weights; unchanged data files linked, new ones sharded
    memory_profile = "graph"  # weights memory-mapped; one fp32 weight read at a time
    consumes = Kind.GRAPH
    produces = Kind.GRAPH

    def check_model(self, facts: PlannedModel) -> PlannedModel:
        check_opset_value(facts.opset)
        check_patterns(facts.linears, self.config.exclude)
        return facts

    def requires(self, source: Artifact) -> None:
        if "linear_weights" not in source.metadata:
            raise PassError(f"quant=fp8: {source.path} records no linear_weights; re-run export")
        check_opset(source)
        if self.config.activations and not (source.path / STATS_FILE).is_file():
            raise PassError(
                f"quant=fp8: {source.path} has no activation statistics ({STATS_FILE}): run the "
                "calibrate-activations pass first, or set quant.activations=false"
            )

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        import onnx

        metadata = read_metadata(source.path)
        model_name = metadata.get("model_file", "model.onnx")
        model = load_graph(source.path, model_name)
        linear_weights: dict[str, str] = metadata["linear_weights"]
        quantized = sorted(select_modules(linear_weights, self.config.exclude, source.path))
        excluded = sorted(set(linear_weights) - set(quantized))
        # Nodes found on the proto (names only; no weights read), then taken from the IR by name.
        matmuls = linear_matmuls(
            onnx.load(str(source.path / model_name), load_external_data=False).graph, linear_weights
        )
        by_name = {node.name: node for node in model.graph}
        act_amax: dict[str, float] = {}
        if self.config.activations:
            stats = load_stats(source.path)
            for module in quantized:
                tensor = matmuls[module].input[0]
                if tensor not in stats:
                    raise PassError(f"quant=fp8: no calibration statistics for {matmuls[module].name} input")
                if tensor not in act_amax:
                    act_amax[tensor] = compute_amax(
                        stats[tensor], self.config.observer, FP8_E4M3, self.config.percentile
                    )
        ir_matmuls = {module: by_name[node.name] for module, node in matmuls.items()}
        counts = quantize_graph(model, ir_matmuls, quantized, act_amax, self.config)
        saved = save_graph(model, out_dir, name=model_name, source_dirs=[source.path])
        link_folder_files(source.path, out_dir)
        activations = None
        if self.config.activations:
            activations = {
                "granularity": "per_tensor",
                "static": True,
                "observer": str(self.config.observer),
                **(
                    {"percentile": self.config.percentile}
                    if self.config.observer == Observer.percentile
                    else {}
                ),
                "calibration": metadata.get("calibration"),
            }
        quantization = {
            "recipe": "fp8",
            "format": "float8e4m3fn",
            "weights": {
                "granularity": "per_channel",
                "axis": 1,
                "observer": str(self.config.weight_observer),
            },
            "activations": activations,
            "modules": len(quantized),
            "excluded": excluded,
            "qdq_nodes": counts,
        }
        write_metadata(out_dir, Kind.GRAPH, {**metadata, "quantization": quantization})
        return {"modules": len(quantized), "excluded": len(excluded), **counts, "disk": saved.as_dict()}

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        import onnx

        model_path = result.path / result.metadata.get("model_file", "model.onnx")
        check_data_files(result.path, self.name)
        try:
            check_model(model_path)
        except Exception as exc:  # onnx raises ValidationError / InferenceError
            raise PassError(f"fp8-qdq: the quantized graph fails onnx.checker ({exc})") from None
        problems = verify_qdq(onnx.load(str(model_path), load_external_data=False), result.metadata)
        if problems:
            raise PassError(f"fp8-qdq: {problems[0]} ({len(problems)} problem(s))")
        agreement = compare_graphs(source.path, result.path, PARITY_PROMPT_TEXT)
        if not agreement["finite"]:
            raise PassError("fp8-qdq: the quantized graph produced non-finite logits on a fixed prompt")
        if agreement["top1_agreement"] < self.config.min_top1_agreement:
            raise PassError(
                f"fp8-qdq: the quantized graph agrees with its input on {agreement['top1_agreement']:.0%} of "
                f"greedy tokens of a fixed prompt (< quant.min_top1_agreement="
                f"{self.config.min_top1_agreement}); the quantized graph is broken"
            )
        # Not named "parity": the run summary reads that key as export's ORT-vs-torch check.
        return {"vs_input": agreement}


def quantize_graph(
    model: Any, matmuls: dict[str, Any], quantized: list[str], act_amax: dict[str, float], config: Any
) -> dict[str, int]:
    """Rewrite ``model`` (an ``onnx_ir.Model``, weights left on disk: ``pipeline.core.graph_io``) in
    place: FP8 weights + DQ, and Q/DQ on the activations in ``act_amax``. ``matmuls``: module ->
    its MatMul node (``linear_matmuls``). Each fp32 weight is read only while it is quantized."""
    import onnx_ir as ir
    from tqdm import tqdm

    graph = model.graph
    initializers = graph.initializers
    counts = {"QuantizeLinear": 0, "DequantizeLinear": 0}
    for module in tqdm(quantized, desc="fp8 weights", unit="layer", leave=False):
        node = matmuls[module]
        old = node.inputs[1]
        weight_name = old.name
        weight = np.asarray(old.const_value.numpy())
        amax = channel_amax(weight, axis=1, observer=config.weight_observer, fmt=FP8_E4M3, label=module)
        scale = FP8_E4M3.scale(amax)
        codes = FP8_E4M3.quantize(weight, scale)
        del weight
        initializers.pop(weight_name)
        if old in graph.inputs:  # IR < 4 also lists initializers as graph inputs
            graph.inputs.remove(old)
        old.const_value = None  # drops the memory map of the fp32 weight
        old.name = f"{weight_name}.fp32"  # the DQ output takes its name
        inputs = [
            new_initializer(graph, f"{weight_name}_fp8", codes),
            new_initializer(graph, f"{weight_name}_scale", scale),
        ]
        scope = node.name.removesuffix("/MatMul")
        dequantize = ir.node(
            "DequantizeLinear",
            inputs,
            attributes={"axis": 1},
            name=f"{scope}/weight_quantizer/DequantizeLinear",
            outputs=[ir.Value(name=weight_name)],  # the MatMul keeps reading `<module>.weight_t`
        )
        for user, index in list(old.uses()):
            user.replace_input_with(index, dequantize.outputs[0])
        graph.insert_before(node, dequantize)
        counts["DequantizeLinear"] += 1
    if not act_amax:
        return counts
    zero = np.zeros((), dtype=FP8_E4M3.quantize(np.zeros(1), 1.0).dtype)
    zero_point = new_initializer(graph, ZERO_POINT, zero)
    values = {v.name: v for v in graph.inputs}
    values.update({v.name: v for n in graph for v in n.outputs})
    dequantized: dict[str, Any] = {}
    at_start: list[Any] = []
    after: dict[int, list[Any]] = {}  # id(producer) -> Q/DQ nodes, in its outputs' order
    for tensor, amax in act_amax.items():
        scale = FP8_E4M3.scale(amax)
        scale_value = new_initializer(graph, f"{tensor}_scale", np.asarray(scale, np.float32).reshape(()))
        quantize = ir.node(
            "QuantizeLinear",
            [values[tensor], scale_value, zero_point],
            name=f"{tensor}_QuantizeLinear",
            outputs=[ir.Value(name=f"{tensor}_fp8")],
        )
        dequantize = ir.node(
            "DequantizeLinear",
            [quantize.outputs[0], scale_value, zero_point],
            name=f"{tensor}_DequantizeLinear",
            outputs=[ir.Value(name=f"{tensor}_dq")],
        )
        dequantized[tensor] = dequantize.outputs[0]
        producer = values[tensor].producer()
        (at_start if producer is None else after.setdefault(id(producer), [])).append(
            (values[tensor], [quantize, dequantize])
        )
        counts["QuantizeLinear"] += 1
        counts["DequantizeLinear"] += 1
    for module in quantized:
        node = matmuls[module]
        if node.inputs[0].name in dequantized:
            node.replace_input_with(0, dequantized[node.inputs[0].name])
    if at_start:
        graph.insert_before(next(iter(graph)), [n for _, pair in at_start for n in pair])
    for node in list(graph):
        if id(node) in after:
            order = {id(v): i for i, v in enumerate(node.outputs)}
            pairs = sorted(after[id(node)], key=lambda item: order[id(item[0])])
            graph.insert_after(node, [n for _, pair in pairs for n in pair])
    return counts


def verify_qdq(model: Any, metadata: dict[str, Any]) -> list[str]:
    """Structural check: each quantized linear MatMul reads FP8 weights (and FP8 activations)."""
    from onnx import TensorProto

    quant = metadata["quantization"]
    producers = {out: node for node in model.graph.node for out in node.output}
    inits = {init.name: init for init in model.graph.initializer}
    problems = []
    excluded = set(quant["excluded"])
    for module, weight in metadata["linear_weights"].items():
        dq = producers.get(weight)
        if module in excluded:
            if dq is not None:
                problems.append(f"excluded module {module} has a quantized weight")
            continue
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            problems.append(f"{module}: weight is not an FP8 initializer + DequantizeLinear")
        elif inits[dq.input[0]].data_type != TensorProto.FLOAT8E4M3FN:
            problems.append(f"{module}: weight initializer is not FLOAT8E4M3FN")
    if quant["activations"]:
        consumers = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in producers]
        for node in consumers:
            if producers[node.input[1]].op_type != "DequantizeLinear":
                continue
            dq = producers.get(node.input[0])
            q = producers.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
            if q is None or q.op_type != "QuantizeLinear":
                problems.append(f"{node.name}: activation input has no QuantizeLinear/DequantizeLinear pair")
    return problems
