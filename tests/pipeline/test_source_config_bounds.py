"""Every ``config.json`` field a pass or the engine reads is bounded when the source is resolved
(issue 50, item 11): a value the engine would refuse only after the export (a
``max_position_embeddings`` or a ``bos_token_id`` of 10^12) is one ``error:`` line at start-up,
exit code 2, naming the field in ``config.json`` and the fix, before anything is exported. Real
checkpoints' configs (Llama 3.1 405B, Llama 3.2 1B, SmolLM2) still pass."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipeline.sources
from pipeline.core.errors import SourceError
from pipeline.source_config import (
    LLAMA,
    ROPE,
    Choice,
    Flag,
    Integer,
    LayerTypes,
    Number,
    NumberList,
    Table,
    TokenId,
    check_config,
)
from pipeline.sources import check_hf_llama, resolve_source
from tests.pipeline.test_errors import assert_one_error_line, cli
from tests.pipeline.test_sources import BUNDLED, converted_folder, make_wheel

FIX = ": re-save the checkpoint"
VOCAB = 320  # the tiny Llama's (tests/conftest.py)


@pytest.fixture
def checkpoint(tiny_llama: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_llama, tmp_path / "ckpt"))


@pytest.fixture(scope="module")
def shared_checkpoint(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One copy for the property tests, its config.json rewritten by every example."""
    return Path(shutil.copytree(tiny_llama, tmp_path_factory.mktemp("bounds") / "ckpt"))


def config_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def with_config(folder: Path, base: dict[str, Any], **changes: Any) -> None:
    (folder / "config.json").write_text(json.dumps({**base, **changes}))


def refusal(folder: Path) -> str:
    """The one-line SourceError ``check_hf_llama`` raises on ``folder``."""
    with pytest.raises(SourceError) as error:
        check_hf_llama(folder)
    message = str(error.value)
    assert "\n" not in message and message.endswith(FIX), message
    return message


# --------------------------------------------------------------------------------------------
# One bad value per field of the table, through the source check


BAD = {
    "vocab_size": (2**24 + 1, "more than the 16777216 tokens"),
    "hidden_size": (1 << 19, "more than the 262144"),
    "intermediate_size": (1 << 21, "more than the 1048576"),
    "num_hidden_layers": (1025, "more than the 1024 a Llama has"),
    "num_attention_heads": (8192, "more than the 4096 heads"),
    "num_key_value_heads": (0, "not a positive integer"),
    "head_dim": (4097, "more than the 4096 values"),
    "max_position_embeddings": (10**12, "more than the 16777216 positions an engine holds"),
    "bos_token_id": (10**12, f"not a token id below vocab_size {VOCAB}"),
    "eos_token_id": ([2, VOCAB], f"not a token id or a list of token ids below vocab_size {VOCAB}"),
    "pad_token_id": (-1, f"not a token id below vocab_size {VOCAB}"),
    "rms_norm_eps": (1.5, "not a finite number more than 0 and less than 1"),
    "rope_theta": (math.inf, "not a finite number more than 0"),
    "rope_scaling": ("llama3", "not a JSON object"),
    "rope_parameters": ([], "not a JSON object"),
    "hidden_act": ("swiglu", "not an activation transformers knows (Llama's: silu)"),
    "tie_word_embeddings": (1, "not true or false"),
    "attention_bias": ("false", "not true or false"),
    "mlp_bias": (None, "not true or false"),
    "use_cache": (0, "not true or false"),
    "attention_dropout": (2.0, "not a finite number from 0 to 1"),
    "initializer_range": (-0.02, "not a finite number from 0 to 1"),
    "torch_dtype": ("int4", "not a floating-point dtype"),
    "dtype": (16, "not a floating-point dtype"),
    "layer_types": (["full_attention"], "not a list of 2 layer types"),
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
BAD_ROPE = {
    "rope_type": ("llama4", "not a RoPE type transformers knows"),
    "type": (None, "not a RoPE type transformers knows"),
    "rope_theta": (-1.0, "not a finite number more than 0"),
    "factor": (0.5, "not a finite number of at least 1"),
    "original_max_position_embeddings": (2**24 + 1, "more than the 16777216 positions"),
    "low_freq_factor": (0, "not a finite number more than 0"),
    "high_freq_factor": ("4", "not a finite number more than 0"),
    "attention_factor": (-1, "not a finite number of at least 0"),
    "beta_fast": (math.nan, "not a finite number more than 0"),
    "beta_slow": (0.0, "not a finite number more than 0"),
    "mscale": (-math.inf, "not a finite number"),
    "mscale_all_dim": ("1", "not a finite number"),
    "truncate": ("yes", "not true or false"),
    "partial_rotary_factor": (1.5, "not a finite number more than 0 and at most 1"),
    "short_factor": ([1.0, -1.0], "not a list of at most 2048 finite numbers more than 0"),
    "long_factor": ([1.0] * 2049, "not a list of at most 2048 finite numbers more than 0"),
}


def test_every_field_of_the_table_has_a_bad_value_here() -> None:
    assert set(BAD) == set(LLAMA.fields)
    assert set(BAD_ROPE) == set(ROPE.fields)


@pytest.mark.parametrize(("key", "value", "says"), [(k, *v) for k, v in BAD.items()], ids=list(BAD))
def test_a_field_out_of_bounds_is_one_line_naming_it_in_config_json(
    checkpoint: Path, key: str, value: Any, says: str
) -> None:
    with_config(checkpoint, config_of(checkpoint), **{key: value})
    message = refusal(checkpoint)
    assert message.startswith(f"{checkpoint / 'config.json'} has {key}=")
    assert f", {says}" in message


@pytest.mark.parametrize("table", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize(("key", "value", "says"), [(k, *v) for k, v in BAD_ROPE.items()], ids=list(BAD_ROPE))
def test_a_rope_field_out_of_bounds_is_one_line_naming_it(
    checkpoint: Path, table: str, key: str, value: Any, says: str
) -> None:
    config = config_of(checkpoint)
    config.pop("rope_parameters", None)
    with_config(checkpoint, config, **{table: {**LLAMA3_ROPE, key: value}})
    message = refusal(checkpoint)
    assert message.startswith(f"{checkpoint / 'config.json'} has {table}.{key}=")
    assert f", {says}" in message


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        (
            {"num_attention_heads": 3, "num_key_value_heads": 1},
            "has hidden_size=64, not a multiple of the number of attention heads (3)",
        ),
        (
            {"hidden_size": 8192, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": None},
            "heads of 8192 values, more than the 4096 an engine holds",
        ),
        (
            {"num_key_value_heads": 3},
            "has num_attention_heads=4, not a multiple of num_key_value_heads=3",
        ),
        (
            {"rope_parameters": {**LLAMA3_ROPE, "low_freq_factor": 4.0}},
            "has rope_parameters.high_freq_factor=4.0, not more than rope_parameters.low_freq_factor=4.0",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 8,
                    "long_factor": [1.0] * 3,
                    "original_max_position_embeddings": 128,
                }
            },
            "has rope_parameters.long_factor of 3 values, not head_dim * partial_rotary_factor / 2 = 8",
        ),
    ],
    ids=["heads-divide-hidden", "head-dim-fits", "kv-heads-divide-heads", "llama3-freqs", "longrope"],
)
def test_fields_that_do_not_fit_together_are_one_line(checkpoint: Path, changes: dict, says: str) -> None:
    with_config(checkpoint, config_of(checkpoint), **changes)
    message = refusal(checkpoint)
    assert message.startswith(f"{checkpoint / 'config.json'} has ") and says in message


def test_longrope_is_accepted_and_a_longrope_per_layer_type_is_refused_in_one_line(checkpoint: Path) -> None:
    """The export switches the model's one longrope table in the graph (test_phi3.py checks it
    against transformers); a table per layer type (Gemma 3's layout) it does not switch yet."""
    from pipeline.source_config import rope_refused

    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    with_config(checkpoint, config_of(checkpoint), rope_parameters=rope)
    assert check_hf_llama(checkpoint)["architecture"] == "LlamaForCausalLM"
    per_type = {"sliding_attention": {"rope_type": "default"}, "full_attention": rope}
    assert rope_refused({"rope_parameters": per_type}) == (
        "rope_parameters.full_attention.rope_type='longrope': this build does not export longrope RoPE "
        "per layer type yet (its factors switch on the sequence length); use a checkpoint without it"
    )


def test_a_generation_config_token_id_outside_the_vocabulary_is_one_line(checkpoint: Path) -> None:
    """The export reads generation_config.json's eos_token_id before config.json's."""
    path = checkpoint / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": 10**12}))
    message = refusal(checkpoint)
    assert message.startswith(f"{path} has eos_token_id=1000000000000, not a token id or a list")


# --------------------------------------------------------------------------------------------
# Many shapes of bad values (hypothesis): what the table says is out of bounds is refused


def _junk(nullable: bool) -> st.SearchStrategy[Any]:
    """Values of no field's type: strings, lists, objects (keys too short to ask for remote code)."""
    junk = st.one_of(
        st.text(max_size=8),
        st.lists(st.integers(), max_size=2),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    )
    return junk if nullable else junk | st.none()


def _floats_outside(rule: Number) -> st.SearchStrategy[float]:
    outside: st.SearchStrategy[float] = st.sampled_from([math.nan, math.inf, -math.inf])
    low, high = rule.low, rule.high
    if low is not None:
        below = st.floats(max_value=low, allow_nan=False)
        outside |= below.filter(lambda v: v != low) if rule.closed_low else below
    if high is not None:
        above = st.floats(min_value=high, allow_nan=False)
        outside |= above.filter(lambda v: v != high) if rule.closed_high else above
    return outside


def bad_values(rule: Any, vocab: int = VOCAB, layers: int = 2) -> st.SearchStrategy[Any]:
    """Values ``rule`` refuses, of every shape: out of range, of the wrong type, nested."""
    junk = _junk(rule.nullable)
    if isinstance(rule, Integer):
        return (
            junk
            | st.booleans()
            | st.floats()
            | st.integers(max_value=rule.low - 1, min_value=-(2**70))
            | st.integers(min_value=rule.high + 1, max_value=2**70)
        )
    if isinstance(rule, Number):
        return junk | st.booleans() | _floats_outside(rule) | st.just(10**400)
    if isinstance(rule, Flag):
        return junk | st.integers() | st.floats()
    if isinstance(rule, Choice):
        names = rule.names() if callable(rule.names) else rule.names
        return st.integers() | st.booleans() | _junk(rule.nullable).filter(lambda v: v not in names)
    if isinstance(rule, TokenId):
        bad_id = (
            st.integers(min_value=vocab, max_value=2**70)
            | st.integers(max_value=-1, min_value=-(2**70))
            | st.booleans()
            | st.floats()
            | st.text(max_size=4)
        )
        if rule.many:  # a list with one bad id among good ones
            good = st.lists(st.integers(0, vocab - 1), max_size=3)
            return bad_id | st.tuples(good, bad_id, good).map(lambda t: [*t[0], t[1], *t[2]])
        return bad_id | st.lists(st.integers(0, vocab - 1), min_size=1, max_size=2)
    if isinstance(rule, LayerTypes):
        names = st.sampled_from(rule.names)
        wrong_length = st.lists(names, max_size=5).filter(lambda v: len(v) != layers)
        return (
            junk.filter(lambda v: not isinstance(v, list))
            | wrong_length
            | st.lists(st.text(max_size=4), min_size=layers, max_size=layers)
        )
    if isinstance(rule, Table):
        return st.text(max_size=8) | st.integers() | st.booleans() | st.lists(st.integers(), max_size=2)
    if isinstance(rule, NumberList):
        return st.text(max_size=4) | st.lists(
            st.one_of(st.text(max_size=2), st.just(0.0)), min_size=1, max_size=3
        )
    raise AssertionError(f"no bad values for {rule!r}")


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), key=st.sampled_from(sorted(LLAMA.fields)))
def test_any_bad_value_of_any_field_is_one_line_naming_it(
    tiny_llama: Path, shared_checkpoint: Path, data: Any, key: str
) -> None:
    base = config_of(tiny_llama)
    value = data.draw(bad_values(LLAMA.fields[key]), label=key)
    with_config(shared_checkpoint, base, **{key: value})
    try:
        message = refusal(shared_checkpoint)
    finally:
        with_config(shared_checkpoint, base)
    assert message.startswith(f"{shared_checkpoint / 'config.json'} has {key}=")


@settings(max_examples=50, deadline=None)
@given(data=st.data(), key=st.sampled_from(sorted(ROPE.fields)))
def test_any_bad_value_of_any_rope_field_is_one_line_naming_it(tiny_llama: Path, data: Any, key: str) -> None:
    value = data.draw(bad_values(ROPE.fields[key]), label=key)
    config = {**config_of(tiny_llama), "rope_scaling": {**LLAMA3_ROPE, key: value}}
    with pytest.raises(SourceError) as error:
        check_config(config, "x/config.json")
    assert str(error.value).startswith(f"x/config.json has rope_scaling.{key}=")
    assert "\n" not in str(error.value)


# In bounds: each field alone at any value its rule allows passes (none is stricter than it says).
GOOD = {
    "vocab_size": st.integers(3, 2**24),  # above the tiny model's token ids 0..2
    "intermediate_size": st.integers(1, 1 << 20),
    "max_position_embeddings": st.integers(1, 2**24),
    "bos_token_id": st.none() | st.integers(0, VOCAB - 1),
    "pad_token_id": st.none() | st.integers(0, VOCAB - 1),
    "eos_token_id": st.none() | st.integers(0, VOCAB - 1) | st.lists(st.integers(0, VOCAB - 1), max_size=4),
    "rms_norm_eps": st.floats(min_value=0, max_value=1, exclude_min=True, exclude_max=True),
    "rope_theta": st.floats(min_value=0, exclude_min=True, allow_infinity=False) | st.integers(1, 10**9),
    "attention_dropout": st.none() | st.floats(0, 1),
    "initializer_range": st.floats(0, 1),
    "tie_word_embeddings": st.booleans(),
    "dtype": st.sampled_from(["float32", "bfloat16", "float16", "torch.bfloat16"]),
}


@settings(max_examples=50, deadline=None)
@given(data=st.data(), key=st.sampled_from(sorted(GOOD)))
def test_any_value_in_bounds_passes(tiny_llama: Path, data: Any, key: str) -> None:
    check_config({**config_of(tiny_llama), key: data.draw(GOOD[key], label=key)}, "x/config.json")


# --------------------------------------------------------------------------------------------
# Real checkpoints pass; the CLI refuses before any export; the GGUF path is checked too


LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
LLAMA_31_405B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 16384,
    "initializer_range": 0.02,
    "intermediate_size": 53248,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 128,
    "num_hidden_layers": 126,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": LLAMA3_SCALING,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
LLAMA_32_1B = {
    **LLAMA_31_405B,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "rope_scaling": {**LLAMA3_SCALING, "factor": 32.0},
    "tie_word_embeddings": True,
}
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "is_llama_config": True,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pad_token_id": None,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_interleaved": False,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 49152,
}


QWEN25_05B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}


@pytest.mark.parametrize(
    "config",
    [LLAMA_31_405B, LLAMA_32_1B, SMOLLM2_135M, QWEN25_05B_INSTRUCT, QWEN3_06B, MISTRAL_7B_V01],
    ids=["405b", "1b", "smollm2", "qwen2.5-0.5b", "qwen3-0.6b", "mistral-7b-v0.1"],
)
def test_real_checkpoint_configs_pass(config: dict[str, Any]) -> None:
    check_config(config, "config.json")


def test_the_tiny_checkpoint_passes(checkpoint: Path) -> None:
    assert check_hf_llama(checkpoint)["vocab_size"] == VOCAB


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("max_position_embeddings", "has max_position_embeddings=1000000000000, more than the 16777216"),
        ("bos_token_id", f"has bos_token_id=1000000000000, not a token id below vocab_size {VOCAB}"),
    ],
)
def test_the_cli_refuses_at_start_up_before_any_export(
    checkpoint: Path, tmp_path: Path, key: str, says: str
) -> None:
    """Today: the export runs, then the engine refuses, naming a staging folder gone by then."""
    with_config(checkpoint, config_of(checkpoint), **{key: 10**12})
    result = cli(
        tmp_path,
        f"model.path={checkpoint}",
        f"pipeline.models_dir={tmp_path / 'models'}",
        f"pipeline.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        "bench=none",
    )
    line = assert_one_error_line(result, 2, says)
    assert f"{checkpoint / 'config.json'} has {key}=" in line and line.endswith(FIX)
    written = [p for p in tmp_path.rglob("*") if p.is_file() and checkpoint not in p.parents]
    assert not [p for p in written if p.name in ("artifact.json", "engine.json") or p.suffix == ".onnx"]
    assert not [p for p in tmp_path.rglob("*") if "staging" in p.name]


def test_the_converted_bundled_model_is_checked_too(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GGUF -> HF conversion's folder goes through the same check as a model.path folder."""

    def convert(gguf_path: Path, out_dir: Path) -> None:
        shutil.copytree(tiny_llama, out_dir, dirs_exist_ok=True)
        with_config(out_dir, config_of(out_dir), max_position_embeddings=10**12)

    monkeypatch.setattr(pipeline.sources, "convert_gguf", convert)
    models = tmp_path / "models"
    make_wheel(models / "downloads")
    with pytest.raises(SourceError) as error:
        resolve_source(BUNDLED, models)
    converted = converted_folder(models)
    assert str(error.value).startswith(f"{converted / 'config.json'} has max_position_embeddings=")
