"""``python -m benchmarks.gpu_check`` on CPU: its report reads the gate's three outcomes, the logit
parity and the timing ratios, and says why a stage did not run (the GPU path itself cannot run
here: tests/pipeline/test_gpu.py checks that it stops at once)."""

from __future__ import annotations

from benchmarks import gpu_check


def test_the_rows_show_verdicts_ratios_and_what_did_not_run() -> None:
    suite = {"verdict": "PASS", "difference": -0.021, "ci_low": -0.08, "ci_high": 0.04, "p_value": 1.0}
    timed = {
        "recipe": "fp8", "target": "tensorrt", "status": "ok", "note": "",
        "vs_ort_cpu": {"kl_mean": 0.00042, "top1_agreement": 0.991}, "match": True,
        "gate": {
            "verdict": "INCONCLUSIVE", "suites": {"reasoning": suite},
            "drift": {"family": "bits8", "verdict": "PASS", "kl": 0.012, "top1": 0.93},
        },
        "ttft_ms": 4.1, "tpot_ms": 1.9, "ttft_vs_ort_cuda_fp16": 0.61, "tpot_vs_ort_cuda_fp16": 0.74,
    }  # fmt: skip
    assert gpu_check.cells(timed) == [
        "fp8",
        "tensorrt",
        "INCONCLUSIVE\nreasoning: -2.1% PASS\ndrift: KL 0.0120, top-1 93.0% (bits8) PASS",
        "0.00042 / 99.10% ok",
        "4.1",
        "1.9",
        "x0.61, x0.74",
    ]
    late = {"recipe": "int4", "target": "tensorrt", "status": "ok", "note": ""}
    late["gate"] = {"verdict": "not run", "note": "past the --deadline (450 s) at 452 s"}
    assert gpu_check.cells(late)[2:4] == ["not run: past the --deadline (450 s) at 452 s", ""]
    peer = {
        "recipe": "fp16",
        "target": "ort-cuda",
        "status": "failed",
        "note": "has no CUDAExecutionProvider",
    }
    assert gpu_check.cells(peer)[2] == "failed: has no CUDAExecutionProvider"


def test_a_stage_after_the_deadline_is_skipped_and_says_when() -> None:
    clock = gpu_check.Clock(deadline=0)
    assert clock.past()
    row = gpu_check._skipped("int4-tensorrt", clock)
    assert not row.ok and row.status == "skipped" and row.note.startswith("past the --deadline (0 s)")
    assert gpu_check.DEFAULT_RECIPES == ["fp8", "int4"]
    recipe, overrides = gpu_check.PEER
    assert recipe == "fp16" and overrides[-1] == "target=ort-cuda"
