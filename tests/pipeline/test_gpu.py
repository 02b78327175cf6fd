"""pipeline/core/gpu.py on a machine without a GPU (every machine here): each probe refuses with one
line naming what is missing and how to get it; benchmarks/gpu_check.py stops the same way."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.core.errors import ConfigError
from pipeline.core.gpu import gpu_info, require_ort_provider, require_tensorrt, tensorrt_module

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
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path / "out")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: TensorRT is not installed"), result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()  # nothing built


def _tensorrt_package(root: Path, body: str) -> None:
    package = root / "tensorrt"
    package.mkdir()
    (package / "__init__.py").write_text(body)


def test_bindings_without_their_libraries_say_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bindings wheel installs from PyPI but its libraries come from NVIDIA's index: an import
    that fails on a missing library names it and the libraries' install, not "not installed".
    The package raises what the real tensorrt-cu13-bindings 11.4 raises here (its extension links
    against libnvonnxparser.so.11), and on the ctypes path what ctypes really raises."""
    real_error = "libnvonnxparser.so.11: cannot open shared object file: No such file or directory"
    _tensorrt_package(tmp_path, f"raise ImportError({real_error!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        tensorrt_module()
    message = str(info.value)
    assert message.startswith("TensorRT's Python bindings are installed but its libraries are not")
    assert "libnvonnxparser.so.11 is missing" in message
    assert "--extra-index-url https://pypi.nvidia.com" in message
    assert "tensorrt-cu13-libs" in message and "\n" not in message


def test_a_library_ctypes_cannot_load_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tensorrt_package(tmp_path, 'import ctypes\nctypes.CDLL("libnvinfer_no_such.so.11")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"libraries do not load \(libnvinfer_no_such\.so\.11: cannot open"):
        tensorrt_module()
