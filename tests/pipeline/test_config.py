"""Structured configs: bad overrides fail at parse time; the recipe builds the right passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from passes.export import ExportPass
from passes.ort_build import OrtCpuBuildPass
from pipeline.config import DRIFT_FAMILIES, STAGE_ORDER, EvalConfig
from pipeline.core.artifacts import Kind
from pipeline.core.config import validate_tree
from pipeline.core.errors import ConfigError
from pipeline.core.manager import validate
from pipeline.core.plugins import build_passes, pass_class
from pipeline.gate import load_eval_config
from pipeline.run import drift_family
from tests.pipeline.recipe import compose_recipe

REPO = Path(__file__).resolve().parents[2]
GROUPS = ["model", "quant", "prune", "distill", "kv_cache", "fusion", "target", "eval", "registry"]


def test_default_recipe_is_export_then_build() -> None:
    cfg = compose_recipe(["model=llama", "quant=none"])
    passes = build_passes(cfg)
    assert [type(p) for p in passes] == [ExportPass, OrtCpuBuildPass]
    validate(passes, Kind.TORCH)
    assert cfg.model.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert list(cfg.pipeline.order) == STAGE_ORDER


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_exists(group: str) -> None:
    assert (REPO / "configs" / group).is_dir()
    assert any((REPO / "configs" / group).glob("*.yaml"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("export.bogus=1", "bogus"),
        ("export.opset=seventeen", "opset"),
        ("target.graph_optimization_level=max", "graph_optimization_level"),
        ("export.attention=flash", "attention"),
        ("bench.repeats=many", "repeats"),
        ("pipeline.cache=maybe", "cache"),
        ("quant.bits=4", "bits"),
        ("unknown_key=1", "unknown_key"),
        ("quant=bogus", "bogus"),
        ("kv_cache=shared kv_cache.dtype=int4", "dtype"),
        ("kv_cache=concat kv_cache.layout=ring", "layout"),
        ("fusion=ort fusion.rules=rms_norm", "rules"),
    ],
)
def test_bad_override_fails_at_parse_time(override: str, message: str) -> None:
    with pytest.raises((ConfigCompositionException, ValidationError)) as error:
        compose_recipe(override.split())
    assert message in str(error.value) or message in str(error.value.__cause__)


def test_layout_and_fusion_options_place_their_passes_between_export_and_build() -> None:
    from passes.fusion.fuse import FusionPass
    from passes.kv_cache import KvCachePass

    cfg = compose_recipe(["fusion=ort", "kv_cache=shared", "kv_cache.window=128"])
    passes = build_passes(cfg)
    assert [type(p) for p in passes] == [ExportPass, KvCachePass, FusionPass, OrtCpuBuildPass]
    validate(passes, Kind.TORCH)
    assert passes[1].config.layout == "shared" and passes[1].config.window == 128
    assert passes[2].config.rules == [
        "rms_norm",
        "skip_rms_norm",
        "rotary_embedding",
        "group_query_attention",
        "packed_qkv",
    ]


def test_kv_cache_dtype_and_its_calibration_reach_the_pass() -> None:
    cfg = compose_recipe(
        ["fusion=ort", "kv_cache=shared", "kv_cache.dtype=int8", "kv_cache.calibration.num_samples=8"]
    )
    kv_cache = build_passes(cfg)[1]
    assert kv_cache.config.dtype == "int8" and kv_cache.config.calibration.num_samples == 8


def test_overrides_reach_the_pass_config() -> None:
    cfg = compose_recipe(["export.opset=18", "target.intra_op_num_threads=2"])
    export, build = build_passes(cfg)
    assert export.config.opset == 18
    assert build.config.intra_op_num_threads == 2


def test_a_pass_waits_for_the_kind_it_consumes() -> None:
    cfg = compose_recipe(["pipeline.order=[target,export]"])
    assert [type(p) for p in build_passes(cfg)] == [ExportPass, OrtCpuBuildPass]


def test_order_without_target_is_a_config_error() -> None:
    cfg = compose_recipe(["pipeline.order=[export]"])
    with pytest.raises(ConfigError, match="ends with an ONNX graph"):
        validate(build_passes(cfg), Kind.TORCH)


def test_order_naming_no_group_is_a_config_error() -> None:
    cfg = compose_recipe(["pipeline.order=[export,nonsense,target]"])
    with pytest.raises(ConfigError, match="'nonsense'"):
        build_passes(cfg)


@pytest.mark.parametrize(
    "target", ["os.system", "subprocess.Popen", "pipeline.run.run_pipeline", "passes.export.log"]
)
def test_target_outside_passes_or_not_a_pass_is_refused(target: str) -> None:
    cfg = compose_recipe([f"export._target_={target}"])
    with pytest.raises(ConfigError, match="_target_"):
        build_passes(cfg)
    with pytest.raises(ConfigError):
        pass_class(target, "export")


def test_cfg_job_prints_the_resolved_recipe() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "model=llama", "quant=none", "--cfg", "job"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "_target_: passes.export.ExportPass" in result.stdout
    assert "sha256: b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53" in result.stdout


@pytest.mark.parametrize(
    ("overrides", "family"),
    [
        ([], "fp32"),
        (["fusion=ort", "kv_cache=shared"], "fp32"),
        (["quant=fp16"], "bits16"),
        (["kv_cache=concat", "kv_cache.dtype=fp16"], "bits16"),
        (["quant=int8"], "bits8"),
        (["quant=fp8"], "bits8"),
        (["kv_cache=shared", "kv_cache.dtype=int8"], "bits8"),
        (["quant=int4_awq", "kv_cache=shared", "kv_cache.dtype=int8"], "bits4"),
        (["quant=int4_gptq"], "bits4"),
        (["prune=width25", "quant=int8"], "pruned"),
        (["distill=kd"], "pruned"),
    ],
)
def test_a_recipe_drifts_as_far_as_its_loosest_pass(overrides: list[str], family: str) -> None:
    assert drift_family(build_passes(compose_recipe(overrides))) == family


def test_the_eval_gate_carries_drift_bounds_per_family_and_checks_them() -> None:
    for size in ("quick", "full"):
        eval_cfg = compose_recipe([f"eval={size}"]).eval
        assert set(eval_cfg.drift) == set(DRIFT_FAMILIES)
        bounds = [eval_cfg.drift[f].max_kl for f in DRIFT_FAMILIES]
        assert bounds == sorted(bounds), "a looser family must allow at least the KL of a stricter one"
        assert load_eval_config(size, []).drift == OmegaConf.to_object(eval_cfg).drift  # the gate CLI's
    with pytest.raises(ConfigError, match=r"eval.drift.bits3: no such recipe family; choose one of fp32"):
        validate_tree(EvalConfig(drift={"bits3": {"max_kl": 0.1}}))
    with pytest.raises(ConfigError, match=r"eval.drift.bits8.min_top1=1.5: must be a number at least 0"):
        validate_tree(EvalConfig(drift={"bits8": {"min_top1": 1.5}}))
    with pytest.raises(ConfigError, match=r"eval.family=int3: no such recipe family"):
        validate_tree(EvalConfig(family="int3"))


def test_too_little_calibration_text_names_both_knobs_and_their_limits(tiny_llama: Path) -> None:
    """Windows that do not fit the text: the hint says how far to lower num_samples, and
    seq_len, each under its own name (a long seq_len used to be blamed on num_samples alone)."""
    from calibration.datasets import CalibrationConfig, token_windows
    from pipeline.core.errors import CalibrationError
    from pipeline.core.torch_model import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama)
    text = "the quick brown fox jumps over the lazy dog " * 40
    tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    config = CalibrationConfig(num_samples=8, seq_len=tokens // 3)
    with pytest.raises(CalibrationError) as error:
        token_windows(tokenizer, config, text=text)
    message = str(error.value)
    assert f"quant.calibration.num_samples=8 x quant.calibration.seq_len={tokens // 3}" in message
    assert "lower quant.calibration.num_samples to at most 3 " in message
    assert f"or quant.calibration.seq_len to at most {tokens // 8}" in message
    with pytest.raises(
        CalibrationError, match=r"shorter than one sequence of kv_cache\.calibration\.seq_len"
    ):
        token_windows(
            tokenizer, CalibrationConfig(seq_len=tokens + 1), text=text, knob="kv_cache.calibration"
        )


def test_calibration_knobs_are_bounded_and_named_where_the_recipe_sets_them() -> None:
    from calibration.datasets import CalibrationConfig
    from pipeline.core.config import build_config, config_where
    from pipeline.core.errors import CalibrationError

    for values, needle in (
        ({"seq_len": 10**8}, "seq_len=100000000: must be a whole number from 2 to 1048576"),
        ({"num_samples": 10**7}, "num_samples=10000000: must be a whole number from 1 to 65536"),
        ({"seed": 2**40}, "seed=1099511627776: must be a whole number from 0 to 4294967295"),
        ({"num_processes": 0}, "num_processes=0: must be a whole number from 1 to 1024"),
        ({"collective_timeout_s": float("inf")}, "collective_timeout_s=inf: must be more than 0"),
    ):
        with pytest.raises(CalibrationError, match=f"^calibration\\.{needle}"):
            build_config(CalibrationConfig, values)
        with config_where("prune"), pytest.raises(CalibrationError, match=f"^prune\\.calibration\\.{needle}"):
            build_config(CalibrationConfig, values)
    build_config(CalibrationConfig, {"seq_len": 1 << 20, "num_samples": 1 << 16})  # the bounds themselves


@pytest.mark.parametrize(("size", "max_drop"), [("quick", 0.15), ("full", 0.05)])
def test_the_generated_call_rule_is_selectable_with_its_thresholds(size: str, max_drop: float) -> None:
    from pipeline.gate import check_eval

    config = load_eval_config(size, ["suites=[reasoning,tool_call,long_context,tool_call_valid]"])
    check_eval(config)  # a known rule with thresholds
    assert dict(config.thresholds)["tool_call_valid"].max_drop == max_drop
    assert "tool_call_valid" in load_eval_config(size, []).suites  # a default rule
