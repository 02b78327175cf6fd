"""The distill pass on the tiny random Llama pruned by the prune pass: a step lowers the KD loss,
a killed run resumes from its checkpoint to the same weights, bad input is one line."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from passes.distill import DistillPass, kd_loss, learning_rate
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.errors import PassError
from pipeline.core.manager import check_against_model
from pipeline.core.placement import ResolvedPlacement
from tests.conftest import make_tiny_llama
from tests.passes.test_prune import prune

SMALL = {"seq_len": 32, "batch_size": 2, "micro_batch_size": 1, "lr": 1e-3}


@pytest.fixture(scope="module")
def pruned(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    artifact, _ = prune(tiny_llama, tmp_path_factory.mktemp("pruned") / "out", mlp_ratio=0.5, depth_ratio=0.5)
    return artifact


def distill(
    source: Artifact,
    out: Path,
    checkpoints: Path,
    placement: ResolvedPlacement | None = None,
    **config: object,
) -> tuple[Artifact, dict]:
    """The pass run by hand, not through the manager (``run_pass``): the manager gives a pass
    the checkpoint folder of its cache key, and these tests choose it, to interrupt a run and
    resume it under another launcher, strategy or output folder."""
    step = DistillPass(**{**SMALL, **config})
    step.checkpoint_dir = checkpoints
    if placement is not None:
        step.placement = placement
    check_against_model([step], source)
    step.requires(source)
    out.mkdir()
    metrics = step.run(source, out)
    return Artifact.from_dir(Kind.TORCH, out), metrics


def distill_killed_in_step(step: int, source: Artifact, out: Path, ckpt: Path, **config: object) -> None:
    """Run the pass and interrupt it (KeyboardInterrupt, as Ctrl-C) in the first of step ``step``'s
    micro-batches, after the checkpoints it wrote before."""
    calls = {"n": 0}
    original = DistillPass._loss
    settings = {**SMALL, **config}
    per_step = int(settings["batch_size"]) // int(settings["micro_batch_size"])

    def dies(self: DistillPass, *args: object) -> object:
        calls["n"] += 1
        if calls["n"] == per_step * (step - 1) + 1:
            raise KeyboardInterrupt
        return original(self, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DistillPass, "_loss", dies)
        with pytest.raises(KeyboardInterrupt):
            distill(source, out, ckpt, **config)


def test_one_step_lowers_the_kd_loss_on_a_fixed_batch(pruned: Artifact) -> None:
    import torch

    from pipeline.core.torch_model import load_causal_lm

    teacher = load_causal_lm(Path(pruned.metadata["prune"]["teacher"]["path"]))
    student = load_causal_lm(pruned.path).train()
    ids = torch.randint(3, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        target = teacher(input_ids=ids).logits

    def loss() -> torch.Tensor:
        return kd_loss(student(input_ids=ids).logits, target, temperature=2.0)

    before = loss()
    before.backward()
    torch.optim.AdamW(student.parameters(), lr=1e-3).step()
    with torch.no_grad():
        assert float(loss()) < float(before)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_distillation_recovers_and_records_its_curve(
    pruned: Artifact, tmp_path: Path, precision: str
) -> None:
    from safetensors.torch import load_file

    result, metrics = distill(pruned, tmp_path / "out", tmp_path / "ckpt", steps=6, precision=precision)
    assert metrics["holdout_after"]["kl_vs_teacher"] < metrics["holdout_before"]["kl_vs_teacher"]
    # bf16 is mixed precision: the master weights, and so the checkpoint, stay fp32.
    weights = load_file(result.path / "model.safetensors")
    assert {str(tensor.dtype) for tensor in weights.values()} == {"torch.float32"}
    assert result.metadata["distill"]["precision"] == precision
    assert [point[0] for point in metrics["loss_curve"]] == [1, 5, 6]
    assert metrics["resumed_from_step"] == 0 and metrics["tokens_trained"] == 6 * 2 * 32
    assert result.metadata["distill"]["steps"] == 6 and (result.path / "tokenizer.json").is_file()
    config = json.loads((result.path / "config.json").read_text())
    assert config["num_hidden_layers"] == 1  # the student's shape is kept


def test_a_bfloat16_placement_teaches_with_a_bfloat16_teacher_and_float32_master_weights(
    pruned: Artifact, tmp_path: Path
) -> None:
    """pipeline.torch_dtype=bfloat16: the frozen teacher is loaded in bfloat16 (its held-out
    perplexity moves a little), the student keeps float32 master weights and bf16 autocast."""
    from safetensors.torch import load_file

    _, fp32 = distill(pruned, tmp_path / "fp32", tmp_path / "ckpt-fp32", steps=1)
    result, bf16 = distill(
        pruned,
        tmp_path / "bf16",
        tmp_path / "ckpt-bf16",
        placement=ResolvedPlacement("cpu", "bfloat16"),
        steps=1,
    )
    assert fp32["compute"]["teacher_dtype"] == "float32"
    assert bf16["compute"] == {
        "device": "cpu",
        "teacher_dtype": "bfloat16",
        "student_dtype": "float32",
        "autocast": "bfloat16",
        "launcher": "inline",
        "processes": 1,
        "strategy": None,
    }
    teacher = fp32["holdout_before"]["teacher_perplexity"], bf16["holdout_before"]["teacher_perplexity"]
    assert teacher[0] != teacher[1] and teacher[1] == pytest.approx(teacher[0], rel=0.05)
    assert bf16["holdout_before"]["perplexity"] == fp32["holdout_before"]["perplexity"]  # fp32 student
    weights = load_file(result.path / "model.safetensors")
    assert {str(tensor.dtype) for tensor in weights.values()} == {"torch.float32"}


def test_a_killed_run_resumes_at_its_checkpoint_with_the_same_result(
    pruned: Artifact, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    whole, _ = distill(pruned, tmp_path / "whole", tmp_path / "ckpt-whole", steps=4, checkpoint_every=2)
    distill_killed_in_step(3, pruned, tmp_path / "first", tmp_path / "ckpt", steps=4, checkpoint_every=2)
    resumed, metrics = distill(pruned, tmp_path / "second", tmp_path / "ckpt", steps=4, checkpoint_every=2)
    assert metrics["resumed_from_step"] == 2
    a, b = load_file(whole.path / "model.safetensors"), load_file(resumed.path / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)


def test_the_schedule_warms_up_then_decays_to_zero() -> None:
    from passes.distill import DistillConfig

    config = DistillConfig(steps=100, lr=1e-3, warmup_ratio=0.1)
    rates = [learning_rate(step, config) for step in range(100)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert max(rates) == pytest.approx(1e-3) and rates[-1] < 1e-5
    assert all(a >= b for a, b in itertools.pairwise(rates[9:]))


def test_without_a_pruned_student_or_with_another_tokenizer_it_refuses(
    tiny_llama: Path, pruned: Artifact, tmp_path: Path
) -> None:
    unpruned = Artifact.from_dir(Kind.TORCH, tiny_llama)
    for check in (
        lambda: check_against_model([DistillPass(**SMALL)], unpruned),
        lambda: DistillPass(**SMALL).requires(unpruned),
    ):
        with pytest.raises(PassError, match="no teacher on record; distill=kd follows a prune pass"):
            check()
    (tmp_path / "student").mkdir()
    for path in pruned.path.iterdir():
        (tmp_path / "student" / path.name).write_bytes(path.read_bytes())
    other = make_tiny_llama(tmp_path / "other-tokenizer")
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["added_tokens"][0]["content"] = "<|other|>"
    (tmp_path / "student" / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(PassError, match="the student's tokenizer differs from the teacher's"):
        DistillPass(**SMALL).requires(Artifact.from_dir(Kind.TORCH, tmp_path / "student"))
    bad_precision = r"distill\.precision='fp8' is out of range \(choose one of bf16, fp32\)"
    with pytest.raises(PassError, match=bad_precision):
        DistillPass(**{**SMALL, "precision": "fp8"})
    with pytest.raises(PassError, match=r"distill\.batch_size=3 is out of range"):
        DistillPass(**{**SMALL, "batch_size": 3, "micro_batch_size": 2})


def test_prune_then_distill_from_the_command_line(tiny_llama: Path, tmp_path: Path) -> None:
    from tests.pipeline.test_main import run_pipeline

    settings = ["prune=width25", "prune.calibration.num_samples=4", "prune.calibration.seq_len=32"]
    kd = ["distill=kd", "distill.steps=3", "distill.seq_len=32", "distill.batch_size=2"]
    kd += ["distill.micro_batch_size=1", "bench=none"]
    result = run_pipeline(tiny_llama, tmp_path, "run", *settings, *kd)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert [p["name"] for p in manifest["passes"]] == ["prune", "distill", "export", "ort_build"]
    assert manifest["passes"][1]["metrics"]["loss_curve"][-1][0] == 3
    assert not list((tmp_path / "cache" / ".checkpoints").glob("*/*"))  # removed once cached


KILLED_IN_STEP_FOUR = {"steps": 4, "checkpoint_every": 1}  # checkpoints after steps 1, 2, 3


@pytest.fixture(scope="module")
def killed(pruned: Artifact, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the checkpoint folder of a run killed in step 4, the weights of the uninterrupted run)."""
    root = tmp_path_factory.mktemp("killed")
    whole, _ = distill(pruned, root / "whole", root / "ckpt-whole", **KILLED_IN_STEP_FOUR)
    distill_killed_in_step(4, pruned, root / "first", root / "ckpt", **KILLED_IN_STEP_FOUR)
    return root / "ckpt", whole.path / "model.safetensors"


def assert_same_weights(a_file: Path, b_file: Path) -> None:
    import torch
    from safetensors.torch import load_file

    a, b = load_file(a_file), load_file(b_file)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)


def test_checkpoints_are_safetensors_and_json_and_only_the_last_two_are_kept(
    killed: tuple[Path, Path],
) -> None:
    from safetensors.torch import load_file

    checkpoints, _ = killed
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000002", "step-000003"]  # no staging
    for folder in checkpoints.iterdir():
        assert sorted(p.name for p in folder.iterdir()) == [
            "optimizer.safetensors",
            "state.json",
            "student.safetensors",
        ]
        state = json.loads((folder / "state.json").read_text())
        assert state["state"]["step"] == int(folder.name[-6:])
        assert state["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}  # tied: stored once
        optimizer = load_file(folder / "optimizer.safetensors")
        assert {"state.0.exp_avg", "state.0.exp_avg_sq", "state.0.step", "rng.torch"} <= optimizer.keys()


def damage(folder: Path, how: str) -> None:
    from safetensors.torch import load_file, save_file

    student = folder / "student.safetensors"
    if how == "truncated":
        student.write_bytes(student.read_bytes()[:-1000])
    elif how == "empty optimizer file":
        (folder / "optimizer.safetensors").write_bytes(b"")
    elif how == "bad json":
        (folder / "state.json").write_text('{"format": 1, "config": ')
    elif how == "json list":
        (folder / "state.json").write_text("[1, 2]")
    elif how == "renamed tensor":
        tensors = load_file(student)
        tensors["model.norm.renamed"] = tensors.pop("model.norm.weight")
        save_file(tensors, student)
    elif how == "wrong shape":
        tensors = load_file(student)
        tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
        save_file(tensors, student)
    elif how == "optimizer shape":
        tensors = load_file(folder / "optimizer.safetensors")
        tensors["state.0.exp_avg"] = tensors["state.0.exp_avg"][:1].clone()
        save_file(tensors, folder / "optimizer.safetensors")
    elif how == "missing file":
        (folder / "student.safetensors").unlink()
    elif how == "data order out of range":
        state = json.loads((folder / "state.json").read_text())
        state["state"]["epoch_orders"][0][0] = 10**6  # would fail training at every rerun
        (folder / "state.json").write_text(json.dumps(state))


DAMAGES = [
    "truncated",
    "empty optimizer file",
    "bad json",
    "json list",
    "renamed tensor",
    "wrong shape",
    "optimizer shape",
    "missing file",
    "data order out of range",
]


@pytest.mark.parametrize("how", DAMAGES)
def test_an_unreadable_latest_checkpoint_falls_back_to_the_one_before(
    pruned: Artifact, killed: tuple[Path, Path], tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    template, whole = killed
    checkpoints = Path(shutil.copytree(template, tmp_path / "ckpt"))
    damage(checkpoints / "step-000003", how)
    with caplog.at_level("WARNING", logger="passes.distill"):
        resumed, metrics = distill(pruned, tmp_path / "second", checkpoints, **KILLED_IN_STEP_FOUR)
    assert metrics["resumed_from_step"] == 2
    assert any("discarding checkpoint step-000003" in r.getMessage() for r in caplog.records)
    assert_same_weights(whole, resumed.path / "model.safetensors")
    # The damaged one was replaced by the rerun's own step 3.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000002", "step-000003"]
    assert json.loads((checkpoints / "step-000003" / "state.json").read_text())["state"]["step"] == 3


def test_with_every_checkpoint_unreadable_it_starts_afresh(
    pruned: Artifact, killed: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    template, whole = killed
    checkpoints = Path(shutil.copytree(template, tmp_path / "ckpt"))
    damage(checkpoints / "step-000003", "truncated")
    damage(checkpoints / "step-000002", "bad json")
    with caplog.at_level("WARNING", logger="passes.distill"):
        fresh, metrics = distill(pruned, tmp_path / "again", checkpoints, **KILLED_IN_STEP_FOUR)
    assert metrics["resumed_from_step"] == 0
    assert sum("discarding checkpoint" in r.getMessage() for r in caplog.records) == 2
    assert_same_weights(whole, fresh.path / "model.safetensors")


def test_leftovers_are_removed_and_a_pickle_is_never_loaded(
    pruned: Artifact, killed: tuple[Path, Path], tmp_path: Path
) -> None:
    """A staging folder of a killed save and a pickle of an earlier version: both are removed at
    resume; unpickling the pickle would have created the marker."""
    import os
    import pathlib
    import pickle
    import signal
    import subprocess
    import sys

    template, whole = killed
    checkpoints = Path(shutil.copytree(template, tmp_path / "ckpt"))
    marker = tmp_path / "MARKER"

    class Touch:
        def __reduce__(self) -> tuple[object, tuple[object, ...]]:
            return (pathlib.Path.touch, (pathlib.Path(marker),))

    (checkpoints / "distill_state.pt").write_bytes(pickle.dumps(Touch()))
    script = (
        "import sys, time; from pathlib import Path\n"
        "from pipeline.core.staging import owned_folder, unique_name\n"
        "with owned_folder(Path(sys.argv[1]) / unique_name('.step-000004')) as f:\n"
        "    (f / 'student.safetensors').write_bytes(b'half')\n"
        "    print('ready', flush=True); time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(checkpoints)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert [p.name for p in checkpoints.glob(".step-000004.*") if p.is_dir()]

    resumed, metrics = distill(pruned, tmp_path / "second", checkpoints, **KILLED_IN_STEP_FOUR)
    assert metrics["resumed_from_step"] == 3
    assert not marker.exists()
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000002", "step-000003"]
    assert_same_weights(whole, resumed.path / "model.safetensors")
