"""Per-layer quantization sensitivity and ``quant.fallback=auto`` (torch -> torch).

The scan runs in a recipe when ``quant.fallback=auto`` reads its ranking, or for the record with
``quant.sensitivity.enabled=true`` (``scans``); it costs about five forwards of the model.

For every linear layer a recipe would quantize, the KL divergence of the next-token distribution
from the fp32 model's when only that layer is quantized (``calibration/sensitivity.py``; the
layer-wise scan of mixed-precision work such as HAWQ, Dong et al. 2019, arXiv:1905.03696).
``quant.sensitivity.method`` says how it is obtained:

- ``fisher`` (default): its second-order (Fisher) estimate from one forward and
  ``quant.sensitivity.fisher_samples`` backwards per batch of windows (labels sampled from the
  fp32 model): linear in depth, the way NVIDIA ModelOpt's AutoQuantize scores layers by gradients;
- ``exact``: the KL itself, the forward restarted at each layer's block: quadratic in depth
  (about a minute on the 135M default model, ~18 minutes at 360M), for small models.

``benchmarks/sensitivity.py`` compares the two on the default model. The quantization is
simulated in torch with the recipe's own formats:

- ``int4`` (AWQ/GPTQ recipes): group-wise round-to-nearest of the weights (``passes/int4.py``),
  the baseline the algorithms improve on: it ranks layers, the algorithms then lower every KL;
- ``int8``: per-channel symmetric INT8 weights and, except ``weight_only`` layers, static
  per-tensor INT8 activations with the SmoothQuant pass's calibrated ranges (it runs after it);
- ``fp8``: per-channel E4M3 weights and static per-tensor E4M3 activations (minmax range).

With ``quant.fallback=auto`` the fewest most sensitive layers are kept in higher precision until
the KL with all other layers quantized together is within ``quant.kl_budget`` (same windows);
they are written to ``extras/sensitivity/fallback.json``, which every quantization pass of the
recipe adds to ``quant.exclude`` (``passes/selection.py``). The fallback search always measures
the exact KL of a few prefixes of the ranking (~2 log2(k) forwards), whichever method ranked. The
scan and its method go to the run record (this pass's metrics) and
``extras/sensitivity/sensitivity.json``. The weights pass through unchanged (hard links where the
filesystem allows).

It computes on ``pipeline.device`` in ``pipeline.torch_dtype``; log-probabilities, KL and Fisher
scores are accumulated in float32 (float64 sums) whatever the compute dtype.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from calibration.datasets import CalibrationConfig, check_context
from calibration.sensitivity import FallbackResult, LayerQuantizer, SensitivityProbe
from calibration.workload import CalibratesOnWindows
from passes.selection import FALLBACK_FILE, select_modules
from pipeline.core.artifacts import ARTIFACT_FILE, Artifact, Kind, link_tree, write_json, write_metadata
from pipeline.core.base import Pass, Workload
from pipeline.core.config import MAX_BATCH, MAX_REPEATS, MAX_TOKENS, check_int
from pipeline.core.errors import CalibrationError, ConfigError
from pipeline.core.planned_model import PlannedModel
from pipeline.core.shapes import ModelShapes

log = logging.getLogger(__name__)

SCAN_FILE = "extras/sensitivity/sensitivity.json"
TOP_IN_RECORD = 10  # the most sensitive layers named in the pass metrics' summary


class Fallback(enum.StrEnum):
    none = "none"  # record the scan only
    auto = "auto"  # keep the most sensitive layers in higher precision until kl_budget is met


class Method(enum.StrEnum):
    fisher = "fisher"  # second-order estimate: a few forward+backward passes, linear in depth
    exact = "exact"  # the KL of each layer quantized alone: quadratic in depth


METHODS = ", ".join(m.value for m in Method)


class WeightFormat(enum.StrEnum):
    int4 = "int4"
    int8 = "int8"
    fp8 = "fp8"


@dataclass
class SensitivityConfig:
    """``quant.sensitivity``: whether the scan runs, its windows (drawn from the calibration text
    with its seed) and how each layer's KL is obtained (``method``: fisher | exact).

    Defaults sized for 2 CPU cores: on the default model (211 layers) 2 x 128 tokens take about
    a minute with ``exact``, seconds with ``fisher``."""

    # null (the default): scan when quant.fallback=auto uses the ranking, not for the record alone.
    # The Fisher scan is about five forwards of the model: 20-28 % of an int8 or fp8 build of the
    # 1.1B shape on 2 cores (benchmarks/scaling.py), a cost a nightly build should not pay for a
    # ranking nothing reads. true: scan for the record anyway; false: never.
    enabled: bool | None = None
    num_samples: int = 2
    seq_len: int = 128
    # A string, not the enum: a bad value is then our one-line ConfigError, not a Hydra trace.
    method: str = Method.fisher.value
    fisher_samples: int = 4  # labels sampled from the fp32 model per window (one backward each)


@dataclass
class FallbackSettings:
    """The knobs every quant recipe shares: ``quant.sensitivity.*`` and ``quant.fallback=auto``."""

    sensitivity: SensitivityConfig = field(default_factory=SensitivityConfig)
    fallback: Fallback = Fallback.none
    # Mean next-token KL (nats) vs fp32 on the scan windows, all non-kept layers quantized.
    kl_budget: float = 0.02
    # At most this many layers kept in higher precision; past it the run records budget_met=false.
    max_fallback_layers: int = 16

    def validate(self) -> None:
        validate_fallback(self)


def scans(config: Any) -> bool:
    """Whether a recipe's flat config runs the scan: ``quant.sensitivity.enabled``, or when it is
    null, whether ``quant.fallback=auto`` needs the ranking."""
    enabled = config.sensitivity.enabled
    return Fallback(config.fallback) == Fallback.auto if enabled is None else bool(enabled)


MAX_FALLBACK_LAYERS = 100_000  # more linears than any model has


def validate_fallback(config: Any) -> None:
    """One-line ConfigErrors for the shared knobs (Recipe.passes() calls it before anything runs)."""
    sensitivity = config.sensitivity
    if sensitivity.num_samples < 1:
        raise ConfigError(f"quant.sensitivity.num_samples={sensitivity.num_samples}: at least one window")
    if sensitivity.seq_len < 2:
        raise ConfigError(f"quant.sensitivity.seq_len={sensitivity.seq_len}: must be at least 2")
    check_int("quant.sensitivity.num_samples", sensitivity.num_samples, 1, MAX_BATCH)
    check_int("quant.sensitivity.seq_len", sensitivity.seq_len, 2, MAX_TOKENS)  # and the model's context
    if sensitivity.method not in set(Method):
        raise ConfigError(f"quant.sensitivity.method={sensitivity.method}: must be one of {METHODS}")
    if sensitivity.fisher_samples < 1:
        raise ConfigError(
            f"quant.sensitivity.fisher_samples={sensitivity.fisher_samples}: must be at least 1"
        )
    check_int("quant.sensitivity.fisher_samples", sensitivity.fisher_samples, 1, MAX_REPEATS)
    if not (
        isinstance(config.kl_budget, int | float) and math.isfinite(config.kl_budget) and config.kl_budget > 0
    ):
        raise ConfigError(f"quant.kl_budget={config.kl_budget}: must be a positive number (nats)")
    if config.max_fallback_layers < 1:
        raise ConfigError(f"quant.max_fallback_layers={config.max_fallback_layers}: must be at least 1")
    check_int("quant.max_fallback_layers", config.max_fallback_layers, 1, MAX_FALLBACK_LAYERS)
    if Fallback(config.fallback) == Fallback.auto and sensitivity.enabled is False:
        raise ConfigError(
            "quant.fallback=auto needs the sensitivity scan: set quant.sensitivity.enabled=true"
        )


@dataclass
class SensitivityPassConfig:
    _target_: str = "passes.sensitivity.SensitivityPass"
    weight: WeightFormat = WeightFormat.int4
    group_size: int = 128  # int4
    symmetric: bool = False  # int4
    activations: bool = False  # int8/fp8: static per-tensor activation quantization
    weight_only: list[str] = field(default_factory=list)  # int8: layers without activation quantization
    exclude: list[str] = field(default_factory=list)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)  # dataset, seed
    sensitivity: SensitivityConfig = field(default_factory=SensitivityConfig)
    fallback: Fallback = Fallback.none
    kl_budget: float = 0.02
    max_fallback_layers: int = 16

    def validate(self) -> None:
        self.weight, self.fallback = WeightFormat(self.weight), Fallback(self.fallback)


def sensitivity_pass(config: Any, **formats: Any) -> SensitivityPass | None:
    """The scan for a recipe's flat config (``None`` when disabled; validated when the recipe was
    built), quantizing like ``formats``."""
    if not scans(config):
        return None
    calibration = dict(
        vars(config.calibration) if not isinstance(config.calibration, dict) else config.calibration
    )
    calibration["num_processes"] = 1  # the scan is its own short forward: one process
    return SensitivityPass(
        exclude=list(config.exclude),
        calibration=calibration,
        sensitivity=vars(config.sensitivity),
        fallback=Fallback(config.fallback),
        kl_budget=config.kl_budget,
        max_fallback_layers=config.max_fallback_layers,
        **formats,
    )


# --------------------------------------------------------------------------------------------
# The recipes' formats, simulated in torch with the same math as the passes that emit them.


def torch_fake_quant(fmt: Any, x: Any, amax: Any) -> Any:
    """float32 fake quantization of ``x`` with threshold ``amax`` (a tensor that broadcasts), on
    ``x``'s device: bit for bit ``fmt.fake_quant`` (``calibration/observers.py``, the numpy math of
    the graph passes: float32 scale and division, saturation, round half to even: ``torch.round``
    for int8 and torch's float8_e4m3fn cast for fp8). Written again in torch because the numpy
    round trip, ml_dtypes' fp8 cast above all, was a third of the Fisher scan's time on the 360M
    shape; ``tests/passes/test_sensitivity.py`` checks the two agree."""
    import torch

    amax = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    scale = torch.where(amax > 0, amax / torch.tensor(fmt.max_value, dtype=torch.float32), one)
    y = torch.div(x.detach().float(), scale)  # a new tensor: the rest is in place (2-3x faster)
    y.clamp_(-fmt.max_value, fmt.max_value)
    if fmt.name == "int8":
        y.round_().add_(0.0)  # int8 has no -0: "+ 0.0" makes round's -0 the numpy round trip's +0
    else:
        y.copy_(y.to(torch.float8_e4m3fn))
    return y.mul_(scale)


def layer_quantizer(config: SensitivityPassConfig, weight_only: bool, input_absmax: float) -> LayerQuantizer:
    """Weight (and activation) fake quantization of one layer in ``config``'s format."""
    from calibration.observers import FP8_E4M3, INT8
    from passes.formats.int4 import fake_quantize_rtn

    if config.weight == WeightFormat.int4:
        return LayerQuantizer(lambda w: fake_quantize_rtn(w, config.group_size, config.symmetric))
    fmt = INT8 if config.weight == WeightFormat.int8 else FP8_E4M3

    def weight(w: Any) -> Any:  # per output channel: the row's max |w|
        return torch_fake_quant(fmt, w, w.detach().float().abs().amax(dim=1, keepdim=True))

    if not config.activations or weight_only:
        return LayerQuantizer(weight)
    return LayerQuantizer(weight, lambda x: torch_fake_quant(fmt, x, input_absmax))


class SensitivityPass(CalibratesOnWindows, Pass):
    """torch -> torch: the same checkpoint plus the per-layer scan (and the fallback layers)."""

    Config = SensitivityPassConfig
    name = "sensitivity"
    version = 3  # 2: quant.sensitivity.method (fisher by default), placement knobs; 3: one label draw
    consumes = Kind.TORCH
    produces = Kind.TORCH
    placement_knobs = ("device", "torch_dtype")
    loads_module_by_module = True  # StreamedCheckpoint.load_model

    def workload(self) -> Workload | None:
        """The scan's windows (``quant.sensitivity``), not the calibration's."""
        sensitivity = self.config.sensitivity
        return Workload(
            windows=int(sensitivity.num_samples),
            seq_len=int(sensitivity.seq_len),
            knob=f"{self.config_group or self.knob_group}.sensitivity.num_samples",
        )

    def estimate_memory(self, shapes: ModelShapes) -> int | None:
        """The generic whole-model estimate plus what the scan adds to it: the Fisher backward's
        saved activations and every linear's output change (every layer's, for one batch of
        windows, and five logits-sized tensors, the head's change among them), the quantized
        copies the KL probe holds beside the weights (one block's, or the head's), and the
        quantizer's temporaries on one chunk of rows. Measured on the 3B shape: 14.48 GiB for an
        estimate of 15.74 (15.82 before the probe quantized in chunks, when the generic estimate
        said 12.64)."""
        from calibration.sensitivity import FISHER_CHUNK_ELEMENTS
        from pipeline.core.memory import CALIBRATION_BATCH, generic_estimate

        sensitivity = self.config.sensitivity
        tokens = min(sensitivity.num_samples, CALIBRATION_BATCH) * sensitivity.seq_len
        compute = 2 if self.placement.torch_dtype in ("bfloat16", "float16") else 4
        largest = max(shapes.vocab_size, shapes.intermediate_size) * shapes.hidden_size  # one weight
        held = max(shapes.vocab_size * shapes.hidden_size, shapes.block_params)  # the head or a block
        added = held * compute + 4 * min(FISHER_CHUNK_ELEMENTS, largest) * 4
        if sensitivity.method == Method.fisher:
            per_token = 6 * shapes.hidden_size + 4 * shapes.intermediate_size
            # every linear's dy (float32, its output's width), made in the forward for the backwards
            kv_width = shapes.num_kv_heads * shapes.head_dim
            per_token += 3 * shapes.hidden_size + 2 * kv_width + 2 * shapes.intermediate_size
            added += shapes.num_layers * tokens * per_token * 4 + 5 * tokens * shapes.vocab_size * 4
        return generic_estimate(self, shapes).host_bytes + added

    def check_model(self, facts: PlannedModel) -> PlannedModel:
        from passes.formats.int4 import check_group_size

        selected = select_modules(facts.linears, self.config.exclude)
        if self.config.weight == WeightFormat.int4:
            check_group_size(self.config.group_size, {n: facts.linears[n][0] for n in selected})
        check_context(self.config.sensitivity, facts, f"{self.config_group or 'quant'}.sensitivity")
        return facts

    def probe(
        self, folder: Path, calibrated_ranges: bool = True
    ) -> tuple[SensitivityProbe, dict[str, LayerQuantizer]]:
        """The checkpoint in ``folder`` on this pass's placement with its fp32 reference on the scan
        windows, and the fake quantizer of every candidate layer. ``calibrated_ranges=False``: int8
        activations use the windows' own minmax ranges, not the SmoothQuant pass's (which ``folder``
        then need not hold; ``benchmarks/sensitivity.py`` scans the unsmoothed checkpoint so)."""
        from calibration.datasets import token_windows
        from calibration.streaming import StreamedCheckpoint
        from passes.selection import matches
        from pipeline.core.torch_model import LM_HEAD, linear_layers, load_tokenizer, untie_lm_head

        config = self.config
        windows_config = CalibrationConfig(
            dataset=config.calibration.dataset,
            num_samples=config.sensitivity.num_samples,
            seq_len=config.sensitivity.seq_len,
            seed=config.calibration.seed,
        )
        model = StreamedCheckpoint(folder, self.placement).load_model()  # the weights, not the file too
        windows = token_windows(load_tokenizer(folder), windows_config, knob="quant.sensitivity")
        candidates = select_modules(linear_layers(model), config.exclude)
        if LM_HEAD in candidates:
            untie_lm_head(model)  # in memory only: quantizing lm_head must not touch the embedding
        probe = SensitivityProbe(model, windows)
        ranges = dict(probe.input_absmax)
        if config.weight == WeightFormat.int8 and config.activations and calibrated_ranges:
            from passes.smoothquant import read_activations

            ranges.update(read_activations(folder)["absmax"])  # the ranges the int8 graph uses
        quantizers = {
            name: layer_quantizer(config, matches(name, config.weight_only), ranges[name])
            for name in candidates
        }
        return probe, quantizers

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        from calibration.sensitivity import fallback_search, fisher_sensitivity, layer_sensitivity

        config = self.config
        started = time.perf_counter()
        probe, quantizers = self.probe(source.path)
        windows = probe.windows
        method = Method(config.sensitivity.method)
        if method == Method.exact:
            scores = layer_sensitivity(probe, quantizers)
        else:
            samples, seed = config.sensitivity.fisher_samples, config.calibration.seed
            scores = fisher_sensitivity(probe, quantizers, samples=samples, seed=seed)
        broken = [name for name, kl in scores.items() if not math.isfinite(kl)]
        if broken:
            raise CalibrationError(
                f"quant.sensitivity: the KL of {broken[0]} (and {len(broken) - 1} more) is not finite on "
                f"the scan windows: the checkpoint overflows in {self.placement.torch_dtype}; check its "
                "weights (or set pipeline.torch_dtype=float32)"
            )
        ranking = list(scores)
        if config.fallback == Fallback.auto:
            result = fallback_search(probe, quantizers, ranking, config.kl_budget, config.max_fallback_layers)
        else:
            everything = probe.kl(quantizers)
            result = FallbackResult([], everything, everything <= config.kl_budget, {0: everything})
        seconds = time.perf_counter() - started
        if config.fallback == Fallback.auto and not result.budget_met:
            log.warning(
                "quant.fallback=auto: keeping the %d most sensitive layers leaves KL %.4g > "
                "quant.kl_budget=%g; raise quant.max_fallback_layers or the budget",
                len(result.modules),
                result.kl,
                config.kl_budget,
            )
        log.info(
            "sensitivity (%s): %d layers in %.1f s; most sensitive %s (KL %.3g); kept in higher "
            "precision: %s",
            method.value,
            len(scores),
            seconds,
            ranking[0] if ranking else "-",
            scores[ranking[0]] if ranking else 0.0,
            ", ".join(result.modules) or "none",
        )

        # A list, most sensitive first: JSON objects are written with sorted keys. With method=fisher
        # "kl" is the estimated KL (nats per token); the fallback's KL is always measured.
        ranked = [{"module": name, "kl": kl} for name, kl in scores.items()]
        link_tree(source.path, out_dir, skip=(ARTIFACT_FILE,))
        fallback = {
            "mode": config.fallback.value,
            "kl_budget": config.kl_budget,
            "modules": result.modules,
            "kl": result.kl,
            "budget_met": result.budget_met,
            "trials": {str(k): v for k, v in sorted(result.trials.items())},
        }
        scan = {
            "format": {
                k: v
                for k, v in self.config_dict().items()
                if k in ("weight", "group_size", "symmetric", "activations")
            },
            "method": method.value,
            "fisher_samples": config.sensitivity.fisher_samples if method == Method.fisher else None,
            "tokens": probe.tokens,
            "windows": {"num_samples": len(windows), "seq_len": int(windows.shape[1])},
            "ranking": ranked,
        }
        (out_dir / SCAN_FILE).parent.mkdir(parents=True, exist_ok=True)
        write_json(out_dir / SCAN_FILE, scan)
        write_json(out_dir / FALLBACK_FILE, fallback)
        write_metadata(out_dir, Kind.TORCH, dict(source.metadata))
        return {
            "layers": len(scores),
            "method": method.value,
            "tokens": probe.tokens,
            "seconds": round(seconds, 1),
            "most_sensitive": ranked[:TOP_IN_RECORD],
            "ranking": ranked,
            "kl_all_quantized": result.trials.get(0, result.kl),
            "fallback": fallback,
        }
