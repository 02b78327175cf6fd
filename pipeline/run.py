"""One pipeline run: validate the recipe, resolve the source, run the passes through the cache
(and the draft's, with ``speculative=draft``), place the engine, benchmark it, write the run
record.

Everything the run writes into its output folder appears by atomic rename, and only after the
passes and the benchmark have finished (the engine folder, then ``manifest.json``), so Ctrl-C or
a crash leaves finished files or nothing (plus Hydra's log and ``.hydra/``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline.bench import measure
from pipeline.config import DRIFT_FAMILIES, BenchConfig, EvalConfig, ModelConfig, QualityConfig, section
from pipeline.core.artifacts import Artifact, Kind, link_tree
from pipeline.core.base import Pass
from pipeline.core.cache import Cache, library_versions
from pipeline.core.errors import EngineError
from pipeline.core.manager import PassManager, check_against_model, validate
from pipeline.core.memory import preflight
from pipeline.core.plugins import build_passes
from pipeline.core.staging import owned_folder, remove_abandoned, storage_error, unique_name
from pipeline.gate import calibration_length
from pipeline.manifest import MANIFEST_FILE, build_manifest, write_manifest
from pipeline.serving_bench import plot_serving
from pipeline.sources import resolve_source
from pipeline.speculative import attach_draft, build_draft, draft_passes, draft_summary, speculative_config
from pipeline.summary import SUMMARY_FILE, gate_verdict_lines

log = logging.getLogger(__name__)

ENGINE_DIR = "engine"
# The lock-owned staging a run keeps in its folder while it runs (``staging.unique_name``): the
# engine copy, the scratch cache of ``pipeline.cache=false``, the run record's temporary file and
# (a sweep's job) its summary's.
RUN_STAGING = re.compile(
    rf"\.({ENGINE_DIR}|{ENGINE_DIR}\.old|work|{re.escape(MANIFEST_FILE)}|{re.escape(SUMMARY_FILE)})"
    rf"\.\d+\.[0-9a-f]{{12}}"
)
SERVING_PLOT = "serving.png"  # bench=serving: throughput vs concurrency
# Groups whose passes optimize; the reference engine is the same recipe with all of them off.
OPTIMIZATION_GROUPS = ("prune", "distill", "quant", "kv_cache", "fusion")

# (candidate engine folder, reference engine folder or None when identical, config) -> record
QualityFn = Callable[[Path, Path | None, QualityConfig], dict[str, Any]]
# (candidate engine, baseline engine, config, the quality record, the recipe's drift family,
# cache folder, the recipe's shortest calibration window or None) -> the gate record
# ({"verdict": "PASS" | "FAIL" | "INCONCLUSIVE", "reason": ..., "suites": {...}, "drift": {...},
# "warnings": [...]}); engines as (folder, content digest).
GateFn = Callable[
    [Artifact, Artifact, EvalConfig, dict[str, Any] | None, str, Path | None, int | None], dict[str, Any]
]


def drift_family(passes: list[Pass]) -> str:
    """The recipe's family among the gate's token-level bounds: the loosest of its passes'."""
    return max((p.drift_family() for p in passes), key=DRIFT_FAMILIES.index, default=DRIFT_FAMILIES[0])


@dataclass
class RunResult:
    run_dir: Path
    engine_dir: Path
    manifest_path: Path
    manifest: dict[str, Any]


def place_engine(engine: Artifact, run_dir: Path) -> Path:
    """Put the engine of the cache into ``run_dir/engine`` atomically: hard-linked (copied across
    file systems) into a lock-owned staging folder ``.engine.<pid>.<random>``, then renamed. Ctrl-C,
    SIGTERM or an error removes the staging folder; after a SIGKILL the next run does
    (:func:`remove_abandoned_runs`). Cache files are never written in place, so sharing them with
    the run folder is safe (an edit to either is caught by the cache's digest check)."""
    final = run_dir / ENGINE_DIR
    try:
        with owned_folder(run_dir / unique_name(f".{ENGINE_DIR}")) as staging:
            link_tree(engine.path, staging)
            if final.exists():  # a rerun into the same folder: swap, never a half-removed engine
                with owned_folder(run_dir / unique_name(f".{ENGINE_DIR}.old")) as old:
                    os.rename(final, old / ENGINE_DIR)
                    os.rename(staging, final)
            else:
                os.rename(staging, final)
    except OSError as exc:
        error = storage_error(exc, f"cannot place the engine in {run_dir}", "hydra.run.dir")
        if error is None:
            raise
        raise error from None
    return final


def remove_abandoned_runs(run_dir: Path, max_age_s: float | None = None) -> None:
    """Remove the staging that killed runs left in ``run_dir`` and its sibling run folders (the
    engine copy, the scratch cache of ``pipeline.cache=false``, the run record's temporary
    file): only those whose owner's lock is free, so live jobs on other hosts keep theirs."""
    parent = run_dir.parent
    try:
        siblings = [p for p in parent.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return
    for folder in siblings:
        for path in remove_abandoned(folder, ".", max_age_s, pattern=RUN_STAGING):
            log.info("removed %s: its run was killed", path)


def staging_max_age_s(cfg: DictConfig) -> float | None:
    """``pipeline.staging_max_age_h`` in seconds (None: staging is removed by lock only)."""
    hours = cfg.pipeline.get("staging_max_age_h")
    return None if hours is None else float(hours) * 3600


def reference_passes(cfg: DictConfig) -> list[Pass]:
    """The passes of the reference engine: this recipe with every optimization group off."""
    reference = cfg.copy()
    with open_dict(reference):
        for group in OPTIMIZATION_GROUPS:
            reference[group] = {}
    return build_passes(reference)


def run_pipeline(
    cfg: DictConfig,
    run_dir: Path,
    overrides: list[str] | None = None,
    quality_fn: QualityFn | None = None,
    gate_fn: GateFn | None = None,
) -> RunResult:
    """Run the recipe. ``quality_fn`` and ``gate_fn`` (from the entry point, which may import
    ``evals``) score the engine against the reference engine: token agreement on held-out text,
    and the eval gate's suites."""
    started = dt.datetime.now(dt.UTC)
    run_dir.mkdir(parents=True, exist_ok=True)
    passes = build_passes(cfg)
    validate(passes, Kind.TORCH)  # before any download or conversion
    spec_cfg = speculative_config(cfg)
    drafting = draft_passes(cfg) if spec_cfg.enabled else []
    if drafting:
        validate(drafting, Kind.TORCH)
    speculative = None

    model_cfg = section(cfg, "model")
    assert isinstance(model_cfg, ModelConfig)
    max_age_s = staging_max_age_s(cfg)
    source = resolve_source(model_cfg, Path(cfg.pipeline.models_dir), max_age_s)
    log.info("source %s (%s)", source.path, source.digest[:12])
    # The model-dependent knobs (a seq_len beyond the model's context...) before the memory
    # preflight, whose estimate they would otherwise blow up under another knob's name.
    check_against_model(passes, source)
    bench_cfg = section(cfg, "bench")
    assert isinstance(bench_cfg, BenchConfig)
    # Before the first pass: refuse a recipe whose estimated peak memory exceeds what is available.
    bench_shape = (bench_cfg.prompt_lengths, bench_cfg.decode_tokens, bench_cfg.batch_size)
    shared_cache = Cache(Path(cfg.pipeline.cache_dir), max_age_s=max_age_s) if cfg.pipeline.cache else None
    preflight(
        passes,
        source.path,
        cfg.pipeline.get("max_memory_gib"),
        bench_shape if bench_cfg.enabled else None,
        cached=PassManager(passes, shared_cache).cached_prefix(source) if shared_cache else 0,
    )

    remove_abandoned_runs(run_dir, max_age_s)
    scratch = contextlib.ExitStack()  # pipeline.cache=false: a throwaway cache in the run folder
    benchmark = None
    quality_cfg = section(cfg, "quality")
    assert isinstance(quality_cfg, QualityConfig)
    quality = None
    eval_cfg = section(cfg, "eval")
    assert isinstance(eval_cfg, EvalConfig)
    gate = None
    family = drift_family(passes)
    try:
        if shared_cache is not None:
            cache = shared_cache
        else:  # lock-owned: removed on any exit, or by the next run after a SIGKILL
            cache = Cache(scratch.enter_context(owned_folder(run_dir / unique_name(".work"))), enabled=False)
        engine, records = PassManager(passes, cache).run(source)
        if drafting:
            draft, draft_records = build_draft(drafting, source, engine, cache)
            engine, attach_hit = attach_draft(cache, engine, draft, spec_cfg.k)
            speculative = draft_summary(draft, draft_records, spec_cfg.k, attach_hit)
        if quality_fn is not None and quality_cfg.enabled:
            quality = _quality(cfg, source, cache, engine, quality_cfg, quality_fn)
        if gate_fn is not None and eval_cfg.enabled:
            log.info("gate: the engine vs the reference engine on %s", ", ".join(eval_cfg.suites))
            reference = _reference(cfg, source, cache)
            gate_cache = cache.root if cache.enabled else None
            calibrated = calibration_length([p.config_dict() for p in passes])
            gate = gate_fn(engine, reference, eval_cfg, quality, family, gate_cache, calibrated)
            log_verdict(gate)  # now, not after the benchmark: the summary repeats it
        if bench_cfg.enabled:  # measured where the engine lies, before anything lands in run_dir
            bench_cache = Path(cfg.pipeline.cache_dir) if cfg.pipeline.cache else None
            peer = None
            if bench_cfg.vs_reference or (bench_cfg.vs_reference is None and cfg.prune):
                reference = _reference(cfg, source, cache)
                peer = (reference.path, reference.digest)
            benchmark = measure(engine.path, engine.digest, bench_cfg, bench_cache, peer)
        engine_dir = place_engine(engine, run_dir)
        if benchmark and benchmark.get("serving") and "rows" in benchmark["serving"]:
            plot = plot_serving(benchmark["serving"], run_dir / SERVING_PLOT)
            benchmark["serving"]["plot"] = plot.name if plot else None
    finally:
        scratch.close()

    manifest = build_manifest(
        source=source,
        recipe=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),  # type: ignore[arg-type]
        overrides=list(overrides or []),
        records=records,
        engine=Artifact.from_dir(Kind.ENGINE, engine_dir, engine.digest),
        engine_dir=engine_dir,
        benchmark=benchmark,
        quality=quality,
        gate=gate,
        speculative=speculative,
        drift_family=family,
        started=started,
    )
    return RunResult(run_dir, engine_dir, write_manifest(run_dir, manifest), manifest)


def log_verdict(gate: dict[str, Any]) -> None:
    """The gate's verdict and its per-suite numbers, one log line each, as soon as it is known
    (a PASS at INFO, a FAIL or INCONCLUSIVE at WARNING)."""
    level = logging.INFO if gate.get("verdict") == "PASS" else logging.WARNING
    for line in gate_verdict_lines(gate):
        log.log(level, "%s", line)


def _quality(
    cfg: DictConfig,
    source: Artifact,
    cache: Cache,
    engine: Artifact,
    config: QualityConfig,
    quality_fn: QualityFn,
) -> dict[str, Any]:
    """Build (or reuse from the cache) the reference engine and score the engine against it."""
    reference = _reference(cfg, source, cache)
    # Deterministic given both engines and the settings, so kept like a pass output.
    payload = {"engine": engine.digest, "reference": reference.digest, "config": asdict(config)}
    key = hashlib.sha256(json.dumps({**payload, "libs": library_versions()}, sort_keys=True).encode())
    stored = cache.root / "quality" / f"{key.hexdigest()}.json"
    expected = json.loads(json.dumps(payload))  # as a record read back holds it

    def check(record: dict[str, Any]) -> str | None:
        return quality_problem(record, expected)

    # A broken record, or one whose fields are of the wrong type or out of range, is recomputed.
    found = cache.read_record(stored, check=check) if cache.enabled else None
    if found is not None:
        return {**found, "cache_hit": True}
    log.info("quality: scoring on held-out text '%s'", config.text)
    same = reference.digest == engine.digest
    record = {**quality_fn(engine.path, None if same else reference.path, config), **payload}
    problem = quality_problem(json.loads(json.dumps(record)), expected)
    if problem is not None:  # never cached: it would be read back as broken
        raise EngineError(
            f"quality: the score of engine {engine.path} is unusable ({problem}); nothing was cached"
        )
    if cache.enabled:
        cache.write_record(stored, record)
    return {**record, "cache_hit": False}


# The numbers of a quality record (``evals.agreement.compare``) and their ranges: (low, high, integer).
QUALITY_NUMBERS: dict[str, tuple[float, float, bool]] = {
    "tokens_scored": (1, math.inf, True),
    "windows": (1, math.inf, True),
    "window": (1, math.inf, True),
    "chunk": (0, math.inf, True),
    "perplexity": (0.0, math.inf, False),
    "reference_perplexity": (0.0, math.inf, False),
    "kl_mean": (-1e-6, math.inf, False),  # a KL, up to float rounding
    "top1_agreement": (0.0, 1.0, False),
}
QUALITY_REQUIRED = ("perplexity", "reference_perplexity", "kl_mean", "top1_agreement", "tokens_scored")


def quality_problem(record: dict[str, Any], payload: dict[str, Any]) -> str | None:
    """What is wrong with a quality record for the engines and settings of ``payload`` (None:
    nothing): another engine, reference or config, a missing score, a number of the wrong type,
    not finite or out of range, or a text or flag of the wrong type."""
    for name, value in payload.items():
        if record.get(name) != value:
            return f"its {name} is not this run's"
    for name in QUALITY_REQUIRED:
        if name not in record:
            return f"it has no {name}"
    for name, (low, high, integral) in QUALITY_NUMBERS.items():
        if name not in record:
            continue
        value = record[name]
        typed = isinstance(value, int) if integral else isinstance(value, int | float)
        if isinstance(value, bool) or not typed or not math.isfinite(value) or not low <= value <= high:
            return f"its {name} {value!r} is not a finite number in [{low:g}, {high:g}]"
    if record["perplexity"] <= 0 or record["reference_perplexity"] <= 0:
        return "a perplexity is not positive"
    if not isinstance(record.get("text", ""), str) or not isinstance(record.get("same_engine", False), bool):
        return "its text or same_engine is of the wrong type"
    return None


def _reference(cfg: DictConfig, source: Artifact, cache: Cache) -> Artifact:
    """The reference engine: this recipe with no optimization passes (built once, then cached)."""
    log.info("reference engine (no optimization passes)")
    reference, _ = PassManager(reference_passes(cfg), cache).run(source)
    return reference
