"""Pass discovery and the guard on ``_target_``.

``pipeline/`` never imports ``passes/`` statically: the entry point imports every module of
the ``passes`` package once (each registers its config schema), and the manager builds passes
from the recipe with ``hydra.utils.instantiate``. Because ``_target_`` names code to import,
only :class:`~pipeline.base.Pass` subclasses defined under ``passes`` are accepted, so an
override cannot make a nightly job import and run arbitrary code.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from pipeline.artifacts import Kind
from pipeline.base import Pass, Recipe
from pipeline.errors import ConfigError, PipelineError

PASS_PACKAGE = "passes"


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


def build_passes(cfg: DictConfig, source_kind: Kind = Kind.TORCH) -> list[Pass]:
    """Instantiate the passes the recipe selects and arrange them along ``pipeline.order``."""
    entries: list[tuple[str, Pass]] = []
    for key in cfg.pipeline.order:
        if key not in cfg:
            raise ConfigError(f"pipeline.order names '{key}', which is not a config group")
        for where, node in _pass_nodes(key, cfg[key]):
            pass_class(str(node._target_), where)
            plain = OmegaConf.to_container(node, resolve=True)
            try:
                built = instantiate(plain, _convert_="all")
            except InstantiationException as exc:
                # A pass refusing its own settings (PassError in __init__) is a user mistake:
                # surface it as itself, not as Hydra's wrapper and its stack-trace hint.
                if isinstance(exc.__cause__, PipelineError):
                    raise exc.__cause__ from None
                raise
            expanded = built.passes() if isinstance(built, Recipe) else [built]
            entries.extend((where, step) for step in expanded)
    return arrange(entries, source_kind)


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
