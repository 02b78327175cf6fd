"""Calibration data and observers that serve quantization passes (filled by the quantization
issue). It imports no pass."""
