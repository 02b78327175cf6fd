"""Memory preflight and per-pass resource measurement (issue 21, item 6).

Before the first pass runs, :func:`preflight` estimates each pass's peak memory from the
checkpoint's ``config.json`` shapes and the pass's config: the weights it holds (parameters x
bytes at its dtype, by :attr:`pipeline.core.base.Pass.memory_profile`), its calibration activations,
the ONNX Runtime session a graph pass's parity check opens, and a fixed overhead (python, torch,
transformers and onnxruntime imported). A pass that knows better overrides
:meth:`pipeline.core.base.Pass.estimate_memory`. The estimates are logged as a table; when the largest
exceeds the memory available (``pipeline.max_memory_gib``, else ``MemAvailable`` capped by the
cgroup limit) the run is refused with one line naming the pass and the knob that lowers it.

While a pass runs, :class:`ResourceMeter` measures its CPU time (``os.times``, children
included), its peak RSS (the kernel's high-water mark ``VmHWM``, reset before the pass through
``/proc/self/clear_refs``; a sampling thread where that is refused) and, when CUDA is in use, the
peak GPU memory torch allocated. Nothing here is a library's: the estimate follows the usual
back-of-envelope accounting (weights + activations + KV cache, as in accelerate's
``estimate-memory`` and the DeepSpeed memory estimators, which cover training states only and
know nothing of our passes), and psutil has no way to reset the high-water mark.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core.errors import ConfigError
from pipeline.core.shapes import DTYPE_BYTES, ModelShapes, model_shapes

if TYPE_CHECKING:
    from pipeline.core.base import Pass

log = logging.getLogger(__name__)

GIB = 2**30
# Resident memory of the pipeline process between passes: python, numpy, torch, transformers, onnx
# and onnxruntime imported (0.45 GiB measured for the imports alone) plus what earlier passes leave
# in the allocators. Measured on the default model: 1.0 GiB resident entering AWQ after the
# sensitivity scan, 0.7 GiB entering the build after the export; counted once per pass.
OVERHEAD_BYTES = int(1.2 * GIB)
# Windows a calibrating pass runs through the model at once (its transient activations).
CALIBRATION_BATCH = 8
PARITY_TOKENS = 64  # the parity checks' prefill (prompt plus decode steps), tokens
RESOURCE_KEYS = ("cpu_seconds", "peak_rss_bytes", "gpu_peak_bytes", "estimate_bytes")
SAMPLE_INTERVAL_S = 0.02
HWM_RESET_SLACK_KIB = 16 * 1024  # a reset mark may trail RSS by what another thread freed meanwhile
MEMINFO = Path("/proc/meminfo")
CLEAR_REFS = Path("/proc/self/clear_refs")  # writing "5" resets VmHWM (Linux >= 4.0)
CGROUP_MAX = Path("/sys/fs/cgroup/memory.max")
CGROUP_CURRENT = Path("/sys/fs/cgroup/memory.current")


class InsufficientMemoryError(ConfigError):
    """The preflight's estimate of a pass exceeds the memory available (exit code 2)."""


# --------------------------------------------------------------------------------------------
# Estimates


@dataclass
class Estimate:
    """A pass's estimated peak: host bytes (its parts) and, on a GPU placement, device bytes."""

    index: int
    name: str
    profile: str
    where: str  # "cpu float32", "cuda:0 bfloat16", "graph (fp32)" ...
    parts: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    gpu_bytes: int | None = None
    knob: str = ""
    custom: bool = False  # from the pass's own estimate_memory


def _bytes_of(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype, 4)


def generic_estimate(step: Pass, shapes: ModelShapes, index: int = 0) -> Estimate:
    """The estimate from the pass's ``memory_profile``, placement and calibration config."""
    profile = step.memory_profile
    torch_pass = step.consumes.value == "torch"
    placement = step.placement
    on_gpu = torch_pass and placement.device_type == "cuda"
    compute = _bytes_of(placement.torch_dtype)
    source = _bytes_of(shapes.source_dtype)
    parts: dict[str, int] = {"overhead": OVERHEAD_BYTES}
    device: dict[str, int] = {}
    weights = 0
    if profile == "whole" and not torch_pass:  # a graph pass that loads the graph's weights
        weights = shapes.graph_bytes
    elif profile == "whole":
        weights = shapes.parameters * compute
        # memory-mapped while the model loads: the whole file, or one module at a time
        mapped = shapes.parameters
        if step.loads_module_by_module:
            mapped = max(shapes.block_params, shapes.embedding_params)
        parts["checkpoint"] = mapped * source
    elif profile == "block":
        held = shapes.embedding_params + shapes.lm_head_params + shapes.block_params
        weights = held * compute
        parts["checkpoint"] = (shapes.block_params + shapes.embedding_params) * source
        if step.produces.value == "torch":
            # ``ensures`` reads the written fp32 checkpoint back through safetensors' memory map:
            # its pages count in the pass's RSS while the file is open (AWQ on the default model
            # peaked at 2.00 GiB, 1.0 GiB above the RSS it started from).
            parts["output read back"] = shapes.parameters * 4
    if torch_pass and step.produces.value == "graph" and profile in ("whole", "block"):
        # The export: it traces a weightless skeleton and writes the weights one tensor at a time
        # (0.78x the fp32 weights at 362M); ``ensures`` then opens ONNX Runtime on the graph (no
        # prepacking: the data file memory-mapped, graph_bytes) and, once that is released, the
        # fp32 torch model ("weights"): the two never coexist, so the peak holds the larger.
        parts["graph beyond the model"] = max(shapes.graph_bytes - weights, 0)
        parts["session"] = shapes.forward_bytes(1, PARITY_TOKENS)
    elif profile == "graph":
        parts["graph"] = shapes.graph_bytes  # external data memory-mapped, every page read once
        # One copy of the weights, whatever the session. Parity and check sessions do not
        # prepack (pipeline.runtime.ort.session_options): they map the data file and add 0.08 GB
        # before they run. The calibration sessions prepack and measure the same: fp8's
        # activation calibration peaked at 5.55 GiB for a 1.1B graph of 4.36 GiB, and at 1.33
        # GiB on the default model either way (calibration.observers.collect_stats).
        parts["session"] = shapes.forward_bytes(1, PARITY_TOKENS)
    if weights:
        (device if on_gpu else parts)["weights"] = weights
    workload = step.workload()
    if workload is not None:
        count, seq_len = workload.windows, workload.seq_len
        if torch_pass:
            # One layer's inputs for every window (what a block-streamed pass keeps), fp32, plus
            # the transient forward of one batch of windows.
            stored = 2 * count * seq_len * shapes.hidden_size * 4
            transient = shapes.forward_bytes(min(count, CALIBRATION_BATCH), seq_len, profile != "block")
            if workload.training:
                # Training (distillation): gradients and AdamW's two moments in fp32, the teacher at
                # the compute dtype, and every layer's activations saved for the backward.
                tokens = count * seq_len
                saved = shapes.num_layers * tokens * (6 * shapes.hidden_size + 4 * shapes.intermediate_size)
                stored = shapes.parameters * (4 + 8 + compute) + 4 * (saved + 3 * tokens * shapes.vocab_size)
            (device if on_gpu else parts)["activations"] = stored + transient
        else:  # a graph pass calibrating through ONNX Runtime: one window at a time, stats kept
            parts["activations"] = shapes.forward_bytes(1, seq_len) + count * seq_len * shapes.hidden_size * 4
    where = f"{placement.device} {placement.torch_dtype}" if torch_pass else "graph fp32"
    estimate = Estimate(index, step.name, profile, where, parts, sum(parts.values()))
    if on_gpu:
        estimate.gpu_bytes = sum(device.values())
        estimate.parts.update({f"gpu {name}": value for name, value in device.items()})
    estimate.knob = refusal_knob(step, estimate)
    return estimate


def estimate_pass(step: Pass, shapes: ModelShapes, index: int = 0) -> Estimate:
    """The pass's own estimate (:meth:`Pass.estimate_memory`) when it gives one, else the generic."""
    estimate = generic_estimate(step, shapes, index)
    custom = step.estimate_memory(shapes)
    if custom is not None:
        estimate.parts = {"pass's own estimate": int(custom)}
        estimate.host_bytes, estimate.gpu_bytes, estimate.custom = int(custom), None, True
    return estimate


def bench_estimate(
    shapes: ModelShapes, prompt_lengths: list[int], decode_tokens: int, batch: int
) -> Estimate:
    """The benchmark's subprocess: the engine (at most the fp32 weights) in an ONNX Runtime
    session, the KV cache of the longest prompt plus the decoded tokens, one prefill's
    activations; and the pipeline process waiting for it."""
    longest = max(prompt_lengths, default=0)
    parts = {
        "overhead": 2 * OVERHEAD_BYTES,
        "session": shapes.graph_bytes,
        "kv cache": shapes.kv_bytes(longest + decode_tokens, batch),
        "activations": shapes.forward_bytes(batch, longest),
    }
    return Estimate(
        0, "benchmark", "engine", "onnxruntime", parts, sum(parts.values()), knob="bench.prompt_lengths"
    )


def refusal_knob(step: Pass, estimate: Estimate) -> str:
    """The setting that lowers this pass's peak, as a refusal names it."""
    workload = step.workload()
    activations = estimate.parts.get("activations", 0) + estimate.parts.get("gpu activations", 0)
    weights = estimate.parts.get("weights", 0) + estimate.parts.get("gpu weights", 0)
    if workload is not None and activations >= weights:
        return f"lower {workload.knob} (now {workload.windows})"
    if step.placement_knobs:
        if step.placement.device_type == "cpu" and step.placement.torch_dtype == "float32":
            return "set pipeline.torch_dtype=bfloat16 (halves the weights) or pipeline.device=cuda on a GPU"
        if step.placement.device_type == "cpu":
            return "set pipeline.device=cuda on a GPU"
        return "set pipeline.device=cpu (host memory) or pipeline.torch_dtype=bfloat16"
    if workload is not None:
        return f"lower {workload.knob} (now {workload.windows})"
    return "run on a machine with more memory"


def available_memory(max_memory_gib: float | None) -> tuple[int, str]:
    """The memory a run may use and where that figure comes from."""
    if max_memory_gib is not None:
        return int(float(max_memory_gib) * GIB), "pipeline.max_memory_gib"
    available, source = None, "unknown"
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available, source = int(line.split()[1]) * 1024, "MemAvailable"
                break
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit_text = CGROUP_MAX.read_text().strip()
        if limit_text != "max":
            limit = int(limit_text)
            with contextlib.suppress(OSError, ValueError):
                limit -= int(CGROUP_CURRENT.read_text().strip())
            if available is None or limit < available:
                available, source = limit, "the cgroup's memory.max"
    except (OSError, ValueError):
        pass
    return (available if available is not None else 0), source


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f} GiB"


def preflight(
    passes: list[Pass],
    source: Path,
    max_memory_gib: float | None = None,
    bench: tuple[list[int], int, int] | None = None,
    cached: int = 0,
) -> list[Estimate]:
    """Estimate each pass's peak memory for the checkpoint in ``source``, log the table, record
    each estimate on its pass (``memory_estimate``, for the run record) and raise
    :class:`InsufficientMemoryError` (one line) when the largest exceeds the memory available.
    ``bench``: (prompt lengths, decode tokens, batch) of the benchmark that follows, if any.
    ``cached``: how many leading passes the cache answers (they do not run: logged, not sized).
    Passes run one after another, so the run's peak is the largest pass's."""
    shapes = model_shapes(source)
    if shapes is None:
        log.info("memory preflight: skipped (no Llama config.json in %s to size the passes)", source)
        return []
    estimates = [estimate_pass(step, shapes, index) for index, step in enumerate(passes, start=1)][cached:]
    for step, estimate in zip(passes[cached:], estimates, strict=True):
        step.memory_estimate = estimate.host_bytes
    rows = list(estimates)
    if bench is not None:
        rows.append(bench_estimate(shapes, *bench))
    limit, limit_source = available_memory(max_memory_gib)
    log.info(
        "memory preflight: %.2fB parameters (%s checkpoint); available %s (%s)",
        shapes.parameters / 1e9,
        shapes.source_dtype,
        _gib(limit),
        limit_source,
    )
    for index, step in enumerate(passes[:cached], start=1):
        log.info("  %-2s %-22s cached: not run", index, step.name)
    for row in rows:
        parts = ", ".join(f"{name} {value / GIB:.2f}" for name, value in row.parts.items())
        gpu = f" + GPU {_gib(row.gpu_bytes)}" if row.gpu_bytes is not None else ""
        log.info(
            "  %-2s %-22s %-6s %-18s %10s%s  (%s GiB)",
            row.index or "",
            row.name,
            row.profile,
            row.where,
            _gib(row.host_bytes),
            gpu,
            parts,
        )
    if not rows:
        return estimates
    largest = max(rows, key=lambda row: row.host_bytes)
    log.info("  peak %s (%s): passes run one after another", _gib(largest.host_bytes), largest.name)
    # The passes first (the largest names the knob), then the benchmark that follows them.
    for group in (estimates, rows[len(estimates) :]):
        worst = max(group, key=lambda row: row.host_bytes, default=None)
        if limit and worst is not None and worst.host_bytes > limit:
            what = f"pass #{worst.index} '{worst.name}'" if worst.index else f"the {worst.name}"
            raise InsufficientMemoryError(
                f"{what} needs an estimated {_gib(worst.host_bytes)} of memory, more than the "
                f"{_gib(limit)} available ({limit_source}): {worst.knob}, or raise pipeline.max_memory_gib "
                "if the estimate is too cautious"
            )
    _check_gpu(passes[cached:], estimates)
    return estimates


def _check_gpu(passes: list[Pass], estimates: list[Estimate]) -> None:
    """Refuse a GPU placement whose estimate exceeds the device's memory."""
    for step, estimate in zip(passes, estimates, strict=True):
        if estimate.gpu_bytes is None:
            continue
        import torch  # a CUDA placement resolved, so torch sees the device

        total = torch.cuda.get_device_properties(step.placement.torch_device).total_memory
        if estimate.gpu_bytes > total:
            raise InsufficientMemoryError(
                f"pass #{estimate.index} '{estimate.name}' needs an estimated {_gib(estimate.gpu_bytes)} "
                f"on {step.placement.device}, which has {_gib(total)}: {estimate.knob}"
            )


# --------------------------------------------------------------------------------------------
# Measurement


def _status_kib(field_name: str) -> int | None:
    return _status_fields(field_name).get(field_name)


def _status_fields(*field_names: str) -> dict[str, int]:
    """The named ``/proc/self/status`` fields (KiB), all from one read; missing ones left out."""
    found: dict[str, int] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in field_names:
                found[name] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return {}
    return found


def _rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:
        return None


def _lifetime_peak_bytes() -> int | None:
    """The process's peak RSS since it started (VmHWM, else ``getrusage``'s ru_maxrss)."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
    except (ImportError, OSError):
        return None


def _reset_high_water_mark() -> bool:
    """Reset the kernel's VmHWM to the current RSS (Linux >= 4.0); False where refused or ignored.

    Some sandboxes accept the write and keep the lifetime mark, so the reset is checked: right
    after it, VmHWM must sit at VmRSS (within ``HWM_RESET_SLACK_KIB`` for pages another thread
    freed in between). A mark that still sits at the current RSS is exact either way."""
    try:
        with open(CLEAR_REFS, "w") as handle:
            handle.write("5")
    except OSError:
        return False
    fields = _status_fields("VmHWM", "VmRSS")
    if len(fields) < 2:
        return False
    return fields["VmHWM"] <= fields["VmRSS"] + HWM_RESET_SLACK_KIB


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def _cuda(device: Any) -> tuple[Any, Any] | None:
    """(torch, device) when torch is already imported and CUDA initialised; never imports torch."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        if device is None or getattr(device, "type", "cpu") != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        return torch, device
    except Exception:
        return None


class ResourceMeter:
    """Measures one pass: ``with ResourceMeter(device) as meter: ...`` then ``meter.resources``.

    ``device``: the pass's torch device (its CUDA peak is read there; else the current one)."""

    def __init__(self, device: Any = None, estimate_bytes: int | None = None) -> None:
        self.device = device
        self.estimate_bytes = estimate_bytes
        self.resources: dict[str, Any] = dict.fromkeys(RESOURCE_KEYS)
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        self._sampled_peak = 0
        self._hwm = False
        self._lifetime_peak: int | None = None

    def __enter__(self) -> ResourceMeter:
        self.resources["estimate_bytes"] = self.estimate_bytes
        self._cpu = _cpu_seconds()
        self._hwm = _reset_high_water_mark()
        if not self._hwm:
            # Where the mark cannot be reset, a pass that sets a new lifetime peak is still exact
            # (VmHWM or ru_maxrss grew during it); otherwise the sampler's maximum is recorded.
            self._lifetime_peak = _lifetime_peak_bytes()
            self._sampled_peak = _rss_bytes() or 0
            self._sampler = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
            self._sampler.start()
        cuda = _cuda(self.device)
        if cuda is not None:
            with contextlib.suppress(Exception):
                cuda[0].cuda.reset_peak_memory_stats(cuda[1])
        return self

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            rss = _rss_bytes()
            if rss is not None:
                self._sampled_peak = max(self._sampled_peak, rss)

    def __exit__(self, *exc: object) -> None:
        self.resources["cpu_seconds"] = round(max(0.0, _cpu_seconds() - self._cpu), 3)
        if self._hwm:
            kib = _status_kib("VmHWM")
            self.resources["peak_rss_bytes"] = kib * 1024 if kib is not None else None
        else:
            self._stop.set()
            if self._sampler is not None:
                self._sampler.join()
            peak = max(self._sampled_peak, _rss_bytes() or 0)
            lifetime = _lifetime_peak_bytes()
            if lifetime is not None and self._lifetime_peak is not None and lifetime > self._lifetime_peak:
                peak = max(peak, lifetime)
            self.resources["peak_rss_bytes"] = peak or None
        # CUDA first initialised inside the pass: its peak statistics start there, so they hold.
        cuda = _cuda(self.device)
        if cuda is not None:
            with contextlib.suppress(Exception):
                self.resources["gpu_peak_bytes"] = int(cuda[0].cuda.max_memory_allocated(cuda[1]))


def empty_resources() -> dict[str, Any]:
    """The resources of a pass computed before they were measured (an older cache entry)."""
    return dict.fromkeys(RESOURCE_KEYS)
