"""Deep JSON never overflows the stack (issue 50, class 2): every JSON read from untrusted input
(model folders, engine folders, cache entries, registry records, manifests, bench and score
records) goes through :func:`pipeline.core.files.loads_bounded`, which refuses nesting deeper than
:data:`~pipeline.core.files.MAX_JSON_DEPTH` before parsing. Without it a file of 200,000 nested
brackets ends in a ``RecursionError`` traceback."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.files import MAX_JSON_DEPTH, JsonTooDeepError, UnsafeFileError, loads_bounded, read_json

REPO = Path(__file__).resolve().parents[2]
DEEP = 200_000


def deep_value(depth: int = DEEP) -> str:
    """``depth`` nested arrays and objects, mixed (valid JSON)."""
    opens = ['{"k": [' if i % 2 else "[" for i in range(depth // 2)]
    closes = ["]}" if i % 2 else "]" for i in range(depth // 2)]
    return "".join(opens) + "1" + "".join(reversed(closes))


def deep_object(depth: int = DEEP) -> str:
    """A JSON object holding one field ``deep`` nested ``depth`` levels down."""
    return '{"deep": ' + deep_value(depth) + "}"


# --------------------------------------------------------------------------------------------
# The bounded reader


def nest(shape: list[str], leaf: object, sibling: str) -> str:
    """JSON text nesting ``leaf`` in ``shape`` ('[' an array, '{' an object), outermost first; each
    level also holds the string ``sibling`` (which may be full of brackets: they must not count)."""
    text = json.dumps(leaf)
    for kind in reversed(shape):
        if kind == "[":
            text = f"[{json.dumps(sibling)}, {text}]"
        else:
            text = f"{{{json.dumps(sibling)}: {text}, {json.dumps(sibling + 'x')}: 0}}"
    return text


def depth_of(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    return 0


BRACKETY = st.text(alphabet='[]{}"\\:, ab\n\u00e9', max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.sampled_from("[{"), max_size=40),
    leaf=st.one_of(BRACKETY, st.integers(), st.none(), st.lists(BRACKETY, max_size=3)),
    sibling=BRACKETY,
    max_depth=st.integers(min_value=1, max_value=30),
)
def test_the_bound_counts_nesting_and_never_brackets_in_strings(
    shape: list[str], leaf: object, sibling: str, max_depth: int
) -> None:
    text = nest(shape, leaf, sibling)
    expected = json.loads(text)
    depth = depth_of(expected)
    assert depth in (len(shape), len(shape) + 1)  # a list leaf adds a level
    if depth <= max_depth:
        assert loads_bounded(text, max_depth) == expected
        assert loads_bounded(text.encode("utf-8"), max_depth) == expected
        assert loads_bounded(text.encode("utf-16"), max_depth) == expected  # as json.loads decodes
    else:
        with pytest.raises(JsonTooDeepError) as caught:
            loads_bounded(text, max_depth)
        error = caught.value
        assert isinstance(error, json.JSONDecodeError) and isinstance(error, ValueError)
        assert text[error.pos] in "[{" and "\n" not in str(error)
        assert f"deeper than {max_depth} levels" in str(error)


@settings(max_examples=60, deadline=None)
@given(
    extra=st.integers(min_value=-3, max_value=3),
    shape=st.lists(st.sampled_from("[{"), min_size=70, max_size=70),
    sibling=BRACKETY,
)
def test_the_default_bound_at_its_edge(extra: int, shape: list[str], sibling: str) -> None:
    """Depth 61..67 against the default bound of 64, brackets in every string."""
    text = nest(shape[: MAX_JSON_DEPTH + extra], "[[[{{{", sibling + "[" * 100)
    if MAX_JSON_DEPTH + extra <= MAX_JSON_DEPTH:
        assert loads_bounded(text) == json.loads(text)
    else:
        with pytest.raises(JsonTooDeepError):
            loads_bounded(text)


@pytest.mark.parametrize(
    "text",
    [
        "[" * DEEP + "]" * DEEP,
        "{" + '"a":{' * DEEP + "}" * DEEP,  # unbalanced: the parser would still recurse first
        deep_object(),
        '"' + "[" * DEEP,  # an unterminated string: its brackets count (it is no JSON anyway)
        "[" * DEEP,
    ],
    ids=["arrays", "objects", "mixed in an object", "unterminated string", "unclosed"],
)
def test_deep_text_is_refused_without_recursion(text: str) -> None:
    with pytest.raises(ValueError) as caught:
        loads_bounded(text)
    assert "\n" not in str(caught.value)


def test_the_old_parser_overflows(tmp_path: Path) -> None:
    """What the bound prevents: the plain parser on the same text."""
    with pytest.raises(RecursionError):
        json.loads(deep_object())


def test_read_json_names_the_file_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(deep_object())
    with pytest.raises(UnsafeFileError) as caught:
        read_json(path, what="a test record")
    message = str(caught.value)
    assert str(path) in message and "nested deeper than 64" in message and "\n" not in message
    path.write_text('{"a": ["[[[[", {"b": "}}}}"}]}')
    assert read_json(path, what="a test record") == {"a": ["[[[[", {"b": "}}}}"}]}


# --------------------------------------------------------------------------------------------
# The readers of untrusted JSON, in process


def test_checkpoint_json_files_are_one_line_source_errors(tmp_path: Path) -> None:
    from pipeline.core.errors import SourceError
    from pipeline.sources import read_json_object

    path = tmp_path / "config.json"
    path.write_text(deep_object())
    with pytest.raises(SourceError) as caught:
        read_json_object(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_config_readers_of_the_kernel(tmp_path: Path) -> None:
    from pipeline.core.artifacts import Artifact, Kind, read_metadata
    from pipeline.core.errors import PipelineError, SourceError
    from pipeline.core.planned_model import PlannedModel
    from pipeline.core.shapes import model_shapes
    from pipeline.core.torch_model import meta_model

    (tmp_path / "config.json").write_text(deep_object())
    assert model_shapes(tmp_path) is None
    assert PlannedModel.of(Artifact(Kind.TORCH, tmp_path, "0" * 64, {})) is None
    with pytest.raises(SourceError) as caught:
        meta_model(tmp_path)
    assert "config.json" in str(caught.value) and "\n" not in str(caught.value)
    (tmp_path / "artifact.json").write_text(deep_object())
    with pytest.raises(PipelineError) as caught:
        read_metadata(tmp_path)
    assert "artifact.json" in str(caught.value) and "\n" not in str(caught.value)


def test_engine_json_is_a_one_line_engine_error(tmp_path: Path) -> None:
    from pipeline.core.engine import read_engine_spec
    from pipeline.core.errors import EngineError

    (tmp_path / "engine.json").write_text(deep_object())
    with pytest.raises(EngineError) as caught:
        read_engine_spec(tmp_path)
    assert "engine.json" in str(caught.value) and "\n" not in str(caught.value)


def test_registry_records_are_one_line_registry_errors(tmp_path: Path) -> None:
    from pipeline.registry.records import load_json
    from pipeline.registry.refs import RegistryError

    path = tmp_path / "record.json"
    path.write_text(deep_object())
    with pytest.raises(RegistryError) as caught:
        load_json(path, "a version record")
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_cached_records_are_discarded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from pipeline.core.cache import Cache

    cache = Cache(tmp_path / "cache")
    stored = tmp_path / "cache" / "bench" / "k.json"
    stored.parent.mkdir()
    stored.write_text(deep_object())
    with caplog.at_level(logging.WARNING):
        assert cache.read_record(stored) is None
    assert not stored.exists() and len(caplog.records) == 1 and "\n" not in caplog.records[0].getMessage()


def test_a_deep_entry_json_is_evicted_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from pipeline.core.artifacts import Artifact, Kind
    from pipeline.core.cache import Cache
    from pipeline.core.manager import PassManager
    from tests.pipeline.passes_for_tests import recipe
    from tests.pipeline.test_cache_untrusted import one_eviction

    source_dir = tmp_path / "src"
    source_dir.mkdir()
    (source_dir / "weights.txt").write_text("w")
    source = Artifact.from_dir(Kind.TORCH, source_dir)
    cache_dir = tmp_path / "cache"
    _, records = PassManager(recipe("a"), Cache(cache_dir)).run(source)
    key = records[0].cache_key
    (cache_dir / key / "entry.json").write_text(deep_object())
    with caplog.at_level(logging.WARNING):
        _, again = PassManager(recipe("a"), Cache(cache_dir)).run(source)
    assert [r.cache_hit for r in again] == [False, True, True]
    one_eviction(caplog, key[:12], "entry.json", "deeper than 64")


def test_a_tool_call_with_deep_arguments_is_no_call() -> None:
    from evals.suites.tool_ast import _as_call

    assert _as_call({"name": "f", "arguments": deep_value()}) is None


# --------------------------------------------------------------------------------------------
# The command lines: exit 2, one line, no traceback


def run(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=300
    )


def assert_one_error_line(result: subprocess.CompletedProcess[str], needle: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert needle in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr and "RecursionError" not in result.stderr


def _deepen(path: Path) -> None:
    """``path`` (a JSON object) with a field nested 200,000 levels down added to it; in a
    ``tokenizer.json``, its ``normalizer`` (a field the tokenizers library parses: its own parser,
    in Rust, stops at 128 levels with an error of its own, which the source check makes one line)."""
    text = path.read_text() if path.exists() else "{}"
    if path.name == "tokenizer.json":
        deepened = re.sub(r'"normalizer": ?null', lambda _: '"normalizer": ' + deep_value(), text, count=1)
        assert deepened != text
        path.write_text(deepened)
        return
    body = text.strip()[1:]
    path.write_text('{"deep": ' + deep_value() + ("," if body.strip() != "}" else "") + body)


@pytest.mark.parametrize(
    "name",
    [
        "config.json",
        "tokenizer_config.json",
        "generation_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
    ],
)
def test_pipeline_cli_refuses_a_deep_model_file_in_one_line(
    tmp_path: Path, tiny_llama: Path, name: str
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    _deepen(model / name)
    result = run(
        tmp_path,
        "-m",
        "pipeline",
        f"model.path={model}",
        f"pipeline.cache_dir={tmp_path / 'cache'}",
        f"pipeline.models_dir={tmp_path / 'models'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        "bench=none",
    )
    assert_one_error_line(result, name)
    if name == "tokenizer.json":
        assert "recursion limit exceeded" in result.stderr  # the tokenizers library's own bound
    cache = tmp_path / "cache"
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [] if cache.is_dir() else True


def test_gate_cli_refuses_a_deep_manifest_in_one_line(tmp_path: Path) -> None:
    for role in ("base", "cand"):
        (tmp_path / role / "engine").mkdir(parents=True)
        (tmp_path / role / "engine" / "engine.json").write_text("{}")
        (tmp_path / role / "manifest.json").write_text(deep_object())
    result = run(
        REPO,
        "-m",
        "pipeline.gate",
        "--baseline",
        str(tmp_path / "base"),
        "--candidate",
        str(tmp_path / "cand"),
        "--eval",
        "quick",
    )
    assert_one_error_line(result, str(tmp_path / "base" / "manifest.json"))
