"""An engine's tokenizer and graph agree on the vocabulary (issue 50 item 8): ``read_engine_spec``
refuses, in one line, a tokenizer whose token ids reach past ``io.vocab_size`` (ONNX Runtime's
``Gather`` would fail at the first generation) or are not non-negative integers, and a graph whose
logits or embedding table declare another vocabulary than ``io.vocab_size``; before ``bench`` or
the registry load or publish anything. A tokenizer smaller than the vocabulary (a padded
embedding table) is normal. Real engine folders (the tiny engine, and one built from a padded
checkpoint), real files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline.core.artifacts import Artifact, Kind, write_json
from pipeline.core.engine import ENGINE_FILE, read_engine_spec
from pipeline.core.errors import EngineError
from pipeline.manifest import engine_files
from tests.conftest import make_tiny_llama, run_pass
from tests.untrusted import deadline

VOCAB = 320  # the tiny engine's io.vocab_size, and its tokenizer's size (ids 0..319)


@pytest.fixture
def engine(tiny_engine: Artifact, tmp_path: Path) -> Path:
    """A copy of the tiny engine (its files copied, so edits never reach the cache entry)."""
    folder = tmp_path / "engine"
    shutil.copytree(tiny_engine.path, folder)
    return folder


@pytest.fixture(scope="module")
def padded_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ort-cpu engine of a checkpoint whose embedding table (384 rows) is larger than its
    tokenizer (320 tokens): built by the real export and build passes."""
    from passes.export import ExportPass
    from passes.ort_build import OrtCpuBuildPass

    source = make_tiny_llama(tmp_path_factory.mktemp("padded-llama"), vocab_size=384)
    graph = run_pass(ExportPass(), Artifact.from_dir(Kind.TORCH, source), tmp_path_factory.mktemp("g"))[0]
    return run_pass(OrtCpuBuildPass(), graph, tmp_path_factory.mktemp("e"))[0].path


def edit_json(path: Path, change: Callable[[Any], Any]) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    change(data)
    path.write_text(json.dumps(data))


def refusal(folder: Path) -> str:
    """The one-line EngineError ``read_engine_spec`` gives for ``folder``."""
    with deadline(60), pytest.raises(EngineError) as info:
        read_engine_spec(folder)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def _added(token_id: Any, content: str = "<|x|>") -> Callable[[Any], None]:
    def change(data: Any) -> None:
        data["added_tokens"].append(
            {"id": token_id, "content": content, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
        )  # fmt: skip

    return change


# -- the tokenizer's ids against io.vocab_size -------------------------------------------------


def test_the_tiny_engine_whose_tokenizer_fills_the_vocabulary_reads(engine: Path) -> None:
    tokenizer = json.loads((engine / "tokenizer.json").read_text())
    assert max(tokenizer["model"]["vocab"].values()) == VOCAB - 1  # exactly full: still fine
    assert read_engine_spec(engine).io.vocab_size == VOCAB


def test_a_tokenizer_smaller_than_a_padded_vocabulary_reads(padded_engine: Path, tmp_path: Path) -> None:
    spec = read_engine_spec(padded_engine)
    tokenizer = json.loads((padded_engine / "tokenizer.json").read_text())
    assert spec.io.vocab_size == 384 and max(tokenizer["model"]["vocab"].values()) == VOCAB - 1
    folder = tmp_path / "engine"  # added tokens up to the last row of the table are fine too
    shutil.copytree(padded_engine, folder)
    edit_json(folder / "tokenizer.json", _added(383))
    edit_json(folder / "added_tokens.json", lambda d: d.update({"<|x|>": 383}))
    edit_json(
        folder / "tokenizer_config.json",
        lambda d: d.update(
            added_tokens_decoder={"0": {"content": "<|endoftext|>"}, "383": {"content": "<|x|>"}}
        ),
    )
    assert read_engine_spec(folder).io.vocab_size == 384


def test_an_added_token_past_the_vocabulary_is_refused(engine: Path) -> None:
    edit_json(engine / "tokenizer.json", _added(VOCAB + 8))
    message = refusal(engine)
    assert f"{engine / 'tokenizer.json'}: token id {VOCAB + 8} ('<|x|>')" in message, message
    assert f"past the graph's vocabulary of {VOCAB} (io.vocab_size in engine.json)" in message
    assert message.endswith("the tokenizer is not this engine's; rebuild the engine"), message


def test_a_bpe_vocabulary_id_past_the_vocabulary_is_refused(engine: Path) -> None:
    edit_json(engine / "tokenizer.json", lambda d: d["model"]["vocab"].update({"zzz": VOCAB}))
    message = refusal(engine)
    assert f"token id {VOCAB} ('zzz') is past the graph's vocabulary of {VOCAB}" in message, message


def test_a_unigram_vocabulary_longer_than_the_graph_is_refused(engine: Path) -> None:
    pieces = [[f"piece{i}", -1.0] for i in range(VOCAB + 1)]
    edit_json(engine / "tokenizer.json", lambda d: d.update(model={"type": "Unigram", "vocab": pieces}))
    assert f"token id {VOCAB} ('piece{VOCAB}')" in refusal(engine)


def test_an_added_tokens_decoder_id_past_the_vocabulary_is_refused(engine: Path) -> None:
    edit_json(
        engine / "tokenizer_config.json",
        lambda d: d.update(
            added_tokens_decoder={"0": {"content": "<|endoftext|>"}, "400": {"content": "<|y|>"}}
        ),
    )
    message = refusal(engine)
    assert f"{engine / 'tokenizer_config.json'}: token id 400 ('<|y|>')" in message, message


def test_an_added_tokens_json_id_past_the_vocabulary_is_refused(engine: Path) -> None:
    edit_json(engine / "added_tokens.json", lambda d: d.update({"<|z|>": 1000}))
    assert f"{engine / 'added_tokens.json'}: token id 1000 ('<|z|>')" in refusal(engine)


def test_a_special_token_past_the_vocabulary_is_named_by_its_role(engine: Path) -> None:
    def move_eos(data: Any) -> None:
        entry = next(e for e in data["added_tokens"] if e["content"] == "<|im_end|>")
        entry["id"] = data["model"]["vocab"]["<|im_end|>"] = VOCAB + 1

    edit_json(engine / "tokenizer.json", move_eos)
    message = refusal(engine)
    assert f"token id {VOCAB + 1} ('<|im_end|>', the eos_token in tokenizer_config.json)" in message, message


def test_a_special_token_no_file_gives_an_id_must_fit_where_transformers_adds_it(
    engine: Path, padded_engine: Path, tmp_path: Path
) -> None:
    """transformers adds a special token the vocabulary lacks after the largest id: the tiny
    engine's tokenizer fills its 320 rows, so a new pad token would be id 320."""
    from transformers import AutoTokenizer

    edit_json(engine / "special_tokens_map.json", lambda d: d.update(pad_token="<|pad|>"))
    message = refusal(engine)
    assert "the pad_token in special_tokens_map.json '<|pad|>' is in no vocabulary" in message, message
    assert f"would add it as token id {VOCAB}" in message
    assert AutoTokenizer.from_pretrained(engine).pad_token_id == VOCAB  # as transformers does
    padded = tmp_path / "padded"  # with rows to spare (384), the added token fits
    shutil.copytree(padded_engine, padded)
    edit_json(padded / "special_tokens_map.json", lambda d: d.update(pad_token="<|pad|>"))
    assert read_engine_spec(padded).io.vocab_size == 384


@pytest.mark.parametrize("bad", ["7", -1, 2.5, None, True, [3]], ids=repr)
@pytest.mark.parametrize("where", ["model.vocab", "added_tokens", "added_tokens.json", "decoder key"])
def test_a_token_id_that_is_not_a_non_negative_integer_is_refused(engine: Path, where: str, bad: Any) -> None:
    if where == "model.vocab":
        edit_json(engine / "tokenizer.json", lambda d: d["model"]["vocab"].update({"zzz": bad}))
    elif where == "added_tokens":
        edit_json(engine / "tokenizer.json", _added(bad))
    elif where == "added_tokens.json":
        edit_json(engine / "added_tokens.json", lambda d: d.update({"<|z|>": bad}))
    else:
        key = bad if isinstance(bad, str) else json.dumps(bad)
        edit_json(engine / "tokenizer_config.json", lambda d: d.update(added_tokens_decoder={key: {}}))
        if key.isdigit():  # "7" is a fine key there: a decimal string is how it records an id
            assert read_engine_spec(engine).io.vocab_size == VOCAB
            return
    assert "not a non-negative integer: the tokenizer is broken; rebuild the engine" in refusal(engine)


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("tokenizer.json", "[1, 2]", "is a list, not a JSON object"),
        ("tokenizer.json", '{"model": {"vocab": 5}}', "model.vocab is a int, not a vocabulary"),
        ("tokenizer.json", '{"model": {"vocab": {}}, "added_tokens": [3]}', "an entry of added_tokens"),
        ("tokenizer_config.json", '{"added_tokens_decoder": []}', "added_tokens_decoder is a list"),
        ("tokenizer.json", '{"model": ', "is not valid JSON"),
        ("tokenizer.json", "[" * 100 + "]" * 100, "nested deeper than 64 levels"),
    ],
)
def test_a_malformed_tokenizer_file_is_one_line(engine: Path, name: str, content: str, needle: str) -> None:
    (engine / name).write_text(content)
    message = refusal(engine)
    assert needle in message and str(engine / name) in message, message


def test_a_tokenizer_too_large_to_be_one_is_refused_unread(engine: Path) -> None:
    with (engine / "added_tokens.json").open("wb") as handle:
        handle.truncate(300 << 20)  # sparse: nothing is written, or read
    assert "more than the 268435456 bytes allowed" in refusal(engine)


def test_a_quick_read_without_graphs_leaves_the_tokenizer_alone(engine: Path) -> None:
    edit_json(engine / "tokenizer.json", _added(VOCAB + 8))
    assert read_engine_spec(engine, graphs=False).io.vocab_size == VOCAB  # lint, gate's max_length
    refusal(engine)


# -- the graph's vocabulary against io.vocab_size ----------------------------------------------


def _set_vocab(folder: Path, vocab: int) -> None:
    edit_json(folder / ENGINE_FILE, lambda d: d["io"].update(vocab_size=vocab))


def test_a_graph_whose_logits_disagree_with_io_vocab_size_is_refused(engine: Path) -> None:
    _set_vocab(engine, 384)  # the tokenizer (320 tokens) fits: only the graph disagrees
    message = refusal(engine)
    assert (
        f"{engine / 'model.onnx'} has a vocabulary of {VOCAB} tokens (the last dimension of its logits "
        in message
    )
    assert "but io.vocab_size is 384: the graph is not this engine's; rebuild the engine" in message, message


def test_a_graph_whose_embedding_table_disagrees_is_refused(engine: Path) -> None:
    import onnx

    graph = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    (logits,) = [o for o in graph.graph.output if o.name == "logits"]
    logits.type.tensor_type.shape.dim[-1].dim_param = "vocab"  # only the embedding table says 320
    (engine / "model.onnx").write_bytes(graph.SerializeToString())
    _set_vocab(engine, 384)
    message = refusal(engine)
    assert (
        f"has a vocabulary of {VOCAB} tokens (the embedding table 'model.model.embed_tokens.weight'"
        in message
    )


def _synthetic_graph(table: str, rows: int, logits: int | str) -> bytes:
    """input_ids -> (Cast) -> an embedding lookup ``table`` ("plain", "fp16", "qdq", "blockwise",
    "computed") of ``rows`` rows -> logits [batch, seq, ``logits``]."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    hidden, nodes, inits = 8, [], []
    ids = "input_ids"
    if table == "blockwise":  # MatMulNBits-style 4-bit table, two values a byte, gathered on axis 0
        inits += [
            numpy_helper.from_array(np.zeros((rows, hidden // 2), np.uint8), "emb_q"),
            numpy_helper.from_array(np.ones((rows, 1), np.float32), "emb_scales"),
        ]
        nodes.append(
            helper.make_node(
                "GatherBlockQuantized", ["emb_q", ids, "emb_scales"], ["h"], domain="com.microsoft",
                gather_axis=0, quantize_axis=1, block_size=16, bits=4,
            )
        )  # fmt: skip
    else:
        nodes.append(helper.make_node("Cast", [ids], ["ids32"], to=TensorProto.INT32))
        emb = "emb"
        if table == "plain":
            inits.append(numpy_helper.from_array(np.zeros((rows, hidden), np.float32), "emb"))
        elif table == "fp16":
            inits.append(numpy_helper.from_array(np.zeros((rows, hidden), np.float16), "emb16"))
            nodes.append(helper.make_node("Cast", ["emb16"], ["emb"], to=TensorProto.FLOAT))
        elif table == "qdq":
            inits += [
                numpy_helper.from_array(np.zeros((rows, hidden), np.int8), "emb_q"),
                numpy_helper.from_array(np.array(0.1, np.float32), "emb_scale"),
            ]
            nodes.append(helper.make_node("DequantizeLinear", ["emb_q", "emb_scale"], ["emb"]))
        else:  # computed at run time: no static shape
            inits.append(numpy_helper.from_array(np.zeros((rows * hidden,), np.float32), "flat"))
            inits.append(numpy_helper.from_array(np.array([rows, hidden], np.int64), "shape"))
            nodes.append(helper.make_node("Reshape", ["flat", "shape"], ["emb"]))
        nodes.append(helper.make_node("Gather", [emb, "ids32"], ["h"], axis=0))
    inits.append(numpy_helper.from_array(np.zeros((hidden, 1), np.float32), "head"))
    nodes.append(helper.make_node("MatMul", ["h", "head"], ["logits"]))
    graph = helper.make_graph(
        nodes,
        "synthetic",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", logits])],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


@pytest.mark.parametrize("table", ["plain", "fp16", "qdq", "blockwise"])
def test_an_embedding_table_of_another_vocabulary_is_refused_plain_or_quantized(
    engine: Path, table: str
) -> None:
    (engine / "model.onnx").write_bytes(_synthetic_graph(table, VOCAB, "vocab"))
    assert read_engine_spec(engine).io.vocab_size == VOCAB  # the table that matches reads
    (engine / "model.onnx").write_bytes(_synthetic_graph(table, 500, "vocab"))
    message = refusal(engine)
    assert "has a vocabulary of 500 tokens (the embedding table " in message, message
    assert f"but io.vocab_size is {VOCAB}" in message


def test_a_vocabulary_the_graph_does_not_fix_statically_is_not_guessed(engine: Path) -> None:
    (engine / "model.onnx").write_bytes(_synthetic_graph("computed", 500, "vocab"))
    assert read_engine_spec(engine).io.vocab_size == VOCAB
    (engine / "model.onnx").write_bytes(_synthetic_graph("computed", 500, 500))
    assert "has a vocabulary of 500 tokens (the last dimension of its logits output)" in refusal(engine)


# -- the CLIs the issue names: bench and registry publish, exit 2, one line ---------------------


def _one_error_line(err: str, needle: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err[-3000:]
    assert needle in lines[0], lines[0]


def test_bench_refuses_an_engine_whose_tokenizer_is_not_its_own(
    engine: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline import bench

    ran: list[Path] = []
    monkeypatch.setattr(bench, "run_benchmark", lambda folder, *_: ran.append(folder) or {})
    edit_json(engine / "tokenizer.json", _added(49160))
    assert bench.main([str(engine)]) == 2
    _one_error_line(
        capsys.readouterr().err, f"token id 49160 ('<|x|>') is past the graph's vocabulary of {VOCAB}"
    )
    assert ran == []  # refused before anything is loaded


def test_registry_publish_refuses_an_engine_whose_tokenizer_is_not_its_own(
    engine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.registry.__main__ import main

    edit_json(
        engine / "tokenizer_config.json",
        lambda d: d.update(added_tokens_decoder={"400": {"content": "<|y|>"}}),
    )
    run = tmp_path / "run"
    shutil.copytree(engine, run / "engine")
    manifest = {
        "engine": {"path": "engine", "target": "ort-cpu", "files": engine_files(run / "engine")},
        "gate": {"verdict": "FAIL", "reason": "a test"},
        "drift_family": "fp32",
    }
    write_json(run / "manifest.json", manifest)
    root = tmp_path / "registry"
    argv = [
        "--root",
        str(root),
        "publish",
        str(run),
        "--model",
        "tiny",
        "--recipe",
        "none",
        "--force",
        "testing",
    ]
    assert main(argv) == 2
    _one_error_line(capsys.readouterr().err, "token id 400 ('<|y|>') is past the graph's vocabulary")
    assert not list(root.glob("versions/**/*.json")) and not list(root.glob("blobs/*/*/*"))
