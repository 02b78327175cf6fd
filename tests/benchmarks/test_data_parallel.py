"""``python -m benchmarks.data_parallel`` on the tiny Llama: a calibration row in 2 processes reports rank 0's
share of the windows and its forward time, measured, not assumed."""

from __future__ import annotations

from pathlib import Path

from benchmarks import data_parallel


def test_a_two_process_calibration_row_is_rank_zeros_share(tiny_llama: Path) -> None:
    one, two = (data_parallel.calibrate(tiny_llama, "smoothquant", processes) for processes in (1, 2))
    assert (one["processes"], one["windows"]) == (1, 64) and (two["processes"], two["windows"]) == (2, 32)
    assert two["forward_seconds"] > 0 and two["forward_cpu_seconds"] > 0 and two["seconds"] > 0
