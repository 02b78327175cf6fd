"""``python -m benchmarks.gate_power``'s planted regressions do what their rows claim, and its "right?"
column reads the three outcomes."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks import gate_power


def edited(
    monkeypatch: pytest.MonkeyPatch, tiny_llama: Path, tmp_path: Path, name: str
) -> tuple[object, object]:
    from pipeline.core.torch_model import load_causal_lm

    monkeypatch.setattr(gate_power, "SOURCE", tiny_llama)  # the module is shared: set for this test only
    args = argparse.Namespace(swap=0, temperature=1.25, noise=0.02)
    folder = gate_power.modified_checkpoint(tmp_path, name, args)
    assert folder == tmp_path / "models" / name and not list(tmp_path.glob("models/.*"))  # no staging left
    return load_causal_lm(tiny_llama).eval(), load_causal_lm(folder).eval()


def test_colder_scales_every_logit_and_keeps_every_argmax(
    monkeypatch: pytest.MonkeyPatch, tiny_llama: Path, tmp_path: Path
) -> None:
    import torch

    original, colder = edited(monkeypatch, tiny_llama, tmp_path, "colder")
    ids = torch.randint(0, original.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base, scaled = original(ids).logits, colder(ids).logits
    torch.testing.assert_close(scaled, base * 1.25, rtol=1e-4, atol=1e-4)
    assert torch.equal(scaled.argmax(-1), base.argmax(-1))
    kl = torch.nn.functional.kl_div(
        scaled.log_softmax(-1), base.log_softmax(-1), log_target=True, reduction="batchmean"
    )
    assert kl > 0  # what the token-level bounds see


def test_noisy_moves_every_decoder_weight_by_the_asked_share_of_its_rms(
    monkeypatch: pytest.MonkeyPatch, tiny_llama: Path, tmp_path: Path
) -> None:
    import torch

    original, noisy = edited(monkeypatch, tiny_llama, tmp_path, "noisy")
    before = dict(original.named_parameters())
    linear = [n for n, m in noisy.model.layers.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linear
    after = dict(noisy.named_parameters())
    for name in linear:
        weight, reference = (
            after[f"model.layers.{name}.weight"].detach(),
            before[f"model.layers.{name}.weight"].detach(),
        )
        share = (weight - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()
        assert 0.015 < float(share) < 0.025, name
    torch.testing.assert_close(noisy.model.norm.weight, original.model.norm.weight)  # only the linears


def test_quotes_swaps_the_heads_quote_rows_and_keeps_the_input_side(
    monkeypatch: pytest.MonkeyPatch, tiny_llama: Path, tmp_path: Path
) -> None:
    import torch
    from tokenizers import Tokenizer

    original, quotes = edited(monkeypatch, tiny_llama, tmp_path, "quotes")
    pairs = gate_power.quote_twins(Tokenizer.from_file(str(tiny_llama / "tokenizer.json")).get_vocab())
    assert pairs and not quotes.config.tie_word_embeddings
    ids = torch.randint(0, original.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base, swapped = original(ids).logits, quotes(ids).logits
    order = torch.arange(base.shape[-1])
    for a, b in pairs:
        order[a], order[b] = b, a
    torch.testing.assert_close(swapped, base[..., order])  # the same hidden states, quote logits exchanged
    torch.testing.assert_close(quotes.model.embed_tokens.weight, original.model.embed_tokens.weight)


def test_quote_twins_pairs_each_double_quote_token_with_its_single_quote_spelling() -> None:
    vocab = {'"': 0, "'": 1, '":': 2, "':": 3, '",': 4, "a": 5, "'a'": 6, '"a"': 7, "\"'": 8, "''": 9}
    assert gate_power.quote_twins(vocab) == [(0, 1), (2, 3), (7, 6)]  # the token "' (both quotes) is left out


@pytest.mark.parametrize(
    ("expected", "verdict", "answer"),
    [("PASS", "PASS", "yes"), ("FAIL", "FAIL", "yes"), ("FAIL", "INCONCLUSIVE", "safe"),
     ("PASS", "FAIL", "NO"), ("FAIL", "PASS", "NO"), ("PASS", "INCONCLUSIVE", "NO")],
)  # fmt: skip
def test_right_reads_the_three_outcomes(expected: str, verdict: str, answer: str) -> None:
    assert gate_power.right({"expected": expected, "verdict": verdict}) == answer


def test_bf16_rounds_every_weight_to_bfloat16_and_saves_float32(
    monkeypatch: pytest.MonkeyPatch, tiny_llama: Path, tmp_path: Path
) -> None:
    import torch

    original, rounded = edited(monkeypatch, tiny_llama, tmp_path, "bf16")
    moved = 0
    for (name, before), (_, after) in zip(
        original.named_parameters(), rounded.named_parameters(), strict=True
    ):
        assert after.dtype == torch.float32, name
        assert torch.equal(after, before.to(torch.bfloat16).float()), name  # exactly the rounded value
        moved += int(not torch.equal(after, before))
    assert moved > 0  # the tiny model's float32 weights are not all bfloat16 values already


def test_a_rules_cell_shows_its_detectable_drop_and_what_was_kept_out() -> None:
    row = {
        "difference": -0.02, "ci_low": -0.05, "ci_high": 0.0, "p_value": 0.3, "verdict": "INCONCLUSIVE",
        "resolution": {"minimum_detectable_drop": 0.083}, "kept_out": [{"category": "irrelevance"}],
    }  # fmt: skip
    assert gate_power.suite_cell("tool_call", row) == (
        "tool_call: -2.0% [-5.0%, +0.0%] (p 0.3) INCONCLUSIVE; detects 8.3%; kept out: irrelevance"
    )
    same = {"difference": 0.0, "p_value": None, "verdict": "PASS", "resolution": None}
    assert gate_power.suite_cell("reasoning", same) == "reasoning: +0.0% PASS"
