"""Calibration samples: fixed-length token windows drawn (seeded) from shipped text.

The text lives in ``calibration/data/`` with its source and licence (``SOURCE.md``). Windows do
not overlap and are chosen without replacement, so ``num_samples`` x ``seq_len`` tokens of
distinct text reach the observers. Defaults are sized for a 2-core CPU: 64 windows of 256 tokens
(16k tokens) run through the 135M default model in well under a minute; ModelOpt's defaults
(512-1024 x 512) are a knob away for bigger machines.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.config import MAX_SAMPLES, MAX_SEED, MAX_THREADS, MAX_TOKENS, _is_int, _is_number
from pipeline.core.config import knob as knob_name
from pipeline.core.errors import CalibrationError
from pipeline.core.planned_model import PlannedModel

DATA_DIR = Path(__file__).resolve().parent / "data"
DATASETS = {"python_reference": "python_reference.txt"}


@dataclass
class CalibrationConfig:
    """Which text, how many windows of how many tokens; and in how many processes."""

    dataset: str = "python_reference"
    num_samples: int = 64
    seq_len: int = 256
    seed: int = 0
    # Execution knobs (outside the cache key and the recorded output): the windows split over
    # num_processes ranks under `accelerate launch` (pipeline/core/distributed.py), their statistics
    # summed or max-reduced across ranks, for the passes that can (GPTQ, AWQ, SmoothQuant, FP8); a collective
    # waiting longer than collective_timeout_s on another rank fails the pass.
    num_processes: int = 1
    collective_timeout_s: float = 300.0

    def validate(self) -> None:
        # The lower bounds of num_samples and seq_len are each pass's to check (check_windows), in
        # its own words; the model's context bounds seq_len too (check_context).
        for name, value, low, high in (
            ("num_samples", self.num_samples, None, MAX_SAMPLES),
            ("seq_len", self.seq_len, None, MAX_TOKENS),
            ("seed", self.seed, 0, MAX_SEED),
            ("num_processes", self.num_processes, 1, MAX_THREADS),
        ):
            if not _is_int(value) or (low is not None and value < low) or value > high:
                low = {"num_samples": 1, "seq_len": 2}.get(name, low)
                where = knob_name(f"calibration.{name}")
                raise CalibrationError(f"{where}={value!r}: must be a whole number from {low} to {high}")
        timeout = self.collective_timeout_s
        if not _is_number(timeout) or not 0 < timeout <= MAX_COLLECTIVE_TIMEOUT_S:
            raise CalibrationError(
                f"{knob_name('calibration.collective_timeout_s')}={timeout!r}: must be more than 0 and at "
                f"most {MAX_COLLECTIVE_TIMEOUT_S:.0f} seconds"
            )


MAX_COLLECTIVE_TIMEOUT_S = 86400.0  # a day: a collective waiting longer waits on a dead rank


def check_windows(config: CalibrationConfig, where: str) -> None:
    """At least one window of at least 2 tokens (``where``: ``prune.calibration``)."""
    if config.num_samples < 1:
        raise CalibrationError(
            f"{where}.num_samples={config.num_samples}: at least one calibration window is needed"
        )
    if config.seq_len < 2:
        raise CalibrationError(f"{where}.seq_len={config.seq_len}: must be at least 2")


def check_context(config: Any, facts: PlannedModel, where: str) -> None:
    """A window of ``config.seq_len`` tokens (a CalibrationConfig's, the sensitivity scan's) longer
    than the model's context (``max_position_embeddings``) is refused at start-up, naming
    ``<where>.seq_len`` (``where``: ``quant.calibration``)."""
    context = facts.config.get("max_position_embeddings")
    if _is_int(context) and context > 0 and _is_int(config.seq_len) and config.seq_len > context:
        raise CalibrationError(
            f"{where}.seq_len={config.seq_len}: longer than the model's context of {context} tokens "
            f"(max_position_embeddings); set {where}.seq_len to at most {context}"
        )


EXECUTION_FIELDS = ("num_processes", "collective_timeout_s")


def recorded(config: CalibrationConfig) -> dict[str, Any]:
    """The calibration settings an output depends on (without the execution knobs), as recorded."""
    return {key: value for key, value in asdict(config).items() if key not in EXECUTION_FIELDS}


def shard(
    windows: np.ndarray, rank: int, world: int, batch_size: int, knob: str = "quant.calibration"
) -> np.ndarray:
    """Rank ``rank``'s contiguous share of the calibration windows in whole batches of
    ``batch_size`` windows: the ranks' batches are one process's batches, split in order (so
    statistics that depend on batch boundaries reduce to one process's)."""
    if world == 1:
        return windows
    batches = -(-len(windows) // batch_size)
    if batches < world:
        raise CalibrationError(
            f"{knob}.num_processes={world}: {len(windows)} windows make {batches} batch(es) of "
            f"{batch_size}, fewer than the processes; raise {knob}.num_samples to "
            f"{world * batch_size} or more"
        )
    bounds = [part[0] * batch_size for part in np.array_split(np.arange(batches), world)] + [len(windows)]
    return windows[bounds[rank] : bounds[rank + 1]]


@cache
def calibration_text(name: str) -> str:
    if name not in DATASETS:
        raise CalibrationError(
            f"quant.calibration.dataset={name!r} is unknown: choose one of {', '.join(sorted(DATASETS))}"
        )
    return (DATA_DIR / DATASETS[name]).read_text()


def token_windows(
    tokenizer: Any, config: CalibrationConfig, text: str | None = None, knob: str = "quant.calibration"
) -> np.ndarray:
    """``[num_samples, seq_len]`` int64 token ids from the calibration text (or ``text``); errors
    name the config node the windows come from (``knob``)."""
    if config.num_samples < 1:
        raise CalibrationError(f"{knob}.num_samples must be at least 1 (got {config.num_samples})")
    if config.seq_len < 2:
        raise CalibrationError(f"{knob}.seq_len must be at least 2 (got {config.seq_len})")
    source = calibration_text(config.dataset) if text is None else text
    ids = np.asarray(tokenizer(source, add_special_tokens=False)["input_ids"], dtype=np.int64)
    available = len(ids) // config.seq_len
    if available == 0:
        raise CalibrationError(
            f"calibration text '{config.dataset}' has {len(ids)} tokens, shorter than one sequence of "
            f"{knob}.seq_len={config.seq_len}: lower {knob}.seq_len"
        )
    if config.num_samples > available:
        longest = len(ids) // config.num_samples
        shorter = f"or {knob}.seq_len to at most {longest}" if longest >= 2 else ""
        raise CalibrationError(
            f"{knob}.num_samples={config.num_samples} x {knob}.seq_len={config.seq_len} needs "
            f"{config.num_samples * config.seq_len} tokens, more than the {len(ids)} of '{config.dataset}': "
            f"lower {knob}.num_samples to at most {available} {shorter}".strip()
        )
    windows = ids[: available * config.seq_len].reshape(available, config.seq_len)
    chosen = np.random.default_rng(config.seed).choice(available, size=config.num_samples, replace=False)
    return windows[np.sort(chosen)]


def calibration_feeds(windows: np.ndarray, io: Any) -> Any:
    """Graph feeds for each token window: a one-row prefill with an empty KV cache."""
    dtype = np.dtype(io.kv_dtype)
    empty = np.zeros((1, io.num_kv_heads, 0, io.head_dim), dtype=dtype)
    for window in windows:
        ids = window[None].astype(np.int64)
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        if io.has_position_ids:
            feed["position_ids"] = np.arange(ids.shape[1], dtype=np.int64)[None]
        feed.update({name: empty for name in io.past_names()})
        yield feed
