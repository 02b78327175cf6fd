"""Serving many requests on one engine: continuous batching and prefix caching.

**Continuous batching** (iteration-level scheduling, Yu et al. 2022, "Orca: A Distributed Serving
System for Transformer-Based Generative Models"): the running requests share one batch and its
KV cache; at every decode step, finished requests leave the batch and waiting ones join it. A
newcomer is prefilled alone (its prompt, or only the part after a cached prefix) and joins, so no
request waits for the longest one of a batch, and each row's attention sees only its own tokens:
greedy outputs are the ones each request gets alone. How the batch holds its cache depends on
the engine (:func:`batch_rows`):

- the unfused graph (masks with the attention mask): rows padded on the left to the longest,
  the newcomer's cache padded and stacked onto the batch (``_LeftPaddedRows``);
- GroupQueryAttention with a concat cache (``fusion=ort``): the kernel takes each row's length
  from the mask (``seqlens_k``) and writes its new KV at that length, so rows are padded on the
  right instead (``_RightPaddedRows``);
- GroupQueryAttention with a shared buffer (``kv_cache=shared``, fp32/fp16/int8): a pool of
  preallocated slots that ONNX Runtime updates in place; a request is prefilled straight into a
  free slot and frees it when done (``_SlotPool``: the CPU form of a paged cache, a page being a
  slot of max_length positions, since the kernel reads each row's KV as one contiguous span).

**Prefix caching** (block-hashed prefixes as in vLLM's automatic prefix caching, Kwon et al.
2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention"): after
a prefill, the KV of the prompt's first ``n * block`` tokens is kept under the hash chain of its
token blocks; a later prompt that starts with the same blocks takes the longest such prefix and
prefills only the rest. Entries are bounded by ``prefix_cache_tokens`` with LRU eviction.

**Limits** (:class:`ServingLimits`): at most ``max_sequences`` requests decode at once, and the
batch's KV cache (rows x the longest row, padding included, each row counted at its final
length) stays within ``max_kv_tokens``; a request that could never fit is refused when it is
submitted (:class:`ServingError`), one that does not fit now waits.

Refused with one line: a sliding-window buffer (a shared layout with ``kv_cache.window`` or a
model's own windows shorter than max_length, which evicts each row at its own length) and
engines on a GPU with a shared buffer (the pool lives in host memory).
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.core.errors import EngineError
from pipeline.runtime.generate import prompt_step, right_padded_mask

_DONE = object()


class ServingError(EngineError):
    """A request the server cannot take (too long for the limits or the engine)."""


@dataclass
class ServingLimits:
    """Scheduler limits: concurrent sequences, KV-cache tokens of the running batch, the prefix
    cache's size (0: no prefix caching) and block (prefixes are reused in whole blocks)."""

    max_sequences: int = 8
    max_kv_tokens: int = 65536
    prefix_cache_tokens: int = 0
    prefix_block: int = 64

    def __post_init__(self) -> None:
        for name in ("max_sequences", "max_kv_tokens", "prefix_block"):
            if int(getattr(self, name)) < 1:
                raise ServingError(f"serving limit {name}={getattr(self, name)} must be at least 1")
        if self.prefix_cache_tokens < 0:
            raise ServingError(f"serving limit prefix_cache_tokens={self.prefix_cache_tokens} must be >= 0")


@dataclass
class Request:
    """One generation request: prompt token ids and how many tokens to generate (greedy)."""

    prompt: Sequence[int]
    max_new_tokens: int = 64
    stop_at_eos: bool = True


@dataclass
class Completion:
    """What a request got: its tokens and when (perf_counter seconds)."""

    tokens: list[int]
    submitted: float
    first_token: float
    finished: float
    prefix_hit: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def ttft(self) -> float:
        return self.first_token - self.submitted

    @property
    def tpot(self) -> float | None:
        return (self.finished - self.first_token) / (len(self.tokens) - 1) if len(self.tokens) > 1 else None


class RequestStream:
    """The tokens of one request as they are generated: iterate (``for token in stream``, or
    ``async for`` in asyncio code), or wait for the :class:`Completion` with :meth:`result`."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.submitted = time.perf_counter()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._done = threading.Event()
        self._completion: Completion | None = None
        self._error: BaseException | None = None

    # producer side (the scheduler)
    def _emit(self, token: int) -> None:
        self._queue.put(token)

    def _finish(self, completion: Completion | None, error: BaseException | None = None) -> None:
        self._completion, self._error = completion, error
        self._done.set()
        self._queue.put(_DONE)

    # consumer side
    def __iter__(self) -> Iterator[int]:
        while (item := self._queue.get()) is not _DONE:
            yield item
        if self._error is not None:
            raise self._error

    async def __aiter__(self) -> AsyncIterator[int]:
        while (item := await asyncio.to_thread(self._queue.get)) is not _DONE:
            yield item
        if self._error is not None:
            raise self._error

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError("the request has not finished")
        if self._error is not None:
            raise self._error
        assert self._completion is not None
        return self._completion


class PrefixCache:
    """KV of prompt prefixes in whole blocks, found by the hash chain of their token blocks,
    bounded in tokens with least-recently-used eviction."""

    def __init__(self, max_tokens: int, block: int) -> None:
        self.max_tokens, self.block = max_tokens, block
        self._entries: OrderedDict[int, tuple[list[np.ndarray], list[str]]] = OrderedDict()
        self._index: dict[str, tuple[int, int]] = {}  # block-chain hash -> (entry id, tokens)
        self._next_id = 0
        self.tokens = 0
        self.hits = self.misses = self.evictions = 0

    def _chain(self, ids: Sequence[int], blocks: int) -> list[str]:
        digest, chain = hashlib.sha256(), []
        for index in range(blocks):
            digest.update(np.asarray(ids[index * self.block : (index + 1) * self.block], np.int64).tobytes())
            chain.append(digest.copy().hexdigest())
        return chain

    def lookup(self, ids: Sequence[int]) -> tuple[int, list[np.ndarray] | None]:
        """The longest cached prefix of ``ids`` that leaves at least one token to prefill:
        (its length, its KV arrays cut to that length) or (0, None)."""
        blocks = (len(ids) - 1) // self.block
        for position, key in reversed(list(enumerate(self._chain(ids, blocks)))):
            found = self._index.get(key)
            if found is None:
                continue
            entry_id, _ = found
            arrays, _ = self._entries[entry_id]
            self._entries.move_to_end(entry_id)
            self.hits += 1
            length = (position + 1) * self.block
            return length, [array[:, :, :length] for array in arrays]
        self.misses += 1
        return 0, None

    def insert(self, ids: Sequence[int], arrays: list[np.ndarray]) -> None:
        """Keep the KV of ``ids``' whole blocks (``arrays``: batch-1 caches of ``len(ids)``
        positions or more), unless it is already cached or larger than the cache."""
        blocks = len(ids) // self.block
        length = blocks * self.block
        if blocks == 0 or length > self.max_tokens:
            return
        chain = self._chain(ids, blocks)
        if chain[-1] in self._index:
            self._entries.move_to_end(self._index[chain[-1]][0])
            return
        while self.tokens + length > self.max_tokens and self._entries:
            self._evict()
        entry_id, self._next_id = self._next_id, self._next_id + 1
        self._entries[entry_id] = ([np.array(a[:, :, :length], copy=True) for a in arrays], chain)
        for position, key in enumerate(chain):
            self._index[key] = (entry_id, (position + 1) * self.block)
        self.tokens += length

    def _evict(self) -> None:
        entry_id, (arrays, chain) = self._entries.popitem(last=False)
        self.tokens -= arrays[0].shape[2]
        self.evictions += 1
        for key in chain:
            if self._index.get(key, (None,))[0] == entry_id:
                del self._index[key]
                # a longer or shorter live entry may hold the same block chain
                for other_id, (_, other_chain) in self._entries.items():
                    if key in other_chain:
                        self._index[key] = (other_id, (other_chain.index(key) + 1) * self.block)
                        break


@dataclass
class _Row:
    stream: RequestStream
    tokens: list[int]
    position: int  # KV positions the row holds (prompt + generated, the last token not yet fed)
    reserve: int  # KV positions this row may reach: prompt + max_new_tokens
    first_token: float
    prefix_hit: int
    done: bool = False


class _Rows(ABC):
    """How the running batch keeps its KV cache: which rows hold it, how a newcomer is prefilled
    and joins, one decode step for all, and how finished rows leave."""

    def __init__(self, model: Any, limits: ServingLimits) -> None:
        self.model, self.limits = model, limits
        self.rows: list[_Row] = []

    def fits(self, reserve: int) -> bool:
        """Whether a newcomer reserving ``reserve`` positions may join now."""
        return len(self.rows) < self.limits.max_sequences

    @abstractmethod
    def prefill(self, prompt: list[int], hit: int, cached: list[np.ndarray] | None) -> np.ndarray:
        """Run a newcomer's prompt after the ``hit`` positions ``cached`` holds (batch-1 host
        arrays); the logits of its last position. :meth:`join` follows at once."""

    @abstractmethod
    def prompt_arrays(self) -> list[np.ndarray]:
        """The newcomer's KV after :meth:`prefill`, as batch-1 host arrays (for the prefix cache)."""

    @abstractmethod
    def join(self, row: _Row) -> None:
        """Add the row just prefilled to the batch."""

    @abstractmethod
    def decode(self, last: np.ndarray) -> np.ndarray:
        """One step feeding ``last`` [rows, 1] at each row's position; logits [rows, vocab]."""

    @abstractmethod
    def leave(self, keep: list[int]) -> None:
        """Keep only the rows at ``keep`` (ascending indices)."""

    def clear(self) -> None:
        self.rows = []


class _StackedRows(_Rows):
    """A concat KV cache: the newcomer is prefilled in a cache of its own, which is then padded
    to the batch's width and stacked onto it (through host memory)."""

    def __init__(self, model: Any, limits: ServingLimits) -> None:
        super().__init__(model, limits)
        self.cache: Any = None  # the model's own cache (e.g. OrtValues), [rows, kv_heads, width, head_dim]
        self._newcomer: list[np.ndarray] = []

    def fits(self, reserve: int) -> bool:
        longest = max([reserve, *(row.reserve for row in self.rows)])
        return super().fits(reserve) and (len(self.rows) + 1) * longest <= self.limits.max_kv_tokens

    def prefill(self, prompt: list[int], hit: int, cached: list[np.ndarray] | None) -> np.ndarray:
        model = self.model
        cache = model.cache_from_arrays(cached) if cached is not None else model.empty_cache(1)
        ids = np.asarray(prompt[hit:], dtype=np.int64)[None]
        positions = np.arange(hit, len(prompt), dtype=np.int64)[None]
        last = np.array([ids.shape[1] - 1])
        logits, cache = prompt_step(model, ids, np.ones((1, len(prompt)), np.int64), positions, cache, last)
        self._newcomer = model.cache_arrays(cache)
        return logits[0, -1]

    def prompt_arrays(self) -> list[np.ndarray]:
        return self._newcomer

    def clear(self) -> None:
        super().clear()
        self.cache = None


class _LeftPaddedRows(_StackedRows):
    """Rows padded on the left to the longest (graphs that mask with the attention mask): a step
    appends one column for every row; positions are each row's own."""

    def __init__(self, model: Any, limits: ServingLimits) -> None:
        super().__init__(model, limits)
        self.mask: np.ndarray | None = None  # [rows, width]

    def join(self, row: _Row) -> None:
        arrays, self._newcomer = self._newcomer, []
        mask = np.ones((1, arrays[0].shape[2]), np.int64)
        if self.cache is None or self.mask is None:
            self.cache, self.mask, self.rows = self.model.cache_from_arrays(arrays), mask, [row]
            return
        length = max(self.mask.shape[1], mask.shape[1])
        self.cache = self.model.cache_from_arrays(
            [
                np.concatenate([_pad(old, length, left=True), _pad(new, length, left=True)], axis=0)
                for old, new in zip(self.model.cache_arrays(self.cache), arrays, strict=True)
            ]
        )
        self.mask = np.concatenate(
            [_pad(self.mask, length, left=True), _pad(mask, length, left=True)], axis=0
        )
        self.rows.append(row)

    def decode(self, last: np.ndarray) -> np.ndarray:
        assert self.cache is not None and self.mask is not None
        positions = np.array([[row.position] for row in self.rows], dtype=np.int64)
        mask = np.concatenate([self.mask, np.ones((len(self.rows), 1), np.int64)], axis=1)
        logits, self.cache = self.model.step(last, mask, positions, self.cache)
        self.mask = mask
        return logits[:, -1]

    def leave(self, keep: list[int]) -> None:
        """Padding every remaining row has on the left is cut away."""
        assert self.cache is not None and self.mask is not None
        mask = self.mask[keep]
        start = int((mask.cumsum(-1) == 0).sum(-1).min())  # columns that are padding in every row
        self.mask = mask[:, start:]
        arrays = self.model.cache_arrays(self.cache)
        self.cache = self.model.cache_from_arrays(
            [np.ascontiguousarray(a[keep][:, :, start:]) for a in arrays]
        )
        self.rows = [self.rows[index] for index in keep]

    def clear(self) -> None:
        super().clear()
        self.mask = None


class _RightPaddedRows(_StackedRows):
    """Rows padded on the right (GroupQueryAttention with a concat cache): each row's KV lies at
    positions 0..position-1, the mask says how many (``seqlens_k``), and the kernel writes each
    row's new KV at its own length; the batch is as wide as its longest row."""

    def join(self, row: _Row) -> None:
        arrays, self._newcomer = self._newcomer, []
        if self.cache is None:
            self.cache, self.rows = self.model.cache_from_arrays(arrays), [row]
            return
        old = self.model.cache_arrays(self.cache)
        width = max(old[0].shape[2], arrays[0].shape[2])
        self.cache = self.model.cache_from_arrays(
            [
                np.concatenate([_pad(a, width), _pad(b, width)], axis=0)
                for a, b in zip(old, arrays, strict=True)
            ]
        )
        self.rows.append(row)

    def decode(self, last: np.ndarray) -> np.ndarray:
        assert self.cache is not None
        lengths = np.array([row.position for row in self.rows], dtype=np.int64)
        logits, self.cache = self.model.step(
            last, right_padded_mask(lengths + 1), lengths[:, None], self.cache
        )
        return logits[:, -1]

    def leave(self, keep: list[int]) -> None:
        """Columns past the longest remaining row are cut away."""
        self.rows = [self.rows[index] for index in keep]
        width = max(row.position for row in self.rows)
        arrays = self.model.cache_arrays(self.cache)
        self.cache = self.model.cache_from_arrays(
            [np.ascontiguousarray(a[keep][:, :, :width]) for a in arrays]
        )


class _SlotPool(_Rows):
    """A shared KV buffer (GroupQueryAttention updating it in place) kept as a pool of slots: one
    preallocated host array per layer and kind, [slots, kv_heads, max_length, head_dim], which
    ONNX Runtime reads and writes without a copy. Row i of the batch is slot i: a newcomer is
    prefilled straight into the first free slot, a step runs on the first ``rows`` slots, and
    when rows finish, the rows after them move down (their valid positions only) so the running
    rows stay the first slots. This is the CPU form of a paged cache: a slot is one page of
    max_length positions, since the kernel reads each row's KV as one contiguous span."""

    def __init__(self, model: Any, limits: ServingLimits) -> None:
        super().__init__(model, limits)
        self.capacity = model.capacity
        self.slots = min(limits.max_sequences, limits.max_kv_tokens // self.capacity)
        if self.slots < 1:
            raise ServingError(
                f"a slot of the shared KV pool holds the engine's {self.capacity} positions; "
                f"max_kv_tokens={limits.max_kv_tokens} holds none: set it to at least {self.capacity}"
            )
        self.pool: list[np.ndarray] = model.shared_pool(self.slots)
        self._newcomer_length = 0

    def fits(self, reserve: int) -> bool:
        return len(self.rows) < self.slots

    def prefill(self, prompt: list[int], hit: int, cached: list[np.ndarray] | None) -> np.ndarray:
        slot = len(self.rows)
        if cached is not None:
            for array, prefix in zip(self.pool, cached, strict=True):
                array[slot, :, :hit] = prefix[0]
        ids = np.asarray(prompt[hit:], dtype=np.int64)[None]
        positions = np.arange(hit, len(prompt), dtype=np.int64)[None]
        cache = self.model.pool_cache(self.pool, slot, slot + 1)
        last = np.array([ids.shape[1] - 1])
        logits, _ = prompt_step(self.model, ids, np.ones((1, len(prompt)), np.int64), positions, cache, last)
        self._newcomer_length = len(prompt)
        return logits[0, -1]

    def prompt_arrays(self) -> list[np.ndarray]:
        slot, length = len(self.rows), self._newcomer_length
        return [array[slot : slot + 1, :, :length] for array in self.pool]  # the prefix cache copies

    def join(self, row: _Row) -> None:
        self.rows.append(row)

    def decode(self, last: np.ndarray) -> np.ndarray:
        lengths = np.array([row.position for row in self.rows], dtype=np.int64)
        cache = self.model.pool_cache(self.pool, 0, len(self.rows))
        logits, _ = self.model.step(last, right_padded_mask(lengths + 1), lengths[:, None], cache)
        return logits[:, -1]

    def leave(self, keep: list[int]) -> None:
        for slot, index in enumerate(keep):  # ascending: a row only moves down, onto a freed slot
            if slot != index:
                length = self.rows[index].position
                for array in self.pool:
                    array[slot, :, :length] = array[index, :, :length]
        self.rows = [self.rows[index] for index in keep]


class Server:
    """Continuous batching over one engine (see the module docstring). ``submit`` from any
    thread; the scheduler runs in :meth:`run` (until nothing is left) or in a background thread
    (:meth:`start` / :meth:`close`, or ``with Server(...) as server``)."""

    def __init__(self, engine: Any, limits: ServingLimits | None = None) -> None:
        self.engine = engine
        self.model = engine.model
        self.limits = limits or ServingLimits()
        self._batch = batch_rows(engine, self.limits)
        self.prefix_cache = (
            PrefixCache(self.limits.prefix_cache_tokens, self.limits.prefix_block)
            if self.limits.prefix_cache_tokens
            else None
        )
        self._waiting: deque[RequestStream] = deque()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self.batch_sizes: list[int] = []  # rows of each decode step run so far

    # ------------------------------------------------------------------ submitting
    def submit(self, request: Request) -> RequestStream:
        """Queue ``request``; a request that could never fit is refused here."""
        need = len(request.prompt) + request.max_new_tokens
        if not request.prompt or request.max_new_tokens < 1:
            raise ServingError("a request needs at least one prompt token and max_new_tokens >= 1")
        vocab = self.engine.io.vocab_size
        if not all(0 <= int(token) < vocab for token in request.prompt):
            bad = next(int(t) for t in request.prompt if not 0 <= int(t) < vocab)
            raise ServingError(f"prompt token id {bad} is outside the engine's vocabulary (0..{vocab - 1})")
        if need > self.engine.max_length:
            raise ServingError(
                f"a {len(request.prompt)}-token prompt plus {request.max_new_tokens} new tokens exceeds the "
                f"engine's max_length {self.engine.max_length}"
            )
        if need > self.limits.max_kv_tokens:
            raise ServingError(
                f"a {len(request.prompt)}-token prompt plus {request.max_new_tokens} new tokens needs {need} "
                f"KV positions, more than max_kv_tokens={self.limits.max_kv_tokens}: raise the limit or "
                "shorten the request"
            )
        stream = RequestStream(request)
        with self._lock:
            self._waiting.append(stream)
            self._lock.notify()
        return stream

    # ------------------------------------------------------------------ running
    def run(self) -> None:
        """Serve until no request is waiting or running."""
        while self._step():
            pass

    def start(self) -> Server:
        """Serve in a background thread until :meth:`close`."""
        self._thread = threading.Thread(target=self._serve_forever, name="pipeline-serving", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve_forever(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._batch.rows and not self._closing:
                    self._lock.wait()
                if self._closing and not self._waiting and not self._batch.rows:
                    return
            try:
                self._step()
            except Exception:  # the failed requests' streams carry the error; serve on
                continue

    def _step(self) -> bool:
        """Admit what fits, then one decode step for the batch; False when idle."""
        try:
            self._admit()
            if not self._batch.rows:
                return bool(self._waiting)
            self._decode()
        except Exception as exc:  # a failing step ends every running request with the error
            for row in self._batch.rows:
                row.stream._finish(None, exc)
            self._batch.clear()
            raise
        return True

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._waiting:
                    return
                stream = self._waiting[0]
                request = stream.request
                reserve = len(request.prompt) + request.max_new_tokens
                if not self._batch.fits(reserve):
                    if not self._batch.rows:  # cannot happen after submit's checks
                        raise ServingError(f"a {reserve}-position request does not fit the limits")
                    return
                self._waiting.popleft()
            try:
                self._prefill(stream, reserve)
            except Exception as exc:  # the newcomer's stream ends with the error, the batch goes on
                stream._finish(None, exc)
                raise

    def _prefill(self, stream: RequestStream, reserve: int) -> None:
        prompt = list(stream.request.prompt)
        hit, arrays = self.prefix_cache.lookup(prompt) if self.prefix_cache else (0, None)
        logits = self._batch.prefill(prompt, hit, arrays)
        token = int(logits.argmax())
        now = time.perf_counter()
        if self.prefix_cache is not None:
            self.prefix_cache.insert(prompt, self._batch.prompt_arrays())
        row = _Row(stream, [token], len(prompt), reserve, now, hit)
        stream._emit(token)
        self._batch.join(row)
        if self._finished(row):
            self._leave()

    def _decode(self) -> None:
        batch = self._batch
        last = np.array([[row.tokens[-1]] for row in batch.rows], dtype=np.int64)
        logits = batch.decode(last)
        self.batch_sizes.append(len(batch.rows))
        for row, token in zip(batch.rows, logits.argmax(-1), strict=True):
            row.tokens.append(int(token))
            row.position += 1
            row.stream._emit(int(token))
        if any([self._finished(row) for row in batch.rows]):  # a list: every row is checked
            self._leave()

    def _finished(self, row: _Row) -> bool:
        request = row.stream.request
        eos = request.stop_at_eos and row.tokens[-1] in self.engine.eos_token_ids
        row.done = len(row.tokens) >= request.max_new_tokens or eos
        return row.done

    def _leave(self) -> None:
        """Finished rows end their streams and leave the batch."""
        batch, now = self._batch, time.perf_counter()
        keep = [index for index, row in enumerate(batch.rows) if not row.done]
        for row in batch.rows:
            if row.done:
                stream = row.stream
                stream._finish(Completion(row.tokens, stream.submitted, row.first_token, now, row.prefix_hit))
        if keep:
            batch.leave(keep)
        else:
            batch.clear()


def batch_rows(engine: Any, limits: ServingLimits) -> _Rows:
    """How the server keeps this engine's running batch; a one-line ServingError for an engine
    it cannot batch."""
    io, model = engine.io, engine.model
    if io.left_padding and io.kv_layout == "concat" and hasattr(model, "cache_arrays"):
        return _LeftPaddedRows(model, limits)
    if io.left_padding or not hasattr(model, "cache_arrays"):
        raise ServingError(
            f"{engine.folder}: continuous batching needs an engine that takes left-padded batches with "
            "a concat KV cache, or a GroupQueryAttention engine (fusion=ort); this one has "
            f"kv_layout={io.kv_layout}, left_padding={io.left_padding}"
        )
    if io.kv_capacity:
        raise ServingError(
            f"{engine.folder}: a sliding-window KV buffer (kv_cache.window, or the model's own windows, "
            "with layout=shared) evicts each row at its own length, which the server cannot batch: serve "
            "an engine built with kv_cache=concat"
        )
    if io.kv_layout == "concat":
        return _RightPaddedRows(model, limits)
    if getattr(model, "device", "cpu") != "cpu" or not hasattr(model, "pool_cache"):
        raise ServingError(
            f"{engine.folder}: the slot pool of a shared KV buffer lives in host memory; serve this "
            "engine on the CPU (ort-cpu), or build it with kv_cache=concat"
        )
    return _SlotPool(model, limits)


def _pad(array: np.ndarray, length: int, left: bool = False) -> np.ndarray:
    """``array`` ([rows, positions] or [rows, heads, positions, dim]) padded with zeros on the
    right (or left) of its positions axis to ``length``."""
    axis = 1 if array.ndim == 2 else 2
    missing = length - array.shape[axis]
    if missing == 0:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (missing, 0) if left else (0, missing)
    return np.pad(array, widths)


def serve(engine: Any, requests: Sequence[Request], limits: ServingLimits | None = None) -> list[Completion]:
    """Serve ``requests`` (all submitted at once) with continuous batching; their completions
    in order."""
    server = Server(engine, limits)
    streams = [server.submit(request) for request in requests]
    server.run()
    return [stream.result() for stream in streams]
