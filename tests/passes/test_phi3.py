"""Phi-3 (issue 52, step 2): a Mistral block with q/k/v packed in ``qkv_proj`` and gate/up in
``gate_up_proj``, split at import (``pipeline/phi3.py``). On a tiny random checkpoint of Phi-3's
config layout (built with transformers' own ``Phi3ForCausalLM``; window 64): the source converts
once into Mistral's layout, which transformers' Mistral computes exactly as its Phi-3 does; the
export and the fused engine (q/k/v and gate/up packed again, each GroupQueryAttention given the
window) match transformers' Phi-3 forward over 2048 positions, and the fused decode its prefill
past the window; every quantized recipe builds end to end; what Mistral's block cannot compute
(a partial rotary) is refused in one line naming the field. longrope (Phi-3.5-mini, Phi-3-128k)
switches its factors with the length in the exported graph as transformers does: exact on both
sides of the switch and in a decode across it; fused, each rotary reads the long rows of a
switched cos/sin table past the switch, before the attention kernel."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import ModelConfig
from pipeline.core.artifacts import Artifact
from pipeline.core.errors import SourceError
from pipeline.core.families import MISTRAL, family_of
from pipeline.core.graph_io import MODEL_FILE, graph_layer_windows
from pipeline.sources import resolve_source
from tests.families import (
    PARITY_POSITIONS,
    QUANT_RECIPES,
    assert_built,
    build,
    make_tiny,
    onnx_decode,
    onnx_prefill,
    random_ids,
    relative_error,
    transformers_logits,
)

TOLERANCE = 1e-4  # of the logit range (issue 51)
WINDOW = 64
STEPS = 24  # decoded one by one after a prefill of 2048 - STEPS positions


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Phi-3 checkpoint, as transformers saves one."""
    return make_tiny("phi3", tmp_path_factory.mktemp("tiny-phi3"), sliding_window=WINDOW)


@pytest.fixture(scope="module")
def source(phi3: Path, tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    """The pipeline's source of it: converted once to Mistral's layout under models_dir."""
    return resolve_source(ModelConfig(name="phi3", path=str(phi3)), tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def checkpoint(source: Artifact) -> Path:
    return source.path


@pytest.fixture(scope="module")
def reference(phi3: Path) -> np.ndarray:
    """transformers' Phi-3 forward of the original checkpoint: what every engine must match."""
    return transformers_logits(phi3, random_ids())


def test_a_phi3_source_is_converted_once_into_mistral_layout(
    phi3: Path, source: Artifact, tmp_path: Path
) -> None:
    config = json.loads((source.path / "config.json").read_text())
    assert family_of(config) is MISTRAL and config["head_dim"] == 16 and config["sliding_window"] == WINDOW
    assert source.metadata["origin"] == {"kind": "local", "path": str(phi3), "converted_from": "phi3"}
    assert source.metadata["architecture"] == "MistralForCausalLM"
    ids = random_ids(256)
    assert relative_error(transformers_logits(source.path, ids), transformers_logits(phi3, ids)) <= 1e-6
    again = resolve_source(ModelConfig(name="phi3", path=str(phi3)), source.path.parent)
    assert (again.path, again.digest) == (source.path, source.digest)  # converted once


def test_a_sharded_phi3_checkpoint_converts_shard_by_shard(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    phi3 = make_tiny("phi3", tmp_path / "one", seed=1)
    model = AutoModelForCausalLM.from_pretrained(phi3, dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "sharded" / name).write_bytes((phi3 / name).read_bytes())
    converted = resolve_source(ModelConfig(name="s", path=str(tmp_path / "sharded")), tmp_path / "models")
    index = json.loads((converted.path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and "model.layers.1.self_attn.k_proj.weight" in index
    assert not [name for name in index if "qkv_proj" in name or "gate_up_proj" in name]
    ids = random_ids(128)
    assert relative_error(transformers_logits(converted.path, ids), transformers_logits(phi3, ids)) <= 1e-6


def test_an_interrupted_conversion_leaves_nothing_and_the_next_run_converts(
    phi3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (or SIGTERM, which the entry point turns into KeyboardInterrupt) mid-conversion."""
    import pipeline.sources

    models, seen = tmp_path / "models", []
    convert = pipeline.sources.convert_phi3

    def half_written_then_interrupted(folder: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        seen.append(out_dir)
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.sources, "convert_phi3", half_written_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_source(ModelConfig(name="phi3", path=str(phi3)), models)
    assert (
        seen
        and not seen[0].exists()
        and not [p.name for p in models.iterdir() if not p.name.endswith(".lock")]
    )
    monkeypatch.setattr(pipeline.sources, "convert_phi3", convert)
    source = resolve_source(ModelConfig(name="phi3", path=str(phi3)), models)
    assert source.metadata["origin"]["converted_from"] == "phi3" and (source.path / "source.json").is_file()


def copy_with_config(checkpoint: Path, folder: Path, **changes: object) -> Path:
    """A copy of ``checkpoint`` in ``folder`` whose config.json has ``changes``."""
    folder.mkdir()
    for item in checkpoint.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = {**json.loads((checkpoint / "config.json").read_text()), **changes}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_hub_configs_auto_map_is_never_run_and_is_dropped(phi3: Path, tmp_path: Path) -> None:
    """Phi-3's hub configs keep an ``auto_map`` from before transformers had its classes."""
    auto_map = {"AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"}
    folder = copy_with_config(phi3, tmp_path / "hub", auto_map=auto_map)
    converted = resolve_source(ModelConfig(name="hub", path=str(folder)), tmp_path / "models")
    assert "auto_map" not in json.loads((converted.path / "config.json").read_text())


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (
            {"partial_rotary_factor": 0.75},
            "partial_rotary_factor=0.75: this build rotates whole heads only (a partial rotary is not "
            "implemented); use a checkpoint whose factor is 1.0",
        ),
    ],
    ids=["partial-rotary"],
)
def test_what_mistrals_block_cannot_compute_is_refused_in_one_line(
    phi3: Path, tmp_path: Path, change: dict, says: str
) -> None:
    folder = copy_with_config(phi3, tmp_path / "odd", **change)
    with pytest.raises(SourceError) as error:
        resolve_source(ModelConfig(name="odd", path=str(folder)), tmp_path / "models")
    message = str(error.value)
    assert "\n" not in message and str(folder) in message
    assert says in message
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").iterdir())


def test_a_pass_given_the_phi3_layout_itself_says_how_to_build_it() -> None:
    with pytest.raises(SourceError, match=r"give its folder as model\.path"):
        family_of({"model_type": "phi3"})


def test_the_export_matches_transformers_phi3_over_2048_positions(
    graph: Artifact, reference: np.ndarray
) -> None:
    assert relative_error(onnx_prefill(graph.path, random_ids()), reference) <= TOLERANCE


def test_the_fused_engine_packs_qkv_again_and_matches_transformers_phi3(
    fused: tuple[Artifact, dict], reference: np.ndarray
) -> None:
    artifact, metrics = fused
    rewrites = metrics["rewrites"]
    assert rewrites["group_query_attention"] == 2 and metrics["warnings"] == []
    assert rewrites["packed_qkv"] == 2, rewrites
    assert graph_layer_windows(artifact.path / MODEL_FILE) == {0: WINDOW, 1: WINDOW}
    assert relative_error(onnx_prefill(artifact.path, random_ids()), reference) <= TOLERANCE


def test_the_fused_decode_matches_its_prefill_past_the_window(
    fused: tuple[Artifact, dict], reference: np.ndarray
) -> None:
    decoded = onnx_decode(fused[0].path, random_ids(), PARITY_POSITIONS - STEPS)
    assert relative_error(decoded, reference[-STEPS:]) <= TOLERANCE


@pytest.mark.parametrize("recipe", list(QUANT_RECIPES.values()), ids=list(QUANT_RECIPES))
def test_every_quantized_recipe_builds_a_phi3_engine(
    checkpoint: Path, tmp_path: Path, recipe: list[str]
) -> None:
    engine, by_name = build(recipe, checkpoint, tmp_path)
    assert_built(engine, by_name)


def test_an_int4_engine_packs_gate_and_up_again_where_the_rule_is_listed(
    checkpoint: Path, tmp_path: Path
) -> None:
    """``packed_gate_up`` packs the int4 MatMulNBits of gate and up into one (off by default: it
    measured no faster on these CPUs, configs/fusion/ort.yaml)."""
    rules = "[rms_norm,skip_rms_norm,rotary_embedding,group_query_attention,packed_qkv,packed_gate_up]"
    engine, by_name = build(["quant=int4_awq", "fusion=ort", f"fusion.rules={rules}"], checkpoint, tmp_path)
    assert_built(engine, by_name, packed_qkv=2)
    assert by_name["fusion"]["rewrites"]["packed_gate_up"] == 2


LONGROPE_SWITCH = 256  # original_max_position_embeddings of the longrope checkpoint


@pytest.fixture(scope="module")
def longrope(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Artifact]:
    """A tiny Phi-3 with longrope factors of its own (random, short != long), switching at 256
    positions; and its source, converted."""
    rng = np.random.default_rng(0)
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": (1 + rng.random(8)).tolist(),
        "long_factor": (2 + 4 * rng.random(8)).tolist(),
    }
    folder = tmp_path_factory.mktemp("phi3-longrope")
    phi3 = make_tiny(
        "phi3", folder / "phi3", rope_parameters=rope, original_max_position_embeddings=LONGROPE_SWITCH
    )
    return phi3, resolve_source(ModelConfig(name="lr", path=str(phi3)), folder / "models")


def transformers_decode(folder: Path, ids: np.ndarray, prefill: int) -> np.ndarray:
    """transformers' logits of the positions after ``prefill``, one token at a time through its
    cache: each step picks its factors from its own position, as the engine must."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    logits = []
    with torch.no_grad():
        cache = model.eval()(torch.from_numpy(ids[:, :prefill]), use_cache=True).past_key_values
        for position in range(prefill, ids.shape[1]):
            out = model(
                torch.from_numpy(ids[:, position : position + 1]),
                past_key_values=cache,
                position_ids=torch.tensor([[position]]),
                use_cache=True,
            )
            cache = out.past_key_values
            logits.append(out.logits[0, -1].numpy())
    return np.stack(logits)


def test_longrope_switches_its_factors_in_the_graph_as_transformers_does(
    longrope: tuple[Path, Artifact], tmp_path: Path
) -> None:
    from passes.export import ExportPass
    from passes.fusion.fuse import FusionPass
    from tests.conftest import run_pass

    phi3, source = longrope
    assert (
        json.loads((source.path / "config.json").read_text())["rope_parameters"][
            "original_max_position_embeddings"
        ]
        == LONGROPE_SWITCH
    )
    graph = run_pass(ExportPass(), source, tmp_path / "graph")[0]
    fused, metrics = run_pass(FusionPass(), graph, tmp_path / "fused")
    assert metrics["rewrites"]["rotary_embedding"] == 4 and metrics["rewrites"]["group_query_attention"] == 2
    assert metrics["warnings"] == [
        "fusion rule 'packed_qkv' skipped: longrope's rotary runs before the attention kernel, on q and k "
        "apart; its sites stay unfused"
    ]
    import onnx

    model = onnx.load(str(fused.path / MODEL_FILE), load_external_data=False)
    producers = {out: node.op_type for node in model.graph.node for out in node.output}
    presents = [o.name for o in model.graph.output if o.name.startswith("present.")]
    assert presents and {producers[name] for name in presents} == {"GroupQueryAttention"}
    assert sum(node.op_type == "RotaryEmbedding" for node in model.graph.node) == 4  # q, k of 2 layers
    short, long = random_ids(200), random_ids(512)  # below the switch (short factors), past it
    for ids in (short, long):
        reference = transformers_logits(phi3, ids)
        for folder in (graph.path, fused.path):
            assert relative_error(onnx_prefill(folder, ids), reference) <= TOLERANCE
    decoded = transformers_decode(phi3, long[:, :300], 240)  # 240 .. 299: across 256
    assert relative_error(onnx_decode(fused.path, long[:, :300], 240), decoded) <= TOLERANCE


def test_a_longrope_phi3_builds_quantized_engines(longrope: tuple[Path, Artifact], tmp_path: Path) -> None:
    for recipe in (QUANT_RECIPES["int4_awq"], QUANT_RECIPES["int8"], QUANT_RECIPES["int8-kv"]):
        engine, by_name = build(recipe, longrope[1].path, tmp_path / recipe[0])
        assert engine.kind.value == "engine"
        for metrics in by_name.values():
            if "parity" in metrics:
                assert metrics["parity"]["top1_agreement"] >= 0.8, metrics
