"""Observers on known synthetic distributions, histogram bookkeeping, per-channel weights, and
collection on a small ONNX graph (ranges, NaN/inf raise CalibrationError naming the tensor)."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from calibration.observers import (
    FP8_E4M3,
    INT8,
    MAX_BINS,
    Observer,
    TensorStats,
    channel_amax,
    collect_ranges,
    collect_stats,
    compute_amax,
)
from pipeline.core.errors import CalibrationError

LABEL = "/model/model/layers.3/mlp/down_proj/MatMul input"


@pytest.fixture(scope="module")
def outliers() -> tuple[np.ndarray, TensorStats]:
    """A standard gaussian (10^6 values) with 20 outliers of magnitude 30..50, seen in 4 batches."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1_000_000).astype(np.float32)
    x[:20] = rng.choice([-1.0, 1.0], 20) * rng.uniform(30, 50, 20)
    stats = TensorStats("t")
    for batch in np.array_split(x, 4):
        stats.update(batch)
    return x, stats


def test_minmax_is_the_largest_magnitude(outliers: tuple[np.ndarray, TensorStats]) -> None:
    x, stats = outliers
    assert compute_amax(stats, "minmax") == pytest.approx(float(np.abs(x).max()))
    assert (stats.lo, stats.hi) == (float(x.min()), float(x.max())) and stats.count == x.size


def test_percentile_clips_the_outliers(outliers: tuple[np.ndarray, TensorStats]) -> None:
    x, stats = outliers
    amax = compute_amax(stats, "percentile", percentile=99.99)
    exact = float(np.percentile(np.abs(x), 99.99))  # ~3.9 for a standard gaussian
    assert exact <= amax <= exact + 2 * stats.width
    assert compute_amax(stats, "percentile", percentile=100.0) == pytest.approx(stats.amax)


@pytest.mark.parametrize("fmt", [FP8_E4M3, INT8])
def test_mse_clips_below_the_max_and_beats_minmax(outliers: tuple[np.ndarray, TensorStats], fmt) -> None:
    x, stats = outliers
    amax = compute_amax(stats, Observer.mse, fmt)
    assert amax < stats.amax

    def error(threshold: float) -> float:
        return float(((fmt.fake_quant(x, threshold) - x) ** 2).mean())

    assert error(amax) <= error(stats.amax)


def test_int8_clips_harder_than_fp8(outliers: tuple[np.ndarray, TensorStats]) -> None:
    """FP8's floating grid keeps small values precise at a large scale; INT8's uniform grid does not."""
    _, stats = outliers
    assert compute_amax(stats, "mse", INT8) < 0.8 * compute_amax(stats, "mse", FP8_E4M3)
    assert compute_amax(stats, "entropy", INT8) < 0.5 * stats.amax


def test_entropy_is_within_the_histogram(outliers: tuple[np.ndarray, TensorStats]) -> None:
    _, stats = outliers
    amax = compute_amax(stats, "entropy", FP8_E4M3)
    assert 128 * stats.width <= amax <= stats.amax


def test_entropy_keeps_a_uniform_range() -> None:
    """Nothing to clip in a uniform distribution: KL is least at (about) its full range."""
    stats = TensorStats("u")
    stats.update(np.random.default_rng(1).uniform(-1, 1, 200_000).astype(np.float32))
    assert compute_amax(stats, "entropy", INT8) > 0.9
    assert compute_amax(stats, "mse", INT8) > 0.9


def test_histogram_grows_by_bins_and_merges_past_the_limit() -> None:
    stats = TensorStats("g", num_bins=64)
    stats.update(np.linspace(-1, 1, 1000, dtype=np.float32))
    width = stats.width
    stats.update(np.array([3.0], np.float32))  # grows by whole bins of the same width
    assert stats.width == width and len(stats.hist) * width >= 3.0 and stats.hist.sum() == 1001
    stats.update(np.array([1e6], np.float32))  # would need far more than MAX_BINS: merge pairwise
    assert len(stats.hist) <= MAX_BINS and len(stats.hist) * stats.width >= 1e6
    assert stats.hist.sum() == stats.count == 1002 and stats.amax == 1e6


def test_all_zero_batches_then_values() -> None:
    stats = TensorStats("z", num_bins=16)
    stats.update(np.zeros(10, np.float32))
    assert compute_amax(stats, "mse") == 0.0 and compute_amax(stats, "minmax") == 0.0
    stats.update(np.array([0.5, -1.0], np.float32))
    assert stats.hist[0] >= 10 and stats.hist.sum() == 12 and stats.amax == 1.0


def test_stats_round_trip_through_json() -> None:
    stats = TensorStats("r")
    stats.update(np.random.default_rng(2).standard_normal(1000).astype(np.float32))
    again = TensorStats.from_dict(stats.to_dict())
    for observer in Observer:
        assert compute_amax(again, observer) == compute_amax(stats, observer)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_values_raise_naming_the_tensor(bad: float) -> None:
    stats = TensorStats(LABEL)
    values = np.ones(8, np.float32)
    values[3] = bad
    kind = "NaN" if np.isnan(bad) else "inf"
    with pytest.raises(CalibrationError, match=f"^{kind} in calibration statistics of {LABEL}: 1 of 8"):
        stats.update(values, " in calibration batch 2 of 4")


def test_non_finite_stored_statistics_raise() -> None:
    stats = TensorStats(LABEL, lo=float("nan"), hi=1.0, count=4, width=0.5, hist=np.array([4]))
    with pytest.raises(CalibrationError, match=f"NaN in calibration statistics of {LABEL}"):
        compute_amax(stats, "minmax")


def test_fp8_fake_quant_rounds_and_saturates() -> None:
    x = np.array([0.0, 1.0, 1.0625, 1.1875, 448.0, 1000.0, -1000.0], np.float32)
    assert FP8_E4M3.fake_quant(x, 448.0).tolist() == [0.0, 1.0, 1.0, 1.25, 448.0, 448.0, -448.0]
    assert FP8_E4M3.quantize(x, np.float32(1.0)).dtype == ml_dtypes.float8_e4m3fn


def test_channel_amax_per_output_channel() -> None:
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((64, 48)).astype(np.float32)  # [in, out]
    weight[5, 7] = 20.0
    minmax = channel_amax(weight, axis=1)
    assert minmax.shape == (48,) and np.array_equal(minmax, np.abs(weight).max(axis=0))
    percentile = channel_amax(weight, axis=1, observer="percentile", percentile=90.0)
    assert (percentile <= minmax).all() and percentile[7] < 20.0
    heavy = rng.laplace(size=(4096, 16)).astype(np.float32)  # heavy tails: clipping pays off somewhere
    for fmt in (FP8_E4M3, INT8):
        mse, most = channel_amax(heavy, axis=1, observer="mse", fmt=fmt), channel_amax(heavy, axis=1)
        assert (mse <= most).all() and (mse < most).any()
        error = ((fmt.fake_quant(heavy, mse) - heavy) ** 2).sum(axis=0)
        assert (error <= ((fmt.fake_quant(heavy, most) - heavy) ** 2).sum(axis=0)).all()
    with pytest.raises(CalibrationError, match="not available per channel"):
        channel_amax(weight, axis=1, observer="entropy")


# --- collection on a graph --------------------------------------------------------------------


def tiny_graph(folder: Path) -> Path:
    """x -> Sqrt -> MatMul(W) -> y, weights in external data (as our exports); Sqrt(x<0) = NaN."""
    weight = numpy_helper.from_array(np.eye(4, dtype=np.float32) * 2, "W")
    graph = helper.make_graph(
        [helper.make_node("Sqrt", ["x"], ["s"]), helper.make_node("MatMul", ["s", "W"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    path = folder / "model.onnx"
    onnx.save_model(
        model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0
    )
    return path


def test_collect_ranges_records_the_inputs_seen(tmp_path: Path) -> None:
    path = tiny_graph(tmp_path)
    rng = np.random.default_rng(4)
    feeds = [{"x": rng.uniform(0, 9, (16, 4)).astype(np.float32)} for _ in range(3)]
    expected = max(float(np.sqrt(f["x"]).max()) for f in feeds)
    ranges = collect_ranges(path, feeds, ["s", "y"], "minmax", progress=False)
    assert ranges["s"] == pytest.approx(expected, rel=1e-6)
    assert ranges["y"] == pytest.approx(2 * expected, rel=1e-6)
    stats = collect_stats(path, feeds, {"s": "mm input"}, progress=False)
    assert stats["s"].count == 3 * 64 and stats["s"].label == "mm input"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]  # nothing written


def test_nan_activation_raises_calibration_error(tmp_path: Path) -> None:
    path = tiny_graph(tmp_path)
    feeds = [{"x": np.ones((2, 4), np.float32)}, {"x": np.full((2, 4), -1.0, np.float32)}]
    with pytest.raises(CalibrationError, match=f"^NaN in calibration statistics of {LABEL}: .*batch 2 of 2"):
        collect_stats(path, feeds, {"s": LABEL}, total=2, progress=False)


def test_unknown_tensor_and_no_batches_raise(tmp_path: Path) -> None:
    path = tiny_graph(tmp_path)
    with pytest.raises(CalibrationError, match="not found"):
        collect_stats(path, [], ["nope"], progress=False)
    with pytest.raises(CalibrationError, match="no calibration batches"):
        collect_stats(path, [], ["s"], progress=False)
