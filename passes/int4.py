"""INT4 weight-only group quantization shared by ``quant=int4_gptq`` and ``quant=int4_awq``.

Numerics: asymmetric unsigned 4-bit codes per group of ``group_size`` consecutive input channels
of each output row (the layout of ONNX Runtime's ``MatMulNBits`` and of block-wise ONNX
``DequantizeLinear``, ``axis`` = input dim). A group's range is widened to contain 0 (GPTQ's
``Quantizer.find_params``, Frantar et al. 2022; also ONNX Runtime's MLAS round-to-nearest, which
this reproduces bit for bit), then ``scale = (max - min) / 15``, ``zero = round(-min / scale)`` and
``code = clamp(round(w / scale) + zero, 0, 15)``; the weight the engine computes with is
``(code - zero) * scale``. ``symmetric`` fixes ``zero = 8`` and ``scale = 2 max|w| / 15`` (GPTQ's
``sym``): the form TensorRT's INT4 ``DequantizeLinear`` accepts (it rejects non-zero zero points).

Contract between the two stages: the torch pass (GPTQ or AWQ) writes the fake-quantized weights
into the checkpoint, so the torch model computes what the engine will, and the exact integer
parameters into ``extras/int4/`` (``params.safetensors``: per module ``<m>.qweight`` uint8
``[out, in/2]`` (two codes a byte, low nibble first), ``<m>.scales`` float32 ``[out, in/group]``,
``<m>.zeros`` uint8 ``[out, in/group]``; ``int4.json``: bits, group size, algorithm, modules).
The graph pass (``passes/matmulnbits.py``) lowers exactly these; a layer with no stored
parameters is quantized there by round-to-nearest with the same formula.

A tied ``lm_head`` (SmolLM2: ``lm_head.weight is model.embed_tokens.weight``) is untied before it
is quantized: the embedding keeps its fp32 values, the head gets its own quantized weight, and
the export (which already writes the head as its own initializer) is unchanged in size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import shutil
from abc import abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from calibration.datasets import CalibrationConfig, as_calibration
from passes.export import EXTRAS_DIR  # export copies extras/ into the graph artifact
from passes.selection import select_modules
from passes.sensitivity import FallbackSettings
from pipeline.artifacts import ARTIFACT_FILE, Artifact, Kind, write_json, write_metadata
from pipeline.base import Pass, Recipe
from pipeline.errors import CalibrationError, ConfigError, PassError

log = logging.getLogger(__name__)

BITS = 4
MAXQ = (1 << BITS) - 1
SYMMETRIC_ZERO = 1 << (BITS - 1)  # MatMulNBits' default zero point for 4-bit codes
GROUP_SIZES = (32, 64, 128)
INT4_DIR = "int4"
PARAMS_FILE = "params.safetensors"
INFO_FILE = "int4.json"
FORMAT_VERSION = 1
LM_HEAD = "lm_head"


class Lowering(enum.StrEnum):
    matmulnbits = "matmulnbits"  # com.microsoft.MatMulNBits (ONNX Runtime CPU/GPU kernels)
    qdq = "qdq"  # UINT4/INT4 initializer + block-wise DequantizeLinear + MatMul (TensorRT's form)


# --------------------------------------------------------------------------------------------
# Configs. Users type a flat recipe (quant.group_size=64 quant.exclude=[lm_head]); each pass of
# the recipe gets its own subset as constructor kwargs.


@dataclass
class Int4Settings:
    """What both stages must agree on: the grid and which layers are quantized."""

    # Input channels sharing one scale and zero point (MatMulNBits block_size). 32 by default: on
    # the default model GPTQ perplexity is 28.8 at 32 vs 29.5 at 64 (fp32 24.9) for +5% engine size
    # and no measurable decode cost; it is also ONNX Runtime GenAI's int4 default, and 128 (the
    # AWQ/GPTQ papers' choice) does not divide the default model's width 576 = 9 x 64.
    group_size: int = 32
    # Zero point fixed at 8 (signed INT4 in the Q/DQ graph: the only INT4 TensorRT accepts).
    symmetric: bool = False
    # fnmatch patterns over module names (model.layers.3.mlp.down_proj, lm_head) kept in fp32.
    exclude: list[str] = field(default_factory=list)


@dataclass
class Int4LoweringSettings:
    """How the graph stage writes the INT4 layers."""

    lowering: Lowering = Lowering.matmulnbits
    # MatMulNBits accuracy_level. 4 (default, as ORT GenAI's builder uses for CPU): ONNX Runtime
    # quantizes the activations to int8 per block and uses integer dot products: a decode-shaped
    # (1 x 576 x 1536) INT4 matmul takes 0.07 ms against 0.19 ms at 0 (fp32 MatMul: 0.46 ms), a
    # prefill-shaped one (512 rows) ~1.8x longer than at 0. On the default model (GPTQ) decode is
    # faster at 4 (TPOT 26-30 vs 29-32 ms in alternating runs; 39 vs 75 ms in one loaded run),
    # prefill slower (TTFT@512 1.38-1.47 vs 1.05-1.17 s), perplexity 28.88 vs 28.84. 0: unset,
    # fp32 compute; the graph then equals the fake-quantized torch model to ~1e-4 (the tests check
    # this). Ignored by the Q/DQ lowering (ONNX Runtime fuses DQ + MatMul into MatMulNBits at its
    # session option ``session.qdq_matmulnbits_accuracy_level``, default 4).
    accuracy_level: int = 4


def validate_settings(config: Any, where: str = "quant") -> None:
    """Checks that need no model: group size, calibration sizes, lowering knobs."""
    if config.group_size not in GROUP_SIZES:
        raise ConfigError(
            f"{where}.group_size={config.group_size} is not supported: choose one of "
            f"{', '.join(map(str, GROUP_SIZES))}"
        )
    calibration = getattr(config, "calibration", None)
    if calibration is not None:
        if calibration.num_samples < 1:
            raise ConfigError(
                f"{where}.calibration.num_samples={calibration.num_samples}: at least one calibration "
                "window is needed"
            )
        if calibration.seq_len < 2:
            raise ConfigError(f"{where}.calibration.seq_len={calibration.seq_len}: must be at least 2")
    accuracy = getattr(config, "accuracy_level", 0)
    if accuracy not in (0, 1, 2, 3, 4):
        raise ConfigError(f"{where}.accuracy_level={accuracy}: choose 0 (unset), 1, 2, 3 or 4")


def check_group_size(group_size: int, widths: dict[str, int], where: str = "quant") -> None:
    """Every quantized layer's input width must be a multiple of the group size."""
    for name, width in widths.items():
        if width % group_size:
            raise ConfigError(
                f"{where}.group_size={group_size} does not divide the input width {width} of {name}"
            )


# --------------------------------------------------------------------------------------------
# The math (torch tensors; float32).


@dataclass
class QuantizedLinear:
    """One layer's INT4 parameters: ``codes`` uint8 [out, in], ``scales`` float32 [out, groups],
    ``zeros`` uint8 [out, groups]. ``dequantize()`` is the weight the engine computes with."""

    codes: Any
    scales: Any
    zeros: Any

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def dequantize(self) -> Any:
        return dequantize(self.codes, self.scales, self.zeros, self.group_size)


def range_params(xmin: Any, xmax: Any, symmetric: bool) -> tuple[Any, Any]:
    """Scale and (integer-valued, float) zero point of groups with the given min and max."""
    import torch

    xmin = torch.clamp(xmin, max=0.0)
    xmax = torch.clamp(xmax, min=0.0)
    if symmetric:
        xmax = torch.maximum(-xmin, xmax)
        xmin = -xmax
    empty = (xmin == 0) & (xmax == 0)  # an all-zero group: any scale works, take GPTQ's
    xmin = torch.where(empty, -1.0, xmin)
    xmax = torch.where(empty, 1.0, xmax)
    scale = (xmax - xmin) / MAXQ
    zero = torch.full_like(scale, SYMMETRIC_ZERO) if symmetric else torch.round(-xmin / scale)
    return scale, zero


def group_params(weight: Any, group_size: int, symmetric: bool) -> tuple[Any, Any]:
    """Round-to-nearest parameters of ``weight`` [out, in]: scales and zeros [out, in/group]."""
    grouped = weight.float().reshape(weight.shape[0], -1, group_size)
    return range_params(grouped.amin(-1), grouped.amax(-1), symmetric)


def quantize_codes(weight: Any, scales: Any, zeros: Any, group_size: int) -> Any:
    """uint8 codes of ``weight`` [out, in] for the given per-group parameters."""
    import torch

    grouped = weight.float().reshape(weight.shape[0], -1, group_size)
    codes = torch.round(grouped / scales[..., None]) + zeros[..., None]
    return codes.clamp_(0, MAXQ).to(torch.uint8).reshape(weight.shape)


def dequantize(codes: Any, scales: Any, zeros: Any, group_size: int) -> Any:
    grouped = codes.float().reshape(codes.shape[0], -1, group_size)
    return ((grouped - zeros.float()[..., None]) * scales.float()[..., None]).reshape(codes.shape)


def quantize_rtn(weight: Any, group_size: int, symmetric: bool) -> QuantizedLinear:
    """Round-to-nearest: the baseline every algorithm here must beat."""
    import torch

    scales, zeros = group_params(weight, group_size, symmetric)
    codes = quantize_codes(weight, scales, zeros, group_size)
    return QuantizedLinear(codes, scales.float(), zeros.to(torch.uint8))


# --------------------------------------------------------------------------------------------
# Packing (numpy). ONNX Runtime's own helpers (onnxruntime.quantization: quantize_matmul_4bits,
# quantize_qdq_matmul_4bits) choose the scales themselves from fp32 weights and cannot take ours,
# so the packing is written here; tests check it against those helpers on round-to-nearest input.


def pack_uint4(codes: np.ndarray) -> np.ndarray:
    """Pack the last axis two codes a byte, the even index in the low nibble (odd length padded)."""
    codes = np.asarray(codes, dtype=np.uint8)
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], 1), np.uint8)], axis=-1)
    return (codes[..., 0::2] & 0x0F) | ((codes[..., 1::2] & 0x0F) << 4)


def unpack_uint4(packed: np.ndarray, length: int) -> np.ndarray:
    packed = np.asarray(packed, dtype=np.uint8)
    both = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return both[..., :length]


def matmulnbits_tensors(layer: QuantizedLinear) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``MatMulNBits`` inputs B [N, k_blocks, block/2] uint8, scales [N, k_blocks] float32 and
    zero_points [N, ceil(k_blocks/2)] uint8 (N = out features, k_blocks = in / group)."""
    codes = np.asarray(layer.codes.numpy(), np.uint8)
    out_features, _ = codes.shape
    blocks = layer.scales.shape[1]
    packed = pack_uint4(codes.reshape(out_features, blocks, layer.group_size))
    scales = np.ascontiguousarray(layer.scales.numpy(), dtype=np.float32)
    zeros = pack_uint4(np.asarray(layer.zeros.numpy(), np.uint8))
    return packed, scales, zeros


def qdq_tensors(layer: QuantizedLinear, symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Block-wise ``DequantizeLinear`` (axis 0 of the [in, out] weight) inputs: codes [in, out]
    (flat-packed), scales [in/group, out], zero points [in/group, out] (flat-packed; None when
    symmetric: the codes are then signed, ``code - 8``)."""
    codes_t = np.ascontiguousarray(np.asarray(layer.codes.numpy(), np.uint8).T)
    scales_t = np.ascontiguousarray(layer.scales.numpy().T, dtype=np.float32)
    if symmetric:
        signed = codes_t.astype(np.int16) - SYMMETRIC_ZERO
        return pack_uint4((signed & 0x0F).astype(np.uint8).reshape(-1)), scales_t, None
    zeros_t = np.ascontiguousarray(np.asarray(layer.zeros.numpy(), np.uint8).T)
    return pack_uint4(codes_t.reshape(-1)), scales_t, pack_uint4(zeros_t.reshape(-1))


# --------------------------------------------------------------------------------------------
# extras/int4/: the exact parameters, from the torch stage to the graph stage.


def save_params(folder: Path, layers: dict[str, QuantizedLinear], info: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Any] = {}
    for name, layer in layers.items():
        tensors[f"{name}.qweight"] = torch.from_numpy(pack_uint4(layer.codes.numpy())).contiguous()
        tensors[f"{name}.scales"] = layer.scales.float().contiguous()
        tensors[f"{name}.zeros"] = layer.zeros.to(torch.uint8).contiguous()
    save_file(tensors, str(folder / PARAMS_FILE))
    info = {**info, "format": FORMAT_VERSION, "bits": BITS, "modules": sorted(layers)}
    write_json(folder / INFO_FILE, info)


def load_params(folder: Path) -> tuple[dict[str, Any], dict[str, QuantizedLinear]]:
    """(info, layers) from ``extras/int4/``; ({}, {}) when the folder holds none."""
    import torch
    from safetensors.torch import load_file

    info_path = folder / INFO_FILE
    if not info_path.is_file():
        return {}, {}
    info = json.loads(info_path.read_text())
    if info.get("format") != FORMAT_VERSION or info.get("bits") != BITS:
        raise PassError(f"{info_path}: unsupported INT4 parameter format {info.get('format')}; rebuild")
    tensors = load_file(str(folder / PARAMS_FILE))
    layers = {}
    for name in info["modules"]:
        scales = tensors[f"{name}.scales"]
        width = scales.shape[1] * info["group_size"]
        codes = torch.from_numpy(unpack_uint4(tensors[f"{name}.qweight"].numpy(), width))
        layers[name] = QuantizedLinear(codes, scales, tensors[f"{name}.zeros"])
    return info, layers


# --------------------------------------------------------------------------------------------
# The torch stage: a model is quantized one decoder layer at a time (GPTQ's sequential scheme),
# so only one layer's calibration activations are alive at once.


def linear_layers(model: Any) -> dict[str, Any]:
    """Every ``nn.Linear`` of a causal LM by module name (decoder projections and ``lm_head``)."""
    import torch

    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def meta_model(folder: Path) -> Any:
    """The model skeleton (no weights) of a checkpoint: module names and shapes, in milliseconds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=False)


@dataclass
class LayerInputs:
    """The inputs of one decoder layer for each calibration batch (hidden states + the layer kwargs
    transformers passes: mask, rotary position embeddings, positions)."""

    hidden: list[Any]
    kwargs: list[dict[str, Any]]

    @property
    def tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)


class _StopForward(Exception):
    pass


def first_layer_inputs(model: Any, windows: np.ndarray, batch_size: int) -> LayerInputs:
    """Run the embedding (and mask/rotary set-up) of ``model`` on ``windows``; catch what reaches
    decoder layer 0, then stop (AutoGPTQ's "Catcher")."""
    import torch

    layers = model.model.layers
    original = layers[0]
    captured = LayerInputs([], [])

    class Catcher(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wrapped = original

        def forward(self, hidden_states: Any, **kwargs: Any) -> Any:
            captured.hidden.append(hidden_states.detach())
            kwargs.pop("cache", None)
            kwargs.pop("past_key_values", None)
            kwargs["use_cache"] = False
            captured.kwargs.append(kwargs)
            raise _StopForward

    layers[0] = Catcher()
    try:
        with torch.no_grad():
            for start in range(0, len(windows), batch_size):
                ids = torch.from_numpy(np.ascontiguousarray(windows[start : start + batch_size]))
                with contextlib.suppress(_StopForward):
                    model(input_ids=ids, use_cache=False)
    finally:
        layers[0] = original
    return captured


def run_layer(layer: Any, inputs: LayerInputs) -> list[Any]:
    """The layer's output hidden states for each batch."""
    import torch

    outputs = []
    with torch.no_grad():
        for hidden, kwargs in zip(inputs.hidden, inputs.kwargs, strict=True):
            out = layer(hidden, **kwargs)
            outputs.append((out[0] if isinstance(out, tuple) else out).detach())
    return outputs


@contextlib.contextmanager
def input_hooks(modules: dict[str, Any], callback: Callable[[str, Any], None]) -> Iterator[None]:
    """Call ``callback(name, input)`` with the (detached) input of each module on every forward."""
    handles = [
        module.register_forward_pre_hook(lambda _m, args, name=name: callback(name, args[0].detach()))
        for name, module in modules.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def check_finite(tensor: Any, what: str, module: str, dataset: str) -> None:
    """NaN/inf in collected statistics is a CalibrationError naming the layer and the data."""
    import torch

    if not bool(torch.isfinite(tensor).all()):
        raise CalibrationError(
            f"quant: the {what} of {module} contain NaN/inf on the calibration windows "
            f"(quant.calibration.dataset={dataset}): the checkpoint overflows in fp32; check its weights"
        )


def untie_lm_head(model: Any) -> bool:
    """Give ``lm_head`` its own copy of a tied embedding (the embedding is not changed)."""
    import torch

    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head.weight is embed.weight or head.weight.data_ptr() == embed.weight.data_ptr()
    if tied:
        head.weight = torch.nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    return tied


CALIBRATION_BATCH = 8  # windows per forward: bounds activation memory, keeps matmuls large
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass
class TorchInt4Config(Int4Settings):
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)

    def __post_init__(self) -> None:
        self.calibration = as_calibration(self.calibration)
        validate_settings(self)


class TorchInt4Pass(Pass):
    """Base of the torch-stage INT4 passes: load, calibrate, quantize (subclass), save."""

    consumes = Kind.TORCH
    produces = Kind.TORCH
    algorithm: ClassVar[str]

    def targets(self, model: Any, folder: Path) -> list[str]:
        """The quantized layers' names, after the exclude (and fallback) and group-size checks."""
        layers = linear_layers(model)
        selected = select_modules(layers, self.config.exclude, folder)
        check_group_size(self.config.group_size, {n: layers[n].in_features for n in selected})
        return selected

    def requires(self, source: Artifact) -> None:
        if (source.path / EXTRAS_DIR / INT4_DIR).exists():
            raise PassError(f"{self.name}: {source.path} is already INT4-quantized; select one quant recipe")
        self.targets(meta_model(source.path), source.path)  # fails before any weight is read

    @abstractmethod
    def quantize_model(
        self, model: Any, windows: np.ndarray, targets: list[str]
    ) -> dict[str, QuantizedLinear]:
        """Quantize ``targets`` of ``model`` in place (fake-quantized weights); return the parameters."""

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        import time

        import torch

        from calibration.datasets import token_windows
        from pipeline.torch_model import load_causal_lm, load_tokenizer

        model = load_causal_lm(source.path)
        windows = token_windows(load_tokenizer(source.path), self.config.calibration)
        targets = self.targets(model, source.path)
        untied = LM_HEAD in targets and untie_lm_head(model)
        started = time.perf_counter()
        with torch.no_grad():
            layers = self.quantize_model(model, windows, targets)
        seconds = time.perf_counter() - started
        for item in source.path.iterdir():
            if item.name in (ARTIFACT_FILE, *WEIGHT_FILES) or item.name.endswith(".safetensors"):
                continue
            if item.is_dir():
                shutil.copytree(item, out_dir / item.name)
            else:
                shutil.copy2(item, out_dir / item.name)
        model.save_pretrained(out_dir, safe_serialization=True)
        info = {
            "algorithm": self.algorithm,
            "group_size": self.config.group_size,
            "symmetric": self.config.symmetric,
            "exclude": list(self.config.exclude),
            "config": self.config_dict(),
        }
        save_params(out_dir / EXTRAS_DIR / INT4_DIR, layers, info)
        summary = {k: v for k, v in info.items() if k != "config"} | {"modules": len(layers), "bits": BITS}
        write_metadata(out_dir, Kind.TORCH, {**source.metadata, "quantization": summary})
        log.info("%s: %d layers quantized in %.1f s", self.name, len(layers), seconds)
        return {
            "quantized_layers": len(layers),
            "untied_lm_head": bool(untied),
            "calibration_tokens": int(windows.size),
            "seconds_quantize": round(seconds, 1),
        }

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        """The saved checkpoint holds exactly the dequantized stored parameters."""
        from safetensors import safe_open

        _, layers = load_params(result.path / EXTRAS_DIR / INT4_DIR)
        worst = 0.0
        files = sorted(result.path.glob("*.safetensors"))
        for path in files:
            with safe_open(str(path), "pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    name = key.removesuffix(".weight")
                    if key.endswith(".weight") and name in layers:
                        diff = (handle.get_tensor(key).float() - layers.pop(name).dequantize()).abs().max()
                        worst = max(worst, float(diff))
        if layers or worst > 0:
            raise PassError(
                f"{self.name}: the saved weights differ from the stored INT4 parameters "
                f"(max |diff| {worst:.3g}, missing {sorted(layers)[:3]})"
            )
        return {}


@dataclass
class Int4RecipeConfig(Int4Settings, Int4LoweringSettings, FallbackSettings):
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)

    def __post_init__(self) -> None:
        # No validation here: Hydra wraps constructor errors; Recipe.passes() raises them plainly.
        self.calibration = as_calibration(self.calibration)


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
        from passes.matmulnbits import Int4LoweringPass
        from passes.sensitivity import WeightFormat, sensitivity_pass

        validate_settings(self.config)
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
