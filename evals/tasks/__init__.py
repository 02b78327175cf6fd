"""lm-eval tasks (lm-evaluation-harness 0.4.13 YAML) over the gate's frozen suites
(``evals.suites``): each suite has a ranking task (``<suite>_rank``: ``multiple_choice``, the
candidate answers or calls ranked by log-likelihood; ``acc``, ``acc_norm``) and a generative
task (``<suite>_gen``: ``generate_until``, scored by the item's ``meta["match"]`` rule in
``evals/tasks/scoring.py``; ``acc``), each in ``full`` and ``quick`` (``_quick``) sizes. The
``tool_call_valid`` tasks generate calls after two worked examples and check them with json
and jsonschema (``evals/tasks/tool_valid.py``; ``acc``, ``parsed``).

The data comes from ``evals/tasks/docs.py`` (``custom_dataset``), which reads the frozen suites
relative to the package, never the working directory. Every doc carries the item's ``id`` and
``hash`` (``evals.suites.item_hash``), so that ``log_samples`` output pairs items across runs.

Importing this package registers the ``pipeline-engine`` lm-eval model (``evals.lm_model``):
a task YAML of ours loaded by path resolves its ``!function`` references, which import this
package, before lm-eval looks the model up. ``python -m evals.tasks`` is lm-eval's command line
with the model registered and this folder on the include path.
"""

from __future__ import annotations

from pathlib import Path

import evals.lm_model  # noqa: F401  (registers the pipeline-engine model with lm-eval)
from evals.gate import FIXED_SCORING

TASKS_DIR = Path(__file__).resolve().parent
SCORINGS = ("rank", "gen")
SIZES = ("full", "quick")
SUITE_NAMES = ("reasoning", "tool_call", "long_context")


def task_name(suite: str, scoring: str, size: str = "full") -> str:
    """The lm-eval task name of a suite, scoring and size (``reasoning_rank_quick``)."""
    return f"{suite}_{scoring}" + ("" if size == "full" else f"_{size}")


TASK_NAMES = tuple(
    task_name(suite, scoring, size) for suite in SUITE_NAMES for scoring in SCORINGS for size in SIZES
) + tuple(task_name(suite, scoring, size) for suite, scoring in FIXED_SCORING.values() for size in SIZES)


def rule_task(rule: str, scoring: str, size: str) -> tuple[str, str]:
    """The (scoring, lm-eval task) of a gate rule: a suite under ``scoring``, or a rule of
    ``FIXED_SCORING`` under its own."""
    suite, scoring = FIXED_SCORING.get(rule, (rule, scoring))
    return scoring, task_name(suite, scoring, size)


def task_path(name: str) -> Path:
    """The YAML file of a task (``TASKS_DIR / f"{name}.yaml"``)."""
    return TASKS_DIR / f"{name}.yaml"


__all__ = [
    "FIXED_SCORING",
    "SCORINGS",
    "SIZES",
    "SUITE_NAMES",
    "TASKS_DIR",
    "TASK_NAMES",
    "rule_task",
    "task_name",
    "task_path",
]
