"""What a calibrating pass tells the kernel about its windows, so that the kernel reads none of its
knobs: :class:`CalibratesOnWindows` gives :meth:`~pipeline.core.base.Pass.workload` (the memory
preflight) and :meth:`~pipeline.core.base.Pass.ranks` (the manager's check of the processes) from
the pass's ``calibration`` (:class:`~calibration.datasets.CalibrationConfig`), and keeps its
processes and timeout out of the cache key. :class:`CalibratesInRanks` adds the run that splits
the windows over those processes (:func:`pipeline.core.distributed.launch`).

A pass that calibrates otherwise (the sensitivity scan, a KV cache that calibrates only int8/fp8,
distillation's training windows) overrides ``workload`` itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pipeline.core.base import Ranks, Workload
from pipeline.core.distributed import Group, launch
from pipeline.core.errors import PassError

if TYPE_CHECKING:
    from calibration.datasets import CalibrationConfig


class CalibratesOnWindows:
    """Mixin of a pass (listed before ``Pass``) whose config holds ``calibration``."""

    config: Any
    config_group: str | None
    name: ClassVar[str]
    # The config group its knobs live under when the pass was built outside ``build_passes``
    # (a recipe's expansion): quant's, unless the pass says otherwise.
    knob_group: ClassVar[str] = "quant"
    # How many processes and how long a collective may wait choose how, not what, the pass
    # computes: outside its cache key (pipeline.core.base.Pass.execution_knobs).
    execution_knobs: ClassVar[tuple[str, ...]] = (
        "calibration.num_processes",
        "calibration.collective_timeout_s",
    )

    @property
    def calibration_knobs(self) -> str:
        """Where the user sets this pass's calibration ("quant.calibration")."""
        return f"{self.config_group or self.knob_group}.calibration"

    def workload(self) -> Workload | None:
        calibration: CalibrationConfig = self.config.calibration
        return Workload(
            windows=int(calibration.num_samples),
            seq_len=int(calibration.seq_len),
            knob=f"{self.calibration_knobs}.num_samples",
        )

    def ranks(self) -> Ranks | None:
        calibration: CalibrationConfig = self.config.calibration
        return Ranks(
            processes=int(calibration.num_processes),
            knob=f"{self.calibration_knobs}.num_processes",
            windows=int(calibration.num_samples),
            windows_knob=f"{self.calibration_knobs}.num_samples",
        )


class CalibratesInRanks(CalibratesOnWindows):
    """Mixin of a pass (listed before ``Pass``) whose ``run_rank(source, out_dir, group)`` splits
    its calibration windows over ``calibration.num_processes`` ranks and reduces the statistics:
    ``run`` launches the ranks, or runs inline for one process."""

    calibrates_in_ranks = True

    def run(self, source: Any, out_dir: Path) -> dict[str, Any]:
        launched = launch_calibration(self, source, out_dir)
        return launched if launched is not None else self.run_rank(source, out_dir, Group())  # type: ignore[attr-defined]


def launch_calibration(step: Any, source: Any, out_dir: Path) -> dict[str, Any] | None:
    """For a pass configured with ``calibration`` (``num_processes``, ``collective_timeout_s``): its
    :func:`~pipeline.core.distributed.launch` over that many ranks, or None for one process (the
    caller runs inline)."""
    calibration = step.config.calibration
    if calibration.num_processes == 1:
        return None
    if not step.calibrates_in_ranks:  # the manager refuses it first; a direct call too
        raise PassError(f"{step.name} calibrates in one process; set calibration.num_processes=1")
    return launch(
        step,
        source,
        out_dir,
        num_processes=calibration.num_processes,
        timeout_s=calibration.collective_timeout_s,
        knob=step.calibration_knobs,
        processes_knob=f"{step.calibration_knobs}.num_processes",
        timeout_knob=f"{step.calibration_knobs}.collective_timeout_s",
    )
