"""Quantization recipes side by side: size, TTFT, TPOT and quality of each ``quant=`` engine and of
ONNX Runtime GenAI's model-builder int4 model of the same checkpoint.

What one run does:

1. **Build** our engine for each recipe in ``--recipes`` with the real CLI, one subprocess each:
   ``python -m pipeline model=llama quant=<recipe> bench=none hydra.run.dir=<out>/<recipe>``
   (the pipeline cache makes a rerun cheap; the log goes to ``<out>/<recipe>.log``). A recipe
   without a config (Hydra: ``Could not find 'quant/<recipe>'``) is reported as *not available*
   and a recipe whose build fails as *failed*, with its last error line; neither stops the
   script. ``none`` is always built: it is the fp32 reference of every comparison. Each
   ``--variant LABEL RECIPE OVERRIDE...`` adds a row built with those overrides (default: the naive
   static INT8 baseline, ``int8`` without smoothing and every layer W8A8, and ``fp8`` with
   ``quant.fallback=auto``).
2. **Build** the model builder's int4 model (``python -m onnxruntime_genai.models.builder -i <hf
   folder> -o <out> -p int4 -e cpu``; round-to-nearest blocks of 32, fused graph with
   GroupQueryAttention and MatMulNBits) from the HF folder the ``none`` run used (its manifest's
   ``source.path``). The output is kept in the pipeline cache (``artifacts/cache/<key>``, key =
   source digest + builder options + onnxruntime-genai version + the pipeline's key libraries),
   so a rerun skips the build.
3. **Measure** every engine in this one process, batch 1, greedy, ``--threads`` intra-op threads:
   * size: bytes of every file of the engine folder (MiB), tokenizer included;
   * TTFT@512: ``Engine.generate_ids(prompt, max_new_tokens=1).prefill_seconds`` (one forward of
     a 512-token prompt plus the argmax);
   * TPOT: mean of ``GenerationResult.step_seconds`` over 64 tokens decoded after a 128-token
     prompt (``stop_at_eos=False``);
   each the median over ``--repeats`` runs after ``--warmup`` runs, interleaved across engines
   (run 1: A B C ..., run 2: A B C ...) so that load drift on a shared machine hits all alike.
   Prompts are seeded random token ids in [100, vocab) drawn as ``pipeline.bench`` draws them
   (``numpy.random.default_rng(--seed)``), the same for every engine.
   * quality vs our fp32 ``none`` engine on the held-out text (``evals/data/gpl-3.0.txt``, the
     same windows and settings as the runs' ``quality`` record): perplexity, mean
     KL(reference || candidate) per token and top-1 agreement, from ``evals.agreement.compare``.
     For our recipes it is the run manifest's ``quality`` when its reference is the ``none``
     engine, else measured here; the builder model is always scored here (result cached).

The builder's ``model.onnx`` follows the GenAI IO convention (``input_ids``, ``attention_mask``,
``past_key_values.{i}.key/value`` -> ``logits``, ``present.{i}.key/value``; no ``position_ids``:
GroupQueryAttention derives positions from the mask), so it runs through our ``OrtModel`` like
our engines, with shapes read from its ``genai_config.json``; the script checks the session's
inputs and outputs against that convention, and checks that greedy decoding through ``OrtModel``
gives the same 16 tokens as onnxruntime_genai's own ``og.Generator`` on an English prompt.

The table prints the TPOT ratio as none / recipe: above 1 means the recipe decodes faster. The
load average (1/5/15 min) before and after the measurement, the CPU and the thread count are
printed too, since this machine is shared and noisy. ``--json`` writes every number.

Run from the repository root::

    python benchmarks/quantization.py --recipes none fp8 int8 int4_awq int4_gptq --repeats 3
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: make ``pipeline`` importable
    sys.path.insert(0, str(REPO))

from pipeline.bench import host_info, summarize  # noqa: E402
from pipeline.config import QualityConfig  # noqa: E402
from pipeline.core.engine import IOSpec  # noqa: E402
from pipeline.core.errors import EngineError, PipelineError, first_line  # noqa: E402
from pipeline.runtime import Engine, GenerationConfig, OrtModel  # noqa: E402

DEFAULT_RECIPES = ["none", "fp8", "int8", "int4_awq", "int4_gptq"]
REFERENCE = "none"
DEFAULT_OUT = Path("artifacts/benchmarks/quantization")
TTFT_LENGTH = 512
DECODE_PROMPT_LENGTH = 128
DECODE_TOKENS = 64
BUILDER_PACKAGE = "onnxruntime-genai"
BUILDER_OPTIONS = {"precision": "int4", "execution_provider": "cpu"}
BUILDER_PASS_NAME = "ortgenai_model_builder"
BUILDER_PASS_VERSION = 1
GREEDY_CHECK_TOKENS = 16
GREEDY_CHECK_TEXT = "The history of the printing press begins in"
# Rows beside the plain recipes: the naive static INT8 baseline the int8 recipe must beat (no
# smoothing, every layer W8A8), and fp8 keeping its most sensitive layers in fp32.
DEFAULT_VARIANTS = [
    ["int8-naive", "int8", "quant.smooth=false", "quant.weight_only=[]", "quant.sensitivity.enabled=false"],
    ["fp8-fallback", "fp8", "quant.fallback=auto", "quant.kl_budget=0.01", "quant.max_fallback_layers=32"],
]
_RECIPE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_KV_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16"}


class UsageError(Exception):
    """A problem with the arguments or the artifacts found: one line, exit status 2."""


@dataclass
class Contestant:
    """One row of the table: a recipe's engine or the builder model, and what was found out."""

    name: str
    kind: str  # "recipe" or "builder"
    status: str = "ok"  # ok | not available | failed
    note: str = ""
    folder: Path | None = None
    build: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] | None = None
    engine: Engine | None = None
    size_bytes: int | None = None
    weight_bytes: int | None = None
    quality: dict[str, Any] | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# --------------------------------------------------------------------------- building our engines


def _tail(text: str, lines: int = 1) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(kept[-lines:]) if kept else "no output"


def build_recipe(
    recipe: str, out: Path, timeout_s: int, label: str | None = None, overrides: tuple[str, ...] = ()
) -> Contestant:
    """Run the pipeline CLI for ``quant=<recipe> <overrides>`` (a row named ``label``, default the
    recipe); never raises for a missing or failing recipe."""
    label = label or recipe
    row = Contestant(label, "recipe")
    run_dir = out / label
    manifest_path = run_dir / "manifest.json"
    manifest_path.unlink(missing_ok=True)  # a stale record must never stand in for a failed rebuild
    command = [
        sys.executable,
        "-m",
        "pipeline",
        "model=llama",
        f"quant={recipe}",
        *overrides,
        "bench=none",
        f"hydra.run.dir={run_dir}",
    ]
    log_path = out / f"{label}.log"
    _say(f"build  {label}: quant={recipe} {' '.join(overrides)} ...")
    start = time.perf_counter()
    try:
        result = subprocess.run(
            command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        row.status, row.note = "failed", f"build took over {timeout_s} s (raise --build-timeout)"
        _say(f"build  quant={recipe}: {row.note}")
        return row
    seconds = round(time.perf_counter() - start, 1)
    log_path.write_text(f"$ {' '.join(command)}\n{result.stdout}\n{result.stderr}")
    row.build = {"command": command, "returncode": result.returncode, "seconds": seconds}
    row.build["log"] = str(log_path)
    if result.returncode != 0:
        if f"Could not find 'quant/{recipe}'" in result.stderr:
            row.status, row.note = "not available", f"no configs/quant/{recipe}.yaml yet"
        else:
            errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
            row.status = "failed"
            row.note = f"build failed (exit {result.returncode}): " + (
                errors[-1] if errors else _tail(result.stderr)
            )
        _say(f"build  quant={recipe}: {row.status} ({row.note}; log {log_path})")
        return row
    if not manifest_path.is_file():
        row.status, row.note = "failed", f"the run wrote no {manifest_path}"
        return row
    row.manifest = json.loads(manifest_path.read_text())
    row.folder = run_dir / row.manifest["engine"]["path"]
    files = row.manifest["engine"]["files"]
    row.size_bytes = sum(f["bytes"] for f in files)
    row.weight_bytes = sum(f["bytes"] for f in files if f["path"].startswith("model.onnx"))
    hits = [p.get("cache_hit", False) for p in row.manifest.get("passes", [])]
    row.build["passes_cached"] = f"{sum(hits)}/{len(hits)}"
    _say(f"build  quant={recipe}: ok ({seconds} s, {sum(hits)}/{len(hits)} passes from the cache)")
    return row


# --------------------------------------------------------------------------- the model builder


def builder_version() -> str | None:
    try:
        return importlib.metadata.version(BUILDER_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def build_builder_model(
    source_dir: Path, source_digest: str, out: Path, timeout_s: int, precision: str = "int4"
) -> Contestant:
    """The model builder's ``precision`` (int4, fp32) model of ``source_dir``, from the cache or built now."""
    from pipeline.core.artifacts import Kind, folder_digest
    from pipeline.core.cache import Cache, cache_key

    version = builder_version()
    row = Contestant(f"builder {precision} (ORT GenAI {version or '-'})", "builder")
    if version is None or importlib.util.find_spec("onnxruntime_genai") is None:
        row.status = "not available"
        row.note = f"{BUILDER_PACKAGE} is not installed: pip install -e '.[bench]'"
        _say(f"build  builder {precision}: {row.note}")
        return row
    options = {**BUILDER_OPTIONS, "precision": precision, BUILDER_PACKAGE: version}
    key = cache_key(source_digest, BUILDER_PASS_NAME, BUILDER_PASS_VERSION, options)
    cache = Cache(REPO / "artifacts" / "cache")
    row.build = {"cache_key": key, "options": options, "source": str(source_dir)}
    entry = cache.lookup(key, Kind.ENGINE)
    if entry is not None:
        row.build.update(cache_hit=True, seconds=0.0)
        _say(f"build  builder {precision}: ok (from the cache, {key[:12]})")
    else:
        _say(f"build  builder {precision} ...")
        with cache.stage(key) as staging:
            output = staging / "output"
            command = [
                sys.executable,
                "-m",
                "onnxruntime_genai.models.builder",
                "-i",
                str(source_dir),
                "-o",
                str(output),
                "-p",
                precision,
                "-e",
                BUILDER_OPTIONS["execution_provider"],
                "-c",
                str(staging / "hf_cache"),  # the builder's default is ./cache_dir in the cwd
            ]
            log_path = out / f"builder-{precision}.log"
            start = time.perf_counter()
            try:
                result = subprocess.run(
                    command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False
                )
            except subprocess.TimeoutExpired:
                row.status, row.note = "failed", f"builder took over {timeout_s} s (raise --build-timeout)"
                return row
            log_path.write_text(f"$ {' '.join(command)}\n{result.stdout}\n{result.stderr}")
            seconds = round(time.perf_counter() - start, 1)
            row.build.update(command=command, returncode=result.returncode, seconds=seconds)
            row.build["log"] = str(log_path)
            if result.returncode != 0 or not (output / "genai_config.json").is_file():
                row.status = "failed"
                row.note = f"builder failed (exit {result.returncode}): {_tail(result.stderr)}"
                _say(f"build  builder {precision}: {row.note} (log {log_path})")
                return row
            record = {
                "pass": BUILDER_PASS_NAME,
                "version": BUILDER_PASS_VERSION,
                "config": options,
                "input_digest": source_digest,
                "output_digest": folder_digest(output),
                "seconds": seconds,
            }
            entry = cache.commit(key, staging, Kind.ENGINE, record)
        row.build["cache_hit"] = False
        _say(f"build  builder {precision}: ok ({row.build['seconds']} s, cached as {key[:12]})")
    row.folder = entry.artifact.path
    row.build["digest"] = entry.artifact.digest
    files = [p for p in row.folder.rglob("*") if p.is_file()]
    row.size_bytes = sum(p.stat().st_size for p in files)
    row.weight_bytes = sum(p.stat().st_size for p in files if p.name.startswith("model.onnx"))
    return row


class GenAIModelEngine(Engine):
    """An ONNX Runtime GenAI model folder (``genai_config.json`` + decoder ONNX) run through our
    ``OrtModel``: the same generation loop, timing and quality code as our engines."""

    def __init__(self, folder: Path, threads: int = 0, share_buffer: bool = False) -> None:  # no engine.json
        """``share_buffer``: bind one KV buffer of the context length per layer, as GenAI does when
        the folder's ``search.past_present_share_buffer`` is set (otherwise concat, as before)."""
        self.folder = Path(folder)
        try:
            genai = json.loads((self.folder / "genai_config.json").read_text())
            model = genai["model"]
            decoder = model["decoder"]
            names = decoder["inputs"]
            model_file = self.folder / decoder["filename"]
            head_dim = int(decoder["head_size"])
            num_layers = int(decoder["num_hidden_layers"])
            num_kv_heads = int(decoder["num_key_value_heads"])
            vocab = int(model["vocab_size"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{self.folder}/genai_config.json is unusable ({first_line(exc)})") from None
        if names.get("past_key_names") != "past_key_values.%d.key":
            raise EngineError(f"{model_file} names its KV cache {names.get('past_key_names')!r}")
        search = genai.get("search", {})
        self.max_length = int(model.get("context_length") or search.get("max_length", 2048))
        shared = share_buffer and bool(search.get("past_present_share_buffer"))
        io = IOSpec(
            num_layers,
            num_kv_heads,
            head_dim,
            vocab,
            has_position_ids="position_ids" in names,
            left_padding=False,  # GroupQueryAttention
            kv_layout="shared" if shared else "concat",
        )
        capacity = self.max_length if shared else 0
        self.model = OrtModel(model_file, io, threads=threads, capacity=capacity)
        inputs = {i.name: i for i in self.model.session.get_inputs()}
        outputs = [o.name for o in self.model.session.get_outputs()]
        expected_in = {"input_ids", "attention_mask", *io.past_names()} | (
            {"position_ids"} if io.has_position_ids else set()
        )
        expected_out = {"logits", *io.present_names()}  # bound by name, so their order is free
        if set(inputs) != expected_in or set(outputs) != expected_out:
            differ = sorted((set(inputs) ^ expected_in) | (set(outputs) ^ expected_out))
            raise EngineError(
                f"{model_file} does not follow the GenAI IO convention OrtModel runs ({differ} differ)"
            )
        kv_type = inputs[io.past_names()[0]].type
        if kv_type not in _KV_DTYPES:
            raise EngineError(f"{model_file} keeps its KV cache as {kv_type}; OrtModel takes float/float16")
        if _KV_DTYPES[kv_type] != io.kv_dtype:  # an fp16 cache: reopen with the matching buffers
            io = replace(io, kv_dtype=_KV_DTYPES[kv_type])
            self.model = OrtModel(model_file, io, threads=threads, capacity=capacity)
        self.io = io
        self.io_names = {"inputs": list(inputs), "outputs": outputs}
        self.spec = {"target": "ort-cpu", "model_file": decoder["filename"], "max_length": self.max_length}
        self._tokenizer: Any = None
        eos = model.get("eos_token_id", [])
        self.eos_token_ids = [int(t) for t in (eos if isinstance(eos, list) else [eos])]
        self.pad_token_id = int(model.get("pad_token_id", self.eos_token_ids[0] if self.eos_token_ids else 0))
        self.draft = None  # a builder folder has no speculative draft
        self.speculative_k = 0
        self.last_draft_stats = None


def genai_greedy_check(engine: GenAIModelEngine) -> dict[str, Any]:
    """Greedy tokens from onnxruntime_genai's own generator vs ours through ``OrtModel``."""
    import onnxruntime_genai as og

    prompt = engine.tokenizer(GREEDY_CHECK_TEXT)["input_ids"]
    ours = engine.generate_ids(
        [prompt], GenerationConfig(max_new_tokens=GREEDY_CHECK_TOKENS, stop_at_eos=False)
    ).tokens[0]
    model = og.Model(str(engine.folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + GREEDY_CHECK_TOKENS, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray([prompt], dtype=np.int32))
    theirs: list[int] = []
    while not generator.is_done() and len(theirs) < GREEDY_CHECK_TOKENS:
        generator.generate_next_token()
        theirs.append(int(generator.get_next_tokens()[0]))
    del generator, model
    return {
        "tokens": GREEDY_CHECK_TOKENS,
        "ort_model": ours,
        "onnxruntime_genai": theirs,
        "agree": ours == theirs,
    }


# --------------------------------------------------------------------------- quality


def quality_config(reference: Contestant) -> QualityConfig:
    """The settings the runs scored quality with (from the ``none`` manifest), else the defaults."""
    recorded = ((reference.manifest or {}).get("quality") or {}).get("config") or {}
    fields = QualityConfig.__dataclass_fields__
    return QualityConfig(**{k: v for k, v in recorded.items() if k in fields})


def score(row: Contestant, reference: Contestant, config: QualityConfig) -> dict[str, Any]:
    """Quality of ``row`` vs the ``none`` engine: from its run manifest when that compared against
    the ``none`` engine with these settings, else measured here (cached for the builder model)."""
    import hashlib

    from evals.agreement import compare
    from pipeline.core.artifacts import write_json
    from pipeline.core.cache import library_versions

    assert row.engine is not None and reference.engine is not None and reference.manifest is not None
    ref_digest = reference.manifest["engine"]["digest"]
    recorded = (row.manifest or {}).get("quality")
    if recorded and recorded.get("reference") == ref_digest and recorded.get("config") == asdict(config):
        return {**recorded, "source": "run manifest"}
    digest = row.build.get("digest") or (row.manifest or {}).get("engine", {}).get("digest")
    payload = {"engine": digest, "reference": ref_digest, "config": asdict(config)}
    key = hashlib.sha256(json.dumps({**payload, "libs": library_versions()}, sort_keys=True).encode())
    stored = REPO / "artifacts" / "cache" / "quality" / f"{key.hexdigest()}.json"
    if digest and stored.is_file():
        return {**json.loads(stored.read_text()), "cache_hit": True, "source": "measured here (cached)"}
    _say(f"quality {row.name} vs {REFERENCE} ...")
    same = digest == ref_digest
    record = {**compare(row.engine, None if same else reference.engine, config), **payload}
    if digest:
        stored.parent.mkdir(parents=True, exist_ok=True)
        write_json(stored, record)
    return {**record, "cache_hit": False, "source": "measured here"}


# --------------------------------------------------------------------------- timing


def make_prompt(rng: np.random.Generator, vocab: int, length: int) -> list[list[int]]:
    low = min(100, vocab // 4)  # skip the special tokens at the start of the vocabulary
    return rng.integers(low, vocab, size=(1, length)).tolist()


def measure_speed(rows: list[Contestant], args: argparse.Namespace) -> dict[str, Any]:
    """TTFT@512 and TPOT of every engine, interleaved per run; fills ``row.samples``."""
    from tqdm.auto import tqdm

    engines = [r for r in rows if r.ok and r.engine is not None]
    vocabs = {r.engine.io.vocab_size for r in engines if r.engine is not None}
    if len(vocabs) != 1:
        raise UsageError(f"the engines disagree on the vocabulary ({sorted(vocabs)}): not one model")
    vocab = vocabs.pop()
    for r in engines:
        assert r.engine is not None
        if max(TTFT_LENGTH + 1, DECODE_PROMPT_LENGTH + DECODE_TOKENS) > r.engine.max_length:
            raise UsageError(f"{r.name}: max_length {r.engine.max_length} is too short for the prompts")
    rng = np.random.default_rng(args.seed)
    ttft_prompt = make_prompt(rng, vocab, TTFT_LENGTH)
    decode_prompt = make_prompt(rng, vocab, DECODE_PROMPT_LENGTH)
    one = GenerationConfig(max_new_tokens=1, stop_at_eos=False)
    many = GenerationConfig(max_new_tokens=DECODE_TOKENS, stop_at_eos=False)
    runs = args.warmup + args.repeats
    load_before = os.getloadavg()
    started = time.perf_counter()
    bar = tqdm(total=runs * len(engines), desc="measure", unit="engine-run", file=sys.stderr)
    for index in range(runs):
        keep = index >= args.warmup
        for r in engines:  # A B C ... then again A B C ...
            assert r.engine is not None
            ttft = r.engine.generate_ids(ttft_prompt, one).prefill_seconds
            result = r.engine.generate_ids(decode_prompt, many)
            if len(result.tokens[0]) != DECODE_TOKENS:
                raise EngineError(f"{r.name} produced {len(result.tokens[0])} tokens, not {DECODE_TOKENS}")
            if keep:
                r.samples.setdefault("ttft", []).append(ttft)
                r.samples.setdefault("tpot", []).append(statistics.mean(result.step_seconds))
            bar.update()
    bar.close()
    return timing_record(load_before, started)


def timing_record(load_before: tuple[float, float, float], started: float) -> dict[str, Any]:
    """Load average before and now, and the seconds since ``started`` (perf_counter)."""
    return {
        "load_average": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in os.getloadavg()],
        },
        "seconds": round(time.perf_counter() - started, 1),
    }


# --------------------------------------------------------------------------- the run


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: Path = (REPO / args.out).resolve() if not args.out.is_absolute() else args.out
    out.mkdir(parents=True, exist_ok=True)
    load_at_start = os.getloadavg()
    started = time.perf_counter()
    recipes = list(dict.fromkeys([REFERENCE, *args.recipes]))  # none first, always: the reference
    rows = [build_recipe(recipe, out, args.build_timeout) for recipe in recipes]
    for label, recipe, *overrides in DEFAULT_VARIANTS if args.variant is None else args.variant:
        rows.append(build_recipe(recipe, out, args.build_timeout, label, tuple(overrides)))
    reference = rows[0]
    if not reference.ok or reference.manifest is None:
        raise UsageError(f"the reference recipe quant={REFERENCE} did not build: {reference.note}")
    source = reference.manifest["source"]
    source_dir = Path(source["path"])
    source_dir = source_dir if source_dir.is_absolute() else REPO / source_dir
    if not (source_dir / "config.json").is_file():
        raise UsageError(f"source.path {source['path']} of the {REFERENCE} run is not an HF model folder")
    builder = build_builder_model(source_dir, source["digest"], out, args.build_timeout)
    rows.append(builder)

    for row in rows:
        if not row.ok or row.folder is None:
            continue
        try:
            if row.kind == "builder":
                row.engine = GenAIModelEngine(row.folder, threads=args.threads)
                row.build["io"] = row.engine.io_names
            else:
                row.engine = Engine(row.folder, threads=args.threads)
        except PipelineError as exc:
            if row is reference:
                raise
            row.status, row.note = "failed", f"cannot load: {exc}"
    timing = measure_speed(rows, args)

    greedy = None
    if builder.ok and isinstance(builder.engine, GenAIModelEngine):
        greedy = genai_greedy_check(builder.engine)
        if not greedy["agree"]:
            builder.note = "greedy tokens differ from onnxruntime_genai's generator"
    config = quality_config(reference)
    for row in rows:
        if row.ok:
            row.quality = score(row, reference, config)

    ref_tpot = statistics.median(reference.samples["tpot"])
    assert reference.engine is not None
    threads = reference.engine.model.session.get_session_options().intra_op_num_threads
    return {
        "config": {
            "recipes": recipes,
            "ttft_prompt_length": TTFT_LENGTH,
            "decode_prompt_length": DECODE_PROMPT_LENGTH,
            "decode_tokens": DECODE_TOKENS,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "seed": args.seed,
            "threads": args.threads,
            "batch_size": 1,
            "quality": asdict(config),
        },
        "rows": [_row_record(row, ref_tpot) for row in rows],
        "builder": {
            "run_through": "pipeline.runtime.OrtModel (has_position_ids=False)",
            "io": builder.build.get("io"),
            "greedy_check": greedy,
        },
        "source": {"path": str(source_dir), "digest": source["digest"]},
        "threads": {"ort_intra_op": threads},
        "load_average": {"at_start": [round(x, 2) for x in load_at_start], **timing["load_average"]},
        "measure_seconds": timing["seconds"],
        "total_seconds": round(time.perf_counter() - started, 1),
        "host": host_info(),
        "versions": _versions(),
    }


def _row_record(row: Contestant, ref_tpot: float) -> dict[str, Any]:
    record: dict[str, Any] = {
        "name": row.name,
        "kind": row.kind,
        "status": row.status,
        "note": row.note,
        "engine": str(row.folder) if row.folder else None,
        "build": row.build,
        "size_mib": round(row.size_bytes / 2**20, 1) if row.size_bytes is not None else None,
        "model_files_mib": round(row.weight_bytes / 2**20, 1) if row.weight_bytes is not None else None,
    }
    if row.samples:
        tpot = summarize(row.samples["tpot"])
        record.update(
            ttft={**summarize(row.samples["ttft"]), "prompt_length": TTFT_LENGTH},
            tpot={**tpot, "prompt_length": DECODE_PROMPT_LENGTH, "tokens": DECODE_TOKENS},
            tpot_ratio_none_over_this=round(ref_tpot * 1e3 / tpot["median_ms"], 3),
        )
    if row.quality is not None:
        record["quality"] = row.quality
    return record


def _versions() -> dict[str, str]:
    from pipeline.core.cache import installed_versions

    return installed_versions(("onnxruntime", "onnxruntime-genai", "onnx", "transformers", "torch"))


# --------------------------------------------------------------------------- reporting


def print_report(record: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    config = record["config"]
    table = Table(title="Quantization recipes vs fp32 quant=none (ORT CPU, batch 1, greedy; medians)")
    for name, justify in [
        ("recipe", "left"),
        ("size MiB", "right"),
        (f"TTFT@{config['ttft_prompt_length']} ms", "right"),
        ("TPOT ms", "right"),
        ("TPOT ratio (none/x)", "right"),
        ("perplexity", "right"),
        ("KL", "right"),
        ("top-1 agree", "right"),
        ("notes", "left"),
    ]:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    notes: list[str] = []
    for row in record["rows"]:
        quality = row.get("quality") or {}
        cells = [
            f"{row['size_mib']:.1f}" if row["size_mib"] is not None else "-",
            f"{row['ttft']['median_ms']:.1f}" if "ttft" in row else "-",
            f"{row['tpot']['median_ms']:.2f}" if "tpot" in row else "-",
            f"{row['tpot_ratio_none_over_this']:.2f}x" if "tpot" in row else "-",
            f"{quality['perplexity']:.2f}" if quality else "-",
            f"{quality['kl_mean']:.4f}" if quality else "-",
            f"{quality['top1_agreement']:.1%}" if quality else "-",
        ]
        marker = f" [{len(notes) + 1}]" if row["note"] else ""
        if row["note"]:
            notes.append(f"[{len(notes) + 1}] {row['name']}: {row['note']}")
        table.add_row(row["name"], *cells, ("" if row["status"] == "ok" else row["status"]) + marker)
    console = Console()
    if not console.is_terminal:  # piped or logged: do not squeeze the table into 80 columns
        console.width = 150
    console.print(table)
    for line in notes:
        console.print(line, highlight=False, soft_wrap=True)
    host, load, quality = record["host"], record["load_average"], config["quality"]
    builder = record["builder"]

    def fmt(values: list[float]) -> str:
        return " ".join(f"{v:.2f}" for v in values)

    lines = [
        f"TTFT: prefill of a {config['ttft_prompt_length']}-token prompt + first token; TPOT: mean per token "
        f"over {config['decode_tokens']} tokens after a {config['decode_prompt_length']}-token prompt; "
        f"{config['repeats']} repeats after {config['warmup']} warm-up, interleaved across engines; "
        f"seeded random-token prompts (seed {config['seed']})",
        f"quality vs quant=none on {quality['text']} ({quality['max_tokens']} tokens, "
        f"{quality['window']}-token windows): perplexity, mean KL(none || x) per token, top-1 agreement",
    ]
    if builder["io"]:
        check = builder["greedy_check"] or {}
        agree = "agree" if check.get("agree") else "DIFFER"
        lines.append(
            f"builder model run through our OrtModel (inputs input_ids, attention_mask, "
            f"past_key_values.*; no position_ids); greedy {check.get('tokens')} tokens vs "
            f"onnxruntime_genai's generator: {agree}"
        )
    lines += [
        f"threads: ORT intra-op {record['threads']['ort_intra_op']} (inter-op 1)",
        f"load average (1/5/15 min) before measuring: {fmt(load['before'])}  after: {fmt(load['after'])}"
        f"  (at start, before builds: {fmt(load['at_start'])})",
        f"CPU: {host['cpu']}; {host['logical_cores']} logical / {host['physical_cores']} physical cores",
    ]
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, like every other user mistake
        self.exit(2, f"error: {message} (see --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="python benchmarks/quantization.py", description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--recipes", nargs="+", default=DEFAULT_RECIPES, help="quant= options (none is always built)"
    )
    parser.add_argument(
        "--variant",
        nargs="+",
        action="append",
        metavar="LABEL RECIPE OVERRIDE",
        help="a recipe with overrides as its own row, e.g. --variant int8-naive int8 quant.smooth=false "
        "'quant.weight_only=[]' (repeatable; default: "
        + "; ".join(" ".join(v) for v in DEFAULT_VARIANTS)
        + "; --variant none: no variants)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="measured runs per engine (median)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured runs first")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="run folders and build logs")
    parser.add_argument("--build-timeout", type=int, default=3600, help="seconds per build")
    parser.add_argument("--json", type=Path, help="also write every number here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.threads < 1 or args.build_timeout < 1:
        parser.error("--repeats, --threads and --build-timeout must be >= 1, --warmup >= 0")
    if args.variant and any(v == ["none"] for v in args.variant):
        args.variant = [] if args.variant == [["none"]] else parser.error("--variant none stands alone")
    for variant in args.variant or []:
        named = len(variant) >= 2 and all(_RECIPE_NAME.match(v) for v in variant[:2])
        if not named or variant[0] in args.recipes:
            parser.error(f"--variant {' '.join(variant)}: give a new LABEL, a RECIPE, then overrides")
    bad = [r for r in args.recipes if not _RECIPE_NAME.match(r)]
    if bad:
        parser.error(f"--recipes takes quant option names such as int8, not {' '.join(bad)}")
    if args.json and not args.json.resolve().parent.is_dir():
        parser.error(f"--json {args.json}: folder {args.json.resolve().parent} does not exist")
    return args


def run_and_report(
    args: argparse.Namespace,
    run_fn: Callable[[argparse.Namespace], dict[str, Any]],
    report_fn: Callable[[dict[str, Any]], None],
) -> int:
    """Run a benchmark, print its report, write ``--json``; one line and exit 2 for user mistakes
    (shared by the benchmark scripts that build with the CLI)."""
    try:
        record = run_fn(args)
    except (UsageError, PipelineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished builds stay in the pipeline cache; rerun to resume", file=sys.stderr)
        return 130
    report_fn(record)
    if args.json:
        args.json.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_and_report(parse_args(argv), run, print_report)


if __name__ == "__main__":
    sys.exit(main())
