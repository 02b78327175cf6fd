"""``python -m pipeline model=llama quant=none``: the Hydra entry point.

User mistakes (bad paths, digests, recipes, and Hydra's own: an unknown group, option or key, a
value of the wrong type, bad override syntax, a ``*_schema`` entry chosen as an option, a number
out of range) print one ``error:`` line naming the bad input and the fix, and exit with code 2,
before any pass runs or the model is downloaded; an OS error (disk full, read-only folder,
permission denied) prints ``error: cannot write <path>: <reason>`` and exits with code 1 (a path
too long or through a symlink loop is the input's: ``error: bad path <path>: <reason>``, code 2); a
FAIL of the eval gate exits with code 3 and an INCONCLUSIVE with code 4 (after the summary),
and neither publishes anything; a PASS is published to the registry (``registry=local``, the
default; ``pipeline/publish.py``); Ctrl-C exits with 130 and SIGTERM with 143
(``pipeline/core/signals.py``), leaving no partial output (every write is staged and renamed).
In a multirun (``-m``, the nightly matrix) each job records its exit code in its folder instead
of exiting, so one failing recipe does not stop the others; the sweep then exits with the worst
code (``pipeline/nightly.py``).

:func:`cli` runs Hydra's command line itself (Hydra's argument parser and ``_run_hydra``, as
``hydra.main`` does) so that Hydra's errors, which it prints over several lines with a hint about
``HYDRA_FULL_ERROR`` and exit code 1, become one line: Hydra reports every error through
``hydra._internal.utils.run_and_report``, which :func:`cli` replaces for the duration of the
call. Errors raised once the job runs are the job's own (``run`` reports them); anything else
escaping the job is a bug and keeps Hydra's traceback. ``HYDRA_FULL_ERROR=1`` shows Hydra's
original report.

Recipe files are untrusted input, the command line is not: every config file Hydra reads from
outside ``configs/`` (a ``--config-dir``, a ``--config-path``, a search-path folder) is checked as
it is composed, before Hydra instantiates a callback, a launcher, a sweeper or the logging config
(``pipeline.config.check_recipe_file``): ``hydra.callbacks`` beyond ours, ``hydra.job.env_set``,
a launcher or sweeper we do not ship (or an object hidden below one, or a launcher's setup
commands), ``hydra.searchpath``, ``hydra.overrides``, sweep params that set ``hydra.*``, and
logging config that calls or imports code are each refused in one line naming the file (exit 2).
The same settings given as overrides on the command line are the operator's and are allowed.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import functools
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from hydra import version as hydra_version
from hydra._internal import hydra as hydra_internal
from hydra._internal import utils as hydra_utils
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline.cluster import anchor_paths
from pipeline.config import (
    SCHEMA_SUFFIX,
    QualityConfig,
    RegistryConfig,
    check_defaults_list,
    check_group_choices,
    check_primary_searchpath,
    check_recipe_file,
    register_pipeline_schemas,
    source_file,
    swept_keys,
    trusted_source,
    validate_config,
)
from pipeline.core.errors import (
    ConfigError,
    PipelineError,
    describe_os_error,
    first_line,
    one_line,
    os_error_exit_code,
)
from pipeline.core.plugins import discover_passes
from pipeline.core.signals import Terminated, exit_code, interrupt_on_sigterm

log = logging.getLogger("pipeline")

CONFIG_PATH = "../configs"
CONFIG_NAME = "pipeline"
USER_ERROR = 2
OS_ERROR = 1

register_pipeline_schemas()
discover_passes()

_job_started = False  # errors after this are the job's own, not Hydra's or the command line's
_multirun = False
_swept: set[str] = set()  # the groups and keys a multirun sweeps (for its error lines)
_overrides: list[str] = []  # the command line's overrides, as typed


def main(cfg: DictConfig) -> None:
    """The Hydra task: one job."""
    global _job_started
    from pipeline.nightly import write_job_status

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode != RunMode.MULTIRUN:
        _job_started = True  # (a multirun job reports everything itself, in its status)
        code, message = run(cfg, run_dir)
        if code:
            sys.exit(code)
        return
    try:
        code, message = run(cfg, run_dir, sweep_job=True)
    except Exception as exc:  # a bug: this job's status says so and the other jobs go on
        log.exception("job crashed")
        code, message = 1, f"crashed: {type(exc).__name__}: {first_line(exc)} (traceback in {run_dir})"
    write_job_status(run_dir, code, message)
    if code in (130, 128 + signal.SIGTERM):  # interrupted (and said so): the sweep stops too
        interrupt = KeyboardInterrupt() if code == 130 else Terminated(signal.SIGTERM)
        interrupt.reported = True  # type: ignore[attr-defined]
        raise interrupt


def run(cfg: DictConfig, run_dir: Path, sweep_job: bool = False) -> tuple[int, str]:
    """One job: (exit code, what it ended with). Errors are printed here, one line each.
    ``sweep_job``: a job of a multirun, whose jobs may share one stdout (joblib's workers): its
    summary goes to ``summary.txt`` in its folder and one line to stdout; the sweep prints one
    table of all its jobs when it ends (``pipeline.nightly.SweepStatus``)."""
    from evals.agreement import compare
    from pipeline.gate import GATE_EXIT_CODES, check_eval, gate_fn
    from pipeline.nightly import apply_nightly
    from pipeline.publish import check_registry, publish_run
    from pipeline.run import run_pipeline
    from pipeline.runtime import Engine
    from pipeline.summary import print_summary, write_summary

    def quality(candidate: Path, reference: Path | None, config: QualityConfig) -> dict:
        return compare(Engine(candidate), Engine(reference) if reference else None, config)

    def fail(code: int, message: str) -> tuple[int, str]:
        message = one_line(message)
        print(message, file=sys.stderr)
        return code, message

    hydra_cfg = HydraConfig.get()
    overrides = list(hydra_cfg.overrides.task)
    try:
        anchor_paths(cfg, Path(hydra_cfg.runtime.cwd))
        if cfg.get("nightly"):
            apply_nightly(cfg, overrides)
        validate_config(cfg)  # ranges, undeclared keys, folders: before anything is downloaded
        if cfg.eval.enabled:
            check_eval(cfg.eval)
        registry_cfg = OmegaConf.to_object(cfg.registry) if cfg.registry else None
        if registry_cfg is not None:
            assert isinstance(registry_cfg, RegistryConfig)
            check_registry(registry_cfg)
        result = run_pipeline(cfg, run_dir, overrides, quality_fn=quality, gate_fn=gate_fn)
    except PipelineError as exc:  # the gate's and the suites' errors too
        log.debug("pipeline error", exc_info=True)
        return fail(getattr(exc, "exit_code", USER_ERROR), f"error: {exc}")
    except OSError as exc:
        log.debug("OS error", exc_info=True)
        return fail(os_error_exit_code(exc), f"error: {describe_os_error(exc)}")
    except KeyboardInterrupt as exc:
        kept = "nothing half-written was kept; rerun to resume from the cache"
        return fail(exit_code(exc), f"interrupted ({_signal_name(exc)}): {kept}")
    if sweep_job:
        verdict = result.manifest["gate"]["verdict"]
        try:
            where = f"summary in {write_summary(result.manifest, run_dir)}"
        except (OSError, PipelineError) as exc:  # the run is complete and recorded: say so, go on
            reason = describe_os_error(exc) if isinstance(exc, OSError) else first_line(exc)
            where = f"no summary written ({reason}); record in {result.manifest_path}"
        print(f"job {hydra_cfg.job.num}: gate {verdict}; {where}")
    else:
        print_summary(result.manifest, run_dir)
    published = ""
    if registry_cfg is not None:
        try:
            published = publish_run(registry_cfg, run_dir, result.manifest, hydra_cfg.runtime.choices)
            print(published)
        except PipelineError as exc:
            return fail(exc.exit_code, f"error: {exc}")
        except OSError as exc:
            return fail(OS_ERROR, f"error: {describe_os_error(exc)} (publishing; the run is complete)")
        except KeyboardInterrupt as exc:
            kept = "nothing was published; the run is complete"
            return fail(exit_code(exc), f"interrupted ({_signal_name(exc)}) while publishing: {kept}")
    gate = result.manifest["gate"]
    if GATE_EXIT_CODES.get(gate["verdict"]):  # FAIL 3, INCONCLUSIVE 4
        return fail(GATE_EXIT_CODES[gate["verdict"]], f"gate {gate['verdict']}: {gate['reason']}")
    return 0, published or f"gate {result.manifest['gate']['verdict']}"


def check_run_dir(run_dir: Path) -> None:
    """Refuse (one line, exit 2) a ``hydra.run.dir`` that already holds a run record
    (``manifest.json``, whatever it is): the new run would replace that record and its engine.
    Checked before Hydra writes anything there (its ``.hydra/`` and log), by
    :func:`_hydra_errors_as_one_line`; a new, empty or unfinished run folder (no record) is used
    as before, so a failed or interrupted run is rerun into its folder. A folder inside another
    run's folder (its ``engine/``) is refused too."""
    from pipeline.manifest import MANIFEST_FILE

    record = run_dir / MANIFEST_FILE
    if os.path.lexists(record):
        raise ConfigError(
            f"hydra.run.dir={run_dir} already holds a run (its record {record}), which a new run would "
            f"overwrite with its engine; name a new folder (by default each run gets one), or remove "
            f"{record} to rerun into it"
        )
    inside = next(
        (p for p in Path(os.path.abspath(run_dir)).parents if os.path.lexists(p / MANIFEST_FILE)), None
    )
    if inside is not None:  # its engine/ folder, say: the run's record lists every file there
        raise ConfigError(
            f"hydra.run.dir={run_dir} lies inside the run {inside} (its record {inside / MANIFEST_FILE}), "
            "whose engine a new run would change; name a folder outside it"
        )


def _signal_name(interrupt: KeyboardInterrupt) -> str:
    return str(interrupt) or "Ctrl-C"  # Terminated says "terminated by SIGTERM"


# --------------------------------------------------------------------------------------------
# The command line: Hydra's, with its errors as one line


class _Parser(argparse.ArgumentParser):
    """Hydra's argument parser, whose mistakes raise (one line) instead of printing the usage."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message}; see python -m pipeline --help")


def _hydra_parser() -> argparse.ArgumentParser:
    parser = hydra_utils.get_args_parser()
    parser.__class__ = _Parser
    parser.prog = "python -m pipeline"
    return parser


def describe_startup_error(exc: BaseException) -> tuple[int, str]:
    """(exit code, one ``error:`` line) for what Hydra or the command line raised before the job
    ran: a user mistake (2) or an OS error (1)."""
    if isinstance(exc, PipelineError):
        return exc.exit_code, one_line(f"error: {exc}")
    if isinstance(exc, MissingConfigException):  # an IOError, but a user mistake
        return USER_ERROR, "error: " + _missing_option(exc)
    if isinstance(exc, OSError) and exc.errno in (errno.EEXIST, errno.ENOTDIR) and exc.filename:
        # Hydra making the run folder (or its .hydra/) where a file is: a bad hydra.run.dir
        blocker = next((p for p in [Path(exc.filename), *Path(exc.filename).parents] if p.is_file()), None)
        if blocker is not None:
            setting = "hydra.sweep.dir" if _multirun else "hydra.run.dir"
            return USER_ERROR, one_line(
                f"error: cannot make the run folder {exc.filename}: {blocker} is a file; "
                f"choose another {setting}"
            )
    if isinstance(exc, OSError):
        return os_error_exit_code(exc), f"error: {describe_os_error(exc)}"
    if isinstance(exc, OverrideParseException):
        reason = first_line(exc.message or exc)
        return USER_ERROR, one_line(
            f"error: {exc.override}: bad override syntax ({reason}); quote values with special "
            "characters, see https://hydra.cc/docs/advanced/override_grammar/basic/"
        )
    if isinstance(exc, ConfigCompositionException):
        return USER_ERROR, "error: " + _composition_error(exc)
    if isinstance(exc, OmegaConfBaseException):
        where = f"{exc.full_key}: " if exc.full_key else ""
        return USER_ERROR, one_line(f"error: {where}{first_line(exc)}")
    if isinstance(exc, ValueError):  # Hydra's checks of the command line
        return USER_ERROR, one_line(f"error: {exc}; see python -m pipeline --help")
    return USER_ERROR, one_line(f"error: {first_line(exc)} (HYDRA_FULL_ERROR=1 shows where)")


def _missing_option(exc: MissingConfigException) -> str:
    missing = exc.missing_cfg_file or ""
    options = [o for o in (exc.options or []) if not o.endswith(SCHEMA_SUFFIX)]
    if "/" not in missing or exc.options is None:
        return one_line(f"{first_line(exc)}; check the config name and the overrides")
    group, option = missing.rsplit("/", 1)
    what = f"{group}={option}: no such option" if option else f"{group}=: no option given"
    close = difflib.get_close_matches(option, options, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"{what}; {hint}choose one of {', '.join(options)}"


def _composition_error(exc: ConfigCompositionException) -> str:
    cause = exc.__cause__
    message = first_line(exc)
    if isinstance(cause, OmegaConfBaseException) and message.startswith("Could not override"):
        key = str(cause.full_key or cause.key or "")
        name = str(cause.key or key.rsplit(".", 1)[-1])
        parent = cause.parent_node
        known = [str(k) for k in parent] if isinstance(parent, DictConfig) else []
        close = difflib.get_close_matches(name, known, n=1)
        where = key.rsplit(".", 1)[0] if "." in key else ""
        owner = f"'{where}'" if where else "the recipe"
        if _multirun and where in _swept:
            # Hydra composes a multirun's settings against the group's default option before it
            # sweeps the group (hydra issue #2888: expected, not a bug); ++ adds the key there.
            typed = [o.lstrip("+") for o in _overrides if o.lstrip("+").split("=", 1)[0] == key]
            fix = f"++{typed[0]}" if typed else f"++{key}=..."
            return one_line(
                f"{key}: in a multirun, Hydra checks it against the default '{where}' option, "
                f"which has no '{name}', before sweeping '{where}'; write it as {fix}"
            )
        if close:
            fix = f"did you mean {close[0]}?"
        elif known:
            fix = f"choose one of {', '.join(sorted(known))}"
        else:
            fix = f"the option chosen for {owner} takes no settings; choose another option first"
        return one_line(f"{key}: {owner} has no setting or group '{name}'; {fix}")
    if isinstance(cause, OmegaConfBaseException):
        override = message.removeprefix("Error merging override ").strip()
        reason = first_line(cause)
        converted = re.search(r"could not be converted to (\w+)", reason)
        fix = f"; give a value of type {converted.group(1)}" if converted else ""
        return one_line(f"{override}: {reason}{fix}")
    return one_line(str(exc))


@contextlib.contextmanager
def _hydra_errors_as_one_line() -> Iterator[None]:
    """Replace Hydra's error report: before the job runs, one line and exit 2 (1: OS error).
    Refuse a ``hydra.run.dir`` holding a run record before Hydra writes there (:func:`check_run_dir`).
    Also keep the ``*_schema`` entries out of the options Hydra offers (``--help``, ``glob(*)``
    sweeps, shell completion): they are type schemas, not recipes."""
    original: Callable[[Any], Any] = hydra_utils.run_and_report
    options = ConfigLoaderImpl.get_group_options
    run_job = hydra_internal.run_job  # what Hydra.run (a single run, not a multirun) calls

    def checked_run_job(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("job_dir_key") == "hydra.run.dir":  # before Hydra makes or writes the folder
            check_run_dir(Path(str(OmegaConf.select(kwargs["config"], "hydra.run.dir"))))
        return run_job(*args, **kwargs)

    def group_options(self: ConfigLoaderImpl, group_name: str, *args: Any, **kwargs: Any) -> list[str]:
        found = options(self, group_name, *args, **kwargs)
        return [name for name in found if not name.endswith(SCHEMA_SUFFIX)]

    def run_and_report(func: Any) -> Any:
        try:
            return func()
        except Exception as exc:
            if _job_started or os.environ.get("HYDRA_FULL_ERROR") == "1":
                return original(functools.partial(_reraise, exc))  # a bug in the job: Hydra's traceback
            code, line = describe_startup_error(exc)
            print(line, file=sys.stderr)
            sys.exit(code)

    hydra_utils.run_and_report = run_and_report
    ConfigLoaderImpl.get_group_options = group_options  # type: ignore[method-assign]
    hydra_internal.run_job = checked_run_job
    try:
        with _recipe_files_checked():
            yield
    finally:
        hydra_utils.run_and_report = original
        ConfigLoaderImpl.get_group_options = options  # type: ignore[method-assign]
        hydra_internal.run_job = run_job


@contextlib.contextmanager
def _recipe_files_checked() -> Iterator[None]:
    """Check every config file Hydra reads from outside ``configs/`` (a ``--config-dir``, a
    ``--config-path``) as it is composed (``pipeline.config.check_recipe_file``): Hydra composes
    the whole configuration, of the run and of each job of a multirun, before it instantiates
    a callback, the launcher, the sweeper or the logging config, so a refused file stops the
    command before anything it names runs. The command line is trusted operator input: its
    overrides are applied after composition and are not checked here."""
    load = ConfigLoaderImpl._load_single_config
    searchpath = ConfigLoaderImpl._process_config_searchpath

    def load_single(self: ConfigLoaderImpl, default: Any, repo: Any) -> Any:
        result = load(self, default, repo)
        if not trusted_source(result.path):
            file = source_file(result.path, default.config_path)
            check_defaults_list(file, result.defaults_list)
            check_recipe_file(file, result.config)
        return result

    def process_searchpath(self: ConfigLoaderImpl, config_name: Any, overrides: Any, repo: Any) -> Any:
        given = any(o.get_key_element() == "hydra.searchpath" for o in overrides)
        if config_name is not None and not given:
            primary = repo.load_config(config_path=config_name)
            if primary is not None:
                check_primary_searchpath(primary.path, config_name, primary.config)
        return searchpath(self, config_name, overrides, repo)

    ConfigLoaderImpl._load_single_config = load_single  # type: ignore[method-assign]
    ConfigLoaderImpl._process_config_searchpath = process_searchpath  # type: ignore[method-assign]
    try:
        yield
    finally:
        ConfigLoaderImpl._load_single_config = load  # type: ignore[method-assign]
        ConfigLoaderImpl._process_config_searchpath = searchpath  # type: ignore[method-assign]


def _reraise(exc: BaseException) -> NoReturn:
    raise exc


def cli(argv: list[str] | None = None) -> int:
    """``python -m pipeline [overrides] [--multirun] [--cfg job] ...``: Hydra's command line,
    every mistake on it one ``error:`` line. Returns the exit code (a job's own code leaves
    through ``SystemExit``)."""
    interrupt_on_sigterm()
    hydra_version.setbase("1.3")
    parser = _hydra_parser()
    try:
        args = parser.parse_intermixed_args(argv)  # overrides may follow --cfg job, -m, ...
        if args.experimental_rerun is not None:
            raise ConfigError("--experimental-rerun is not supported; rerun with the run's overrides")
        check_group_choices(args.overrides)
        global _multirun, _swept, _overrides
        _multirun = bool(args.multirun)
        _overrides = list(args.overrides)
        _swept = swept_keys(args.overrides) if _multirun else set()
        with _hydra_errors_as_one_line():
            hydra_utils._run_hydra(
                args=args,
                args_parser=parser,
                task_function=main,
                config_path=CONFIG_PATH,
                config_name=CONFIG_NAME,
            )
    except KeyboardInterrupt as exc:
        if not getattr(exc, "reported", False):
            print(f"interrupted ({_signal_name(exc)}): nothing half-written was kept", file=sys.stderr)
        return exit_code(exc)
    except Exception as exc:  # the command line's or Hydra's checks (the job reports its own)
        if _job_started or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        code, line = describe_startup_error(exc)
        print(line, file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(cli())
