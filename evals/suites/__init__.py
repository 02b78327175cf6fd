"""Offline eval suites of the gate, generated deterministically and frozen as JSONL.

- ``reasoning``: GSM-Symbolic-style templated arithmetic and word problems, comparison and
  logic items (Mirzadeh et al. 2024, arXiv:2410.05229).
- ``tool_call``: function selection and arguments, BFCL categories and AST scoring (Berkeley
  Function-Calling Leaderboard, Yan et al. 2024).
- ``long_context``: RULER-style needle retrieval, variable tracking and common-word extraction
  at 1k-8k tokens (Hsieh et al. 2024, arXiv:2404.06654).

Every item carries candidate answers for log-likelihood ranking (small models) and a target for
generative scoring (larger ones). Use ``load_suite(name, "quick" | "full")``; regenerate the
frozen files with ``python -m evals.suites --write``, compare them with ``--check``.
"""

from __future__ import annotations

from evals.suites.common import GENERATOR_VERSION, SEED, Item, SuiteError, item_hash, read_jsonl, write_jsonl
from evals.suites.store import DATA_DIR, SPECS, SUITES, check, load_suite, write

__all__ = [
    "DATA_DIR",
    "GENERATOR_VERSION",
    "SEED",
    "SPECS",
    "SUITES",
    "Item",
    "SuiteError",
    "check",
    "item_hash",
    "load_suite",
    "read_jsonl",
    "write",
    "write_jsonl",
]
