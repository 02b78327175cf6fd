"""Shared fixtures: a tiny random Llama checkpoint (built here, never downloaded), its ONNX
export and its ort-cpu engine, each made once per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.base import Pass
from pipeline.core.cache import Cache
from pipeline.core.manager import PassManager

TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog. Once upon a time, there was a small model "
    "that learned to count: one, two, three, four, five. Engines decode tokens one by one, "
    "and the cache keeps keys and values of every past token. 0123456789 +-*/=()[]{}<>"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2


def run_pass(step: Pass, source: Artifact, cache_root: Path) -> tuple[Artifact, dict[str, Any]]:
    """Run ``step`` on ``source`` as a recipe runs it: the real pass manager validates it (kinds,
    calibration processes, preflight), then requires, run in a staging folder, ensures and commit,
    into a throwaway cache at ``cache_root``. (The output artifact in the cache, its metrics.)"""
    artifact, (record,) = PassManager([step], Cache(cache_root), final_kind=None).run(source)
    return artifact, record.metrics


def make_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TOKENIZER_TEXT] * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.save_pretrained(folder)


def make_tiny_llama(folder: Path, seed: int = 0, **overrides: object) -> Path:
    """Save a random 2-layer Llama (GQA: 4 heads, 2 KV heads) with a byte-level BPE tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    make_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_source(tiny_llama: Path) -> Artifact:
    return Artifact.from_dir(Kind.TORCH, tiny_llama)


@pytest.fixture(scope="session")
def tiny_graph(tiny_source: Artifact, tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    from passes.export import ExportPass

    return run_pass(ExportPass(), tiny_source, tmp_path_factory.mktemp("tiny-graph"))[0]


@pytest.fixture(scope="session")
def tiny_engine(tiny_graph: Artifact, tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    from passes.ort_build import OrtCpuBuildPass

    return run_pass(OrtCpuBuildPass(), tiny_graph, tmp_path_factory.mktemp("tiny-engine"))[0]


def genai_greedy_tokens(engine_folder: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens ONNX Runtime GenAI's own generator makes from an engine folder."""
    import onnxruntime_genai as og

    model = og.Model(str(engine_folder))
    params = og.GeneratorParams(model)
    length = len(prompt) + new_tokens
    params.set_search_options(max_length=length, min_length=length, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens
