"""``engine.json`` is untrusted input (issue 37, class 6): every field typed and range-checked,
every file it names confined to the engine folder (symlinks and the graphs' external data
included), execution providers and their options from an allow-list; each refusal is one line,
in the reader (``read_engine_spec``), the runtime's ``Engine`` and the CLIs (exit 2, no
traceback). Also the benchmark's clean child environment (class 8) and its cached records
(class 4). Real engine folders (the tiny engine), real files, FIFOs, symlinks and subprocesses.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipeline.bench import benchmark_in_subprocess, measure
from pipeline.config import BenchConfig
from pipeline.core.artifacts import Artifact, write_json
from pipeline.core.engine import ENGINE_FILE, EngineSpec, read_engine_spec
from pipeline.core.errors import EngineError
from pipeline.core.subprocesses import child_environment, isolated_python
from pipeline.manifest import engine_files
from pipeline.runtime import Engine
from tests.untrusted import JSON_VALUES, deadline, json_paths

REPO = Path(__file__).resolve().parents[2]
ENV = {**child_environment(), "PYTHONPATH": str(REPO)}


@pytest.fixture
def engine(tiny_engine: Artifact, tmp_path: Path) -> Path:
    """A copy of the tiny engine (its files copied, so edits never reach the cache entry)."""
    folder = tmp_path / "engine"
    shutil.copytree(tiny_engine.path, folder)
    return folder


def spec_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / ENGINE_FILE).read_text())


def write_spec(folder: Path, spec: dict[str, Any]) -> None:
    (folder / ENGINE_FILE).write_text(json.dumps(spec))


def edit(folder: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    spec = spec_of(folder)
    change(spec)
    write_spec(folder, spec)


def refusal(folder: Path) -> str:
    """The one-line EngineError ``read_engine_spec`` gives for ``folder``."""
    with deadline(30), pytest.raises(EngineError) as info:
        read_engine_spec(folder)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_every_engine_a_builder_writes_reads_unchanged(engine: Path) -> None:
    spec = read_engine_spec(engine)
    assert isinstance(spec, EngineSpec) and spec.target == "ort-cpu"
    assert spec.model_path == engine / "model.onnx" and spec.providers == ("CPUExecutionProvider",)
    assert spec.io.num_layers == 2 and spec.raw == spec_of(engine)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(spec: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value

    return change


FIELD_CASES = [
    ("session.intra_op_num_threads", "abc", "session.intra_op_num_threads"),
    ("session.intra_op_num_threads", -1, "session.intra_op_num_threads"),
    ("session.intra_op_num_threads", 2.5, "session.intra_op_num_threads"),
    ("session.graph_optimization_level", "max", "graph_optimization_level"),
    ("io.num_layers", -1, "io.num_layers=-1"),
    ("io.num_layers", True, "io.num_layers=true"),
    ("io.num_layers", 10**12, "io.num_layers"),
    ("io.vocab_size", "320", "io.vocab_size"),
    ("io.head_dim", None, "io.head_dim"),
    ("io.has_position_ids", "yes", "io.has_position_ids"),
    ("io.left_padding", 1, "io.left_padding"),
    ("io.kv_dtype", "bfloat99", "io.kv_dtype"),
    ("io.kv_layout", "ring", "io.kv_layout"),
    ("io.window", -5, "io.window"),
    ("io.kv_capacity", 64, "io.kv_capacity"),
    ("io.kv_capacity", [64], "io.kv_capacity"),  # one per layer
    ("io.kv_capacity", [64, 1], "io.kv_capacity"),
    ("io.kv_capacity", [64, "64"], "io.kv_capacity"),
    ("io", [], "io="),
    ("target", "openvino", "target"),
    ("target", None, "target"),
    ("max_length", 0, "max_length"),
    ("max_length", 1e9, "max_length"),
    ("schema_version", 2, "schema_version"),
    ("tokens.eos_token_ids", ["a"], "tokens.eos_token_ids"),
    ("tokens.eos_token_ids", 2, "tokens.eos_token_ids"),
    ("tokens.pad_token_id", 10**9, "tokens.pad_token_id"),
    ("tokens.bos_token_id", -1, "tokens.bos_token_id"),
    ("tokens", "x", "tokens"),
    ("speculative", {"draft": "draft", "k": 0}, "speculative.k"),
    ("speculative", {"draft": "draft", "k": "3"}, "speculative.k"),
    ("speculative", "draft", "speculative"),
    ("kv_cache", [1], "kv_cache"),
    ("surprise", 1, "unknown field 'surprise'"),
    ("model_file", 7, "model_file 7 is not a file name"),
    ("model_file", "", "model_file"),
    ("model_file", "other.onnx", "other.onnx is missing"),
]


@pytest.mark.parametrize(
    ("path", "value", "needle"), FIELD_CASES, ids=[f"{c[0]}={c[1]!r}" for c in FIELD_CASES]
)
def test_a_bad_field_is_one_line_naming_it(engine: Path, path: str, value: Any, needle: str) -> None:
    edit(engine, _set(path, value))
    message = refusal(engine)
    assert needle in message and str(engine / ENGINE_FILE) in message, message


@pytest.mark.parametrize(
    ("providers", "options", "needle"),
    [
        (["OpenVINOExecutionProvider"], None, '"OpenVINOExecutionProvider" is not an execution provider'),
        (["CPUExecutionProvider", "CPUExecutionProvider"], None, "names one twice"),
        ("CPUExecutionProvider", None, "providers="),
        ([], None, "providers="),
        (["CUDAExecutionProvider", "CPUExecutionProvider"], None, "runs on CPUExecutionProvider first"),
        (["CPUExecutionProvider"], [{"evil": 1}], 'option "evil" is not allowed'),
        (["CPUExecutionProvider"], [{}, {}], "provider_options="),
        (["CPUExecutionProvider"], ["x"], "not an object"),
    ],
)
def test_providers_and_options_come_from_the_allow_list(
    engine: Path, providers: Any, options: Any, needle: str
) -> None:
    def change(spec: dict[str, Any]) -> None:
        spec["providers"] = providers
        if options is not None:
            spec["provider_options"] = options

    edit(engine, change)
    message = refusal(engine)
    assert needle in message, message


@pytest.mark.parametrize(
    ("option", "value", "needle"),
    [
        (
            "trt_engine_cache_path",
            "/tmp/elsewhere",
            "trt_engine_cache_path=\"/tmp/elsewhere\" must be '{cache}'",
        ),
        ("trt_builder_optimization_level", 9, "trt_builder_optimization_level=9"),
        ("trt_max_workspace_size", "8G", "trt_max_workspace_size"),
        ("trt_engine_cache_enable", "yes", "trt_engine_cache_enable"),
        ("trt_profile_min_shapes", "input_ids:1x1;rm -rf", "trt_profile_min_shapes"),
        ("device_id", -1, "device_id=-1"),
        ("trt_dump_subgraphs", True, 'option "trt_dump_subgraphs" is not allowed'),
    ],
)
def test_tensorrt_provider_options_are_typed_and_known(
    engine: Path, option: str, value: Any, needle: str
) -> None:
    """An ort-trt engine.json as passes/ort_build.py writes it reads; one bad option is one line."""
    good = {
        "device_id": 0,
        "trt_max_workspace_size": 8 << 30,
        "trt_builder_optimization_level": 3,
        "trt_engine_cache_enable": True,
        "trt_timing_cache_enable": True,
        "trt_engine_cache_path": "{cache}",
        "trt_timing_cache_path": "{cache}",
        "trt_profile_min_shapes": "input_ids:1x1,attention_mask:1x1",
        "trt_profile_opt_shapes": "input_ids:1x512,attention_mask:1x512",
        "trt_profile_max_shapes": "input_ids:1x2048,attention_mask:1x2048",
    }

    def change(spec: dict[str, Any], trt: dict[str, Any]) -> None:
        spec["target"] = "ort-trt"
        spec["providers"] = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
        spec["provider_options"] = [trt, {"device_id": 0}, {}]

    edit(engine, lambda spec: change(spec, good))
    assert read_engine_spec(engine).provider_options == (good, {"device_id": 0}, {})
    edit(engine, lambda spec: change(spec, {**good, option: value}))
    message = refusal(engine)
    assert needle in message, message


@pytest.mark.parametrize(
    ("tensorrt", "needle"),
    [
        (None, "records its build in 'tensorrt', which is missing"),
        ({"gpu": "H200"}, "tensorrt.gpu"),
        ({"version": ["10"]}, "tensorrt.version"),
        ({"profiles": {"decode": {"input_ids": [[1, 1], [1, 1]]}}}, "tensorrt.profiles.decode.input_ids"),
        ({"profiles": {"decode": {"input_ids": [[1, 1], [1, 1], [1, "x"]]}}}, "three shapes"),
        ({"profiles": {"decode": {}}}, "tensorrt.profiles.decode.input_ids"),
        ({"profiles": []}, "tensorrt.profiles"),
    ],
)
def test_a_tensorrt_record_is_typed(engine: Path, tensorrt: Any, needle: str) -> None:
    edit(engine, lambda spec: spec.update(target="tensorrt", tensorrt=tensorrt))
    message = refusal(engine)
    assert needle in message, message


# -- confinement ----------------------------------------------------------------------------


def test_a_graph_outside_the_folder_is_refused_by_name(engine: Path) -> None:
    outside = engine.parent / "outside"
    shutil.copytree(engine, outside)
    edit(engine, _set("model_file", "../outside/model.onnx"))
    assert "model_file '../outside/model.onnx' leaves the engine folder" in refusal(engine)
    edit(engine, _set("model_file", str(outside / "model.onnx")))
    assert "leaves the engine folder" in refusal(engine)
    edit(engine, _set("model_file", "model.onnx"))
    (engine / "model.onnx").unlink()
    (engine / "model.onnx").symlink_to(outside / "model.onnx")
    message = refusal(engine)
    assert "lies outside" in message and "model.onnx" in message, message


def test_a_symlink_inside_the_folder_is_followed(engine: Path) -> None:
    (engine / "tokenizer.json").rename(engine / "tokenizer.real.json")
    (engine / "tokenizer.json").symlink_to("tokenizer.real.json")
    read_engine_spec(engine)


def test_a_prefill_graph_outside_the_folder_is_refused(engine: Path) -> None:
    shutil.copy(engine / "model.onnx", engine.parent / "prefill.onnx")
    edit(engine, _set("prefill_model_file", "../prefill.onnx"))
    assert "prefill_model_file '../prefill.onnx' leaves the engine folder" in refusal(engine)


def _external_location(engine: Path) -> str:
    import onnx

    proto = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                return entry.value
    raise AssertionError("the tiny engine keeps its weights as external data")


def _point_external_data(engine: Path, location: str) -> None:
    import onnx

    proto = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    (engine / "model.onnx").write_bytes(proto.SerializeToString())


def test_external_data_outside_the_folder_is_refused(engine: Path) -> None:
    data = _external_location(engine)
    shutil.copy(engine / data, engine.parent / data)
    _point_external_data(engine, f"../{data}")
    message = refusal(engine)
    assert f"'../{data}' leaves the engine folder" in message and "external data" in message, message
    _point_external_data(engine, str(engine.parent / data))
    assert "leaves the engine folder" in refusal(engine)


def test_external_data_symlinked_outside_is_refused(engine: Path) -> None:
    data = _external_location(engine)
    shutil.move(engine / data, engine.parent / data)
    (engine / data).symlink_to(engine.parent / data)
    message = refusal(engine)
    assert "lies outside" in message and data in message, message


def test_truncated_external_data_is_refused(engine: Path) -> None:
    data = engine / _external_location(engine)
    os.truncate(data, data.stat().st_size // 2)
    assert "lie past the end" in refusal(engine)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", ENGINE_FILE])
def test_a_fifo_or_outside_symlink_for_a_named_file_is_refused_without_hanging(
    engine: Path, name: str
) -> None:
    original = engine.parent / f"saved-{name}"
    shutil.move(engine / name, original)
    os.mkfifo(engine / name)
    assert "FIFO" in refusal(engine)
    (engine / name).unlink()
    (engine / name).symlink_to(original)
    assert "lies outside" in refusal(engine)
    (engine / name).unlink()
    (engine / name).symlink_to("/dev/zero")
    assert "/dev/zero" in refusal(engine)


def test_a_draft_outside_the_folder_is_refused(engine: Path, tmp_path: Path) -> None:
    shutil.copytree(engine, tmp_path / "draft")
    edit(engine, _set("speculative", {"draft": "../draft", "k": 2}))
    assert "speculative.draft '../draft' is not a folder inside" in refusal(engine)
    (engine / "draft").symlink_to(tmp_path / "draft")
    edit(engine, _set("speculative", {"draft": "draft", "k": 2}))
    assert "lies outside" in refusal(engine)
    (engine / "draft").unlink()
    shutil.copytree(tmp_path / "draft", engine / "draft")
    read_engine_spec(engine)  # the layout attach_draft writes
    edit(engine / "draft", _set("io.num_layers", "2"))
    assert "io.num_layers" in refusal(engine) and "draft" in refusal(engine)


def test_a_garbage_graph_is_one_line(engine: Path) -> None:
    (engine / "model.onnx").write_bytes(b"\x08\x07garbage" * 100)
    assert "is not a readable ONNX graph" in refusal(engine)


# -- Engine and the CLIs ----------------------------------------------------------------------


def test_engine_refuses_before_loading_anything(engine: Path) -> None:
    edit(engine, _set("session.intra_op_num_threads", "abc"))
    with pytest.raises(EngineError, match=r"session\.intra_op_num_threads") as info:
        Engine(engine)
    assert "\n" not in str(info.value)


def _cli(*argv: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=REPO
    )


def _one_line_exit_2(result: subprocess.CompletedProcess[str], needle: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert needle in lines[0], lines


def test_bench_cli_refuses_a_bad_engine_in_one_line(engine: Path) -> None:
    edit(engine, _set("io.num_layers", -1))
    _one_line_exit_2(_cli("-m", "pipeline.bench", str(engine)), "io.num_layers=-1")


def _run_folder(engine: Path, run: Path) -> Path:
    shutil.copytree(engine, run / "engine", symlinks=True)
    manifest = {
        "engine": {"path": "engine", "target": "ort-cpu", "files": engine_files(run / "engine")},
        "gate": {"verdict": "FAIL", "reason": "a test"},
        "drift_family": "fp32",
    }
    write_json(run / "manifest.json", manifest)
    return run


def test_gate_cli_refuses_a_candidate_whose_graph_lies_outside(engine: Path, tmp_path: Path) -> None:
    base = _run_folder(engine, tmp_path / "base")
    shutil.copytree(engine, tmp_path / "outside")
    edit(engine, _set("model_file", "../../outside/model.onnx"))
    cand = _run_folder(engine, tmp_path / "cand")
    result = _cli("-m", "pipeline.gate", "--baseline", str(base), "--candidate", str(cand), "--eval", "quick")
    _one_line_exit_2(result, "leaves the engine folder")


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda e: (e / "model.onnx").write_bytes(b"garbage" * 50), "is not a readable ONNX graph"),
        (lambda e: os.truncate(e / "model.onnx", (e / "model.onnx").stat().st_size // 3), "model.onnx"),
        (lambda e: edit(e, _set("model_file", "../model.onnx")), "leaves the engine folder"),
    ],
    ids=["garbage graph", "truncated graph", "graph outside"],
)
def test_registry_publish_force_refuses_an_engine_that_cannot_load(
    engine: Path, tmp_path: Path, damage: Callable[[Path], Any], needle: str
) -> None:
    damage(engine)
    run = _run_folder(engine, tmp_path / "run")
    root = tmp_path / "registry"
    result = _cli(
        "-m", "pipeline.registry", "--root", str(root), "publish", str(run),
        "--model", "tiny", "--recipe", "none", "--force", "testing",
    )  # fmt: skip
    _one_line_exit_2(result, needle)
    assert not list(root.glob("versions/**/*.json")) and not list(root.glob("blobs/*/*/*"))


# -- the benchmark child: a clean environment, checked records --------------------------------

SMALL_BENCH = BenchConfig(
    prompt_lengths=[4], decode_tokens=2, decode_prompt_length=4, warmup=0, repeats=1, timeout_s=300
)


def test_the_benchmark_child_never_imports_a_planted_sitecustomize(
    engine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planted = tmp_path / "recipes"
    planted.mkdir()
    marker = tmp_path / "marker"
    (planted / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (planted / "startup.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    # a recipe's hydra.job.env_set puts these into the pipeline's own environment
    monkeypatch.setenv("PYTHONPATH", str(planted))
    monkeypatch.setenv("PYTHONSTARTUP", str(planted / "startup.py"))
    # the control: a plain child with that environment does run the planted file
    subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60)
    assert marker.exists()
    marker.unlink()
    record = benchmark_in_subprocess(engine, SMALL_BENCH, tmp_path / "bench.json")
    assert record["ttft"]["4"]["runs"] == 1
    assert not marker.exists()
    command = isolated_python("pipeline.bench")
    assert command[:2] == [sys.executable, "-I"] and str(REPO) in command


@pytest.mark.parametrize(
    "damage",
    [
        lambda r: r["ttft"]["4"].update(median_ms="fast"),
        lambda r: r["tpot"].update(median_ms=-3.0),
        lambda r: r.update(peak_rss_mib=float("nan")),
        lambda r: r.update(schema_version="1"),
        lambda r: r["ttft"].update({"4": None}),
    ],
    ids=["string time", "negative time", "NaN", "schema as string", "summary null"],
)
def test_a_broken_cached_bench_record_is_discarded_and_measured_again(
    engine: Path, tmp_path: Path, damage: Callable[[dict[str, Any]], Any], caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    first = measure(engine, "d" * 64, SMALL_BENCH, cache)
    (stored,) = (cache / "bench").glob("*.json")
    broken = copy.deepcopy(json.loads(stored.read_text()))
    damage(broken)
    stored.write_text(json.dumps(broken))
    again = measure(engine, "d" * 64, SMALL_BENCH, cache)
    assert first["cache_hit"] is False and again["cache_hit"] is False  # measured anew
    assert "discarding it and recomputing" in caplog.text
    assert measure(engine, "d" * 64, SMALL_BENCH, cache)["cache_hit"] is True  # the new one is kept


# -- property-based: malformed engine.json files ----------------------------------------------


@st.composite
def malformed_specs(draw: st.DrawFn, good: dict[str, Any]) -> str:
    """engine.json text: the good spec with one field replaced, removed or added, or not JSON."""
    how = draw(st.sampled_from(["replace", "remove", "add", "text"]))
    if how == "text":
        return draw(st.text(max_size=40))
    spec = copy.deepcopy(good)
    path = draw(st.sampled_from(json_paths(spec)))
    node = spec
    for key in path[:-1]:
        node = node[key]
    if how == "replace":
        node[path[-1]] = draw(JSON_VALUES)
    elif how == "remove":
        del node[path[-1]]
    elif isinstance(node, dict):
        node[draw(st.text(max_size=8))] = draw(JSON_VALUES)
    else:
        node.append(draw(JSON_VALUES))
    return json.dumps(spec, allow_nan=True)


@pytest.fixture(scope="module")
def fuzz_engine(
    tiny_engine: Artifact, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("fuzz") / "engine"
    shutil.copytree(tiny_engine.path, folder)
    return folder, spec_of(folder)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_malformed_engine_json_is_one_line_or_read(
    data: st.DataObject, fuzz_engine: tuple[Path, dict[str, Any]]
) -> None:
    folder, good = fuzz_engine
    (folder / ENGINE_FILE).write_text(data.draw(malformed_specs(good)))
    try:
        spec = read_engine_spec(folder)
    except EngineError as exc:
        assert "\n" not in str(exc) and str(folder) in str(exc)
        return
    # what it accepted is well-typed
    assert type(spec.io.num_layers) is int and spec.io.num_layers >= 1
    assert type(spec.max_length) is int and spec.max_length >= 1
    assert spec.model_path.resolve().parent == folder.resolve()


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_malformed_engine_json_through_the_bench_cli(
    data: st.DataObject, fuzz_engine: tuple[Path, dict[str, Any]]
) -> None:
    folder, good = fuzz_engine
    text = data.draw(malformed_specs(good))
    (folder / ENGINE_FILE).write_text(text)
    try:
        read_engine_spec(folder)
    except EngineError:
        pass
    else:
        assume(False)  # a valid engine.json: the benchmark would run; not this test's case
    result = _cli("-m", "pipeline.bench", str(folder))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), lines


def test_the_peak_rss_child_never_imports_a_planted_sitecustomize(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The benchmarks' fresh-process RSS probe (``benchmarks.common.child_rss``: fusion's and the
    llama.cpp peer's)."""
    from benchmarks import common

    planted = tmp_path / "recipes"
    planted.mkdir()
    marker = tmp_path / "marker"
    (planted / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.setenv("PYTHONPATH", str(planted))
    script = "import sys\nfrom pipeline.runtime.generate import GenerationConfig\nprint(sys.argv[1], 7)\n"
    assert common.child_rss(script, ["5"], tmp_path) == {"after_load": 5, "peak_decoding": 7}
    assert not marker.exists()
