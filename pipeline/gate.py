"""The eval gate as an entry point: ``python -m pipeline.gate --baseline DIR --candidate DIR``.

Compares any two engine folders (tonight's build vs the stable one, a hand-built engine vs
ours) with the same suites, statistics, table and exit codes as the gate that ends every
``python -m pipeline`` run (which calls ``gate_fn`` here): 0 PASS, 3 FAIL, 4 INCONCLUSIVE, 2 bad
input. Each folder is an engine folder (``engine.json``) with the run's ``manifest.json`` beside
it, or the run folder holding both. The token-level drift (held-out KL, top-1 agreement,
perplexity ratio) is measured here and judged by the candidate's recipe family, which its
manifest records (``--set family=...`` for an older manifest). Like ``pipeline/__main__.py``
this is an entry point, so it may import ``evals``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import OmegaConf

from pipeline.config import DRIFT_FAMILIES, EvalConfig, QualityConfig
from pipeline.core.artifacts import Artifact, Kind, digest_of, sha256_file, write_json
from pipeline.core.config import validate_tree
from pipeline.core.engine import read_engine_spec
from pipeline.core.errors import EngineError, PipelineError, first_line, print_error
from pipeline.core.files import check_output_file, loads_bounded, read_regular_text
from pipeline.core.signals import exit_code, interrupt_on_sigterm

GATE_FAILED = 3  # distinct from a user mistake's 2
GATE_INCONCLUSIVE = 4  # neither a PASS nor a shown regression: more items, or eval=full
GATE_EXIT_CODES = {"PASS": 0, "FAIL": GATE_FAILED, "INCONCLUSIVE": GATE_INCONCLUSIVE}
# Calibration windows at most 1/8 of the engine's context draw the long-context warning.
SHORT_CALIBRATION = 8
log = logging.getLogger(__name__)
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "eval"
JSON_WHAT = "the gate record, --json"
VALIDITY_WHAT = "the suite-validity report, --validity"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def gate_fn(
    candidate: Artifact,
    baseline: Artifact,
    config: EvalConfig,
    quality: dict[str, Any] | None,
    family: str,
    cache: Path | None,
    calibrated: int | None = None,
) -> dict[str, Any]:
    """Score both engines on the configured suites and judge them, and judge the token-level
    drift of ``quality`` by the bounds of the recipe's ``family`` (``pipeline.run.GateFn``).
    ``calibrated``: the shortest calibration window of the recipe's passes, in tokens (None:
    nothing calibrated), for the long-context warning (``long_context_warning``)."""
    from evals.drift import DriftRule
    from evals.gate import run_gate
    from evals.stats import GateThresholds
    from evals.validity import REPORT, read_report

    thresholds = {s: GateThresholds(t.max_drop, t.min_recovery) for s, t in config.thresholds.items()}
    family = config.family or family
    bounds = config.drift.get(family)
    rule = DriftRule(bounds.max_kl, bounds.min_top1, bounds.max_ppl_ratio) if bounds else DriftRule()
    chat = resolve_chat(config, candidate.path)
    record = run_gate(
        (candidate.path, candidate.digest),
        (baseline.path, baseline.digest),
        config.suites,
        thresholds,
        score_fn(config, chat),
        eval_settings(config, chat),
        drift=(family, rule),
        quality=quality,
        cache_dir=cache,
        confidence=config.confidence,
        resamples=config.resamples,
        seed=config.seed,
        validity=read_report(REPORT) if REPORT.is_file() else None,
    )
    warning = long_context_warning(config, candidate.path, calibrated)
    record["warnings"] = [warning] if warning else []
    if warning:
        log.warning("gate: %s", warning)
    return record


def calibration_length(pass_configs: list[Any]) -> int | None:
    """The shortest calibration window (``calibration.seq_len``) among the configs of a recipe's
    passes (as ``Pass.config_dict`` or the manifest's ``passes[i].config`` hold them)."""
    lengths = [
        config["calibration"]["seq_len"]
        for config in pass_configs
        if isinstance(config, dict)
        and isinstance(config.get("calibration"), dict)
        and isinstance(config["calibration"].get("seq_len"), int)
    ]
    return min(lengths, default=None)


def long_context_warning(config: EvalConfig, engine: Path, calibrated: int | None) -> str | None:
    """A warning when the gate scores long_context and the recipe calibrated on windows of
    1/``SHORT_CALIBRATION`` of the engine's context or less: scales fit to short windows miss
    the activation ranges of long ones, a known cause of long-context loss in quantized models
    (KVQuant, Hooper et al. 2024, on activation outliers that grow with position)."""
    if calibrated is None or "long_context" not in config.suites:
        return None
    try:
        max_length = read_engine_spec(engine, graphs=False).max_length
    except (OSError, PipelineError):
        return None
    if calibrated * SHORT_CALIBRATION > max_length:
        return None
    return (
        f"the recipe calibrated on {calibrated}-token windows, 1/{max_length // calibrated} of the engine's "
        f"{max_length}-token context: a known cause of long-context loss after quantization; watch "
        "long_context, or calibrate on longer windows (quant.calibration.seq_len)"
    )


def check_eval(config: Any) -> None:
    """Unknown suites, missing thresholds, a bad metric: one-line errors before anything runs."""
    from evals.engine_scores import RANK_METRICS
    from evals.gate import FIXED_SCORING, GateError, check_suites
    from evals.suites import SPECS

    check_suites(list(config.suites), dict(config.thresholds), [*sorted(SPECS), *FIXED_SCORING])
    if config.rank_metric not in RANK_METRICS:
        raise GateError(f"eval.rank_metric={config.rank_metric!r}: choose one of {', '.join(RANK_METRICS)}")


def has_chat_template(engine: Path) -> bool:
    """Whether the engine folder's tokenizer carries a chat template (as transformers reads it:
    ``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``)."""
    if (engine / "chat_template.jinja").is_file():
        return True
    try:
        text = read_regular_text(engine / "tokenizer_config.json", within=engine, what="a tokenizer config")
        tokenizer_config = loads_bounded(text)
    except (OSError, ValueError, PipelineError):
        return False
    return isinstance(tokenizer_config, dict) and bool(tokenizer_config.get("chat_template"))


def resolve_chat(config: EvalConfig, engine: Path) -> bool:
    """``eval.chat``, or (null) whether the engine's tokenizer has a chat template."""
    if config.chat is not None:
        if config.chat and not has_chat_template(engine):
            raise PipelineError(
                f"eval.chat=true: {engine}'s tokenizer has no chat template; set eval.chat=false"
            )
        return bool(config.chat)
    return has_chat_template(engine)


def eval_settings(config: EvalConfig, chat: bool) -> dict[str, Any]:
    """What an engine's scores depend on besides the engine: the key of their cache (and, in the
    gate record, how the items were put to the model)."""
    from evals.suites import DATA_DIR

    manifest = json.loads((DATA_DIR / "MANIFEST.json").read_text())
    return {
        "size": str(config.size),
        "scoring": str(config.scoring),
        "rank_metric": config.rank_metric,
        "chat": chat,
        "limit": config.limit,
        "suites": {name: entry["sha256"] for name, entry in manifest["files"].items()},
        "lm_eval": importlib.metadata.version("lm-eval"),
    }


def validity_report(
    config: EvalConfig, baseline: Artifact, cache: Path | None, earlier: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The suite-validity report (``evals.validity``) of the baseline's scores on every rule of
    ``config``: those the gate just scored (read back from the cache, or scored again). The rules
    of an ``earlier`` report that ``config`` does not score are kept, with their recorded scores,
    where it measured this baseline under today's settings (``kept_rules``): one rule can be
    measured at a time (``--set suites=[long_context]``), and every category is judged again at
    the level of the whole report."""
    from evals.gate import cached_scores, rule_scoring, rule_suite, suite_settings
    from evals.suites import load_suite
    from evals.validity import build_report, recorded_scores, rule_settings

    chat = resolve_chat(config, baseline.path)
    settings = eval_settings(config, chat)
    scorer = score_fn(config, chat)

    def matched(rule: str) -> dict[str, Any]:
        return rule_settings(suite_settings(settings, rule), rule_scoring(rule, settings["scoring"]))

    rules = {}
    for rule in kept_rules(earlier, config.suites, baseline.digest, matched):
        suite = rule_suite(rule)
        rules[rule] = (matched(rule), load_suite(suite, "full"), recorded_scores(earlier or {}, rule, suite))
    for rule in config.suites:
        scores = cached_scores(scorer, baseline.path, baseline.digest, rule, settings, cache)
        items = load_suite(rule_suite(rule), str(config.size))
        rules[rule] = (matched(rule), items, {s.id: s.score for s in scores})
    return build_report(rules, baseline.digest, config.confidence)


def kept_rules(
    earlier: dict[str, Any] | None,
    scored: list[str],
    reference: str,
    matched: Callable[[str], dict[str, Any]],
) -> list[str]:
    """The rules of an ``earlier`` report to keep beside those ``scored`` now: each one it holds
    for the same ``reference`` under today's settings (``matched(rule)``: suite files, scoring,
    rank metric, chat). What is not kept is printed, with why."""
    if not earlier:
        return []
    others = [rule for rule in earlier["rules"] if rule not in scored]
    if others and earlier.get("reference") != reference:
        print(f"suite validity: {', '.join(others)} not kept: the earlier report measured another reference")
        return []
    kept = []
    for rule in others:
        if earlier["rules"][rule]["settings"] == matched(rule):
            kept.append(rule)
        else:
            print(
                f"suite validity: {rule} not kept: its suite or settings changed since; "
                "add it to --set suites=[...]"
            )
    if kept:
        print(
            f"suite validity: {', '.join(kept)} kept from the earlier report "
            "(the same reference and settings)"
        )
    return kept


def earlier_report(path: Path) -> dict[str, Any] | None:
    """The report at ``path`` that a new one replaces (None: none there, or unreadable: then it is
    only replaced, with a notice)."""
    from evals.validity import ValidityError, read_report

    if not path.exists():
        return None
    try:
        return read_report(path)
    except ValidityError as exc:
        print(f"suite validity: the earlier report is replaced, nothing kept from it ({first_line(exc)})")
        return None


def write_validity(path: Path, report: dict[str, Any]) -> None:
    """The report to ``path`` and its table to stdout."""
    from evals.validity import report_table, write_report

    write_report(check_output_file(path, VALIDITY_WHAT), report)
    print("\n".join(report_table(report)))
    print(f"suite validity: written to {path}")


def score_fn(config: EvalConfig, chat: bool) -> Callable[[Path, str], list[Any]]:
    from evals.engine_scores import lm_eval_scores

    def score(engine: Path, suite: str) -> list[Any]:
        size, scoring = str(config.size), str(config.scoring)
        return lm_eval_scores(
            engine, suite, size, scoring, config.rank_metric, config.limit, config.threads, chat=chat
        )

    return score


# --------------------------------------------------------------------------------------------
# The standalone CLI


def eval_options() -> list[str]:
    """The ``--eval`` choices: the configs in ``configs/eval`` but ``none`` and the parts
    others include (``_drift``)."""
    return sorted(
        p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem != "none" and not p.stem.startswith("_")
    )


def load_eval_config(size: str, overrides: list[str]) -> EvalConfig:
    """``configs/eval/<size>.yaml`` with ``key=value`` overrides, checked against EvalConfig:
    unknown keys, wrong types and out-of-range values (``EvalConfig.validate``) are one-line
    errors."""
    options = eval_options()
    if size not in options:  # also keeps --eval from naming a file outside configs/eval
        raise PipelineError(f"--eval {size}: no such eval config; choose one of {', '.join(options)}")
    data = OmegaConf.load(CONFIG_DIR / f"{size}.yaml")
    # Hydra's defaults list, as composing ``eval=<size>`` reads it: each entry that is a file of
    # this group merges under the config itself (``_self_`` last); the schema comes from EvalConfig.
    parts = [
        OmegaConf.load(CONFIG_DIR / f"{entry}.yaml")
        for entry in data.pop("defaults", None) or []
        if isinstance(entry, str)
        and not entry.startswith("_self")
        and (CONFIG_DIR / f"{entry}.yaml").is_file()
    ]
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise PipelineError(f"--set {item!r}: write KEY=VALUE, e.g. --set limit=12")
    base = [OmegaConf.structured(EvalConfig), *parts, data]
    for item in overrides:  # each on its own first, so that the message names the bad one
        _build_eval_config(base, [item])
    return _build_eval_config(base, overrides)


def _build_eval_config(base: list[Any], overrides: list[str]) -> EvalConfig:
    """``base`` with ``overrides`` merged, built and validated; a mistake is one line naming them."""
    shown = " ".join(overrides)
    try:
        merged = OmegaConf.merge(*base, OmegaConf.from_dotlist(overrides))
        config = OmegaConf.to_object(merged)
        validate_tree(config)  # EvalConfig's range checks
    except PipelineError as exc:  # EvalConfig's own range checks (ConfigError)
        raise PipelineError(f"--set {shown}: {first_line(exc)}") from None
    except Exception as exc:  # omegaconf's validation errors: unknown key, wrong type
        known = f" (keys: {', '.join(EvalConfig.__dataclass_fields__)})" if "Key" in first_line(exc) else ""
        raise PipelineError(f"--set {shown}: {first_line(exc)}{known}") from None
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
        manifest = loads_bounded(read_regular_text(manifest_path, what="a run manifest"))
    except (OSError, UnicodeDecodeError, ValueError, PipelineError) as exc:
        raise EngineError(f"--{role} {manifest_path} is unreadable ({first_line(exc)})") from None
    recorded = manifest.get("engine") if isinstance(manifest, dict) else None
    if not isinstance(recorded, dict):
        raise EngineError(f"--{role} {manifest_path} records no engine: the gate compares pipeline runs")
    try:
        files = check_files(recorded.get("files"), str(manifest_path))
        digests = check_engine_folder(engine, files, str(manifest_path))
    except RegistryError as exc:
        raise EngineError(f"--{role}: {exc}") from None
    try:  # engine.json typed and every path it names confined, before anything is scored
        read_engine_spec(engine)
    except EngineError as exc:
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
        "--set",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="eval overrides, e.g. 'suites=[reasoning]'; repeat the flag or give several after it",
    )
    parser.add_argument("--cache-dir", type=Path, default=Path("artifacts/cache"), help="score cache")
    parser.add_argument(
        "--no-kl", action="store_true", help="skip the held-out token drift (the gate cannot PASS without it)"
    )
    parser.add_argument("--json", type=Path, help="also write the gate record here")
    parser.add_argument(
        "--validity",
        type=Path,
        help="also write the suite-validity report of the baseline's scores here (--eval full; the "
        "project's own: evals/data/suite_validity.json, of the default model's reference); the rules "
        "of the report already there that are not scored now are kept, for the same reference and settings",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    interrupt_on_sigterm()
    args = parse_args(argv)
    # The gate's progress (a line as each suite starts and ends) on stderr, as the pipeline logs it.
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    try:
        if args.json:  # before the gate runs: a FIFO, a link or a device there is never replaced
            check_output_file(args.json, JSON_WHAT)
        if args.validity:
            check_output_file(args.validity, VALIDITY_WHAT)
        config = load_eval_config(args.eval, list(args.set))
        check_eval(config)
        if args.validity and (str(config.size) != "full" or config.limit is not None):
            raise PipelineError(
                "--validity: a category's validity is measured on all its items: use --eval full"
            )
        baseline, _ = resolve_engine(args.baseline, "baseline")
        candidate, manifest = resolve_engine(args.candidate, "candidate")
        family = config.family or recorded_family(manifest, args.candidate)
        check_same_tokenizer(baseline.path, candidate.path)
        quality = None if args.no_kl else _token_quality(baseline.path, candidate.path)
        passes = [p.get("config") for p in manifest.get("passes") or [] if isinstance(p, dict)]
        record = gate_fn(
            candidate, baseline, config, quality, family, args.cache_dir, calibration_length(passes)
        )
        if args.validity:
            earlier = earlier_report(args.validity)
            write_validity(args.validity, validity_report(config, baseline, args.cache_dir, earlier))
    except (PipelineError, OSError) as exc:  # GateError, SuiteError; a score cache not written
        return print_error(exc)
    except KeyboardInterrupt as exc:
        print("interrupted: scores finished so far are cached; rerun to resume", file=sys.stderr)
        return exit_code(exc)
    from pipeline.summary import gate_table, make_console

    make_console().print(gate_table(record))
    if args.json:
        try:
            write_json(check_output_file(args.json, JSON_WHAT), record)
        except PipelineError as exc:  # made a FIFO, a link... while the gate ran
            return print_error(exc)
        except OSError as exc:
            exc.add_note("the gate record, --json")
            return print_error(exc)
    passed = record["verdict"] == "PASS"
    print(f"gate {record['verdict']}: {record['reason']}", file=sys.stdout if passed else sys.stderr)
    return GATE_EXIT_CODES[record["verdict"]]


def recorded_family(manifest: dict[str, Any], folder: Path) -> str:
    """The recipe family the candidate's run recorded (``drift_family``), or a one-line error."""
    family = manifest.get("drift_family")
    if not isinstance(family, str) or family not in DRIFT_FAMILIES:
        raise PipelineError(
            f"--candidate {folder}: its manifest records no recipe family (drift_family), so its token-level "
            f"bounds are unknown; name it: --set family=<{'|'.join(DRIFT_FAMILIES)}>"
        )
    return family


def _token_quality(baseline: Path, candidate: Path) -> dict[str, Any]:
    from evals.agreement import compare
    from pipeline.runtime import Engine

    return compare(Engine(candidate), Engine(baseline), QualityConfig())


if __name__ == "__main__":
    sys.exit(main())
