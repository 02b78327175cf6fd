"""The generation loop: left padding, next-token selection, and ``generate`` driven by a real
ONNX Runtime session over the tiny engine (``OrtModel``), with its callbacks, EOS and timings."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.artifacts import Artifact
from pipeline.runtime.generate import GenerationConfig, generate, left_pad, sample_next
from pipeline.runtime.ort import Engine, OrtModel

# ---------------------------------------------------------------------------------------------
# left_pad


def test_left_pad_shapes_values_and_mask() -> None:
    ids, mask = left_pad([[5, 6, 7], [8], [9, 10]], pad_id=0)
    assert ids.shape == mask.shape == (3, 3)
    assert ids.dtype == mask.dtype == np.int64
    np.testing.assert_array_equal(ids, [[5, 6, 7], [0, 0, 8], [0, 9, 10]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 1], [0, 1, 1]])


def test_left_pad_uses_the_given_pad_id_and_keeps_pad_valued_prompt_tokens() -> None:
    # A prompt token equal to the pad id is still a real token: the mask, not the id, says so.
    ids, mask = left_pad([[4, 4], [7, 8, 9, 4]], pad_id=4)
    np.testing.assert_array_equal(ids, [[4, 4, 4, 4], [7, 8, 9, 4]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1], [1, 1, 1, 1]])


def test_left_pad_equal_lengths_has_no_padding() -> None:
    ids, mask = left_pad([(1, 2), (3, 4)], pad_id=99)
    np.testing.assert_array_equal(ids, [[1, 2], [3, 4]])
    assert mask.all()


@pytest.mark.parametrize("prompts", [[[]], [[1, 2], []], []], ids=["one-empty", "second-empty", "no-prompts"])
def test_left_pad_rejects_empty_prompts(prompts: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        left_pad(prompts, pad_id=0)


# ---------------------------------------------------------------------------------------------
# sample_next


def _logits(seed: int = 0, batch: int = 4, vocab: int = 50) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, vocab)).astype(np.float32)


def test_greedy_is_argmax_and_ignores_sampling_settings() -> None:
    logits = _logits()
    config = GenerationConfig(do_sample=False, temperature=5.0, top_k=3, top_p=0.5, seed=1)
    picked = sample_next(logits, config, np.random.default_rng(0))
    assert picked.dtype == np.int64
    assert picked.shape == (4,)
    np.testing.assert_array_equal(picked, logits.argmax(-1))


def test_sample_next_does_not_modify_the_logits() -> None:
    logits = _logits()
    before = logits.copy()
    sample_next(
        logits,
        GenerationConfig(do_sample=True, temperature=0.5, top_k=5, top_p=0.9),
        np.random.default_rng(0),
    )
    np.testing.assert_array_equal(logits, before)


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed() -> None:
    flat = np.zeros((16, 64), dtype=np.float32)  # uniform: every draw is a coin flip over 64 tokens
    config = GenerationConfig(do_sample=True)
    first = sample_next(flat, config, np.random.default_rng(123))
    again = sample_next(flat, config, np.random.default_rng(123))
    other = sample_next(flat, config, np.random.default_rng(124))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    assert len(set(first.tolist())) > 1  # it really samples: 16 uniform draws are not all equal


def test_top_k_one_is_greedy() -> None:
    logits = _logits(seed=3, batch=32)
    config = GenerationConfig(do_sample=True, top_k=1, temperature=10.0)
    for seed in range(3):
        np.testing.assert_array_equal(
            sample_next(logits, config, np.random.default_rng(seed)), logits.argmax(-1)
        )


def test_tiny_top_p_is_greedy() -> None:
    logits = _logits(seed=4, batch=32)
    config = GenerationConfig(do_sample=True, top_p=1e-6, temperature=10.0)
    for seed in range(3):
        np.testing.assert_array_equal(
            sample_next(logits, config, np.random.default_rng(seed)), logits.argmax(-1)
        )


def test_top_k_samples_only_among_the_k_best() -> None:
    row = np.array([0.0, 3.0, 1.0, 2.9, -1.0, 2.8], dtype=np.float32)
    logits = np.tile(row, (400, 1))
    picked = sample_next(logits, GenerationConfig(do_sample=True, top_k=2, seed=0), np.random.default_rng(0))
    assert set(picked.tolist()) == {1, 3}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = np.array([0.6, 0.3, 0.1])
    logits = np.tile(np.log(probs), (400, 1))
    rng = np.random.default_rng(0)
    only_first = sample_next(logits, GenerationConfig(do_sample=True, top_p=0.5), rng)
    assert set(only_first.tolist()) == {0}
    first_two = sample_next(logits, GenerationConfig(do_sample=True, top_p=0.7), rng)
    assert set(first_two.tolist()) == {0, 1}
    everything = sample_next(logits, GenerationConfig(do_sample=True, top_p=1.0), rng)
    assert set(everything.tolist()) == {0, 1, 2}


@pytest.mark.parametrize("temperature", [0.0, 1e-3])
def test_zero_or_tiny_temperature_samples_the_argmax(temperature: float) -> None:
    logits = _logits(seed=5, batch=64)
    config = GenerationConfig(do_sample=True, temperature=temperature)
    np.testing.assert_array_equal(sample_next(logits, config, np.random.default_rng(0)), logits.argmax(-1))


def test_temperature_scales_the_distribution() -> None:
    logits = np.tile(np.array([0.0, 1.0, 2.0], dtype=np.float32), (6000, 1))

    def frequencies(temperature: float) -> np.ndarray:
        config = GenerationConfig(do_sample=True, temperature=temperature)
        picked = sample_next(logits, config, np.random.default_rng(7))
        return np.bincount(picked, minlength=3) / len(picked)

    def softmax(scores: np.ndarray) -> np.ndarray:
        exp = np.exp(scores - scores.max())
        return exp / exp.sum()

    # 6000 draws: the standard error of each frequency is below 0.007.
    np.testing.assert_allclose(frequencies(1.0), softmax(np.array([0.0, 1.0, 2.0])), atol=0.03)
    np.testing.assert_allclose(frequencies(0.5), softmax(np.array([0.0, 2.0, 4.0])), atol=0.03)
    np.testing.assert_allclose(frequencies(1000.0), [1 / 3, 1 / 3, 1 / 3], atol=0.03)


# ---------------------------------------------------------------------------------------------
# generate() over the tiny engine's ONNX Runtime session


@pytest.fixture(scope="module")
def engine(tiny_engine: Artifact) -> Engine:
    return Engine(tiny_engine.path)


@pytest.fixture(scope="module")
def ort_model(engine: Engine) -> OrtModel:
    return engine.model


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    texts = ["The quick brown fox", "Once upon a time, there was a small model that", "0123"]
    encoded = [list(engine.tokenizer(t)["input_ids"]) for t in texts]
    assert len({len(e) for e in encoded}) == 3  # different lengths: the batch is really padded
    return encoded


def _greedy(model: OrtModel, prompt: list[int], n: int) -> list[int]:
    return generate(model, [prompt], GenerationConfig(max_new_tokens=n, stop_at_eos=False), pad_id=0).tokens[
        0
    ]


def test_generate_returns_max_new_tokens_and_timings(ort_model: OrtModel, prompts: list[list[int]]) -> None:
    result = generate(ort_model, prompts, GenerationConfig(max_new_tokens=5, stop_at_eos=False), pad_id=0)
    assert [len(row) for row in result.tokens] == [5, 5, 5]
    assert all(0 <= t < ort_model.io.vocab_size for row in result.tokens for t in row)
    assert result.prefill_seconds > 0
    assert len(result.step_seconds) == 4
    assert all(s > 0 for s in result.step_seconds)


def test_generate_one_token_is_the_prefill_argmax(ort_model: OrtModel, prompts: list[list[int]]) -> None:
    prompt = prompts[1]
    logits, _ = ort_model.step(
        np.array([prompt]),
        np.ones((1, len(prompt)), np.int64),
        np.arange(len(prompt))[None],
        ort_model.empty_cache(1),
    )
    result = generate(ort_model, [prompt], GenerationConfig(max_new_tokens=1), pad_id=0)
    assert result.tokens == [[int(logits[0, -1].argmax())]]
    assert result.step_seconds == []


def test_on_tokens_gets_one_array_per_step(ort_model: OrtModel, prompts: list[list[int]]) -> None:
    steps: list[np.ndarray] = []
    config = GenerationConfig(max_new_tokens=6, stop_at_eos=False)
    result = generate(ort_model, prompts, config, pad_id=0, on_tokens=lambda t: steps.append(t.copy()))
    assert len(steps) == 6
    assert all(step.shape == (3,) for step in steps)
    np.testing.assert_array_equal(np.stack(steps, axis=1), np.array(result.tokens))


def test_generate_stops_rows_at_eos_and_marks_them_in_on_tokens(
    ort_model: OrtModel, prompts: list[list[int]]
) -> None:
    alone = [_greedy(ort_model, p, 6) for p in prompts[:2]]
    eos = alone[0][0]  # row 0 ends on its first token
    assert eos not in alone[1]  # so row 1 runs to the end
    steps: list[np.ndarray] = []
    config = GenerationConfig(max_new_tokens=6, stop_at_eos=True)
    result = generate(ort_model, prompts[:2], config, pad_id=0, eos_ids=[eos], on_tokens=steps.append)
    assert result.tokens == [[eos], alone[1]]
    assert len(steps) == 6
    assert steps[0].tolist() == [eos, alone[1][0]]
    assert [int(s[0]) for s in steps[1:]] == [-1] * 5  # a finished row reports -1
    assert [int(s[1]) for s in steps] == alone[1]


def test_generate_ends_early_when_every_row_is_finished(
    ort_model: OrtModel, prompts: list[list[int]]
) -> None:
    firsts = [_greedy(ort_model, p, 1)[0] for p in prompts]
    calls: list[np.ndarray] = []
    config = GenerationConfig(max_new_tokens=10, stop_at_eos=True)
    result = generate(ort_model, prompts, config, pad_id=0, eos_ids=firsts, on_tokens=calls.append)
    assert result.tokens == [[t] for t in firsts]
    assert len(calls) == 1
    assert result.step_seconds == []


def test_eos_is_ignored_without_stop_at_eos(ort_model: OrtModel, prompts: list[list[int]]) -> None:
    expected = _greedy(ort_model, prompts[0], 4)
    config = GenerationConfig(max_new_tokens=4, stop_at_eos=False)
    result = generate(ort_model, [prompts[0]], config, pad_id=0, eos_ids=[expected[0]])
    assert result.tokens == [expected]


def test_generate_rejects_an_empty_prompt(ort_model: OrtModel) -> None:
    with pytest.raises(ValueError):
        generate(ort_model, [[1, 2], []], GenerationConfig(max_new_tokens=2), pad_id=0)


def test_top_p_zero_keeps_the_most_likely_token() -> None:
    logits = np.array([[0.1, 2.0, 0.3]])
    config = GenerationConfig(do_sample=True, top_p=0.0, seed=0)
    assert sample_next(logits, config, np.random.default_rng(0)).tolist() == [1]


@pytest.mark.parametrize("right_padded", [False, True])
def test_a_prefilled_prefix_generates_as_from_scratch(
    ort_model: OrtModel, prompts: list[list[int]], right_padded: bool
) -> None:
    from pipeline.runtime.generate import prefill

    prompt = prompts[1]
    config = GenerationConfig(max_new_tokens=6, stop_at_eos=False)
    scratch = generate(ort_model, [prompt], config, pad_id=0, right_padded=right_padded).tokens
    past = len(prompt) - 3
    cache = prefill(ort_model, prompt[:past], ort_model.empty_cache(1))
    resumed = generate(
        ort_model, [prompt[past:]], config, pad_id=0, right_padded=right_padded, cache=cache, past=past
    )
    assert resumed.tokens == scratch
    with pytest.raises(ValueError, match="pass one prompt"):
        generate(ort_model, prompts[:2], config, pad_id=0, cache=cache, past=past)
