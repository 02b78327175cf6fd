"""The peer the fusion and quantization benchmarks race: ONNX Runtime GenAI's model builder graph
of the tiny random Llama, run by ``benchmarks.common.GenAIModelEngine`` through our
generation loop, decodes the same greedy tokens as our own engine of that checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import GenAIModelEngine
from pipeline.core.artifacts import Artifact
from pipeline.runtime.generate import GenerationConfig
from pipeline.runtime.ort import Engine


@pytest.fixture(scope="module")
def builder_folder(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("builder")
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(tiny_llama)]
    command += ["-o", str(work / "out"), "-p", "fp32", "-e", "cpu", "-c", str(work / "hf_cache")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return work / "out"


@pytest.mark.parametrize("share_buffer", [False, True])
def test_the_builder_graph_decodes_like_our_engine(
    builder_folder: Path, tiny_engine: Artifact, share_buffer: bool
) -> None:
    peer = GenAIModelEngine(builder_folder, threads=1, share_buffer=share_buffer)
    assert peer.io.kv_layout == ("shared" if share_buffer else "concat")
    ours = Engine(tiny_engine.path, threads=1)
    prompt = [[5, 17, 42, 99, 3, 250, 7, 64]]
    config = GenerationConfig(max_new_tokens=12, stop_at_eos=False)
    expected = ours.generate_ids(prompt, config).tokens
    result = peer.generate_ids(prompt, config)
    assert result.tokens == expected and len(expected[0]) == 12
    assert peer.last_draft_stats is None  # a builder folder decodes without a draft
