"""The distill pass under ``accelerate launch`` with 2 processes (gloo on this CPU), against the
same pass inline: DDP and FSDP give the single-process losses and weights, a killed rank fails the
pass with one line and the run resumes under the other launcher, bad knobs are one line."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from passes.distill import DistillPass
from pipeline.core.artifacts import Artifact
from pipeline.core.errors import PassError
from pipeline.core.manager import check_against_model
from tests.passes.test_distill import SMALL, distill, distill_killed_in_step
from tests.passes.test_prune import prune

# fp32, so that 1 and 2 processes differ only by the order of float sums (the gradient all-reduce
# adds per-rank sums where one process adds all micro-batches in turn): a few ulp per gradient.
# AdamW moves each weight by about lr a step whatever its gradient's scale, so where a gradient is
# near zero those ulp can tilt a step: measured, the largest difference after 4 steps of lr 1e-3 is
# 3e-7 (1 element of 20480). 1e-5 absolute is 1 % of one step: a rank whose gradients are left out
# or wrong moves weights by ~lr and fails it.
EXACT = {**SMALL, "batch_size": 4, "precision": "fp32"}
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
TWO = {"launcher": "accelerate", "num_processes": 2}


@pytest.fixture(scope="module")
def student(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    """The tiny Llama with its MLPs halved and both decoder blocks kept (FSDP shards per block)."""
    artifact, _ = prune(tiny_llama, tmp_path_factory.mktemp("student") / "out", mlp_ratio=0.5)
    return artifact


def same_weights(a: Artifact, b: Artifact) -> None:
    import torch
    from safetensors.torch import load_file

    first, second = load_file(a.path / "model.safetensors"), load_file(b.path / "model.safetensors")
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(first[name], second[name], **TOLERANCE)


@pytest.fixture(scope="module")
def inline(student: Artifact, tmp_path_factory: pytest.TempPathFactory) -> tuple[Artifact, dict]:
    folder = tmp_path_factory.mktemp("inline")
    return distill(student, folder / "out", folder / "ckpt", steps=4, **EXACT)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_give_the_single_process_losses_and_weights(
    student: Artifact, inline: tuple[Artifact, dict], tmp_path: Path, strategy: str
) -> None:
    result, metrics = distill(
        student, tmp_path / "out", tmp_path / "ckpt", steps=4, strategy=strategy, **EXACT, **TWO
    )
    assert metrics["compute"]["processes"] == 2 and metrics["compute"]["strategy"] == strategy
    peaks = metrics["ranks"]["peak_rss_bytes"]  # each rank's own, measured in the rank
    assert len(peaks) == 2 and all(peak > 100 * 2**20 for peak in peaks)  # torch alone is more
    alone, alone_metrics = inline
    assert [step for step, _ in metrics["loss_curve"]] == [step for step, _ in alone_metrics["loss_curve"]]
    for (_, loss), (_, expected) in zip(metrics["loss_curve"], alone_metrics["loss_curve"], strict=True):
        assert loss == pytest.approx(expected, rel=1e-4, abs=1e-5)  # rounded to 5 decimals when recorded
    assert metrics["holdout_after"]["kl_vs_teacher"] == pytest.approx(
        alone_metrics["holdout_after"]["kl_vs_teacher"], rel=1e-4
    )
    same_weights(result, alone)
    assert result.metadata == alone.metadata  # the output does not say how many processes made it


def test_one_process_under_accelerate_is_the_inline_run(
    student: Artifact, inline: tuple[Artifact, dict], tmp_path: Path
) -> None:
    """``accelerate launch`` of one process (no process group): the inline run's student, to the bit."""
    result, metrics = distill(
        student, tmp_path / "out", tmp_path / "ckpt", steps=4, **EXACT, launcher="accelerate"
    )
    assert metrics["compute"]["processes"] == 1 and metrics["ranks"]["processes"] == 1
    assert metrics["loss_curve"] == inline[1]["loss_curve"] and result.digest == inline[0].digest


def rank_process(rank: int) -> psutil.Process | None:
    """This user's running rank ``rank`` of a ``pipeline.core.distributed`` launch."""
    for process in psutil.process_iter(["cmdline"]):
        try:
            if "pipeline.core.distributed" in (process.info["cmdline"] or []) and (
                process.environ().get("RANK") == str(rank)
            ):
                return process
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def signal_rank_one(
    student: Artifact, out: Path, checkpoints: Path, how: signal.Signals, **settings: object
) -> tuple[PassError, float]:
    """Run the pass in 2 ranks, send ``how`` to rank 1 once rank 0 wrote a checkpoint; (the pass's
    error, seconds from the signal to the failure). Fails if it does not fail within 2 minutes."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            distill(student, out, checkpoints, **settings, **TWO)
        except BaseException as exc:  # handed to the test's thread
            failure.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    deadline, victim = time.monotonic() + 120, None
    while victim is None and time.monotonic() < deadline and runner.is_alive():
        if list(checkpoints.glob("step-*")):
            victim = rank_process(1)
        time.sleep(0.02)
    assert victim is not None, "no checkpoint or no rank 1 to signal"
    signalled_at = time.monotonic()
    os.kill(victim.pid, how)
    runner.join(timeout=120)
    assert not runner.is_alive(), "the pass hangs"
    assert len(failure) == 1 and isinstance(failure[0], PassError), failure
    assert rank_process(0) is None and rank_process(1) is None  # no rank left behind
    return failure[0], time.monotonic() - signalled_at


def test_a_killed_rank_fails_the_pass_with_one_line_and_the_run_resumes_inline(
    student: Artifact, tmp_path: Path
) -> None:
    """Rank 1 is SIGKILLed once rank 0 wrote a checkpoint: the pass fails at once (gloo reports the
    lost peer; the agent stops rank 0), and the same run resumes inline from that checkpoint to the
    weights of an uninterrupted inline run."""
    # 60 steps: the 2-rank run is still far from its end when rank 1 is killed after step 2, and
    # the two inline runs (resumed, uninterrupted) cost a third of what 200 steps did.
    long = {**EXACT, "steps": 60, "checkpoint_every": 2}
    checkpoints = tmp_path / "ckpt"
    error, seconds = signal_rank_one(student, tmp_path / "killed", checkpoints, signal.SIGKILL, **long)
    assert seconds < 60 and str(error) == (
        "distill: the 2-process launch failed: rank 1 was killed (SIGKILL); "
        "a rerun resumes at the last checkpoint"
    )

    resumed, metrics = distill(student, tmp_path / "resumed", checkpoints, **long)
    assert 2 <= metrics["resumed_from_step"] < 60 and metrics["compute"]["launcher"] == "inline"
    whole, _ = distill(student, tmp_path / "whole", tmp_path / "ckpt-whole", **long)
    same_weights(resumed, whole)


def test_a_stuck_rank_fails_the_pass_after_the_collective_timeout(student: Artifact, tmp_path: Path) -> None:
    """Rank 1 is stopped (SIGSTOP, as a hung host): rank 0's next collective gives up after
    distill.collective_timeout_s and writes its error; 5 s later the agent and its ranks are killed
    (the stopped one included), and the pass fails with one line instead of hanging."""
    settings = {**EXACT, "steps": 2000, "checkpoint_every": 2, "collective_timeout_s": 5}
    error, seconds = signal_rank_one(student, tmp_path / "out", tmp_path / "ckpt", signal.SIGSTOP, **settings)
    assert seconds < 25  # the 5 s timeout, then 5 s for the other rank to end
    assert str(error).startswith("distill: the 2-process launch failed: rank 0: Timed out waiting 5000ms")
    assert str(error).endswith("(another rank stopped answering for distill.collective_timeout_s)")


def test_ctrl_c_stops_every_rank(student: Artifact, tmp_path: Path) -> None:
    """SIGINT to this process while the ranks train (Ctrl-C at the terminal: the launch runs in a
    session of its own, so only we get it): KeyboardInterrupt, and no rank is left running."""
    # Python's own SIGINT handler whatever started pytest: a background job of a non-interactive
    # shell (as CI may be) inherits SIGINT ignored, and the signal would change nothing.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_two_ranks(student, tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_two_ranks(student: Artifact, tmp_path: Path) -> None:
    settings = {**EXACT, "steps": 2000, "checkpoint_every": 2}
    checkpoints = tmp_path / "ckpt"

    finished = threading.Event()

    def interrupt_after_a_checkpoint() -> None:
        while not list(checkpoints.glob("step-*")) and not finished.wait(0.02):
            pass
        if not finished.is_set():
            os.kill(os.getpid(), signal.SIGINT)

    interrupter = threading.Thread(target=interrupt_after_a_checkpoint, daemon=True)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            distill(student, tmp_path / "out", checkpoints, **settings, **TWO)
    finally:
        finished.set()
        interrupter.join()
    deadline = time.monotonic() + 40  # SIGTERM to the agent, which stops its ranks
    while (rank_process(0) or rank_process(1)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rank_process(0) is None and rank_process(1) is None


def test_an_inline_checkpoint_resumes_under_fsdp(
    student: Artifact, inline: tuple[Artifact, dict], tmp_path: Path
) -> None:
    """Killed inline in step 3 (checkpoint at step 2), resumed by 2 FSDP ranks: they load the whole
    checkpoint into their shards, weights and AdamW state, and end where the inline run ended."""
    checkpoints = tmp_path / "ckpt"
    settings = {**EXACT, "steps": 4, "checkpoint_every": 2}
    distill_killed_in_step(3, student, tmp_path / "first", checkpoints, **settings)
    resumed, metrics = distill(student, tmp_path / "second", checkpoints, strategy="fsdp", **settings, **TWO)
    assert metrics["resumed_from_step"] == 2
    same_weights(resumed, inline[0])


def test_an_error_in_a_rank_is_its_one_line(student: Artifact, tmp_path: Path) -> None:
    """More windows per batch than the text holds: found by the ranks, which read the text."""
    with pytest.raises(PassError, match=r"^distill\.seq_len=\d+: the calibration text holds \d+ windows"):
        distill(student, tmp_path / "out", tmp_path / "ckpt", **{**EXACT, "batch_size": 65536}, **TWO)


def test_bad_process_knobs_are_one_line_before_anything_runs(pruned_to_one_block: Artifact) -> None:
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(
        PassError,
        match=rf"^distill\.num_processes={cores + 1} is out of range: this machine has {cores} CPU cores",
    ):
        DistillPass(
            **{**EXACT, "batch_size": 4 * (cores + 1)}, launcher="accelerate", num_processes=cores + 1
        ).preflight()
    with pytest.raises(PassError, match=r"needs distill\.launcher=accelerate"):
        DistillPass(**EXACT, num_processes=2)
    with pytest.raises(
        PassError, match=r"distill\.num_processes=2 is out of range \(each of the processes takes"
    ):
        DistillPass(**{**EXACT, "batch_size": 2, "micro_batch_size": 2}, **TWO)
    with pytest.raises(
        PassError, match=r"distill\.strategy='zero3' is out of range \(choose one of ddp, fsdp\)"
    ):
        DistillPass(**EXACT, strategy="zero3", **TWO)
    too_small = r"^distill\.strategy=fsdp: the student has 1 decoder block\(s\), too few to shard over"
    with pytest.raises(PassError, match=too_small):
        check_against_model([DistillPass(**EXACT, strategy="fsdp", **TWO)], pruned_to_one_block)
    check_against_model([DistillPass(**EXACT, **TWO)], pruned_to_one_block)  # DDP replicates: any size


@pytest.fixture(scope="module")
def pruned_to_one_block(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    artifact, _ = prune(tiny_llama, tmp_path_factory.mktemp("one-block") / "out", depth_ratio=0.5)
    return artifact


def test_the_memory_preflight_counts_every_rank_on_this_host(student: Artifact) -> None:
    from pipeline.core.memory import generic_estimate
    from pipeline.core.shapes import ModelShapes

    shapes = ModelShapes.from_config(json.loads((student.path / "config.json").read_text()))
    one = generic_estimate(DistillPass(**EXACT), shapes).host_bytes
    assert DistillPass(**EXACT).estimate_memory(shapes) is None
    assert DistillPass(**EXACT, **TWO).estimate_memory(shapes) == 2 * one
    state = shapes.parameters * 16
    assert DistillPass(**EXACT, strategy="fsdp", **TWO).estimate_memory(shapes) == 2 * one - state


def test_the_execution_knobs_stay_out_of_the_cache_key(student: Artifact) -> None:
    from pipeline.core.manager import _key

    inline_key = _key(DistillPass(**EXACT), student.digest)
    assert (
        _key(DistillPass(**EXACT, strategy="fsdp", collective_timeout_s=9, **TWO), student.digest)
        == inline_key
    )
    assert _key(DistillPass(**{**EXACT, "seed": 1}), student.digest) != inline_key


def test_from_the_command_line_the_output_is_cached_under_either_launcher(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """``distill.launcher=accelerate distill.num_processes=2`` through the pass manager computes the
    student once; the inline rerun is a cache hit. Too many processes: one line, exit 2, no pass run."""
    from tests.pipeline.test_main import run_pipeline

    recipe = ["prune=width25", "prune.calibration.num_samples=4", "prune.calibration.seq_len=32"]
    recipe += ["distill=kd", "distill.steps=3", "distill.seq_len=32", "distill.batch_size=2"]
    recipe += ["distill.micro_batch_size=1", "distill.precision=fp32", "bench=none", "export=onnx"]
    cores = len(os.sched_getaffinity(0))
    too_many = ["distill.launcher=accelerate", f"distill.num_processes={cores + 1}"]
    result = run_pipeline(
        tiny_llama, tmp_path, "too-many", *recipe, *too_many, f"distill.batch_size={cores + 1}"
    )
    assert result.returncode == 2, result.stderr[-2000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error == [
        f"error: distill.num_processes={cores + 1} is out of range: this machine has {cores} CPU cores "
        f"(one process each); set distill.num_processes between 1 and {cores}"
    ]
    assert ": running (" not in result.stdout + result.stderr  # refused before the first pass

    result = run_pipeline(
        tiny_llama, tmp_path, "two", *recipe, "distill.launcher=accelerate", "distill.num_processes=2"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "manifest.json").read_text())["passes"][1]
    assert (
        two["name"] == "distill" and not two["cache_hit"] and ": running (" in result.stdout + result.stderr
    )
    assert two["metrics"]["compute"]["processes"] == 2 and two["config"]["num_processes"] == 2
    result = run_pipeline(tiny_llama, tmp_path, "one", *recipe)
    assert result.returncode == 0, result.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "manifest.json").read_text())["passes"][1]
    assert one["cache_hit"] and one["output_digest"] == two["output_digest"]
