"""The ONNX Runtime engine: real sessions on tiny engines compared with the torch model they
were exported from (greedy tokens, logits, KV cache), sampling, streaming, EOS and load errors.

Two engines are used: the shared ``tiny_engine`` and a "sharp" one built here the same way
from a Llama with a larger initializer range. The shared model's tied embeddings make its
greedy output repeat the last prompt token, which would hide cache or padding bugs; the sharp
model's greedy continuations change at every step.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.engine import ENGINE_FILE, IOSpec, graph_io
from pipeline.core.errors import EngineError
from pipeline.runtime.generate import GenerationConfig, left_pad
from pipeline.runtime.ort import Engine, OrtModel
from tests.conftest import make_tiny_llama

PROMPTS = ["The quick brown fox", "Once upon a time, there was a small model that", "0123"]
NEW_TOKENS = 12


@dataclass
class Subject:
    """An engine and the torch model it was built from."""

    name: str
    engine: Engine
    torch_model: Any

    def encode(self, text: str) -> list[int]:
        return list(self.engine.tokenizer(text)["input_ids"])

    def torch_greedy(self, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
        """Reference: greedy decoding with a full forward (no cache) at every step."""
        import torch

        sequence = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                sequence.append(int(self.torch_model(torch.tensor([sequence])).logits[0, -1].argmax()))
        return sequence[len(prompt) :]


def _load_torch(folder: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny(tiny_llama: Path, tiny_engine: Artifact) -> Subject:
    return Subject("tiny", Engine(tiny_engine.path), _load_torch(tiny_llama))


@pytest.fixture(scope="module")
def sharp(tmp_path_factory: pytest.TempPathFactory) -> Subject:
    from passes.export import ExportPass
    from passes.ort_build import OrtCpuBuildPass

    source = make_tiny_llama(tmp_path_factory.mktemp("sharp-llama"), seed=0, initializer_range=0.3)
    graph = tmp_path_factory.mktemp("sharp-graph")
    ExportPass().run(Artifact.from_dir(Kind.TORCH, source), graph)
    engine = tmp_path_factory.mktemp("sharp-engine")
    OrtCpuBuildPass().run(Artifact.from_dir(Kind.GRAPH, graph), engine)
    return Subject("sharp", Engine(engine), _load_torch(source))


@pytest.fixture(params=["tiny", "sharp"])
def subject(request: pytest.FixtureRequest) -> Subject:
    return request.getfixturevalue(request.param)


def _full_step(model: OrtModel, ids: list[int]) -> np.ndarray:
    """Logits of one forward over ``ids`` from an empty cache."""
    logits, _ = model.step(
        np.array([ids]), np.ones((1, len(ids)), np.int64), np.arange(len(ids))[None], model.empty_cache(1)
    )
    return logits[0]


# ---------------------------------------------------------------------------------------------
# Greedy generation against torch


def test_sharp_reference_is_not_degenerate(sharp: Subject) -> None:
    # Guards the strength of the comparisons below: the sharp model's greedy output varies.
    for text in PROMPTS:
        assert len(set(sharp.torch_greedy(sharp.encode(text)))) >= 6


@pytest.mark.parametrize("text", PROMPTS)
def test_engine_greedy_equals_torch_greedy(subject: Subject, text: str) -> None:
    prompt = subject.encode(text)
    result = subject.engine.generate_ids(
        [prompt], GenerationConfig(max_new_tokens=NEW_TOKENS, stop_at_eos=False)
    )
    assert result.tokens == [subject.torch_greedy(prompt)]


def test_engine_greedy_equals_torch_generate(tiny: Subject) -> None:
    import torch

    prompt = tiny.encode(PROMPTS[0])
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = tiny.torch_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    expected = out[0, len(prompt) :].tolist()
    assert tiny.engine.eos_token_ids[0] not in expected  # min_new_tokens would have masked it
    result = tiny.engine.generate_ids(
        [prompt], GenerationConfig(max_new_tokens=NEW_TOKENS, stop_at_eos=False)
    )
    assert result.tokens == [expected]


def test_left_padded_batch_equals_each_prompt_alone(subject: Subject) -> None:
    prompts = [subject.encode(t) for t in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, stop_at_eos=False)
    batch = subject.engine.generate_ids(prompts, config).tokens
    alone = [subject.engine.generate_ids([p], config).tokens[0] for p in prompts]
    assert batch == alone
    # Reversed order (longest prompt last) pads the other rows.
    assert subject.engine.generate_ids(prompts[::-1], config).tokens == alone[::-1]


def test_left_padded_prefill_logits_equal_torch(sharp: Subject) -> None:
    import torch

    prompts = [sharp.encode(t) for t in PROMPTS]
    ids, mask = left_pad(prompts, sharp.engine.pad_token_id)
    positions = np.clip(mask.cumsum(-1) - 1, 0, None)
    model = sharp.engine.model
    logits, _ = model.step(ids, mask, positions, model.empty_cache(len(prompts)))
    assert np.isfinite(logits).all()
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            reference = sharp.torch_model(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(logits[row, -len(prompt) :], reference, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# The KV cache


def test_prefill_then_decode_steps_equal_one_full_forward(sharp: Subject) -> None:
    import torch

    model = sharp.engine.model
    io = model.io
    prompt = sharp.encode(PROMPTS[1])
    continuation = sharp.torch_greedy(prompt, 3)
    sequence = prompt + continuation
    full = _full_step(model, sequence)
    with torch.no_grad():
        reference = sharp.torch_model(torch.tensor([sequence])).logits[0].numpy()
    np.testing.assert_allclose(full, reference, atol=1e-4, rtol=0)

    logits, cache = model.step(
        np.array([prompt]),
        np.ones((1, len(prompt)), np.int64),
        np.arange(len(prompt))[None],
        model.empty_cache(1),
    )
    assert logits.shape == (1, len(prompt), io.vocab_size)
    np.testing.assert_allclose(logits[0], full[: len(prompt)], atol=1e-4, rtol=0)
    assert len(cache) == 2 * io.num_layers
    for i, token in enumerate(continuation):
        total = len(prompt) + i + 1
        assert all(c.shape() == [1, io.num_kv_heads, total - 1, io.head_dim] for c in cache)
        logits, cache = model.step(
            np.array([[token]]), np.ones((1, total), np.int64), np.array([[total - 1]]), cache
        )
        assert logits.shape == (1, 1, io.vocab_size)
        np.testing.assert_allclose(logits[0, 0], full[total - 1], atol=1e-4, rtol=0)
        np.testing.assert_allclose(logits[0, 0], reference[total - 1], atol=1e-4, rtol=0)


def test_decode_without_the_cache_gives_different_logits(sharp: Subject) -> None:
    # The comparison above could not pass by ignoring the past: the cache changes the logits.
    model = sharp.engine.model
    prompt = sharp.encode(PROMPTS[0])
    token = sharp.torch_greedy(prompt, 1)[0]
    with_past = _full_step(model, [*prompt, token])[-1]
    without, _ = model.step(
        np.array([[token]]), np.ones((1, 1), np.int64), np.array([[len(prompt)]]), model.empty_cache(1)
    )
    assert np.abs(without[0, 0] - with_past).max() > 1e-2


def test_a_cache_can_be_stepped_twice(sharp: Subject) -> None:
    # Stepping does not consume or overwrite the cache it is given.
    model = sharp.engine.model
    prompt = sharp.encode(PROMPTS[2])
    n = len(prompt)
    _, cache = model.step(
        np.array([prompt]), np.ones((1, n), np.int64), np.arange(n)[None], model.empty_cache(1)
    )
    before = [c.numpy().copy() for c in cache]
    decode = (np.array([[7]]), np.ones((1, n + 1), np.int64), np.array([[n]]))
    first, _ = model.step(*decode, cache)
    second, _ = model.step(*decode, cache)
    np.testing.assert_array_equal(first, second)
    for old, new in zip(before, cache, strict=True):
        np.testing.assert_array_equal(old, new.numpy())


def test_batched_decode_with_left_padding_equals_torch(sharp: Subject) -> None:
    import torch

    model = sharp.engine.model
    prompts = [sharp.encode(t) for t in PROMPTS[:2]]
    nexts = [sharp.torch_greedy(p, 1)[0] for p in prompts]
    ids, mask = left_pad(prompts, sharp.engine.pad_token_id)
    positions = np.clip(mask.cumsum(-1) - 1, 0, None)
    _, cache = model.step(ids, mask, positions, model.empty_cache(2))
    mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    logits, _ = model.step(np.array(nexts)[:, None], mask, positions[:, -1:] + 1, cache)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            reference = sharp.torch_model(torch.tensor([[*prompt, nexts[row]]])).logits[0, -1].numpy()
        np.testing.assert_allclose(logits[row, 0], reference, atol=1e-4, rtol=0)


def test_session_settings_do_not_change_the_logits(sharp: Subject) -> None:
    prompt = sharp.encode(PROMPTS[0])
    expected = _full_step(sharp.engine.model, prompt)
    unoptimized = OrtModel(
        sharp.engine.folder / sharp.engine.spec["model_file"], sharp.engine.io, 1, "disable"
    )
    np.testing.assert_allclose(_full_step(unoptimized, prompt), expected, atol=1e-4, rtol=0)
    one_thread = Engine(sharp.engine.folder, threads=1)
    np.testing.assert_allclose(_full_step(one_thread.model, prompt), expected, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# Sampling


def test_seeded_sampling_is_reproducible(sharp: Subject) -> None:
    prompts = [sharp.encode(t) for t in PROMPTS[:2]]

    def run(seed: int) -> list[list[int]]:
        config = GenerationConfig(
            max_new_tokens=NEW_TOKENS, stop_at_eos=False, do_sample=True, seed=seed, temperature=2.0
        )
        return sharp.engine.generate_ids(prompts, config).tokens

    first = run(0)
    assert first == run(0)
    assert first != run(1)
    greedy = sharp.engine.generate_ids(
        prompts, GenerationConfig(max_new_tokens=NEW_TOKENS, stop_at_eos=False)
    )
    assert first != greedy.tokens  # at temperature 2 it really samples


def test_sampling_with_top_k_one_equals_greedy(tiny: Subject, sharp: Subject) -> None:
    for subject in (tiny, sharp):
        prompts = [subject.encode(t) for t in PROMPTS]
        greedy = GenerationConfig(max_new_tokens=6, stop_at_eos=False)
        top1 = GenerationConfig(
            max_new_tokens=6, stop_at_eos=False, do_sample=True, top_k=1, temperature=5.0, seed=3
        )
        assert (
            subject.engine.generate_ids(prompts, top1).tokens
            == subject.engine.generate_ids(prompts, greedy).tokens
        )


# ---------------------------------------------------------------------------------------------
# Text, streaming and callbacks


def _stream(engine: Engine, texts: str | list[str], config: GenerationConfig) -> tuple[list[str], list[Any]]:
    pieces: list[tuple[int, str]] = []
    results = engine.generate(texts, config, stream=lambda row, piece: pieces.append((row, piece)))
    rows = 1 if isinstance(texts, str) else len(texts)
    assert all(0 <= row < rows and piece for row, piece in pieces)
    return ["".join(p for r, p in pieces if r == row) for row in range(rows)], results


STREAM_CASES = pytest.mark.parametrize("texts", [PROMPTS[0], PROMPTS[:2]], ids=["one-prompt", "two-prompts"])


@STREAM_CASES
def test_streamed_pieces_concatenate_to_the_returned_text(tiny: Subject, texts: str | list[str]) -> None:
    config = GenerationConfig(max_new_tokens=16, stop_at_eos=False)
    pieces: list[tuple[int, str]] = []
    results = tiny.engine.generate(texts, config, stream=lambda row, piece: pieces.append((row, piece)))
    rows = 1 if isinstance(texts, str) else 2
    assert len(results) == rows
    assert len(pieces) > rows  # it streams as it goes, not once at the end
    assert {row for row, _ in pieces} == set(range(rows))
    assert all(piece for _, piece in pieces)
    streamed = ["".join(p for r, p in pieces if r == row) for row in range(rows)]
    assert all(results[row].text for row in range(rows))
    assert streamed == [result.text for result in results]


@STREAM_CASES
def test_streamed_text_is_a_prefix_of_the_returned_text(sharp: Subject, texts: str | list[str]) -> None:
    # The sharp model's greedy continuation contains bytes of incomplete UTF-8 sequences.
    streamed, results = _stream(sharp.engine, texts, GenerationConfig(max_new_tokens=16, stop_at_eos=False))
    assert all(text for text in streamed)
    assert all(result.text.startswith(text) for text, result in zip(streamed, results, strict=True))


@STREAM_CASES
def test_streamed_text_equals_returned_text_mid_character(sharp: Subject, texts: str | list[str]) -> None:
    streamed, results = _stream(sharp.engine, texts, GenerationConfig(max_new_tokens=16, stop_at_eos=False))
    assert streamed == [result.text for result in results]


def test_on_tokens_receives_one_array_per_step(tiny: Subject) -> None:
    prompts = [tiny.encode(t) for t in PROMPTS]
    steps: list[np.ndarray] = []
    config = GenerationConfig(max_new_tokens=7, stop_at_eos=False)
    result = tiny.engine.generate_ids(prompts, config, on_tokens=lambda t: steps.append(np.array(t)))
    assert len(steps) == 7
    assert all(s.shape == (3,) for s in steps)
    assert np.stack(steps, axis=1).tolist() == result.tokens


# ---------------------------------------------------------------------------------------------
# End of sequence


def test_engine_reads_special_tokens_from_engine_json(tiny: Subject) -> None:
    # conftest's Llama: eos 2 (<|im_end|>), pad 0 (<|endoftext|>).
    assert tiny.engine.eos_token_ids == [2]
    assert tiny.engine.pad_token_id == 0


def test_generation_stops_at_the_engine_eos(sharp: Subject) -> None:
    prompt = sharp.encode(PROMPTS[0])
    expected = sharp.torch_greedy(prompt)
    engine = Engine(sharp.engine.folder)
    engine.eos_token_ids = [expected[0]]
    assert expected.count(expected[0]) == 1
    stop = engine.generate_ids([prompt], GenerationConfig(max_new_tokens=NEW_TOKENS, stop_at_eos=True))
    assert stop.tokens == [[expected[0]]]
    assert stop.step_seconds == []
    keep = engine.generate_ids([prompt], GenerationConfig(max_new_tokens=NEW_TOKENS, stop_at_eos=False))
    assert keep.tokens == [expected]
    # Stopping at a later token keeps everything up to and including it.
    assert expected.index(expected[4]) == 4
    engine.eos_token_ids = [expected[4]]
    later = engine.generate_ids([prompt], GenerationConfig(max_new_tokens=NEW_TOKENS, stop_at_eos=True))
    assert later.tokens == [expected[:5]]


def test_eos_stops_text_generation_too(tiny: Subject) -> None:
    engine = Engine(tiny.engine.folder)
    first = engine.generate_ids([tiny.encode(PROMPTS[1])], GenerationConfig(max_new_tokens=1)).tokens[0][0]
    engine.eos_token_ids = [first]
    (result,) = engine.generate(PROMPTS[1], GenerationConfig(max_new_tokens=NEW_TOKENS))
    assert result.token_ids == [first]


# ---------------------------------------------------------------------------------------------
# IO spec and load errors


def test_io_spec_names_and_graph_io(tiny_graph: Artifact, tiny: Subject) -> None:
    io = tiny.engine.io
    assert io == IOSpec(num_layers=2, num_kv_heads=2, head_dim=16, vocab_size=320)
    assert io.past_names() == [
        "past_key_values.0.key",
        "past_key_values.0.value",
        "past_key_values.1.key",
        "past_key_values.1.value",
    ]
    assert io.present_names() == [n.replace("past_key_values", "present") for n in io.past_names()]
    assert graph_io(tiny_graph.path) == io
    session = tiny.engine.model.session
    assert [o.name for o in session.get_outputs()] == ["logits", *io.present_names()]


def test_graph_io_without_metadata_raises(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="re-export"):
        graph_io(tmp_path)


@pytest.fixture
def engine_copy(tiny_engine: Artifact, tmp_path: Path) -> Path:
    folder = tmp_path / "engine"
    shutil.copytree(tiny_engine.path, folder)
    return folder


def _edit_spec(folder: Path, **changes: Any) -> None:
    path = folder / ENGINE_FILE
    spec = json.loads(path.read_text())
    spec.update(changes)
    path.write_text(json.dumps(spec))


def test_engine_copy_loads_and_runs(engine_copy: Path) -> None:
    # The copies below fail only because of the edit each one makes.
    engine = Engine(engine_copy)
    assert engine.generate_ids([[5, 6, 7]], GenerationConfig(max_new_tokens=2)).tokens[0]


def test_folder_without_engine_json_raises(tmp_path: Path) -> None:
    folder = tmp_path / "not-an-engine"
    folder.mkdir()
    with pytest.raises(EngineError, match="not an engine folder") as info:
        Engine(folder)
    assert str(folder) in str(info.value)


def test_missing_folder_raises(tmp_path: Path) -> None:
    with pytest.raises(EngineError) as info:
        Engine(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(info.value)


def test_unsupported_target_raises(engine_copy: Path) -> None:
    _edit_spec(engine_copy, target="openvino")
    with pytest.raises(EngineError, match="openvino") as info:
        Engine(engine_copy)
    assert "ort-cpu" in str(info.value)


def test_tensorrt_engine_without_tensorrt_is_one_line(engine_copy: Path) -> None:
    """A TensorRT engine folder on a machine without TensorRT (or without a GPU): one line
    naming the folder and what to install, before any plan is read."""
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here: the refusal path needs a machine without it")
    _edit_spec(engine_copy, target="tensorrt", tensorrt={"version": "10.0", "profiles": {}})
    with pytest.raises(EngineError, match="TensorRT engine: TensorRT is not installed") as info:
        Engine(engine_copy)
    assert str(engine_copy) in str(info.value) and "\n" not in str(info.value)


def test_missing_model_file_raises(engine_copy: Path) -> None:
    (engine_copy / "model.onnx").unlink()
    with pytest.raises(EngineError, match="missing") as info:
        Engine(engine_copy)
    assert "model.onnx" in str(info.value)


def test_model_file_named_in_engine_json_is_used(engine_copy: Path) -> None:
    _edit_spec(engine_copy, model_file="other.onnx")
    with pytest.raises(EngineError, match=r"other\.onnx"):
        Engine(engine_copy)


def test_corrupt_model_file_raises(engine_copy: Path) -> None:
    (engine_copy / "model.onnx").write_bytes(b"not a protobuf")
    with pytest.raises(EngineError, match="is not a readable ONNX graph") as info:
        Engine(engine_copy)
    assert "model.onnx" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "is not valid JSON"),
        ('{"target": "ort-cpu"}', "io is missing"),
        ("[]", "is a list, not a JSON object"),
    ],
)
def test_malformed_engine_json_raises_engine_error(engine_copy: Path, content: str, needle: str) -> None:
    (engine_copy / ENGINE_FILE).write_text(content)
    with pytest.raises(EngineError, match=needle) as info:
        Engine(engine_copy)
    assert str(engine_copy / ENGINE_FILE) in str(info.value) and "\n" not in str(info.value)


def test_prompt_past_max_length_is_refused(tiny: Subject) -> None:
    engine = tiny.engine
    prompt = [5] * (engine.max_length - 3)
    with pytest.raises(EngineError, match=r"exceeds this engine's max_length 256"):
        engine.generate_ids([prompt], GenerationConfig(max_new_tokens=4))
    assert (
        len(engine.generate_ids([prompt], GenerationConfig(max_new_tokens=3, stop_at_eos=False)).tokens[0])
        == 3
    )
