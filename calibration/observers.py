"""Range observers for static quantization: minmax, percentile, MSE and entropy (KL) calibration.

An observer turns the values a tensor took on calibration data into one clipping threshold
``amax`` (symmetric: the quantizer maps ``[-amax, amax]`` onto the format's range, so the scale
is ``amax / format.max``). Activations are observed per tensor; weights may also be observed
per channel (:func:`channel_amax`).

- **minmax**: the largest magnitude seen (ModelOpt's ``max`` calibrator, ORT's MinMaxCalibrater
  with ``symmetric=True``).
- **percentile**: the ``p``-th percentile of ``|x|`` from a histogram (ORT's
  PercentileCalibrater with ``symmetric=True``; ModelOpt ``_compute_amax_percentile``).
- **mse**: the candidate threshold that minimizes the quantization mean-squared error of the
  histogram *for the target format* (ModelOpt ``_compute_amax_mse``, which evaluates FP8 E4M3 with
  ``scaled_e4m3``; ORT has no MSE calibrator).
- **entropy**: Migacz 2017, "8-bit Inference with TensorRT" (GTC S7310): the threshold whose
  clipped-and-quantized histogram has the least KL divergence from the clipped reference. For
  INT8 the quantized levels are 128 uniform buckets of ``|x|`` (as in TensorRT and ModelOpt);
  for FP8 E4M3 they are the bins that round to the same FP8 value, since FP8's grid is not
  uniform (Micikevicius et al. 2022, "FP8 Formats for Deep Learning").

Histograms are of ``|x|`` with uniform bins starting at 0 that grow by whole bins when a later
batch exceeds the range (ModelOpt ``HistogramCalibrator``), merged pairwise if they would pass
``MAX_BINS``. Sources: NVIDIA TensorRT "Working with Quantized Types" / ModelOpt calibration
docs and ``modelopt/torch/quantization/calib/histogram.py``; ONNX Runtime
``onnxruntime/quantization/calibrate.py``; ONNX QuantizeLinear/DequantizeLinear (opset 19+)
for the FP8 rounding (round to nearest even, saturate to +-448).

Collection runs the ONNX graph itself: :func:`collect_stats` adds the requested tensors as
graph outputs (ORT's HistogramCalibrater augmentation), runs ONNX Runtime on each feed and
folds the values into histograms. We do not call ORT's calibrator classes directly: their
constructor writes ``<model>-inferred.onnx`` beside the input model (ours is an immutable cache
entry) and re-saves every weight; MinMaxCalibrater merges with ``np.nanmax`` after ORT's
``ReduceMax``, whose NaN result depends on element order ([1, nan, 3] -> 3, [nan, 1, 3] -> nan,
ORT 1.32), so a NaN activation could pass unnoticed; and its HistogramCollector prints per
batch. Non-finite values raise :class:`~pipeline.core.errors.CalibrationError` naming the tensor.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from pipeline.core.distributed import Group
from pipeline.core.errors import CalibrationError

__all__ = [
    "FORMATS",
    "FP8_E4M3",
    "INT8",
    "Format",
    "Observer",
    "TensorStats",
    "channel_amax",
    "collect_ranges",
    "collect_stats",
    "compute_amax",
    "entropy_amax",
    "mse_amax",
    "percentile_amax",
]

DEFAULT_BINS = 2048
MAX_BINS = 1 << 15  # a histogram past this many bins is merged pairwise (outliers far from the bulk)
START_BIN = 128  # smallest threshold the histogram searches consider, in bins (TensorRT/ModelOpt)
MAX_CANDIDATES = 512  # thresholds tried by mse/entropy (strided above this)


class Observer(enum.StrEnum):
    minmax = "minmax"
    percentile = "percentile"
    mse = "mse"
    entropy = "entropy"


@dataclass(frozen=True)
class Format:
    """A symmetric quantized number format: its largest magnitude and its rounding."""

    name: str
    max_value: float

    def scale(self, amax: float | np.ndarray) -> Any:
        """The quantization scale for threshold ``amax`` (a zero range gets scale 1)."""
        amax = np.asarray(amax, dtype=np.float32)
        return np.where(amax > 0, amax / np.float32(self.max_value), np.float32(1.0)).astype(np.float32)

    def quantize(self, x: np.ndarray, scale: Any) -> np.ndarray:
        """ONNX QuantizeLinear: ``saturate(round(x / scale))`` in this format's numpy type."""
        y = np.clip(
            np.asarray(x, np.float32) / np.asarray(scale, np.float32), -self.max_value, self.max_value
        )
        if self.name == "int8":
            return np.rint(y).astype(np.int8)
        return y.astype(ml_dtypes.float8_e4m3fn)  # round to nearest even (ml_dtypes, as ONNX)

    def fake_quant(self, x: np.ndarray, amax: Any) -> np.ndarray:
        """Quantize then dequantize ``x`` with threshold ``amax`` (broadcasting)."""
        scale = self.scale(amax)
        return self.quantize(x, scale).astype(np.float32) * scale

    def codes(self, x: np.ndarray, amax: float) -> np.ndarray:
        """Integer id of the quantized value each element of ``x >= 0`` rounds to (0..255)."""
        q = self.quantize(x, self.scale(amax))
        return q.view(np.uint8).astype(np.int64) if self.name != "int8" else q.astype(np.int64)


FP8_E4M3 = Format("float8e4m3fn", 448.0)
INT8 = Format("int8", 127.0)
FORMATS = {"fp8_e4m3": FP8_E4M3, "float8e4m3fn": FP8_E4M3, "int8": INT8}


def _format(fmt: str | Format) -> Format:
    if isinstance(fmt, Format):
        return fmt
    if fmt not in FORMATS:
        raise CalibrationError(f"unknown quantization format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


@dataclass
class TensorStats:
    """What calibration keeps of one tensor: min, max, count and a histogram of ``|x|``.

    Bin ``k`` covers ``[k * width, (k + 1) * width)``; the histogram grows by whole bins when a
    batch exceeds its range and halves its resolution past ``MAX_BINS``.
    """

    label: str
    num_bins: int = DEFAULT_BINS
    lo: float = math.inf
    hi: float = -math.inf
    count: int = 0
    width: float = 0.0  # 0 until a non-zero value arrives
    hist: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    zeros_pending: int = 0  # values seen while every value so far was exactly 0

    @property
    def amax(self) -> float:
        return max(abs(self.lo), abs(self.hi)) if self.count else 0.0

    def update(self, x: np.ndarray, where: str = "") -> None:
        x = np.asarray(x, dtype=np.float32).ravel()
        if x.size == 0:
            return
        lo, hi = float(x.min()), float(x.max())  # min/max propagate NaN
        if not (math.isfinite(lo) and math.isfinite(hi)):
            bad = int((~np.isfinite(x)).sum())
            kind = "NaN" if np.isnan(x).any() else "inf"
            raise CalibrationError(
                f"{kind} in calibration statistics of {self.label}: {bad} of {x.size} values are not "
                f"finite{where}; the graph yields non-finite activations on the calibration text "
                "(check the source checkpoint and the passes before quantization)"
            )
        self.lo, self.hi = min(self.lo, lo), max(self.hi, hi)
        self.count += x.size
        amax = max(abs(lo), abs(hi))
        if self.width == 0.0:
            if amax == 0.0:
                self.zeros_pending += x.size
                return
            self.width = amax / self.num_bins
            self.hist = np.zeros(self.num_bins, np.int64)
            self.hist[0] += self.zeros_pending
            self.zeros_pending = 0
        self._grow(amax)
        top = len(self.hist) * self.width
        hist, _ = np.histogram(np.abs(x), bins=len(self.hist), range=(0.0, top))
        self.hist += hist

    def _grow(self, amax: float) -> None:
        needed = max(len(self.hist), math.ceil(amax / self.width))
        while needed * self.width < amax:  # float rounding at the top edge
            needed += 1
        while needed > MAX_BINS:
            hist = self.hist if len(self.hist) % 2 == 0 else np.append(self.hist, 0)
            self.hist = hist.reshape(-1, 2).sum(axis=1)
            self.width *= 2
            needed = math.ceil(amax / self.width)
            while needed * self.width < amax:
                needed += 1
        if needed > len(self.hist):
            self.hist = np.concatenate([self.hist, np.zeros(needed - len(self.hist), np.int64)])

    def start_at(self, width: float) -> None:
        """Begin with bins of ``width``, as if the first non-zero batch had set them (a rank that
        does not hold the first batch takes the width from the rank that does)."""
        if self.count or self.width:
            raise ValueError(f"{self.label}: the histogram has started already")
        self.width = width
        self.hist = np.zeros(self.num_bins, np.int64)

    def coarsened(self, width: float) -> np.ndarray:
        """The histogram at ``width``, a power-of-two multiple of this one's (bins start at 0, so
        pairs of bins merge exactly, as ``_grow`` merges them)."""
        hist, current = self.hist, self.width
        while current < width:
            hist = (hist if len(hist) % 2 == 0 else np.append(hist, 0)).reshape(-1, 2).sum(axis=1)
            current *= 2
        if current != width:
            raise ValueError(f"{self.label}: bin width {self.width} does not divide {width}")
        return hist

    def edges(self) -> np.ndarray:
        return np.arange(len(self.hist) + 1, dtype=np.float64) * self.width

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "num_bins": self.num_bins,
            "lo": self.lo,
            "hi": self.hi,
            "count": self.count,
            "width": self.width,
            "zeros_pending": self.zeros_pending,
            "hist": self.hist.tolist(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorStats:
        return cls(
            label=data["label"],
            num_bins=int(data["num_bins"]),
            lo=float(data["lo"]),
            hi=float(data["hi"]),
            count=int(data["count"]),
            width=float(data["width"]),
            hist=np.asarray(data["hist"], dtype=np.int64),
            zeros_pending=int(data.get("zeros_pending", 0)),
        )


# --- thresholds from a histogram --------------------------------------------------------------


def _candidates(num_bins: int, start_bin: int) -> np.ndarray:
    """Threshold candidates in bins (upper edges), at most MAX_CANDIDATES, always incl. the top."""
    start = min(start_bin, num_bins)
    stride = max(1, math.ceil((num_bins - start + 1) / MAX_CANDIDATES))
    found = np.arange(start, num_bins + 1, stride)
    return np.unique(np.append(found, num_bins))


def percentile_amax(stats: TensorStats, percentile: float = 99.99) -> float:
    """Upper edge of the bin where the cdf of ``|x|`` reaches ``percentile`` (capped at the max)."""
    if not 0.0 < percentile <= 100.0:
        raise CalibrationError(f"percentile must be in (0, 100] (got {percentile})")
    total = stats.hist.sum()
    if stats.width == 0.0 or total == 0:
        return 0.0
    cdf = np.cumsum(stats.hist) / total
    index = int(np.searchsorted(cdf, percentile / 100.0 - 1e-12))
    return float(min((index + 1) * stats.width, stats.amax))


def mse_amax(stats: TensorStats, fmt: str | Format = FP8_E4M3, start_bin: int = START_BIN) -> float:
    """The threshold minimizing ``sum(hist * (fake_quant(center) - center)^2)`` for ``fmt``."""
    fmt = _format(fmt)
    if stats.width == 0.0:
        return 0.0
    counts = stats.hist.astype(np.float64)
    centers = ((np.arange(len(counts)) + 0.5) * stats.width).astype(np.float32)
    thresholds = _candidates(len(counts), start_bin) * stats.width
    thresholds = np.append(thresholds, stats.amax)
    errors = np.empty(len(thresholds))
    for start in range(0, len(thresholds), 32):  # 32 candidates x bins at a time
        chunk = thresholds[start : start + 32, None]
        dq = fmt.fake_quant(centers[None, :], chunk.astype(np.float32))
        errors[start : start + len(chunk)] = ((dq - centers[None, :]).astype(np.float64) ** 2 * counts).sum(1)
    best = int(np.argmin(errors))
    return float(min(thresholds[best], stats.amax))


def entropy_amax(stats: TensorStats, fmt: str | Format = FP8_E4M3, start_bin: int = START_BIN) -> float:
    """Migacz's KL-divergence threshold, with the quantized levels of ``fmt`` (see module doc)."""
    fmt = _format(fmt)
    if stats.width == 0.0:
        return 0.0
    bins = stats.hist.astype(np.float64)
    if len(bins) > 1:
        bins[0] = bins[1]  # exact zeros (padding, ReLU) would dominate the distribution (ModelOpt)
    centers = ((np.arange(len(bins)) + 0.5) * stats.width).astype(np.float32)
    best_kl, best_threshold = math.inf, stats.amax
    for i in _candidates(len(bins), start_bin):
        threshold = i * stats.width
        kept = bins[:i]
        reference = kept.copy()
        reference[-1] += bins[i:].sum()  # clipped values land in the last kept bin
        if fmt.name == "int8":  # 128 uniform levels of |x| over [0, threshold] (TensorRT)
            levels = np.minimum((np.arange(i) * int(fmt.max_value + 1)) // i, int(fmt.max_value))
        else:
            levels = fmt.codes(centers[:i], threshold)
        nonzero = kept > 0
        level_mass = np.bincount(levels, weights=kept)
        level_bins = np.bincount(levels, weights=nonzero.astype(np.float64))
        with np.errstate(divide="ignore", invalid="ignore"):
            candidate = np.where(nonzero, level_mass[levels] / np.maximum(level_bins[levels], 1.0), 0.0)
        p = reference / reference.sum()
        q_total = candidate.sum()
        if q_total == 0:
            continue
        q = candidate / q_total
        mask = p > 0
        kl = float(np.sum(p[mask] * np.log(p[mask] / np.maximum(q[mask], 1e-12))))
        if kl <= best_kl:  # ties: the larger threshold (ModelOpt takes the last argmin)
            best_kl, best_threshold = kl, threshold
    return float(min(best_threshold, stats.amax))


def compute_amax(
    stats: TensorStats,
    observer: str | Observer = Observer.minmax,
    fmt: str | Format = FP8_E4M3,
    percentile: float = 99.99,
) -> float:
    """The clipping threshold ``observer`` picks for ``stats``; raises on non-finite results."""
    if stats.count and not (math.isfinite(stats.lo) and math.isfinite(stats.hi)):
        raise CalibrationError(
            f"{'NaN' if math.isnan(stats.lo) or math.isnan(stats.hi) else 'inf'} in calibration statistics "
            f"of {stats.label}: range [{stats.lo}, {stats.hi}]"
        )
    if not np.isfinite(stats.hist).all() or (stats.hist < 0).any():
        raise CalibrationError(f"NaN in calibration statistics of {stats.label}: the histogram is corrupt")
    observer = Observer(observer)
    if observer == Observer.minmax:
        amax = stats.amax
    elif observer == Observer.percentile:
        amax = percentile_amax(stats, percentile)
    elif observer == Observer.mse:
        amax = mse_amax(stats, fmt)
    else:
        amax = entropy_amax(stats, fmt)
    if not math.isfinite(amax):
        raise CalibrationError(f"NaN in calibration statistics of {stats.label}: {observer} gave amax={amax}")
    return amax


# --- per-channel weights ----------------------------------------------------------------------


def channel_amax(
    weight: np.ndarray,
    axis: int,
    observer: str | Observer = Observer.minmax,
    fmt: str | Format = FP8_E4M3,
    percentile: float = 99.99,
    mse_steps: int = 11,
    label: str = "weight",
) -> np.ndarray:
    """Per-channel threshold along ``axis`` (the kept axis) of a weight tensor.

    ``minmax``: max ``|w|`` per channel. ``percentile``: the percentile of ``|w|`` per channel.
    ``mse``: per channel, the best of ``mse_steps`` thresholds from 0.5x to 1x the max
    (ModelOpt ``MseCalibrator``). Entropy needs a distribution, not a few hundred weights.
    """
    fmt = _format(fmt)
    w = np.asarray(weight, dtype=np.float32)
    if not np.isfinite(w).all():
        raise CalibrationError(f"NaN in calibration statistics of {label}: the weight has non-finite values")
    axis = axis % w.ndim
    reduce = tuple(d for d in range(w.ndim) if d != axis)
    amax = np.abs(w).max(axis=reduce)
    observer = Observer(observer)
    if observer == Observer.minmax:
        return amax
    if observer == Observer.percentile:
        return np.minimum(np.percentile(np.abs(w), percentile, axis=reduce), amax).astype(np.float32)
    if observer == Observer.mse:
        shape = [1] * w.ndim
        shape[axis] = -1
        best, best_err = amax.copy(), np.full(amax.shape, np.inf)
        for factor in np.linspace(0.5, 1.0, mse_steps):
            candidate = (amax * np.float32(factor)).astype(np.float32)
            err = ((fmt.fake_quant(w, candidate.reshape(shape)) - w) ** 2).sum(axis=reduce)
            better = err <= best_err  # ties: the larger threshold (factor grows)
            best[better], best_err[better] = candidate[better], err[better]
        return best
    raise CalibrationError(
        f"observer '{observer}' is not available per channel: use minmax, percentile or mse"
    )


# --- collection on an ONNX graph --------------------------------------------------------------


def _tap_model(model_path: Path, tensor_names: Sequence[str]) -> bytes:
    """The graph (weights left in their external files) with ``tensor_names`` as extra outputs."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    existing = {o.name for o in model.graph.output}
    produced = {name for node in model.graph.node for name in node.output}
    produced |= {i.name for i in model.graph.input}
    missing = [n for n in tensor_names if n not in produced]
    if missing:
        raise CalibrationError(f"calibration: tensors not found in {model_path}: {', '.join(missing[:3])}")
    for name in tensor_names:
        if name not in existing:
            model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return model.SerializeToString()


def collect_stats(
    model_path: str | Path,
    feeds: Iterable[dict[str, Any]],
    tensor_names: Sequence[str] | Mapping[str, str],
    *,
    num_bins: int = DEFAULT_BINS,
    total: int | None = None,
    progress: bool = True,
    threads: int = 0,
    stats: dict[str, TensorStats] | None = None,
) -> dict[str, TensorStats]:
    """Run ``model_path`` on every feed and keep min/max/histogram of each named tensor.

    ``tensor_names`` may map each name to a label used in messages (``"<MatMul node> input"``).
    ``stats``: statistics to continue (those of earlier feeds, or histograms already started).
    """
    import onnxruntime as ort
    from tqdm import tqdm

    labels = dict(tensor_names) if isinstance(tensor_names, Mapping) else {n: n for n in tensor_names}
    names = list(labels)
    if stats is None:
        stats = {name: TensorStats(labels[name], num_bins=num_bins) for name in names}
    model_path = Path(model_path)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads > 0:
        options.intra_op_num_threads = threads
    # Loaded from bytes, the graph finds its external weights through this folder: no copy.
    options.add_session_config_entry(
        "session.model_external_initializers_file_folder_path", str(model_path.resolve().parent)
    )
    # Prepacking stays on: measured on the default model's graph (16 windows x 256 tokens), the
    # session peaks at 1.33 GiB in 9.3 s with or without it, and this pass peaked at 5.55 GiB
    # for a 1.1B graph of 4.36 GiB and 12.82 GiB for a 3B one of 11.06 GiB: one copy, as the
    # memory preflight sizes it. Turning it off changes the GEMMs' summation order, hence the
    # calibrated ranges in their last bits, and that alone flips greedy answers of the default
    # model's fp8 engine (tests/passes/test_fp8.py).
    session = ort.InferenceSession(_tap_model(model_path, names), options, providers=["CPUExecutionProvider"])
    batches = tqdm(feeds, total=total, desc="calibrate", unit="batch", disable=not progress, leave=False)
    seen = 0
    for index, feed in enumerate(batches):
        outputs = session.run(names, feed)
        where = f" in calibration batch {index + 1}" + (f" of {total}" if total else "")
        for name, value in zip(names, outputs, strict=True):
            stats[name].update(value, where)
        seen += 1
    if seen == 0 and not any(s.count for s in stats.values()):
        raise CalibrationError("calibration: no calibration batches were given")
    return stats


def reduce_stats(stats: dict[str, TensorStats], ranks: Group) -> None:
    """Merge every rank's statistics into those of all their batches, in place (every rank gets
    them): min and max, counts, and histograms coarsened to the widest rank's bins and summed.
    With every rank's bins started at the width the first batch set (:meth:`TensorStats.start_at`)
    the widths are that width times powers of two, so the merged histogram is the one a single
    process builds over the same batches (its ``_grow`` merges pairs of bins the same way)."""
    if ranks.world == 1:
        return
    import torch

    names = sorted(stats)
    f64 = torch.float64
    lows = -ranks.max(torch.tensor([-stats[n].lo for n in names], dtype=f64))
    highs = ranks.max(torch.tensor([stats[n].hi for n in names], dtype=f64))
    counts = ranks.sum(torch.tensor([stats[n].count for n in names], dtype=torch.int64))
    widths = ranks.max(torch.tensor([stats[n].width for n in names], dtype=f64))
    hists = [stats[n].coarsened(float(w)) for n, w in zip(names, widths, strict=True)]
    lengths = ranks.max(torch.tensor([len(h) for h in hists], dtype=torch.int64)).tolist()
    packed = torch.zeros(sum(lengths), dtype=torch.int64)
    offsets = np.cumsum([0, *lengths])
    for start, hist in zip(offsets, hists, strict=False):
        packed[start : start + len(hist)] = torch.from_numpy(hist.astype(np.int64))
    ranks.sum(packed)
    for i, name in enumerate(names):
        entry = stats[name]
        entry.lo, entry.hi, entry.count = float(lows[i]), float(highs[i]), int(counts[i])
        entry.width = float(widths[i])
        entry.hist = packed[offsets[i] : offsets[i + 1]].numpy().copy()


def collect_ranges(
    model_path: str | Path,
    feeds: Iterable[dict[str, Any]],
    tensor_names: Sequence[str] | Mapping[str, str],
    observer: str | Observer = Observer.minmax,
    *,
    fmt: str | Format = FP8_E4M3,
    percentile: float = 99.99,
    num_bins: int = DEFAULT_BINS,
    total: int | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Symmetric clipping threshold (amax) of each named tensor of the graph, by ``observer``."""
    stats = collect_stats(model_path, feeds, tensor_names, num_bins=num_bins, total=total, progress=progress)
    return {name: compute_amax(s, observer, fmt, percentile) for name, s in stats.items()}
