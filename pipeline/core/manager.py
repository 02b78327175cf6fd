"""The pass manager: validate the whole recipe, then run each pass through the cache.

Validation happens before anything runs, so ``prune`` after ``export`` is a configuration
error at start-up, not a crash an hour in. Each pass output is looked up by content key;
a miss runs the pass in a staging folder, checks ``ensures`` and that every weight of the output is
finite (``pipeline/core/finite.py``), and only then commits, so a failed, diverged or interrupted
pass leaves no entry and a rerun resumes from the last finished pass.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.base import Pass, without_knobs
from pipeline.core.cache import (
    ENTRY_FILE,
    KEY_FIELDS,
    Cache,
    CacheEntry,
    RecordCheck,
    key_fields,
    key_of,
    key_problem,
)
from pipeline.core.distributed import check_processes
from pipeline.core.errors import ConfigError, PassError, PipelineError
from pipeline.core.finite import first_nonfinite
from pipeline.core.memory import ResourceMeter, empty_resources
from pipeline.core.planned_model import PlannedModel

log = logging.getLogger(__name__)


@dataclass
class PassRecord:
    """What the run record says about one pass."""

    name: str
    pass_class: str
    version: int
    config: dict[str, Any]
    input_digest: str
    output_digest: str
    seconds: float
    cache_hit: bool
    cache_key: str
    # The resolved pipeline.device / pipeline.torch_dtype of a pass that honours them (else {}).
    placement: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    # What the pass cost when it ran (for a cache hit: the run that computed it): cpu_seconds,
    # peak_rss_bytes, gpu_peak_bytes (CUDA only) and the preflight's estimate_bytes; None where
    # not measured (pipeline/core/memory.py).
    resources: dict[str, Any] = field(default_factory=empty_resources)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def validate(passes: list[Pass], source_kind: Kind, final_kind: Kind | None = Kind.ENGINE) -> None:
    """Check that each pass consumes what the one before it produces, and that this machine
    can run every pass (``Pass.preflight``), before any of them runs."""
    current, producer = source_kind, "the model source"
    for index, step in enumerate(passes, start=1):
        if step.consumes != current:
            raise ConfigError(
                f"pass #{index} '{step.name}' consumes {step.consumes.label} but receives "
                f"{current.label} from {producer}: reorder pipeline.order or drop the pass"
            )
        current, producer = step.produces, f"'{step.name}'"
    if final_kind is not None and current != final_kind:
        raise ConfigError(
            f"the recipe ends with {current.label} from {producer}, not {final_kind.label}: "
            f"select a target (target=ort-cpu)"
        )
    for step in passes:
        if step.placement_knobs and step.placement_request is not None:
            step.placement = step.placement_request.resolve()  # a CUDA request without CUDA fails here
        _check_calibration_processes(step)
        step.preflight()


def check_against_model(passes: list[Pass], source: Artifact) -> None:
    """Hand the facts of ``source``'s model through ``passes`` (``Pass.check_model``), so a knob
    that cannot work on the model fails before any pass runs; nothing to check without a
    ``config.json`` in the source."""
    facts = PlannedModel.of(source)
    if facts is None:
        log.debug("model checks: skipped (no config.json in %s)", source.path)
        return
    for step in passes:
        facts = step.check_model(facts)


def _check_calibration_processes(step: Pass) -> None:
    """One line unless the processes the pass's calibration asks for suit the pass and the machine."""
    ranks = step.ranks()
    if ranks is None or ranks.processes == 1:
        return
    knob, processes = ranks.knob, ranks.processes
    if not step.calibrates_in_ranks:
        raise ConfigError(
            f"{knob}={processes}: pass '{step.name}' calibrates in one process with this config "
            f"(several processes: quant=fp8, quant=int8, quant=int4_gptq, quant=int4_awq with "
            f"objective=linear); set {knob}=1"
        )
    if ranks.windows < processes:
        raise ConfigError(
            f"{knob}={processes} exceeds {ranks.windows_knob}={ranks.windows}: every process needs "
            "a window; lower the processes or raise the samples"
        )
    check_processes(knob, processes, step.placement.device_type)


def _key_fields(step: Pass, input_digest: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the cache key of ``step`` (its ``config_dict()``, when the caller has it) on an input
    of ``input_digest`` is computed from: the placement enters it only for a pass whose output
    depends on it, its execution knobs (processes, launcher) never."""
    keyed = without_knobs(step.config_dict() if config is None else config, step.execution_knobs)
    if step.placement_knobs:
        keyed["_placement"] = step.placement.key(step.placement_knobs)
    return key_fields(input_digest, step.name, step.version, keyed)


def _key(step: Pass, input_digest: str, config: dict[str, Any] | None = None) -> str:
    """The cache key of ``step`` on an input of ``input_digest`` (see :func:`_key_fields`)."""
    return key_of(_key_fields(step, input_digest, config))


def _entry_check(step: Pass, key: str, fields: dict[str, Any]) -> RecordCheck:
    """What is wrong with an ``entry.json`` found under ``key`` for a request of ``fields``.

    An entry written before entries recorded their key's fields (no ``key_fields``) is verified
    as far as its record allows rather than evicted (recomputing every cached pass after an
    upgrade costs hours for a large model): its input digest, pass name and version and its config
    (keyed as :func:`_key_fields` keys it) must be this request's and give ``key`` again; only
    the library versions, which it does not record, are taken from this run (the key it was found
    under holds them). :meth:`PassManager._lookup` then records the fields, as ``Cache.amend``
    records ``finite``, so it is checked in full from then on."""

    def check(record: dict[str, Any]) -> str | None:
        if KEY_FIELDS in record:
            return key_problem(record, key, fields)
        if not isinstance(record.get("pass"), str) or not isinstance(record.get("version"), int):
            return f"{ENTRY_FILE} records neither {KEY_FIELDS} nor its pass and version: unverifiable"
        legacy = key_fields(record["input_digest"], record["pass"], record["version"], {})
        legacy["config"] = _key_fields(step, record["input_digest"], record["config"])["config"]
        legacy["libraries"] = fields["libraries"]
        return key_problem({**record, KEY_FIELDS: legacy}, key, fields)

    return check


def placement_of(step: Pass) -> dict[str, str]:
    """The placement a pass computed with, as the record shows it (only the knobs it honours)."""
    resolved = step.placement.to_dict()
    return {knob: resolved[knob] for knob in step.placement_knobs}


class PassManager:
    """Runs a validated list of passes through ``cache``. ``final_kind``: what the list must end
    with (an engine for a recipe; None for a part of one, as the tests run single passes)."""

    def __init__(self, passes: list[Pass], cache: Cache, final_kind: Kind | None = Kind.ENGINE) -> None:
        self.passes = passes
        self.cache = cache
        self.final_kind = final_kind

    def run(self, source: Artifact) -> tuple[Artifact, list[PassRecord]]:
        validate(self.passes, source.kind, self.final_kind)
        check_against_model(self.passes, source)
        records: list[PassRecord] = []
        current = source
        for index, step in enumerate(self.passes, start=1):
            current, record = self._run_one(index, step, current)
            records.append(record)
        return current, records

    def cached_prefix(self, source: Artifact) -> int:
        """How many leading passes the cache is expected to answer, from the entries' recorded
        digests (no file is hashed: :meth:`run` still verifies each hit). The memory preflight
        does not size a pass that will not run."""
        digest = source.digest
        for count, step in enumerate(self.passes):
            fields = _key_fields(step, digest)
            key = key_of(fields)
            recorded = self.cache.recorded_output(key, _entry_check(step, key, fields))
            if recorded is None:
                return count
            digest = recorded
        return len(self.passes)

    def _run_one(self, index: int, step: Pass, source: Artifact) -> tuple[Artifact, PassRecord]:
        config = step.config_dict()
        placement = placement_of(step)
        fields = _key_fields(step, source.digest, config)
        key = key_of(fields)
        entry = self._lookup(step, key, fields)
        if entry is None:
            # Jobs sharing the cache (a sweep) compute a key once: the others wait, then reuse it.
            with self.cache.computing(key, f"pass '{step.name}' ({key[:12]})"):
                entry = self._lookup(step, key, fields)  # committed while we took the lock?
                if entry is None:
                    return self._compute(index, step, source, key, config, placement, fields)
        log.info("pass %d/%d %s: cache hit (%s)", index, len(self.passes), step.name, key[:12])
        return entry.artifact, _record(step, entry, cache_hit=True)

    def _lookup(self, step: Pass, key: str, fields: dict[str, Any]) -> CacheEntry | None:
        """The verified entry of ``key`` (computed from ``fields``), or None. Its record must say
        it was computed from ``fields`` (:func:`_entry_check`; one computed by an earlier version,
        verified as far as it can be, gets them recorded now). An entry committed before outputs
        were checked for finite weights (no ``finite`` in its record) is checked now, and evicted
        (then recomputed) if a weight is NaN or infinite: a diverged output cached by an earlier
        version must not fail every later run."""
        entry = self.cache.lookup(key, step.produces, _entry_check(step, key, fields))
        if entry is not None and KEY_FIELDS not in entry.record:
            entry = self.cache.amend(entry, {KEY_FIELDS: fields})  # verified once, as far as it can be
        if entry is None or entry.record.get("finite") is True:
            return entry
        try:
            found = first_nonfinite(entry.artifact.path)
        except (ValueError, PipelineError) as exc:
            problem = str(exc)
        else:
            problem = None if found is None else f"{found.file} holds a non-finite {found.tensor}"
        if problem is None:
            return self.cache.amend(entry, {"finite": True})  # checked once, not on every hit
        log.warning(
            "cache entry %s of pass '%s': %s; discarding it and recomputing", key[:12], step.name, problem
        )
        self.cache.evict(key)
        return None

    def _compute(
        self,
        index: int,
        step: Pass,
        source: Artifact,
        key: str,
        config: dict[str, Any],
        placement: dict[str, str],
        fields: dict[str, Any],
    ) -> tuple[Artifact, PassRecord]:
        """Run ``step`` on ``source`` in a staging folder and commit its output under ``key``."""
        log.info("pass %d/%d %s: running (%s)", index, len(self.passes), step.name, key[:12])
        step.requires(source)
        step.checkpoint_dir = self.cache.checkpoint_dir(key)
        start = time.perf_counter()
        with self.cache.stage(key, f"the output of pass '{step.name}'") as staging:
            out_dir = staging / "output"
            device = step.placement.torch_device if step.placement.device_type == "cuda" else None
            with ResourceMeter(device, step.memory_estimate) as meter:
                metrics = dict(step.run(source, out_dir) or {})
                produced = Artifact.from_dir(step.produces, out_dir)
                metrics.update(step.ensures(source, produced) or {})
            check_finite(step, out_dir)
            seconds = round(time.perf_counter() - start, 3)
            entry = self.cache.commit(
                key,
                staging,
                step.produces,
                {
                    "pass": step.name,
                    "version": step.version,
                    "config": config,
                    "placement": placement,
                    "input_digest": source.digest,
                    "output_digest": produced.digest,
                    "seconds": seconds,
                    "resources": meter.resources,
                    "metrics": metrics,
                    "finite": True,  # every weight checked (check_finite)
                    KEY_FIELDS: fields,  # what the key was computed from: checked on every hit
                },
            )
        peak = meter.resources["peak_rss_bytes"]
        log.info(
            "pass %d/%d %s: done in %.1f s (CPU %.1f s, peak RSS %s)",
            index,
            len(self.passes),
            step.name,
            seconds,
            meter.resources["cpu_seconds"],
            "unknown" if peak is None else f"{peak / 2**30:.2f} GiB",
        )
        return entry.artifact, _record(step, entry, cache_hit=False)


def check_finite(step: Pass, out_dir: Path) -> None:
    """A one-line :class:`PassError` naming the pass, the file and the tensor unless every weight
    of ``step``'s output in ``out_dir`` is finite (and the fix: ``Pass.nonfinite_hint``)."""
    started = time.perf_counter()
    try:
        found = first_nonfinite(out_dir)
    except ValueError as exc:
        raise PassError(f"pass '{step.name}' wrote an unreadable output: {exc}; nothing was cached") from None
    log.debug("pass %s: weights checked finite in %.1f s", step.name, time.perf_counter() - started)
    if found is not None:
        raise PassError(
            f"pass '{step.name}' produced non-finite weights ({found.count}+ NaN or infinite values in "
            f"tensor {found.tensor} of {found.file}); nothing was cached: {step.nonfinite_hint()}"
        )


def _record(step: Pass, entry: CacheEntry, cache_hit: bool) -> PassRecord:
    """The run-record line of a pass, from its cache entry (fresh or reused)."""
    stored = entry.record
    return PassRecord(
        name=step.name,
        pass_class=f"{type(step).__module__}.{type(step).__qualname__}",
        version=step.version,
        config=stored["config"],
        input_digest=stored["input_digest"],
        output_digest=entry.artifact.digest,
        seconds=float(stored.get("seconds", 0.0)),
        cache_hit=cache_hit,
        cache_key=entry.key,
        metrics=stored.get("metrics", {}),
        placement=stored.get("placement", {}),
        resources={**empty_resources(), **stored.get("resources", {})},
    )
