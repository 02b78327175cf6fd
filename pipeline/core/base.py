"""The pass contract: a structured config, a consumed and a produced artifact kind,
``requires`` (precondition), ``run`` and ``ensures`` (postcondition), and a version.

Shaped after onnx-ir's pass infrastructure (``onnx_ir/passes/_pass_infra.py``), but our passes
move whole artifacts (a torch checkpoint, an ONNX graph, an engine folder) rather than
in-memory IR, so they read and write folders and the manager can cache them by content.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.config import build_config
from pipeline.core.errors import PassError
from pipeline.core.placement import CPU_FLOAT32, Placement, ResolvedPlacement

if TYPE_CHECKING:
    from pipeline.core.planned_model import PlannedModel
    from pipeline.core.shapes import ModelShapes

__all__ = ["Pass", "PassError", "Ranks", "Recipe", "Workload"]


@dataclasses.dataclass(frozen=True)
class Workload:
    """The activations a pass runs its model over, as the kernel needs them: the memory preflight
    (:mod:`pipeline.core.memory`) sizes them, and a refusal names ``knob`` as what lowers them.
    A pass says this through :meth:`Pass.workload`, so the kernel reads none of its knobs."""

    windows: int  # sequences held at once (calibration windows, a training micro-batch)
    seq_len: int  # tokens each
    knob: str  # the knob that sets ``windows``, as the user writes it ("quant.calibration.num_samples")
    training: bool = False  # gradients, optimizer moments and saved activations besides (distillation)


@dataclasses.dataclass(frozen=True)
class Ranks:
    """How many processes a pass's calibration asks for, and over how many windows: the manager
    checks them against the pass (:attr:`Pass.calibrates_in_ranks`) and the machine."""

    processes: int
    knob: str  # the knob that sets ``processes`` ("quant.calibration.num_processes")
    windows: int
    windows_knob: str  # the knob that sets ``windows`` ("quant.calibration.num_samples")


class Pass(ABC):
    """One step of a recipe. Subclasses set the class attributes and implement ``run``.

    ``Config`` is the pass's structured config (a dataclass registered in Hydra's ConfigStore
    by :func:`pipeline.config.register_pass`); ``version`` must be bumped whenever the output
    for the same input and config changes, so cached outputs of the old code are not reused.
    """

    Config: ClassVar[type]
    name: ClassVar[str]
    version: ClassVar[int] = 1
    consumes: ClassVar[Kind]
    produces: ClassVar[Kind]
    # Set by the pass manager before ``run``: a folder that survives an interrupted run of this
    # pass on this input with this config (and is removed once its output is cached), where a
    # long pass keeps checkpoints to resume from. None when run outside the manager.
    checkpoint_dir: Path | None = None
    # The pipeline.device / pipeline.torch_dtype knobs this pass honours (pipeline/core/placement.py):
    # they enter its cache key and its record. Every torch pass declares both; a pass that
    # declares a knob must compute where and in what dtype ``placement`` says.
    placement_knobs: ClassVar[tuple[str, ...]] = ()
    # Config fields that choose how the pass computes, not what it computes (how many processes,
    # which launcher; "a.b" names field b of the nested config a, absent ones are skipped): left out
    # of its cache key, so a rerun with other values reuses the output and resumes the checkpoints
    # of an interrupted run. They stay in the recorded config.
    execution_knobs: ClassVar[tuple[str, ...]] = ()
    # Whether the pass splits its calibration windows over the processes :meth:`ranks` names
    # (a ``run_rank(source, out_dir, group)`` reducing its statistics across them); the manager
    # refuses more than one process for any other pass.
    calibrates_in_ranks: ClassVar[bool] = False
    # How the pass holds the model while it runs (pipeline/core/memory.py estimates its peak from it):
    # "whole" (every weight in memory at the placement's dtype), "block" (one decoder block at a
    # time, streamed from the safetensors), "graph" (an ONNX graph with external data memory-mapped),
    # "none" (no weights).
    memory_profile: ClassVar[str] = "whole"
    # How far the pass may move the model's next-token distribution: its family among the eval
    # gate's token-level bounds (configs/eval/_drift.yaml; pipeline.config.DRIFT_FAMILIES),
    # "fp32" (exact rewrites in float32), "bits16", "bits8", "bits4" or "pruned". A recipe's
    # family is the loosest of its passes'. A pass whose family depends on its config overrides
    # ``drift_family``.
    drift: ClassVar[str] = "fp32"
    # A "whole" pass that loads its model module by module (calibration.streaming's
    # ``StreamedCheckpoint.load_model``) maps one module of the checkpoint at a time; one that
    # loads through ``from_pretrained`` has the whole checkpoint mapped beside the weights.
    loads_module_by_module: ClassVar[bool] = False
    # The preflight's estimate of this pass's peak memory in bytes (pipeline.core.memory.preflight sets
    # it; the manager records it next to the measured peak). None: not estimated.
    memory_estimate: int | None = None
    # The config node the pass was built from ("quant", "prune", ...; set by
    # ``pipeline.core.plugins.build_passes``), so messages name its knobs where the user sets them.
    config_group: str | None = None
    # What the recipe asks for (set by ``pipeline.core.plugins.build_passes``) and what it resolves
    # to on this machine (set by ``pipeline.core.manager.validate`` for passes with placement knobs).
    # Outside the manager: the CPU in float32.
    placement_request: Placement | None = None
    placement: ResolvedPlacement = CPU_FLOAT32

    def __init__(self, **config: Any) -> None:
        try:
            self.config = build_config(self.Config, config)
        except TypeError as exc:  # unknown keyword: a recipe key the pass does not have
            raise PassError(f"pass '{self.name}': bad config ({exc})") from None

    def drift_family(self) -> str:
        """This pass's family among the gate's token-level bounds (``drift``)."""
        return self.drift

    def config_dict(self) -> dict[str, Any]:
        """The resolved config as plain data, without the ``_target_`` bookkeeping key."""
        data = dataclasses.asdict(self.config)
        data.pop("_target_", None)
        return data

    def keyed_config(self) -> dict[str, Any]:
        """:meth:`config_dict` without the :attr:`execution_knobs`: what the output depends on."""
        return without_knobs(self.config_dict(), self.execution_knobs)

    def preflight(self) -> None:  # noqa: B027 - optional hook
        """Raise a :class:`~pipeline.core.errors.PipelineError` if this machine cannot run the pass
        (no GPU, no TensorRT, ...). The manager asks every pass before the first one runs, so a
        recipe ending in a GPU build fails at once, not after its long passes. Default: accept."""

    def estimate_memory(self, shapes: ModelShapes) -> int | None:
        """This pass's peak memory in bytes for a checkpoint of ``shapes`` (host memory, at
        ``self.placement``), for a pass that knows better than the generic estimate from
        :attr:`memory_profile` and its calibration config (``pipeline.core.memory``). Default: None."""
        return None

    def workload(self) -> Workload | None:
        """The windows this pass runs its model over (calibration, training), for the memory
        preflight; None for a pass that runs none. Default: None."""
        return None

    def ranks(self) -> Ranks | None:
        """The processes this pass's calibration asks for; None for one. Default: None."""
        return None

    def check_model(self, facts: PlannedModel) -> PlannedModel:
        """Raise a one-line :class:`~pipeline.core.errors.PipelineError` for a knob that cannot work
        on the model this pass will receive (``facts``: what the passes before leave of the
        source's config); return the facts of what this pass produces. The manager asks every pass
        in order before the first one runs, so a model-dependent knob fails at start-up
        (``pipeline.core.planned_model``). ``requires`` then checks the real input. Default: accept,
        facts unchanged."""
        return facts

    def requires(self, source: Artifact) -> None:  # noqa: B027 - optional hook
        """Raise :class:`PassError` if ``source`` cannot be processed (what only the real input
        shows: a missing file, a graph already quantized). Default: accept."""

    @abstractmethod
    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        """Write the output artifact into the (empty, existing) ``out_dir``; return metrics."""

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        """Check the output; raise :class:`PassError` on failure; return metrics to record."""
        return {}

    def nonfinite_hint(self) -> str:
        """The fix the one-line error names when this pass's output holds a NaN or infinite
        weight (the manager checks every output before caching it): the knob to change."""
        group = self.config_group or self.name
        return (
            f"check that the input model's weights are finite, and the {group}.* settings of "
            f"pass '{self.name}' (a scale or step size that overflows)"
        )


def without_knobs(config: dict[str, Any], knobs: tuple[str, ...]) -> dict[str, Any]:
    """A copy of ``config`` without the (possibly dotted, possibly absent) ``knobs``."""
    data = dict(config)
    for knob in knobs:
        head, _, rest = knob.partition(".")
        if rest and isinstance(data.get(head), dict):
            data[head] = without_knobs(data[head], (rest,))
        elif not rest:
            data.pop(head, None)
    return data


class Recipe(ABC):
    """A user-facing recipe that expands to several passes sharing one flat config.

    ``quant=int4_gptq`` is one config node (``quant.group_size=128``) but two passes: GPTQ in
    torch before export and the lowering of its weights in the graph after it. The manager
    places each expanded pass where its input kind first exists (see ``pipeline.core.plugins``).
    """

    Config: ClassVar[type]
    name: ClassVar[str]

    def __init__(self, **config: Any) -> None:
        try:
            self.config = build_config(self.Config, config)
        except TypeError as exc:
            raise PassError(f"recipe '{self.name}': bad config ({exc})") from None

    @abstractmethod
    def passes(self) -> list[Pass]:
        """The passes this recipe runs, in order."""
