"""What is known of the model each pass will receive, before any pass runs.

The pass manager reads the source's ``config.json`` (and, for a graph source, what its
``artifact.json`` records) into :class:`PlannedModel` and hands it through the recipe:
each pass checks its model-dependent knobs against the facts it receives
(``Pass.check_model``: a group size that must divide every quantized layer's width, an
exclude pattern that must match a layer, a KV-cache option the target cannot build) and
returns the facts of what it produces (prune's smaller widths, export's opset, the cache
layout, the fusion rules). So such a knob fails at start-up, not after the passes before it
have run for an hour: the static counterpart of ``requires``, which checks the real input.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from pipeline.core.artifacts import Artifact
from pipeline.core.errors import SourceError, first_line


@dataclass(frozen=True)
class PlannedModel:
    """The facts one pass receives. ``config``: the checkpoint's ``config.json`` as the passes
    before leave it; ``teacher``: the config before pruning (None: not pruned); ``opset``: the
    graph's opset once exported; ``kv_cache``: the layout a kv_cache pass records (its
    ``artifact.json`` entry); ``fusion``: the rule families a fusion pass applies (None: unfused)."""

    config: Mapping[str, Any]
    teacher: Mapping[str, Any] | None = None
    opset: int | None = None
    kv_cache: Mapping[str, Any] = field(default_factory=dict)
    fusion: tuple[str, ...] | None = None

    @classmethod
    def of(cls, source: Artifact) -> PlannedModel | None:
        """The facts of ``source``; None without a readable ``config.json`` (nothing to check)."""
        try:
            config = json.loads((source.path / "config.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict):
            return None
        metadata = source.metadata
        fused = metadata.get("fusion")
        opset = metadata.get("opset")
        return cls(
            config=config,
            teacher=_teacher_config(metadata),
            opset=int(opset) if opset is not None else None,
            kv_cache=dict(metadata.get("kv_cache") or {}),
            fusion=tuple(fused) if fused else None,
        )

    def replace(self, **changes: Any) -> PlannedModel:
        """A copy with ``changes``; the layers already built carry over unless the config changes
        (export, kv_cache and fusion change other facts: one skeleton serves every graph pass)."""
        copy = dataclasses.replace(self, **changes)
        if "config" not in changes and "linears" in self.__dict__:
            copy.__dict__["linears"] = self.__dict__["linears"]
        return copy

    @cached_property
    def linears(self) -> dict[str, tuple[int, int]]:
        """Every linear layer's module name -> (in_features, out_features), from a skeleton built
        on torch's meta device (no weights: milliseconds once transformers is imported)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        settings = dict(self.config)
        model_type = settings.pop("model_type", None)
        try:
            config = AutoConfig.for_model(str(model_type), **settings)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
        except (ValueError, KeyError, TypeError) as exc:  # transformers' messages span lines
            raise SourceError(
                f"config.json (model_type {model_type!r}) does not describe a causal LM transformers "
                f"builds: {first_line(exc)}"
            ) from None
        return {
            name: (module.in_features, module.out_features)
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)
        }


def _teacher_config(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``config.json`` of the checkpoint a pruned source was cut from, if it is still there
    (the distill pass's own ``requires`` names what is wrong when it is not)."""
    teacher = (metadata.get("prune") or {}).get("teacher") or {}
    try:
        config = json.loads((Path(teacher["path"]) / "config.json").read_text())
    except (KeyError, TypeError, OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
