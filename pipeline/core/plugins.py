"""Pass discovery and the guard on ``_target_``.

``pipeline/`` never imports ``passes/`` statically: the entry point imports every module of
the ``passes`` package once (each registers its config schema), and the manager builds passes
from the recipe's ``_target_``. Because ``_target_`` names code to import, only
:class:`~pipeline.core.base.Pass` (or :class:`~pipeline.core.base.Recipe`) subclasses defined under ``passes``
are accepted, so an override cannot make a nightly job import and run arbitrary code. The class is
called directly with the node's other keys as plain data, never through Hydra's recursive
``instantiate``: a ``_target_`` (or ``_args_``, ``_partial_``, ...) anywhere below a group's own
``_target_`` would have Hydra build that object too (``+quant.x._target_=torch.load`` unpickles a
file), so such keys are refused wherever they appear.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.core.artifacts import Kind
from pipeline.core.base import Pass, Recipe
from pipeline.core.config import config_where
from pipeline.core.errors import ConfigError
from pipeline.core.placement import Placement

PASS_PACKAGE = "passes"
# Keys through which Hydra's instantiate calls or shapes code; only a group's own _target_ is used.
HYDRA_KEYS = ("_target_", "_args_", "_partial_", "_recursive_", "_convert_")


def discover_passes(package: str = PASS_PACKAGE) -> list[str]:
    """Import every module of ``package`` so that each pass registers its config schema."""
    root = importlib.import_module(package)
    names = []
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        importlib.import_module(info.name)
        names.append(info.name)
    return names


def pass_class(target: str, where: str) -> type[Pass | Recipe]:
    """Resolve ``target`` to a Pass or Recipe subclass under ``passes``, or raise a ConfigError."""
    module_name, _, attr = target.rpartition(".")
    if not module_name or not (module_name == PASS_PACKAGE or module_name.startswith(PASS_PACKAGE + ".")):
        raise ConfigError(f"{where}: _target_ '{target}' is not under '{PASS_PACKAGE}.'; only passes may run")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{where}: cannot import '{module_name}' for _target_ '{target}' ({exc})") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Pass | Recipe)) or cls in (Pass, Recipe):
        raise ConfigError(f"{where}: _target_ '{target}' is not a Pass or Recipe subclass")
    return cls


def _pass_nodes(key: str, node: Any) -> list[tuple[str, DictConfig]]:
    if node is None:
        return []
    if not isinstance(node, DictConfig):
        raise ConfigError(f"'{key}' must be a mapping of pass configs, got {node!r}")
    if "_target_" in node:
        return [(key, node)]
    found = []
    for child_key, child in node.items():
        if not (isinstance(child, DictConfig) and "_target_" in child):
            raise ConfigError(
                f"'{key}.{child_key}' is not a pass config (no _target_); choose an option of the "
                f"'{key}' group instead"
            )
        found.append((f"{key}.{child_key}", child))
    return found


def check_plain_settings(where: str, node: dict[Any, Any]) -> None:
    """Refuse Hydra's instantiate keys in a pass node except its own top-level ``_target_``."""

    def walk(value: Any, path: str, top: bool) -> None:
        if isinstance(value, dict):
            for key, child in value.items():
                name = f"{path}.{key}"
                if key in HYDRA_KEYS and not (top and key == "_target_"):
                    raise ConfigError(
                        f"{name} is refused: pass settings are plain data and only the group's own "
                        f"_target_ names code (a pass under '{PASS_PACKAGE}.'); remove {name}"
                    )
                walk(child, name, top=False)
        elif isinstance(value, list):
            for index, child in enumerate(value):
                walk(child, f"{path}[{index}]", top=False)

    walk(node, where, top=True)


def build_pass(where: str, node: DictConfig) -> Pass | Recipe:
    """The pass (or recipe) a node selects: its allow-listed class called with the node's other
    keys as plain data (no recursive instantiation)."""
    cls = pass_class(str(node._target_), where)
    plain = OmegaConf.to_container(node, resolve=True)
    assert isinstance(plain, dict)
    check_plain_settings(where, plain)
    settings = {str(key): value for key, value in plain.items() if key != "_target_"}
    with config_where(where):  # nested checks name their knob under the node (quant.calibration...)
        return cls(**settings)


def build_passes(cfg: DictConfig, source_kind: Kind = Kind.TORCH) -> list[Pass]:
    """Build the passes the recipe selects and arrange them along ``pipeline.order``."""
    entries: list[tuple[str, Pass]] = []
    for key in cfg.pipeline.order:
        if key not in cfg:
            raise ConfigError(f"pipeline.order names '{key}', which is not a config group")
        nodes = _pass_nodes(key, cfg[key])
        built = [(where, build_pass(where, node)) for where, node in nodes]
        for where, step in built:
            expanded = step.passes() if isinstance(step, Recipe) else [step]
            for one in expanded:
                one.config_group = where  # where its knobs live, for messages (pipeline/core/memory.py)
            entries.extend((where, one) for one in expanded)
    passes = arrange(entries, source_kind)
    request = Placement(str(cfg.pipeline.get("device", "auto")), str(cfg.pipeline.get("torch_dtype", "auto")))
    for step in passes:
        step.placement_request = request
    return passes


def arrange(entries: list[tuple[str, Pass]], source_kind: Kind) -> list[Pass]:
    """Order passes along the recipe, moving a pass forward only to where its input first exists.

    A recipe group may hold passes of two stages (GPTQ in torch, its lowering in the graph):
    each pass runs at its group's place in ``pipeline.order`` or, if that place does not yet hold
    the kind it consumes, as soon as that kind appears. Kinds only move forward (torch ->
    graph -> engine), so a pass placed after the kind it needs is a configuration error.
    """
    placed: list[Pass] = []
    pending: list[tuple[str, Pass, Kind, str]] = []  # + the kind and its producer on arrival
    kind, producer = source_kind, "the model source"
    for where, step in entries:
        pending.append((where, step, kind, producer))
        while ready := [i for i, entry in enumerate(pending) if entry[1].consumes == kind]:
            where_placed, placed_step, _, _ = pending.pop(ready[0])
            placed.append(placed_step)
            kind, producer = placed_step.produces, f"'{placed_step.name}' ({where_placed})"
    if pending:
        where, step, kind, producer = pending[0]
        raise ConfigError(
            f"pass '{step.name}' ({where}) consumes {step.consumes.label}, but where '{where}' stands in "
            f"pipeline.order the recipe already holds {kind.label} from {producer}: move '{where}' "
            "earlier in pipeline.order"
        )
    return placed
