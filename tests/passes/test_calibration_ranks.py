"""Data-parallel calibration (``calibration.num_processes=2`` under ``accelerate launch``, gloo on
this CPU) on the tiny Llama: each rank takes a contiguous run of one process's batches and the
statistics are reduced across ranks (GPTQ's ``X^T X`` and AWQ's token sums summed, SmoothQuant's
per-channel maxima max-reduced), so 2 processes give one process's scales; passes that cannot split
their windows refuse with one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from passes.awq import AwqPass
from passes.formats.int4 import INT4_DIR, load_params
from passes.gptq import GptqPass
from passes.int4 import EXTRAS_DIR
from passes.smoothquant import SmoothQuantPass, read_activations
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.base import Pass
from pipeline.core.errors import ConfigError, PassError
from pipeline.core.manager import validate
from tests.conftest import run_pass

INT4_CALIBRATION = {"num_samples": 16, "seq_len": 64}  # 2 batches of 8 windows: one a process
TWO_INT4 = {**INT4_CALIBRATION, "num_processes": 2}
SMOOTH_CALIBRATION = {"num_samples": 4, "seq_len": 32}
SMOOTH = {"alpha": 0.6, "weight_only": [], "batch_size": 2}


def run(step: Pass, source: Artifact, out: Path) -> tuple[Artifact, dict]:
    return run_pass(step, source, out)


def same_int4(one: Artifact, two: Artifact) -> float:
    """Assert equal recorded info and scales (to 1e-5 relative); the share of equal codes."""
    import torch

    info_one, layers_one = load_params(one.path / EXTRAS_DIR / INT4_DIR)
    info_two, layers_two = load_params(two.path / EXTRAS_DIR / INT4_DIR)
    assert info_one == info_two  # the recorded config leaves the process count out
    assert layers_one.keys() == layers_two.keys() and len(layers_one) == 15
    codes = same = 0
    for name, layer in layers_one.items():
        torch.testing.assert_close(layers_two[name].scales, layer.scales, rtol=1e-5, atol=1e-8)
        codes += layer.codes.numel()
        same += int((layers_two[name].codes == layer.codes).sum())
    return same / codes


def test_gptq_in_two_processes_gives_one_process_scales(tiny_source: Artifact, tmp_path: Path) -> None:
    """The Hessian sums of two halves equal the whole's up to the order of float sums, so the
    GPTQ solve sees the same matrix to ~1e-7 relative: scales agree to 1e-5 and all but a few
    codes (a value on a rounding boundary may round the other way) are equal."""
    one, one_metrics = run(
        GptqPass(group_size=32, calibration=INT4_CALIBRATION), tiny_source, tmp_path / "one"
    )
    two, two_metrics = run(GptqPass(group_size=32, calibration=TWO_INT4), tiny_source, tmp_path / "two")
    assert (one_metrics["calibration"]["processes"], one_metrics["calibration"]["windows"]) == (1, 16)
    assert (two_metrics["calibration"]["processes"], two_metrics["calibration"]["windows"]) == (2, 8)
    assert one_metrics["calibration_tokens"] == two_metrics["calibration_tokens"] == 16 * 64
    assert same_int4(one, two) > 0.999


@pytest.mark.parametrize("sketch_rows", [32, 1024], ids=["sketch", "gram"])
def test_awq_in_two_processes_gives_one_process_scales(
    tiny_source: Artifact, tmp_path: Path, sketch_rows: int
) -> None:
    """AWQ's linear objective: activation means, the error statistics (the Gram matrix, or the
    CountSketch with each rank's buckets drawn where one process draws them) and the clip blocks
    are sums over tokens, summed across ranks: the same scale and clip choices as one process."""
    settings = {"group_size": 32, "sketch_rows": sketch_rows}
    one, _ = run(AwqPass(**settings, calibration=INT4_CALIBRATION), tiny_source, tmp_path / "one")
    two, metrics = run(AwqPass(**settings, calibration=TWO_INT4), tiny_source, tmp_path / "two")
    assert (metrics["calibration"]["processes"], metrics["calibration"]["windows"]) == (2, 8)
    assert same_int4(one, two) > 0.999


def test_smoothquant_in_two_processes_gives_one_process_scales(tiny_source: Artifact, tmp_path: Path) -> None:
    """Per-channel maxima reduce exactly: the ranges and the smoothed weights equal one process's
    (up to the last bit of a matmul run on another batch shape)."""
    import torch

    from pipeline.core.torch_model import load_causal_lm

    one, _ = run(SmoothQuantPass(**SMOOTH, calibration=SMOOTH_CALIBRATION), tiny_source, tmp_path / "one")
    two_calibration = {**SMOOTH_CALIBRATION, "num_processes": 2}
    two, metrics = run(SmoothQuantPass(**SMOOTH, calibration=two_calibration), tiny_source, tmp_path / "two")
    assert metrics["calibration_tokens"] == 4 * 32 and metrics["fp32_parity"]["top1_agreement"] == 1.0
    assert (metrics["calibration"]["processes"], metrics["calibration"]["windows"]) == (2, 2)
    ranges_one, ranges_two = read_activations(one.path), read_activations(two.path)
    assert ranges_one["calibration"] == ranges_two["calibration"]  # no process count recorded
    assert ranges_one["absmax"].keys() == ranges_two["absmax"].keys()
    for name, value in ranges_one["absmax"].items():
        assert ranges_two["absmax"][name] == pytest.approx(value, rel=1e-6), name
    weights_one, weights_two = load_causal_lm(one.path).state_dict(), load_causal_lm(two.path).state_dict()
    for name, tensor in weights_one.items():
        torch.testing.assert_close(weights_two[name], tensor, rtol=1e-6, atol=1e-7)


def test_fp8_activation_statistics_in_two_processes_are_one_process_statistics(
    tiny_graph: Artifact, tmp_path: Path
) -> None:
    """Each rank runs its windows in its own ONNX Runtime session, its histograms started at the
    bins rank 0's first window set; merged (min, max, counts, histograms coarsened to the widest
    rank's bins and summed), they are the statistics one process gathers over the same windows,
    and so is every observer's range."""
    from calibration.observers import Observer, compute_amax
    from passes.fp8 import CalibratePass, load_stats

    def calibrate(out: Path, **calibration: int) -> tuple[Artifact, dict]:
        step = CalibratePass(calibration={"num_samples": 6, "seq_len": 32, **calibration})
        out.mkdir()
        metrics = step.run(tiny_graph, out)
        return Artifact.from_dir(Kind.GRAPH, out), metrics

    one, one_metrics = calibrate(tmp_path / "one")
    two, two_metrics = calibrate(tmp_path / "two", num_processes=2)
    assert one_metrics == {k: v for k, v in two_metrics.items() if k != "ranks"}
    stats_one, stats_two = load_stats(one.path), load_stats(two.path)
    assert stats_one.keys() == stats_two.keys() and len(stats_one) == 9  # 4 inputs a block + the head
    grown = 0
    for name, a in stats_one.items():
        b = stats_two[name]
        assert (a.count, a.width, len(a.hist)) == (b.count, b.width, len(b.hist)), name
        assert a.lo == pytest.approx(b.lo, rel=1e-6) and a.hi == pytest.approx(b.hi, rel=1e-6), name
        # A value on a bin edge may land in the neighbouring bin of a finer histogram.
        assert int(abs(a.hist - b.hist).sum()) <= max(2, a.count // 100_000), name
        grown += len(a.hist) > a.num_bins  # some histograms outgrew the first window's range
        for observer in Observer:
            assert compute_amax(b, observer) == pytest.approx(compute_amax(a, observer), rel=1e-3), (
                name,
                observer,
            )
    assert grown, "no histogram grew past the first window's bins: the merge is not exercised"


def test_a_pass_that_calibrates_in_one_process_refuses_more(tiny_source: Artifact, tmp_path: Path) -> None:
    def check(step: object) -> None:
        step.config_group = "quant"  # type: ignore[attr-defined]
        validate([step], Kind.TORCH, final_kind=None)  # type: ignore[list-item]

    one_process = (
        r"^quant\.calibration\.num_processes=2: pass 'awq' calibrates in one process with this config"
    )
    with pytest.raises(ConfigError, match=one_process):
        check(AwqPass(group_size=32, objective="block", calibration=TWO_INT4))
    with pytest.raises(
        ConfigError, match=r"exceeds quant\.calibration\.num_samples=1: every process needs a window"
    ):
        check(GptqPass(group_size=32, calibration={"num_samples": 1, "num_processes": 2}))
    cores = len(os.sched_getaffinity(0))
    many = {"num_samples": 64, "num_processes": cores + 1}
    with pytest.raises(PassError, match=rf"^quant\.calibration\.num_processes={cores + 1} is out of range"):
        check(GptqPass(group_size=32, calibration=many))
    check(GptqPass(group_size=32, calibration=TWO_INT4))
    check(AwqPass(group_size=32, calibration=TWO_INT4))
    # 8 windows are one batch of 8: a second process would have none (said from inside the rank).
    one_batch = {**TWO_INT4, "num_samples": 8}
    with pytest.raises(PassError, match=r"^quant\.calibration\.num_processes=2: 8 windows make 1 batch"):
        run(GptqPass(group_size=32, calibration=one_batch), tiny_source, tmp_path / "out")


def test_int8_from_the_command_line_in_two_processes_is_the_cached_one_process_output(
    tiny_llama: Path, tmp_path: Path
) -> None:
    from tests.pipeline.test_main import run_pipeline

    recipe = ["quant=int8", "quant.calibration.num_samples=16", "quant.calibration.seq_len=32", "bench=none"]
    result = run_pipeline(tiny_llama, tmp_path, "two", *recipe, "quant.calibration.num_processes=2")
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "manifest.json").read_text())["passes"]
    assert two[0]["name"] == "smoothquant" and not two[0]["cache_hit"]
    assert two[0]["config"]["calibration"]["num_processes"] == 2
    assert two[0]["metrics"]["calibration"]["windows"] == 8 and two[0]["metrics"]["ranks"]["processes"] == 2
    result = run_pipeline(tiny_llama, tmp_path, "one", *recipe)
    assert result.returncode == 0, result.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "manifest.json").read_text())["passes"]
    assert all(step["cache_hit"] for step in one) and one[-1]["output_digest"] == two[-1]["output_digest"]
