"""Per-item scores of one engine on one suite, through lm-eval (``simple_evaluate`` with
``log_samples``) and our ``pipeline-engine`` model (``evals/lm_model.py``) on our tasks
(``evals/tasks/``): the ``ScoreFn`` the gate pairs across engines by item id and hash."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from evals.gate import GateError, ItemScore
from evals.suites.tool_schema import PARSE, SCHEMA

log = logging.getLogger(__name__)

RANK_METRICS = ("acc", "acc_norm")
# The loggers of lm-eval 0.4.13: ``lm_eval`` (and its modules' ``lm_eval.*``, by ``__name__``)
# and ``lm-eval`` (some task modules).
LM_EVAL_LOGGERS = ("lm_eval", "lm-eval")
# lm-eval's advice to pass ``--metadata``, a WARNING each time a task built by a function is
# loaded (ours all are): nothing to act on in the gate, which passes what its tasks need.
METADATA_ADVICE = "Custom kwargs can be passed to `--metadata`"


class _MetadataAdvice(logging.Filter):
    """Drop lm-eval's ``--metadata`` advice unless lm-eval's logs were asked for at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if METADATA_ADVICE not in str(record.msg):
            return True
        return logging.getLogger(LM_EVAL_LOGGERS[0]).isEnabledFor(logging.DEBUG)


def quiet_lm_eval() -> None:
    """Keep lm-eval's loggers at WARNING while the gate scores (its INFO lines, six per suite and
    engine, drown the gate's own progress), unless the user asked for more: a level set on the
    logger already (``hydra.verbose=lm_eval``, a ``hydra.job_logging`` entry), everything at DEBUG
    (``hydra.verbose=true``), or lm-eval's own ``LMEVAL_LOG_LEVEL``. Its ``--metadata`` advice
    shows only at DEBUG."""
    named = logging.getLevelName(os.environ.get("LMEVAL_LOG_LEVEL", "").strip().upper() or "-")
    for name in LM_EVAL_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level != logging.NOTSET:  # set by the user's logging config
            continue
        if isinstance(named, int):  # getLevelName gives a level's number, or text for an unknown name
            logger.setLevel(named)
        elif not logging.getLogger().isEnabledFor(logging.DEBUG):
            logger.setLevel(logging.WARNING)
    task_logger = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _MetadataAdvice) for f in task_logger.filters):
        task_logger.addFilter(_MetadataAdvice())


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
    ``chat``: each item's prompt as one user turn of the tokenizer's chat template, else raw.
    ``suite`` may name a rule of ``evals.gate.FIXED_SCORING``, scored its own way: for
    ``tool_call_valid`` the worked examples are earlier chat turns (lm-eval's multi-turn
    few-shot) and each failed item records why (``parse`` or ``schema``)."""
    quiet_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from evals.lm_model import EngineLM
    from evals.tasks import TASKS_DIR, rule_task

    if rank_metric not in RANK_METRICS:
        raise GateError(f"eval.rank_metric={rank_metric!r}: choose one of {', '.join(RANK_METRICS)}")
    scoring, task = rule_task(suite, scoring, size)
    log.info("eval: %s on %s", task, engine)
    fewshot = {"apply_chat_template": chat, "fewshot_as_multiturn": chat} if scoring == "valid" else {}
    results = simple_evaluate(
        model=EngineLM(engine=str(engine), threads=threads, chat=chat),
        tasks=[task],
        limit=limit,
        log_samples=True,
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        bootstrap_iters=0,  # the gate's own paired statistics replace lm-eval's stderr
        **fewshot,
    )
    metric = rank_metric if scoring == "rank" else "acc"
    return [
        ItemScore(s["doc"]["id"], s["doc"]["hash"], float(s[metric]), failure_of(s))
        for s in results["samples"][task]
    ]


def failure_of(sample: dict[str, Any]) -> str:
    """Why a ``tool_call_valid`` sample failed (``parse``, ``schema``), or "" (passed, or a task
    that does not say)."""
    if "parsed" not in sample or sample.get("acc"):
        return ""
    return SCHEMA if sample["parsed"] else PARSE
