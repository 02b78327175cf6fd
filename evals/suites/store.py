"""Frozen suites: write the generated items as JSONL under ``evals/suites/data/`` with a
``MANIFEST.json`` of their sha256, load them back (checking every hash), and compare them with
a fresh generation (``python -m evals.suites --write`` / ``--check``).

A frozen file is the contract between runs: the gate compares a candidate with a baseline item
by item, so an item must never change silently. Three things guard it: the file's sha256 in the
manifest (a hand edit is refused on load), the generator version in the manifest (code bumped,
data not rewritten), and ``--check`` / the tests (regenerating must give the same bytes).

Long-context items are stored without their prompts (each is 4-36 kB); the loader rebuilds
every prompt from the shipped haystack and checks it against the item's ``prompt_sha256``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evals.suites import haystack, long_context, reasoning, tool_call
from evals.suites.common import (
    GENERATOR_VERSION,
    SEED,
    SIZES,
    WRITE_HINT,
    Item,
    SuiteError,
    dumps_jsonl,
    plan,
    read_jsonl,
    sha256_file,
    sha256_text,
)
from pipeline.core.files import loads_bounded

DATA_DIR = Path(__file__).resolve().parent / "data"
MANIFEST = "MANIFEST.json"
TOKENS = "long_context.tokens.json"


@dataclass(frozen=True)
class Suite:
    name: str
    generate: Callable[..., list[Item]]
    full: dict[str, int]  # items per group in ``full``
    quick: int | dict[str, int]  # the first ``quick`` items of each group (or of the groups named)
    defaults: dict[str, Any]
    compact: bool = False  # prompts rebuilt on load, not stored


SPECS: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite(reasoning.NAME, reasoning.generate, reasoning.FULL, reasoning.QUICK, reasoning.DEFAULTS),
        Suite(tool_call.NAME, tool_call.generate, tool_call.FULL, tool_call.QUICK, tool_call.DEFAULTS),
        Suite(
            long_context.NAME,
            long_context.generate,
            long_context.FULL,
            long_context.QUICK,
            long_context.DEFAULTS,
            compact=True,
        ),
    )
}
# Suite name -> generator ``generate(size, seed, **params) -> list[Item]``.
SUITES: dict[str, Callable[..., list[Item]]] = {name: spec.generate for name, spec in SPECS.items()}


def _show(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _spec(name: str) -> Suite:
    if name not in SPECS:
        raise SuiteError(f"unknown suite {name!r}: choose one of {', '.join(sorted(SPECS))}")
    return SPECS[name]


def to_record(item: Item) -> dict[str, Any]:
    """The frozen form of an item (long-context prompts left out)."""
    record = item.to_dict()
    if SPECS[item.suite].compact:
        record["prompt"] = None
    return record


def from_record(record: dict[str, Any], source: Path | str) -> Item:
    """An item from its frozen form, rebuilding a long-context prompt (hash-checked)."""
    try:
        item = Item.from_dict(record)
    except (TypeError, ValueError) as error:
        raise SuiteError(f"{source}: {error}; {WRITE_HINT}") from None
    if item.suite in SPECS and SPECS[item.suite].compact:
        item.prompt = long_context.rebuild_prompt(item, source)
    return item


def render(name: str, items: list[Item]) -> str:
    """The text of the frozen file of a suite."""
    return dumps_jsonl(to_record(item) for item in items)


def _file_entry(spec: Suite, text: str, items: list[Item]) -> dict[str, Any]:
    categories: dict[str, int] = {}
    for item in items:
        categories[item.category] = categories.get(item.category, 0) + 1
    return {
        "sha256": sha256_text(text),
        "bytes": len(text.encode("utf-8")),
        "items": len(items),
        "quick_items": sum(plan("quick", spec.full, spec.quick).values()),
        "quick_per_group": spec.quick,
        "categories": categories,
        "params": spec.defaults,
    }


def build(data_dir: Path = DATA_DIR, seed: int = SEED) -> tuple[dict[str, str], dict[str, Any]]:
    """Generate every suite in memory: (file name -> text, manifest). Long-context token counts
    are taken from ``data_dir/long_context.tokens.json`` (measurements, not generated)."""
    files: dict[str, str] = {}
    entries: dict[str, Any] = {}
    for name, spec in SPECS.items():
        kwargs = {"tokens_file": data_dir / TOKENS} if spec.compact else {}
        items = spec.generate("full", seed, **kwargs)
        text = render(name, items)
        files[f"{name}.jsonl"] = text
        entries[f"{name}.jsonl"] = _file_entry(spec, text, items)
    manifest = {
        "generator_version": GENERATOR_VERSION,
        "seed": seed,
        "files": entries,
        "haystack": {
            "path": "evals/data/haystack/haystack.txt",
            "sha256": sha256_text(haystack.generate_text()),
        },
        "long_context": {
            "chars_per_token": long_context.CHARS_PER_TOKEN,
            "fill": long_context.FILL,
            "lengths": long_context.LENGTHS,
            "tokens_file": TOKENS,
            "tokens_file_sha256": sha256_file(data_dir / TOKENS) if (data_dir / TOKENS).is_file() else None,
        },
    }
    return files, manifest


def _manifest_text(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def measure(data_dir: Path, tokenizer_dir: Path, seed: int = SEED) -> int:
    """Measure every long-context prompt with the tokenizer and write the tokens file."""
    items = long_context.generate("full", seed, tokens_file=data_dir / TOKENS)
    counts = long_context.measure_tokens([item.prompt for item in items], tokenizer_dir)
    data = {
        "tokenizer": _show(tokenizer_dir / "tokenizer.json"),
        "tokenizer_sha256": sha256_file(tokenizer_dir / "tokenizer.json"),
        "note": "tokens of each prompt alone: no special tokens, no chat template",
        "tokens": {item.id: [item.meta["prompt_sha256"], n] for item, n in zip(items, counts, strict=True)},
    }
    (data_dir / TOKENS).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return len(counts)


def write(data_dir: Path = DATA_DIR, tokenizer_dir: Path | None = None, seed: int = SEED) -> list[str]:
    """Regenerate and freeze every suite (and the haystack); returns lines to print."""
    lines = []
    haystack.PATH.parent.mkdir(parents=True, exist_ok=True)
    haystack.PATH.write_text(haystack.generate_text(), encoding="utf-8", newline="\n")
    haystack.shipped_text.cache_clear()
    data_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
        n = measure(data_dir, tokenizer_dir, seed)
        lines.append(f"measured {n} long-context prompts with {_show(tokenizer_dir / 'tokenizer.json')}")
    else:
        lines.append(
            f"note: no tokenizer at {tokenizer_dir}: long-context token counts kept where the prompt "
            "is unchanged"
        )
    files, manifest = build(data_dir, seed)
    for name, text in files.items():
        (data_dir / name).write_text(text, encoding="utf-8", newline="\n")
        entry = manifest["files"][name]
        lines.append(f"wrote {_show(data_dir / name)}: {entry['items']} items, {entry['bytes']} bytes")
    (data_dir / MANIFEST).write_text(_manifest_text(manifest), encoding="utf-8", newline="\n")
    lines.append(f"wrote {_show(data_dir / MANIFEST)}")
    return lines


def check(data_dir: Path = DATA_DIR, seed: int = SEED) -> list[str]:
    """Differences between the frozen data and a fresh generation, one line each ([] if none)."""
    problems = []
    files, manifest = build(data_dir, seed)
    if not haystack.PATH.is_file() or haystack.PATH.read_text(encoding="utf-8") != haystack.generate_text():
        problems.append(f"{_show(haystack.PATH)} differs from its generator")
    for name, text in files.items():
        path = data_dir / name
        if not path.is_file():
            problems.append(f"{_show(path)} is missing")
            continue
        frozen = path.read_text(encoding="utf-8").splitlines()
        fresh = text.splitlines()
        if frozen != fresh:
            where = next((i for i, (a, b) in enumerate(zip(frozen, fresh, strict=False)) if a != b), None)
            if where is None:
                detail = f"{len(frozen)} lines frozen, {len(fresh)} generated"
            else:
                detail = f"first at line {where + 1}, item {json.loads(fresh[where])['id']}"
            problems.append(f"{_show(path)} differs from its generator ({detail})")
    path = data_dir / MANIFEST
    if not path.is_file() or path.read_text(encoding="utf-8") != _manifest_text(manifest):
        problems.append(f"{_show(path)} is missing or out of date")
    return problems


def _manifest(data_dir: Path) -> dict[str, Any]:
    path = data_dir / MANIFEST
    try:
        manifest = loads_bounded(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SuiteError(f"{_show(path)} is missing; {WRITE_HINT}") from None
    except json.JSONDecodeError as error:
        raise SuiteError(f"{_show(path)}: not valid JSON ({error.msg}); {WRITE_HINT}") from None
    if manifest.get("generator_version") != GENERATOR_VERSION:
        raise SuiteError(
            f"{_show(path)}: frozen with generator version {manifest.get('generator_version')}, "
            f"the code is version {GENERATOR_VERSION}; {WRITE_HINT}"
        )
    return manifest


def load_suite(name: str, size: str = "full", *, data_dir: Path | None = None) -> list[Item]:
    """The frozen items of suite ``name``: ``full``, or ``quick`` (the first items of each group,
    the same ids). Raises ``SuiteError`` (one line naming the file and the fix) for an unknown
    suite or size, a file whose sha256 differs from ``MANIFEST.json`` (edited by hand), a
    manifest of another generator version, or a long-context prompt that no longer rebuilds."""
    spec = _spec(name)
    if size not in SIZES:
        raise SuiteError(f"unknown size {size!r} for suite {name}: choose one of {', '.join(SIZES)}")
    data_dir = DATA_DIR if data_dir is None else Path(data_dir)
    manifest = _manifest(data_dir)
    path = data_dir / f"{name}.jsonl"
    entry = manifest.get("files", {}).get(path.name)
    if entry is None or not path.is_file():
        raise SuiteError(f"{_show(path)} is missing or not in {MANIFEST}; {WRITE_HINT}")
    actual = sha256_file(path)
    if actual != entry["sha256"]:
        raise SuiteError(
            f"{_show(path)}: sha256 {actual[:12]}... does not match {MANIFEST} ({entry['sha256'][:12]}...): "
            f"edited by hand or stale; {WRITE_HINT}"
        )
    if spec.compact:
        expected = manifest.get("haystack", {}).get("sha256")
        if not haystack.PATH.is_file() or sha256_file(haystack.PATH) != expected:
            raise SuiteError(
                f"{_show(haystack.PATH)}: missing or its sha256 does not match {MANIFEST}; {WRITE_HINT}"
            )
    records = read_jsonl(path)
    if size == "quick":
        counts = plan("quick", spec.full, spec.quick)
        prefix = len(name) + 1  # ids are <suite>-<group>-<k>
        records = [r for r in records if r["meta"]["k"] < counts.get(_group(r["id"], prefix), 0)]
    return [from_record(record, _show(path)) for record in records]


def _group(item_id: str, prefix: int) -> str:
    """The group of an item id ``<suite>-<group>-<k>`` (``prefix``: the length of ``<suite>-``)."""
    return item_id[prefix : item_id.rindex("-")]
