"""Continuous batching and prefix caching (pipeline/runtime/serving.py) on the tiny random Llama's
ONNX Runtime engines of every kind the server batches: the unfused graph (left-padded rows),
GroupQueryAttention with a concat cache (right-padded rows), with a shared buffer (the slot
pool), and with an int8 shared buffer. Every request's greedy tokens equal running it alone,
whatever joins and leaves around it; prefix-cache hits, misses and evictions; limits."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest

from pipeline.core.artifacts import Artifact
from pipeline.runtime import Engine, GenerationConfig
from pipeline.runtime.serving import PrefixCache, Request, Server, ServingError, ServingLimits, serve
from tests.conftest import run_pass

# kv_cache settings of each engine kind (None: the unfused export); the fused ones run fusion=ort.
KINDS = {
    "unfused": None,
    "fused-concat": {},
    "fused-shared": {"layout": "shared"},
    "fused-shared-int8": {
        "layout": "shared",
        "dtype": "int8",
        "calibration": {"num_samples": 4, "seq_len": 64},
    },
}


def build_engine(graph: Artifact, cache: Path, kv_cache: dict | None, **target: object) -> Engine:
    from passes.fusion.fuse import FusionPass
    from passes.kv_cache import KvCachePass
    from passes.ort_build import OrtCpuBuildPass

    if kv_cache is not None:
        graph = run_pass(KvCachePass(**kv_cache), graph, cache)[0]
        graph = run_pass(FusionPass(), graph, cache)[0]
    return Engine(run_pass(OrtCpuBuildPass(**target), graph, cache)[0].path)


@pytest.fixture(scope="module", params=list(KINDS))
def engine(
    request: pytest.FixtureRequest, tiny_graph: Artifact, tmp_path_factory: pytest.TempPathFactory
) -> Engine:
    return build_engine(tiny_graph, tmp_path_factory.mktemp(request.param), KINDS[request.param])


def pooled(engine: Engine) -> bool:
    return engine.io.kv_layout == "shared"


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
    if pooled(engine):
        with pytest.raises(ServingError, match=r"max_kv_tokens=64 holds none: set it to at least 256$"):
            Server(engine, ServingLimits(max_kv_tokens=64))
        with pytest.raises(ServingError, match="exceeds the engine's max_length 256"):
            Server(engine).submit(Request(list(range(4, 254)), max_new_tokens=20))  # no slot holds it
        return
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
    # room for 50 positions; a pool's slot holds the engine's max_length: one slot
    server = Server(engine, ServingLimits(max_kv_tokens=engine.max_length if pooled(engine) else 50))
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
    from tests.passes.test_kv_cache import build, layout

    # the window changes what attention sees: layout() skips the fusion's parity check against
    # the unwindowed graph, as the kv_cache tests do
    window = Engine(build(layout(tiny_graph, tmp_path, layout="shared", window=8), tmp_path / "engine").path)
    with pytest.raises(
        ServingError, match=r"a sliding-window KV buffer .* evicts each row .* kv_cache=concat"
    ):
        serve(window, [Request([5, 6, 7], 4)])


def test_slots_are_reused_after_requests_finish(engine: Engine) -> None:
    """Two slots for seven requests: each finished request frees its slot for the next, the rows
    after it move down, and the pool is never reallocated."""
    if not pooled(engine):
        pytest.skip("the slot pool holds shared-buffer engines")
    requests = [
        Request(p, max_new_tokens=n, stop_at_eos=False)
        for p, n in zip(_prompts(7, seed=8), (9, 2, 6, 1, 11, 4, 3), strict=True)
    ]
    server = Server(engine, ServingLimits(max_sequences=2, max_kv_tokens=4 * engine.max_length))
    pool = list(server._batch.pool)
    assert server._batch.slots == 2 and pool[0].shape[:1] == (2,)
    streams = [server.submit(r) for r in requests]
    server.run()
    assert all(a is b for a, b in zip(server._batch.pool, pool, strict=True))
    assert max(server.batch_sizes) == 2
    for request, stream in zip(requests, streams, strict=True):
        assert stream.result().tokens == _alone(engine, request)


def test_a_static_batch_of_unequal_prompts_equals_each_alone(engine: Engine) -> None:
    """``generate_ids`` batches unequal prompts: left padding on the unfused graph, right padding
    (each row fed at its own length) on GroupQueryAttention engines."""
    prompts = _prompts(4, seed=9, low=2, high=30)
    config = GenerationConfig(max_new_tokens=7, stop_at_eos=False)
    batch = engine.generate_ids(prompts, config).tokens
    assert batch == [engine.generate_ids([p], config).tokens[0] for p in prompts]


def test_a_token_outside_the_vocabulary_is_refused_at_submit(engine: Engine) -> None:
    with pytest.raises(
        ServingError, match=r"prompt token id 330 is outside the engine's vocabulary \(0\.\.319\)"
    ):
        Server(engine).submit(Request([5, engine.io.vocab_size + 10, 7], 4))
