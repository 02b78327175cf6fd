"""The sensitivity pass in the quant recipes: the scan in the run record (Fisher estimate by
default, the exact scan on request), quant.fallback=auto keeping the most sensitive layers in fp32
in the final graph, the placement knobs, and its bad-input errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto
from scipy.stats import spearmanr

from calibration.sensitivity import fisher_sensitivity, layer_sensitivity
from passes.selection import FALLBACK_FILE
from passes.sensitivity import SCAN_FILE, SensitivityPass
from pipeline.core.artifacts import Artifact, sha256_file
from pipeline.core.cache import Cache
from pipeline.core.errors import ConfigError
from pipeline.core.manager import PassManager
from pipeline.core.placement import ResolvedPlacement
from pipeline.core.plugins import build_passes
from tests.pipeline.recipe import compose_recipe
from tests.pipeline.test_main import run_pipeline

QUICK = ["quant.calibration.num_samples=4", "quant.calibration.seq_len=32", "quant.sensitivity.seq_len=32"]
RECIPES = {
    "int4_gptq": ["quant=int4_gptq", "quant.group_size=32"],
    "int4_awq": ["quant=int4_awq", "quant.group_size=32"],
    "int8": ["quant=int8"],
    "fp8": ["quant=fp8", "quant.exclude=[]"],
}


@pytest.mark.parametrize(
    ("recipe", "names"),
    [
        ("int4_gptq", ["sensitivity", "gptq", "export", "int4_lowering", "ort_build"]),
        ("int8", ["smoothquant", "sensitivity", "export", "int8_qdq", "ort_build"]),
        ("fp8", ["sensitivity", "export", "calibrate-activations", "fp8-qdq", "ort_build"]),
    ],
)
def test_every_recipe_scans_before_it_quantizes_when_asked(recipe: str, names: list[str]) -> None:
    """By default the scan runs when quant.fallback=auto reads it; enabled=true runs it for the
    record alone, enabled=false never (and then fallback=auto is a ConfigError, below)."""
    without = [n for n in names if n != "sensitivity"]
    assert [p.name for p in build_passes(compose_recipe(RECIPES[recipe]))] == without
    for knobs, expected in (
        (["quant.fallback=auto"], names),
        (["quant.sensitivity.enabled=true"], names),
        (["quant.sensitivity.enabled=false"], without),
        (["quant.sensitivity.enabled=null", "quant.fallback=none"], without),
    ):
        assert [p.name for p in build_passes(compose_recipe([*RECIPES[recipe], *knobs]))] == expected


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["quant.kl_budget=0"], "quant.kl_budget=0.0: must be a positive number"),
        (["quant.max_fallback_layers=0"], "quant.max_fallback_layers=0: must be at least 1"),
        (["quant.sensitivity.num_samples=0"], "quant.sensitivity.num_samples=0: at least one window"),
        (
            ["quant.sensitivity.method=taylor"],
            "quant.sensitivity.method=taylor: must be one of fisher, exact",
        ),
        (["quant.sensitivity.fisher_samples=0"], "quant.sensitivity.fisher_samples=0: must be at least 1"),
        (
            ["quant.fallback=auto", "quant.sensitivity.enabled=false"],
            "quant.fallback=auto needs the sensitivity scan",
        ),
    ],
)
def test_bad_knobs_are_config_errors(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        build_passes(compose_recipe([*RECIPES["int4_gptq"], *overrides]))


def test_unknown_fallback_mode_fails_at_parse_time() -> None:
    with pytest.raises(Exception, match="fallback"):
        compose_recipe([*RECIPES["int8"], "quant.fallback=sometimes"])


def test_weights_pass_through_unchanged(tiny_source: Artifact, tmp_path: Path) -> None:
    SensitivityPass(weight="int4", group_size=32, sensitivity={"num_samples": 2, "seq_len": 32}).run(
        tiny_source, tmp_path
    )
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert sha256_file(tmp_path / name) == sha256_file(tiny_source.path / name)
    scan = json.loads((tmp_path / SCAN_FILE).read_text())
    kl = [entry["kl"] for entry in scan["ranking"]]
    assert len(kl) == 15 and kl == sorted(kl, reverse=True) and kl[-1] >= 0  # 2 x 7 projections + lm_head
    assert json.loads((tmp_path / FALLBACK_FILE).read_text())["modules"] == []


def fp32_weight_initializers(graph_dir: Path) -> set[str]:
    model = onnx.load(str(graph_dir / "model.onnx"), load_external_data=False)
    return {i.name for i in model.graph.initializer if i.data_type == TensorProto.FLOAT}


@pytest.mark.parametrize("recipe", ["int4_gptq", "int4_awq", "int8", "fp8"])
def test_fallback_auto_keeps_the_most_sensitive_layers_in_fp32(
    recipe: str, tiny_source: Artifact, tmp_path: Path
) -> None:
    """A budget no quantized model meets: fallback keeps max_fallback_layers=2, the top of the scan."""
    overrides = [*RECIPES[recipe], *QUICK, "quant.fallback=auto", "quant.kl_budget=1e-12"]
    cfg = compose_recipe([*overrides, "quant.max_fallback_layers=2"])
    engine, records = PassManager(build_passes(cfg), Cache(tmp_path / "cache")).run(tiny_source)
    scan = next(r for r in records if r.name == "sensitivity").metrics
    ranking = [entry["module"] for entry in scan["ranking"]]
    assert len(ranking) == 15 and scan["fallback"]["modules"] == ranking[:2]
    assert not scan["fallback"]["budget_met"]
    fp32 = fp32_weight_initializers(engine.path)
    kept = {m for m in ranking if f"{m}.weight_t" in fp32}  # the export's names
    assert kept == set(ranking[:2]), "only the fallback layers stay fp32"


def test_cli_writes_the_scan_to_the_run_record(tiny_llama: Path, tmp_path: Path) -> None:
    fallback = ["quant.fallback=auto", "quant.kl_budget=1e-12", "quant.max_fallback_layers=1"]
    overrides = [*RECIPES["int8"], *QUICK, *fallback]
    result = run_pipeline(tiny_llama, tmp_path, "run", "bench=none", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    scan = next(p for p in manifest["passes"] if p["name"] == "sensitivity")["metrics"]
    kl = [entry["kl"] for entry in scan["ranking"]]
    assert len(kl) == 15 and kl == sorted(kl, reverse=True)  # the record keeps the ranking order
    assert scan["fallback"]["modules"] == [scan["ranking"][0]["module"]]
    assert scan["most_sensitive"][0]["kl"] == kl[0]
    assert manifest["recipe"]["quant"]["fallback"] == "auto" and manifest["quality"]["perplexity"] > 1


def test_cli_bad_budget_is_one_line_and_caches_nothing(tiny_llama: Path, tmp_path: Path) -> None:
    result = run_pipeline(tiny_llama, tmp_path, "run", "bench=none", *RECIPES["fp8"], "quant.kl_budget=-1")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: quant.kl_budget=-1.0: must be a positive number")
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(p.is_dir() and len(p.name) == 64 for p in cache.iterdir())


SCAN = {"weight": "int4", "group_size": 32}
WINDOWS = {"num_samples": 2, "seq_len": 32}


def scan_kl(folder: Path) -> dict[str, float]:
    return {e["module"]: e["kl"] for e in json.loads((folder / SCAN_FILE).read_text())["ranking"]}


def test_exact_method_is_the_restart_scan(tiny_source: Artifact, tmp_path: Path) -> None:
    scan = SensitivityPass(**SCAN, sensitivity={**WINDOWS, "method": "exact"})
    metrics = scan.run(tiny_source, tmp_path)
    assert metrics["method"] == "exact"
    assert json.loads((tmp_path / SCAN_FILE).read_text())["method"] == "exact"
    probe, quantizers = scan.probe(tiny_source.path)
    assert scan_kl(tmp_path) == layer_sensitivity(probe, quantizers, progress=False)


def test_fisher_is_the_default_and_fallback_auto_keeps_the_budget(
    tiny_source: Artifact, tmp_path: Path
) -> None:
    probe, quantizers = SensitivityPass(**SCAN, sensitivity=WINDOWS).probe(tiny_source.path)
    budget = probe.kl(quantizers) / 2  # every layer quantized misses it: some must stay fp32
    scan = SensitivityPass(
        **SCAN, sensitivity=WINDOWS, fallback="auto", kl_budget=budget, max_fallback_layers=15
    )
    metrics = scan.run(tiny_source, tmp_path)
    assert metrics["method"] == "fisher" and SensitivityPass.version >= 2
    assert scan_kl(tmp_path) == fisher_sensitivity(probe, quantizers, samples=4, progress=False)
    fallback = json.loads((tmp_path / FALLBACK_FILE).read_text())
    assert fallback["budget_met"] and fallback["kl"] <= budget and 0 < len(fallback["modules"]) < 15
    assert fallback["modules"] == [e["module"] for e in metrics["ranking"][: len(fallback["modules"])]]
    assert probe.kl({n: q for n, q in quantizers.items() if n not in fallback["modules"]}) <= budget


def test_the_pass_computes_on_its_placement(tiny_source: Artifact, tmp_path: Path) -> None:
    """pipeline.torch_dtype=bfloat16 reaches the model and the scan; scores stay float32-accumulated."""
    assert SensitivityPass.placement_knobs == ("device", "torch_dtype")
    bf16 = ResolvedPlacement("cpu", "bfloat16")
    scan = SensitivityPass(**SCAN, sensitivity=WINDOWS)
    scan.placement = bf16
    probe, quantizers = scan.probe(tiny_source.path)
    seen: set[torch.dtype] = set()
    layer = probe.linears["model.layers.1.mlp.down_proj"]
    handle = layer.register_forward_pre_hook(lambda _m, args: seen.add(args[0].dtype))
    try:
        fisher_sensitivity(probe, quantizers, samples=1, progress=False)
    finally:
        handle.remove()
    assert seen == {torch.bfloat16}

    for name in ("bf16", "fp32"):
        (tmp_path / name).mkdir()
    scan.run(tiny_source, tmp_path / "bf16")
    SensitivityPass(**SCAN, sensitivity=WINDOWS).run(tiny_source, tmp_path / "fp32")
    low, full = scan_kl(tmp_path / "bf16"), scan_kl(tmp_path / "fp32")
    names = list(full)
    assert low != full  # the placement was honoured: bf16 rounds differently
    assert spearmanr([full[n] for n in names], [low[n] for n in names]).statistic > 0.8
    assert next(iter(low)) == names[0]


def test_cli_bad_method_is_one_line(tiny_llama: Path, tmp_path: Path) -> None:
    result = run_pipeline(
        tiny_llama, tmp_path, "run", "bench=none", *RECIPES["int8"], "quant.sensitivity.method=taylor"
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == ["error: quant.sensitivity.method=taylor: must be one of fisher, exact"]


def test_memory_estimate_adds_the_fisher_backward_to_the_whole_model(tiny_llama: Path) -> None:
    from pipeline.core.memory import generic_estimate
    from pipeline.core.shapes import model_shapes

    shapes = model_shapes(tiny_llama)
    assert shapes is not None
    fisher, exact = SensitivityPass(), SensitivityPass(sensitivity={"method": "exact"})
    generic = generic_estimate(fisher, shapes).host_bytes
    assert generic < exact.estimate_memory(shapes) < fisher.estimate_memory(shapes)  # type: ignore[operator]


@pytest.mark.parametrize("fmt_name", ["int8", "float8e4m3fn"])
def test_torch_fake_quant_is_the_graph_passes_numpy_math_bit_for_bit(fmt_name: str) -> None:
    """The scan simulates int8/fp8 in torch; the graph passes quantize with ``Format.fake_quant``.
    Ties, saturation, subnormals and a zero range included: every element must agree exactly."""
    import numpy as np

    from calibration.observers import FORMATS
    from passes.sensitivity import torch_fake_quant

    fmt = FORMATS[fmt_name]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 257, generator=generator) * torch.logspace(-6, 2, 257)
    x[0, :8] = torch.tensor([0.5, 1.5, -2.5, 3.5, 1e-9, -0.0, 1e6, -1e6])  # ties, tiny, saturating
    rows = x.abs().amax(dim=1, keepdim=True)
    rows[1] = 0.0  # an all-zero range gets scale 1 in both
    x[1] = 0.0
    for amax in (rows, torch.tensor(3.25), torch.tensor(0.0)):
        expected = fmt.fake_quant(x.numpy(), amax.numpy())
        got = torch_fake_quant(fmt, x, amax).numpy()
        assert got.dtype == np.float32
        assert np.array_equal(got.view(np.uint32), expected.astype(np.float32).view(np.uint32))
