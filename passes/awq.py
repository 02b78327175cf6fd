"""AWQ: activation-aware INT4 weight-only quantization (torch stage), and the ``quant=int4_awq``
recipe (AWQ in torch, then ``passes.matmulnbits`` in the graph).

Algorithm: Lin, Tang, Tang, Yang, Dang, Gan, Han, "AWQ: Activation-aware Weight Quantization for
LLM Compression and Acceleration" (MLSys 2024, arXiv:2306.00978), as in the authors' ``llm-awq``
(``auto_scale.py``, ``auto_clip.py``). Per decoder layer, on calibration inputs:

1. Scale search. For each set of linears fed by one op (``input_layernorm`` -> q/k/v,
   ``v_proj`` -> ``o_proj`` when their shapes match (no GQA), ``post_attention_layernorm`` ->
   gate/up, ``up_proj`` -> ``down_proj``) with ``s = mean|x|^alpha / sqrt(max * min)`` for
   ``alpha`` in ``0, 1/grid, ..., (grid-1)/grid``, quantize ``W diag(s)`` and keep the ``s`` with
   the smallest output error. ``objective=linear`` (default) scores the linears' own outputs, the
   paper's Eq. 4, exactly over every calibration token via the inputs' Gram matrix
   (``mean_t ||dW x_t||^2 = tr(dW G dW^T)``, no forward per candidate); ``objective=block`` scores
   the output of the block they sit in (attention, MLP), as ``llm-awq`` does, with a forward per
   candidate on ``search_samples`` windows (several times slower on a 2-core CPU). ``alpha = 0``
   is plain round-to-nearest, so the search never does worse than it on the data it scores.
2. Fold: the producing op's weight (RMSNorm gain, or the linear's output rows) is divided by ``s``
   and the consumers' input columns multiplied by it; the fp32 function is unchanged.
3. Clip search: per output row and group, the weight range is shrunk (1.0 down to 0.55 of max|w|)
   to minimise the group's partial-output error (not for q/k, as in ``llm-awq``), again exact
   over every token through the diagonal blocks of the Gram matrix (``llm-awq`` samples 512).
4. Round-to-nearest on the scaled, clipped weights (``passes.int4``).

The next layer is calibrated on the fp32 layer's outputs (``llm-awq``'s ``run_awq``). ``lm_head``
(untied from the embedding) gets the same treatment with the final RMSNorm as its producer.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from passes.int4 import (
    CALIBRATION_BATCH,
    LM_HEAD,
    Int4Recipe,
    Int4RecipeConfig,
    LayerInputs,
    QuantizedLinear,
    TorchInt4Config,
    TorchInt4Pass,
    check_finite,
    dequantize,
    input_hooks,
    quantize_codes,
    quantize_rtn,
    range_params,
    run_layer,
)
from pipeline.config import register_pass
from pipeline.errors import ConfigError

log = logging.getLogger(__name__)

CLIP_MAX_SHRINK = 0.5
CLIP_GRID = 20
NO_CLIP = ("q_proj", "k_proj")  # their error is amplified by the attention scores (llm-awq)


class Objective(enum.StrEnum):
    # The paper's Eq. 4: the searched linears' own output error, exact over every calibration
    # token through their inputs' Gram matrix (no forward pass per candidate).
    linear = "linear"
    # llm-awq's implementation: the output error of the block the linears sit in (attention for
    # q/k/v, the MLP for gate/up), one forward per candidate on ``search_samples`` windows.
    block = "block"


@dataclass
class AwqConfig(TorchInt4Config):
    _target_: str = "passes.awq.AwqPass"
    # Candidate scale exponents alpha = 0, 1/grid, ..., (grid-1)/grid (the paper: 20).
    grid: int = 20
    objective: Objective = Objective.linear
    # objective=block: calibration windows scoring each candidate (rounded up to batches of 8;
    # 0: all). Activation statistics always use every window.
    search_samples: int = 16
    # Weight-range clipping search after scaling (the paper's auto_clip).
    clip: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        validate_awq(self)


@dataclass
class Int4AwqConfig(Int4RecipeConfig):
    """``quant=int4_awq``: AWQ in torch, lowered to MatMulNBits (or block-wise Q/DQ) in the graph."""

    _target_: str = "passes.awq.Int4AwqRecipe"
    grid: int = 20
    objective: Objective = Objective.linear
    search_samples: int = 16
    clip: bool = True


register_pass("quant", "int4_awq", Int4AwqConfig)


def validate_awq(config: Any) -> None:
    config.objective = Objective(config.objective)
    if config.grid < 1:
        raise ConfigError(f"quant.grid={config.grid}: at least one candidate scale is needed")
    if config.search_samples < 0:
        raise ConfigError(f"quant.search_samples={config.search_samples}: must be >= 0 (0: all windows)")


def fake_quantize(weight: Any, group_size: int, symmetric: bool) -> Any:
    return quantize_rtn(weight, group_size, symmetric).dequantize()


def fold_scales(prev: Any, linears: list[Any], scales: Any) -> None:
    """Divide ``prev``'s output channels by ``scales`` and multiply the consumers' input columns
    by them: ``W diag(s) (x / s) = W x``, so the model's function is unchanged."""
    if hasattr(prev, "out_features"):  # a linear: its output rows
        prev.weight.data.div_(scales[:, None])
        if prev.bias is not None:
            prev.bias.data.div_(scales)
    else:  # RMSNorm: its gain
        prev.weight.data.div_(scales)
    for linear in linears:
        linear.weight.data.mul_(scales[None, :])


@dataclass
class ScaleGroup:
    """Linears fed by one op, their inputs per batch, and the block whose output scores a scale."""

    name: str
    prev: Any  # None: no op to fold a scale into (o_proj under GQA); the linears are only clipped
    linears: dict[str, Any]  # every consumer of prev's output (all are rescaled)
    quantized: list[str]  # those being quantized (exclude patterns may keep some in fp32)
    inputs: list[Any]
    # (input batch, batch index) -> output; None when the block is the group's single linear: its
    # output error is then exact from the inputs' Gram matrix over every token, at no forward cost.
    block: Callable[[Any, int], Any] | None
    gram: Any = None  # X^T X / tokens of the inputs (after folding: of the scaled inputs)


def gram_matrix(inputs: list[Any]) -> Any:
    """``X^T X / T`` of the inputs' rows: ``mean_t (x_t . d)^2 = d^T G d`` for any ``d``."""
    import torch

    # Accumulated in float32 on the inputs' device whatever their dtype.
    gram = torch.zeros(inputs[0].shape[-1], inputs[0].shape[-1], device=inputs[0].device)
    count = 0
    for x in inputs:
        rows = x.reshape(-1, x.shape[-1]).float()
        gram.addmm_(rows.T, rows)
        count += rows.shape[0]
    return gram / count


def linear_error(delta: Any, gram: Any) -> float:
    """``mean_t ||delta x_t||^2``: the squared output error of a linear whose weight moves by ``delta``."""
    return float(((delta @ gram) * delta).sum())


def activation_scale(inputs: list[Any]) -> Any:
    """Mean |x| per input channel over every calibration token."""
    import torch

    total = torch.zeros(inputs[0].shape[-1], device=inputs[0].device)  # float32 whatever x's dtype
    count = 0
    for x in inputs:
        rows = x.reshape(-1, x.shape[-1]).float()
        total += rows.abs().sum(0)
        count += rows.shape[0]
    return total / count


def candidate_scales(x_mean: Any, ratio: float) -> Any:
    scales = x_mean.pow(ratio).clamp(min=1e-4)
    return scales / (scales.max() * scales.min()).sqrt()


def search_scale(
    group: ScaleGroup, grid: int, group_size: int, symmetric: bool, batches: int, objective: str = "block"
) -> tuple[Any, float]:
    """The best ``s`` of the grid and its exponent (weights are left as they were)."""
    x_mean = activation_scale(group.inputs)
    originals = {name: group.linears[name].weight.data.clone() for name in group.quantized}
    losses = []
    if group.block is None or objective == Objective.linear:
        gram = group.gram if group.gram is not None else gram_matrix(group.inputs)
        for step in range(grid):
            scales = candidate_scales(x_mean, step / grid)
            losses.append(
                sum(
                    linear_error(fake_quantize(w * scales, group_size, symmetric) / scales - w, gram)
                    for w in originals.values()
                )
            )
    else:
        search = range(min(batches, len(group.inputs)))
        reference = [group.block(group.inputs[b], b) for b in search]
        try:
            for step in range(grid):
                scales = candidate_scales(x_mean, step / grid)
                for name, weight in originals.items():
                    quantized = fake_quantize(weight * scales[None, :], group_size, symmetric)
                    group.linears[name].weight.data.copy_(quantized / scales[None, :])
                losses.append(
                    sum(
                        float((group.block(group.inputs[b], b) - reference[i]).float().pow(2).mean())
                        for i, b in enumerate(search)
                    )
                )
        finally:
            for name, weight in originals.items():
                group.linears[name].weight.data.copy_(weight)
    best = min(range(grid), key=losses.__getitem__)
    return candidate_scales(x_mean, best / grid), best / grid


def search_clip(weight: Any, gram: Any, group_size: int, symmetric: bool, chunk: int = 4096) -> Any:
    """Per (output row, group) the clipping bound of |w|, ``max|w| * (1 - i/20)`` for ``i`` in
    ``0..9`` (llm-awq), minimising the group's partial-output MSE; exact over every calibration
    token through the diagonal blocks of the inputs' Gram matrix ``gram``."""
    import torch

    out_features, in_features = weight.shape
    groups = in_features // group_size
    blocks = torch.stack(
        [
            gram[g * group_size : (g + 1) * group_size, g * group_size : (g + 1) * group_size]
            for g in range(groups)
        ]
    )  # [G, gs, gs]
    best_max = torch.empty(out_features, groups, device=weight.device)
    for start in range(0, out_features, chunk):
        w = weight[start : start + chunk].float().reshape(-1, groups, group_size)  # [oc, G, gs]
        org_max = w.abs().amax(-1)  # [oc, G]
        chunk_best, chunk_err = org_max.clone(), torch.full_like(org_max, float("inf"))
        for step in range(int(CLIP_MAX_SHRINK * CLIP_GRID)):
            bound = org_max * (1 - step / CLIP_GRID)
            clipped = torch.maximum(torch.minimum(w, bound[..., None]), -bound[..., None])
            scales, zeros = range_params(clipped.amin(-1), clipped.amax(-1), symmetric)
            flat = clipped.reshape(clipped.shape[0], -1)
            q = dequantize(quantize_codes(flat, scales, zeros, group_size), scales, zeros, group_size)
            delta = (q.reshape(w.shape) - w).permute(1, 0, 2)  # [G, oc, gs]
            err = (torch.bmm(delta, blocks) * delta).sum(-1).T  # [oc, G]
            better = err < chunk_err
            chunk_err = torch.where(better, err, chunk_err)
            chunk_best = torch.where(better, bound, chunk_best)
        best_max[start : start + chunk] = chunk_best
    return best_max


def apply_clip(weight: Any, bound: Any, group_size: int) -> None:
    grouped = weight.data.view(weight.shape[0], -1, group_size)
    grouped.copy_(grouped.clamp(-bound[..., None], bound[..., None]))


def layer_groups(layer: Any, inputs: LayerInputs) -> tuple[list[ScaleGroup], list[Any]]:
    """The scale groups of a Llama decoder layer with their inputs, and the layer's fp32 outputs."""
    attn, mlp = layer.self_attn, layer.mlp
    probes = {"qkv": attn.q_proj, "o": attn.o_proj, "gate_up": mlp.gate_proj, "down": mlp.down_proj}
    feats: dict[str, list[Any]] = {name: [] for name in probes}
    with input_hooks(probes, lambda name, x: feats[name].append(x)):
        outputs = run_layer(layer, inputs)
    kwargs = inputs.kwargs
    # v's output channels are o's input channels only without GQA (llm-awq's condition).
    v_feeds_o = attn.v_proj.weight.shape == attn.o_proj.weight.shape
    qkv = {f"self_attn.{n}": getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")}
    gate_up = {"mlp.gate_proj": mlp.gate_proj, "mlp.up_proj": mlp.up_proj}
    groups = [
        ScaleGroup("qkv", layer.input_layernorm, qkv, [], feats["qkv"], lambda x, b: attn(x, **kwargs[b])[0]),
        ScaleGroup(
            "o",
            attn.v_proj if v_feeds_o else None,
            {"self_attn.o_proj": attn.o_proj},
            [],
            feats["o"],
            None,
        ),
        ScaleGroup(
            "gate_up", layer.post_attention_layernorm, gate_up, [], feats["gate_up"], lambda x, _b: mlp(x)
        ),
        ScaleGroup(
            "down",
            mlp.up_proj,
            {"mlp.down_proj": mlp.down_proj},
            [],
            feats["down"],
            lambda x, _b: mlp.down_proj(x),
        ),
    ]
    return groups, outputs


class AwqPass(TorchInt4Pass):
    Config = AwqConfig
    name = "awq"
    version = 2  # 2: streamed, the output written in shards (same tensors)
    algorithm = "awq"

    def _search_batches(self, total: int) -> int:
        samples = self.config.search_samples
        return total if samples == 0 else -(-samples // CALIBRATION_BATCH)

    def quantize_block(
        self, prefix: str, layer: Any, inputs: LayerInputs, wanted: set[str]
    ) -> dict[str, QuantizedLinear]:
        groups, outputs = layer_groups(layer, inputs)
        for group in groups:
            group.quantized = [n for n in group.linears if prefix + n in wanted]
        results = self._scale_clip_quantize(prefix, groups, self._search_batches(len(inputs.hidden)))
        inputs.hidden = outputs  # the fp32 layer's outputs feed the next layer
        return results

    def quantize_head(self, norm: Any, head: Any, hidden: list[Any]) -> dict[str, QuantizedLinear]:
        final = [norm(h) for h in hidden]
        group = ScaleGroup("lm_head", norm, {LM_HEAD: head}, [LM_HEAD], final, None)
        return self._scale_clip_quantize("", [group], 1)

    def _scale_clip_quantize(
        self, prefix: str, groups: list[ScaleGroup], batches: int
    ) -> dict[str, QuantizedLinear]:
        cfg = self.config
        dataset = cfg.calibration.dataset
        for group in groups:
            for x in group.inputs:
                check_finite(x, "input activations", prefix + next(iter(group.linears)), dataset)
        clipped = {n for g in groups for n in g.quantized if cfg.clip and not n.endswith(NO_CLIP)}
        for group in groups:
            if group.block is None or cfg.objective == Objective.linear or clipped & set(group.quantized):
                group.gram = gram_matrix(group.inputs)
                check_finite(group.gram, "input Gram matrix", prefix + next(iter(group.linears)), dataset)
        chosen = {}
        for group in groups:  # all searches on the unscaled layer, then all folds (llm-awq)
            if group.quantized and group.prev is not None:
                chosen[group.name] = search_scale(
                    group, cfg.grid, cfg.group_size, cfg.symmetric, batches, cfg.objective
                )
        for group in groups:
            if group.name in chosen:
                scales = chosen[group.name][0]
                fold_scales(group.prev, list(group.linears.values()), scales)
                if group.gram is not None:  # the inputs are now x / s
                    group.gram = group.gram / (scales[:, None] * scales[None, :])
        results = {}
        for group in groups:
            for name in group.quantized:
                linear = group.linears[name]
                if name in clipped:
                    bound = search_clip(linear.weight.data, group.gram, cfg.group_size, cfg.symmetric)
                    apply_clip(linear.weight, bound, cfg.group_size)
                quantized = quantize_rtn(linear.weight.data, cfg.group_size, cfg.symmetric)
                linear.weight.data.copy_(quantized.dequantize())
                results[prefix + name] = quantized
        log.debug("%s scale exponents %s", prefix or "lm_head", {k: v[1] for k, v in chosen.items()})
        return results


class Int4AwqRecipe(Int4Recipe):
    Config = Int4AwqConfig
    name = "int4_awq"
    torch_pass = AwqPass
