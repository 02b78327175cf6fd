"""Serving many requests on one engine: continuous batching and prefix caching.

**Continuous batching** (iteration-level scheduling, Yu et al. 2022, "Orca: A Distributed Serving
System for Transformer-Based Generative Models"): the running requests share one left-padded
batch and its KV cache; at every decode step, finished requests leave the batch and waiting
ones join it. A newcomer is prefilled alone (its prompt, or only the part after a cached prefix),
then its cache is padded on the left to the batch's length and stacked onto the batch, so no
request waits for the longest one of a batch, and each row's attention sees only its own tokens
(mask zeros over the padding): greedy outputs are the ones each request gets alone.

**Prefix caching** (block-hashed prefixes as in vLLM's automatic prefix caching, Kwon et al.
2023, "Efficient Memory Management for Large Language Model Serving with PagedAttention"): after
a prefill, the KV of the prompt's first ``n * block`` tokens is kept under the hash chain of its
token blocks; a later prompt that starts with the same blocks takes the longest such prefix and
prefills only the rest. Entries are bounded by ``prefix_cache_tokens`` with LRU eviction.

**Limits** (:class:`ServingLimits`): at most ``max_sequences`` requests decode at once, and the
batch's KV cache (rows x the longest row, padding included, each row counted at its final
length) stays within ``max_kv_tokens``; a request that could never fit is refused when it is
submitted (:class:`ServingError`), one that does not fit now waits.

Works on engines whose graph takes left-padded batches with a concat KV cache (the unfused
export, ``kv_cache=none|concat``): GroupQueryAttention graphs mask from sequence lengths only
and the shared buffer is one preallocated cache, so those engines are refused here.
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.core.errors import EngineError

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
        self._entries[entry_id] = ([np.ascontiguousarray(a[:, :, :length]) for a in arrays], chain)
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
    position: int  # positions decoded so far (prompt + generated, the last token not yet fed)
    reserve: int  # KV positions this row may reach: prompt + max_new_tokens
    first_token: float
    prefix_hit: int
    done: bool = False


@dataclass
class _Batch:
    rows: list[_Row] = field(default_factory=list)
    # the model's own cache (e.g. OrtValues), per layer/kind [rows, kv_heads, length, head_dim];
    # it goes through numpy only when rows join or leave
    cache: Any = None
    mask: np.ndarray | None = None  # [rows, length]


class Server:
    """Continuous batching over one engine (see the module docstring). ``submit`` from any
    thread; the scheduler runs in :meth:`run` (until nothing is left) or in a background thread
    (:meth:`start` / :meth:`close`, or ``with Server(...) as server``)."""

    def __init__(self, engine: Any, limits: ServingLimits | None = None) -> None:
        self.engine = engine
        self.model = engine.model
        self.limits = limits or ServingLimits()
        io = engine.io
        if not io.left_padding or io.kv_layout != "concat" or not hasattr(self.model, "cache_arrays"):
            raise ServingError(
                f"{engine.folder}: continuous batching needs an engine that takes left-padded batches with "
                "a concat KV cache (fusion=none, kv_cache=none|concat); this one has "
                f"kv_layout={io.kv_layout}, left_padding={io.left_padding}"
            )
        self.prefix_cache = (
            PrefixCache(self.limits.prefix_cache_tokens, self.limits.prefix_block)
            if self.limits.prefix_cache_tokens
            else None
        )
        self._waiting: deque[RequestStream] = deque()
        self._lock = threading.Condition()
        self._batch = _Batch()
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
            self._batch = _Batch()
            raise
        return True

    def _fits(self, reserve: int) -> bool:
        rows = self._batch.rows
        if len(rows) >= self.limits.max_sequences:
            return False
        longest = max([reserve, *(row.reserve for row in rows)])
        return (len(rows) + 1) * longest <= self.limits.max_kv_tokens

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._waiting:
                    return
                stream = self._waiting[0]
                request = stream.request
                reserve = len(request.prompt) + request.max_new_tokens
                if not self._fits(reserve):
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
        model = self.model
        cache = model.cache_from_arrays(arrays) if arrays is not None else model.empty_cache(1)
        ids = np.asarray(prompt[hit:], dtype=np.int64)[None]
        logits, cache = model.step(
            ids, np.ones((1, len(prompt)), np.int64), np.arange(hit, len(prompt), dtype=np.int64)[None], cache
        )
        token = int(logits[0, -1].argmax())
        now = time.perf_counter()
        prefilled = model.cache_arrays(cache)
        if self.prefix_cache is not None:
            self.prefix_cache.insert(prompt, prefilled)
        row = _Row(stream, [token], len(prompt), reserve, now, hit)
        stream._emit(token)
        self._join(row, prefilled)
        if self._finished(row):
            self._leave()

    def _join(self, row: _Row, arrays: list[np.ndarray]) -> None:
        """Stack a prefilled row onto the batch, left-padding the shorter side."""
        batch, model = self._batch, self.model
        mask = np.ones((1, arrays[0].shape[2]), np.int64)
        if batch.cache is None or batch.mask is None:
            batch.cache, batch.mask, batch.rows = model.cache_from_arrays(arrays), mask, [row]
            return
        length = max(batch.mask.shape[1], mask.shape[1])
        batch.cache = model.cache_from_arrays(
            [
                np.concatenate([_left_pad(old, length), _left_pad(new, length)], axis=0)
                for old, new in zip(model.cache_arrays(batch.cache), arrays, strict=True)
            ]
        )
        batch.mask = np.concatenate([_left_pad(batch.mask, length), _left_pad(mask, length)], axis=0)
        batch.rows.append(row)

    def _decode(self) -> None:
        batch = self._batch
        assert batch.cache is not None and batch.mask is not None
        model = self.model
        last = np.array([[row.tokens[-1]] for row in batch.rows], dtype=np.int64)
        positions = np.array([[row.position] for row in batch.rows], dtype=np.int64)
        mask = np.concatenate([batch.mask, np.ones((len(batch.rows), 1), np.int64)], axis=1)
        logits, batch.cache = model.step(last, mask, positions, batch.cache)
        self.batch_sizes.append(len(batch.rows))
        batch.mask = mask
        tokens = logits[:, -1].argmax(-1)
        for row, token in zip(batch.rows, tokens, strict=True):
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
        """Finished rows leave; padding every remaining row has on the left is cut away."""
        batch, now = self._batch, time.perf_counter()
        keep = [index for index, row in enumerate(batch.rows) if not row.done]
        for row in batch.rows:
            if row.done:
                stream = row.stream
                stream._finish(Completion(row.tokens, stream.submitted, row.first_token, now, row.prefix_hit))
        if not keep:
            self._batch = _Batch()
            return
        assert batch.cache is not None and batch.mask is not None
        mask = batch.mask[keep]
        start = int((mask.cumsum(-1) == 0).sum(-1).min())  # columns that are padding in every row
        batch.mask = mask[:, start:]
        arrays = self.model.cache_arrays(batch.cache)
        batch.cache = self.model.cache_from_arrays(
            [np.ascontiguousarray(array[keep][:, :, start:]) for array in arrays]
        )
        batch.rows = [batch.rows[index] for index in keep]


def _left_pad(array: np.ndarray, length: int) -> np.ndarray:
    """``array`` ([rows, ..., positions] or [rows, heads, positions, dim]) padded with zeros
    on the left of its positions axis to ``length``."""
    axis = 1 if array.ndim == 2 else 2
    missing = length - array.shape[axis]
    if missing == 0:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (missing, 0)
    return np.pad(array, widths)


def serve(engine: Any, requests: Sequence[Request], limits: ServingLimits | None = None) -> list[Completion]:
    """Serve ``requests`` (all submitted at once) with continuous batching; their completions
    in order."""
    server = Server(engine, limits)
    streams = [server.submit(request) for request in requests]
    server.run()
    return [stream.result() for stream in streams]
