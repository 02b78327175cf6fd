"""What GPU stack this machine has: the NVIDIA GPU (through torch's CUDA build), TensorRT's
Python package, and ONNX Runtime's GPU execution providers.

GPU targets call these before anything long runs (``Pass.preflight``), so ``target=tensorrt``
on a machine without a GPU or without TensorRT stops at once with one line saying what is
missing and how to get it, not after an hour of quantization. None of this imports
``tensorrt`` at module import: the package stays importable on CPU-only machines.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from dataclasses import asdict, dataclass
from typing import Any

from pipeline.core.errors import ConfigError

GPU_INSTALL = (
    'pip install ".[gpu]" --extra-index-url https://pypi.nvidia.com on a machine with an NVIDIA GPU '
    '(".[gpu-cu12]" for a driver older than R580)'
)
# TensorRT's libraries are wheels on NVIDIA's index; the PyPI packages of the same name are sdists
# that fetch them from there at install time (wheel-stub), which fails on a machine that cannot
# reach it, leaving the bindings without their libraries.
LIBS_INSTALL = "pip install --extra-index-url https://pypi.nvidia.com {libs}"
ORT_GPU_INSTALL = "pip uninstall -y onnxruntime && pip install onnxruntime-gpu==1.31.1"


@dataclass(frozen=True)
class GpuInfo:
    """The GPU a build ran on, as recorded in a TensorRT engine's metadata."""

    name: str
    compute_capability: str  # "9.0"
    cuda: str  # the CUDA runtime torch was built with
    memory_gib: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gpu_info(device: int = 0) -> GpuInfo:
    """The CUDA GPU ``device``, or a :class:`ConfigError` naming what is missing."""
    try:
        import torch
    except ImportError:  # torch is a dependency; kept for a clear message in broken installs
        raise ConfigError(f"no torch installed: {GPU_INSTALL}") from None
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
        raise ConfigError(
            f"no CUDA GPU is visible ({build}): GPU targets need an NVIDIA GPU, its driver and a "
            f"CUDA build of torch; {GPU_INSTALL}, or use target=ort-cpu"
        )
    props = torch.cuda.get_device_properties(device)
    return GpuInfo(
        name=str(props.name),
        compute_capability=f"{props.major}.{props.minor}",
        cuda=str(torch.version.cuda),
        memory_gib=round(props.total_memory / 2**30, 1),
    )


def tensorrt_module() -> Any:
    """The ``tensorrt`` module (TensorRT 11 or newer), or a :class:`ConfigError`."""
    try:
        trt = importlib.import_module("tensorrt")
    except ImportError as exc:
        library = _missing_library(exc)
        if library is None:
            raise ConfigError(
                f"TensorRT is not installed ({exc}): target=tensorrt needs it; {GPU_INSTALL}"
            ) from None
        raise ConfigError(
            f"TensorRT's Python bindings are installed but its libraries are not ({library} is "
            f"missing): {LIBS_INSTALL.format(libs=_matching_libs())}"
        ) from None
    except OSError as exc:  # ctypes could not load a library the bindings' __init__ opens
        raise ConfigError(
            f"TensorRT's Python bindings are installed but its libraries do not load ({exc}): "
            f"{LIBS_INSTALL.format(libs=_matching_libs())}"
        ) from None
    major = int(str(getattr(trt, "__version__", "0")).split(".")[0] or 0)
    if major < 11:
        raise ConfigError(
            f"TensorRT {trt.__version__} is installed; target=tensorrt builds strongly typed networks "
            f"for TensorRT 11 or newer: {GPU_INSTALL}"
        )
    return trt


def _missing_library(exc: ImportError) -> str | None:
    """The shared library an import could not open ("libnvinfer.so.11: cannot open shared object
    file"), or None when the import failed for another reason (no such module)."""
    message = str(exc)
    if isinstance(exc, ModuleNotFoundError) or "cannot open shared object" not in message:
        return None
    return message.split(":", 1)[0].strip()


def _matching_libs() -> str:
    """The libraries wheel that matches the installed bindings (CUDA flavour and version)."""
    for cuda in ("cu13", "cu12"):
        try:
            return f"tensorrt-{cuda}-libs=={importlib.metadata.version(f'tensorrt-{cuda}-bindings')}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "tensorrt-cu13-libs (tensorrt-cu12-libs for a driver older than R580), at the bindings' version"


@functools.cache
def require_tensorrt() -> tuple[str, GpuInfo]:
    """TensorRT's version and the GPU, once per process; a :class:`ConfigError` if either is
    missing."""
    trt = tensorrt_module()
    return str(trt.__version__), gpu_info()


def require_ort_provider(provider: str) -> GpuInfo:
    """The GPU, after checking that ONNX Runtime was built with ``provider``."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if provider not in available:
        raise ConfigError(
            f"this ONNX Runtime ({ort.__version__}) has no {provider} (it has {', '.join(available)}): "
            f"{ORT_GPU_INSTALL}"
        )
    return gpu_info()
