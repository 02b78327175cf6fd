"""The llama.cpp peer of the fusion benchmark (``benchmarks.llamacpp_peer``): the source's own GGUF,
checked before use, and llama.cpp's Q8_0 of it, decoding greedily through llama-cpp-python.
Needs the ``bench`` extra (llama-cpp-python) and the default model's GGUF beside its converted
checkpoint (the README's first command puts it there); skipped without them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import llamacpp_peer
from pipeline.runtime.generate import GenerationConfig

pytest.importorskip("llama_cpp")

MODELS = Path(__file__).resolve().parents[2] / "artifacts" / "models"


def default_source() -> Path:
    sources = [p.parent for p in MODELS.glob("*/source.json")] if MODELS.is_dir() else []
    if not sources:
        pytest.skip("the default model is not converted here (python -m pipeline model=llama first)")
    return sources[0]


def test_a_changed_gguf_is_refused(tmp_path: Path) -> None:
    source = default_source()
    record = json.loads((source / "source.json").read_text())
    (tmp_path / "model").mkdir()
    (tmp_path / "downloads").mkdir()
    shutil.copy(source / "source.json", tmp_path / "model" / "source.json")
    (tmp_path / "downloads" / record["gguf_file"]).write_bytes(b"GGUF not the real file")
    with pytest.raises(ValueError, match="does not have the sha256"):
        llamacpp_peer.source_gguf(tmp_path / "model")
    with pytest.raises(ValueError, match=r"no source\.json"):
        llamacpp_peer.source_gguf(tmp_path / "downloads")


def test_q4_1_and_its_q8_0_decode_greedily_and_mostly_agree(tmp_path: Path) -> None:
    """Both files decode 12 tokens deterministically with the timings our engines report; the
    Q8_0 made by llama.cpp's quantizer is a real 8-bit file that agrees with the Q4_1 it came
    from on most greedy tokens of a natural prompt."""
    q4_1 = llamacpp_peer.source_gguf(default_source())
    q8_0 = llamacpp_peer.requantize_q8_0(q4_1, tmp_path, threads=2)
    assert q8_0.stat().st_size > 1.3 * q4_1.stat().st_size  # 8.5 vs 5.7 bits a weight
    assert llamacpp_peer.requantize_q8_0(q4_1, tmp_path, threads=2) == q8_0  # made once
    config = GenerationConfig(max_new_tokens=12, stop_at_eos=False)
    outputs = []
    for gguf in (q4_1, q8_0):
        engine = llamacpp_peer.LlamaCppEngine(gguf, max_length=128, threads=2)
        prompt = [engine.llm.tokenize(b"The capital of France is Paris. The capital of Italy is")]
        first, again = engine.generate_ids(prompt, config), engine.generate_ids(prompt, config)
        assert first.tokens == again.tokens and len(first.tokens[0]) == 12
        assert first.prefill_seconds > 0 and len(first.step_seconds) == 11
        assert engine.kv_cache_bytes() == 2 * 30 * 192 * 128 * 2  # 30 layers, 3 KV heads x 64, f16
        outputs.append(first.tokens[0])
    assert sum(a == b for a, b in zip(*outputs, strict=True)) >= 8
