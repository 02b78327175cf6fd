"""Shared pieces of the offline eval suites: the ``Item`` record, canonical JSON and JSONL, item
hashes, sizes (``quick`` / ``full`` / a number of items), seeded per-item random streams and the
multiple-choice helpers.

Determinism: item ``k`` of group ``g`` (a category, or a length and a task) of a suite draws from
its own stream, ``random.Random("<suite>:<seed>:<group>:<k>")`` (a string seed is hashed with
SHA-512 by CPython, independent of ``PYTHONHASHSEED``); an item whose prompt repeats an earlier
one of its group is redrawn from ``"...:<k>:<attempt>"`` (``unique_draw``). An item therefore
depends only on its group, its index and the items before it, never on how many are generated
after it: ``quick`` (the first N items of each group) is a subset of ``full`` with the same ids,
and any size shares its items with every larger one.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from pipeline.core.errors import PipelineError
from pipeline.core.files import loads_bounded

# Bump when a generator changes what it produces; MANIFEST.json records the version it was
# frozen with, and the loader refuses a mismatch.
GENERATOR_VERSION = 4
# The seed of the frozen files.
SEED = 2024
SIZES = ("quick", "full")
WRITE_HINT = "regenerate with `python -m evals.suites --write`"
T = TypeVar("T")


class SuiteError(PipelineError, ValueError):
    """A suite that cannot be used as it is: unknown name or size, or frozen data that does not
    match its manifest or generator. The message is one line naming the file and the fix (a
    PipelineError, so every entry point reports it the same way; a ValueError for callers that
    validate parameters)."""


@dataclass
class Item:
    """One eval item.

    ``prompt`` is the user message (the model wrapper applies the chat template). ``choices``
    are the candidate answers for log-likelihood ranking and ``answer`` the index of the right
    one. ``target`` is the reference of generative scoring: a string (reasoning), a list of
    strings that must all occur in the answer (long context), or the expected calls
    ``[{"name": ..., "arguments": {...}}]`` (tool calls; ``[]`` when no call is right).
    ``meta["match"]`` names the generative matching rule (``number``, ``choice``, ``all``,
    ``ast``); the rest of ``meta`` describes how the item was made.
    """

    id: str
    suite: str
    category: str
    prompt: str
    choices: list[str]
    answer: int
    target: Any
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Item:
        names = {f.name for f in fields(cls)}
        missing = sorted(names - set(record) - {"meta"})
        extra = sorted(set(record) - names)
        if missing or extra:
            raise ValueError(f"item record: missing fields {missing}, unknown fields {extra}")
        return cls(**{k: record[k] for k in names if k in record})


def canonical_json(value: Any) -> str:
    """Sorted keys, no whitespace, UTF-8 characters kept: one text per value."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def item_hash(item: Item) -> str:
    """sha256 of the item's canonical JSON (prompt included)."""
    return sha256_text(canonical_json(item.to_dict()))


def dumps_jsonl(records: Iterable[Mapping[str, Any]]) -> str:
    """One canonical JSON record per line, trailing newline."""
    return "".join(canonical_json(dict(r)) + "\n" for r in records)


def write_jsonl(path: Path, records: Iterable[Mapping[str, Any] | Item]) -> None:
    rows = [r.to_dict() if isinstance(r, Item) else r for r in records]
    path.write_text(dumps_jsonl(rows), encoding="utf-8", newline="\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSONL file; a line that is not a JSON object is a one-line SuiteError."""
    records = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = loads_bounded(line)
            except json.JSONDecodeError as error:
                raise SuiteError(f"{path}:{number}: not valid JSON ({error.msg}); {WRITE_HINT}") from None
            if not isinstance(record, dict):
                raise SuiteError(f"{path}:{number}: not a JSON object; {WRITE_HINT}")
            records.append(record)
    return records


def plan(size: str | int, full: Mapping[str, int], quick: int | Mapping[str, int]) -> dict[str, int]:
    """Items per group for a size: ``full`` (the counts given), ``quick`` (the first ``quick``
    of each group, or of the groups a mapping names: others get none)
    or an int (split over the groups in proportion to ``full``, largest
    remainders first, ties in group order)."""
    if isinstance(size, bool) or not isinstance(size, str | int):
        raise SuiteError(f"size {size!r}: use one of {', '.join(SIZES)} or a number of items")
    if size == "full":
        return dict(full)
    if size == "quick":
        if isinstance(quick, Mapping):
            return {group: min(quick.get(group, 0), n) for group, n in full.items()}
        return {group: min(quick, n) for group, n in full.items()}
    if isinstance(size, str):
        raise SuiteError(f"unknown size {size!r}: use one of {', '.join(SIZES)} or a number of items")
    if size < 1:
        raise SuiteError(f"size {size}: need at least one item")
    total = sum(full.values())
    exact = {group: size * n / total for group, n in full.items()}
    counts = {group: int(x) for group, x in exact.items()}
    order = sorted(full, key=lambda g: (-(exact[g] - counts[g]), list(full).index(g)))
    for group in order[: size - sum(counts.values())]:
        counts[group] += 1
    return counts


def item_rng(suite: str, seed: int, group: str, k: int, attempt: int = 0) -> random.Random:
    """The random stream of item ``k`` of ``group`` (``attempt`` > 0: a redraw, see
    ``unique_draw``)."""
    return random.Random(f"{suite}:{seed}:{group}:{k}" + (f":{attempt}" if attempt else ""))


# Redraws of one item before a group is declared too small for its count of distinct prompts.
MAX_ATTEMPTS = 1000


def unique_draw(
    suite: str,
    seed: int,
    group: str,
    k: int,
    make: Callable[[random.Random], T],
    prompt_of: Callable[[T], str],
    seen: set[str],
) -> tuple[random.Random, T]:
    """``make(rng)`` for item ``k`` of ``group``, redrawn with a fresh stream until its prompt is
    not in ``seen`` (then added). A repeated prompt is the same question counted twice: a
    deterministic engine answers both copies alike, so the paired statistics would see more
    evidence than the suite holds. The first draw is ``item_rng(..., k)``, so an item that was
    already unique keeps its text."""
    for attempt in range(MAX_ATTEMPTS):
        rng = item_rng(suite, seed, group, k, attempt)
        made = make(rng)
        if prompt_of(made) not in seen:
            seen.add(prompt_of(made))
            return rng, made
    raise SuiteError(
        f"{suite}/{group}: no new prompt for item {k} in {MAX_ATTEMPTS} draws: "
        "the group's templates cannot make that many distinct items; lower its count"
    )


def item_id(suite: str, group: str, k: int) -> str:
    return f"{suite}-{group}-{k:04d}"


def pick_choices(
    rng: random.Random, correct: str, distractors: Sequence[tuple[str, str]], n: int
) -> tuple[list[str], int, list[str]]:
    """``n`` unique choices: ``correct`` and the first distinct distractors (``(text, kind)``, in
    the caller's order of preference), shuffled. Returns (choices, answer index, kinds)."""
    if n < 2:
        raise ValueError(f"n_choices={n}: need at least 2")
    picked = [(correct, "correct")]
    seen = {correct}
    for text, kind in distractors:
        if text not in seen:
            picked.append((text, kind))
            seen.add(text)
        if len(picked) == n:
            break
    if len(picked) < n:
        raise ValueError(f"only {len(picked) - 1} distinct distractors for {correct!r}, need {n - 1}")
    rng.shuffle(picked)
    choices = [text for text, _ in picked]
    kinds = [kind for _, kind in picked]
    return choices, kinds.index("correct"), kinds
