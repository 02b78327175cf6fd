"""Knowledge distillation of a pruned student from its unpruned teacher (torch stage), as Minitron
recovers pruned models: Muralidharan et al. 2024, "Compact Language Models via Pruning and
Knowledge Distillation", section 3 (logit KD, optionally with intermediate-state losses), after
Hinton et al. 2015, "Distilling the Knowledge in a Neural Network".

Loss per token: ``T^2 KL(softmax(z_teacher / T) || softmax(z_student / T))``, plus, with
``hidden_weight > 0``, that weight times the MSE between each student layer's output and the
output of the teacher layer it was cut from (``prune`` records which; needs an unpruned hidden
size). Optimizer: AdamW, linear warm-up over ``warmup_ratio`` of the steps, then cosine decay
to zero; ``batch_size`` sequences per step as ``batch_size / micro_batch_size`` accumulated
micro-batches. Precision (``precision="bf16"``, the default): mixed precision after Micikevicius
et al. 2018, "Mixed Precision Training": the student's forward and backward run under
``torch.autocast(bfloat16)`` and the teacher as a bfloat16 copy, while master weights, AdamW
state and the KD loss stay fp32 (bfloat16 has fp32's range, so no loss scaling).
Placement (``pipeline.device``, ``pipeline.torch_dtype``), reconciled with ``precision``: everything
(teacher, student, batches, AdamW state) lives on the placement's device. The frozen teacher is
loaded in ``pipeline.torch_dtype``: in float32 (the CPU's ``auto``) it measures the held-out
quality and, with ``precision="bf16"``, a bfloat16 copy of it teaches, as above; in bfloat16 or
float16 it is that one copy, teaching and measuring (half the memory of fp32, no second copy). The
student's master weights, AdamW state, KD loss and the held-out perplexity/KL are float32 (float64
for the held-out sums) whatever the placement; ``precision`` alone picks the student's autocast
dtype (bfloat16, or none for "fp32"): float16 autocast would need loss scaling, which we do not do,
so a CUDA device without bfloat16 must use ``precision="fp32"`` (a one-line error says so).
Data: token windows of the shipped calibration text (``calibration/data``; the
eval suites are synthetic and the quality text is GPL-3, so neither is trained on), reshuffled
every epoch; ``HOLDOUT`` windows are never trained on and measure perplexity and KL against the
teacher before and after.

The teacher is the checkpoint the prune pass started from (its path and digest are in the
student's metadata; the digest is checked). Every ``checkpoint_every`` steps the student,
optimizer, schedule, torch RNG, data order and loss history are saved to the pass's checkpoint
folder (kept by the pass manager across interrupted runs), so a killed run resumes at the step it
reached and ends with the same weights as an uninterrupted one. A checkpoint is a folder
``step-NNNNNN`` of safetensors (the student's tensors; AdamW's ``exp_avg``/``exp_avg_sq``/``step``
per parameter and the RNG state) and ``state.json`` (hyperparameters, schedule, data order, loss
curve): no pickle, so a checkpoint folder can never run code. It is written in a staging folder
owned by a lock and renamed into place when complete; the last ``KEEP_CHECKPOINTS`` are kept. A
checkpoint is untrusted input when read back: every field of ``state.json`` is typed and
range-checked against this run (``check_state``: the step, the loss curve's points, the seed's data
order, AdamW's hyperparameters, the schedule's state), its files must be regular ones (no symlink,
FIFO or device), and its tensors must have the student's names, shapes and dtypes and finite values.
One that fails (truncated, bad JSON, a field of the wrong type) is discarded with a warning and the
run resumes from the one before (or from the start). The knobs are range-checked at start-up
(``LIMITS``), the KD loss of every step must be finite, and the manager refuses a student with a
non-finite weight: a diverged run is one line, never a cached student.
Defaults fit the 2-core CPU: see ``configs/distill/kd.yaml`` for the measured budget.

Data parallelism (``launcher="accelerate"``, ``num_processes=N``; ``pipeline/core/distributed.py``):
the same pass in N ranks started by ``accelerate launch`` (gloo on the CPU, NCCL on CUDA, a
timeout on every collective), as PyTorch's DDP (Li et al. 2020, "PyTorch Distributed: Experiences
on Accelerating Data Parallel Training") or FSDP (Zhao et al. 2023, "PyTorch FSDP: Experiences on
Scaling Fully Sharded Data Parallel"; ``fully_shard`` per decoder block). Every rank walks the same
data order and takes its contiguous ``batch_size / N`` sequences of each step; the gradients are
averaged across ranks, so a step is the single-process step up to the order of float sums. The
frozen teacher is replicated in every rank. Rank 0 writes the checkpoints, whole and in the
single-process layout, so a run resumes under either launcher; the launcher, process count,
strategy and timeout are execution knobs, outside the cache key and the checkpoint's config match.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from calibration.datasets import DATASETS, calibration_text
from passes.prune import holdout_quality
from pipeline.core.artifacts import Artifact, Kind, folder_digest, sha256_file, write_metadata
from pipeline.core.base import Pass, Workload, without_knobs
from pipeline.core.config import register_pass
from pipeline.core.distributed import (
    LAUNCHERS,
    STRATEGIES,
    Group,
    check_processes,
    data_parallel,
    full_state,
    launch,
    load_optimizer_state,
    load_weights,
    sharded,
    sync_gradients,
    unwrapped,
)
from pipeline.core.errors import PassError
from pipeline.core.families import family_of
from pipeline.core.files import loads_bounded, read_regular_text, regular_size
from pipeline.core.planned_model import PlannedModel
from pipeline.core.staging import owned_folder, remove_abandoned, unique_name

if TYPE_CHECKING:
    from pipeline.core.shapes import ModelShapes

log = logging.getLogger(__name__)

HOLDOUT = 8  # windows never trained on: perplexity and KL vs the teacher, before and after
CHECKPOINT_PREFIX = "step-"  # step-000020: the checkpoint after 20 steps
CHECKPOINT_NAME = re.compile(r"step-(\d{6,})")
KEEP_CHECKPOINTS = 2  # the newest and the one before, to fall back on if the newest is unreadable
STATE_FILE = "state.json"
STUDENT_FILE = "student.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
CHECKPOINT_FORMAT = 1
RNG_TENSOR = "rng.torch"
LEGACY_CHECKPOINT = "distill_state.pt"  # a pickle written by earlier versions: removed, never loaded
CURVE_EVERY = 5  # steps between points of the loss curve kept in the record
PRECISIONS = ("bf16", "fp32")


@dataclass
class DistillConfig:
    """Logit (and optionally hidden-state) distillation from the unpruned teacher."""

    _target_: str = "passes.distill.DistillPass"
    steps: int = 160
    seq_len: int = 256
    batch_size: int = 8  # sequences per optimizer step
    # Sequences per forward/backward; batch_size / micro_batch_size are accumulated. One micro-batch
    # of 8 runs 5x faster a step than 4 of 2 on 2 cores (16 vs 80 s, measured), memory permitting.
    micro_batch_size: int = 8
    lr: float = 2e-4
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    temperature: float = 1.0
    hidden_weight: float = 0.0
    checkpoint_every: int = 20
    dataset: str = "python_reference"
    seed: int = 0
    # "bf16": the teacher runs as a bfloat16 copy and the student's forward/backward under
    # torch.autocast(bfloat16), with fp32 master weights, AdamW state and KD loss (mixed precision,
    # Micikevicius et al. 2018). Measured on this CPU (AMX-BF16): 6.4-7.7 s a step vs 12.8-15.4 s
    # in fp32. "fp32" trains in full precision (for CPUs without native bfloat16).
    precision: str = "bf16"
    # Execution knobs (outside the cache key; a checkpoint resumes under any of them): "inline" runs
    # the steps in this process; "accelerate" in num_processes ranks under `accelerate launch`, each
    # taking batch_size / num_processes sequences of every step, as "ddp" (replicated weights) or
    # "fsdp" (weights, gradients and AdamW state sharded, one decoder block gathered at a time). A
    # collective that waits longer than collective_timeout_s for another rank fails the pass.
    launcher: str = "inline"
    num_processes: int = 1
    strategy: str = "ddp"
    collective_timeout_s: float = 300.0

    def validate(self) -> None:
        """One line naming the first knob of a wrong type or out of its range (``LIMITS``)."""
        config = self
        for knob, (low, high) in LIMITS.items():
            value = getattr(config, knob)
            integral = isinstance(getattr(DistillConfig, knob), int)
            typed = isinstance(value, int) if integral else isinstance(value, int | float)
            good = typed and not isinstance(value, bool) and math.isfinite(value)
            if good:
                good = (low < value if knob in OPEN_BELOW else low <= value) and (
                    value < high if knob in OPEN_ABOVE else value <= high
                )
            if not good:
                kind = "an integer" if integral else "a finite number"
                raise PassError(
                    f"distill.{knob}={value!r} is out of range: {kind} in "
                    f"{_interval(knob, low, high)}{LIMIT_HINTS.get(knob, '')}"
                )
        checks = {
            "batch_size": config.batch_size >= config.micro_batch_size
            and config.batch_size % config.micro_batch_size == 0,
            "precision": config.precision in PRECISIONS,
            "launcher": config.launcher in LAUNCHERS,
            "strategy": config.strategy in STRATEGIES,
            "num_processes": (config.num_processes == 1 or config.launcher == "accelerate")
            and config.batch_size % (config.num_processes * config.micro_batch_size) == 0,
        }
        checks["dataset"] = config.dataset in DATASETS
        for knob, ok in checks.items():
            if not ok:
                hint = {
                    "batch_size": f" (a multiple of distill.micro_batch_size={config.micro_batch_size})",
                    "dataset": f" (choose one of {', '.join(sorted(DATASETS))})",
                    "precision": f" (choose one of {', '.join(PRECISIONS)})",
                    "launcher": f" (choose one of {', '.join(LAUNCHERS)})",
                    "strategy": f" (choose one of {', '.join(STRATEGIES)})",
                    "num_processes": (
                        " (more than one process needs distill.launcher=accelerate)"
                        if config.num_processes > 1 and config.launcher != "accelerate"
                        else f" (each of the processes takes distill.batch_size / num_processes = "
                        f"{config.batch_size}/{config.num_processes} sequences a step, a multiple of "
                        f"distill.micro_batch_size={config.micro_batch_size})"
                    ),
                }.get(knob, "")
                raise PassError(f"distill.{knob}={getattr(config, knob)!r} is out of range{hint}")


# The numeric knobs' closed ranges (``_interval`` shows the open ends): an optimizer knob beyond them
# diverges or does nothing (an AdamW step above 1 moves every weight by about 1 a step), a size beyond
# them cannot fit. ``check_model`` bounds seq_len by the model's context as well.
LIMITS: dict[str, tuple[float, float]] = {
    "steps": (1, 10**7),
    "seq_len": (8, 1 << 20),
    "batch_size": (1, 1 << 16),
    "micro_batch_size": (1, 1 << 16),
    "lr": (0.0, 1.0),
    "weight_decay": (0.0, 1.0),
    "warmup_ratio": (0.0, 1.0),
    "temperature": (0.01, 100.0),
    "hidden_weight": (0.0, 1000.0),
    "checkpoint_every": (1, 10**7),
    "seed": (0, 2**32 - 1),
    "num_processes": (1, 1024),
    "collective_timeout_s": (0.0, 7 * 86400.0),
}
OPEN_BELOW = ("lr", "collective_timeout_s")  # 0 itself is out of range
OPEN_ABOVE = ("warmup_ratio",)
LIMIT_HINTS = {
    "lr": " (AdamW's step size; 1e-5 to 1e-3 is usual: a larger one diverges)",
    "weight_decay": " (AdamW's decoupled decay per unit of lr; 0.0 to 0.1 is usual)",
    "warmup_ratio": " (the fraction of distill.steps spent warming up)",
}


def _interval(knob: str, low: float, high: float) -> str:
    def shown(bound: float) -> str:
        return str(bound) if isinstance(bound, int) else f"{bound:g}"

    return (
        f"{'(' if knob in OPEN_BELOW else '['}{shown(low)}, {shown(high)}{')' if knob in OPEN_ABOVE else ']'}"
    )


register_pass("distill", "distill", DistillConfig)


def learning_rate(step: int, config: DistillConfig) -> float:
    """Linear warm-up, then cosine decay to zero (``step`` counts from 0)."""
    warmup = max(1, round(config.steps * config.warmup_ratio)) if config.warmup_ratio else 0
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.steps - warmup)
    return config.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def kd_loss(student_logits: Any, teacher_logits: Any, temperature: float) -> Any:
    """Mean over tokens of ``T^2 KL(teacher || student)`` at temperature ``T``."""
    import torch

    t = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    per_token = (t.exp() * (t - s)).sum(-1)
    return per_token.mean() * temperature**2


NO_TEACHER = "distill: the student has no teacher on record; distill=kd follows a prune pass (prune=...)"


def teacher_of(source: Artifact) -> Path:
    """The unpruned checkpoint the student came from, checked against the recorded digest."""
    teacher = (source.metadata.get("prune") or {}).get("teacher")
    if not teacher:
        raise PassError(NO_TEACHER)
    path = Path(teacher["path"])
    if not (path / "config.json").is_file():
        raise PassError(f"distill: the teacher checkpoint {path} is gone; rerun the prune pass")
    if folder_digest(path) != teacher["digest"]:
        raise PassError(f"distill: the teacher checkpoint {path} changed since pruning; rerun the prune pass")
    return path


class DistillPass(Pass):
    """Torch -> torch: the distilled student."""

    Config = DistillConfig
    name = "distill"
    drift = "pruned"  # a retrained student
    version = 1
    consumes = Kind.TORCH
    produces = Kind.TORCH
    placement_knobs = ("device", "torch_dtype")
    execution_knobs = ("launcher", "num_processes", "strategy", "collective_timeout_s")
    loads_module_by_module = True  # StreamedCheckpoint.load_model (teacher and student)

    def preflight(self) -> None:
        self._check_bfloat16()
        if self.config.launcher == "accelerate":
            check_processes("distill.num_processes", self.config.num_processes, self.placement.device_type)

    def workload(self) -> Workload | None:
        """One micro-batch of training windows, with gradients and AdamW's moments besides."""
        return Workload(
            windows=int(self.config.micro_batch_size),
            seq_len=int(self.config.seq_len),
            knob=f"{self.config_group or self.name}.micro_batch_size",
            training=True,
        )

    def estimate_memory(self, shapes: ModelShapes) -> int | None:
        """On the CPU every rank of an accelerate launch shares this host: DDP holds one replica of
        everything per rank; FSDP one teacher per rank but the student's training state (fp32
        weights, gradients, AdamW's two moments) once, split across the ranks. Inline, or one rank
        per GPU: the generic estimate (None)."""
        config = self.config
        if (
            config.launcher != "accelerate"
            or config.num_processes == 1
            or self.placement.device_type == "cuda"
        ):
            return None
        from pipeline.core.memory import generic_estimate

        one = generic_estimate(self, shapes).host_bytes
        if config.strategy == "ddp":
            return config.num_processes * one
        training_state = shapes.parameters * 16
        return config.num_processes * (one - training_state) + training_state

    def check_model(self, facts: PlannedModel) -> PlannedModel:
        config = self.config
        blocks = int(facts.config["num_hidden_layers"])
        if config.strategy == "fsdp" and config.num_processes > 1 and blocks < config.num_processes:
            # Per process FSDP holds its shard (1/N of the model) plus the block it gathers: with
            # fewer blocks than processes that block outweighs the shard, and sharding saves nothing.
            raise PassError(
                f"distill.strategy=fsdp: the student has {blocks} decoder block(s), too few to shard "
                f"over distill.num_processes={config.num_processes} (FSDP gathers one block at a "
                "time); use distill.strategy=ddp or fewer processes"
            )
        if facts.teacher is None:
            raise PassError(NO_TEACHER)
        context = facts.config.get("max_position_embeddings")
        if isinstance(context, int) and not isinstance(context, bool) and config.seq_len > context:
            raise PassError(
                f"distill.seq_len={config.seq_len} exceeds the model's context of {context} tokens "
                f"(max_position_embeddings): set distill.seq_len={context} or less"
            )
        if config.hidden_weight and facts.config["hidden_size"] != facts.teacher["hidden_size"]:
            raise PassError(
                "distill.hidden_weight needs the student's hidden size to equal the teacher's "
                "(prune.hidden_ratio=0); set distill.hidden_weight=0"
            )
        return facts

    def requires(self, source: Artifact) -> None:
        teacher = teacher_of(source)
        mine, theirs = source.path / "tokenizer.json", teacher / "tokenizer.json"
        if not mine.is_file() or not theirs.is_file() or sha256_file(mine) != sha256_file(theirs):
            raise PassError(
                "distill: the student's tokenizer differs from the teacher's; both must share one"
            )

    def nonfinite_hint(self) -> str:
        config = self.config
        return (
            f"the student diverged: lower distill.lr (now {config.lr:g}) or raise distill.warmup_ratio "
            f"(now {config.warmup_ratio:g})"
        )

    def _check_bfloat16(self) -> None:
        if self.config.precision != "bf16" or self.placement.device_type != "cuda":
            return
        import torch

        if not torch.cuda.is_bf16_supported():
            raise PassError(
                f"distill.precision=bf16: {self.placement.device} has no bfloat16 (and float16 "
                "training would need loss scaling); use distill.precision=fp32"
            )

    def _data(self, tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
        """(training windows, held-out windows) of the calibration text: every whole window of
        ``seq_len`` tokens, ``HOLDOUT`` of them (seeded) set aside."""
        config = self.config
        ids = np.asarray(tokenizer(calibration_text(config.dataset), add_special_tokens=False)["input_ids"])
        total = len(ids) // config.seq_len
        if total < HOLDOUT + config.batch_size:
            raise PassError(
                f"distill.seq_len={config.seq_len}: the calibration text holds {total} windows, fewer than "
                f"{HOLDOUT} held out + one batch of {config.batch_size}; lower seq_len or batch_size"
            )
        every = ids[: total * config.seq_len].reshape(total, config.seq_len).astype(np.int64)
        order = np.random.default_rng(config.seed).permutation(total)
        return every[np.sort(order[HOLDOUT:])], every[np.sort(order[:HOLDOUT])]

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        if self.config.launcher == "accelerate":
            return launch(
                self,
                source,
                out_dir,
                num_processes=self.config.num_processes,
                timeout_s=self.config.collective_timeout_s,
                knob=self.config_group or self.name,
                processes_knob=f"{self.config_group or self.name}.num_processes",
                timeout_knob=f"{self.config_group or self.name}.collective_timeout_s",
            )
        return self.run_rank(source, out_dir, Group())

    def run_rank(self, source: Artifact, out_dir: Path, group: Group) -> dict[str, Any]:
        """The pass in one rank of ``group`` (the whole pass for the one-process group): rank 0
        writes the checkpoints and ``out_dir`` and returns the metrics, the others return {}."""
        import torch
        from tqdm import tqdm

        from calibration.streaming import StreamedCheckpoint
        from pipeline.core.placement import ResolvedPlacement
        from pipeline.core.torch_model import copy_beside_weights, load_tokenizer

        config = self.config
        placement = self.placement
        teacher_path = teacher_of(source)
        # Module by module (the checkpoints' pages are not kept mapped beside the weights).
        teacher = StreamedCheckpoint(teacher_path, placement).load_model()
        # Master weights in float32 on the placement's device, whatever its dtype.
        master = ResolvedPlacement(placement.device, "float32")
        student = StreamedCheckpoint(source.path, master).load_model()
        for parameter in teacher.parameters():
            parameter.requires_grad_(False)
        train, holdout = self._data(load_tokenizer(source.path))
        before = holdout_quality(teacher, student, holdout)
        layer_map = (source.metadata.get("prune") or {}).get("layers_kept") or list(
            range(len(student.get_submodule(family_of(student.config).layers)))
        )

        model = data_parallel(student, group, config.strategy)
        torch.manual_seed(config.seed)
        optimizer, schedule = self.optimizer(model)
        state = {"step": 0, "curve": [], "epoch_orders": []}
        resumed_from = self._resume(model, optimizer, schedule, state, len(train), group)
        group.agree(resumed_from, "the step to resume from")
        rng = np.random.default_rng(config.seed)
        for _ in range(len(state["epoch_orders"])):
            rng.permutation(len(train))  # the same data order as the uninterrupted run
        queue: list[int] = [i for order in state["epoch_orders"] for i in order][
            state["step"] * config.batch_size :
        ]

        # An fp32 teacher measures quality before and after; a bfloat16 copy teaches. A teacher
        # loaded in a half dtype (pipeline.torch_dtype) does both.
        half = config.precision == "bf16" and teacher.dtype == torch.float32
        trainer = copy.deepcopy(teacher).to(torch.bfloat16) if half else teacher
        model.train()
        share = config.batch_size // group.world  # this rank's sequences of every step
        accumulate = share // config.micro_batch_size
        bar = tqdm(
            total=config.steps, initial=state["step"], desc="distill", unit="step", disable=not group.main
        )
        try:
            while state["step"] < config.steps:
                while len(queue) < config.batch_size:
                    order = rng.permutation(len(train)).tolist()
                    state["epoch_orders"].append(order)
                    queue.extend(order)
                batch, queue = queue[: config.batch_size], queue[config.batch_size :]
                mine = batch[group.rank * share : (group.rank + 1) * share]
                optimizer.zero_grad(set_to_none=True)
                total = 0.0
                for start in range(0, share, config.micro_batch_size):
                    ids = torch.from_numpy(
                        np.ascontiguousarray(train[mine[start : start + config.micro_batch_size]])
                    ).to(placement.torch_device)
                    # Gradients are averaged across ranks once a step, at its last micro-batch.
                    with sync_gradients(model, sync=start + config.micro_batch_size >= share):
                        loss = self._loss(trainer, model, ids, layer_map) / accumulate
                        loss.backward()
                    total += float(loss.detach())
                total = group.mean(total)
                if not math.isfinite(total):  # every rank sees the same mean: all stop here
                    raise PassError(
                        f"distill: the KD loss became non-finite ({total}) in step {state['step'] + 1}: "
                        f"{self.nonfinite_hint()}"
                    )
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                state["step"] += 1
                if state["step"] % CURVE_EVERY == 0 or state["step"] in (1, config.steps):
                    state["curve"].append([state["step"], round(total, 5)])
                bar.set_postfix(loss=f"{total:.4f}", lr=f"{schedule.get_last_lr()[0]:.2e}")
                bar.update()
                if state["step"] % config.checkpoint_every == 0 and state["step"] < config.steps:
                    weights, optimizer_state = full_state(model, group, optimizer)
                    if group.main:
                        self._save(weights, optimizer_state, schedule, state)
        finally:
            bar.close()
        del trainer
        weights, _ = full_state(model, group)
        if not group.main:
            return {}
        if sharded(model):  # fully_shard turned the student's weights into shards: rebuild it whole
            student = StreamedCheckpoint(source.path, master).load_model()
            student.load_state_dict(weights, strict=True)
        student = unwrapped(student)
        student.eval()
        after = self._quality_after(teacher, student, holdout)

        copy_beside_weights(source.path, out_dir)
        student.save_pretrained(out_dir, safe_serialization=True)
        # What the student depends on: the execution knobs (launcher, processes) are left out.
        info = {"algorithm": "logit-kd", **_trained(asdict(config)), "teacher": str(teacher_path)}
        info.pop("_target_")
        write_metadata(out_dir, Kind.TORCH, {**source.metadata, "distill": info})
        log.info(
            "distill: held-out perplexity %.2f -> %.2f (teacher %.2f), KL %.4f -> %.4f",
            before["perplexity"], after["perplexity"], before["teacher_perplexity"],
            before["kl_vs_teacher"], after["kl_vs_teacher"],
        )  # fmt: skip
        return {
            "holdout_before": before,
            "holdout_after": after,
            "loss_curve": state["curve"],
            "resumed_from_step": resumed_from,
            "tokens_trained": config.steps * config.batch_size * config.seq_len,
            "compute": {
                "device": str(placement.torch_device),
                "teacher_dtype": str(teacher.dtype).removeprefix("torch."),
                "student_dtype": str(student.dtype).removeprefix("torch."),
                "autocast": "bfloat16" if config.precision == "bf16" else None,
                "launcher": config.launcher,
                "processes": group.world,
                "strategy": config.strategy if group.world > 1 else None,
            },
        }

    def optimizer(self, model: Any) -> tuple[Any, Any]:
        """(AdamW on ``model``'s parameters, its warm-up then cosine schedule), as a checkpoint
        of this config holds them."""
        import torch

        config = self.config
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: learning_rate(s, config) / config.lr
        )
        return optimizer, schedule

    def _quality_after(self, teacher: Any, student: Any, holdout: np.ndarray) -> dict[str, float]:
        """The held-out quality of the trained student; a one-line error if its logits overflow
        (a perplexity or KL that is not finite), so that no diverged student is written."""
        try:
            after = holdout_quality(teacher, student, holdout)
        except OverflowError:  # math.exp of a huge mean NLL
            after = {"perplexity": math.inf}
        bad = [name for name, value in after.items() if not math.isfinite(value)]
        if bad:
            raise PassError(
                f"distill: the trained student's held-out {bad[0]} is not finite (its logits "
                f"overflow): {self.nonfinite_hint()}"
            )
        return after

    def _loss(self, teacher: Any, student: Any, ids: Any, layer_map: list[int]) -> Any:
        import torch

        hidden = self.config.hidden_weight > 0
        with torch.no_grad():
            t_out = teacher(input_ids=ids, use_cache=False, output_hidden_states=hidden)
        with torch.autocast(
            self.placement.device_type, dtype=torch.bfloat16, enabled=self.config.precision == "bf16"
        ):
            s_out = student(input_ids=ids, use_cache=False, output_hidden_states=hidden)
        loss = kd_loss(s_out.logits, t_out.logits, self.config.temperature)
        if hidden:  # hidden_states[i + 1] is layer i's output
            pairs = [
                (s_out.hidden_states[i + 1], t_out.hidden_states[t + 1]) for i, t in enumerate(layer_map)
            ]
            mse = sum(torch.nn.functional.mse_loss(s.float(), t.float()) for s, t in pairs) / len(pairs)
            loss = loss + self.config.hidden_weight * mse
        return loss

    def _save(
        self, weights: dict[str, Any], optimizer_state: dict[str, Any], schedule: Any, state: dict[str, Any]
    ) -> None:
        """Write the checkpoint of ``state["step"]`` (staged, then renamed) and drop older ones:
        the student's whole ``weights`` and ``optimizer_state`` in the single-process layout."""
        if self.checkpoint_dir is None:
            return
        import torch
        from safetensors.torch import save_file

        tensors, aliases = _unique_tensors(weights)
        optimizer_tensors, optimizer_meta = _split_optimizer(optimizer_state)
        optimizer_tensors[RNG_TENSOR] = torch.get_rng_state()
        meta = {
            "format": CHECKPOINT_FORMAT,
            "config": asdict(self.config),
            "state": state,
            "aliases": aliases,
            "optimizer": optimizer_meta,
            "schedule": schedule.state_dict(),
        }
        root = self.checkpoint_dir
        name = f"{CHECKPOINT_PREFIX}{state['step']:06d}"
        with owned_folder(root / unique_name("." + name)) as staging:
            save_file(tensors, str(staging / STUDENT_FILE))
            save_file(optimizer_tensors, str(staging / OPTIMIZER_FILE))
            (staging / STATE_FILE).write_text(json.dumps(meta))
            for file in (STUDENT_FILE, OPTIMIZER_FILE, STATE_FILE):
                _fsync(staging / file)
            final = root / name
            if final.exists() or final.is_symlink():  # this step again, after a bad later one was dropped
                _discard(final)
            try:
                os.rename(staging, final)
            except OSError:
                if not final.is_dir():
                    raise
                # Another job on this key wrote the same step meanwhile: keep its (equal) one.
        _fsync(root)
        for old in _checkpoints(root)[KEEP_CHECKPOINTS:]:
            _discard(old)
        log.info("distill: checkpoint at step %d", state["step"])

    def _resume(
        self,
        model: Any,
        optimizer: Any,
        schedule: Any,
        state: dict[str, Any],
        train_size: int,
        group: Group,
    ) -> int:
        """Load the newest readable checkpoint of this pass (same input and trained config), if
        any, into ``model`` (possibly wrapped for data parallelism; every rank reads the same
        checkpoint); its step. Unreadable ones are discarded with a warning. ``train_size``:
        training windows."""
        import torch

        root = self.checkpoint_dir
        if root is None or not root.is_dir():
            return 0
        if group.main:
            remove_abandoned(root, "." + CHECKPOINT_PREFIX)  # staging a killed run left behind
        legacy = root / LEGACY_CHECKPOINT
        if group.main and legacy.exists():
            log.warning("distill: removing %s (a pickle of an earlier version; never loaded)", legacy)
            legacy.unlink()
        for path in _checkpoints(root):
            try:
                if path.is_symlink() or not path.is_dir():
                    raise ValueError("it is not a folder (a symlink or a file in its place)")
                loaded = self._read_checkpoint(path, unwrapped(model), optimizer, schedule, train_size)
            except Exception as exc:  # a damaged checkpoint raises anything; nothing was applied yet
                reason = " ".join(str(exc).split())[:300] or type(exc).__name__
                log.warning(
                    "distill: discarding checkpoint %s (%s); trying an earlier one", path.name, reason
                )
                _discard(path)
                continue
            weights, optimizer_state, schedule_state, rng, saved = loaded
            try:
                load_weights(model, weights)
                load_optimizer_state(model, optimizer, optimizer_state)
                schedule.load_state_dict(schedule_state)
                torch.set_rng_state(rng)
            except Exception as exc:  # checked above: not expected, but never block every rerun on it
                _discard(path)
                reason = " ".join(str(exc).split())[:300] or type(exc).__name__
                raise PassError(
                    f"distill: checkpoint {path} could not be applied ({reason}) and was discarded: "
                    "rerun to resume from an earlier one"
                ) from None
            state.update(saved)
            log.info("distill: resuming at step %d of %d", state["step"], self.config.steps)
            return int(state["step"])
        return 0

    def _read_checkpoint(
        self, path: Path, student: Any, optimizer: Any, schedule: Any, train_size: int
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], Any, dict[str, Any]]:
        """Read and check a checkpoint without applying it: (student weights, optimizer state
        dict, schedule state dict, RNG state, training state). Every field of ``state.json`` is
        typed and range-checked against this run (``check_state``), every tensor against the
        student and the optimizer, and every file must be a regular one (no symlink, FIFO or
        device). Raises (``ValueError``, ``UnsafeFileError``, a reader's error) on anything amiss."""
        import torch
        from safetensors.torch import load_file

        text = read_regular_text(
            path / STATE_FILE, follow_symlinks=False, what="a distill checkpoint's state"
        )
        meta = loads_bounded(text, parse_constant=_no_constant)
        check_state(
            meta, self.config, train_size, optimizer.state_dict()["param_groups"], schedule.state_dict()
        )
        saved = meta["state"]
        step = saved["step"]

        expected = student.state_dict()
        weight_bytes = sum(t.numel() * t.element_size() for t in expected.values())
        stored = load_file(str(_tensor_file(path / STUDENT_FILE, weight_bytes)))
        aliases = meta["aliases"]
        if set(aliases) & set(stored) or not set(aliases.values()) <= set(stored):
            raise ValueError("its tensor aliases name no stored tensor, or a stored one")
        weights = dict(stored)
        for name, original in aliases.items():
            weights[name] = stored[original]
        if set(weights) != set(expected):
            differ = sorted(set(weights) ^ set(expected))
            raise ValueError(f"the student's tensor names differ ({', '.join(differ[:3])}, ...)")
        for name, tensor in expected.items():
            if weights[name].shape != tensor.shape or weights[name].dtype != tensor.dtype:
                raise ValueError(
                    f"{name} is {weights[name].dtype} {tuple(weights[name].shape)}, the student's "
                    f"{tensor.dtype} {tuple(tensor.shape)}"
                )
        for name, tensor in stored.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"the student's {name} holds NaN or infinite values")

        optimizer_tensors = load_file(str(_tensor_file(path / OPTIMIZER_FILE, 3 * weight_bytes)))
        if RNG_TENSOR not in optimizer_tensors:
            raise ValueError("it holds no RNG state")
        rng = optimizer_tensors.pop(RNG_TENSOR)
        current = torch.get_rng_state()
        if rng.dtype != current.dtype or rng.shape != current.shape:
            raise ValueError("the RNG state has another shape")
        torch.Generator().set_state(rng)  # raises for a state the generator refuses
        optimizer_state = _join_optimizer(optimizer_tensors, meta["optimizer"], optimizer, step)
        return weights, optimizer_state, meta["schedule"], rng, saved


def _no_constant(name: str) -> Any:
    raise ValueError(f"{STATE_FILE} holds {name}, which is not JSON")


def _tensor_file(path: Path, payload_bytes: int) -> Path:
    """``path``, refused unless it is a regular file (not a symlink, FIFO or device: nothing is
    opened) no larger than ``payload_bytes`` of tensors and a header could make it."""
    size = regular_size(path, follow_symlinks=False, what="a distill checkpoint's tensors")
    if size > payload_bytes + (64 << 20):
        raise ValueError(f"{path.name} is {size} bytes, more than its tensors can take")
    return path


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _same(saved: Any, mine: Any) -> bool:
    """Whether a value read back from JSON is ``mine`` (tuples as lists), type for type."""
    if isinstance(mine, list | tuple):
        return (
            isinstance(saved, list)
            and len(saved) == len(mine)
            and all(_same(a, b) for a, b in zip(saved, mine, strict=True))
        )
    if isinstance(mine, dict):
        return (
            isinstance(saved, dict)
            and saved.keys() == mine.keys()
            and all(_same(saved[k], v) for k, v in mine.items())
        )
    return type(saved) is type(mine) and saved == mine


def _fields(record: Any, what: str, fields: set[str]) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise ValueError(f"{what} is a JSON {type(record).__name__}, not an object")
    if set(record) != fields:
        differ = sorted(set(record) ^ fields)
        raise ValueError(f"{what} has other fields than a checkpoint's ({', '.join(differ[:3])})")
    return record


CHECKPOINT_FIELDS = {"format", "config", "state", "aliases", "optimizer", "schedule"}
STATE_FIELDS = {"step", "curve", "epoch_orders"}


def check_state(
    meta: Any,
    config: DistillConfig,
    train_size: int,
    param_groups: list[dict[str, Any]],
    schedule_state: dict[str, Any],
) -> None:
    """Raise ``ValueError`` naming the first field of a checkpoint's ``state.json`` (``meta``) that
    is of the wrong type or out of range for a run of ``config`` on ``train_size`` training
    windows, whose optimizer has ``param_groups`` and whose schedule's (fresh) state is
    ``schedule_state``: every field is checked, so nothing read back fails the training later."""
    meta = _fields(meta, STATE_FILE, CHECKPOINT_FIELDS)
    if not (_is_int(meta["format"]) and meta["format"] == CHECKPOINT_FORMAT):
        raise ValueError(f"{STATE_FILE} is not a format-{CHECKPOINT_FORMAT} checkpoint record")
    if _trained(meta["config"]) != _trained(json.loads(json.dumps(asdict(config)))):
        raise ValueError("it was written with another distill config")
    saved = _fields(meta["state"], "its state", STATE_FIELDS)
    step = saved["step"]
    if not (_is_int(step) and 0 < step < config.steps):
        raise ValueError(f"step {step!r} is out of range")
    curve = saved["curve"]
    if not isinstance(curve, list) or not all(
        isinstance(point, list)
        and len(point) == 2
        and _is_int(point[0])
        and 1 <= point[0] <= step
        and _is_number(point[1])
        and point[1] >= 0
        for point in curve
    ):
        raise ValueError("the loss curve is not a list of [step, finite loss] pairs up to its step")
    points = [s for s in range(1, step + 1) if s % CURVE_EVERY == 0 or s == 1]
    if [point[0] for point in curve] != points:
        raise ValueError(
            f"the loss curve does not hold the points of steps {points[:3]}... up to step {step}"
        )
    orders = saved["epoch_orders"]
    epochs = -(-step * config.batch_size // train_size)  # the orders that many steps draw on
    if not isinstance(orders, list) or len(orders) != epochs:
        raise ValueError(f"the data order does not hold the {epochs} epoch(s) of {step} steps")
    rng = np.random.default_rng(config.seed)
    for order in orders:  # the seed's orders, exactly: the resumed run replays the same data
        if not (isinstance(order, list) and all(_is_int(i) for i in order)):
            raise ValueError("the data order is not a list of window numbers")
        if order != rng.permutation(train_size).tolist():
            raise ValueError(
                f"the data order is not distill.seed's order of the {train_size} training windows"
            )
    aliases = meta["aliases"]
    if not isinstance(aliases, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()
    ):
        raise ValueError("its tensor aliases are not names")
    rate = learning_rate(step, config)
    optimizer = _fields(meta["optimizer"], "its optimizer state", {"param_groups", "scalars"})
    groups = optimizer["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(param_groups):
        raise ValueError("the optimizer has another number of parameter groups")
    for group, mine in zip(groups, param_groups, strict=True):
        group = _fields(group, "an optimizer parameter group", set(mine))
        for name, value in mine.items():
            if name == "lr":
                if not (
                    _is_number(group[name]) and math.isclose(group[name], rate, rel_tol=1e-6, abs_tol=1e-12)
                ):
                    raise ValueError(
                        f"the optimizer's lr {group[name]!r} is not the schedule's {rate:g} at step {step}"
                    )
            elif not _same(group[name], value):
                raise ValueError(f"the optimizer's {name} {group[name]!r} is not this run's {value!r}")
    scalars = optimizer["scalars"]
    if not isinstance(scalars, dict) or not all(
        isinstance(values, dict) and all(isinstance(k, str) and _is_number(v) for k, v in values.items())
        for values in scalars.values()
    ):
        raise ValueError("the optimizer's scalars are not finite numbers")
    schedule = _fields(meta["schedule"], "its schedule state", set(schedule_state))
    for name, value in schedule_state.items():
        given = schedule[name]
        if name == "last_epoch":
            ok = _is_int(given) and given == step
        elif name == "_step_count":
            ok = _is_int(given) and given == step + 1
        elif name == "_last_lr":
            ok = (
                isinstance(given, list)
                and len(given) == len(value)
                and all(
                    _is_number(lr) and math.isclose(lr, rate, rel_tol=1e-6, abs_tol=1e-12) for lr in given
                )
            )
        elif isinstance(value, bool):  # internal flags of the scheduler: their type only
            ok = isinstance(given, bool)
        else:  # base_lrs, lr_lambdas: this run's
            ok = _same(given, value)
        if not ok:
            raise ValueError(f"the schedule's {name} {given!r} does not fit step {step} of this run")


def _trained(config: Any) -> Any:
    """A recorded distill config without its execution knobs (a checkpoint resumes under any)."""
    return without_knobs(config, DistillPass.execution_knobs) if isinstance(config, dict) else config


def _checkpoints(root: Path) -> list[Path]:
    """The checkpoints under ``root`` (whatever lies at a ``step-NNNNNN`` name), newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_NAME.fullmatch(p.name))]
    return [path for _, path in sorted(found, reverse=True)]


def _discard(path: Path) -> None:
    """Remove a checkpoint: a folder with what it holds, or a symlink or file in its place (never
    what a symlink points to)."""
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(OSError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _fsync(path: Path) -> None:
    """Flush a file (or a folder's entries) to storage, so a rename never outlives its data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on folders
        pass
    finally:
        os.close(fd)


def _unique_tensors(weights: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(tensors to store, {name: stored name} of tensors that are the same tensor as a stored one,
    such as tied embeddings): safetensors stores each storage once."""
    tensors: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], str], str] = {}
    for name, tensor in weights.items():
        identity = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            str(tensor.dtype),
        )
        if identity in seen:
            aliases[name] = seen[identity]
        else:
            seen[identity] = name
            tensors[name] = tensor.detach().cpu().contiguous()
    return tensors, aliases


def _split_optimizer(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An optimizer state dict as (tensors ``state.<param>.<name>``, JSON-able rest)."""
    import torch

    tensors: dict[str, Any] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, values in state_dict["state"].items():
        for name, value in values.items():
            if torch.is_tensor(value):
                tensors[f"state.{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def _join_optimizer(
    tensors: dict[str, Any], meta: dict[str, Any], optimizer: Any, step: int
) -> dict[str, Any]:
    """The optimizer state dict from a checkpoint's parts (``meta`` checked by ``check_state``),
    its tensors checked against ``optimizer``'s parameters: names, shapes, dtypes, finite values,
    second moments not negative, step counts within the checkpoint's ``step``."""
    import torch

    groups = copy.deepcopy(meta["param_groups"])
    for saved in groups:
        if isinstance(saved.get("betas"), list):
            saved["betas"] = tuple(saved["betas"])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    moments = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        kind, index_text, name = [*key.split(".", 2), "", ""][:3]
        if kind != "state" or not index_text.isdigit() or not 0 <= int(index_text) < len(params):
            raise ValueError(f"unexpected optimizer tensor {key}")
        index = int(index_text)
        if name in moments:
            if tensor.shape != params[index].shape or tensor.dtype != params[index].dtype:
                raise ValueError(f"optimizer tensor {key} is {tensor.dtype} {tuple(tensor.shape)}")
        elif name != "step" or tensor.numel() != 1 or not tensor.is_floating_point():
            raise ValueError(f"unexpected optimizer tensor {key}")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"optimizer tensor {key} holds NaN or infinite values")
        if name == "exp_avg_sq" and bool((tensor < 0).any()):
            raise ValueError(f"optimizer tensor {key} holds negative second moments")
        if name == "step" and not (0 <= float(tensor) <= step and float(tensor) == int(float(tensor))):
            raise ValueError(f"optimizer tensor {key} counts {float(tensor)} steps, not at most {step}")
        state.setdefault(index, {})[name] = tensor
    for index_text, values in meta["scalars"].items():
        index = int(index_text) if index_text.isdigit() else -1
        if not values or set(values) & set(state.get(index, {})):
            raise ValueError(f"unexpected optimizer scalars of parameter {index_text!r}")
        state.setdefault(index, {}).update(values)
    amsgrad = any(group.get("amsgrad") for group in groups)
    needed = {"exp_avg", "exp_avg_sq", "step"} | ({"max_exp_avg_sq"} if amsgrad else set())
    for index, values in state.items():
        if not 0 <= index < len(params) or set(values) != needed:
            raise ValueError(f"the optimizer state of parameter {index} is incomplete")
    return {"state": state, "param_groups": groups}
