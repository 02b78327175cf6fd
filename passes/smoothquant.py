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

``run`` checks that the smoothed checkpoint, reloaded from disk, computes the same logits as the
input on a calibration window (``parity_tolerance``); ``ensures`` checks the recorded statistics.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from calibration.datasets import CalibrationConfig, as_calibration, token_windows
from passes.selection import check_patterns, matches
from pipeline.artifacts import Artifact, Kind, write_json, write_metadata
from pipeline.base import Pass
from pipeline.errors import CalibrationError, PassError

log = logging.getLogger(__name__)

EXTRAS_DIR = "extras"  # == passes.export.EXTRAS_DIR: export copies it into the graph artifact
INT8_DIR = "int8"
ACTIVATIONS_FILE = "activations.json"
FORMAT_VERSION = 1
MIN_SCALE = 1e-5  # the reference implementation's clamp of weight maxima and smoothing scales


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

    def __post_init__(self) -> None:
        self.calibration = as_calibration(self.calibration)


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
    if config.batch_size < 1:
        raise PassError(f"{where}.batch_size={config.batch_size}: must be at least 1")


# --------------------------------------------------------------------------------------------
# Statistics


def linear_modules(model: Any) -> dict[str, Any]:
    """Every ``nn.Linear`` of the model by module name (decoder projections and ``lm_head``)."""
    import torch

    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def collect_channel_absmax(
    model: Any, windows: np.ndarray, batch_size: int = 8, modules: dict[str, Any] | None = None
) -> tuple[dict[str, Any], int]:
    """Per input channel ``max|X_j|`` of every linear layer over ``windows`` [n, seq]; also the token
    count. Raises CalibrationError on NaN/inf."""
    import torch
    from tqdm.auto import tqdm

    modules = linear_modules(model) if modules is None else modules
    stats: dict[str, Any] = {}

    def hook(name: str) -> Any:
        def record(_module: Any, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            current = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
            # torch.maximum propagates NaN, so a NaN/inf in any batch stays visible to the check below.
            stats[name] = current if name not in stats else torch.maximum(stats[name], current)

        return record

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


def smoothing_groups(model: Any, smooth_o_proj: bool, smooth_down_proj: bool) -> list[SmoothGroup]:
    groups = []
    for index, _layer in enumerate(model.model.layers):
        p = f"model.layers.{index}"
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        groups.append(
            SmoothGroup(f"{p}.qkv", "norm", f"{p}.input_layernorm", [f"{attn}.{x}_proj" for x in "qkv"])
        )
        if smooth_o_proj:
            groups.append(SmoothGroup(f"{p}.o", "v", f"{attn}.v_proj", [f"{attn}.o_proj"]))
        groups.append(
            SmoothGroup(
                f"{p}.gate_up",
                "norm",
                f"{p}.post_attention_layernorm",
                [f"{mlp}.gate_proj", f"{mlp}.up_proj"],
            )
        )
        if smooth_down_proj:
            groups.append(SmoothGroup(f"{p}.down", "up", f"{mlp}.up_proj", [f"{mlp}.down_proj"]))
    return groups


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
    import torch

    modules = dict(model.named_modules())
    hf = model.config
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    divided: dict[str, Any] = {}
    done: list[str] = []
    groups = smoothing_groups(model, config.smooth_o_proj, config.smooth_down_proj)
    with torch.no_grad():
        for group in groups:
            if all(matches(c, config.exclude + config.weight_only) for c in group.consumers):
                continue
            consumers = [modules[c] for c in group.consumers]
            weights = [m.weight for m in consumers]
            act = stats[group.consumers[0]]
            alpha = (alphas or {}).get(group.name, config.alpha)
            if group.kind == "v":  # one scale per KV channel, shared by its query heads
                w_max = torch.stack([_kv_shared(w.abs().amax(dim=0), kv_heads, head_dim) for w in weights])
                w_max = w_max.amax(dim=0).clamp(min=MIN_SCALE)
                a = _kv_shared(act, kv_heads, head_dim).clamp(min=MIN_SCALE)
                s_kv = (a.pow(alpha) / w_max.pow(1.0 - alpha)).clamp(min=MIN_SCALE)
                scale = _kv_expand(s_kv, heads, kv_heads, head_dim)
                producer_scale = s_kv
            else:
                scale = smoothing_scales(act, weights, alpha)
                producer_scale = scale
            producer = modules[group.producer]
            if group.kind == "norm":
                producer.weight.div_(producer_scale)
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


def _weights_tied(model: Any) -> bool:
    head = getattr(model, "lm_head", None)
    embed = model.get_input_embeddings()
    return head is not None and head.weight.data_ptr() == embed.weight.data_ptr()


# --------------------------------------------------------------------------------------------
# The pass


class SmoothQuantPass(Pass):
    """Torch -> torch: the smoothed checkpoint plus ``extras/int8/activations.json``."""

    Config = SmoothQuantConfig
    name = "smoothquant"
    version = 1
    consumes = Kind.TORCH
    produces = Kind.TORCH

    def requires(self, source: Artifact) -> None:
        validate(self.config)
        hf = json.loads((source.path / "config.json").read_text())
        if hf.get("model_type") != "llama":
            raise PassError(
                f"smoothquant: model_type is {hf.get('model_type')!r}; quant=int8 smooths Llama models only"
            )

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        import torch

        from pipeline.torch_model import copy_beside_weights, load_causal_lm, load_tokenizer

        config = self.config
        validate(config)
        model = load_causal_lm(source.path)
        modules = linear_modules(model)
        check_patterns(list(modules), config.exclude)
        check_patterns(list(modules), config.weight_only, "quant.weight_only")
        tied = _weights_tied(model)
        windows = token_windows(load_tokenizer(source.path), config.calibration)
        probe = torch.from_numpy(np.ascontiguousarray(windows[:1, : min(64, windows.shape[1])]))
        with torch.inference_mode():
            reference = model(input_ids=probe, use_cache=False).logits.float()
        log.info(
            "smoothquant: calibrating on %d windows x %d tokens", len(windows), config.calibration.seq_len
        )
        stats, tokens = collect_channel_absmax(model, windows, config.batch_size, modules)
        divided, groups = smooth_model(model, stats, config) if config.smooth else ({}, [])
        if tied and not _weights_tied(model):
            raise PassError("smoothquant: smoothing untied lm_head from embed_tokens (a bug)")
        ranges = activation_ranges(stats, divided)
        log.info("smoothquant: alpha=%.2f, %d groups smoothed", config.alpha, len(groups))

        copy_beside_weights(source.path, out_dir)
        model.save_pretrained(out_dir)
        info = {
            "algorithm": "smoothquant",
            "alpha": config.alpha,
            "smooth": config.smooth,
            "groups": groups,
            "calibration": {**asdict(config.calibration), "tokens": tokens},
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

        reloaded = load_causal_lm(out_dir)
        with torch.inference_mode():
            logits = reloaded(input_ids=probe, use_cache=False).logits.float()
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
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT_VERSION:
        raise PassError(f"{path}: unsupported format {data.get('format')}; rebuild with quant=int8")
    return data
