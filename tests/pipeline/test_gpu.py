"""pipeline/gpu.py on a machine without a GPU (every machine here): each probe refuses with one
line naming what is missing and how to get it; benchmarks/gpu_check.py stops the same way."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.gpu import gpu_info, require_ort_provider, require_tensorrt, tensorrt_module

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("tensorrt") is not None,
    reason="a GPU or TensorRT is here: these tests check the refusals of a machine without them",
)


def test_no_gpu_is_one_line_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="no CUDA GPU is visible") as info:
        gpu_info()
    assert "target=ort-cpu" in str(info.value) and "\n" not in str(info.value)


def test_no_tensorrt_is_one_line_with_the_install_command() -> None:
    with pytest.raises(ConfigError, match=r'TensorRT is not installed .*pip install "\.\[gpu\]"'):
        tensorrt_module()
    with pytest.raises(ConfigError, match="TensorRT is not installed"):
        require_tensorrt()


def test_cpu_onnxruntime_has_no_gpu_provider() -> None:
    with pytest.raises(ConfigError, match=r"has no CUDAExecutionProvider .*onnxruntime-gpu"):
        require_ort_provider("CUDAExecutionProvider")


def test_gpu_check_script_stops_at_once_without_a_gpu(tmp_path: Path) -> None:
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path / "out")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: TensorRT is not installed"), result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()  # nothing built
