"""lm-eval's own logging while the gate scores: its loggers at WARNING unless the user asked for
more, and its ``--metadata`` advice (a WARNING per task load) only at DEBUG."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from evals.engine_scores import LM_EVAL_LOGGERS, METADATA_ADVICE, lm_eval_scores, quiet_lm_eval

TASK_LOGGER = "lm_eval.api.task"


@pytest.fixture(autouse=True)
def fresh_loggers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """lm-eval's loggers as a fresh process has them (NOTSET), restored afterwards."""
    monkeypatch.delenv("LMEVAL_LOG_LEVEL", raising=False)
    names = (*LM_EVAL_LOGGERS, TASK_LOGGER)
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).filters)) for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.NOTSET)
        logging.getLogger(name).filters.clear()
    yield
    for name, (level, filters) in saved.items():
        logging.getLogger(name).setLevel(level)
        logging.getLogger(name).filters[:] = filters


def advice_passes() -> bool:
    record = logging.LogRecord(
        TASK_LOGGER, logging.WARNING, __file__, 1, f"t: {METADATA_ADVICE} ...", None, None
    )
    return logging.getLogger(TASK_LOGGER).filter(record)


def test_lm_eval_loggers_are_kept_at_warning_and_its_metadata_advice_dropped() -> None:
    quiet_lm_eval()
    quiet_lm_eval()  # twice (every suite, every engine): one filter, same levels
    for name in LM_EVAL_LOGGERS:
        assert logging.getLogger(name).level == logging.WARNING
    assert not logging.getLogger("lm_eval.evaluator").isEnabledFor(logging.INFO)
    assert logging.getLogger("lm_eval.evaluator").isEnabledFor(logging.WARNING)  # its real warnings stay
    assert len(logging.getLogger(TASK_LOGGER).filters) == 1 and not advice_passes()


@pytest.mark.parametrize(
    ("setup", "level"),
    [
        # hydra.verbose=lm_eval sets the logger to DEBUG before the job runs
        (lambda mp: logging.getLogger("lm_eval").setLevel(logging.DEBUG), logging.DEBUG),
        # a hydra.job_logging entry for the logger
        (lambda mp: logging.getLogger("lm_eval").setLevel(logging.INFO), logging.INFO),
        # lm-eval's own knob
        (lambda mp: mp.setenv("LMEVAL_LOG_LEVEL", "debug"), logging.DEBUG),
    ],
)
def test_a_level_the_user_asked_for_is_kept(monkeypatch: pytest.MonkeyPatch, setup: Any, level: int) -> None:
    setup(monkeypatch)
    quiet_lm_eval()
    assert logging.getLogger("lm_eval").level == level
    assert advice_passes() == (level == logging.DEBUG)  # the advice only when DEBUG was asked for


def test_everything_at_debug_leaves_lm_eval_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", logging.DEBUG)  # hydra.verbose=true
    quiet_lm_eval()
    assert logging.getLogger("lm_eval").level == logging.NOTSET and advice_passes()


def test_scoring_a_suite_logs_no_lm_eval_info_and_no_metadata_advice(
    tiny_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        scores = lm_eval_scores(tiny_engine.path, "reasoning", "quick", "rank", limit=4)
    assert len(scores) == 4
    from_lm_eval = [r for r in caplog.records if r.name.startswith(("lm_eval", "lm-eval"))]
    assert not [r for r in from_lm_eval if r.levelno < logging.WARNING], from_lm_eval
    assert METADATA_ADVICE not in caplog.text
    caplog.clear()
    logging.getLogger("lm_eval").setLevel(logging.DEBUG)  # hydra.verbose=lm_eval: all of it again
    with caplog.at_level(logging.INFO):
        lm_eval_scores(tiny_engine.path, "reasoning", "quick", "rank", limit=4)
    assert METADATA_ADVICE in caplog.text and "Running loglikelihood requests" in caplog.text
