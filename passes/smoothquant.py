"""SmoothQuant: migrate activation outliers into the weights before W8A8 quantization (torch stage).

Algorithm: Xiao et al. 2022, "SmoothQuant: Accurate and Efficient Post-Training Quantization for
Large Language Models" (arXiv:2211.10438; reference code github.com/mit-han-lab/smoothquant,
``smoothquant/smooth.py``). For the linear layers that read one activation ``X`` (columns ``j``):

    s_j = max|X_j| ** alpha / max|W_:,j| ** (1 - alpha)        (clamped to >= 1e-5)

``X`` is divided by ``s`` and the weights' input columns multiplied by it: ``(X / s)(s W) = X W``,
so the fp32 function is unchanged while the per-channel activation outliers, which per-tensor INT8
cannot represent, move into the weights, which are quantized per output channel. The division is
folded into the producer of ``X``, so the model keeps its architecture:

- ``input_layernorm.weight``          -> ``q_proj``, ``k_proj``, ``v_proj`` (the paper's rule)
- ``post_attention_layernorm.weight`` -> ``gate_proj``, ``up_proj`` (the paper's rule)
- ``up_proj`` rows                     -> ``down_proj`` (``silu(gate) * up`` is linear in ``up``)
- ``v_proj`` rows                      -> ``o_proj`` (attention output is linear in V; with grouped
  query attention a KV channel feeds ``heads / kv_heads`` query heads, so they share one scale)

The tied ``lm_head`` (SmolLM2: ``lm_head.weight is embed_tokens.weight``) is not smoothed: scaling it
would scale the embedding too (the recipe quantizes it weight-only by default). Groups whose layers
are all excluded or weight-only are not smoothed either: smoothing only helps activations.

Statistics: one calibration pass over ``calibration`` windows records the per-channel ``max|X_j|``
of every ``nn.Linear`` input (forward pre-hooks). Because smoothing divides channel ``j`` exactly by
``s_j``, the per-tensor range of each smoothed input, ``max_j max|X_j| / s_j``, follows from the
same pass; it is written to ``extras/int8/activations.json`` for the graph pass
(``passes/int8.py``), which makes it the static INT8 activation scale (``absmax / 127``). The ONNX
MatMul input equals the torch ``Linear`` input, so the graph pass needs no second calibration.
(The per-channel absmax collection here is deliberately minimal; once ``calibration/observers.py``
lands, the per-tensor range should come from its observers, e.g. percentile or MSE.)

Scale (issue 21): the pass streams the checkpoint one decoder block at a time
(``calibration/streaming.py``; llm-compressor's sequential pipeline and GPTQ's reference code do
the same): a block is read from the safetensors, the calibration activations pass through it
(its unsmoothed outputs feed the next block, so the statistics equal a whole-model forward's),
its groups are smoothed, it is written as one shard and freed. Peak memory is one block plus the
calibration activations at one layer plus the embeddings, whatever the depth. Blocks compute on
``pipeline.device`` in ``pipeline.torch_dtype``; statistics and scales are float32, and the scales
are folded into a float32 copy of the weights, so the output is float32 safetensors as before.
:func:`smooth_model` / :func:`collect_channel_absmax` are the whole-model form of the same
computation (tests compare the two).

``run`` checks that the smoothed model computes the same float32 logits as the input on a probe
window (``parity_tolerance``), pushing the probe through each block before and after smoothing as
it streams by; ``ensures`` checks the recorded statistics.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from calibration.datasets import CalibrationConfig, check_context, recorded, shard, token_windows
from calibration.streaming import ForwardTime
from calibration.workload import CalibratesInRanks
from passes.selection import check_patterns, matches
from pipeline.core.artifacts import Artifact, Kind, write_json, write_metadata
from pipeline.core.base import Pass
from pipeline.core.config import MAX_BATCH, check_number
from pipeline.core.distributed import Group
from pipeline.core.errors import CalibrationError, PassError
from pipeline.core.families import Family, divide_gain, family_of, head_dim
from pipeline.core.files import read_json
from pipeline.core.placement import CPU_FLOAT32, ResolvedPlacement
from pipeline.core.planned_model import PlannedModel
from pipeline.core.torch_model import linear_layers

log = logging.getLogger(__name__)

EXTRAS_DIR = "extras"  # == passes.export.EXTRAS_DIR: export copies it into the graph artifact
INT8_DIR = "int8"
ACTIVATIONS_FILE = "activations.json"
FORMAT_VERSION = 1
MIN_SCALE = 1e-5  # the reference implementation's clamp of weight maxima and smoothing scales
PROBE_TOKENS = 64  # the parity probe: the first calibration window, cut to this many tokens


@dataclass
class SmoothQuantConfig:
    """SmoothQuant smoothing and the activation statistics of the INT8 recipe (torch stage)."""

    _target_: str = "passes.smoothquant.SmoothQuantPass"
    # Migration strength: 0 leaves activation outliers where they are, 1 moves them all into the
    # weights. The paper's default is 0.5; 0.8 measured best on SmolLM2-135M (passes/int8.py).
    alpha: float = 0.8
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    # fnmatch patterns over module names (model.layers.3.mlp.down_proj, lm_head) left in fp32.
    exclude: list[str] = field(default_factory=list)
    # Patterns of modules whose weights only are quantized (activations stay fp32). A smoothing
    # group whose consumers are all excluded or weight-only is not smoothed: smoothing only
    # helps activation quantization and makes the weights harder to quantize.
    weight_only: list[str] = field(default_factory=list)
    # false: no smoothing, only the activation ranges (plain static W8A8: the naive baseline).
    smooth: bool = True
    # Also smooth o_proj (folded into v_proj rows) and down_proj (folded into up_proj rows).
    smooth_o_proj: bool = True
    smooth_down_proj: bool = True
    # Calibration windows per forward.
    batch_size: int = 8
    # Max |logit difference| of the saved smoothed model vs the input, relative to max |logit|.
    parity_tolerance: float = 1e-3

    def validate(self) -> None:
        validate(self)


def validate(config: Any, where: str = "quant") -> None:
    """Checks that need no model; one-line errors naming the knob."""
    alpha = config.alpha
    if not isinstance(alpha, int | float) or not math.isfinite(alpha) or not 0.0 <= alpha <= 1.0:
        raise PassError(f"{where}.alpha={alpha} is outside [0, 1]: SmoothQuant's migration strength")
    calibration = config.calibration
    if calibration.num_samples < 1:
        raise CalibrationError(
            f"{where}.calibration.num_samples={calibration.num_samples}: at least one calibration window "
            "is needed for static activation ranges"
        )
    if calibration.seq_len < 2:
        raise CalibrationError(f"{where}.calibration.seq_len={calibration.seq_len}: must be at least 2")
    if not isinstance(config.batch_size, int) or not 1 <= config.batch_size <= MAX_BATCH:
        raise PassError(f"{where}.batch_size={config.batch_size}: must be from 1 to {MAX_BATCH}")
    check_number(f"{where}.parity_tolerance", getattr(config, "parity_tolerance", 0.0), low=0, high=1)


# --------------------------------------------------------------------------------------------
# Statistics


def absmax_hook(stats: dict[str, Any], name: str) -> Any:
    """A forward pre-hook folding the per-channel ``max|X_j|`` of a linear layer's input into
    ``stats[name]`` (float32). The max of bf16/fp16 values is exact, so the cast comes after the
    reduction; torch.maximum propagates NaN, so a NaN/inf in any batch stays visible to the checks."""
    import torch

    def record(_module: Any, args: tuple[Any, ...]) -> None:
        x = args[0].detach()
        current = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        stats[name] = current if name not in stats else torch.maximum(stats[name], current)

    return record


def collect_channel_absmax(
    model: Any, windows: np.ndarray, batch_size: int = 8, modules: dict[str, Any] | None = None
) -> tuple[dict[str, Any], int]:
    """Per input channel ``max|X_j|`` of every linear layer over ``windows`` [n, seq]; also the token
    count. Raises CalibrationError on NaN/inf."""
    import torch
    from tqdm.auto import tqdm

    modules = linear_layers(model) if modules is None else modules
    stats: dict[str, Any] = {}

    def hook(name: str) -> Any:
        return absmax_hook(stats, name)

    # The head's input is the decoder's last hidden state: record it directly instead of
    # computing [batch, seq, vocab] logits (a fifth of the forward's work on the default model).
    decoder = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    head_name = next((n for n, m in modules.items() if m is head), None)
    direct = decoder is not None and head_name is not None
    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items() if not (direct and m is head)]
    tokens = 0
    try:
        with torch.inference_mode():
            for start in tqdm(
                range(0, len(windows), batch_size), desc="smoothquant: calibration", unit="batch"
            ):
                batch = torch.from_numpy(np.ascontiguousarray(windows[start : start + batch_size]))
                if direct:
                    hidden = decoder(input_ids=batch, use_cache=False).last_hidden_state
                    hook(head_name)(head, (hidden,))
                else:
                    model(input_ids=batch, use_cache=False)
                tokens += batch.numel()
    finally:
        for handle in handles:
            handle.remove()
    if tokens == 0:
        raise CalibrationError("quant.calibration: no calibration tokens reached the model")
    for name, value in stats.items():
        if not torch.isfinite(value).all():
            raise CalibrationError(
                f"quant.calibration: the input statistics of {name} hold NaN/inf on the calibration text "
                "(the checkpoint overflows in fp32); exclude it (quant.exclude) or check the weights"
            )
    missing = sorted(set(modules) - set(stats))
    if missing:
        raise CalibrationError(f"quant.calibration: no activation reached {missing[0]} during calibration")
    return stats, tokens


# --------------------------------------------------------------------------------------------
# Smoothing


@dataclass
class SmoothGroup:
    """Linear layers reading one activation and the producer the division by ``s`` folds into."""

    name: str  # e.g. model.layers.0.qkv
    kind: str  # "norm" | "up" | "v"
    producer: str  # module whose weight absorbs 1/s
    consumers: list[str]


def layer_groups(
    family: Family, index: int, smooth_o_proj: bool, smooth_down_proj: bool
) -> list[SmoothGroup]:
    """The smoothing groups of decoder layer ``index`` (each group lies inside one layer), from
    the family's mapping (:mod:`pipeline.core.families`): ``smooth_o_proj`` keeps its "v" group
    (v -> o), ``smooth_down_proj`` its "up" group (up -> down)."""
    p = family.layer(index)
    kept = {"norm": True, "v": smooth_o_proj, "up": smooth_down_proj}
    return [
        SmoothGroup(f"{p}.{g.name}", g.kind, f"{p}.{g.producer}", [f"{p}.{c}" for c in g.consumers])
        for g in family.smoothing
        if kept[g.kind]
    ]


def smoothing_groups(model: Any, smooth_o_proj: bool, smooth_down_proj: bool) -> list[SmoothGroup]:
    family = family_of(model.config)
    return [
        group
        for index in range(len(model.get_submodule(family.layers)))
        for group in layer_groups(family, index, smooth_o_proj, smooth_down_proj)
    ]


def smoothing_scales(act_absmax: Any, weights: list[Any], alpha: float) -> Any:
    """SmoothQuant's ``s_j = max|X_j|^alpha / max|W_j|^(1-alpha)`` for weights [out, in] sharing X."""
    import torch

    weight_max = torch.stack([w.detach().abs().amax(dim=0).float() for w in weights]).amax(dim=0)
    weight_max = weight_max.clamp(min=MIN_SCALE)
    act = act_absmax.float().clamp(min=MIN_SCALE)
    return (act.pow(alpha) / weight_max.pow(1.0 - alpha)).clamp(min=MIN_SCALE)


def _kv_shared(values: Any, kv_heads: int, head_dim: int) -> Any:
    """[heads * head_dim] -> [kv_heads * head_dim]: max over the query heads sharing a KV head."""
    return values.reshape(kv_heads, -1, head_dim).amax(dim=1).reshape(-1)


def _kv_expand(values: Any, heads: int, kv_heads: int, head_dim: int) -> Any:
    """[kv_heads * head_dim] -> [heads * head_dim], head ``h`` reading KV head ``h // (heads/kv)``."""
    rep = heads // kv_heads
    return values.reshape(kv_heads, 1, head_dim).expand(kv_heads, rep, head_dim).reshape(-1)


def smooth_model(
    model: Any, stats: dict[str, Any], config: SmoothQuantConfig, alphas: dict[str, float] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Apply SmoothQuant in place (``alphas``: per-group migration strength, default
    ``config.alpha``); return the scale each linear input was divided by (module -> [in] tensor;
    absent: 1) and the names of the smoothed groups."""
    groups = smoothing_groups(model, config.smooth_o_proj, config.smooth_down_proj)
    return smooth_modules(dict(model.named_modules()), groups, stats, config, model.config, alphas)


def smooth_modules(
    modules: dict[str, Any],
    groups: list[SmoothGroup],
    stats: dict[str, Any],
    config: SmoothQuantConfig,
    hf: Any,
    alphas: dict[str, float] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """:func:`smooth_model` on the ``groups`` whose modules are in ``modules`` (by full module name:
    the whole model, or one decoder block as it streams by); ``hf`` is the model's config."""
    import torch

    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    offset = family_of(hf).norm_offset  # Gemma's RMSNorm scales by (1 + weight)
    width = head_dim(hf.to_dict())
    divided: dict[str, Any] = {}
    done: list[str] = []
    with torch.no_grad():
        for group in groups:
            if all(matches(c, config.exclude + config.weight_only) for c in group.consumers):
                continue
            consumers = [modules[c] for c in group.consumers]
            weights = [m.weight for m in consumers]
            act = stats[group.consumers[0]]
            alpha = (alphas or {}).get(group.name, config.alpha)
            if group.kind == "v":  # one scale per KV channel, shared by its query heads
                w_max = torch.stack([_kv_shared(w.abs().amax(dim=0), kv_heads, width) for w in weights])
                w_max = w_max.amax(dim=0).clamp(min=MIN_SCALE)
                a = _kv_shared(act, kv_heads, width).clamp(min=MIN_SCALE)
                s_kv = (a.pow(alpha) / w_max.pow(1.0 - alpha)).clamp(min=MIN_SCALE)
                scale = _kv_expand(s_kv, heads, kv_heads, width)
                producer_scale = s_kv
            else:
                scale = smoothing_scales(act, weights, alpha)
                producer_scale = scale
            producer = modules[group.producer]
            if group.kind == "norm":
                divide_gain(producer.weight, producer_scale, offset)
            else:  # a linear layer's output rows (up_proj, v_proj)
                producer.weight.div_(producer_scale[:, None])
                if getattr(producer, "bias", None) is not None:
                    producer.bias.div_(producer_scale)
            for module in consumers:
                module.weight.mul_(scale[None, :])
            for name in group.consumers:
                divided[name] = scale
            done.append(group.name)
    return divided, done


def activation_ranges(stats: dict[str, Any], divided: dict[str, Any]) -> dict[str, float]:
    """Per-tensor ``max|X|`` of each linear input after smoothing (exact: channel j is divided by s_j)."""
    ranges = {}
    for name, absmax in stats.items():
        value = absmax / divided[name] if name in divided else absmax
        ranges[name] = float(value.max())
    return ranges


# --------------------------------------------------------------------------------------------
# One decoder block at a time


def block_modules(layer: Any, prefix: str) -> dict[str, Any]:
    """The modules of one decoder block by their full name in the model (``model.layers.3.mlp``)."""
    return {f"{prefix}.{name}" if name else prefix: module for name, module in layer.named_modules()}


def check_finite_stats(stats: dict[str, Any]) -> None:
    import torch

    for name, value in stats.items():
        if not bool(torch.isfinite(value).all()):
            raise CalibrationError(
                f"quant.calibration: the input statistics of {name} hold NaN/inf on the calibration text "
                "(the checkpoint overflows in fp32); exclude it (quant.exclude) or check the weights"
            )


def calibrate_block(
    layer: Any, prefix: str, hidden: list[Any], kwargs: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[Any]]:
    """Push each calibration batch through one decoder block: the per-channel ``max|X_j|`` of each of
    its linear inputs (float32, on the block's device) and the block's outputs (the next block's
    inputs). Raises CalibrationError on NaN/inf."""
    import torch

    linears = {n: m for n, m in block_modules(layer, prefix).items() if isinstance(m, torch.nn.Linear)}
    stats: dict[str, Any] = {}

    def hook(name: str) -> Any:
        return absmax_hook(stats, name)

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    outputs = []
    try:
        with torch.inference_mode():
            for h, kw in zip(hidden, kwargs, strict=True):
                out = layer(h, **kw)
                outputs.append(out[0] if isinstance(out, tuple) else out)
    finally:
        for handle in handles:
            handle.remove()
    check_finite_stats(stats)
    missing = sorted(set(linears) - set(stats))
    if missing:
        raise CalibrationError(f"quant.calibration: no activation reached {missing[0]} during calibration")
    return stats, outputs


@dataclass
class Streamed:
    """What :func:`smooth_streamed` measured: the unsmoothed per-channel statistics (module ->
    [in] float32), the divisors of the smoothed inputs, the smoothed groups, the calibration token
    count, and the float32 logits of the probe window through the input and the smoothed model."""

    stats: dict[str, Any]
    divided: dict[str, Any]
    groups: list[str]
    tokens: int
    tied: bool
    reference: Any
    logits: Any
    forward_time: ForwardTime  # this rank's calibration forwards


def smooth_streamed(
    source: Path,
    out_dir: Path,
    windows: np.ndarray,
    config: SmoothQuantConfig,
    placement: ResolvedPlacement = CPU_FLOAT32,
    group: Group | None = None,
) -> Streamed:
    """SmoothQuant one decoder block at a time (the scheme of llm-compressor's sequential pipeline
    and GPTQ's reference code, on ``calibration/streaming.py``): per block, load its weights from
    the safetensors, push the calibration activations through it collecting its inputs'
    per-channel ``max|X_j|``, fold the smoothing scales into its weights (:func:`smooth_modules`,
    as :func:`smooth_model` does for the whole model), write it and free it. The block's unsmoothed
    outputs are the next block's inputs, so every statistic is the one a whole-model forward
    collects. Peak memory: one block (float32, plus a copy in the compute dtype when that differs)
    + the calibration activations at one layer + the embeddings (or the head).

    Blocks compute on ``placement``; statistics and scales are float32, and the scales are folded
    into a float32 copy of the weights, which is what is written (float32 safetensors, as
    ``save_pretrained`` wrote before). The parity probe (one window, <= 64 tokens) runs in float32
    through each block before and after smoothing, so it does not depend on the compute dtype and
    needs no reload of the written model.

    In a group of ranks (``quant.calibration.num_processes``), each pushes its share of ``windows``
    and the per-channel maxima are max-reduced across ranks after each block, so every rank smooths
    with the statistics of all windows (max is exact: the scales equal one process's); rank 0
    alone writes."""
    import torch
    from tqdm.auto import tqdm

    from calibration.streaming import CheckpointWriter, StreamedCheckpoint

    fp32 = ResolvedPlacement(placement.device, "float32")
    master = StreamedCheckpoint(source, fp32)  # the weights that are smoothed and written
    family = master.family
    lowered = placement.dtype != torch.float32
    compute = StreamedCheckpoint(source, placement) if lowered else master  # calibration forwards
    group = group or Group()
    writer = CheckpointWriter(out_dir) if group.main else None
    forward_time = ForwardTime()

    # Embeddings, final norm, head: unchanged (SmoothQuant leaves them), written as read.
    rest = [*master.tensor_names(family.embeddings), *master.tensor_names(family.final_norm)]
    if not master.output_tied:
        rest += master.tensor_names(family.head)
    if writer:
        writer.write({n: t.float().contiguous() for n, t in master.read(rest).items()})

    probe_windows = windows[:1, : min(PROBE_TOKENS, windows.shape[1])]
    probe = master.first_block_inputs(probe_windows, 1)
    reference = smoothed = probe.hidden[0]
    mine = shard(windows, group.rank, group.world, config.batch_size)
    inputs = compute.first_block_inputs(mine, config.batch_size)
    hidden, tokens = inputs.hidden, inputs.tokens
    stats: dict[str, Any] = {}
    divided: dict[str, Any] = {}
    groups: list[str] = []
    with torch.inference_mode():
        for index in tqdm(range(master.num_layers), desc="smoothquant: blocks", unit="block"):
            prefix = master.layer_prefix(index)
            layer = master.materialize(prefix)
            block = compute.materialize(prefix) if lowered else layer
            probe_kwargs = probe.at(index).kwargs[0]  # this layer's mask and rotary
            with forward_time.measure():
                block_stats, hidden = calibrate_block(block, prefix, hidden, inputs.at(index).kwargs)
            for name in sorted(block_stats):  # every rank reduces the same tensors in one order
                group.max(block_stats[name])
            if lowered:
                compute.release(prefix)
            del block
            stats.update(block_stats)
            reference = _block_output(layer, reference, probe_kwargs)
            if config.smooth:
                block_divided, done = smooth_modules(
                    block_modules(layer, prefix),
                    layer_groups(family, index, config.smooth_o_proj, config.smooth_down_proj),
                    block_stats,
                    config,
                    master.config,
                )
                divided.update(block_divided)
                groups.extend(done)
            smoothed = _block_output(layer, smoothed, probe_kwargs)
            if writer:
                writer.write(master.output_tensors(prefix))
            master.release(prefix)  # hands the freed memory back to the OS (pipeline/core/allocator.py)

        # lm_head reads the final norm of the last hidden state: no [batch, seq, vocab] logits.
        norm = compute.materialize(family.final_norm)
        head_stats = None
        for h in hidden:
            x = norm(h)
            current = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
            head_stats = current if head_stats is None else torch.maximum(head_stats, current)
        del hidden
        stats[family.head] = group.max(head_stats)
        check_finite_stats({family.head: head_stats})
        if lowered:
            compute.release(family.final_norm)
        norm, head = master.materialize(family.final_norm), master.materialize(family.head)
        reference, logits = (head(norm(h)).float() for h in (reference, smoothed))
        master.release(family.final_norm)
        master.release(family.head)
    if writer:
        writer.finish(master.config, master.generation_config())
    tokens = int(group.sum(torch.tensor([tokens], dtype=torch.float64))[0])
    return Streamed(stats, divided, groups, tokens, master.tied, reference, logits, forward_time)


def _block_output(layer: Any, hidden: Any, kwargs: dict[str, Any]) -> Any:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


# --------------------------------------------------------------------------------------------
# The pass


class SmoothQuantPass(CalibratesInRanks, Pass):
    """Torch -> torch: the smoothed checkpoint plus ``extras/int8/activations.json``."""

    Config = SmoothQuantConfig
    name = "smoothquant"
    version = 2  # 2: block-streamed, on pipeline.device / pipeline.torch_dtype
    consumes = Kind.TORCH
    produces = Kind.TORCH
    placement_knobs = ("device", "torch_dtype")
    memory_profile = "block"

    def check_model(self, facts: PlannedModel) -> PlannedModel:
        family_of(facts.config)  # a family whose smoothing mapping is known (pipeline.core.families)
        check_patterns(facts.linears, self.config.exclude)
        check_context(self.config.calibration, facts, f"{self.config_group or 'quant'}.calibration")
        check_patterns(facts.linears, self.config.weight_only, "quant.weight_only")
        return facts

    def run_rank(self, source: Artifact, out_dir: Path, group: Group) -> dict[str, Any]:
        """The pass in one rank of ``group`` (all of it for one process): rank 0 writes and
        returns the metrics, the others return {}."""
        from pipeline.core.torch_model import copy_beside_weights, load_tokenizer

        config = self.config
        windows = token_windows(load_tokenizer(source.path), config.calibration)
        log.info(
            "smoothquant: calibrating on %d windows x %d tokens, block by block on %s in %s",
            len(windows),
            config.calibration.seq_len,
            self.placement.device,
            self.placement.torch_dtype,
        )
        if group.main:
            out_dir.mkdir(parents=True, exist_ok=True)
            copy_beside_weights(source.path, out_dir)  # before the weights: their config.json wins
        streamed = smooth_streamed(source.path, out_dir, windows, config, self.placement, group)
        if not group.main:
            return {}
        stats, divided, groups, tokens = streamed.stats, streamed.divided, streamed.groups, streamed.tokens
        tied = streamed.tied
        ranges = activation_ranges(stats, divided)
        log.info("smoothquant: alpha=%.2f, %d groups smoothed", config.alpha, len(groups))
        info = {
            "algorithm": "smoothquant",
            "alpha": config.alpha,
            "smooth": config.smooth,
            "groups": groups,
            "calibration": {**recorded(config.calibration), "tokens": tokens},
            "tied_lm_head": tied,
        }
        extras = out_dir / EXTRAS_DIR / INT8_DIR
        extras.mkdir(parents=True, exist_ok=True)
        write_json(
            extras / ACTIVATIONS_FILE,
            {
                **info,
                "format": FORMAT_VERSION,
                "observer": "absmax",
                "absmax": ranges,
                # Before smoothing, for the record: how much smoothing shrank each range.
                "absmax_unsmoothed": {n: float(v.max()) for n, v in stats.items()},
            },
        )
        write_metadata(out_dir, Kind.TORCH, {**source.metadata, "smoothquant": info})

        reference, logits = streamed.reference, streamed.logits
        diff = float((logits - reference).abs().max())
        relative = diff / max(float(reference.abs().max()), 1e-12)
        agree = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
        if not relative <= config.parity_tolerance:
            raise PassError(
                f"smoothquant: the smoothed model's logits differ from the input's by {relative:.2e} of "
                f"their range (> parity_tolerance {config.parity_tolerance:g}); smoothing must not change "
                "the fp32 function"
            )
        shrink = [stats[n].max().item() / max(ranges[n], 1e-12) for n in divided]
        return {
            "groups_smoothed": len(groups),
            "calibration_tokens": tokens,
            # Smoothed vs input checkpoint in torch (not "parity", which the summary reads as ORT vs torch).
            "fp32_parity": {"max_abs_diff": diff, "relative": relative, "top1_agreement": agree},
            "median_range_reduction": float(np.median(shrink)) if shrink else 1.0,
            # This process's share: with N processes, 1/N of the windows (rank 0's time).
            "calibration": {
                "processes": group.world,
                "windows": len(shard(windows, group.rank, group.world, config.batch_size)),
                **streamed.forward_time.to_dict(),
            },
        }

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        data = read_activations(result.path)
        bad = [n for n, v in data["absmax"].items() if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise CalibrationError(f"quant.calibration: activation range of {bad[0]} is not finite")
        return {}


def read_activations(folder: Path) -> dict[str, Any]:
    """The ``extras/int8/activations.json`` of a torch or graph artifact folder."""
    path = folder / EXTRAS_DIR / INT8_DIR / ACTIVATIONS_FILE
    if not path.is_file():
        raise PassError(
            f"{path} is missing: the INT8 graph pass needs the activation ranges written by the "
            "smoothquant pass of quant=int8"
        )
    data = read_json(path, what="the activation ranges")
    if data.get("format") != FORMAT_VERSION:
        raise PassError(f"{path}: unsupported format {data.get('format')}; rebuild with quant=int8")
    return data
