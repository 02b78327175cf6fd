"""llama.cpp as a peer in the engine benchmarks (``python -m benchmarks.fusion``).

Two GGUF models of the same checkpoint, run by llama-cpp-python (``pip install -e '.[bench]'``
builds it from source with the machine's native instructions: llama.cpp's ``GGML_NATIVE``):

- **Q4_1**: the default model's own GGUF, the file our source was converted from (found beside
  the source in ``models_dir/downloads/``, its sha256 checked against the source's record);
- **Q8_0**: made from that file by llama.cpp's own quantizer (``llama_model_quantize``, which
  ships in llama-cpp-python), requantizing: our checkpoint *is* the Q4_1 file dequantized, so
  its Q8_0 holds the weights our engines hold, rounded to 8 bits.

Greedy decoding on the same prompt token ids as our engines (the GGUF carries the same
tokenizer), timed like ours: TTFT is the prompt's evaluation plus the first token's argmax,
TPOT each further ``eval`` of one token plus its argmax. llama.cpp's own defaults otherwise
(prompt batches of ``n_batch`` = 512 tokens, its KV cache in f16 for ``n_ctx`` positions).

Its rows' recorded results are in the fusion tables of ``benchmarks/README.md``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import child_rss, peak_rss_script
from pipeline.runtime.generate import GenerationConfig, GenerationResult

PACKAGE = "llama-cpp-python"
Q8_0_FILE = "{stem}.Q8_0-requantized.gguf"


def available() -> str | None:
    """The installed llama-cpp-python version, or None."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return str(llama_cpp.__version__)


def system_info() -> str:
    """The instruction sets llama.cpp was built with (``llama_print_system_info``)."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode().strip()


def source_gguf(source_dir: Path) -> Path:
    """The GGUF our checkpoint in ``source_dir`` was converted from, checked against the sha256
    the conversion recorded (``source.json``); ValueError when there is none or it changed."""
    record_path = source_dir / "source.json"
    if not record_path.is_file():
        raise ValueError(f"{source_dir} records no GGUF it was converted from (no source.json)")
    record = json.loads(record_path.read_text())
    path = source_dir.parent / "downloads" / str(record["gguf_file"])
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != record["gguf_sha256"]:
        raise ValueError(f"{path} does not have the sha256 {source_dir}/source.json records")
    return path


def requantize_q8_0(gguf: Path, out: Path, threads: int) -> Path:
    """``gguf`` requantized to Q8_0 by llama.cpp's quantizer, written once into ``out`` (via a
    temporary name, renamed when complete)."""
    import llama_cpp

    target = out / Q8_0_FILE.format(stem=gguf.name.split(".")[0])
    if target.is_file():
        return target
    out.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    params.nthread = threads
    try:
        code = llama_cpp.llama_model_quantize(str(gguf).encode(), str(partial).encode(), params)
        if code != 0:
            raise RuntimeError(f"llama_model_quantize returned {code} for {gguf}")
        partial.rename(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


@dataclass
class LlamaCppIO:
    """The few IO facts the benchmark reads of an engine."""

    vocab_size: int
    kv_layout: str = "llama.cpp"
    kv_dtype: str = "float16"


class LlamaCppEngine:
    """A GGUF in llama.cpp behind the ``generate_ids`` interface of our ``Engine`` (one prompt,
    greedy)."""

    def __init__(self, gguf: Path, max_length: int, threads: int) -> None:
        from llama_cpp import Llama

        self.path = gguf
        self.llm = Llama(
            model_path=str(gguf), n_ctx=max_length, n_threads=threads, n_threads_batch=threads, verbose=False
        )
        self.io = LlamaCppIO(vocab_size=int(self.llm.n_vocab()))
        self.max_length = max_length
        self.layers = int(self.llm.metadata.get("llama.block_count", 0))

    def _next(self) -> int:
        import llama_cpp

        logits = np.ctypeslib.as_array(
            llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.io.vocab_size,)
        )
        return int(logits.argmax())

    def generate_ids(
        self, prompts: Sequence[Sequence[int]], config: GenerationConfig | None = None, **_: Any
    ) -> GenerationResult:
        config = config or GenerationConfig()
        (prompt,) = prompts
        llm = self.llm
        llm.reset()  # the next eval drops every cached position
        start = time.perf_counter()
        llm.eval(list(prompt))
        token = self._next()
        prefill = time.perf_counter() - start
        tokens, steps = [token], []
        for _step in range(config.max_new_tokens - 1):
            start = time.perf_counter()
            llm.eval([token])
            token = self._next()
            steps.append(time.perf_counter() - start)
            tokens.append(token)
        return GenerationResult([tokens], prefill, steps)

    def kv_cache_bytes(self) -> int:
        """llama.cpp allocates its f16 KV cache for ``n_ctx`` positions when the context is made."""
        import llama_cpp

        model = self.llm.model
        kv_width = llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model)
        kv_width *= llama_cpp.llama_model_n_head_kv(model)
        return 2 * self.layers * kv_width * self.max_length * 2


# Peak RSS of a fresh process, as the fusion benchmark measures our engines
# (``benchmarks.common.peak_rss_script``): the context holds the prompt and 64 tokens more.
PEAK_RSS_CHILD = peak_rss_script(
    "from pathlib import Path\n"
    "from benchmarks.llamacpp_peer import LlamaCppEngine\n"
    "engine = LlamaCppEngine(Path(sys.argv[1]), int(sys.argv[2]) + 64, int(sys.argv[3]))"
)


def peak_rss(gguf: Path, tokens: int, threads: int, repo: Path) -> dict[str, int]:
    """Resident memory of a fresh process after loading ``gguf`` and its peak while it decodes
    after ``tokens`` tokens (Linux only)."""
    return child_rss(PEAK_RSS_CHILD, [str(gguf), str(tokens), str(threads)], repo)
