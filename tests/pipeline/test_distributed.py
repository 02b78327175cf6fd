"""How a failed launch becomes one line: the agent's report (torch elastic's, as printed by
torch 2.13) read with the error files the ranks wrote. The launches themselves are exercised in
tests/passes/test_distill_accelerate.py and test_calibration_ranks.py."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.core.distributed import ERROR_PREFIX, _failure

RANK_REPORT = """\
[{index}]:
  time      : 2026-12-02_22:42:13
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {exit} (pid: 3125{rank})
  error_file: <N/A>
"""


def agent_report(failures: list[tuple[int, int]], root: tuple[int, int]) -> str:
    """The agent's report: ``failures`` listed first, then the first observed failure."""
    lines = ["pipeline.core.distributed FAILED", "-" * 60, "Failures:"]
    lines += [RANK_REPORT.format(index=i + 1, rank=r, exit=e) for i, (r, e) in enumerate(failures)]
    lines += ["-" * 60, "Root Cause (first observed failure):"]
    lines += [RANK_REPORT.format(index=0, rank=root[0], exit=root[1]), "=" * 60]
    return "Traceback (most recent call last):\n  ...\nChildFailedError:\n" + "\n".join(lines)


def write_error(work: Path, rank: int, message: str, user: bool = False) -> None:
    (work / f"{ERROR_PREFIX}{rank}.json").write_text(json.dumps({"message": message, "user": user}))


LOST_PEER = (
    "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"
)
KILLED = (
    "distill: the 2-process launch failed: rank 1 was killed (SIGKILL); "
    "a rerun resumes at the last checkpoint"
)


def test_a_killed_rank_is_the_cause_whichever_failure_the_agent_saw_first(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed, rank 0 failing on the lost peer: the agent may list either as the root
    cause (whichever exited first within its poll); the line names the killed rank both ways."""
    write_error(tmp_path, 0, LOST_PEER)
    killed_first = agent_report([(0, 1)], root=(1, -9))
    peer_first = agent_report([(1, -9)], root=(0, 1))
    for tail in (killed_first, peer_first):
        assert str(_failure(tmp_path, tail, 2, 1, "distill", "distill.collective_timeout_s")) == KILLED


def test_a_rank_that_failed_on_its_own_is_named_with_its_error_without_the_source_location(
    tmp_path: Path,
) -> None:
    write_error(tmp_path, 1, "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv")
    tail = agent_report([(0, -15)], root=(1, 1))
    assert str(
        _failure(tmp_path, tail, 2, 1, "quant.calibration", "quant.calibration.collective_timeout_s")
    ) == (
        "quant.calibration: the 2-process launch failed: rank 1: Timed out waiting 5000ms for recv "
        "(another rank stopped answering for quant.calibration.collective_timeout_s)"
    )


def test_a_user_error_in_any_rank_is_the_line_verbatim(tmp_path: Path) -> None:
    write_error(tmp_path, 0, LOST_PEER)
    write_error(tmp_path, 1, "distill.seq_len=10000000: the calibration text holds 3 windows", user=True)
    tail = agent_report([(0, 1)], root=(1, 1))
    assert str(_failure(tmp_path, tail, 2, 1, "distill", "distill.collective_timeout_s")) == (
        "distill.seq_len=10000000: the calibration text holds 3 windows"
    )


def test_without_a_report_the_launch_is_its_last_line(tmp_path: Path) -> None:
    tail = "usage: accelerate launch ...\naccelerate: error: unrecognized arguments: --bad\n"
    assert str(_failure(tmp_path, tail, 2, 2, "distill", "distill.collective_timeout_s")) == (
        "distill: the 2-process launch failed with exit code 2: "
        "accelerate: error: unrecognized arguments: --bad"
    )
