"""Block streaming: materialized modules hold the checkpoint's tensors (single file and sharded),
the captured first-block inputs and the block-by-block forward equal the whole model's, and a
streamed write loads back as the same model (tied and untied heads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from calibration.datasets import CalibrationConfig, token_windows
from calibration.streaming import INDEX_FILE, CheckpointWriter, StreamedCheckpoint
from passes.int4 import first_layer_inputs, run_layer
from pipeline.core.errors import SourceError
from pipeline.core.families import LLAMA
from pipeline.core.placement import ResolvedPlacement
from pipeline.core.torch_model import copy_beside_weights, load_causal_lm, load_tokenizer
from tests.conftest import make_tiny_llama

EMBEDDINGS, FINAL_NORM, LM_HEAD = LLAMA.embeddings, LLAMA.final_norm, LLAMA.head


@pytest.fixture(scope="module")
def sharded_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama saved as several shards with an index (as large checkpoints are)."""
    folder = tmp_path_factory.mktemp("sharded")
    load_causal_lm(tiny_llama).save_pretrained(folder, safe_serialization=True, max_shard_size="100KB")
    copy_beside_weights(tiny_llama, folder)
    assert (folder / INDEX_FILE).is_file() and len(list(folder.glob("*.safetensors"))) > 2
    return folder


@pytest.mark.parametrize("sharded", [False, True])
def test_materialize_loads_the_checkpoint_and_release_frees_it(
    tiny_llama: Path, sharded_llama: Path, sharded: bool
) -> None:
    folder = sharded_llama if sharded else tiny_llama
    checkpoint = StreamedCheckpoint(folder)
    whole = load_causal_lm(tiny_llama).state_dict()
    assert checkpoint.tied and checkpoint.num_layers == 2
    assert all(p.is_meta for p in checkpoint.model.parameters())  # nothing read yet
    for prefix in (EMBEDDINGS, "model.layers.1", FINAL_NORM, LM_HEAD):
        module = checkpoint.materialize(prefix)
        for name, value in module.state_dict().items():
            assert value.device.type == "cpu" and value.dtype == torch.float32
            assert torch.equal(value, whole[f"{prefix}.{name}"]), f"{prefix}.{name}"
        checkpoint.release(prefix)
        assert all(p.is_meta for p in module.parameters())
    # The tied head is read from the embedding.
    assert checkpoint.source_key("lm_head.weight") == "model.embed_tokens.weight"


def test_materialize_honours_the_placement_dtype(tiny_llama: Path) -> None:
    checkpoint = StreamedCheckpoint(tiny_llama, ResolvedPlacement("cpu", "bfloat16"))
    layer = checkpoint.materialize("model.layers.0")
    assert {p.dtype for p in layer.parameters()} == {torch.bfloat16}
    expected = load_causal_lm(tiny_llama).model.layers[0].mlp.up_proj.weight.to(torch.bfloat16)
    assert torch.equal(layer.mlp.up_proj.weight, expected)


def test_streamed_forward_equals_the_whole_model(sharded_llama: Path, tiny_llama: Path) -> None:
    """Captured first-block inputs and every block's outputs, streamed vs held whole."""
    windows = token_windows(load_tokenizer(tiny_llama), CalibrationConfig(num_samples=4, seq_len=32))
    model = load_causal_lm(tiny_llama)
    checkpoint = StreamedCheckpoint(sharded_llama)
    with torch.no_grad():
        whole = first_layer_inputs(model, windows, 2)
        streamed = checkpoint.first_block_inputs(windows, 2)
        assert checkpoint.module(EMBEDDINGS).weight.is_meta  # released after the capture
        assert len(streamed.hidden) == 2 and streamed.tokens == whole.tokens == 128
        for a, b in zip(streamed.kwargs, whole.kwargs, strict=True):
            assert a.keys() == b.keys()
            cos_a, sin_a = a["position_embeddings"]
            cos_b, sin_b = b["position_embeddings"]
            assert torch.equal(cos_a, cos_b) and torch.equal(sin_a, sin_b)
        for index, layer in enumerate(model.model.layers):
            block = checkpoint.materialize(checkpoint.layer_prefix(index))
            streamed.hidden = run_layer(block, streamed)
            checkpoint.release(checkpoint.layer_prefix(index))
            whole.hidden = run_layer(layer, whole)
            for a, b in zip(streamed.hidden, whole.hidden, strict=True):
                assert torch.equal(a, b), index
        norm = checkpoint.materialize(FINAL_NORM)
        head = checkpoint.materialize(LM_HEAD)
        logits = head(norm(streamed.hidden[0]))
        reference = model(torch.from_numpy(windows[:2])).logits
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


WINDOWED = {
    # layer 0 full, layer 1 within 64 positions: two attention masks
    "qwen2": {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
}


@pytest.mark.parametrize("model_type", list(WINDOWED))
def test_each_block_is_streamed_with_its_own_mask_and_rotary(model_type: str, tmp_path: Path) -> None:
    """Windows of 128 tokens, longer than the sliding layers' 64: each block runs with the
    arguments transformers gives that block (its mask, its RoPE table), caught once for all
    layers, and the streamed block-by-block logits are the whole model's."""
    from tests.families import make_tiny, random_ids

    source = make_tiny(model_type, tmp_path / model_type, **WINDOWED[model_type])
    windows = random_ids(128)[0].reshape(1, -1).repeat(4, axis=0)
    windows[1:, 5:] = random_ids(3 * 123, seed=1).reshape(3, 123)
    model = load_causal_lm(source)
    checkpoint = StreamedCheckpoint(source)
    family = checkpoint.family
    with torch.no_grad():
        inputs = checkpoint.first_block_inputs(windows, 2)
        assert len(inputs.by_layer) == checkpoint.num_layers and inputs.kwargs is inputs.by_layer[0]
        first, last = inputs.by_layer[0][0], inputs.by_layer[-1][0]
        full, sliding = first["attention_mask"], last["attention_mask"]  # sdpa: None where plain causal
        assert sliding is not None and (full is None or not torch.equal(full, sliding))
        for index in range(checkpoint.num_layers):
            block = checkpoint.materialize(checkpoint.layer_prefix(index))
            inputs = inputs.at(index)
            inputs.hidden = run_layer(block, inputs)
            checkpoint.release(checkpoint.layer_prefix(index))
        norm = checkpoint.materialize(family.final_norm)
        head = checkpoint.materialize(family.embeddings if checkpoint.tied else family.head)
        hidden = norm(inputs.hidden[0])
        logits = hidden @ head.weight.T
        reference = model(torch.from_numpy(windows[:2])).logits
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("untie", [False, True])
def test_streamed_write_loads_back_as_the_same_model(tiny_llama: Path, tmp_path: Path, untie: bool) -> None:
    checkpoint = StreamedCheckpoint(tiny_llama)
    if untie:
        assert checkpoint.untie_lm_head()
    out = tmp_path / "out"
    writer = CheckpointWriter(out)
    copy_beside_weights(tiny_llama, out)
    prefixes = [EMBEDDINGS, *(checkpoint.layer_prefix(i) for i in range(checkpoint.num_layers)), FINAL_NORM]
    if not checkpoint.output_tied:
        prefixes.append(LM_HEAD)
    for prefix in prefixes:
        checkpoint.materialize(prefix)
        writer.write(checkpoint.output_tensors(prefix))
        checkpoint.release(prefix)
    writer.finish(checkpoint.config, checkpoint.generation_config())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == [
        f"model-{i:05d}-of-{len(prefixes):05d}.safetensors" for i in range(1, len(prefixes) + 1)
    ]
    index = json.loads((out / INDEX_FILE).read_text())
    assert ("lm_head.weight" in index["weight_map"]) is untie
    original, loaded = load_causal_lm(tiny_llama), load_causal_lm(out)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is not untie
    for name, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is not untie


@pytest.mark.parametrize("tied", [True, False])
def test_load_model_equals_from_pretrained(tmp_path: Path, tied: bool) -> None:
    folder = make_tiny_llama(tmp_path / "llama", tie_word_embeddings=tied)
    expected, loaded = load_causal_lm(folder), StreamedCheckpoint(folder).load_model()
    assert not loaded.training
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tied
    assert loaded.state_dict().keys() == expected.state_dict().keys()
    for name, value in expected.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected(ids).logits)
    bf16 = StreamedCheckpoint(folder, ResolvedPlacement("cpu", "bfloat16")).load_model()
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}


def test_a_folder_without_safetensors_is_a_source_error(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(SourceError, match=r"holds no model.safetensors or model.safetensors.index.json"):
        StreamedCheckpoint(folder)


def test_a_corrupt_shard_is_a_source_error(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SourceError, match=r"cannot read the weight index of .*: re-save or re-download"):
        StreamedCheckpoint(folder)
