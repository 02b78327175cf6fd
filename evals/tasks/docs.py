"""Docs of the lm-eval tasks: the frozen suite items (``evals.suites.load_suite``, read
relative to the package) as one ``test`` split, for a task's ``custom_dataset``.

A doc holds flat, Arrow-friendly fields: ``id``, ``hash`` (``evals.suites.item_hash``: the
pairing key of the gate), ``suite``, ``category``, ``prompt``, ``choices``, ``answer`` (index),
``match`` (the generative rule), ``reference`` (the target as text, for reading), and
``target`` / ``meta`` as canonical JSON text (their shapes differ between suites).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import datasets

from evals.suites import Item, item_hash, load_suite
from evals.suites.common import canonical_json


def reference_text(item: Item) -> str:
    """The target as a person reads it: the answer, the strings joined, or the calls as JSON."""
    target = item.target
    if isinstance(target, str):
        return target
    if isinstance(target, list) and all(isinstance(t, str) for t in target):
        return ", ".join(target)
    return canonical_json(target)


def to_doc(item: Item) -> dict[str, Any]:
    """One lm-eval doc of an item."""
    return {
        "id": item.id,
        "hash": item_hash(item),
        "suite": item.suite,
        "category": item.category,
        "prompt": item.prompt,
        "choices": list(item.choices),
        "answer": int(item.answer),
        "match": str(item.meta.get("match", "")),
        "reference": reference_text(item),
        "target": canonical_json(item.target),
        "meta": canonical_json(item.meta),
    }


@lru_cache(maxsize=8)
def _docs(suite: str, size: str) -> tuple[dict[str, Any], ...]:
    return tuple(to_doc(item) for item in load_suite(suite, size))


def docs(suite: str, size: str = "full") -> list[dict[str, Any]]:
    """The docs of a suite at a size (``full`` or ``quick``), in frozen order."""
    return [dict(doc) for doc in _docs(suite, size)]


def load(suite: str, size: str = "full", **_: Any) -> dict[str, datasets.Dataset]:
    """``custom_dataset`` of every task: ``{"test": Dataset}``. lm-eval also passes the task's
    metadata and the model arguments as keywords; they do not change the data."""
    return {"test": datasets.Dataset.from_list(docs(suite, size))}


def decode(doc: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The target and meta of a doc, decoded from their JSON text."""
    return json.loads(doc["target"]), json.loads(doc["meta"])
