"""ONNX Runtime execution of our exported graphs and ``ort-cpu`` engines.

The KV cache stays in ONNX Runtime's memory between steps: each step binds the previous
step's ``present.*`` OrtValues as ``past_key_values.*`` inputs through IOBinding, so no
per-step copy through numpy happens; logits are written straight into a numpy buffer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from pipeline.core.engine import (
    KV_LAYOUTS,
    KV_NUMPY_DTYPES,
    KV_ONNX_ELEMENT_TYPES,
    LOGITS_POSITIONS,
    TARGETS,
    DraftSpec,
    EngineSpec,
    IOSpec,
    read_engine_spec,
)
from pipeline.core.errors import ConfigError, EngineError, first_line
from pipeline.core.files import sha256_regular
from pipeline.core.gpu import require_ort_provider
from pipeline.core.graph_io import graph_layer_windows, graph_ops
from pipeline.runtime.chat_template import render_chat, template_file
from pipeline.runtime.generate import GenerationConfig, GenerationResult, generate, select_logits
from pipeline.runtime.serving import Completion, Request, ServingLimits, serve
from pipeline.runtime.speculative import DraftStats, speculative_generate

SUPPORTED_TARGETS = TARGETS
GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
# Where ONNX Runtime's TensorRT EP keeps the engines and timing cache it builds on this machine
# (``{cache}`` in an ort-trt engine's provider options).
ORT_TRT_CACHE_ENV = "PIPELINE_ORT_TRT_CACHE"


# CPU flags of an int8 dot product that accumulates in int32 (AVX-512 VNNI, AVX-VNNI, AMX).
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def int8_kernels_saturate(cpuinfo: str | None = None) -> bool:
    """Whether ONNX Runtime's CPU int8 kernels (MLAS, u8s8) saturate on this machine: an x86-64
    CPU without VNNI sums pairs of u8 x s8 products in int16 (``vpmaddubsw``), which overflows for
    full-range int8 weights (ONNX Runtime's quantization docs: saturation on AVX2/AVX-512 without
    VNNI, hence its ``reduce_range``). Measured 2026-12-06 on an AMD EPYC with AVX2 only: the
    tiny model's W8A8 graph strayed from its own Q/DQ semantics by 3.4x the quantization's mean
    logit error, against under 0.05x on CPUs with VNNI. ``cpuinfo``: /proc/cpuinfo's text (read
    here when None; a machine without it, or not x86, is taken as not saturating)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
                cpuinfo = handle.read(1 << 20)
        except OSError:
            return False
    flags = next(
        (line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), None
    )
    return flags is not None and "avx2" in flags and not VNNI_FLAGS & set(flags)


def session_options(
    threads: int = 0, optimization: str = "all", prepack: bool = True, spin: bool = True
) -> ort.SessionOptions:
    """ONNX Runtime's options for one of our sessions. ``prepack=False`` keeps the MatMul weights
    as they lie in the external data file (memory-mapped, reclaimable pages) instead of copying
    them into MLAS's packed layout: a session that runs a few steps (the parity checks) then
    holds the weights once, not twice during load (default model: peak 0.71 -> 0.62 GB,
    logits equal to 1e-5); an engine that serves keeps prepacking (faster GEMMs). ``spin=False``:
    the intra-op threads sleep as soon as a run ends instead of spinning for the next one, for a
    second session of the same engine (the prefill graph) whose idle threads would otherwise
    take cores from the decode session's."""
    options = ort.SessionOptions()
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads > 0:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    options.graph_optimization_level = levels[optimization]
    options.log_severity_level = 3
    return options


class OrtModel:
    """One decoder ONNX model in an ONNX Runtime session, stepped with a KV cache."""

    def __init__(
        self,
        model_path: Path,
        io: IOSpec,
        threads: int = 0,
        optimization: str = "all",
        providers: Sequence[str] = ("CPUExecutionProvider",),
        capacity: int = 0,
        provider_options: Sequence[dict[str, Any]] | None = None,
        prepack: bool = True,
        prefill_model_path: Path | None = None,
    ) -> None:
        self.io = io
        if io.kv_layout == "shared" and capacity <= 0:
            raise EngineError(
                f"{model_path}: a shared KV layout needs the buffer capacity (the engine's max_length)"
            )
        shared = io.kv_layout == "shared"
        # Each layer's buffer positions (its window buffer, else the engine's max_length).
        self.capacities = (
            tuple(io.layer_capacity(i, capacity) for i in range(io.num_layers)) if shared else ()
        )
        self.capacity = max(self.capacities, default=0)
        self._evicts = shared and bool(io.kv_capacity)  # some window-sized buffers evict in place
        # A sequence fits while every buffer that does not evict holds it (None: all evict).
        self._fits = None if shared and io.kv_capacity and all(io.kv_capacity) else self.capacity
        # on a GPU provider the KV cache stays in device memory between steps
        self.device = "cuda" if providers and providers[0] in GPU_PROVIDERS else "cpu"

        def load(path: Path, spin: bool = True) -> ort.InferenceSession:
            try:
                return ort.InferenceSession(
                    str(path),
                    session_options(threads, optimization, prepack, spin),
                    providers=list(providers),
                    provider_options=list(provider_options) if provider_options else None,
                )
            except Exception as exc:  # ORT raises its own pybind types (InvalidGraph, NoSuchFile, ...)
                raise EngineError(f"ONNX Runtime cannot load {path} ({first_line(exc)})") from None

        self.session = load(model_path)
        # An int8-KV engine's prefill graph (passes/fusion/int8_prefill.py): prompt tokens on the
        # fp32 attention path. Its session holds a second copy of the prepacked weights (ONNX
        # Runtime's Python API cannot share prepacked weights between sessions).
        self.prefill_session = (
            load(prefill_model_path, spin=False)
            if prefill_model_path is not None and self.device == "cpu" and not self._evicts
            else None
        )
        self._past_names = io.past_names()
        self._present_names = io.present_names()
        if io.kv_dtype not in KV_NUMPY_DTYPES:
            raise EngineError(
                f"{model_path}: the engine records a {io.kv_dtype} KV cache; this runtime holds "
                f"{', '.join(KV_NUMPY_DTYPES)}: rebuild it"
            )
        self._kv_dtype = KV_NUMPY_DTYPES[io.kv_dtype]
        self._kv_element_type = KV_ONNX_ELEMENT_TYPES.get(io.kv_dtype)

    def _cache_value(self, array: np.ndarray) -> ort.OrtValue:
        """An OrtValue of the cache's type from a host array (raw codes for float8)."""
        array = np.ascontiguousarray(array, dtype=self._kv_dtype)
        if self._kv_element_type is None:
            return ort.OrtValue.ortvalue_from_numpy(array, self.device)
        # numpy has no float8: ONNX Runtime takes the codes with their element type (host memory;
        # a GPU session copies it in on the first step).
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, self._kv_element_type)

    def empty_cache(self, batch: int) -> list[ort.OrtValue]:
        """The cache before the first step: empty tensors, or the zeroed shared buffers."""
        return [
            self._cache_value(np.zeros(shape, dtype=self._kv_dtype)) for shape in self._cache_shapes(batch)
        ]

    def _cache_shapes(self, batch: int) -> list[tuple[int, int, int, int]]:
        """Each cache input's shape: a layer's key and value each hold that layer's positions."""
        heads, width = self.io.num_kv_heads, self.io.head_dim
        positions = [size for size in self.capacities or (0,) * self.io.num_layers for _ in range(2)]
        return [(batch, heads, size, width) for size in positions]

    def step(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        cache: list[ort.OrtValue],
    ) -> tuple[np.ndarray, list[ort.OrtValue]]:
        """Run one forward; return logits [batch, seq, vocab] and the new cache."""
        binding = self.session.io_binding()
        logits = self._bind_tokens(binding, input_ids, attention_mask, position_ids)
        for name, value in zip(self._past_names, cache, strict=True):
            binding.bind_ortvalue_input(name, value)
        if self.capacity:  # GroupQueryAttention appends into the buffer it reads from
            self._check_capacity(attention_mask)
            for name, value in zip(self._present_names, cache, strict=True):
                binding.bind_ortvalue_output(name, value)
            self.session.run_with_iobinding(binding)
            return logits, cache
        for name in self._present_names:
            binding.bind_output(name, self.device)
        self.session.run_with_iobinding(binding)
        present = binding.get_outputs()[1:]
        return logits, list(present)

    def prompt_step(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        cache: list[ort.OrtValue],
        logits_at: np.ndarray | None = None,
    ) -> tuple[np.ndarray, list[ort.OrtValue]]:
        """:meth:`step` for prompt tokens (a prefill, a chunk of one, a scored continuation; not
        tokens the model generated): on an int8-KV engine the prefill graph runs them, its
        attention in fp32 over the values the int8 cache holds. It reads the cache as a concat
        cache; with a shared buffer, the past positions are fed as a copy and each row's new
        positions written back into the buffer. ``logits_at`` [batch]: the one position of each
        row (an index into this step's tokens) whose logits are wanted, returned as [batch, 1,
        vocab], which the prefill graph computes alone; None: every position."""
        if self.prefill_session is None:
            logits, cache = self.step(input_ids, attention_mask, position_ids, cache)
            return select_logits(logits, logits_at), cache
        binding = self.prefill_session.io_binding()
        wanted = (
            np.broadcast_to(np.arange(input_ids.shape[1]), input_ids.shape)
            if logits_at is None
            else np.asarray(logits_at).reshape(-1, 1)
        )
        logits = self._bind_tokens(binding, input_ids, attention_mask, position_ids, wanted)
        new = input_ids.shape[1]
        buffers = []
        if self.capacity:
            self._check_capacity(attention_mask)
            buffers = [value.numpy() for value in cache]  # views: writes land in the buffer
            past = attention_mask.shape[1] - new
            for name, buffer in zip(self._past_names, buffers, strict=True):
                binding.bind_cpu_input(name, np.ascontiguousarray(buffer[:, :, :past]))
        else:
            for name, value in zip(self._past_names, cache, strict=True):
                binding.bind_ortvalue_input(name, value)
        for name in self._present_names:
            binding.bind_output(name, "cpu")
        self.prefill_session.run_with_iobinding(binding)
        present = binding.get_outputs()[1:]
        if not self.capacity:
            return logits, list(present)
        # Each row's new tokens sit at max(length - new, 0)..length-1 (GroupQueryAttention's rule).
        lengths = attention_mask.sum(-1)
        for buffer, value in zip(buffers, present, strict=True):
            written = value.numpy()
            for row, length in enumerate(lengths.tolist()):
                start = max(length - new, 0)
                buffer[row, :, start:length] = written[row, :, start:length]
        return logits, cache

    def _bind_tokens(
        self,
        binding: Any,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        logits_positions: np.ndarray | None = None,
    ) -> np.ndarray:
        """Bind the token inputs (and the prefill graph's ``logits_positions``); return the
        logits buffer bound as the output."""
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask, dtype=np.int64))
        if self.io.has_position_ids:
            binding.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids, dtype=np.int64))
        shape = input_ids.shape
        if logits_positions is not None:
            binding.bind_cpu_input(LOGITS_POSITIONS, np.ascontiguousarray(logits_positions, dtype=np.int64))
            shape = logits_positions.shape
        logits = np.empty((*shape, self.io.vocab_size), dtype=np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        return logits

    def _check_capacity(self, attention_mask: np.ndarray) -> None:
        if self._fits is not None and attention_mask.shape[1] > self._fits:
            raise EngineError(
                f"{attention_mask.shape[1]} tokens exceed the shared KV buffer ({self._fits} positions)"
            )

    def cache_arrays(self, cache: list[ort.OrtValue]) -> list[np.ndarray]:
        """The cache as numpy arrays, for rearranging rows (continuous batching). Copies:
        ``OrtValue.numpy()`` is a view into memory the OrtValue owns and frees with it."""
        if self.capacity:
            raise EngineError("a shared KV buffer cannot be rearranged row by row")
        return [value.numpy().copy() for value in cache]

    def shared_pool(self, slots: int) -> list[np.ndarray]:
        """Zeroed host arrays of ``slots`` rows of the shared buffer, one per cache input: the
        server's slot pool (:mod:`pipeline.runtime.serving`), bound with :meth:`pool_cache`."""
        if not self.capacity or self.device != "cpu":
            raise EngineError(
                "a slot pool holds a shared KV buffer in host memory (ort-cpu, kv_cache=shared)"
            )
        return [np.zeros(shape, dtype=self._kv_dtype) for shape in self._cache_shapes(slots)]

    def pool_cache(self, pool: Sequence[np.ndarray], start: int, stop: int) -> list[ort.OrtValue]:
        """Slots ``start``..``stop - 1`` of ``pool`` as the cache of a batch of that many rows,
        without a copy: ONNX Runtime reads the arrays' memory and GroupQueryAttention writes
        each row's new positions into it (a slice of whole rows is contiguous)."""
        return [ort.OrtValue.ortvalue_from_numpy(array[start:stop]) for array in pool]

    def cache_from_arrays(self, arrays: Sequence[np.ndarray]) -> list[ort.OrtValue]:
        """A cache from numpy arrays (inverse of :meth:`cache_arrays`)."""
        return [self._cache_value(array) for array in arrays]

    def truncate_cache(self, cache: list[ort.OrtValue], length: int) -> list[ort.OrtValue]:
        """The cache of the first ``length`` positions (speculative decoding's rollback).

        A shared buffer needs no copy: GroupQueryAttention reads and writes it at the positions
        the attention mask gives, so rows past ``length`` are simply overwritten later. A buffer
        that evicts (a sliding window) cannot roll back and is refused.
        """
        if self.capacity:
            if self._evicts:
                raise EngineError("a sliding-window KV buffer cannot be rolled back for speculative decoding")
            return cache
        kept = [value.numpy()[:, :, :length].copy() for value in cache]  # not a view: see cache_arrays
        return [self._cache_value(array) for array in kept]


@dataclass
class GeneratedText:
    text: str
    token_ids: list[int]


class Engine:
    """A built engine folder: the model, its tokenizer and how it was built (``engine.json``).

    An engine built with ``speculative=draft`` holds a draft engine in a subfolder
    (``engine.json`` ``speculative: {draft, k}``); greedy single-sequence decoding then runs
    speculatively (:mod:`pipeline.runtime.speculative`), unless ``speculative=False``. Sampled
    decoding and batches of several prompts always run the target alone.

    An int8-KV ``ort-cpu`` engine runs prompt tokens through its prefill graph
    (``prefill_model_file``, :meth:`OrtModel.prompt_step`); ``prefill_graph=False`` runs them on
    the int8 kernel instead, without the prefill session's copy of the prepacked weights.
    """

    def __init__(
        self,
        folder: Path,
        threads: int = 0,
        speculative: bool = True,
        prepack: bool = True,
        prefill_graph: bool = True,
    ) -> None:
        self.folder = Path(folder)
        # engine.json is untrusted: every field typed and every file it names (graphs, their
        # external data, the tokenizer, the draft) confined to the folder, before any load
        self.engine_spec: EngineSpec = read_engine_spec(self.folder)
        spec = self.engine_spec
        self.spec = spec.raw
        self.io = spec.io
        spec_path = spec.path
        model_file = spec.model_path
        target = spec.target
        self.max_length = spec.max_length
        self.model: OrtModel | Any
        if target == "tensorrt":
            from pipeline.runtime.tensorrt import TrtModel

            self.model = TrtModel(model_file, self.io, self.spec)
        else:
            check_kv_layout(self.io, model_file, spec_path)
            providers = list(spec.providers)
            if providers[0] in GPU_PROVIDERS:  # ONNX Runtime would quietly run it on the CPU
                try:
                    require_ort_provider(providers[0])
                except ConfigError as exc:
                    raise EngineError(f"{self.folder} is a {target} engine: {exc}") from None
            self.model = OrtModel(
                model_file,
                self.io,
                threads=threads or spec.intra_op_num_threads,
                optimization=spec.graph_optimization_level,
                providers=providers,
                capacity=self.max_length,
                provider_options=resolve_provider_options(
                    list(spec.provider_options) if spec.provider_options else None
                ),
                prepack=prepack,
                prefill_model_path=spec.prefill_model_path if prefill_graph else None,
            )
        self._tokenizer: Any = None
        self.eos_token_ids: list[int] = list(spec.tokens.eos_token_ids)
        pad = spec.tokens.pad_token_id
        self.pad_token_id: int = (
            pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        )
        self.draft: Engine | None = None
        self.speculative_k = 0
        self.last_draft_stats: DraftStats | None = None  # of the latest speculative generate_ids
        if spec.speculative is not None and speculative:
            self.draft, self.speculative_k = self._load_draft(spec.speculative, threads)

    def _load_draft(self, plan: DraftSpec, threads: int) -> tuple[Engine, int]:
        draft = Engine(plan.folder, threads=threads, speculative=False)
        check_draft(self, draft)
        return draft, plan.k

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.folder, trust_remote_code=False)
        return self._tokenizer

    def generate_ids(
        self,
        prompts: Sequence[Sequence[int]],
        config: GenerationConfig | None = None,
        on_tokens: Callable[[np.ndarray], None] | None = None,
        use_draft: bool = True,
        cache: Any = None,
        past: int = 0,
    ) -> GenerationResult:
        """Token ids of each prompt's continuation; with a draft (and ``use_draft``), greedy
        single-prompt decoding is speculative and ``last_draft_stats`` tells how it went.
        ``cache`` holding ``past`` positions (a prefix prefilled once for several prompts): one
        prompt, its tokens after them, decoded by this engine alone."""
        config = config or GenerationConfig()
        longest = past + max((len(p) for p in prompts), default=0)
        if longest + config.max_new_tokens > self.max_length:
            raise EngineError(
                f"a {longest}-token prompt plus {config.max_new_tokens} new tokens exceeds this engine's "
                f"max_length {self.max_length}: shorten the prompt or lower max_new_tokens"
            )
        drafted = use_draft and self.draft is not None and cache is None
        if drafted and not config.do_sample and len(prompts) == 1:
            return self._generate_speculatively(prompts[0], config, on_tokens)
        # A GroupQueryAttention graph batches prompts of unequal length padded on the right,
        # except with a sliding-window buffer, which evicts rows at each row's own length.
        right_padded = not self.io.left_padding and not self.io.kv_capacity
        if self.io.left_padding or right_padded or len({len(p) for p in prompts}) <= 1:
            return generate(
                self.model,
                prompts,
                config,
                pad_id=self.pad_token_id,
                eos_ids=self.eos_token_ids,
                on_tokens=on_tokens,
                right_padded=right_padded,
                cache=cache,
                past=past,
            )
        return self._generate_one_by_one(prompts, config, on_tokens)

    def _generate_speculatively(
        self,
        prompt: Sequence[int],
        config: GenerationConfig,
        on_tokens: Callable[[np.ndarray], None] | None,
    ) -> GenerationResult:
        """Greedy decoding with the draft proposing; token for token the target's own output."""
        assert self.draft is not None
        k = self.speculative_k
        for engine in (self, self.draft):  # the verify step writes k + 1 positions past the end
            if len(prompt) + config.max_new_tokens + k > engine.max_length:
                raise EngineError(
                    f"a {len(prompt)}-token prompt plus {config.max_new_tokens} new tokens and {k} "
                    f"draft tokens exceeds max_length {engine.max_length} of {engine.folder}: shorten "
                    "the prompt or lower max_new_tokens"
                )

        def on_token(token: int) -> None:
            if on_tokens is not None:
                on_tokens(np.array([token], dtype=np.int64))

        result, stats = speculative_generate(
            self.model,
            self.draft.model,
            prompt,
            k=k,
            max_new_tokens=config.max_new_tokens,
            eos_ids=self.eos_token_ids,
            stop_at_eos=config.stop_at_eos,
            on_token=on_token,
        )
        self.last_draft_stats = stats
        return result

    def _generate_one_by_one(
        self,
        prompts: Sequence[Sequence[int]],
        config: GenerationConfig,
        on_tokens: Callable[[np.ndarray], None] | None,
    ) -> GenerationResult:
        """Prompts of unequal length on a graph that takes no left padding: each row alone.

        ``on_tokens`` still sees one array per step with a slot per prompt (-1 for the others).
        """
        tokens: list[list[int]] = []
        prefill, steps = 0.0, []
        for row, prompt in enumerate(prompts):

            def row_tokens(step_tokens: np.ndarray, row: int = row) -> None:
                if on_tokens is not None:
                    full = np.full(len(prompts), -1, dtype=np.int64)
                    full[row] = step_tokens[0]
                    on_tokens(full)

            result = generate(
                self.model,
                [prompt],
                config,
                pad_id=self.pad_token_id,
                eos_ids=self.eos_token_ids,
                on_tokens=row_tokens,
            )
            tokens.extend(result.tokens)
            prefill += result.prefill_seconds
            steps.extend(result.step_seconds)
        return GenerationResult(tokens, prefill, steps)

    def serve(self, requests: Sequence[Request], limits: ServingLimits | None = None) -> list[Completion]:
        """Serve ``requests`` with continuous batching (greedy; :mod:`pipeline.runtime.serving`);
        for streams per request, use ``Server(engine).submit``."""
        return serve(self, requests, limits)

    def generate(
        self,
        prompts: str | Sequence[str],
        config: GenerationConfig | None = None,
        stream: Callable[[int, str], None] | None = None,
        chat: bool = False,
    ) -> list[GeneratedText]:
        """Generate text for one or more prompts; ``stream(row, text_piece)`` gets pieces as decoded."""
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        tok = self.tokenizer
        if chat:  # the chat template already holds the special tokens the model expects
            where = template_file(self.folder)
            texts = [
                render_chat(tok, [{"role": "user", "content": t}], where=where, add_generation_prompt=True)
                for t in texts
            ]
        encoded = [tok(t, add_special_tokens=not chat)["input_ids"] for t in texts]
        emitted = ["" for _ in texts]
        so_far: list[list[int]] = [[] for _ in texts]

        def on_tokens(step_tokens: np.ndarray) -> None:
            for row, token in enumerate(step_tokens):
                if token < 0 or stream is None:
                    continue
                so_far[row].append(int(token))
                text = tok.decode(so_far[row], skip_special_tokens=True)
                if len(text) > len(emitted[row]) and not text.endswith("\ufffd"):
                    stream(row, text[len(emitted[row]) :])
                    emitted[row] = text

        result = self.generate_ids(encoded, config, on_tokens if stream else None)
        texts = [tok.decode(ids, skip_special_tokens=True) for ids in result.tokens]
        if stream is not None:  # flush text held back mid-character when generation ended
            for row, text in enumerate(texts):
                if len(text) > len(emitted[row]):
                    stream(row, text[len(emitted[row]) :])
        return [GeneratedText(text, ids) for text, ids in zip(texts, result.tokens, strict=True)]


def resolve_provider_options(options: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Provider options of ``engine.json`` for this machine: ``{cache}`` becomes the ORT
    TensorRT EP's cache folder (``$PIPELINE_ORT_TRT_CACHE`` or ``~/.cache/llm-pipeline/ort-trt``),
    created on first use."""
    if not options:
        return None
    folder = Path(os.environ.get(ORT_TRT_CACHE_ENV) or "~/.cache/llm-pipeline/ort-trt").expanduser()
    resolved = []
    for entry in options:
        values = {}
        for key, value in entry.items():
            if value == "{cache}":
                folder.mkdir(parents=True, exist_ok=True)
                value = str(folder)
            values[key] = value
        resolved.append(values)
    return resolved


def check_draft(target: Engine, draft: Engine) -> None:
    """Refuse a draft that cannot propose the target's tokens (see :func:`check_draft_folders`)."""
    check_draft_specs(target.engine_spec, draft.engine_spec)


def check_draft_folders(target_folder: Path, draft_folder: Path) -> None:
    """:func:`check_draft_specs` of two engine folders (their ``engine.json`` read and checked)."""
    check_draft_specs(read_engine_spec(target_folder), read_engine_spec(draft_folder))


def check_draft_specs(target: EngineSpec, draft: EngineSpec) -> None:
    """Refuse a draft of another vocabulary or tokenizer, and KV buffers that cannot roll back;
    from the engine folders and their ``engine.json``, before or without loading a session."""
    target_folder, draft_folder = target.folder, draft.folder
    target_io, draft_io = target.io, draft.io
    if draft_io.vocab_size != target_io.vocab_size:
        raise EngineError(
            f"draft {draft_folder} has a vocabulary of {draft_io.vocab_size} tokens, the target "
            f"{target_io.vocab_size}: a draft must share the target's tokenizer"
        )
    if draft.tokens != target.tokens or _tokenizer_digest(draft_folder) != (_tokenizer_digest(target_folder)):
        raise EngineError(f"draft {draft_folder} has another tokenizer than the target: rebuild the draft")
    for folder, io in ((target_folder, target_io), (draft_folder, draft_io)):
        if io.kv_capacity:
            raise EngineError(
                f"{folder} keeps a sliding-window KV buffer, which cannot roll back rejected "
                "draft tokens: build with kv_cache=concat or without speculative=draft"
            )


def _tokenizer_digest(folder: Path) -> str:
    path = folder / "tokenizer.json"
    if not os.path.lexists(path):
        return "absent"
    return sha256_regular(path, within=folder, what="an engine's tokenizer")


def check_kv_layout(io: IOSpec, model_file: Path, where: Path) -> None:
    """Refuse a KV layout the graph cannot run: shared buffers and sliding windows need
    GroupQueryAttention, which updates the buffer in place and bounds the attention span."""
    if io.kv_layout not in KV_LAYOUTS:
        raise EngineError(
            f"{where} records kv_layout '{io.kv_layout}'; this runtime knows {', '.join(KV_LAYOUTS)}"
        )
    if io.kv_capacity and io.kv_layout != "shared":
        raise EngineError(
            f"{where} records window buffers of {list(io.kv_capacity)} positions for kv_layout "
            f"'{io.kv_layout}': only a shared layout holds a window; rebuild it"
        )
    if io.kv_capacity:
        for layer, window in graph_layer_windows(model_file).items():
            size = io.kv_capacity[layer] if layer < len(io.kv_capacity) else 0
            if size and (window <= 0 or size < window):
                raise EngineError(
                    f"{where} records a {size}-position buffer for layer {layer}, whose attention "
                    f"window in {model_file.name} is {window if window > 0 else 'unbounded'}: a "
                    "buffer holds at least its layer's window; rebuild it"
                )
    if (io.kv_layout == "shared" or io.window) and "GroupQueryAttention" not in graph_ops(model_file):
        raise EngineError(
            f"{where} records kv_layout '{io.kv_layout}' (window {io.window}) but {model_file.name} has no "
            "GroupQueryAttention: rebuild the engine with fusion=ort"
        )
