"""Generative scoring of the ``<suite>_gen`` tasks: a reply is right or wrong by its item's
``meta["match"]`` rule (the rules are defined with the suites, ``evals/suites/``):

- ``number`` (reasoning): the last number in the reply equals the target numerically
  (thousands separators allowed; "5-3" reads as 5 and 3, not -3).
- ``choice`` (reasoning): the reply names the right choice and no other (case- and
  space-insensitive, whole words; a choice found only inside a longer choice does not count).
- ``all`` (long context): every target string occurs in the reply, case-insensitively
  (RULER's ``string_match_all``, as a yes/no per item).
- ``ast`` (tool calls): the calls parsed from the reply match the expected calls by abstract
  syntax against the offered schemas (``evals.suites.tool_ast.score_reply``, BFCL's rules).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from evals.suites.tool_ast import score_reply
from evals.tasks.docs import decode

_NUMBER = re.compile(r"(?<![\d.])-?\d+(?:,\d{3})*(?:\.\d+)?")


def _normalize(text: str) -> str:
    return " ".join(text.casefold().split())


def last_number(reply: str) -> float | None:
    """The last number written in ``reply``, or None."""
    found = _NUMBER.findall(reply)
    return float(found[-1].replace(",", "")) if found else None


def match_number(reply: str, target: Any) -> bool:
    value = last_number(reply)
    return value is not None and math.isclose(value, float(target), rel_tol=1e-9, abs_tol=1e-9)


def named_choices(reply: str, choices: Sequence[str]) -> set[int]:
    """Indices of the choices named in ``reply`` (longest first; a shorter choice inside a
    found longer one is not counted)."""
    text = _normalize(reply)
    taken = [False] * len(text)
    found: set[int] = set()
    for index in sorted(range(len(choices)), key=lambda i: -len(choices[i])):
        phrase = _normalize(choices[index]).rstrip(".")
        if not phrase:
            continue
        pattern = re.compile(r"(?<!\w)" + re.escape(phrase) + r"(?!\w)")
        for hit in pattern.finditer(text):
            if not any(taken[hit.start() : hit.end()]):
                found.add(index)
                taken[hit.start() : hit.end()] = [True] * (hit.end() - hit.start())
    return found


def match_choice(reply: str, target: Any, choices: Sequence[str]) -> bool:
    wanted = {i for i, choice in enumerate(choices) if _normalize(choice) == _normalize(str(target))}
    return bool(wanted) and named_choices(reply, choices) == wanted


def match_all(reply: str, target: Any) -> bool:
    text = reply.casefold()
    wanted = [target] if isinstance(target, str) else list(target)
    return all(str(t).casefold() in text for t in wanted)


def match_ast(reply: str, target: Any, functions: Sequence[Mapping[str, Any]] | None) -> bool:
    return score_reply(reply, target, functions).ok


RULES: dict[str, Callable[[str, Any, Sequence[str], Mapping[str, Any]], bool]] = {
    "number": lambda reply, target, choices, meta: match_number(reply, target),
    "choice": lambda reply, target, choices, meta: match_choice(reply, target, choices),
    "all": lambda reply, target, choices, meta: match_all(reply, target),
    "ast": lambda reply, target, choices, meta: match_ast(reply, target, meta.get("functions")),
}


def score(reply: str, doc: Mapping[str, Any]) -> bool:
    """Whether ``reply`` is right for a doc of ``evals.tasks.docs``."""
    rule = doc["match"]
    if rule not in RULES:
        raise ValueError(f"item {doc['id']}: unknown match rule {rule!r}; known: {', '.join(RULES)}")
    target, meta = decode(dict(doc))
    return RULES[rule](reply, target, list(doc["choices"]), meta)


def process_results(doc: Mapping[str, Any], results: Sequence[str]) -> dict[str, float]:
    """lm-eval's ``process_results`` of the generative tasks: ``acc`` is 1.0 or 0.0 per item."""
    return {"acc": float(score(results[0], doc))}
