"""Export pass on a tiny random Llama: GenAI IO names, dynamic axes, external data, parity, the
weightless trace (the same graph as an export of the loaded model), shards, no stray files."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import passes.export
from passes.export import (
    DATA_FILE,
    MODEL_FILE,
    Attention,
    Checkpoint,
    ExportPass,
    check_parity,
    name_linear_weights,
    placeholder_model,
)
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.errors import PassError
from pipeline.core.graph_io import load_proto
from tests.conftest import make_tiny_llama


def test_graph_has_genai_io_and_dynamic_axes(tiny_graph: Artifact) -> None:
    model = onnx.load(str(tiny_graph.path / MODEL_FILE), load_external_data=False)
    inputs = {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input
    }
    outputs = {
        o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output
    }
    assert inputs["input_ids"] == ["batch_size", "sequence_length"]
    assert inputs["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert inputs["position_ids"] == ["batch_size", "sequence_length"]
    assert inputs["past_key_values.1.value"] == ["batch_size", 2, "past_sequence_length", 16]
    assert outputs["logits"][:2] == ["batch_size", "sequence_length"]
    assert outputs["present.0.key"] == ["batch_size", 2, "total_sequence_length", 16]
    assert len(inputs) == 3 + 2 * 2 and len(outputs) == 1 + 2 * 2


def test_weights_live_in_external_data(tiny_graph: Artifact, tmp_path: Path) -> None:
    assert (tiny_graph.path / DATA_FILE).stat().st_size > 100_000
    assert (tiny_graph.path / MODEL_FILE).stat().st_size < 200_000
    # A copy: the checker refuses data files with several hard links (tiny_engine links them).
    copy = Path(shutil.copytree(tiny_graph.path, tmp_path / "graph"))
    onnx.checker.check_model(str(copy / MODEL_FILE), full_check=True)


def test_metadata_and_tokenizer_travel_with_the_graph(tiny_graph: Artifact) -> None:
    meta = tiny_graph.metadata
    assert meta["io"] == {
        "num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 320,
        "kv_dtype": "float32", "has_position_ids": True,
        "left_padding": True, "kv_layout": "concat", "window": 0, "kv_capacity": [],
    }  # fmt: skip
    assert meta["tokens"]["eos_token_ids"] == [2]
    assert meta["tokens"]["pad_token_id"] == 0
    assert (tiny_graph.path / "tokenizer.json").is_file()


def test_ensures_records_parity(tiny_source: Artifact, tiny_graph: Artifact) -> None:
    metrics = ExportPass().ensures(tiny_source, tiny_graph)
    parity = metrics["parity"]
    assert parity["top1_agreement"] == 1.0
    assert parity["max_abs_diff"] < 1e-3
    assert parity["tokens"] > 5


def test_ensures_fails_on_a_wrong_graph(tiny_source: Artifact, tiny_graph: Artifact, tmp_path: Path) -> None:
    broken_dir = Path(shutil.copytree(tiny_graph.path, tmp_path / "broken"))
    model = onnx.load(str(broken_dir / MODEL_FILE))
    # Scramble the largest weight (the embedding / lm_head): logits become unrelated to torch's.
    largest = max(model.graph.initializer, key=lambda t: np.prod(t.dims))
    rng = np.random.default_rng(0)
    largest.CopyFrom(
        numpy_helper.from_array(rng.standard_normal(tuple(largest.dims)).astype(np.float32), largest.name)
    )
    (broken_dir / DATA_FILE).unlink()
    onnx.save_model(model, str(broken_dir / MODEL_FILE), save_as_external_data=True, location=DATA_FILE)
    assert check_parity(tiny_source.path, broken_dir, "The quick brown fox")["top1_agreement"] < 0.99
    with pytest.raises(PassError, match="export: ONNX Runtime agrees with torch on"):
        ExportPass().ensures(tiny_source, Artifact.from_dir(Kind.GRAPH, broken_dir))


def test_opset_is_configurable(tiny_source: Artifact, tmp_path: Path) -> None:
    ExportPass(opset=18).run(tiny_source, tmp_path)
    model = onnx.load(str(tmp_path / MODEL_FILE), load_external_data=False)
    assert {o.domain: o.version for o in model.opset_import}[""] == 18


def test_export_is_deterministic(tiny_source: Artifact, tiny_graph: Artifact, tmp_path: Path) -> None:
    # Later passes are keyed by this output's digest: re-exporting must not change it.
    ExportPass().run(tiny_source, tmp_path)
    assert Artifact.from_dir(Kind.GRAPH, tmp_path).digest == tiny_graph.digest


def test_sdpa_attention_exports_with_parity(tiny_source: Artifact, tmp_path: Path) -> None:
    export = ExportPass(attention="sdpa")
    export.run(tiny_source, tmp_path)
    graph = onnx.load(str(tmp_path / MODEL_FILE), load_external_data=False)
    assert "IsNaN" in {node.op_type for node in graph.graph.node}  # SDPA's decomposition, not eager's
    assert (
        export.ensures(tiny_source, Artifact.from_dir(Kind.GRAPH, tmp_path))["parity"]["top1_agreement"]
        == 1.0
    )


def test_eager_attention_is_the_default(tiny_graph: Artifact) -> None:
    graph = onnx.load(str(tiny_graph.path / MODEL_FILE), load_external_data=False)
    assert "IsNaN" not in {node.op_type for node in graph.graph.node}


def test_linear_weights_are_named_after_their_modules(tiny_llama: Path, tiny_graph: Artifact) -> None:
    from safetensors.numpy import load_file

    weights = load_file(str(tiny_llama / "model.safetensors"))
    graph = load_proto(tiny_graph.path)  # tiny_engine hard-links its data: onnx.load refuses that
    initializers = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer}
    linear = tiny_graph.metadata["linear_weights"]
    assert len(linear) == 2 * 7 + 1  # q k v o gate up down per layer, and lm_head
    for module, name in linear.items():
        torch_name = "model.embed_tokens.weight" if module == "lm_head" else f"{module}.weight"  # tied
        np.testing.assert_array_equal(initializers[name], weights[torch_name].T)


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"opset": 5}, "export.opset=5: choose an opset from 18 to 23"),
        ({"opset": 24}, "export.opset=24: choose an opset from 18 to 23"),
        ({"min_top1_agreement": 1.5}, "export.min_top1_agreement=1.5: must be from 0 to 1"),
    ],
)
def test_settings_out_of_range_are_refused_when_built(settings: dict, needle: str) -> None:
    with pytest.raises(PassError, match=needle.replace(".", r"\.")):
        ExportPass(**settings)


def export_of_the_loaded_model(folder: Path) -> onnx.ModelProto:
    """What the export wrote before its weightless trace: torch's exporter on the model loaded with
    its weights (``export_params=True``), linear weights renamed the same way."""
    import onnx_ir as ir

    from pipeline.core.torch_model import load_causal_lm

    model = load_causal_lm(folder, attn_implementation=Attention.eager.value)
    proto, _ = ExportPass()._export(model, export_params=True)
    graph = ir.serde.deserialize_model(proto)
    name_linear_weights(graph.graph)
    return ir.serde.serialize_model(graph)


def assert_same_graph(reference: onnx.ModelProto, folder: Path) -> None:
    candidate = load_proto(folder)  # the folder may be hard-linked (tiny_engine links tiny_graph)
    assert list(candidate.graph.node) == list(reference.graph.node)  # ops, names, inputs, attributes
    assert list(candidate.graph.input) == list(reference.graph.input)
    assert list(candidate.graph.output) == list(reference.graph.output)
    assert [t.name for t in candidate.graph.initializer] == [t.name for t in reference.graph.initializer]
    for mine, theirs in zip(candidate.graph.initializer, reference.graph.initializer, strict=True):
        a, b = numpy_helper.to_array(mine), numpy_helper.to_array(theirs)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), mine.name


def test_weightless_trace_gives_the_graph_of_the_loaded_model(tiny_llama: Path, tiny_graph: Artifact) -> None:
    # The tiny model's RMSNorm weights are all ones: the exporter keeps one initializer for them.
    assert_same_graph(export_of_the_loaded_model(tiny_llama), tiny_graph.path)
    norms = [n for n in tiny_graph.metadata["linear_weights"].values() if "norm" in n]
    assert not norms


def test_weightless_trace_with_equal_weights_an_untied_head_and_a_sharded_checkpoint(tmp_path: Path) -> None:
    """Equal weights are deduplicated by value (the placeholders must be equal exactly where the
    checkpoint's tensors are), an untied lm_head has its own tensor, a sharded checkpoint reads."""
    import torch
    from transformers import LlamaForCausalLM

    source = make_tiny_llama(tmp_path / "src", seed=3, tie_word_embeddings=False)
    model = LlamaForCausalLM.from_pretrained(source)
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight.copy_(model.model.layers[0].self_attn.q_proj.weight)
        model.model.layers[1].post_attention_layernorm.weight.fill_(0.5)
    (source / "model.safetensors").unlink()
    model.save_pretrained(source, max_shard_size="100KB")
    assert (source / "model.safetensors.index.json").is_file()
    out = tmp_path / "graph"
    out.mkdir()
    ExportPass().run(Artifact.from_dir(Kind.TORCH, source), out)
    assert_same_graph(export_of_the_loaded_model(source), out)
    graph = onnx.load(str(out / MODEL_FILE), load_external_data=False)
    names = {t.name for t in graph.graph.initializer}
    # Norm weights: all ones but one layer's 0.5s: two initializers (ones deduplicated), the same
    # that the exporter makes of the real weights.
    assert sorted(n for n in names if "norm" in n) == [
        "model.model.layers.0.input_layernorm.weight",
        "model.model.layers.1.post_attention_layernorm.weight",
    ]
    assert "lm_head.weight_t" in names
    result = ExportPass().ensures(Artifact.from_dir(Kind.TORCH, source), Artifact.from_dir(Kind.GRAPH, out))
    assert result["parity"]["top1_agreement"] == 1.0


def test_the_traced_skeleton_holds_no_weights(tiny_llama: Path) -> None:
    skeleton = placeholder_model(tiny_llama, Checkpoint(tiny_llama), "eager")
    parameters = list(skeleton.parameters())
    assert len(parameters) == 2 * 9 + 2  # tied lm_head: one parameter with the embedding
    for parameter in parameters:
        assert parameter.untyped_storage().nbytes() == 4 and set(parameter.stride()) == {0}
    norms = {float(skeleton.model.layers[i].input_layernorm.weight[0]) for i in range(2)}
    assert len(norms) == 1  # equal checkpoint tensors (all ones): equal placeholders
    assert skeleton.model.rotary_emb.inv_freq.device.type == "cpu"  # real frequencies


def test_external_data_is_written_in_shards(
    tiny_source: Artifact, tiny_graph: Artifact, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(passes.export, "SHARD_BYTES", 100_000)
    export = ExportPass()
    metrics = export.run(tiny_source, tmp_path)
    shards = sorted(p.name for p in tmp_path.glob("*.data"))
    assert len(shards) > 3 and shards == metrics["data_files"] and not (tmp_path / DATA_FILE).exists()
    embedding = 320 * 64 * 4  # the largest tensor gets a shard of its own
    assert all((tmp_path / s).stat().st_size <= max(100_000, embedding) for s in shards)
    reference = load_proto(tiny_graph.path)
    assert_same_graph(reference, tmp_path)
    parity = export.ensures(tiny_source, Artifact.from_dir(Kind.GRAPH, tmp_path))["parity"]
    assert parity["top1_agreement"] == 1.0


@pytest.mark.parametrize("planted", ["onnx__MatMul_662", "model.onnx.data.old", "model-00002-of-00002.data"])
def test_ensures_refuses_an_unreferenced_file(
    tiny_source: Artifact, tiny_graph: Artifact, tmp_path: Path, planted: str
) -> None:
    folder = Path(shutil.copytree(tiny_graph.path, tmp_path / "graph"))
    (folder / planted).write_bytes(b"\0" * 4096)  # what the exporter left beside the data before
    with pytest.raises(PassError) as error:
        ExportPass().ensures(tiny_source, Artifact.from_dir(Kind.GRAPH, folder))
    assert planted in str(error.value) and "\n" not in str(error.value)


def test_export_output_holds_only_referenced_files(tiny_graph: Artifact) -> None:
    assert passes.export.unreferenced_files(tiny_graph.path) == []
    assert passes.export.external_files(tiny_graph.path / MODEL_FILE) == {DATA_FILE}


# --------------------------------------------------------------------------------------------
# A full disk (or the file size limit) while the data is written: the path and what was written


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 100 KiB tmpfs: a real ENOSPC partway through the tiny model's data (needs root and
    mount; skipped elsewhere)."""
    from tests.untrusted import tmpfs

    with tmpfs(tmp_path / "disk", "100k") as mount:
        yield mount


def test_a_full_disk_during_the_data_write_names_the_file(tiny_graph: Artifact, small_disk: Path) -> None:
    from pipeline.core.errors import describe_os_error
    from pipeline.core.graph_io import load_graph, save_graph

    out = small_disk / "graph"
    out.mkdir()
    model = load_graph(tiny_graph.path)
    with pytest.raises(OSError) as error:
        save_graph(model, out, source_dirs=[])  # every tensor written anew
    line = describe_os_error(error.value)
    assert line.startswith(f"cannot write {out / DATA_FILE}: No space left on device (disk full"), line
    assert "(writing the external data of model.onnx: " in line and "OSError" not in line, line


def test_a_full_cache_disk_fails_the_export_in_one_line_and_keeps_nothing(
    tiny_source: Artifact, small_disk: Path
) -> None:
    from pipeline.core.errors import StorageError
    from tests.conftest import run_pass

    with pytest.raises(StorageError) as error:
        run_pass(ExportPass(), tiny_source, small_disk / "cache")
    message = str(error.value)
    assert "No space left on device" in message and "OSError" not in message and "\n" not in message
    assert "model.onnx.data" in message and "writing the external data" in message, message
    assert error.value.exit_code == 1
    assert [p.name for p in (small_disk / "cache").iterdir()] == [".staging"]
    assert list((small_disk / "cache" / ".staging").iterdir()) == []


FSIZE_CHILD = """
import resource, sys
from pathlib import Path
from pipeline.core.errors import describe_os_error
from pipeline.core.graph_io import load_graph, save_graph
resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))
try:
    save_graph(load_graph(Path(sys.argv[1])), Path(sys.argv[2]), source_dirs=[])
except OSError as exc:
    print(describe_os_error(exc))
"""


def test_the_file_size_limit_during_the_data_write_names_the_file(
    tiny_graph: Artifact, tmp_path: Path
) -> None:
    """``ulimit -f``: a real EFBIG in a child process (the limit is the child's alone)."""
    import subprocess
    import sys

    out = tmp_path / "graph"
    out.mkdir()
    command = [sys.executable, "-c", FSIZE_CHILD, str(tiny_graph.path), str(out)]
    line = (
        subprocess.run(command, capture_output=True, text=True, timeout=300).stdout.strip().splitlines()[-1]
    )
    assert line.startswith(f"cannot write {out / DATA_FILE}: File too large (the file size limit"), line
    assert "writing the external data of model.onnx" in line, line
