"""Finding a non-finite weight in a pass output before it is cached.

A diverged pass (a distilled student whose loss blew up, a scale divided by zero) writes NaN or
infinite weights that load and hash like any others; cached, they fail every later run. The pass
manager scans each output with :func:`first_nonfinite` before committing it.

The scan streams tensor by tensor, in bounded chunks read into one reused buffer, so a 70B
checkpoint is never loaded whole: safetensors files (a torch checkpoint) through their JSON
header, ONNX graphs through their initializers (and constant tensors), external data read at each
initializer's offset. Floating tensors are checked by their bit patterns (float32, float64,
float16, bfloat16 and the float8 formats, whose NaN codes count); integer and packed tensors (int4,
int8, uint8, ...) cannot hold a NaN and are skipped. Every file is opened through
:mod:`pipeline.core.files`, confined to the output folder.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from pipeline.core.files import UnsafeFileError, confined, loads_bounded, open_regular, walk_regular
from pipeline.core.graph_io import proto_tensors

_CHUNK_BYTES = 32 << 20  # bytes read (and checked) at a time
_MAX_HEADER = 100 << 20  # a safetensors JSON header larger than this is not one

# ``bits`` (unsigned integers of the dtype's width) -> a mask of the elements that are NaN or inf.
Checker = Callable[[np.ndarray], np.ndarray]


def _exponent_all_ones(mask: int) -> Checker:
    return lambda bits: (bits & mask) == mask


def _float8_e4m3fn(bits: np.ndarray) -> np.ndarray:  # no infinity; NaN is S.1111.111
    return (bits & 0x7F) == 0x7F


def _float8_fnuz(bits: np.ndarray) -> np.ndarray:  # no infinity, no negative zero: NaN is 0x80
    return bits == 0x80


def _float8_e8m0(bits: np.ndarray) -> np.ndarray:  # an exponent only: NaN is 0xFF
    return bits == 0xFF


# dtype -> (bytes per element, checker)
_FLOAT32 = (4, _exponent_all_ones(0x7F800000))
_FLOAT64 = (8, _exponent_all_ones(0x7FF0000000000000))
_FLOAT16 = (2, _exponent_all_ones(0x7C00))
_BFLOAT16 = (2, _exponent_all_ones(0x7F80))
_E5M2 = (1, _exponent_all_ones(0x7C))

SAFETENSORS_FLOATS: dict[str, tuple[int, Checker]] = {
    "F32": _FLOAT32,
    "F64": _FLOAT64,
    "F16": _FLOAT16,
    "BF16": _BFLOAT16,
    "F8_E5M2": _E5M2,
    "F8_E4M3": (1, _float8_e4m3fn),
    "F8_E8M0": (1, _float8_e8m0),
}
# onnx.TensorProto.DataType numbers (FLOAT, DOUBLE, FLOAT16, BFLOAT16, FLOAT8E4M3FN,
# FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ, FLOAT8E8M0); COMPLEX64/128 as pairs of floats.
ONNX_FLOATS: dict[int, tuple[int, Checker]] = {
    1: _FLOAT32,
    11: _FLOAT64,
    10: _FLOAT16,
    16: _BFLOAT16,
    17: (1, _float8_e4m3fn),
    18: (1, _float8_fnuz),
    19: _E5M2,
    20: (1, _float8_fnuz),
    24: (1, _float8_e8m0),
    14: _FLOAT32,
    15: _FLOAT64,
}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True)
class NonFinite:
    """Where a non-finite value lies: the file (relative to the scanned folder) and the tensor."""

    file: str
    tensor: str
    count: int  # non-finite elements in the chunk where the first was found (at least 1)


def _scan_bytes(handle: BinaryIO, offset: int, length: int, width: int, check: Checker) -> int:
    """How many elements of the ``length`` bytes at ``offset`` are non-finite in the first chunk
    holding one (0: none), read ``_CHUNK_BYTES`` at a time."""
    if length % width:
        raise ValueError(f"{length} bytes are not a whole number of {width}-byte elements")
    handle.seek(offset)
    buffer = bytearray(min(_CHUNK_BYTES, length))  # a multiple of every width
    left = length
    while left > 0:
        size = min(len(buffer), left)
        got = handle.readinto(memoryview(buffer)[:size])
        if got != size:
            raise ValueError(f"the file ends {left - (got or 0)} bytes before a tensor does")
        bits = np.frombuffer(buffer, dtype=_UNSIGNED[width], count=size // width)
        bad = int(np.count_nonzero(check(bits)))
        if bad:
            return bad
        left -= size
    return 0


def _safetensors(path: Path, within: Path) -> Iterator[tuple[str, int]]:
    """(tensor name, non-finite count) of each floating tensor of a safetensors file that holds one."""
    with open_regular(path, within=within, what="a pass output checked for finite weights") as handle:
        size = os.fstat(handle.fileno()).st_size
        head = handle.read(8)
        if len(head) != 8:
            raise ValueError("it is too short to be a safetensors file")
        (header_size,) = struct.unpack("<Q", head)
        if header_size > min(_MAX_HEADER, size - 8):
            raise ValueError(f"its header claims {header_size} bytes")
        header = loads_bounded(handle.read(header_size))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        start = 8 + header_size
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            floating = SAFETENSORS_FLOATS.get(str(info.get("dtype")))
            if floating is None:
                continue  # integers, booleans, packed formats: nothing to be non-finite
            begin, end = info["data_offsets"]
            if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= size - start):
                raise ValueError(f"tensor {name} lies outside the file")
            bad = _scan_bytes(handle, start + begin, end - begin, *floating)
            if bad:
                yield name, bad


def _onnx(path: Path, within: Path) -> Iterator[tuple[str, int]]:
    """(tensor name, non-finite count) of each floating tensor of an ONNX graph that holds one;
    external data is read where each tensor points, confined to ``within``."""
    import onnx

    with open_regular(path, within=within, what="a pass output checked for finite weights") as handle:
        model = onnx.load_model_from_string(handle.read())  # external data is not loaded
    for tensor in proto_tensors(model.graph):  # initializers, sparse and constant ones, subgraphs
        floating = ONNX_FLOATS.get(tensor.data_type)
        if floating is None:
            continue
        width, check = floating
        name = tensor.name or "(a constant)"
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = {entry.key: entry.value for entry in tensor.external_data}
            data = confined(path.parent / info["location"], within)
            offset = int(info.get("offset", 0))
            with open_regular(data, within=within, what="external data checked for finite weights") as raw:
                size = os.fstat(raw.fileno()).st_size
                length = int(info["length"]) if "length" in info else size - offset
                if not 0 <= offset <= offset + length <= size:
                    raise ValueError(f"tensor {name} lies outside {data.name}")
                bad = _scan_bytes(raw, offset, length, width, check)
        elif tensor.HasField("raw_data"):
            bits = np.frombuffer(tensor.raw_data, dtype=_UNSIGNED[width], count=len(tensor.raw_data) // width)
            bad = int(np.count_nonzero(check(bits)))
        else:  # typed fields: float_data / double_data hold floats; int32_data holds 16/8-bit codes
            values = np.asarray(list(tensor.float_data) + list(tensor.double_data), dtype=np.float64)
            bad = int(np.count_nonzero(~np.isfinite(values)))
            if width < 4 and tensor.int32_data:
                codes = np.asarray(tensor.int32_data, dtype=np.int64).astype(_UNSIGNED[width])
                bad += int(np.count_nonzero(check(codes)))
        if bad:
            yield name, bad


def first_nonfinite(folder: Path) -> NonFinite | None:
    """The first non-finite weight in the safetensors files and ONNX graphs under ``folder`` (a
    torch checkpoint, a graph or an engine), or None when every weight is finite. Raises
    :class:`~pipeline.core.files.UnsafeFileError` for a file that is not a regular one inside
    ``folder``, and ``ValueError`` for a file that is not what its name says."""
    folder = Path(folder)
    for relative, path in walk_regular(folder, what="a pass output checked for finite weights"):
        if path.suffix == ".safetensors":
            scan = _safetensors
        elif path.suffix == ".onnx":
            scan = _onnx
        else:
            continue
        try:
            for name, bad in scan(path, folder):
                return NonFinite(relative, name, bad)
        except UnsafeFileError:
            raise
        except (ValueError, KeyError, TypeError, OSError) as exc:
            raise ValueError(f"{relative} cannot be checked for finite weights ({exc})") from None
    return None
