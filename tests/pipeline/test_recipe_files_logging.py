"""A recipe file never runs code and never reads the environment (issue 50): Hydra hands
``hydra.job_logging`` and ``hydra.hydra_logging`` to ``logging.config.dictConfig``, so a file
that declares a ``FileHandler`` could write a ``.pth`` into site-packages (its ``format`` text runs
at every later python start) or empty any file the user can write (``mode: w``); and an
interpolation such as ``${oc.env:SECRET}`` in a file would copy the environment into the run's
config and so into ``manifest.json`` and the registry record. A file may set only a logger's
level and interpolate only other keys and the resolvers our own configs use; the command line
stays trusted. Each attack is checked with a marker (the ``.pth`` and the code it would run) or a
victim file, and a control gives the same settings on the command line to show the attack
works where the check does not apply."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from pipeline.config import CONFIG_DIR, FILE_RESOLVERS, _interpolations, check_recipe_file
from pipeline.core.errors import ConfigError
from tests.pipeline.test_errors import assert_one_error_line, cli
from tests.pipeline.test_recipe_files import STOP, write

FILE = "/r/quant/x.yaml"
CHEAP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def refusal(config: dict[str, Any]) -> str:
    """The one-line message with which the check refuses ``config`` (fails if it passes)."""
    with pytest.raises(ConfigError) as error:
        check_recipe_file(FILE, OmegaConf.create(config))
    message = str(error.value)
    assert message.startswith(f"{FILE}: ") and "\n" not in message, message
    return message


def nest(path: list[str], value: Any) -> dict[str, Any]:
    node: Any = value
    for key in reversed(path):
        node = {key: node}
    return node


def merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        both = isinstance(out.get(key), dict) and isinstance(value, dict)
        out[key] = merged(out[key], value) if both else value
    return out


# --------------------------------------------------------------------------------------------
# Logging config: in-process, many shapes

NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True)
HANDLER_SETTINGS = {
    "class": ["logging.FileHandler", "logging.StreamHandler", "logging.handlers.RotatingFileHandler"],
    "filename": ["/usr/lib/python3/site-packages/evil.pth", "~/.bashrc", "${now:%H}.pth"],
    "mode": ["w", "a"],
    "formatter": ["simple", "evil"],
    "stream": ["ext://sys.stdout", "ext://os.system"],
    "()": ["logging.FileHandler", "shutil.copyfile"],
    "level": ["INFO"],
    "filters": [["f"], []],
    "delay": [True],
    "encoding": ["utf-8"],
    ".": [{"baseFilename": "/x"}],
}
FORMATTER_SETTINGS = {
    "format": ["import os; os.system('touch /x')  # %(message)s", "[%(asctime)s] %(message)s"],
    "class": ["logging.Formatter", "mypkg.Formatter"],
    "style": ["{", "%"],
    "datefmt": ["%H"],
    "()": ["logging.Formatter"],
    "validate": [False],
}
FILTER_SETTINGS = {"()": ["mypkg.Filter", "logging.Filter"], "name": ["x"]}
LOGGER_SETTINGS = {"handlers": [["console"], ["evil", "file"], []], "filters": [["f"]], "propagate": [False]}
BAD_LEVELS = ["ext://os.system", "cfg://handlers.evil", "debug", "1.5", 1.5, True, [10], {"x": 1}]
TOP_SETTINGS = {
    "incremental": [True, False],
    "disable_existing_loggers": [True, False],
    "version": [2, "1"],
    "handlers": [{}],
    "formatters": [{}],
    "filters": [{}],
    "root": [None, "INFO"],
    "loggers": [["x"], "x"],
}


def _pick(table: dict[str, list[Any]]) -> st.SearchStrategy[tuple[str, Any]]:
    return st.sampled_from(sorted(table)).flatmap(lambda k: st.tuples(st.just(k), st.sampled_from(table[k])))


@st.composite
def forbidden_logging(draw: st.DrawFn) -> tuple[list[str], Any]:
    """(a key path below a logging section, a value) that a file may not set."""
    name = draw(NAMES)
    kind = draw(st.sampled_from(["handler", "formatter", "filter", "root", "logger", "top", "level"]))
    if kind in ("handler", "formatter", "filter"):
        table = {"handler": HANDLER_SETTINGS, "formatter": FORMATTER_SETTINGS, "filter": FILTER_SETTINGS}[
            kind
        ]
        key, value = draw(_pick(table))
        return [f"{kind}s", name, key], value
    if kind in ("root", "logger"):
        key, value = draw(_pick(LOGGER_SETTINGS))
        return (["root"] if kind == "root" else ["loggers", name]) + [key], value
    if kind == "level":
        where = draw(st.sampled_from([["root"], ["loggers", name]]))
        return [*where, "level"], draw(st.sampled_from(BAD_LEVELS))
    key, value = draw(_pick(TOP_SETTINGS))
    return [key], value


ALLOWED_LOGGING = st.fixed_dictionaries(
    {},
    optional={
        "version": st.just(1),
        "root": st.fixed_dictionaries({"level": st.sampled_from(["INFO", "DEBUG", "WARNING", 10, None])}),
        "loggers": st.dictionaries(
            NAMES, st.fixed_dictionaries({"level": st.sampled_from(["ERROR", "CRITICAL", 30])}), max_size=3
        ),
    },
)


@CHEAP
@given(
    section=st.sampled_from(["job_logging", "hydra_logging"]),
    setting=forbidden_logging(),
    allowed=ALLOWED_LOGGING,
    first=st.booleans(),
)
def test_a_logging_setting_anywhere_in_a_file_is_refused(
    section: str, setting: tuple[list[str], Any], allowed: dict[str, Any], first: bool
) -> None:
    """Wherever the handler, file, format, filter or class sits in the logging tree, and whatever
    allowed levels surround it (before or after it), the file is refused naming that setting."""
    path, value = setting
    bad = nest(path, value)
    tree = merged(merged(bad, allowed) if first else allowed, bad)  # the bad setting wins
    message = refusal({"hydra": {section: tree}})
    assert f"hydra.{'.'.join([section, *path])}" in message and "configures logging" in message, message


@CHEAP
@given(section=st.sampled_from(["job_logging", "hydra_logging"]), allowed=ALLOWED_LOGGING)
def test_a_file_may_set_a_logger_level(section: str, allowed: dict[str, Any]) -> None:
    check_recipe_file(FILE, OmegaConf.create({"hydra": {section: allowed}}))


@pytest.mark.parametrize(
    ("logging", "key"),
    [
        (
            {"handlers": {"pth": {"class": "logging.FileHandler", "filename": "/s/x.pth"}}},
            "handlers.pth.class",
        ),
        (
            {"formatters": {"simple": {"format": "import os\n%(message)s"}}},
            "formatters.simple.format='import os",
        ),
        ({"root": {"level": "INFO", "handlers": ["file"]}}, "root.handlers[0]=file"),
        ({"loggers": {"pipeline": {"handlers": []}}}, "loggers.pipeline.handlers=[]"),
        ({"incremental": True}, "incremental=True"),
        ({"disable_existing_loggers": True}, "disable_existing_loggers=True"),
        ({"filters": {"f": {"name": "x"}}}, "filters.f.name=x"),
        (
            {"handlers": {"console": {"stream": "ext://sys.stdout"}}},
            "handlers.console.stream=ext://sys.stdout",
        ),
    ],
)
def test_each_logging_sibling_is_named(logging: dict[str, Any], key: str) -> None:
    for section in ("job_logging", "hydra_logging"):
        message = refusal({"hydra": {section: logging}})
        assert f"hydra.{section}.{key}" in message and "never runs code" in message, message


def test_a_logging_section_that_is_not_a_mapping_is_refused() -> None:
    assert "hydra.job_logging=x configures logging" in refusal({"hydra": {"job_logging": "x"}})
    check_recipe_file(FILE, OmegaConf.create({"hydra": {"job_logging": None}}))  # Hydra's stdout default


# --------------------------------------------------------------------------------------------
# Resolvers: in-process, many shapes

DENIED = ["oc.env", "oc.decode", "oc.create", "oc.deprecated", "oc.select", "oc.dict.keys", "oc.dict.values"]
DENIED += ["hydra", "python_version", "env", "now.x", "run_suffix2"]
RESOLVERS = st.sampled_from(DENIED) | st.from_regex(
    r"[a-z_][a-z0-9_]{0,6}(\.[a-z_][a-z0-9_]{0,6})?", fullmatch=True
)
SHAPES = [
    "${N:A}",
    "pre-${N:A}-post",
    "${ N : A }",
    "${N:A,fallback}",
    "${now:${N:A}}",
    "${run_suffix:}_${N:A}",
    "${a.${N:A}}",
    "${N:'${A}'}",
    "${${k}:A}",
    "${N:}",
]
PLACES = [["model", "name"], ["registry", "tags", "x"], ["pipeline", "cache_dir"], ["hydra", "run", "dir"]]
PLACES += [["hydra", "job", "name"], ["hydra", "sweeper", "params", "model.name"], ["quant", "bits"], ["x"]]


@CHEAP
@given(
    name=RESOLVERS.filter(lambda n: n not in FILE_RESOLVERS),
    shape=st.sampled_from(SHAPES),
    place=st.sampled_from(PLACES),
    in_list=st.booleans(),
)
def test_a_resolver_we_do_not_use_is_refused_anywhere_in_a_file(
    name: str, shape: str, place: list[str], in_list: bool
) -> None:
    value = shape.replace("N", name).replace("A", "R50_SECRET")
    message = refusal(nest(place, ["plain", value] if in_list else value))
    key = ".".join(place) + ("[1]" if in_list else "")
    assert message.startswith(f"{FILE}: {key}=") and "calls resolver" in message, message
    assert "never reads the environment" in message, message


@CHEAP
@given(
    value=st.sampled_from(
        [
            "${a.b}",
            "${..name}",
            "x-${model.name}-${now:%Y}",
            "${run_suffix:}",
            "${launch_dir:}/runs",
            "\\${oc.env:X}",
        ]
    ),
    place=st.sampled_from([p for p in PLACES if p[0] != "hydra"] + [["hydra", "mode"], ["hydra", "verbose"]]),
)
def test_other_keys_and_our_resolvers_may_be_interpolated(value: str, place: list[str]) -> None:
    check_recipe_file(FILE, OmegaConf.create(nest(place, value)))


OUTPUTS = [["hydra", "run", "dir"], ["hydra", "sweep", "dir"], ["hydra", "sweep", "subdir"]]
OUTPUTS += [["hydra", "output_subdir"]]
OURS = ["runs/${now:%H}", "${launch_dir:}/runs/${run_suffix:}", "${hydra.job.num}", "a/b"]
OTHERS = ["${a.b}/run", "${pipeline.models_dir}", "x-${model.name}", "${..name}", "/x", "../x"]


@CHEAP
@given(
    value=st.sampled_from(OURS),
    place=st.sampled_from(OUTPUTS),
)
def test_where_a_run_is_written_a_file_may_interpolate_only_ours(value: str, place: list[str]) -> None:
    check_recipe_file(FILE, OmegaConf.create(nest(place, value)))


@CHEAP
@given(
    value=st.sampled_from(OTHERS),
    place=st.sampled_from(OUTPUTS),
)
def test_where_a_run_is_written_another_key_is_refused(value: str, place: list[str]) -> None:
    """Another key may hold an absolute path (the same file may set it): Hydra would write there."""
    message = refusal(nest(place, value))
    assert message.startswith(f"{FILE}: {'.'.join(place)}=") and "never writes outside" in message, message


def test_the_secret_itself_never_reaches_the_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("R50_SECRET", "s3cr3t-value")
    message = refusal({"model": {"name": "${oc.env:R50_SECRET}"}})
    assert (
        "s3cr3t-value" not in message and "model.name=${oc.env:R50_SECRET} calls resolver oc.env" in message
    )


def test_the_allowed_resolvers_are_the_ones_our_configs_use() -> None:
    """FILE_RESOLVERS grows only with what configs/ itself needs."""
    used: set[str] = set()
    for path in CONFIG_DIR.rglob("*.yaml"):
        for value in re.findall(r"\$\{[^\n#]*\}", path.read_text()):
            used |= {name for name in _interpolations(value) or () if name is not None}
    assert used == set(FILE_RESOLVERS)


# --------------------------------------------------------------------------------------------
# The command line: one error line, nothing written; the same settings given as overrides work


@pytest.fixture
def attack(tmp_path: Path) -> dict[str, Path]:
    """A working folder, a recipe folder, a site folder, the marker its .pth would make, a victim."""
    paths = {name: tmp_path / name for name in ("work", "recipes", "site")}
    for folder in paths.values():
        folder.mkdir()
    paths["pth"] = paths["site"] / "evil.pth"
    paths["marker"] = tmp_path / "MARKER"
    paths["victim"] = tmp_path / "victim.txt"
    paths["victim"].write_text("precious\n")
    return paths


def pth_format(marker: Path) -> str:
    return f"import pathlib; pathlib.Path('{marker}').touch()  # %(message)s"


def start_python(site: Path) -> None:
    """A later python start that reads ``site`` (as it reads site-packages)."""
    subprocess.run([sys.executable, "-c", f"import site; site.addsitedir({str(site)!r})"], check=True)


def test_a_pth_file_from_the_logging_config_of_a_file_is_refused(attack: dict[str, Path]) -> None:
    """Hydra's own logger writes 'Launching 1 jobs' through the file's handler as a multirun starts."""
    text = (
        "# @package _global_\nhydra:\n  hydra_logging:\n    formatters:\n      evil:\n"
        f'        format: "{pth_format(attack["marker"])}"\n'
        f"    handlers:\n      evil:\n        class: logging.FileHandler\n        filename: {attack['pth']}\n"
        "        formatter: evil\n    root:\n      handlers: [console, evil]\n"
    )
    file = write(attack["recipes"], "quant/log.yaml", text)
    result = cli(attack["work"], "-m", "--config-dir", str(attack["recipes"]), "quant=log", STOP)
    line = assert_one_error_line(result, 2, str(file))
    assert "hydra.hydra_logging.formatters.evil.format=" in line and "never runs code" in line, line
    start_python(attack["site"])
    assert not attack["pth"].exists() and not attack["marker"].exists()


def test_a_logging_option_a_recipe_ships_cannot_empty_a_file(attack: dict[str, Path]) -> None:
    """The recipe selects its own hydra/job_logging option, whose handler opens a file with mode w."""
    option = (
        "version: 1\nhandlers:\n  victim:\n    class: logging.FileHandler\n"
        f"    filename: {attack['victim']}\n    mode: w\nroot:\n  level: INFO\n  handlers: [victim]\n"
    )
    file = write(attack["recipes"], "hydra/job_logging/evil.yaml", option)
    primary = "defaults:\n  - pipeline\n  - override hydra/job_logging: evil\n  - _self_\n"
    write(attack["recipes"], "mine.yaml", primary)
    result = cli(attack["work"], "--config-dir", str(attack["recipes"]), "--config-name", "mine", STOP)
    line = assert_one_error_line(result, 2, str(file))
    assert "hydra.job_logging.handlers.victim.class=logging.FileHandler" in line, line
    assert attack["victim"].read_text() == "precious\n"


def test_control_the_same_logging_on_the_command_line_runs(attack: dict[str, Path]) -> None:
    """The attacks are real: given as (trusted) overrides, the .pth is written and runs at the next
    python start, and the victim is emptied. Without the check, the files above do the same."""
    hydra_log, job_log = "+hydra.hydra_logging", "+hydra.job_logging"
    overrides = [
        f'{hydra_log}.formatters.evil.format="{pth_format(attack["marker"])}"',
        f"{hydra_log}.handlers.evil.class=logging.FileHandler",
        f"{hydra_log}.handlers.evil.filename={attack['pth']}",
        f"{hydra_log}.handlers.evil.formatter=evil",
        "hydra.hydra_logging.root.handlers=[console,evil]",
        f"{job_log}.handlers.victim.class=logging.FileHandler",
        f"{job_log}.handlers.victim.filename={attack['victim']}",
        f"{job_log}.handlers.victim.mode=w",
        "hydra.job_logging.root.handlers=[console,victim]",
    ]
    result = cli(attack["work"], "-m", *overrides, STOP)
    assert result.returncode == 2, result.stderr[-2000:]  # the job's own STOP
    assert "import pathlib" in attack["pth"].read_text()
    assert attack["victim"].read_text() == ""
    start_python(attack["site"])
    assert attack["marker"].exists()


def test_an_environment_variable_in_a_file_is_refused(
    attack: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--cfg job --resolve`` prints what the run would record (manifest.json, the registry)."""
    monkeypatch.setenv("R50_SECRET", "s3cr3t-value")
    text = "defaults:\n  - pipeline\n  - _self_\nmodel:\n  name: ${oc.env:R50_SECRET}\n"
    file = write(attack["recipes"], "mine.yaml", text)
    result = cli(
        attack["work"],
        "--config-dir",
        str(attack["recipes"]),
        "--config-name",
        "mine",
        "--cfg",
        "job",
        "--resolve",
    )
    line = assert_one_error_line(result, 2, str(file))
    assert "model.name=${oc.env:R50_SECRET} calls resolver oc.env" in line, line
    assert "s3cr3t-value" not in result.stdout + result.stderr


def test_control_the_command_line_may_read_the_environment(
    attack: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same interpolation on the command line is the operator's; a file's logger level passes."""
    monkeypatch.setenv("R50_SECRET", "s3cr3t-value")
    text = (
        "defaults:\n  - pipeline\n  - _self_\nhydra:\n  job_logging:\n    root:\n      level: WARNING\n"
        "  hydra_logging:\n    loggers:\n      hydra:\n        level: INFO\n"
    )
    write(attack["recipes"], "plain.yaml", text)
    args = [
        "--config-dir",
        str(attack["recipes"]),
        "--config-name",
        "plain",
        "model.name=${oc.env:R50_SECRET}",
    ]
    result = cli(attack["work"], *args, "--cfg", "job", "--resolve")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "name: s3cr3t-value" in result.stdout
    assert os.environ["R50_SECRET"] == "s3cr3t-value"
