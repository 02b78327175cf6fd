"""The INT4 weight format: group-wise codes, their scales and zero points, packing into ONNX
Runtime's ``MatMulNBits`` and ONNX ``DequantizeLinear`` layouts, and ``extras/int4/``, which
carries the exact parameters from the torch stage to the graph stage. No pass here: GPTQ, AWQ and
the lowering (``passes/gptq.py``, ``passes/awq.py``, ``passes/matmulnbits.py``) build on it.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.artifacts import write_json
from pipeline.core.errors import ConfigError, PassError
from pipeline.core.files import read_json

BITS = 4
MAXQ = (1 << BITS) - 1
SYMMETRIC_ZERO = 1 << (BITS - 1)  # MatMulNBits' default zero point for 4-bit codes
GROUP_SIZES = (32, 64, 128)
INT4_DIR = "int4"
PARAMS_FILE = "params.safetensors"
INFO_FILE = "int4.json"
FORMAT_VERSION = 1


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
    info = read_json(info_path, what="the INT4 parameters")
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
