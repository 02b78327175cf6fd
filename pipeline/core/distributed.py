"""One pass's work in N processes on one machine: started with ``accelerate launch`` (torch's
elastic agent, ``torchrun``, underneath for N > 1), joined in one process group (gloo on the CPU,
NCCL on CUDA) with a timeout on every collective, so a dead or stuck rank fails the pass with one
line instead of hanging it.

- :func:`launch` runs in the pass manager's process: it writes the job's spec, runs
  ``accelerate launch -m pipeline.core.distributed SPEC``, streams the ranks' output (rank 0's progress
  bar) through, and returns rank 0's metrics, or raises one line naming the rank that failed and
  why (its error, or the signal that killed it, from the agent's report). Ctrl-C or any error
  stops the agent, which stops its ranks; the spec's folder is removed on every exit.
- :func:`main` runs in each rank: it rebuilds the pass from the allow-list
  (:func:`pipeline.core.plugins.pass_class`; the spec names a pass, never arbitrary code), joins the
  group and calls the pass's ``run_rank(source, out_dir, group)``.
- :class:`Group` is what a rank's code needs: rank and world size, sums across ranks, a barrier.
  ``Group()`` is the one-process group of an inline run; its collectives do nothing.
- :func:`data_parallel`, :func:`sync_gradients`, :func:`full_state` and the loaders wrap a torch model for
  training as DDP or FSDP (torch's ``fully_shard``, one unit per decoder block, then the root), the
  calls accelerate itself makes. Accelerate provides the launch and the process group, but its own
  FSDP wrapping is refused on the CPU (``DistributedType.MULTI_CPU`` never becomes ``FSDP``), so
  the wrapping is done here with the same torch calls on every device.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import PassError, PipelineError, first_line
from pipeline.core.families import family_of
from pipeline.core.subprocesses import PROJECT_ROOT, child_environment

LAUNCHERS = ("inline", "accelerate")
STRATEGIES = ("ddp", "fsdp")
SPEC_FILE = "spec.json"
RESULT_FILE = "result.json"
ERROR_PREFIX = "error-rank"
PEAK_PREFIX = "peak-rank"  # each rank's peak RSS (the pass manager's meter sees its own process only)
TAIL_CHARS = 64 * 1024  # what is kept of the ranks' output to explain a failure
STOP_GRACE_S = 30  # after Ctrl-C: how long the agent gets to stop its ranks before it is killed
# After a rank reported an error: how long the others get to end before the launch is killed (a
# rank stuck in a collective or stopped outright would hold torchrun's agent for 30 s more).
FAILED_GRACE_S = 5
POLL_S = 0.5


def max_processes(device_type: str) -> int:
    """How many ranks this machine can run: one per usable CPU core, or one per CUDA device."""
    if device_type == "cuda":
        import torch

        return torch.cuda.device_count()
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_processes(knob: str, num_processes: int, device_type: str) -> None:
    """One line if ``num_processes`` ranks cannot run here (fewer than 1, or more than the machine's
    cores or GPUs)."""
    most = max_processes(device_type)
    unit = "CUDA devices" if device_type == "cuda" else "CPU cores"
    if num_processes < 1 or num_processes > most:
        raise PassError(
            f"{knob}={num_processes} is out of range: this machine has {most} {unit} "
            f"(one process each); set {knob} between 1 and {most}"
        )


@dataclass
class Group:
    """The processes that share one pass's work. The default is the single process of an inline
    run: its collectives return their input."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, tensor: Any) -> Any:
        """``tensor`` summed over the ranks, in place (every rank gets the sum)."""
        return self._reduce(tensor, "SUM")

    def max(self, tensor: Any) -> Any:
        """``tensor`` element-wise maximum over the ranks, in place."""
        return self._reduce(tensor, "MAX")

    def _reduce(self, tensor: Any, op: str) -> Any:
        if self.world > 1:
            import torch.distributed as dist

            moved = tensor.to(self.device)  # NCCL reduces CUDA tensors only
            dist.all_reduce(moved, op=getattr(dist.ReduceOp, op))
            if moved is not tensor:
                tensor.copy_(moved)
        return tensor

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of integers, by rank (each rank may hold a different number)."""
        if self.world == 1:
            return [list(values)]
        import torch

        longest = int(self.max(torch.tensor([len(values)], dtype=torch.int64))[0])
        table = torch.zeros(self.world, longest + 1, dtype=torch.int64)
        table[self.rank, 0] = len(values)
        table[self.rank, 1 : 1 + len(values)] = torch.tensor(values, dtype=torch.int64)
        self.sum(table)
        return [table[rank, 1 : 1 + int(table[rank, 0])].tolist() for rank in range(self.world)]

    def mean(self, value: float) -> float:
        """The mean of a float over the ranks (float64)."""
        if self.world == 1:
            return value
        import torch

        return float(self.sum(torch.tensor([value], dtype=torch.float64))[0]) / self.world

    def agree(self, value: int, what: str) -> None:
        """Raise unless every rank holds the same integer ``value`` (``what`` names it)."""
        if self.world == 1:
            return
        import torch

        both = self.sum(torch.tensor([value, -value], dtype=torch.int64))
        low, high = -int(both[1]) // self.world, int(both[0]) // self.world
        if not low == high == value:
            raise PassError(f"the {self.world} processes disagree on {what} (rank {self.rank}: {value})")

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def join(device: str, timeout_s: float) -> Group:
    """Join this rank's process group through accelerate (gloo on the CPU, NCCL on CUDA): every
    collective waits at most ``timeout_s`` seconds for the other ranks. A launch of one process
    (no ``WORLD_SIZE`` above 1) has no group to join: it computes on ``device`` alone."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return Group(device=device)
    device_type = device.split(":")[0]
    backend = "nccl" if device_type == "cuda" else "gloo"
    handler = InitProcessGroupKwargs(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    accelerator = Accelerator(cpu=device_type != "cuda", kwargs_handlers=[handler])
    device = f"cuda:{accelerator.local_process_index}" if device_type == "cuda" else "cpu"
    local = accelerator.local_process_index
    return Group(accelerator.process_index, accelerator.num_processes, local, device)


def leave(group: Group) -> None:
    if group.world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Data-parallel training: DDP or FSDP (fully_shard per decoder block)


def data_parallel(model: Any, group: Group, strategy: str) -> Any:
    """``model`` wrapped for data-parallel training over ``group`` (unchanged for one process):
    DDP (replicated weights, gradients averaged) or FSDP (``fully_shard`` on each decoder block,
    then on the whole model: weights, gradients and optimizer state sharded, one block gathered at a
    time). Build the optimizer on the returned model's parameters after this call."""
    if group.world == 1:
        return model
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.get_submodule(family_of(model.config).layers):
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [group.local_rank] if group.device.startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=ids)


def unwrapped(model: Any) -> Any:
    """The module DDP wraps (FSDP's ``fully_shard`` wraps in place)."""
    return getattr(model, "module", model)


@contextlib.contextmanager
def sync_gradients(model: Any, sync: bool) -> Iterator[None]:
    """Accumulate this micro-batch's gradients locally (``sync=False``) or reduce them across the
    ranks with the ones accumulated before (``sync=True``, the last micro-batch of a step)."""
    if sync or not (hasattr(model, "no_sync") or hasattr(model, "set_requires_gradient_sync")):
        yield
    elif hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    else:  # FSDP
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


def full_state(model: Any, group: Group, optimizer: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state dict, optimizer state dict or {} without ``optimizer``) whole, in the
    single-process layout (optimizer state keyed by parameter index, in ``model.parameters()``
    order), on rank 0; other ranks get empty dicts. A collective under FSDP: every rank calls it."""
    if not sharded(model):
        if not group.main:
            return {}, {}
        return unwrapped(model).state_dict(), {} if optimizer is None else optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is None:
        return get_model_state_dict(model, options=options), {}
    weights, by_name = get_state_dict(model, optimizer, options=options)
    if not group.main:
        return {}, {}
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    groups = [{**g, "params": [index[name] for name in g["params"]]} for g in by_name["param_groups"]]
    by_index = {index[name]: values for name, values in by_name["state"].items()}
    return weights, {"state": by_index, "param_groups": groups}


def load_weights(model: Any, weights: dict[str, Any]) -> None:
    """Load a whole state dict (the same on every rank) into ``model``, sharded or not."""
    if not sharded(model):
        unwrapped(model).load_state_dict(weights, strict=True)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=True))


def load_optimizer_state(model: Any, optimizer: Any, state: dict[str, Any]) -> None:
    """Load a whole optimizer state dict of the single-process layout into ``optimizer`` built on
    the parameters of the (possibly FSDP-sharded) ``model``; every rank passes the same dict."""
    if not sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = [name for name, _ in model.named_parameters()]
    groups = [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]]
    by_name = {"state": {names[int(i)]: s for i, s in state["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def sharded(model: Any) -> bool:
    """Whether ``model`` was wrapped by FSDP's ``fully_shard`` (its weights are shards)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


# --------------------------------------------------------------------------------------------
# The launch (pass manager's process) and the rank's entry point


def launch(
    step: Any,
    source: Any,
    out_dir: Path,
    *,
    num_processes: int,
    timeout_s: float,
    knob: str,
    processes_knob: str,
    timeout_knob: str,
) -> dict[str, Any]:
    """Run ``step.run_rank`` in ``num_processes`` ranks under ``accelerate launch``; rank 0's
    metrics. ``knob`` prefixes messages (the pass's config node, e.g. ``distill``);
    ``processes_knob`` and ``timeout_knob`` are the knobs that set ``num_processes`` and
    ``timeout_s``, as messages name them (the pass knows them; the kernel does not)."""
    device_type = step.placement.device_type
    check_processes(processes_knob, num_processes, device_type)
    with tempfile.TemporaryDirectory(prefix="pipeline-ranks-") as folder:
        work = Path(folder)
        spec = {
            "target": f"{type(step).__module__}.{type(step).__qualname__}",
            "config": step.config_dict(),
            "config_group": step.config_group,
            "placement": step.placement.to_dict(),
            "checkpoint_dir": None if step.checkpoint_dir is None else str(step.checkpoint_dir),
            "source": str(source.path),
            "source_kind": str(source.kind),
            "source_digest": source.digest,
            "out_dir": str(out_dir),
            "work": str(work),
            "timeout_s": timeout_s,
        }
        (work / SPEC_FILE).write_text(json.dumps(spec))
        threads = max(1, max_processes("cpu") // num_processes)
        command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(num_processes)]
        command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        command += ["--num_cpu_threads_per_process", str(threads)]
        if num_processes > 1:
            # Port 0: the agent's store binds a free port itself (a port picked here and bound later
            # could be taken meanwhile by another launch on this machine).
            command += ["--multi_gpu", "--main_process_port", "0"]
        command += ["-m", "pipeline.core.distributed", str(work / SPEC_FILE)]
        # accelerate starts the ranks itself, so they cannot run in isolated mode: the project root
        # is their only PYTHONPATH (never one inherited from a recipe's hydra.job.env_set).
        env = child_environment(
            {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(PROJECT_ROOT)}
        )
        code, tail = _run(command, env, work)
        if code != 0:
            raise _failure(work, tail, num_processes, code, knob, timeout_knob)
        result = work / RESULT_FILE
        if not result.is_file():
            raise PassError(f"{knob}: the {num_processes}-process launch ended without rank 0's result")
        metrics = json.loads(result.read_text())
        peaks = [_read_int(work / f"{PEAK_PREFIX}{rank}") for rank in range(num_processes)]
        metrics["ranks"] = {"processes": num_processes, "peak_rss_bytes": peaks}
        return metrics


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _run(command: list[str], env: dict[str, str], work: Path) -> tuple[int, str]:
    """Run the launch in its own session, copying its stderr through (progress bars
    included); (exit code, the last ``TAIL_CHARS`` of stderr). Once a rank has written its error,
    the rest get ``FAILED_GRACE_S`` to end before the agent and its ranks are killed. Interrupted
    (Ctrl-C, any exception): the agent is stopped, and killed with its ranks if it lingers."""
    process = subprocess.Popen(
        command, env=env, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True
    )
    tail: deque[str] = deque()
    size = [0]

    def pump() -> None:
        assert process.stderr is not None
        for chunk in iter(lambda: os.read(process.stderr.fileno(), 4096), b""):
            sys.stderr.write(text := chunk.decode(errors="replace"))
            sys.stderr.flush()
            tail.append(text)
            size[0] += len(text)
            while size[0] > TAIL_CHARS and len(tail) > 1:
                size[0] -= len(tail.popleft())

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    failed_at: float | None = None
    try:
        while True:
            try:
                code = process.wait(POLL_S)
                break
            except subprocess.TimeoutExpired:
                if failed_at is None and any(work.glob(f"{ERROR_PREFIX}*")):
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() - failed_at > FAILED_GRACE_S:
                    _kill_group(process)
    except BaseException:
        _stop(process)
        raise
    finally:
        reader.join(timeout=5)
    return code, "".join(tail)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the agent and every process under it (torch's agent starts each rank in a session
    of its own, so a process-group kill would miss them)."""
    import psutil

    try:
        agent = psutil.Process(process.pid)
        family = [*agent.children(recursive=True), agent]  # listed before the agent dies
    except psutil.NoSuchProcess:
        return
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            member.kill()


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop the agent (it forwards SIGTERM to its ranks), then kill it if it lingers."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        process.wait()


SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")  # gloo's "[.../pair.cc:553] "
FAILED_RANK = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n[^\n]*exitcode\s*:\s*(-?\d+)")


def _failure(work: Path, tail: str, world: int, code: int, knob: str, timeout_knob: str) -> PipelineError:
    """One line for a failed launch: a rank's own user error verbatim, else the rank that was
    killed or the first rank's error, else the launch's last line."""
    errors: dict[int, dict[str, Any]] = {}
    for path in work.glob(f"{ERROR_PREFIX}*.json"):
        with contextlib.suppress(ValueError, OSError):
            errors[int(path.stem.removeprefix(ERROR_PREFIX))] = json.loads(path.read_text())
    user = [errors[rank] for rank in sorted(errors) if errors[rank].get("user")]
    if user:
        return PassError(user[0]["message"])
    # The agent's last report lists every failed rank, the first it observed under "Root Cause".
    # A rank killed without an error of its own is the cause: the first observed one, else any
    # other than those the agent itself stopped (SIGTERM). The peers it left in a collective fail
    # within the same poll, so the agent may observe one of them first.
    _, _, report = tail.rpartition("Failures:")
    _, _, root = report.rpartition("Root Cause")
    died = [(int(rank), int(exit)) for rank, exit in FAILED_RANK.findall(root)]
    died += [
        (int(rank), int(exit)) for rank, exit in FAILED_RANK.findall(report) if int(exit) != -signal.SIGTERM
    ]
    prefix = f"{knob}: the {world}-process launch failed"
    for rank, exit in died:
        if rank not in errors and exit < 0:
            name = signal.Signals(-exit).name if -exit in signal.valid_signals() else f"signal {-exit}"
            why = f"rank {rank} was killed ({name}); a rerun resumes at the last checkpoint"
            return PassError(f"{prefix}: {why}")
    if errors:
        rank = min(errors)
        message = SOURCE_LOCATION.sub("", errors[rank]["message"])
        if "timed out" in message.lower():
            message += f" (another rank stopped answering for {timeout_knob})"
        return PassError(f"{prefix}: rank {rank}: {message}")
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return PassError(f"{prefix} with exit code {code}: {lines[-1] if lines else 'no output'}")


def main(argv: list[str] | None = None) -> int:
    """A rank's entry point: ``python -m pipeline.core.distributed SPEC`` (started by :func:`launch`)."""
    from pipeline.core.artifacts import Artifact, Kind, read_metadata
    from pipeline.core.placement import ResolvedPlacement
    from pipeline.core.plugins import pass_class

    spec_file = Path((argv if argv is not None else sys.argv[1:])[0])
    spec = json.loads(spec_file.read_text())
    work = Path(spec["work"])
    rank = int(os.environ.get("RANK", "0"))
    group: Group | None = None
    try:
        cls = pass_class(str(spec["target"]), "pipeline.core.distributed")
        if not callable(getattr(cls, "run_rank", None)):
            raise PassError(f"pass {spec['target']} cannot run in several processes")
        step: Any = cls(**spec["config"])
        step.config_group = spec["config_group"]
        placement = ResolvedPlacement(**spec["placement"])
        group = join(placement.device, float(spec["timeout_s"]))
        rank = group.rank
        step.placement = ResolvedPlacement(group.device, placement.torch_dtype)
        step.checkpoint_dir = None if spec["checkpoint_dir"] is None else Path(spec["checkpoint_dir"])
        path = Path(spec["source"])
        source = Artifact(Kind(spec["source_kind"]), path, str(spec["source_digest"]), read_metadata(path))
        metrics = step.run_rank(source, Path(spec["out_dir"]), group)
        group.barrier()  # every rank done before any tears its connections down
        if group.main:
            staged = work / f".{RESULT_FILE}"
            staged.write_text(json.dumps(metrics))
            os.replace(staged, work / RESULT_FILE)
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        (work / f"{PEAK_PREFIX}{rank}").write_text(str(peak))
        return 0
    except BaseException as exc:
        error = {"message": first_line(exc), "user": isinstance(exc, PipelineError)}
        with contextlib.suppress(OSError):
            (work / f"{ERROR_PREFIX}{rank}.json").write_text(json.dumps(error))
        raise
    finally:
        if group is not None:
            leave(group)


def _exit(code: int) -> None:
    """End the rank with ``code`` once its files are written and its group left, without the
    interpreter's teardown: native libraries' static destructors (ONNX Runtime's and gloo's threads)
    ran there and, rarely, aborted a rank that had finished its work (SIGABRT, "terminate called
    without an active exception"), failing a launch whose every result was on disk."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        exit_code = main()
    except BaseException:  # its error file is written: print the traceback, as Python would
        import traceback

        traceback.print_exc()
        exit_code = 1
    _exit(exit_code)
