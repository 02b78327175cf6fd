"""``python -m pipeline model=llama quant=none``: the Hydra entry point.

User mistakes (bad paths, digests, recipes) print one ``error:`` line and exit with code 2;
a FAIL of the eval gate exits with code 3 (after the summary) and publishes nothing; a PASS is
published to the registry (``registry=local``, the default; ``pipeline/publish.py``); Ctrl-C
exits with 130 and leaves no partial output (every write is staged and renamed).
In a multirun (``-m``, the nightly matrix) each job records its exit code in its folder instead
of exiting, so one failing recipe does not stop the others; the sweep then exits with the worst
code (``pipeline/nightly.py``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pipeline.config import QualityConfig, RegistryConfig, register_pipeline_schemas
from pipeline.errors import PipelineError
from pipeline.plugins import discover_passes

log = logging.getLogger("pipeline")

register_pipeline_schemas()
discover_passes()


@hydra.main(config_path="../configs", config_name="pipeline", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from pipeline.nightly import write_job_status

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    code, message = run(cfg, run_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        write_job_status(run_dir, code, message)
    elif code:
        sys.exit(code)


def run(cfg: DictConfig, run_dir: Path) -> tuple[int, str]:
    """One job: (exit code, what it ended with). Errors are printed here, one line each."""
    from evals.agreement import compare
    from evals.gate import GateError
    from evals.suites import SuiteError
    from pipeline.gate import GATE_FAILED, check_eval, gate_fn
    from pipeline.nightly import apply_nightly
    from pipeline.publish import check_registry, publish_run
    from pipeline.run import run_pipeline
    from pipeline.runtime import Engine
    from pipeline.summary import print_summary

    def quality(candidate: Path, reference: Path | None, config: QualityConfig) -> dict:
        return compare(Engine(candidate), Engine(reference) if reference else None, config)

    def fail(code: int, message: str) -> tuple[int, str]:
        print(message, file=sys.stderr)
        return code, message

    hydra_cfg = HydraConfig.get()
    overrides = list(hydra_cfg.overrides.task)
    try:
        if cfg.get("nightly"):
            apply_nightly(cfg, overrides)
        if cfg.eval.enabled:
            check_eval(cfg.eval)
        registry_cfg = OmegaConf.to_object(cfg.registry) if cfg.registry else None
        if registry_cfg is not None:
            assert isinstance(registry_cfg, RegistryConfig)
            check_registry(registry_cfg)
        result = run_pipeline(cfg, run_dir, overrides, quality_fn=quality, gate_fn=gate_fn)
    except (PipelineError, GateError, SuiteError) as exc:
        log.debug("pipeline error", exc_info=True)
        return fail(2, f"error: {exc}")
    except KeyboardInterrupt:
        return fail(130, "interrupted: nothing half-written was kept; rerun to resume from the cache")
    print_summary(result.manifest, run_dir)
    published = ""
    if registry_cfg is not None:
        try:
            published = publish_run(registry_cfg, run_dir, result.manifest, hydra_cfg.runtime.choices)
            print(published)
        except PipelineError as exc:
            return fail(2, f"error: {exc}")
        except KeyboardInterrupt:
            return fail(130, "interrupted while publishing: nothing was published; the run is complete")
    if result.manifest["gate"]["verdict"] == "FAIL":
        return fail(GATE_FAILED, f"gate FAIL: {result.manifest['gate']['reason']}")
    return 0, published or f"gate {result.manifest['gate']['verdict']}"


if __name__ == "__main__":
    main()
