"""Nothing non-finite is cached: the pass manager checks every weight of a pass output (torch
safetensors, ONNX graphs and their external data, engines) before committing it, and refuses a NaN
or infinite one in one line naming the pass, the file and the tensor; distill's knobs are
range-checked at start-up and its loss is checked every step. A refused output leaves no entry, and
a rerun with a sane setting computes and caches it."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from passes.distill import DistillPass
from passes.fp16 import Fp16Pass
from passes.ort_build import OrtCpuBuildPass
from passes.prune import PrunePass
from pipeline.core.artifacts import Artifact, Kind, folder_digest
from pipeline.core.cache import ENTRY_FILE, OUTPUT_DIR, Cache
from pipeline.core.errors import PassError
from pipeline.core.files import UnsafeFileError
from pipeline.core.finite import first_nonfinite
from pipeline.core.manager import PassManager
from tests.conftest import make_tiny_llama, run_pass
from tests.passes.test_distill import SMALL, pruned  # noqa: F401 - fixture
from tests.passes.test_prune import CALIBRATION

NAN32 = struct.pack("<f", float("nan"))


def entries(cache: Path) -> list[str]:
    """The committed entries of a cache folder (its keys)."""
    return sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) if cache.is_dir() else []


def staged(cache: Path) -> list[str]:
    """What is left in the cache's staging folder other than lock files."""
    return [p.name for p in (cache / ".staging").iterdir() if not p.name.endswith(".lock")]


# --------------------------------------------------------------------------------------------
# The scan


def _safetensors(folder: Path, dtype: str, values: list[float]) -> None:
    import torch
    from safetensors.torch import save_file

    tensor = torch.tensor(values, dtype=torch.float32).to(getattr(torch, dtype))
    save_file({"fine": torch.ones(3, dtype=tensor.dtype), "bad": tensor}, str(folder / "model.safetensors"))


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        ("float32", float("nan")),
        ("float32", float("-inf")),
        ("float16", float("inf")),
        ("bfloat16", float("nan")),
        ("float64", float("inf")),
        ("float8_e4m3fn", float("nan")),  # its NaN code (no infinity)
        ("float8_e5m2", float("inf")),
    ],
)
def test_a_non_finite_value_of_every_float_dtype_is_found(tmp_path: Path, dtype: str, value: float) -> None:
    _safetensors(tmp_path, dtype, [1.0, 2.0, 3.0])
    assert first_nonfinite(tmp_path) is None
    _safetensors(tmp_path, dtype, [1.0, value, 3.0])
    found = first_nonfinite(tmp_path)
    assert found is not None and (found.file, found.tensor, found.count) == ("model.safetensors", "bad", 1)


def test_integer_and_packed_tensors_need_no_check(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    every_byte = torch.arange(256, dtype=torch.int32)  # 0x7F, 0xFF: NaN codes of a float8
    save_file(
        {"u8": every_byte.to(torch.uint8), "i8": every_byte.to(torch.int8), "i32": every_byte},
        str(tmp_path / "model.safetensors"),
    )
    assert first_nonfinite(tmp_path) is None


def _graph(folder: Path, weight: np.ndarray, external: bool) -> None:
    import onnx
    from onnx import helper, numpy_helper

    constant = helper.make_node(
        "Constant", [], ["c"], value=numpy_helper.from_array(np.ones(4, np.float32), "c")
    )
    nodes = [
        constant,
        helper.make_node("MatMul", ["x", "W"], ["y0"]),
        helper.make_node("Add", ["y0", "c"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(np.zeros(16, np.int8), "packed"), numpy_helper.from_array(weight, "W")],
    )
    options = (
        {"save_as_external_data": True, "location": "model.onnx.data", "size_threshold": 0}
        if external
        else {}
    )
    onnx.save(helper.make_model(graph), str(folder / "model.onnx"), **options)


@pytest.mark.parametrize("external", [True, False], ids=["external data", "inline"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_an_onnx_initializer_is_checked_in_its_external_data(
    tmp_path: Path, external: bool, dtype: type
) -> None:
    weight = np.eye(4, dtype=dtype)
    _graph(tmp_path, weight, external)
    assert first_nonfinite(tmp_path) is None
    weight[2, 1] = np.nan
    _graph(tmp_path, weight, external)
    found = first_nonfinite(tmp_path)
    assert found is not None and (found.file, found.tensor) == ("model.onnx", "W")


def test_a_large_checkpoint_is_streamed_not_loaded(tmp_path: Path) -> None:
    """A 1 GiB float32 tensor (a sparse file: no disk) scanned under a 512 MiB address-space rise:
    loading it whole would fail."""
    header = json.dumps({"big": {"dtype": "F32", "shape": [1 << 28], "data_offsets": [0, 1 << 30]}}).encode()
    path = tmp_path / "model.safetensors"
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.truncate(8 + len(header) + (1 << 30))
        handle.seek(8 + len(header) + (1 << 30) - 4)
        handle.write(NAN32)  # the last element
    script = textwrap.dedent(
        """
        import resource, sys
        from pipeline.core.finite import first_nonfinite
        import numpy, onnx  # imported before the limit
        used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + (512 << 20), resource.RLIM_INFINITY))
        found = first_nonfinite(sys.argv[1])
        print(found.tensor, found.count)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["big", "1"]


def test_a_fifo_in_an_output_is_refused_without_hanging(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors")
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the scan hung on a FIFO"))
    signal.alarm(20)
    try:
        with pytest.raises(UnsafeFileError, match="is a FIFO, not a regular file"):
            first_nonfinite(tmp_path)
    finally:
        signal.alarm(0)


# --------------------------------------------------------------------------------------------
# Real passes through the manager


def _poison_safetensors(folder: Path) -> str:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    path.unlink()  # never write through a hard link into another entry
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name].view(-1)[5] = float("nan")
    save_file(tensors, str(path), metadata={"format": "pt"})
    return name


def _own_copy(path: Path) -> None:
    """Replace ``path`` by a copy of itself: an output hard-links files of its input's entry."""
    content = path.read_bytes()
    path.unlink()
    path.write_bytes(content)


def _poison_graph(folder: Path, every: bool = False) -> str:
    """A NaN in the external data of the graph's first float initializer (``every``: of each); the
    (first) name."""
    import onnx

    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    names = []
    for tensor in model.graph.initializer:
        if tensor.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16) and tensor.external_data:
            info = {entry.key: entry.value for entry in tensor.external_data}
            nan = NAN32 if tensor.data_type == onnx.TensorProto.FLOAT else struct.pack("<e", float("nan"))
            data = folder / info["location"]
            if data.stat().st_nlink > 1:
                _own_copy(data)
            with data.open("r+b") as handle:
                handle.seek(int(info.get("offset", 0)))
                handle.write(nan)
            names.append(tensor.name)
            if not every:
                break
    assert names, "no float initializer with external data"
    return names[0]


POISONED: dict[str, str] = {}


class PoisonedPrune(PrunePass):
    """The real prune pass whose output gets a NaN weight after its own checks passed."""

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        metrics = super().ensures(source, result)
        POISONED["tensor"] = _poison_safetensors(result.path)
        return metrics


class PoisonedFp16(Fp16Pass):
    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        metrics = super().ensures(source, result)
        POISONED["tensor"] = _poison_graph(result.path)
        return metrics


class PoisonedBuild(OrtCpuBuildPass):
    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        metrics = super().ensures(source, result)
        POISONED["tensor"] = _poison_graph(result.path)
        return metrics


def _refused(step: Any, source: Artifact, cache: Path, file: str) -> PassError:
    with pytest.raises(PassError) as caught:
        run_pass(step, source, cache)
    message = str(caught.value)
    assert "\n" not in message
    assert f"pass '{step.name}' produced non-finite weights" in message
    assert f"tensor {POISONED['tensor']} of {file}" in message and "nothing was cached" in message
    assert entries(cache) == [] and staged(cache) == []
    return caught.value


def test_a_torch_output_with_a_nan_weight_is_not_cached_and_a_rerun_computes_it(
    tiny_llama: Path, tmp_path: Path
) -> None:
    source = Artifact.from_dir(Kind.TORCH, tiny_llama)
    settings = {"calibration": CALIBRATION, "mlp_ratio": 0.5}
    _refused(PoisonedPrune(**settings), source, tmp_path / "cache", "model.safetensors")
    result, _ = run_pass(PrunePass(**settings), source, tmp_path / "cache")
    assert len(entries(tmp_path / "cache")) == 1 and first_nonfinite(result.path) is None


def test_a_graph_with_a_nan_in_its_external_data_is_not_cached(tiny_graph: Artifact, tmp_path: Path) -> None:
    error = _refused(PoisonedFp16(), tiny_graph, tmp_path / "cache", "model.onnx")
    assert "quant.* settings" in str(error) or "fp16.* settings" in str(error)
    run_pass(Fp16Pass(), tiny_graph, tmp_path / "cache")
    assert len(entries(tmp_path / "cache")) == 1


def test_an_engine_with_a_nan_weight_is_not_cached(tiny_graph: Artifact, tmp_path: Path) -> None:
    _refused(PoisonedBuild(), tiny_graph, tmp_path / "cache", "model.onnx")
    run_pass(OrtCpuBuildPass(), tiny_graph, tmp_path / "cache")
    assert len(entries(tmp_path / "cache")) == 1


class DivergingDistill(DistillPass):
    """The real distill pass; with lr >= 0.5 one weight of its student is NaN, as a student that
    diverged in its last step (the tiny model's clipped AdamW does not diverge by itself)."""

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        metrics = super().run(source, out_dir)
        if self.config.lr >= 0.5:
            POISONED["tensor"] = _poison_safetensors(out_dir)
        return metrics


def test_a_diverged_student_is_refused_and_a_rerun_with_a_lower_lr_is_cached(
    pruned: Artifact,  # noqa: F811 - the imported fixture
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    diverging = {**SMALL, "steps": 2, "lr": 0.5}
    error = _refused(DivergingDistill(**diverging), pruned, cache, "model.safetensors")
    assert str(error).endswith(
        "the student diverged: lower distill.lr (now 0.5) or raise distill.warmup_ratio (now 0.1)"
    )
    assert not list((cache / ".checkpoints").glob("*/*"))  # no checkpoint of it to resume either
    result, metrics = run_pass(DivergingDistill(**{**diverging, "lr": 1e-3}), pruned, cache)
    assert len(entries(cache)) == 1 and first_nonfinite(result.path) is None
    assert metrics["loss_curve"][-1][0] == 2


def test_a_student_whose_loss_is_not_finite_stops_in_its_first_step(pruned: Artifact, tmp_path: Path) -> None:  # noqa: F811
    """A NaN weight in the student the distill pass starts from: its KD loss is NaN in step 1; the
    pass stops there in one line rather than training on NaN for every step."""
    import shutil

    student = Path(shutil.copytree(pruned.path, tmp_path / "student"))
    _poison_safetensors(student)
    source = Artifact.from_dir(Kind.TORCH, student)
    with pytest.raises(PassError) as caught:
        run_pass(DistillPass(**{**SMALL, "steps": 3}), source, tmp_path / "cache")
    message = str(caught.value)
    assert "\n" not in message and "the KD loss became non-finite (nan) in step 1" in message
    assert "lower distill.lr (now 0.001)" in message and entries(tmp_path / "cache") == []


def test_an_entry_cached_with_a_nan_weight_by_an_earlier_version_is_evicted_and_recomputed(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = Artifact.from_dir(Kind.TORCH, tiny_llama)
    step = PrunePass(calibration=CALIBRATION, mlp_ratio=0.5)
    run_pass(step, source, tmp_path / "cache")
    (key,) = entries(tmp_path / "cache")
    entry = tmp_path / "cache" / key
    # What an earlier version committed: the diverged output, its digest, no "finite" mark.
    _poison_safetensors(entry / OUTPUT_DIR)
    record = json.loads((entry / ENTRY_FILE).read_text())
    record.pop("finite")
    record["output_digest"] = folder_digest(entry / OUTPUT_DIR)
    (entry / ENTRY_FILE).write_text(json.dumps(record))

    _, (again,) = PassManager(
        [PrunePass(calibration=CALIBRATION, mlp_ratio=0.5)], Cache(tmp_path / "cache"), None
    ).run(source)
    assert not again.cache_hit
    assert any(
        "holds a non-finite model.layers.0.mlp.down_proj.weight" in r.getMessage() for r in caplog.records
    )
    assert json.loads((entry / ENTRY_FILE).read_text())["finite"] is True
    assert first_nonfinite(entry / OUTPUT_DIR) is None
    _, (third,) = PassManager(
        [PrunePass(calibration=CALIBRATION, mlp_ratio=0.5)], Cache(tmp_path / "cache"), None
    ).run(source)
    assert third.cache_hit


# --------------------------------------------------------------------------------------------
# Distill's knobs at start-up


@pytest.mark.parametrize(
    ("knob", "shown"),
    [
        ("distill.lr=inf", "distill.lr=inf is out of range: a finite number in (0, 1]"),
        ("distill.lr=1e4", "distill.lr=10000.0 is out of range: a finite number in (0, 1]"),
        ("distill.weight_decay=-1e9", "distill.weight_decay=-1000000000.0 is out of range"),
        # Before the memory preflight, which named distill.micro_batch_size for it.
        ("distill.seq_len=100000", "distill.seq_len=100000 exceeds the model's context of"),
    ],
)
def test_an_optimizer_knob_out_of_range_is_one_line_before_any_pass_runs(
    tiny_llama: Path, tmp_path: Path, knob: str, shown: str
) -> None:
    from tests.pipeline.test_main import run_pipeline

    result = run_pipeline(tiny_llama, tmp_path, "run", "prune=width25", "distill=kd", knob, "bench=none")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and shown in lines[-1], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert entries(tmp_path / "cache") == []


def test_distill_seq_len_is_bounded_by_the_models_context(pruned: Artifact) -> None:  # noqa: F811
    from pipeline.core.manager import check_against_model

    context = json.loads((pruned.path / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(
        PassError, match=rf"distill.seq_len={context * 2} exceeds the model's context of {context}"
    ):
        check_against_model([DistillPass(**{**SMALL, "seq_len": context * 2})], pruned)


def test_make_tiny_llama_is_finite(tmp_path: Path) -> None:
    assert first_nonfinite(make_tiny_llama(tmp_path / "m")) is None


# --------------------------------------------------------------------------------------------
# Cached quality records: typed and range-checked when read back


QUALITY_DAMAGES = {
    "kl_mean of text": lambda r: r.update(kl_mean="abc"),
    "perplexity NaN": lambda r: r.update(perplexity=float("nan")),
    "another engine": lambda r: r.update(engine="0" * 64),
    "no reference perplexity": lambda r: r.pop("reference_perplexity"),
}


@pytest.fixture(scope="module")
def quality_run(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    from tests.pipeline.test_main import run_pipeline

    workdir = tmp_path_factory.mktemp("quality")
    result = run_pipeline(
        tiny_llama, workdir, "run", "bench=none", "quality.max_tokens=256", "quality.window=64"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, json.loads((workdir / "run" / "manifest.json").read_text())["quality"]


def test_a_sound_quality_record_is_reused(tiny_llama: Path, quality_run: tuple[Path, dict[str, Any]]) -> None:
    from tests.pipeline.test_main import run_pipeline

    workdir, first = quality_run
    result = run_pipeline(
        tiny_llama, workdir, "reuse", "bench=none", "quality.max_tokens=256", "quality.window=64"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    again = json.loads((workdir / "reuse" / "manifest.json").read_text())["quality"]
    assert again["cache_hit"] is True and again["kl_mean"] == first["kl_mean"]


def test_a_sound_entry_of_an_earlier_version_is_checked_once_and_marked(
    tiny_llama: Path, tmp_path: Path
) -> None:
    source = Artifact.from_dir(Kind.TORCH, tiny_llama)
    run_pass(PrunePass(calibration=CALIBRATION, mlp_ratio=0.5), source, tmp_path / "cache")
    (key,) = entries(tmp_path / "cache")
    entry_file = tmp_path / "cache" / key / ENTRY_FILE
    record = json.loads(entry_file.read_text())
    record.pop("finite")  # as an earlier version committed it
    entry_file.write_text(json.dumps(record))
    _, (again,) = PassManager(
        [PrunePass(calibration=CALIBRATION, mlp_ratio=0.5)], Cache(tmp_path / "cache"), None
    ).run(source)
    assert again.cache_hit  # served, not recomputed ...
    assert json.loads(entry_file.read_text()) == {**record, "finite": True}  # ... and marked checked
    assert list((tmp_path / "cache" / ".staging").iterdir()) == []


@pytest.mark.parametrize("damage", sorted(QUALITY_DAMAGES))
def test_a_cached_quality_record_with_a_bad_field_is_recomputed(
    tiny_llama: Path, quality_run: tuple[Path, dict[str, Any]], damage: str
) -> None:
    from tests.pipeline.test_main import run_pipeline

    workdir, first = quality_run
    (path,) = (workdir / "cache" / "quality").glob("*.json")
    record = json.loads(path.read_text())
    QUALITY_DAMAGES[damage](record)
    path.write_text(json.dumps(record))
    run = f"again-{damage.replace(' ', '-')}"
    result = run_pipeline(
        tiny_llama, workdir, run, "bench=none", "quality.max_tokens=256", "quality.window=64"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    again = json.loads((workdir / f"again-{damage.replace(' ', '-')}" / "manifest.json").read_text())[
        "quality"
    ]
    assert again["cache_hit"] is False and again["perplexity"] == first["perplexity"]
    assert "discarding it and recomputing" in result.stderr + result.stdout
    assert json.loads(path.read_text())["perplexity"] == first["perplexity"]  # stored whole again


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top1_agreement", 3.0),
        ("tokens_scored", True),
        ("perplexity", 0.0),
        ("kl_mean", -1.0),
        ("windows", "2"),
    ],
)
def test_quality_record_fields_are_typed_and_range_checked(field: str, value: object) -> None:
    from pipeline.run import quality_problem

    payload = {"engine": "e", "reference": "r", "config": {"text": "gpl-3.0"}}
    good = {**payload, "perplexity": 3.0, "reference_perplexity": 2.5, "kl_mean": 0.1, "top1_agreement": 0.9}
    good.update(tokens_scored=10, windows=2, window=6, chunk=0, text="gpl-3.0", same_engine=False)
    assert quality_problem(good, payload) is None
    assert field in (quality_problem({**good, field: value}, payload) or "") or field == "perplexity"
    assert quality_problem({**good, field: value}, payload) is not None


def test_an_engine_with_non_finite_logits_gets_no_quality_score(
    tiny_engine: Artifact, tmp_path: Path
) -> None:
    """The held-out comparison refuses NaN logits in one line: a NaN perplexity or KL is never
    recorded, nor cached as the run's quality."""
    import shutil

    from evals.agreement import compare
    from evals.config import QualityConfig
    from pipeline.core.errors import EngineError
    from pipeline.runtime import Engine

    folder = Path(shutil.copytree(tiny_engine.path, tmp_path / "engine"))
    _poison_graph(folder, every=True)
    with pytest.raises(EngineError) as caught:
        compare(Engine(folder), None, QualityConfig(window=32, max_tokens=64))
    message = str(caught.value)
    assert "\n" not in message and f"quality: the engine {folder} gives non-finite logits" in message
