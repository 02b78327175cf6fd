"""The eval gate as an entry point: ``python -m pipeline.gate --baseline DIR --candidate DIR``.

Compares any two engine folders (tonight's build vs the stable one, a hand-built engine vs
ours) with the same suites, statistics, table and exit codes as the gate that ends every
``python -m pipeline`` run (which calls ``gate_fn`` here): 0 PASS, 3 FAIL, 2 bad input. Each
folder is an engine folder (``engine.json``) with the run's ``manifest.json`` beside it, or the
run folder holding both. Token-level KL (the ``max_kl`` rule) is measured here on the held-out
text. Like ``pipeline/__main__.py`` this is an entry point, so it may import ``evals``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import OmegaConf

from pipeline.artifacts import Artifact, Kind, digest_of, sha256_file, write_json
from pipeline.config import EvalConfig, QualityConfig
from pipeline.errors import EngineError, PipelineError, describe_os_error, first_line
from pipeline.signals import exit_code, interrupt_on_sigterm

GATE_FAILED = 3  # distinct from a user mistake's 2
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "eval"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def gate_fn(
    candidate: Artifact, baseline: Artifact, config: EvalConfig, kl: float | None, cache: Path | None
) -> dict[str, Any]:
    """Score both engines on the configured suites and judge them (``pipeline.run.GateFn``)."""
    from evals.gate import run_gate
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


def check_eval(config: Any) -> None:
    """Unknown suites, missing thresholds, a bad metric: one-line errors before anything runs."""
    from evals.engine_scores import RANK_METRICS
    from evals.gate import GateError, check_suites
    from evals.suites import SPECS

    check_suites(list(config.suites), dict(config.thresholds), sorted(SPECS))
    if config.rank_metric not in RANK_METRICS:
        raise GateError(f"eval.rank_metric={config.rank_metric!r}: choose one of {', '.join(RANK_METRICS)}")


def eval_settings(config: EvalConfig) -> dict[str, Any]:
    """What an engine's scores depend on besides the engine: the key of their cache."""
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


def score_fn(config: EvalConfig) -> Callable[[Path, str], list[Any]]:
    from evals.engine_scores import lm_eval_scores

    def score(engine: Path, suite: str) -> list[Any]:
        size, scoring = str(config.size), str(config.scoring)
        return lm_eval_scores(engine, suite, size, scoring, config.rank_metric, config.limit, config.threads)

    return score


# --------------------------------------------------------------------------------------------
# The standalone CLI


def eval_options() -> list[str]:
    """The ``--eval`` choices: the configs in ``configs/eval`` but ``none``."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem != "none")


def load_eval_config(size: str, overrides: list[str]) -> EvalConfig:
    """``configs/eval/<size>.yaml`` with ``key=value`` overrides, checked against EvalConfig:
    unknown keys, wrong types and out-of-range values (``EvalConfig.__post_init__``) are one-line
    errors."""
    options = eval_options()
    if size not in options:  # also keeps --eval from naming a file outside configs/eval
        raise PipelineError(f"--eval {size}: no such eval config; choose one of {', '.join(options)}")
    data = OmegaConf.load(CONFIG_DIR / f"{size}.yaml")
    data.pop("defaults", None)
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise PipelineError(f"--set {item!r}: write KEY=VALUE, e.g. --set limit=12")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(EvalConfig), data, OmegaConf.from_dotlist(overrides))
        config = OmegaConf.to_object(merged)  # builds EvalConfig: its __post_init__ checks run
    except PipelineError as exc:  # EvalConfig's own range checks (ConfigError)
        raise PipelineError(f"--set {' '.join(overrides)}: {first_line(exc)}") from None
    except Exception as exc:  # omegaconf's validation errors: unknown key, wrong type
        known = f" (keys: {', '.join(EvalConfig.__dataclass_fields__)})" if "Key" in first_line(exc) else ""
        raise PipelineError(f"--set {' '.join(overrides)}: {first_line(exc)}{known}") from None
    assert isinstance(config, EvalConfig)
    return config


def resolve_engine(folder: Path, role: str) -> tuple[Artifact, dict[str, Any]]:
    """The engine and its run manifest for an engine folder or the run folder holding it. The
    engine folder must still be what the manifest recorded: every file listed, with its sha256,
    and nothing else (a symlink leading out of the folder is refused)."""
    from pipeline.registry.records import check_engine_folder, check_files
    from pipeline.registry.refs import RegistryError

    folder = Path(folder)
    engine = folder if (folder / "engine.json").is_file() else folder / "engine"
    if not (engine / "engine.json").is_file():
        raise EngineError(f"--{role} {folder}: not an engine folder (no engine.json): pass a run's engine/")
    manifest_path = engine.parent / "manifest.json"
    if not manifest_path.is_file():
        raise EngineError(
            f"--{role} {engine}: no manifest.json beside it; the gate compares engines of pipeline runs"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise EngineError(f"--{role} {manifest_path} is unreadable ({first_line(exc)})") from None
    recorded = manifest.get("engine") if isinstance(manifest, dict) else None
    if not isinstance(recorded, dict):
        raise EngineError(f"--{role} {manifest_path} records no engine: the gate compares pipeline runs")
    try:
        files = check_files(recorded.get("files"), str(manifest_path))
        digests = check_engine_folder(engine, files, str(manifest_path))
    except RegistryError as exc:
        raise EngineError(f"--{role}: {exc}") from None
    return Artifact.from_dir(Kind.ENGINE, engine, digest_of(digests)), manifest


def check_same_tokenizer(baseline: Path, candidate: Path) -> None:
    for name in TOKENIZER_FILES:
        base, cand = baseline / name, candidate / name
        if base.is_file() != cand.is_file() or (base.is_file() and sha256_file(base) != sha256_file(cand)):
            raise EngineError(
                f"the candidate's {name} differs from the baseline's: paired items need one tokenizer "
                "(compare engines of the same source)"
            )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, like every other user mistake
        self.exit(2, f"error: {message} (see --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="python -m pipeline.gate", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="engine (or run) folder: the reference")
    parser.add_argument("--candidate", type=Path, required=True, help="engine (or run) folder to judge")
    parser.add_argument("--eval", default="full", help="configs/eval option: quick | full (default full)")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="eval overrides, e.g. 'suites=[reasoning]'"
    )
    parser.add_argument("--cache-dir", type=Path, default=Path("artifacts/cache"), help="score cache")
    parser.add_argument("--no-kl", action="store_true", help="skip the held-out token agreement")
    parser.add_argument("--json", type=Path, help="also write the gate record here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from evals.gate import GateError
    from evals.suites import SuiteError

    interrupt_on_sigterm()
    args = parse_args(argv)
    try:
        config = load_eval_config(args.eval, list(args.set))
        check_eval(config)
        baseline, _ = resolve_engine(args.baseline, "baseline")
        candidate, _ = resolve_engine(args.candidate, "candidate")
        check_same_tokenizer(baseline.path, candidate.path)
        kl = None if args.no_kl else _token_kl(baseline.path, candidate.path)
        record = gate_fn(candidate, baseline, config, kl, args.cache_dir)
    except (PipelineError, GateError, SuiteError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the score cache cannot be written: one line naming the path
        print(f"error: {describe_os_error(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print("interrupted: scores finished so far are cached; rerun to resume", file=sys.stderr)
        return exit_code(exc)
    from rich.console import Console

    from pipeline.summary import gate_table

    Console().print(gate_table(record))
    if args.json:
        try:
            write_json(args.json, record)
        except OSError as exc:
            exc.add_note("the gate record, --json")
            print(f"error: {describe_os_error(exc)}", file=sys.stderr)
            return 1
    passed = record["verdict"] == "PASS"
    print(f"gate {record['verdict']}: {record['reason']}", file=sys.stdout if passed else sys.stderr)
    return 0 if passed else GATE_FAILED


def _token_kl(baseline: Path, candidate: Path) -> float:
    from evals.agreement import compare
    from pipeline.runtime import Engine

    return float(compare(Engine(candidate), Engine(baseline), QualityConfig())["kl_mean"])


if __name__ == "__main__":
    sys.exit(main())
