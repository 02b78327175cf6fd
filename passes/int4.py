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

The torch stage is block-streamed (``calibration/streaming.py``; GPTQ's reference
``llama_sequential``, llm-compressor's sequential pipeline): the model is a ``meta`` skeleton,
each decoder block is read from the safetensors shards onto ``pipeline.device`` in
``pipeline.torch_dtype``, calibrated and quantized on the previous block's outputs, written as its
own shard and freed. Peak memory is one block, one layer's calibration activations and the
embeddings, whatever the depth; the results equal those of the model held whole
(:meth:`TorchInt4Pass.quantize_model`, which the tests compare). Statistics (Gram matrices,
Hessians, activation means) are accumulated in float32 whatever the compute dtype, and the saved
weights are float32 as before: quantized layers hold exactly the dequantized parameters,
tensors the pass did not change keep their stored values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
from abc import abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from calibration.datasets import CalibrationConfig, as_calibration, shard
from calibration.streaming import ForwardTime, LayerInputs, capture_first_block_inputs
from passes.export import EXTRAS_DIR  # export copies extras/ into the graph artifact
from passes.selection import select_modules
from passes.sensitivity import FallbackSettings
from pipeline.artifacts import Artifact, Kind, write_json, write_metadata
from pipeline.base import Pass, Recipe
from pipeline.distributed import CalibratesInRanks, Group
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
    """``(codes - zeros) * scales`` per group, float32, in place on one new temporary."""
    import torch

    grouped = codes.to(torch.float32, copy=True).reshape(codes.shape[0], -1, group_size)
    return grouped.sub_(zeros.float()[..., None]).mul_(scales.float()[..., None]).reshape(codes.shape)


def quantize_rtn(weight: Any, group_size: int, symmetric: bool) -> QuantizedLinear:
    """Round-to-nearest: the baseline every algorithm here must beat."""
    import torch

    scales, zeros = group_params(weight, group_size, symmetric)
    codes = quantize_codes(weight, scales, zeros, group_size)
    return QuantizedLinear(codes, scales.float(), zeros.to(torch.uint8))


def fake_quantize_rtn(weight: Any, group_size: int, symmetric: bool) -> Any:
    """``quantize_rtn(weight, ...).dequantize()`` bit for bit (the same float32 operations in the
    same order), in place on one float32 temporary: half the time, for searches that quantize a
    weight many times and never keep its codes (AWQ's scale search, the sensitivity scan)."""
    import torch

    scales, zeros = group_params(weight, group_size, symmetric)
    scale, zero = scales[..., None], zeros[..., None]
    grouped = torch.div(weight.float().reshape(weight.shape[0], -1, group_size), scale)
    return grouped.round_().add_(zero).clamp_(0, MAXQ).sub_(zero).mul_(scale).reshape(weight.shape)


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


def packed_params(name: str, layer: QuantizedLinear) -> dict[str, Any]:
    """The stored tensors of one layer (CPU): packed codes, scales, zeros."""
    import torch

    return {
        f"{name}.qweight": torch.from_numpy(pack_uint4(layer.codes.cpu().numpy())).contiguous(),
        f"{name}.scales": layer.scales.float().cpu().contiguous(),
        f"{name}.zeros": layer.zeros.to(device="cpu", dtype=torch.uint8).contiguous(),
    }


def save_params(folder: Path, layers: dict[str, QuantizedLinear], info: dict[str, Any]) -> None:
    tensors: dict[str, Any] = {}
    for name, layer in layers.items():
        tensors.update(packed_params(name, layer))
    save_packed_params(folder, tensors, sorted(layers), info)


def save_packed_params(
    folder: Path, tensors: dict[str, Any], modules: list[str], info: dict[str, Any]
) -> None:
    """Write ``extras/int4/`` from tensors already packed by :func:`packed_params`."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / PARAMS_FILE))
    info = {**info, "format": FORMAT_VERSION, "bits": BITS, "modules": sorted(modules)}
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


def first_layer_inputs(model: Any, windows: np.ndarray, batch_size: int) -> LayerInputs:
    """The first decoder layer's inputs of an in-memory ``model`` on ``windows`` (on its device)."""
    device = next(model.model.embed_tokens.parameters()).device
    return capture_first_block_inputs(model, windows, batch_size, device)


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


@dataclass
class TorchInt4Config(Int4Settings):
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)

    def __post_init__(self) -> None:
        self.calibration = as_calibration(self.calibration)
        validate_settings(self)


class TorchInt4Pass(CalibratesInRanks, Pass):
    """Base of the torch-stage INT4 passes: calibrate and quantize (subclass) one decoder block at a
    time, streamed from the checkpoint and written as it is done (``calibration.streaming``)."""

    consumes = Kind.TORCH
    produces = Kind.TORCH
    placement_knobs = ("device", "torch_dtype")
    memory_profile = "block"
    algorithm: ClassVar[str]
    drift = "bits4"
    group: Group = Group()  # the ranks sharing the calibration windows (set by run_rank)
    forward_time: ForwardTime = ForwardTime()  # this rank's calibration forwards (reset by run_rank)

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
    def quantize_block(
        self, prefix: str, layer: Any, inputs: LayerInputs, wanted: set[str]
    ) -> dict[str, QuantizedLinear]:
        """Quantize the linears of decoder ``layer`` (module names ``prefix + name``) that are in
        ``wanted``, in place (fake-quantized weights); set ``inputs.hidden`` to the inputs of the
        next layer; return the parameters."""

    @abstractmethod
    def quantize_head(self, norm: Any, head: Any, hidden: list[Any]) -> dict[str, QuantizedLinear]:
        """Quantize ``lm_head`` (``head``) on the final ``norm`` of the last layer's outputs."""

    def quantize_model(
        self, model: Any, windows: np.ndarray, targets: list[str]
    ) -> dict[str, QuantizedLinear]:
        """Quantize ``targets`` of an in-memory ``model`` in place; the parameters. The same steps
        as :meth:`run`, on a model held whole (tests compare the two)."""
        wanted = set(targets)
        results: dict[str, QuantizedLinear] = {}
        inputs = first_layer_inputs(model, windows, CALIBRATION_BATCH)
        for index, layer in enumerate(model.model.layers):
            results.update(self.quantize_block(f"model.layers.{index}.", layer, inputs, wanted))
        if LM_HEAD in wanted:
            results.update(self.quantize_head(model.model.norm, model.lm_head, inputs.hidden))
        return results

    def run_rank(self, source: Artifact, out_dir: Path, group: Group) -> dict[str, Any]:
        """The pass in one rank of ``group`` (all of it for one process): each rank pushes its
        share of the calibration windows through the blocks, :meth:`quantize_block` reduces the
        statistics across ranks (``self.group``), so every rank quantizes alike; rank 0 writes
        and returns the metrics, the others return {}."""
        import time

        import torch
        from tqdm.auto import tqdm

        from calibration.datasets import token_windows
        from calibration.streaming import EMBEDDINGS, FINAL_NORM, CheckpointWriter, StreamedCheckpoint
        from pipeline.torch_model import copy_beside_weights, load_tokenizer

        self.group = group
        self.forward_time = ForwardTime()
        checkpoint = StreamedCheckpoint(source.path, self.placement)
        windows = token_windows(load_tokenizer(source.path), self.config.calibration)
        mine = shard(windows, group.rank, group.world, CALIBRATION_BATCH)
        targets = self.targets(checkpoint.model, source.path)
        wanted = set(targets)
        untied = LM_HEAD in wanted and checkpoint.untie_lm_head()
        writer = CheckpointWriter(out_dir) if group.main else None
        if group.main:
            copy_beside_weights(source.path, out_dir)
        params: dict[str, Any] = {}
        modules: list[str] = []

        def finish(prefix: str, results: dict[str, QuantizedLinear]) -> None:
            """Write module ``prefix`` (quantized weights exact, in float32) and free it."""
            if writer:
                overrides = {f"{name}.weight": layer.dequantize() for name, layer in results.items()}
                writer.write(checkpoint.output_tensors(prefix, overrides))
            for name, layer in results.items():
                params.update(packed_params(name, layer))
                modules.append(name)
            checkpoint.release(prefix)

        started = time.perf_counter()
        with torch.no_grad():
            inputs = checkpoint.first_block_inputs(mine, CALIBRATION_BATCH)
            if writer:
                writer.write(self._unchanged(checkpoint, EMBEDDINGS))  # no INT4 pass changes it
            layers = range(checkpoint.num_layers)
            for index in tqdm(layers, desc=self.name, unit="layer", disable=not group.main):
                prefix = checkpoint.layer_prefix(index)
                layer = checkpoint.materialize(prefix)
                finish(prefix, self.quantize_block(prefix + ".", layer, inputs, wanted))
            norm = checkpoint.materialize(FINAL_NORM)
            if LM_HEAD in wanted:
                head = checkpoint.materialize(LM_HEAD)
                results = self.quantize_head(norm, head, inputs.hidden)
                finish(LM_HEAD, results)
            elif writer and not checkpoint.output_tied:
                writer.write(self._unchanged(checkpoint, LM_HEAD))
            finish(FINAL_NORM, {})
        seconds = time.perf_counter() - started
        if writer is None:
            return {}
        writer.finish(checkpoint.config, checkpoint.generation_config())
        info = {
            "algorithm": self.algorithm,
            "group_size": self.config.group_size,
            "symmetric": self.config.symmetric,
            "exclude": list(self.config.exclude),
            "config": self.keyed_config(),
        }
        save_packed_params(out_dir / EXTRAS_DIR / INT4_DIR, params, modules, info)
        summary = {k: v for k, v in info.items() if k != "config"} | {"modules": len(modules), "bits": BITS}
        write_metadata(out_dir, Kind.TORCH, {**source.metadata, "quantization": summary})
        log.info("%s: %d layers quantized in %.1f s", self.name, len(modules), seconds)
        return {
            "quantized_layers": len(modules),
            "untied_lm_head": bool(untied),
            "calibration_tokens": int(windows.size),
            "seconds_quantize": round(seconds, 1),
            # This process's share: with N processes, 1/N of the windows (rank 0's time).
            "calibration": {"processes": group.world, "windows": len(mine), **self.forward_time.to_dict()},
        }

    @staticmethod
    def _unchanged(checkpoint: Any, prefix: str) -> dict[str, Any]:
        """A module the pass does not change, as stored (float32, the dtype of today's outputs)."""
        import torch

        names = checkpoint.tensor_names(prefix)
        return {
            name: value.to(torch.float32 if value.is_floating_point() else value.dtype).contiguous()
            for name, value in checkpoint.read(names).items()
        }

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        """The saved checkpoint holds exactly the dequantized stored parameters (checked one
        tensor at a time, so the check is bounded in memory too)."""
        import torch
        from safetensors import safe_open

        folder = result.path / EXTRAS_DIR / INT4_DIR
        info = json.loads((folder / INFO_FILE).read_text()) if (folder / INFO_FILE).is_file() else {}
        missing = set(info.get("modules", []))
        worst = 0.0
        with safe_open(str(folder / PARAMS_FILE), "pt") if missing else contextlib.nullcontext() as stored:
            for path in sorted(result.path.glob("*.safetensors")):
                with safe_open(str(path), "pt") as handle:
                    for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                        name = key.removesuffix(".weight")
                        if not key.endswith(".weight") or name not in missing:
                            continue
                        missing.discard(name)
                        scales = stored.get_tensor(f"{name}.scales")
                        width = scales.shape[1] * info["group_size"]
                        packed = stored.get_tensor(f"{name}.qweight").numpy()
                        codes = torch.from_numpy(unpack_uint4(packed, width))
                        zeros = stored.get_tensor(f"{name}.zeros")
                        expected = dequantize(codes, scales, zeros, info["group_size"])
                        diff = (handle.get_tensor(key).float() - expected).abs().max()
                        worst = max(worst, float(diff))
        if missing or worst > 0:
            raise PassError(
                f"{self.name}: the saved weights differ from the stored INT4 parameters "
                f"(max |diff| {worst:.3g}, missing {sorted(missing)[:3]})"
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
