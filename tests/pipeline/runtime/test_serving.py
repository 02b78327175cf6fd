"""Continuous batching and prefix caching (pipeline/runtime/serving.py) on the tiny random Llama's
ONNX Runtime engine: every request's greedy tokens equal running it alone, whatever joins and
leaves around it; prefix-cache hits, misses and evictions; limits."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest

from pipeline.core.artifacts import Artifact, Kind
from pipeline.runtime import Engine, GenerationConfig
from pipeline.runtime.serving import PrefixCache, Request, Server, ServingError, ServingLimits, serve


@pytest.fixture(scope="module")
def engine(tiny_engine: Artifact) -> Engine:
    return Engine(tiny_engine.path)


def _alone(engine: Engine, request: Request) -> list[int]:
    config = GenerationConfig(max_new_tokens=request.max_new_tokens, stop_at_eos=request.stop_at_eos)
    return engine.generate_ids([list(request.prompt)], config).tokens[0]


def _prompts(count: int, seed: int = 0, low: int = 3, high: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 300, size=int(rng.integers(low, high))).tolist() for _ in range(count)]


def test_outputs_equal_running_each_request_alone(engine: Engine) -> None:
    requests = [
        Request(prompt, max_new_tokens=n, stop_at_eos=False)
        for prompt, n in zip(_prompts(7), (5, 17, 1, 9, 12, 3, 20), strict=True)
    ]
    completions = engine.serve(requests, ServingLimits(max_sequences=3))
    for request, completion in zip(requests, completions, strict=True):
        assert completion.tokens == _alone(engine, request)
        assert len(completion.tokens) == request.max_new_tokens
        assert completion.submitted <= completion.first_token <= completion.finished


def test_join_and_leave_at_every_step_boundary(engine: Engine) -> None:
    """Output lengths 1..8 with room for 4: a request leaves after every step and a waiting one
    joins in its place, at every step, with prompts of every length."""
    prompts, lengths = _prompts(8, seed=1, low=2, high=30), range(1, 9)
    requests = [
        Request(p, max_new_tokens=n, stop_at_eos=False) for p, n in zip(prompts, lengths, strict=True)
    ]
    server = Server(engine, ServingLimits(max_sequences=4))
    streams = [server.submit(r) for r in requests]
    server.run()
    for request, stream in zip(requests, streams, strict=True):
        assert stream.result().tokens == _alone(engine, request)
    # every generated token past a request's first comes from one decode step over the batch
    assert sum(server.batch_sizes) == sum(n - 1 for n in lengths)
    assert server.batch_sizes[:4] == [4, 4, 4, 4]  # full while requests waited
    assert len(server.batch_sizes) == 10  # not 28: the rows share their steps


def test_end_of_sequence_ends_a_request_early(engine: Engine) -> None:
    prompt = _prompts(1, seed=2)[0]
    alone = _alone(engine, Request(prompt, max_new_tokens=30, stop_at_eos=False))
    eos = alone[4]  # make the model's fifth token the end-of-sequence token of this engine
    original = engine.eos_token_ids
    engine.eos_token_ids = [eos]
    try:
        (completion,) = engine.serve([Request(prompt, max_new_tokens=30)])
    finally:
        engine.eos_token_ids = original
    assert completion.tokens == alone[: alone.index(eos) + 1]


def test_prefix_cache_hit_gives_the_same_tokens(engine: Engine) -> None:
    system = _prompts(1, seed=3, low=150, high=151)[0]
    requests = [Request(system + tail, max_new_tokens=6, stop_at_eos=False) for tail in _prompts(3, seed=4)]
    limits = ServingLimits(max_sequences=1, prefix_cache_tokens=1024, prefix_block=64)
    server = Server(engine, limits)
    streams = [server.submit(r) for r in requests]
    server.run()
    completions = [s.result() for s in streams]
    assert [c.prefix_hit for c in completions] == [0, 128, 128]  # two whole blocks of the 150 shared tokens
    assert server.prefix_cache is not None and server.prefix_cache.hits == 2
    for request, completion in zip(requests, completions, strict=True):
        assert completion.tokens == _alone(engine, request)


def test_prefix_cache_evicts_the_least_recently_used() -> None:
    cache = PrefixCache(max_tokens=128, block=64)
    kv = [np.zeros((1, 2, 130, 4), np.float32)]
    a, b = list(range(130)), list(range(1000, 1130))
    cache.insert(a, kv)  # 128 tokens: full
    assert cache.lookup([*a, 7])[0] == 128
    cache.insert(b, kv)  # evicts a
    assert cache.evictions == 1 and cache.tokens == 128
    assert cache.lookup([*a, 7]) == (0, None)
    length, arrays = cache.lookup(b[:100])  # a shorter prompt takes the whole blocks it shares
    assert length == 64 and arrays is not None and arrays[0].shape == (1, 2, 64, 4)
    assert (cache.hits, cache.misses) == (2, 1)
    cache.insert(list(range(300)), [np.zeros((1, 2, 300, 4), np.float32)])  # larger than the cache
    assert cache.tokens == 128


def test_requests_that_cannot_fit_are_refused_at_submit(engine: Engine) -> None:
    server = Server(engine, ServingLimits(max_kv_tokens=64))
    with pytest.raises(ServingError, match="needs 70 KV positions, more than max_kv_tokens=64"):
        server.submit(Request(list(range(4, 54)), max_new_tokens=20))
    with pytest.raises(ServingError, match="exceeds the engine's max_length 256"):
        Server(engine).submit(Request(list(range(4, 254)), max_new_tokens=20))
    with pytest.raises(ServingError, match="max_sequences=0"):
        ServingLimits(max_sequences=0)


def test_requests_that_do_not_fit_now_wait(engine: Engine) -> None:
    """Room for one 40-position request at a time: they run one after another, all complete."""
    requests = [
        Request(p[:20], max_new_tokens=20, stop_at_eos=False) for p in _prompts(3, seed=5, low=20, high=30)
    ]
    server = Server(engine, ServingLimits(max_kv_tokens=50))
    streams = [server.submit(r) for r in requests]
    sizes = []
    while server._step():
        sizes.append(len(server._batch.rows))
    assert max(sizes) == 1
    for request, stream in zip(requests, streams, strict=True):
        assert stream.result().tokens == _alone(engine, request)


def test_streams_from_a_background_server(engine: Engine) -> None:
    requests = [Request(p, max_new_tokens=8, stop_at_eos=False) for p in _prompts(4, seed=6)]
    with Server(engine, ServingLimits(max_sequences=2)) as server:
        streams = [server.submit(r) for r in requests]
        collected: list[list[int]] = [[] for _ in streams]

        def read(index: int) -> None:
            collected[index] = list(streams[index])

        readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
        for reader in readers:
            reader.start()

        async def read_async() -> list[list[int]]:
            async def one(index: int) -> list[int]:
                return [token async for token in streams[index]]

            return list(await asyncio.gather(one(2), one(3)))

        collected[2:] = asyncio.run(read_async())
        for reader in readers:
            reader.join()
    for request, tokens, stream in zip(requests, collected, streams, strict=True):
        assert tokens == stream.result().tokens == _alone(engine, request)


def test_engines_that_cannot_batch_are_refused(tiny_graph: Artifact, tmp_path: Path) -> None:
    from passes.fusion.fuse import FusionPass
    from passes.ort_build import OrtCpuBuildPass

    (tmp_path / "fused").mkdir()
    FusionPass().run(tiny_graph, tmp_path / "fused")
    (tmp_path / "engine").mkdir()
    OrtCpuBuildPass().run(Artifact.from_dir(Kind.GRAPH, tmp_path / "fused"), tmp_path / "engine")
    with pytest.raises(ServingError, match="left-padded batches"):
        serve(Engine(tmp_path / "engine"), [Request([5, 6, 7], 4)])


def test_a_token_outside_the_vocabulary_is_refused_at_submit(engine: Engine) -> None:
    with pytest.raises(
        ServingError, match=r"prompt token id 330 is outside the engine's vocabulary \(0\.\.319\)"
    ):
        Server(engine).submit(Request([5, engine.io.vocab_size + 10, 7], 4))
