"""Per-item scores of one engine on one suite, through lm-eval (``simple_evaluate`` with
``log_samples``) and our ``pipeline-engine`` model (``evals/lm_model.py``) on our tasks
(``evals/tasks/``): the ``ScoreFn`` the gate pairs across engines by item id and hash."""

from __future__ import annotations

import logging
from pathlib import Path

from evals.gate import GateError, ItemScore

log = logging.getLogger(__name__)

RANK_METRICS = ("acc", "acc_norm")


def lm_eval_scores(
    engine: Path,
    suite: str,
    size: str,
    scoring: str,
    rank_metric: str = "acc_norm",
    limit: int | None = None,
    threads: int = 0,
    chat: bool = False,
) -> list[ItemScore]:
    """0/1 per item: ``rank_metric`` of the ranking task, or ``acc`` of the generative one;
    ``chat``: each item's prompt as one user turn of the tokenizer's chat template, else raw."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from evals.lm_model import EngineLM
    from evals.tasks import TASKS_DIR, task_name

    if rank_metric not in RANK_METRICS:
        raise GateError(f"eval.rank_metric={rank_metric!r}: choose one of {', '.join(RANK_METRICS)}")
    task = task_name(suite, scoring, size)
    log.info("eval: %s on %s", task, engine)
    results = simple_evaluate(
        model=EngineLM(engine=str(engine), threads=threads, chat=chat),
        tasks=[task],
        limit=limit,
        log_samples=True,
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        bootstrap_iters=0,  # the gate's own paired statistics replace lm-eval's stderr
    )
    metric = rank_metric if scoring == "rank" else "acc"
    return [ItemScore(s["doc"]["id"], s["doc"]["hash"], float(s[metric])) for s in results["samples"][task]]
