"""The quantization recipes (``quant=int4_gptq``, ``int4_awq``, ``int8``, ``fp8``): each expands the
flat config users type (``quant.group_size=64 quant.exclude=[lm_head]``) into the passes that
implement it, in order, each with its own subset of the keys (:class:`~pipeline.core.base.Recipe`);
the pass manager then places each where its input kind first exists along ``pipeline.order``.
Recipes compose passes and hold no algorithm: GPTQ (Frantar et al. 2022), AWQ (Lin et al. 2024),
SmoothQuant (Xiao et al. 2023), the sensitivity scan and the Q/DQ and INT4 lowerings are in their
own modules, the number formats in ``passes/formats/``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from calibration.datasets import CalibrationConfig
from calibration.observers import DEFAULT_BINS, Observer
from passes.awq import AwqPass, Objective, validate_awq
from passes.fp8 import CalibratePass, Fp8QdqPass, WeightObserver, validate_fp8
from passes.gptq import GptqPass
from passes.int4 import Int4LoweringSettings, Int4Settings, TorchInt4Pass, validate_settings
from passes.int8 import DEFAULT_WEIGHT_ONLY, Int8QDQPass
from passes.matmulnbits import Int4LoweringPass
from passes.sensitivity import FallbackSettings, WeightFormat, sensitivity_pass
from passes.smoothquant import SmoothQuantPass
from passes.smoothquant import validate as validate_smoothquant
from pipeline.core.base import Pass, Recipe
from pipeline.core.config import check_number, register_pass

# --------------------------------------------------------------------------------------------
# INT4 weight-only: a torch algorithm (GPTQ or AWQ), then the lowering of its weights in the graph


@dataclass
class Int4RecipeConfig(Int4Settings, Int4LoweringSettings, FallbackSettings):
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)

    def validate(self) -> None:
        validate_settings(self)
        super().validate()  # FallbackSettings


def _subset(config: Any, target: type) -> dict[str, Any]:
    """The recipe's values for the fields of the pass config ``target`` (others keep its defaults)."""
    names = [f.name for f in dataclasses.fields(target) if f.name != "_target_" and hasattr(config, f.name)]
    values = {name: getattr(config, name) for name in names}
    if "calibration" in values:
        values["calibration"] = asdict(values["calibration"])
    return values


class Int4Recipe(Recipe):
    """``quant=int4_<algorithm>``: the torch pass, then the lowering of its weights in the graph."""

    torch_pass: ClassVar[type[TorchInt4Pass]]

    def passes(self) -> list[Pass]:
        scan = sensitivity_pass(
            self.config,
            weight=WeightFormat.int4,
            group_size=self.config.group_size,
            symmetric=self.config.symmetric,
        )
        return [
            *([scan] if scan else []),
            self.torch_pass(**_subset(self.config, self.torch_pass.Config)),
            Int4LoweringPass(**_subset(self.config, Int4LoweringPass.Config)),
        ]


@dataclass
class Int4GptqConfig(Int4RecipeConfig):
    """``quant=int4_gptq``: GPTQ in torch, lowered to MatMulNBits (or block-wise Q/DQ) in the graph."""

    _target_: str = "passes.recipes.Int4GptqRecipe"
    damp_percent: float = 0.01
    act_order: bool = True

    def validate(self) -> None:
        super().validate()
        check_number("quant.damp_percent", self.damp_percent, low=0, high=1)


register_pass("quant", "int4_gptq", Int4GptqConfig)


class Int4GptqRecipe(Int4Recipe):
    Config = Int4GptqConfig
    name = "int4_gptq"
    torch_pass = GptqPass


@dataclass
class Int4AwqConfig(Int4RecipeConfig):
    """``quant=int4_awq``: AWQ in torch, lowered to MatMulNBits (or block-wise Q/DQ) in the graph."""

    _target_: str = "passes.recipes.Int4AwqRecipe"
    grid: int = 20
    objective: Objective = Objective.linear
    search_samples: int = 16
    sketch_rows: int = 1024
    clip: bool = True

    def validate(self) -> None:
        super().validate()
        validate_awq(self)


register_pass("quant", "int4_awq", Int4AwqConfig)


class Int4AwqRecipe(Int4Recipe):
    Config = Int4AwqConfig
    name = "int4_awq"
    torch_pass = AwqPass


# --------------------------------------------------------------------------------------------
# INT8 W8A8: SmoothQuant in torch, then Q/DQ in the graph


@dataclass
class Int8Config(FallbackSettings):
    """``quant=int8``: SmoothQuant W8A8 (per-channel INT8 weights, static per-tensor INT8
    activations; INT8 weight-only on ``weight_only`` layers). Keys as users type them:
    quant.alpha=0.7 quant.calibration.num_samples=128 quant.exclude=[lm_head] quant.weight_only=[]."""

    _target_: str = "passes.recipes.Int8Recipe"
    # SmoothQuant migration strength in [0, 1] (see passes/smoothquant.py). The paper's default is
    # 0.5; on SmolLM2-135M 0.8 measured best (KL vs fp32 0.0119; 0.65: 0.0156; 0.5 in a torch
    # simulation: 0.028).
    alpha: float = 0.8
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    # fnmatch patterns over module names (model.layers.3.mlp.down_proj, lm_head) kept in fp32.
    exclude: list[str] = field(default_factory=list)
    # Patterns of layers quantized to INT8 weights only, activations fp32 (ORT: MatMulNBits,
    # bits=8). [] gives pure W8A8 everywhere. Default: down_proj (per-token activation outliers
    # that no per-channel smoothing moves) and lm_head (tied to the embedding: not smoothable in
    # torch); see the module docstring for the measurements.
    weight_only: list[str] = field(default_factory=lambda: list(DEFAULT_WEIGHT_ONLY))
    # false: no smoothing (plain static W8A8 with the same ranges: the naive baseline).
    smooth: bool = True
    # Smooth o_proj (into v_proj rows) and down_proj (into up_proj rows); a weight-only or
    # excluded layer is never smoothed.
    smooth_o_proj: bool = True
    smooth_down_proj: bool = True
    # Calibration windows per forward.
    batch_size: int = 8
    # ensures: ONNX Runtime must lower every quantized MatMul to an integer kernel.
    check_lowering: bool = True

    def validate(self) -> None:
        validate_smoothquant(self)
        super().validate()  # FallbackSettings


register_pass("quant", "int8", Int8Config)


class Int8Recipe(Recipe):
    Config = Int8Config
    name = "int8"

    def passes(self) -> list[Pass]:
        c = self.config
        scan = sensitivity_pass(
            c, weight=WeightFormat.int8, activations=True, weight_only=list(c.weight_only)
        )
        return [
            SmoothQuantPass(
                alpha=c.alpha,
                calibration=c.calibration,
                exclude=list(c.exclude),
                weight_only=list(c.weight_only),
                smooth=c.smooth,
                smooth_o_proj=c.smooth_o_proj,
                smooth_down_proj=c.smooth_down_proj,
                batch_size=c.batch_size,
            ),
            *([scan] if scan else []),
            Int8QDQPass(
                exclude=list(c.exclude), weight_only=list(c.weight_only), check_lowering=c.check_lowering
            ),
        ]


# --------------------------------------------------------------------------------------------
# FP8 E4M3: activation calibration and Q/DQ, both in the graph


@dataclass
class Fp8Config(FallbackSettings):
    """``quant=fp8``: FP8 E4M3 weights (per output channel) and activations (per tensor, static)."""

    _target_: str = "passes.recipes.Fp8Recipe"
    # Activation observer: minmax | percentile | mse | entropy (calibration/observers.py). On the
    # default model (GPL-3 text, 8 x 512 tokens; fp32 perplexity 24.93) minmax gives the least KL
    # and the best top-1 agreement (perplexity +2.5%, KL 0.040, top-1 88.9%); mse and entropy are
    # within noise (+2.5% / +2.2%, KL 0.041 / 0.044); percentile=99.99 clips the model's massive
    # activations (|x| up to 3300 at the layer-11 down_proj input) and breaks it (+266%).
    observer: Observer = Observer.minmax
    # Percentile of |x| kept by observer=percentile.
    percentile: float = 99.99
    # Per-output-channel weight observer: minmax (amax/448) | percentile | mse.
    weight_observer: WeightObserver = WeightObserver.minmax
    # false: FP8 weights only (no activation Q/DQ, no calibration run).
    activations: bool = True
    # fnmatch patterns over linear module names (graph metadata `linear_weights`) kept in fp32.
    # lm_head is excluded by default, as in ModelOpt's FP8 config.
    exclude: list[str] = field(default_factory=lambda: ["lm_head"])
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    # Histogram bins per activation tensor (grown as needed) for percentile/mse/entropy.
    num_bins: int = DEFAULT_BINS
    # The pass fails when the quantized graph's greedy token differs from the input graph's on
    # more positions of a fixed prompt: a guard against broken graphs, not a quality gate.
    min_top1_agreement: float = 0.5

    def validate(self) -> None:
        super().validate()  # FallbackSettings
        validate_fp8(self)


register_pass("quant", "fp8", Fp8Config)


class Fp8Recipe(Recipe):
    """``quant=fp8``: [calibrate-activations,] fp8-qdq, both graph -> graph."""

    Config = Fp8Config
    name = "fp8"

    def passes(self) -> list[Pass]:
        config = self.config
        qdq = Fp8QdqPass(
            observer=Observer(config.observer),
            percentile=config.percentile,
            weight_observer=WeightObserver(config.weight_observer),
            activations=config.activations,
            exclude=list(config.exclude),
            min_top1_agreement=config.min_top1_agreement,
        )
        scan = sensitivity_pass(config, weight=WeightFormat.fp8, activations=config.activations)
        steps: list[Pass] = [scan] if scan else []
        if config.activations:
            steps.append(CalibratePass(calibration=config.calibration, num_bins=config.num_bins))
        return [*steps, qdq]
