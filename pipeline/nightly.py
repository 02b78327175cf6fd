"""Nightly builds: ``+nightly=true`` on a Hydra multirun over the model x recipe matrix.

    python -m pipeline -m model=llama quant=none,fp8,int8,int4_awq hydra/launcher=joblib +nightly=true

The launcher plugin runs the jobs (joblib here; submitit for SLURM or Ray on a cluster; we
write no scheduler). A nightly job runs the full gate unless an ``eval`` option is given, and a
PASS is published to the registry's ``nightly`` channel unless ``registry.channel`` says
otherwise. Each job writes ``job_status.json`` (exit code, last line) in its folder instead of
exiting, so one failing recipe does not stop the others, and its summary in ``summary.txt``
there instead of the shared stdout (parallel jobs would interleave their tables: each prints one
line); :class:`SweepStatus` (a Hydra callback in ``configs/pipeline.yaml``) prints one table of
every job (from their run records) and one line per job when the sweep ends, and exits with the
worst code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline.core.artifacts import write_json
from pipeline.core.errors import one_line
from pipeline.core.files import loads_bounded
from pipeline.summary import make_console, sweep_table

NIGHTLY_CHANNEL = "nightly"
JOB_STATUS = "job_status.json"


def apply_nightly(cfg: DictConfig, overrides: list[str]) -> None:
    """The nightly defaults, under what the command line set: the full gate (with its ``eval.*``
    overrides) when no eval option is chosen, and the ``nightly`` channel."""
    from pipeline.gate import load_eval_config

    with open_dict(cfg):
        if not cfg.eval.enabled:
            settings = [o.removeprefix("eval.") for o in overrides if o.startswith("eval.")]
            cfg.eval = OmegaConf.structured(load_eval_config("full", settings))
        if cfg.registry and cfg.registry.channel is None:
            cfg.registry.channel = NIGHTLY_CHANNEL


def write_job_status(run_dir: Path, code: int, message: str) -> None:
    """The job's exit code and last line (always one line: a library's message can span many)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / JOB_STATUS, {"exit_code": code, "message": one_line(message)})


class SweepStatus(Callback):
    """At the end of a multirun: one table of the jobs (``pipeline.summary.sweep_table``: gate
    verdict, suite scores, drift, speed, from each job's ``manifest.json``) on stdout, one line
    per job (the overrides the sweep varied, the exit code, the last line) on stderr, and the
    sweep's exit code is the worst job's
    (2 bad input, 3 gate FAIL, 130 interrupted; a job that wrote no status counts as 1; a gate
    INCONCLUSIVE, 4, ranks below every failure: it asks for more evidence, not a fix)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(config.hydra.sweep.dir)
        jobs = sorted(
            (p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
        )
        overrides = {job: _job_overrides(job) for job in jobs}
        shared = set.intersection(*(set(o) for o in overrides.values())) if jobs else set()
        worst = 0
        lines, rows = [], []
        for job in jobs:
            status_file = job / JOB_STATUS
            status = json.loads(status_file.read_text()) if status_file.is_file() else None
            code = 1 if status is None else int(status["exit_code"])
            message = "no status written (the job crashed)" if status is None else one_line(status["message"])
            varied = " ".join(o for o in overrides[job] if o not in shared)  # what the sweep varied
            lines.append(f"job {job.name} [{varied}]: exit {code}: {message}")
            rows.append({"job": job.name, "varied": varied, "exit_code": code, "manifest": _run_record(job)})
            worst = max(worst, code, key=exit_severity)
        if jobs:
            sys.stdout.flush()
            make_console().print(sweep_table(rows))
        for line in lines:
            print(line, file=sys.stderr)
        if worst:
            sys.exit(worst)


def exit_severity(code: int) -> tuple[bool, bool, int]:
    """Order of exit codes by how bad they are: 0, then INCONCLUSIVE, then the failures by code."""
    from pipeline.gate import GATE_INCONCLUSIVE

    return code != 0, code != GATE_INCONCLUSIVE, code


def _run_record(job: Path) -> dict[str, Any] | None:
    """The job's run record (``manifest.json``), or None: none written (the job failed before
    the end), or unreadable."""
    from pipeline.manifest import MANIFEST_FILE  # (its imports are the job's, not the launcher's)

    try:
        record = loads_bounded((job / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _job_overrides(job: Path) -> list[str]:
    path = job / ".hydra" / "overrides.yaml"
    return [str(o) for o in OmegaConf.load(path)] if path.is_file() else []
