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

from pipeline.config import QualityConfig, register_pipeline_schemas
from pipeline.errors import PipelineError
from pipeline.plugins import discover_passes

log = logging.getLogger("pipeline")

register_pipeline_schemas()
discover_passes()


@hydra.main(config_path="../configs", config_name="pipeline", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from evals.agreement import compare
    from evals.gate import GateError
    from evals.suites import SuiteError
    from pipeline.gate import GATE_FAILED, check_eval, gate_fn
    from pipeline.run import run_pipeline
    from pipeline.runtime import Engine
    from pipeline.summary import print_summary

    def quality(candidate: Path, reference: Path | None, config: QualityConfig) -> dict:
        return compare(Engine(candidate), Engine(reference) if reference else None, config)

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        if cfg.eval.enabled:
            check_eval(cfg.eval)
        overrides = list(hydra_cfg.overrides.task)
        result = run_pipeline(cfg, run_dir, overrides, quality_fn=quality, gate_fn=gate_fn)
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


if __name__ == "__main__":
    main()
