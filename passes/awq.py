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
   paper's Eq. 4, over every calibration token without a forward per candidate:
   ``mean_t ||dW x_t||^2 = ||dW Z^T||^2`` for any ``Z`` with ``Z^T Z = X^T X / T``. ``Z`` has at
   most ``sketch_rows`` rows, so a candidate costs ``out x in x sketch_rows`` at most, linear in
   the weight's size: the inputs' Gram matrix (exact) when they are at most that wide, the tokens
   themselves (exact) when there are at most that many, and otherwise a CountSketch of every
   token (Charikar, Chen, Farach-Colton, "Finding frequent items in data streams", ICALP 2002;
   for Gram matrices, Clarkson & Woodruff, STOC 2013): each token is added, with a random sign,
   to one of ``sketch_rows`` rows, so ``Z^T Z`` is an unbiased estimate of ``X^T X / T``, and
   every candidate is scored on the same sketch. ``objective=block`` scores
   the output of the block they sit in (attention, MLP), as ``llm-awq`` does, with a forward per
   candidate on ``search_samples`` windows (several times slower on a 2-core CPU). ``alpha = 0``
   is plain round-to-nearest, so the search never does worse than it on the data it scores.
2. Fold: the producing op's weight (RMSNorm gain, or the linear's output rows) is divided by ``s``
   and the consumers' input columns multiplied by it; the fp32 function is unchanged.
3. Clip search: per output row and group, the weight range is shrunk (1.0 down to 0.55 of max|w|)
   to minimise the group's partial-output error (not for q/k, as in ``llm-awq``), exact over
   every token through the diagonal ``group_size``-square blocks of the Gram matrix (``llm-awq``
   samples 512 tokens), accumulated on their own (``tokens x in x group_size``: linear in width).
4. Round-to-nearest on the scaled, clipped weights (``passes.int4``).

The next layer is calibrated on the fp32 layer's outputs (``llm-awq``'s ``run_awq``). ``lm_head``
(untied from the embedding) gets the same treatment with the final RMSNorm as its producer.

Data parallel (``quant.calibration.num_processes``, linear objective): every statistic above is a
sum over tokens (activation means, the Gram matrix or its sketch, the clip blocks), so each rank
sums its run of the batches and the ranks add them up; a rank draws the sketch's buckets where one
process would draw them for those tokens. The block objective scores candidates by forwards over
the first windows, which one rank holds: it runs in one process.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from passes.formats.int4 import (
    QuantizedLinear,
    dequantize,
    fake_quantize_rtn,
    quantize_codes,
    quantize_rtn,
    range_params,
)
from passes.int4 import (
    CALIBRATION_BATCH,
    LayerInputs,
    TorchInt4Config,
    TorchInt4Pass,
    check_finite,
    input_hooks,
    run_layer,
)
from pipeline.core.config import MAX_REPEATS, MAX_SAMPLES, check_int
from pipeline.core.distributed import Group
from pipeline.core.families import Family, Smoothing, divide_gain
from pipeline.core.torch_model import LM_HEAD

log = logging.getLogger(__name__)

CLIP_MAX_SHRINK = 0.5
CLIP_GRID = 20
SKETCH_SEED = 0


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
    # objective=linear: rows of the inputs' error sketch (see the module docstring); bounds a
    # candidate's cost at out x in x sketch_rows. 0: always the exact Gram matrix (out x in^2,
    # which grows with the width: minutes a layer at 3B on a CPU).
    sketch_rows: int = 1024
    # Weight-range clipping search after scaling (the paper's auto_clip).
    clip: bool = True

    def validate(self) -> None:
        super().validate()
        validate_awq(self)


MAX_SKETCH_ROWS = 1 << 16  # rows of the error sketch: past the exact Gram matrix of any width


def validate_awq(config: Any) -> None:
    config.objective = Objective(config.objective)
    check_int("quant.grid", config.grid, 1, MAX_REPEATS)  # candidate scales
    check_int("quant.search_samples", config.search_samples, 0, MAX_SAMPLES)  # 0: all windows
    check_int("quant.sketch_rows", config.sketch_rows, 0, MAX_SKETCH_ROWS)  # 0: the exact Gram matrix


def fold_scales(prev: Any, linears: list[Any], scales: Any, norm_offset: float = 0.0) -> None:
    """Divide ``prev``'s output channels by ``scales`` and multiply the consumers' input columns
    by them: ``W diag(s) (x / s) = W x``, so the model's function is unchanged. ``norm_offset``:
    what the family's RMSNorm adds to its weight (Gemma: 1)."""
    if hasattr(prev, "out_features"):  # a linear: its output rows
        prev.weight.data.div_(scales[:, None])
        if prev.bias is not None:
            prev.bias.data.div_(scales)
    else:  # RMSNorm: its gain
        divide_gain(prev.weight.data, scales, norm_offset)
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
    # output error then comes from the inputs' statistics, at no forward cost.
    block: Callable[[Any, int], Any] | None
    stats: InputStats | None = None  # of the inputs (after folding: of the scaled inputs)


class ErrorForm(enum.StrEnum):
    """How :class:`InputStats` holds ``X^T X / T`` for the linear objective."""

    gram = "gram"  # the Gram matrix itself: exact, out x in^2 a candidate
    tokens = "tokens"  # the tokens as rows (at most sketch_rows of them): exact
    sketch = "sketch"  # a CountSketch of every token to sketch_rows rows: unbiased


@dataclass
class InputStats:
    """What the scale and clip searches need of a group's inputs ``X`` (``T`` tokens x ``in``),
    in float32 whatever the inputs' dtype, in memory linear in ``in`` except for ``gram``
    (``in <= sketch_rows``)."""

    form: ErrorForm | None  # None: no error estimate (the group is only clipped)
    gram: Any = None  # [in, in] X^T X / T (form gram)
    rows: Any = None  # [r, in], rows^T rows = X^T X / T exactly (tokens) or in expectation (sketch)
    clip_blocks: Any = None  # [in / group_size, group_size, group_size]: diagonal blocks of X^T X / T

    def error(self, delta: Any, chunk: int = 4096) -> float:
        """``mean_t ||delta x_t||^2``: the squared output error of a linear whose weight moves by
        ``delta``, over ``chunk`` output rows at a time (bounded memory for a vocabulary-wide head)."""
        total = 0.0
        for start in range(0, delta.shape[0], chunk):
            part = delta[start : start + chunk]
            if self.form == ErrorForm.gram:
                total += float(((part @ self.gram) * part).sum())
            else:
                total += float((part @ self.rows.T).pow(2).sum())
        return total

    def rescaled(self, scales: Any) -> InputStats:
        """The statistics of the inputs ``x / scales`` (after the scales are folded)."""
        gram = None if self.gram is None else self.gram / (scales[:, None] * scales[None, :])
        rows = None if self.rows is None else self.rows / scales[None, :]
        blocks = self.clip_blocks
        if blocks is not None:
            grouped = scales.view(blocks.shape[0], blocks.shape[1])
            blocks = blocks / (grouped[:, :, None] * grouped[:, None, :])
        return InputStats(self.form, gram, rows, blocks)

    def tensors(self) -> list[Any]:
        return [t for t in (self.gram, self.rows, self.clip_blocks) if t is not None]


def error_form(width: int, tokens: int, sketch_rows: int) -> ErrorForm:
    """The cheapest exact form when one costs at most ``sketch_rows`` per weight, else the sketch."""
    if sketch_rows == 0 or width <= min(tokens, sketch_rows):
        return ErrorForm.gram
    return ErrorForm.tokens if tokens <= sketch_rows else ErrorForm.sketch


def input_stats(
    inputs: list[Any],
    sketch_rows: int | None,
    group_size: int | None,
    seed: int = SKETCH_SEED,
    ranks: Group | None = None,
) -> InputStats:
    """One pass over the input batches: the error estimate (``sketch_rows`` None: none) and the
    clip search's diagonal Gram blocks (``group_size`` None: none). The sketch's buckets and signs
    come from a CPU generator seeded with ``seed``, so a run is repeatable on any device.

    Split over ``ranks`` (each holding a contiguous run of one process's batches), every rank
    adds its batches into the statistics of all tokens (its rows of ``tokens``, its buckets of the
    sketch after replaying the draws of the batches before its own) and the ranks sum them: the
    result is one process's, up to the order of float sums."""
    import torch

    ranks = ranks or Group()
    width, device = inputs[0].shape[-1], inputs[0].device
    every = ranks.gather([x.numel() // width for x in inputs])  # token counts of each rank's batches
    before = [count for rank in range(ranks.rank) for count in every[rank]]
    tokens = sum(sum(counts) for counts in every)
    form = None if sketch_rows is None else error_form(width, tokens, sketch_rows)
    gram = torch.zeros(width, width, device=device) if form == ErrorForm.gram else None
    rows = None
    if form in (ErrorForm.tokens, ErrorForm.sketch):
        rows = torch.zeros(min(tokens, sketch_rows), width, device=device)  # sketch_rows > 0 here
    blocks = None
    if group_size:
        blocks = torch.zeros(width // group_size, group_size, group_size, device=device)
    generator = torch.Generator().manual_seed(seed)
    if form == ErrorForm.sketch:
        for count in before:  # the draws of the batches other ranks hold, in one process's order
            torch.randint(rows.shape[0], (count,), generator=generator)
            torch.randint(2, (count,), generator=generator)
    filled = sum(before)
    for x in inputs:
        flat = x.reshape(-1, width).float()
        count = flat.shape[0]
        if gram is not None:
            gram.addmm_(flat.T, flat)
        elif form == ErrorForm.tokens:
            rows[filled : filled + count] = flat
        elif form == ErrorForm.sketch:
            bucket = torch.randint(rows.shape[0], (count,), generator=generator).to(device)
            sign = (torch.randint(2, (count,), generator=generator) * 2 - 1).to(device, torch.float32)
            rows.index_add_(0, bucket, flat * sign[:, None])
        if blocks is not None:
            grouped = flat.reshape(count, -1, group_size).transpose(0, 1)  # [G, count, gs]
            blocks.baddbmm_(grouped.transpose(1, 2), grouped)
        filled += count
    for total in (gram, rows, blocks):
        if total is not None:
            ranks.sum(total)
    return InputStats(
        form,
        None if gram is None else gram / tokens,
        None if rows is None else rows / tokens**0.5,
        None if blocks is None else blocks / tokens,
    )


def activation_scale(inputs: list[Any], ranks: Group | None = None) -> Any:
    """Mean |x| per input channel over every calibration token (of every rank)."""
    import torch

    ranks = ranks or Group()
    total = torch.zeros(inputs[0].shape[-1], device=inputs[0].device)  # float32 whatever x's dtype
    count = 0
    for x in inputs:
        rows = x.reshape(-1, x.shape[-1]).float()
        total += rows.abs().sum(0)
        count += rows.shape[0]
    tokens = ranks.sum(torch.tensor([count], dtype=torch.float64))
    return ranks.sum(total) / float(tokens[0])


def candidate_scales(x_mean: Any, ratio: float) -> Any:
    scales = x_mean.pow(ratio).clamp(min=1e-4)
    return scales / (scales.max() * scales.min()).sqrt()


def search_scale(
    group: ScaleGroup,
    grid: int,
    group_size: int,
    symmetric: bool,
    batches: int,
    objective: str = "block",
    ranks: Group | None = None,
) -> tuple[Any, float]:
    """The best ``s`` of the grid and its exponent (weights are left as they were). Over several
    ``ranks`` only the linear objective runs (its statistics are reduced across them)."""
    x_mean = activation_scale(group.inputs, ranks)
    originals = {name: group.linears[name].weight.data.clone() for name in group.quantized}
    losses = []
    if group.block is None or objective == Objective.linear:
        stats = (
            group.stats
            if group.stats is not None and group.stats.form
            else input_stats(group.inputs, 0, None, ranks=ranks)
        )
        for step in range(grid):
            scales = candidate_scales(x_mean, step / grid)
            losses.append(
                sum(
                    stats.error(fake_quantize_rtn(w * scales, group_size, symmetric) / scales - w)
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
                    quantized = fake_quantize_rtn(weight * scales[None, :], group_size, symmetric)
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


def search_clip(weight: Any, blocks: Any, group_size: int, symmetric: bool, chunk: int = 4096) -> Any:
    """Per (output row, group) the clipping bound of |w|, ``max|w| * (1 - i/20)`` for ``i`` in
    ``0..9`` (llm-awq), minimising the group's partial-output MSE; exact over every calibration
    token through ``blocks`` ``[G, gs, gs]``, the diagonal blocks of the inputs' Gram matrix."""
    import torch

    out_features, in_features = weight.shape
    groups = in_features // group_size
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


def layer_groups(family: Family, layer: Any, inputs: LayerInputs) -> tuple[list[ScaleGroup], list[Any]]:
    """The scale groups of a decoder layer, from its family's smoothing mapping
    (:mod:`pipeline.core.families`), with their inputs, and the layer's fp32 outputs. A group is
    scored on its block (the attention, called with the layer's arguments; the MLP; or its one
    linear); a "v" group (v -> o) folds into v only where v's output channels are o's input
    channels, that is without GQA (llm-awq's condition); otherwise o is only clipped."""
    probes = {g.name: layer.get_submodule(g.consumers[0]) for g in family.smoothing}
    feats: dict[str, list[Any]] = {name: [] for name in probes}
    with input_hooks(probes, lambda name, x: feats[name].append(x)):
        outputs = run_layer(layer, inputs)
    groups = []
    for g in family.smoothing:
        prev = layer.get_submodule(g.producer)
        linears = {name: layer.get_submodule(name) for name in g.consumers}
        if g.kind == "v" and prev.weight.shape != linears[g.consumers[0]].weight.shape:
            prev = None
        score = _scorer(family, layer, g, inputs)
        groups.append(ScaleGroup(g.name, prev, linears, [], feats[g.name], score))
    return groups, outputs


def _scorer(
    family: Family, layer: Any, group: Smoothing, inputs: LayerInputs
) -> Callable[[Any, int], Any] | None:
    """What scores a scale of ``group``: its block's output for an input batch (and its index)."""
    if group.scored_by is None:
        return None
    block = layer.get_submodule(group.scored_by)
    if group.scored_by == family.attention:  # the attention takes the layer's position arguments
        kwargs = inputs.kwargs
        return lambda x, b: block(x, **kwargs[b])[0]
    return lambda x, _b: block(x)


class AwqPass(TorchInt4Pass):
    Config = AwqConfig
    name = "awq"
    # 2: streamed, the output written in shards (same tensors); 3: the linear objective on an
    # error sketch of at most sketch_rows rows, clip blocks accumulated on their own
    version = 3
    algorithm = "awq"

    @property
    def calibrates_in_ranks(self) -> bool:  # type: ignore[override]
        """The linear objective's statistics (activation means, Gram, sketch, clip blocks) are
        sums over tokens, reduced across ranks; the block objective scores candidates on the first
        ``search_samples`` windows by forwards, which one process holds."""
        return self.config.objective == Objective.linear

    def _search_batches(self, total: int) -> int:
        samples = self.config.search_samples
        return total if samples == 0 else -(-samples // CALIBRATION_BATCH)

    def quantize_block(
        self, prefix: str, layer: Any, inputs: LayerInputs, wanted: set[str]
    ) -> dict[str, QuantizedLinear]:
        groups, outputs = layer_groups(self.family, layer, inputs)
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
        # q and k are not clipped: their error is amplified by the attention scores (llm-awq)
        no_clip = (self.family.q, self.family.k)
        clipped = {n for g in groups for n in g.quantized if cfg.clip and not n.endswith(no_clip)}
        for group in groups:
            searched = bool(group.quantized) and group.prev is not None
            scored = searched and (group.block is None or cfg.objective == Objective.linear)
            clips = bool(clipped & set(group.quantized))
            if scored or clips:
                group.stats = input_stats(
                    group.inputs,
                    cfg.sketch_rows if scored else None,
                    cfg.group_size if clips else None,
                    ranks=self.group,
                )
                for tensor in group.stats.tensors():
                    check_finite(tensor, "input statistics", prefix + next(iter(group.linears)), dataset)
        chosen = {}
        for group in groups:  # all searches on the unscaled layer, then all folds (llm-awq)
            if group.quantized and group.prev is not None:
                chosen[group.name] = search_scale(
                    group, cfg.grid, cfg.group_size, cfg.symmetric, batches, cfg.objective, self.group
                )
        for group in groups:
            if group.name in chosen:
                scales = chosen[group.name][0]
                fold_scales(group.prev, list(group.linears.values()), scales, self.family.norm_offset)
                if group.stats is not None:  # the inputs are now x / s
                    group.stats = group.stats.rescaled(scales)
        results = {}
        for group in groups:
            for name in group.quantized:
                linear = group.linears[name]
                if name in clipped:
                    bound = search_clip(
                        linear.weight.data, group.stats.clip_blocks, cfg.group_size, cfg.symmetric
                    )
                    apply_clip(linear.weight, bound, cfg.group_size)
                quantized = quantize_rtn(linear.weight.data, cfg.group_size, cfg.symmetric)
                linear.weight.data.copy_(quantized.dequantize())
                results[prefix + name] = quantized
        log.debug("%s scale exponents %s", prefix or "lm_head", {k: v[1] for k, v in chosen.items()})
        return results
