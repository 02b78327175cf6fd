"""Where and in what dtype the torch passes compute: ``pipeline.device`` and ``pipeline.torch_dtype``.

``auto`` takes the first CUDA device when torch sees one (else the CPU) and, for the dtype,
bfloat16 on a GPU that supports it (float16 on one that does not) and float32 on the CPU, so a
CPU run computes exactly as before these knobs existed. Statistics that decide scales (ranges,
histograms, Hessians, KL) are accumulated in float32 whatever the compute dtype: the passes cast
before they accumulate.

The placement enters a pass's cache key only through the knobs the pass declares it honours
(:attr:`pipeline.core.base.Pass.placement_knobs`), and only as the device *type* (``cuda:0`` and
``cuda:1`` compute alike; a GPU and the CPU may differ in the last bits, so they are kept apart).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from pipeline.core.errors import ConfigError

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def check_device(value: Any) -> None:
    if not isinstance(value, str) or not DEVICE_PATTERN.match(value):
        raise ConfigError(f"pipeline.device={value}: must be auto, cpu, cuda or cuda:N")


def check_dtype(value: Any) -> None:
    if value not in DTYPES:
        raise ConfigError(f"pipeline.torch_dtype={value}: must be one of {', '.join(DTYPES)}")


@dataclass(frozen=True)
class Placement:
    """The requested device and dtype (``auto`` allowed); :meth:`resolve` makes them concrete."""

    device: str = "auto"
    torch_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_device(self.device)
        check_dtype(self.torch_dtype)

    def resolve(self) -> ResolvedPlacement:
        """The concrete device and dtype on this machine; a CUDA request without a visible CUDA
        device is a one-line ConfigError."""
        return _resolve(self.device, self.torch_dtype)


@dataclass(frozen=True)
class ResolvedPlacement:
    device: str  # "cpu" or "cuda:N"
    torch_dtype: str  # "float32" | "bfloat16" | "float16"

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def dtype(self) -> Any:
        """The ``torch.dtype``."""
        import torch

        return getattr(torch, self.torch_dtype)

    @property
    def torch_device(self) -> Any:
        import torch

        return torch.device(self.device)

    def key(self, knobs: tuple[str, ...]) -> dict[str, str]:
        """What enters the cache key of a pass that honours ``knobs``."""
        values = {"device": self.device_type, "torch_dtype": self.torch_dtype}
        return {knob: values[knob] for knob in knobs}

    def to_dict(self) -> dict[str, str]:
        return {"device": self.device, "torch_dtype": self.torch_dtype}


CPU_FLOAT32 = ResolvedPlacement("cpu", "float32")


@functools.cache
def _resolve(device: str, torch_dtype: str) -> ResolvedPlacement:
    import torch

    if device == "auto":
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"pipeline.device={device}: torch sees no CUDA device on this machine "
                "(a CPU build of torch, or no GPU): use pipeline.device=cpu or auto"
            )
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"pipeline.device={device}: only {torch.cuda.device_count()} CUDA device(s) are "
                f"visible: use cuda:0 ... cuda:{torch.cuda.device_count() - 1}"
            )
        device = f"cuda:{index}"
    if torch_dtype == "auto":
        if device == "cpu":
            torch_dtype = "float32"
        else:
            torch_dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return ResolvedPlacement(device, torch_dtype)
