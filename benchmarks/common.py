"""What the benchmark scripts share, in one module: where the project is, the command line's
one-line errors, progress lines, the load average and the timing record, seeded prompts, child
processes (a logged CLI build, a fresh process's peak RSS), the rows built with the real CLI
(``python -m pipeline ... bench=none``, cached like any run) and ONNX Runtime GenAI's model-builder
peer, their interleaved TTFT/TPOT and their quality against a reference, and the end of every
script: the report printed, the record written as JSON.

Every benchmark runs from the repository root as ``python -m benchmarks.<name>``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from pipeline.config import QualityConfig
from pipeline.core.engine import IOSpec
from pipeline.core.errors import EngineError, PipelineError, first_line
from pipeline.core.subprocesses import PROJECT_ROOT, child_environment, isolated_script
from pipeline.runtime import Engine, GenerationConfig, OrtModel

REPO = PROJECT_ROOT
# The converted default model (`python -m pipeline model=llama` makes it).
DEFAULT_MODEL = REPO / "artifacts" / "models" / "llama-b179c9523d0e"
REFERENCE = "none"  # the quant= recipe every comparison is against
TTFT_LENGTH = 512
DECODE_PROMPT_LENGTH = 128
DECODE_TOKENS = 64
BUILDER_PACKAGE = "onnxruntime-genai"
BUILDER_OPTIONS = {"precision": "int4", "execution_provider": "cpu"}
BUILDER_PASS_NAME = "ortgenai_model_builder"
BUILDER_PASS_VERSION = 1
# Greedy agreement is checked on real text: random-id prompts make the model repeat itself.
GREEDY_CHECK_TOKENS = 16
GREEDY_CHECK_TEXT = "The history of the printing press begins in"
_KV_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16"}


class UsageError(Exception):
    """A problem with the arguments or the artifacts found: one line, exit status 2."""


# --------------------------------------------------------------------------- command line


class OneLineParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose errors are one line naming ``--help``, like every
    other user mistake (exit status 2), not argparse's usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def make_parser(script: str, doc: str | None) -> OneLineParser:
    """The parser of the benchmark whose file is ``script`` (its ``__file__``): ``prog`` is its
    ``python -m benchmarks.<name>`` form, the description the first paragraph of ``doc``."""
    first = " ".join((doc or "").strip().split("\n\n")[0].split())
    return OneLineParser(prog=f"python -m benchmarks.{Path(script).stem}", description=first or None)


def add_run_arguments(
    parser: argparse.ArgumentParser, out: Path, build_timeout: int, repeats: int = 3, threads: bool = True
) -> None:
    """The options of every benchmark that builds rows with the CLI and times them: ``--repeats``,
    ``--warmup``, ``--threads`` (unless ``threads`` is false), ``--seed``, ``--out``,
    ``--build-timeout`` and ``--json``, with these defaults."""
    parser.add_argument("--repeats", type=int, default=repeats, help="measured runs per engine (median)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured runs first")
    if threads:
        parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids")
    parser.add_argument("--out", type=Path, default=out, help="run folders and build logs")
    parser.add_argument("--build-timeout", type=int, default=build_timeout, help="seconds per build")
    parser.add_argument("--json", type=Path, help="also write every number here")


def cpu_line(host: dict[str, Any]) -> str:
    """``CPU: <model>; N logical / M physical cores`` of ``pipeline.bench.host_info()``."""
    return f"CPU: {host['cpu']}; {host['logical_cores']} logical / {host['physical_cores']} physical cores"


def say(message: str) -> None:
    """A progress line on stderr (stdout keeps the report)."""
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- load and timing


def load_average() -> list[float]:
    """The 1/5/15-minute load average now, rounded: this machine is shared, so every record has it."""
    return [round(x, 2) for x in os.getloadavg()]


def format_load(*loads: Sequence[float]) -> str:
    """``1.0/0.8/0.6 -> 1.9/1.0/0.7``: load averages in the order read (before and after a
    measurement)."""
    return " -> ".join("/".join(f"{x:.1f}" for x in load) for load in loads)


def load_line(*loads: Sequence[float]) -> str:
    """``load average (1/5/15 min) 1.0/0.8/0.6 -> 1.9/1.0/0.7``: the line every table ends with
    (this machine is shared: compare ratios of one run)."""
    return f"load average (1/5/15 min) {format_load(*loads)}"


def print_lines(console: Any, lines: Sequence[str]) -> None:
    """The lines under a table, on a rich ``console``, unwrapped and unhighlighted."""
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)


def median_ms(seconds: Sequence[float]) -> float:
    """The median of timings given in seconds, in milliseconds."""
    return 1000 * statistics.median(seconds)


def ort_model(engine: Engine) -> OrtModel:
    """The ONNX Runtime model of ``engine``; a UsageError for another target (the benchmarks that
    read ONNX Runtime's session: its threads, its profile, its prefill session)."""
    if not isinstance(engine.model, OrtModel):
        target = engine.spec.get("target")
        raise UsageError(f"{engine.folder} is a {target} engine: this benchmark takes an ort-cpu engine")
    return engine.model


def make_prompt(rng: np.random.Generator, vocab: int, length: int) -> list[list[int]]:
    """One seeded random prompt of ``length`` token ids in [100, vocab), drawn as
    ``pipeline.bench`` draws them."""
    low = min(100, vocab // 4)  # skip the special tokens at the start of the vocabulary
    return rng.integers(low, vocab, size=(1, length)).tolist()


# --------------------------------------------------------------------------- child processes


def last_line(text: str, lines: int = 1) -> str:
    """The last ``lines`` non-empty lines of a child's output, joined: what a row's note shows."""
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(kept[-lines:]) if kept else "no output"


def error_line(text: str) -> str:
    """The last ``error:`` line of a child's output (the CLI's one-line errors), else its last line."""
    errors = [line.strip() for line in text.splitlines() if line.startswith("error:")]
    return errors[-1] if errors else last_line(text)


def pipeline_command(module: str, *arguments: str) -> list[str]:
    """``python -m <module> arguments`` in this interpreter: ``pipeline`` (a build),
    ``pipeline.gate``, ``pipeline.registry``... run from the repository root (see :func:`run_logged`)."""
    return [sys.executable, "-m", module, *arguments]


def run_logged(
    command: list[str], log: Path, timeout_s: float | None = None
) -> subprocess.CompletedProcess[str] | None:
    """Run ``command`` from the repository root, its output captured and written to ``log``
    (``$ command``, stdout, stderr); None when it ran past ``timeout_s``."""
    try:
        result = subprocess.run(
            command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return None
    log.write_text(f"$ {' '.join(command)}\n{result.stdout}\n{result.stderr}")
    return result


def peak_rss_script(load: str) -> str:
    """The text of a fresh process that measures an engine's memory: ``load`` (constant code of
    the caller, which binds ``engine`` from ``sys.argv[1:4]``: folder, tokens, threads); then the
    kernel's resident-set high-water mark is reset (Linux ``/proc/self/clear_refs``: "5"), one
    prefill of N tokens and two decode steps run, and it prints the RSS after loading and the
    high-water mark (VmHWM), bytes. Loading alone peaks higher (session creation optimizes a copy
    of the graph), so the process-lifetime peak would hide the cache."""
    return f"""
import sys
from pipeline.runtime.generate import GenerationConfig

def status(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024

{load}
loaded = status("VmRSS")
with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")
n = int(sys.argv[2])
prompt = [[(7919 * i) % engine.io.vocab_size for i in range(n)]]
engine.generate_ids(prompt, GenerationConfig(max_new_tokens=2, stop_at_eos=False))
print(loaded, status("VmHWM"))
"""


def child_rss(script: str, args: list[str], cwd: Path) -> dict[str, int]:
    """Run ``script`` in a fresh Python with ``args``; it prints RSS after loading and the peak
    while decoding (bytes), which come back as a record. The child runs in isolated mode with a
    clean environment (``pipeline.core.subprocesses.isolated_script``): no inherited PYTHONPATH or
    PYTHONSTARTUP; the project root is put on its path explicitly."""
    done = subprocess.run(
        isolated_script(script, *args),
        capture_output=True,
        text=True,
        check=True,
        cwd=cwd,
        env=child_environment(),
    )
    loaded, peak = (int(x) for x in done.stdout.split()[-2:])
    return {"after_load": loaded, "peak_decoding": peak}


# --------------------------------------------------------------------------- rows built with the CLI


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


def build_recipe(
    recipe: str,
    out: Path,
    timeout_s: int,
    label: str | None = None,
    overrides: tuple[str, ...] = (),
    model: str = "llama",
) -> Contestant:
    """Run the pipeline CLI for ``model=<model> quant=<recipe> <overrides>`` (a row named
    ``label``, default the recipe); never raises for a missing or failing recipe."""
    label = label or recipe
    row = Contestant(label, "recipe")
    run_dir = out / label
    manifest_path = run_dir / "manifest.json"
    manifest_path.unlink(missing_ok=True)  # a stale record must never stand in for a failed rebuild
    command = pipeline_command(
        "pipeline", f"model={model}", f"quant={recipe}", *overrides, "bench=none", f"hydra.run.dir={run_dir}"
    )
    log_path = out / f"{label}.log"
    say(f"build  {label}: quant={recipe} {' '.join(overrides)} ...")
    start = time.perf_counter()
    result = run_logged(command, log_path, timeout_s)
    if result is None:
        row.status, row.note = "failed", f"build took over {timeout_s} s (raise --build-timeout)"
        say(f"build  quant={recipe}: {row.note}")
        return row
    seconds = round(time.perf_counter() - start, 1)
    row.build = {"command": command, "returncode": result.returncode, "seconds": seconds}
    row.build["log"] = str(log_path)
    if result.returncode != 0:
        if f"Could not find 'quant/{recipe}'" in result.stderr:
            row.status, row.note = "not available", f"no configs/quant/{recipe}.yaml yet"
        else:
            row.status = "failed"
            row.note = f"build failed (exit {result.returncode}): {error_line(result.stderr)}"
        say(f"build  quant={recipe}: {row.status} ({row.note}; log {log_path})")
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
    say(f"build  quant={recipe}: ok ({seconds} s, {sum(hits)}/{len(hits)} passes from the cache)")
    return row


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
        say(f"build  builder {precision}: {row.note}")
        return row
    options = {**BUILDER_OPTIONS, "precision": precision, BUILDER_PACKAGE: version}
    key = cache_key(source_digest, BUILDER_PASS_NAME, BUILDER_PASS_VERSION, options)
    cache = Cache(REPO / "artifacts" / "cache")
    row.build = {"cache_key": key, "options": options, "source": str(source_dir)}
    entry = cache.lookup(key, Kind.ENGINE)
    if entry is not None:
        row.build.update(cache_hit=True, seconds=0.0)
        say(f"build  builder {precision}: ok (from the cache, {key[:12]})")
    else:
        say(f"build  builder {precision} ...")
        with cache.stage(key) as staging:
            output = staging / "output"
            command = pipeline_command(
                "onnxruntime_genai.models.builder",
                *("-i", str(source_dir), "-o", str(output), "-p", precision),
                *("-e", BUILDER_OPTIONS["execution_provider"]),
                *("-c", str(staging / "hf_cache")),  # the builder's default is ./cache_dir in the cwd
            )
            log_path = out / f"builder-{precision}.log"
            start = time.perf_counter()
            result = run_logged(command, log_path, timeout_s)
            if result is None:
                row.status, row.note = "failed", f"builder took over {timeout_s} s (raise --build-timeout)"
                return row
            seconds = round(time.perf_counter() - start, 1)
            row.build.update(command=command, returncode=result.returncode, seconds=seconds)
            row.build["log"] = str(log_path)
            if result.returncode != 0 or not (output / "genai_config.json").is_file():
                row.status = "failed"
                row.note = f"builder failed (exit {result.returncode}): {last_line(result.stderr)}"
                say(f"build  builder {precision}: {row.note} (log {log_path})")
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
        say(f"build  builder {precision}: ok ({row.build['seconds']} s, cached as {key[:12]})")
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


# --------------------------------------------------------------------------- quality


def quality_config(reference: Contestant) -> QualityConfig:
    """The settings the runs scored quality with (from the ``none`` manifest), else the defaults."""
    recorded = ((reference.manifest or {}).get("quality") or {}).get("config") or {}
    fields = QualityConfig.__dataclass_fields__
    return QualityConfig(**{k: v for k, v in recorded.items() if k in fields})


def score(row: Contestant, reference: Contestant, config: QualityConfig) -> dict[str, Any]:
    """Quality of ``row`` vs the ``none`` engine: from its run manifest when that compared against
    the ``none`` engine with these settings, else measured here (cached for the builder model)."""
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
    say(f"quality {row.name} vs {REFERENCE} ...")
    same = digest == ref_digest
    record = {**compare(row.engine, None if same else reference.engine, config), **payload}
    if digest:
        stored.parent.mkdir(parents=True, exist_ok=True)
        write_json(stored, record)
    return {**record, "cache_hit": False, "source": "measured here"}


# --------------------------------------------------------------------------- timing


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
    load_before = load_average()
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


def timing_record(load_before: Sequence[float], started: float) -> dict[str, Any]:
    """Load average before and now, and the seconds since ``started`` (perf_counter)."""
    return {
        "load_average": {"before": [round(x, 2) for x in load_before], "after": load_average()},
        "seconds": round(time.perf_counter() - started, 1),
    }


# --------------------------------------------------------------------------- the end of a run

BUILDS_KEPT = "finished builds stay in the pipeline cache; rerun to resume"


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Every number of a run as JSON (paths and other objects as text)."""
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {path}")


def run_and_report(
    args: argparse.Namespace,
    run_fn: Callable[[argparse.Namespace], dict[str, Any]],
    report_fn: Callable[[dict[str, Any]], None],
    interrupted: str = BUILDS_KEPT,
) -> int:
    """Run a benchmark, print its report, write ``--json`` when given; one line and exit 2 for
    user mistakes, exit 130 with ``interrupted`` (what survives) on Ctrl-C."""
    try:
        record = run_fn(args)
    except (UsageError, PipelineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: {interrupted}", file=sys.stderr)
        return 130
    report_fn(record)
    if getattr(args, "json", None):
        write_record(args.json, record)
    return 0


def measure_and_report(
    args: argparse.Namespace,
    measure: Callable[[argparse.Namespace], dict[str, Any]],
    print_table: Callable[[dict[str, Any]], None],
) -> int:
    """:func:`run_and_report` of a measurement with the load average before and after it
    (``load_before``, ``load_after``) beside its record."""

    def measured(args: argparse.Namespace) -> dict[str, Any]:
        before = load_average()
        record = measure(args)
        record["load_before"], record["load_after"] = before, load_average()
        return record

    return run_and_report(args, measured, print_table, interrupted="nothing was recorded")
