"""Which linear layers a quantization pass touches.

Users name layers with fnmatch patterns over module names (``quant.exclude=[lm_head]``,
``quant.weight_only=['*.mlp.down_proj']``); the sensitivity pass (``passes/sensitivity.py``) may
add layers to keep in higher precision (``quant.fallback=auto``), which it records in
``extras/sensitivity/fallback.json``: the export pass carries ``extras/`` into the graph, so the
torch-stage and graph-stage passes of a recipe read the same list. Every quantization pass selects
its layers here, so a pattern means the same thing in every recipe.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable
from pathlib import Path

from pipeline.core.errors import ConfigError
from pipeline.core.files import read_json

log = logging.getLogger(__name__)

EXTRAS_DIR = "extras"
FALLBACK_FILE = "extras/sensitivity/fallback.json"


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether module ``name`` matches any of the fnmatch ``patterns`` (case-sensitive)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def check_patterns(names: Iterable[str], patterns: Iterable[str], knob: str = "quant.exclude") -> None:
    """A pattern that matches no module is a typo (``lm_haed``) that would quantize a layer the user
    meant to keep: a ConfigError naming the knob."""
    names = list(names)
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            example = ", ".join(names[:1] + names[-1:])
            raise ConfigError(
                f"{knob} pattern {pattern!r} matches no linear module (names look like {example})"
            )


def fallback_modules(folder: Path) -> list[str]:
    """The layers the sensitivity pass kept in higher precision for the artifact in ``folder``."""
    path = Path(folder) / FALLBACK_FILE
    if not path.is_file():
        return []
    return list(read_json(path, what="the sensitivity fallback").get("modules", []))


def select_modules(
    names: Iterable[str], exclude: Iterable[str], folder: Path | None = None, knob: str = "quant.exclude"
) -> list[str]:
    """The module names to quantize, in their order: not matched by ``exclude`` and not kept in
    higher precision by a sensitivity fallback recorded in ``folder`` (when given)."""
    names, exclude = list(names), list(exclude)
    check_patterns(names, exclude, knob)
    kept = set(fallback_modules(folder)) if folder is not None else set()
    selected = [n for n in names if not matches(n, exclude) and n not in kept]
    if not selected:
        log.warning("%s keeps every linear layer in higher precision: nothing is quantized", knob)
    return selected
