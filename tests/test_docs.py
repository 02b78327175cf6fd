"""The documentation stays true: README.md and docs/*.md.

* Every ``python -m pipeline ...`` command in a fenced shell block (```bash, ```sh, ```console or
  unlabelled) composes: its overrides are parsed by Hydra's own argument parser, as
  ``pipeline/__main__.py`` parses them, and the recipe is composed in-process with Hydra's compose
  API from ``configs/`` (what ``python -m pipeline <overrides> --cfg job`` prints; one test checks
  that the two agree), then checked as a run checks it at start-up (``*_schema`` choices, the
  structured sections' ranges, every pass config). A multirun (``-m``) is composed once per job of
  its sweep, which is what each job composes (Hydra refuses ``-m`` with ``--cfg``).
* Every other ``python -m X ...`` command names a module X that answers ``python -m X --help``
  with exit code 0 (one subprocess per module).
* The README's two set-up commands are in its first 40 lines and in ``.ci/run`` verbatim.
* README.md has at most 350 lines, links every docs page, and every relative link in README.md
  and docs/*.md points at a file that exists (and, into a Markdown file, at a heading it has).
"""

from __future__ import annotations

import functools
import itertools
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline.config import CONFIG_DIR, check_group_choices, register_pipeline_schemas, validate_config
from pipeline.core.plugins import build_passes, discover_passes

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOC_PAGES = sorted((REPO / "docs").glob("*.md"))
DOCUMENTS = [README, *DOC_PAGES]
MAX_README_LINES = 350
SETUP_WITHIN_LINES = 40
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
# Shell operators a documented line may chain commands with (``pip install ... && python -m ...``).
OPERATORS = {"&&", "||", ";", "|", "&"}
HELP_TIMEOUT_S = 120


@dataclass(frozen=True)
class Command:
    """One ``python -m MODULE ARGS...`` command of a fenced block, and where it is."""

    where: str  # README.md:123
    module: str
    args: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: python -m {self.module} {shlex.join(self.args)}".rstrip()


def fenced_blocks(path: Path) -> list[tuple[int, str, list[tuple[int, str]]]]:
    """(line of the opening fence, language, [(line number, text), ...]) of every fenced block."""
    blocks: list[tuple[int, str, list[tuple[int, str]]]] = []
    opened: tuple[int, str, str] | None = None  # (line, fence, language)
    body: list[tuple[int, str]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if opened is None:
            match = re.match(r"^(`{3,}|~{3,})\s*([\w+-]*)", stripped)
            if match:
                opened, body = (number, match.group(1), match.group(2).lower()), []
        elif stripped.startswith(opened[1]) and not stripped[len(opened[1]) :].strip():
            blocks.append((opened[0], opened[2], body))
            opened = None
        else:
            body.append((number, line))
    assert opened is None, f"{path.name}:{opened[0]}: a fenced block is never closed"
    return blocks


def shell_lines(body: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The command lines of a shell block: continuations (a trailing backslash) joined, a ``$ ``
    prompt removed."""
    lines: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, text in body:
        if pending is not None:
            number, text = pending[0], pending[1] + " " + text.strip()
        pending = None
        if text.rstrip().endswith("\\"):
            pending = (number, text.rstrip()[:-1].rstrip())
            continue
        text = text.strip()
        lines.append((number, text[2:] if text.startswith("$ ") else text))
    if pending is not None:
        lines.append(pending)
    return lines


def split_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line (split at ``&&``, ``|``, ``;`` ...), each as its words;
    ``# comments`` dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="&|;")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in OPERATORS:
            commands.append([])
        else:
            commands[-1].append(token)
    return [words for words in commands if words]


def python_commands(words: list[str]) -> tuple[str, list[str]] | None:
    if len(words) >= 3 and words[0] in ("python", "python3") and words[1] == "-m":
        return words[2], words[3:]
    return None


def documented_commands(documents: list[Path]) -> tuple[list[Command], list[str]]:
    """Every ``python -m`` command of the fenced shell blocks, and the lines no shell could parse."""
    found: list[Command] = []
    unparsable: list[str] = []
    for path in documents:
        for _, language, body in fenced_blocks(path):
            if language not in SHELL_LANGUAGES:
                continue
            for number, line in shell_lines(body):
                if "python" not in line:
                    continue  # a diagram, an install, a server: no python -m command to check
                where = f"{path.relative_to(path.parents[1])}:{number}"
                try:
                    commands = split_commands(line)
                except ValueError as exc:  # an unclosed quote
                    unparsable.append(f"{where}: {exc}: {line}")
                    continue
                for words in commands:
                    command = python_commands(words)
                    if command is not None:
                        found.append(Command(where, command[0], tuple(command[1])))
    return found, unparsable


COMMANDS, UNPARSABLE = documented_commands(DOCUMENTS)
PIPELINE_COMMANDS = [c for c in COMMANDS if c.module == "pipeline"]
OTHER_MODULES = sorted({c.module for c in COMMANDS if c.module != "pipeline"})


# --------------------------------------------------------------------------------------------
# python -m pipeline ...: the recipe composes


@functools.cache
def _registered() -> None:
    register_pipeline_schemas()  # what pipeline/__main__.py does on import
    discover_passes()


def parse_pipeline_args(args: list[str]) -> tuple[list[str], bool]:
    """(overrides, multirun) as ``python -m pipeline`` parses its command line (Hydra's parser)."""
    parser = get_args_parser()
    parser.exit_on_error = False
    try:
        parsed = parser.parse_intermixed_args(args)
    except SystemExit as exc:  # argparse's own exit on an unknown option
        raise ValueError(f"python -m pipeline cannot parse {args}") from exc
    return list(parsed.overrides), bool(parsed.multirun)


def jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The overrides of each job: one job, or every combination of a multirun's sweeps."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    if not multirun:
        return [overrides]
    choices = []
    for override in parsed:
        if override.is_sweep_override():
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    return [list(combination) for combination in itertools.product(*choices)]


def compose_recipe(overrides: list[str], hydra_config: bool = True) -> DictConfig:
    _registered()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("pipeline", overrides=overrides, return_hydra_config=hydra_config)


def check_pipeline_command(args: list[str]) -> int:
    """Compose (and check as a run starts) every job of ``python -m pipeline ARGS``; the number
    of jobs. Raises on the first mistake."""
    from pipeline.nightly import apply_nightly

    overrides, multirun = parse_pipeline_args(args)
    check_group_choices(overrides)
    combinations = jobs(overrides, multirun)
    for job in combinations:
        cfg = compose_recipe(job)
        with open_dict(cfg):
            del cfg["hydra"]  # resolved by Hydra at run time only (${hydra:...}, ${now:...})
        if cfg.get("nightly"):
            apply_nightly(cfg, job)
        validate_config(cfg)
        build_passes(cfg)  # every pass config: types and ranges (validate())
    return len(combinations)


def test_every_shell_line_parses() -> None:
    assert not UNPARSABLE, "\n".join(UNPARSABLE)


def test_there_are_pipeline_commands() -> None:
    assert len(PIPELINE_COMMANDS) >= 10, [str(c) for c in PIPELINE_COMMANDS]


@pytest.mark.parametrize("command", PIPELINE_COMMANDS, ids=str)
def test_pipeline_command_composes(command: Command) -> None:
    try:
        check_pipeline_command(list(command.args))
    except Exception as exc:
        pytest.fail(f"{command}\n  does not compose: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize(
    "args",
    [
        ["quant=int8", "quant.no_such_knob=1"],  # a misspelled knob
        ["quant=int5"],  # an option that does not exist
        ["quant=int8_schema"],  # a type schema, not an option
        ["quant=int8", "quant.group_size=64"],  # a knob of another option
        ["bench.repeats=0"],  # out of range
        ["-m", "quant=none,int5", "hydra/launcher=joblib"],  # one job of a sweep is wrong
        ["hydra/launcher=slurm", "hydra.launcher.partitions=gpu"],  # a launcher knob misspelled
        ["quant=int8", "--no-such-flag"],
    ],
    ids=" ".join,
)
def test_checker_refuses_a_bad_command(args: list[str]) -> None:
    with pytest.raises(Exception):  # noqa: B017 (Hydra's, OmegaConf's or ours: any refusal)
        check_pipeline_command(args)


def test_checker_expands_a_multirun() -> None:
    args = [
        "-m",
        "model=llama",
        "quant=none,int8",
        "fusion=none,ort",
        "hydra/launcher=joblib",
        "+nightly=true",
    ]
    assert check_pipeline_command(args) == 4


def test_in_process_compose_is_what_the_cli_prints() -> None:
    overrides = ["quant=int8", "eval=quick", "eval.suites=[reasoning,tool_call]", "fusion=ort"]
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", *overrides, "--cfg", "job"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == OmegaConf.to_yaml(compose_recipe(overrides, hydra_config=False))


# --------------------------------------------------------------------------------------------
# python -m X ...: X exists and answers --help


@functools.cache
def module_help(module: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT_S,
    )


@pytest.mark.parametrize("module", OTHER_MODULES)
def test_module_answers_help(module: str) -> None:
    result = module_help(module)
    where = ", ".join(c.where for c in COMMANDS if c.module == module)
    assert result.returncode == 0, (
        f"python -m {module} --help exited with {result.returncode} (documented at {where}):\n"
        f"{result.stderr[-2000:]}"
    )


# --------------------------------------------------------------------------------------------
# The README: set up, length, links


def setup_commands() -> list[tuple[int, str]]:
    """(line, text) of every line in the fenced blocks of the README's "Set up" section, as written."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines, 1) if line.strip() == "## Set up")
    end = next((i for i, line in enumerate(lines, 1) if i > start and line.startswith("## ")), len(lines) + 1)
    return [
        (number, text)
        for opened, _, body in fenced_blocks(README)
        if start < opened < end
        for number, text in body
        if text.strip()
    ]


def test_setup_commands_are_early_and_run_by_ci_verbatim() -> None:
    commands = setup_commands()
    assert [text for _, text in commands] == [
        "pip install -e . && python -m pipeline model=llama quant=none",
        'pip install -e ".[dev]" && ruff check . && ruff format --check . && lint-imports '
        "&& python -m pytest -q -n 2 --dist loadfile",
    ]
    ci_lines = set((REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines())  # byte for byte
    for number, text in commands:
        assert number <= SETUP_WITHIN_LINES, f"README.md:{number}: a set-up command below line 40"
        assert text in ci_lines, f"README.md:{number}: .ci/run does not run {text!r} verbatim"


def test_readme_is_a_guide() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"


def test_readme_links_every_docs_page() -> None:
    assert DOC_PAGES, "docs/ holds no page"
    linked = {target for _, target in links(README)}
    missing = [p.name for p in DOC_PAGES if f"docs/{p.name}" not in {t.split("#")[0] for t in linked}]
    assert not missing, f"README.md links no {missing}"


def prose(path: Path) -> str:
    """The file's text without fenced blocks and inline code (links there are not links)."""
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"^(`{3,}|~{3,}).*?^\1\s*$", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(prose(path).splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
            found.append((number, target))
    return found


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    found: set[str] = set()
    for line in prose(path).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).lower().replace("`", "")).replace(" ", "-")
            found.add(slug)
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for _, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(
                f"{target} (no {resolved.relative_to(REPO) if resolved.is_relative_to(REPO) else resolved})"
            )
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.name})")
    return broken


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path: Path) -> None:
    broken = broken_links(path)
    assert not broken, f"{path.relative_to(REPO)}: broken links: {broken}"


SAMPLE = """# Sample

## A heading

```bash
$ python -m pipeline quant=int8 \\
    eval=quick   # a comment
pip install -e ".[bench]" && python -m benchmarks.fusion --repeats 3
python -m pipeline.registry promote llama/int8@1 --reason 'week 48 # not a comment'
echo no python here
```

```python
python -m not.a.shell.block
```

```
python -m pipeline.report nightly
```

[ok](#a-heading) [ok too](sub/page.md) [gone](missing.md) [no anchor](#nowhere) `[code](nope.md)`
"""


def test_extraction_and_links_on_a_sample(tmp_path: Path) -> None:
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "sub" / "page.md").write_text("# Page\n")
    sample = tmp_path / "docs" / "sample.md"
    sample.write_text(SAMPLE)
    commands, unparsable = documented_commands([sample])
    assert not unparsable
    assert [(c.where, c.module, c.args) for c in commands] == [
        ("docs/sample.md:6", "pipeline", ("quant=int8", "eval=quick")),
        ("docs/sample.md:8", "benchmarks.fusion", ("--repeats", "3")),
        (
            "docs/sample.md:9",
            "pipeline.registry",
            ("promote", "llama/int8@1", "--reason", "week 48 # not a comment"),
        ),
        ("docs/sample.md:18", "pipeline.report", ("nightly",)),
    ]
    assert sorted(broken_links(sample)) == [
        "#nowhere (no heading #nowhere in sample.md)",
        "missing.md (no " + str(tmp_path / "docs" / "missing.md") + ")",
    ]
