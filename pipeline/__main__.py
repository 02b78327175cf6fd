"""``python -m pipeline model=llama quant=none``: the Hydra entry point.

User mistakes (bad paths, digests, recipes) print one ``error:`` line and exit with code 2;
a FAIL of the eval gate exits with code 3 (after the summary); Ctrl-C exits with 130 and leaves
no partial output (every write is staged and renamed).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from pipeline.artifacts import Artifact
from pipeline.config import EvalConfig, QualityConfig, register_pipeline_schemas
from pipeline.errors import PipelineError
from pipeline.plugins import discover_passes

log = logging.getLogger("pipeline")
GATE_FAILED = 3  # distinct from a user mistake's 2

register_pipeline_schemas()
discover_passes()


@hydra.main(config_path="../configs", config_name="pipeline", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from evals.agreement import compare
    from evals.gate import GateError, run_gate
    from evals.suites import SuiteError
    from pipeline.run import run_pipeline
    from pipeline.runtime import Engine
    from pipeline.summary import print_summary

    def quality(candidate: Path, reference: Path | None, config: QualityConfig) -> dict:
        return compare(Engine(candidate), Engine(reference) if reference else None, config)

    def gate(
        candidate: Artifact, baseline: Artifact, config: EvalConfig, kl: float | None, cache: Path | None
    ) -> dict:
        from evals.stats import GateThresholds

        thresholds = {
            s: GateThresholds(t.max_drop, t.min_recovery, config.max_kl) for s, t in config.thresholds.items()
        }
        return run_gate(
            (candidate.path, candidate.digest),
            (baseline.path, baseline.digest),
            config.suites,
            thresholds,
            score_fn(config),
            eval_settings(config),
            kl=kl,
            cache_dir=cache,
            confidence=config.confidence,
            resamples=config.resamples,
            seed=config.seed,
        )

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        if cfg.eval.enabled:
            check_eval(cfg.eval)
        result = run_pipeline(cfg, run_dir, list(hydra_cfg.overrides.task), quality_fn=quality, gate_fn=gate)
    except (PipelineError, GateError, SuiteError) as exc:
        log.debug("pipeline error", exc_info=True)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: nothing half-written was kept; rerun to resume from the cache", file=sys.stderr)
        sys.exit(130)
    print_summary(result.manifest, run_dir)
    if result.manifest["gate"]["verdict"] == "FAIL":
        print(f"gate FAIL: {result.manifest['gate']['reason']}", file=sys.stderr)
        sys.exit(GATE_FAILED)


def check_eval(config: DictConfig) -> None:
    """Unknown suites or missing thresholds: a one-line error before anything is built."""
    from evals.engine_scores import RANK_METRICS
    from evals.gate import GateError, check_suites
    from evals.suites import SPECS

    check_suites(list(config.suites), dict(config.thresholds), sorted(SPECS))
    if config.rank_metric not in RANK_METRICS:
        raise GateError(f"eval.rank_metric={config.rank_metric!r}: choose one of {', '.join(RANK_METRICS)}")


def eval_settings(config: EvalConfig) -> dict:
    """What the per-engine scores depend on besides the engine: the key of their cache."""
    import importlib.metadata
    import json

    from evals.suites import DATA_DIR

    manifest = json.loads((DATA_DIR / "MANIFEST.json").read_text())
    return {
        "size": str(config.size),
        "scoring": str(config.scoring),
        "rank_metric": config.rank_metric,
        "limit": config.limit,
        "suites": {name: entry["sha256"] for name, entry in manifest["files"].items()},
        "lm_eval": importlib.metadata.version("lm-eval"),
    }


def score_fn(config: EvalConfig):
    from evals.engine_scores import lm_eval_scores

    def score(engine: Path, suite: str) -> list:
        size, scoring = str(config.size), str(config.scoring)
        return lm_eval_scores(engine, suite, size, scoring, config.rank_metric, config.limit, config.threads)

    return score


if __name__ == "__main__":
    main()
