"""The INT8 format of the W8A8 recipe: symmetric codes in [-127, 127] (no zero point), per output
channel for weights and per tensor for activations, as ONNX ``QuantizeLinear``/``DequantizeLinear``
and TensorRT's explicit quantization take them (SmoothQuant, Xiao et al. 2023, section 3).
"""

from __future__ import annotations

import numpy as np

QMAX = 127


def weight_params(weight_t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel symmetric INT8 of a [in, out] weight: (int8 codes [in, out], scales [out])."""
    weight_t = np.asarray(weight_t, dtype=np.float32)
    absmax = np.abs(weight_t).max(axis=0)
    scale = np.where(absmax > 0, absmax / QMAX, 1.0).astype(np.float32)
    codes = np.clip(np.rint(weight_t / scale), -QMAX, QMAX).astype(np.int8)
    return codes, scale


def activation_scale(absmax: float) -> np.float32:
    """Static per-tensor symmetric INT8 scale of an activation whose calibrated range is ``absmax``."""
    return np.float32(absmax / QMAX) if absmax > 0 else np.float32(1.0)
