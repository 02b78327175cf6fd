"""pipeline.device / pipeline.torch_dtype: validation, resolution on this machine, and their
place in the cache key and the record of the passes that honour them."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import PipelineSettings
from pipeline.core.artifacts import Artifact
from pipeline.core.cache import Cache
from pipeline.core.config import build_config
from pipeline.core.errors import ConfigError
from pipeline.core.manager import PassManager
from pipeline.core.placement import CPU_FLOAT32, Placement, ResolvedPlacement
from tests.pipeline.passes_for_tests import AppendPass, ToEnginePass, ToGraphPass


class PlacedAppendPass(AppendPass):
    """An AppendPass that honours both knobs and reports the dtype it was given."""

    placement_knobs = ("device", "torch_dtype")

    def run(self, source: Artifact, out_dir: Path) -> dict:
        return {**super().run(source, out_dir), "ran_in": self.placement.torch_dtype}


def placed_recipe(device: str, dtype: str) -> list:
    passes = [PlacedAppendPass(text="a"), AppendPass(text="b"), ToGraphPass(), ToEnginePass()]
    for step in passes:
        step.placement_request = Placement(device, dtype)
    return passes


@pytest.mark.parametrize(
    ("device", "dtype", "message"),
    [
        ("gpu", "auto", r"pipeline.device=gpu: must be auto, cpu, cuda or cuda:N"),
        ("cuda:x", "auto", r"pipeline.device=cuda:x"),
        ("cpu", "fp16", r"pipeline.torch_dtype=fp16: must be one of auto, float32, bfloat16, float16"),
    ],
)
def test_bad_knobs_are_one_line_config_errors(device: str, dtype: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(PipelineSettings, {"device": device, "torch_dtype": dtype})


def test_auto_is_the_cpu_in_float32_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    assert Placement().resolve() == CPU_FLOAT32
    assert Placement("cpu", "bfloat16").resolve() == ResolvedPlacement("cpu", "bfloat16")
    with pytest.raises(
        ConfigError, match=r"pipeline.device=cuda: torch sees no CUDA device .* use pipeline.device=cpu"
    ):
        Placement("cuda", "auto").resolve()


def test_a_cuda_request_without_cuda_fails_before_any_pass_runs(source: Artifact, tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(ConfigError, match=r"pipeline\.device=cuda:1"):
        PassManager(placed_recipe("cuda:1", "auto"), Cache(tmp_path / "cache")).run(source)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [".staging"]


def test_dtype_is_in_the_key_and_record_of_passes_that_honour_it(source: Artifact, tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache")
    _, records = PassManager(placed_recipe("cpu", "float32"), cache).run(source)
    assert records[0].placement == {"device": "cpu", "torch_dtype": "float32"}
    assert records[1].placement == {}  # AppendPass declares no knob
    _, repeat = PassManager(placed_recipe("auto", "auto"), cache).run(source)  # auto = cpu float32 here
    assert [r.cache_hit for r in repeat] == [True] * 4
    _, bf16 = PassManager(placed_recipe("cpu", "bfloat16"), cache).run(source)
    assert [r.cache_hit for r in bf16] == [False, True, True, True]  # same bytes further on
    assert bf16[0].placement == {"device": "cpu", "torch_dtype": "bfloat16"}
    assert (records[0].metrics["ran_in"], bf16[0].metrics["ran_in"]) == ("float32", "bfloat16")
    assert bf16[0].cache_key != records[0].cache_key
