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
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from pipeline.core.artifacts import Artifact
from pipeline.core.errors import SourceError
from pipeline.core.families import Family, family_of
from pipeline.core.files import UnsafeFileError, loads_bounded, read_regular_text

CONFIG_MAX_BYTES = 16 << 20  # a config.json is kilobytes; a bigger one is not a config


@dataclass(frozen=True)
class PlannedModel:
    """The facts one pass receives. ``config``: the checkpoint's ``config.json`` as the passes
    before leave it; ``teacher``: the config before pruning (None: not pruned); ``opset``: the
    graph's opset once exported; ``kv_cache``: the layout a kv_cache pass records (its
    ``artifact.json`` entry); ``fusion``: the rule families a fusion pass applies (None: unfused);
    ``where``: the config's name in messages."""

    config: Mapping[str, Any]
    teacher: Mapping[str, Any] | None = None
    opset: int | None = None
    kv_cache: Mapping[str, Any] = field(default_factory=dict)
    fusion: tuple[str, ...] | None = None
    where: str = field(default="config.json", compare=False)

    @classmethod
    def of(cls, source: Artifact) -> PlannedModel | None:
        """The facts of ``source``; None without a readable ``config.json`` (nothing to check)."""
        path = source.path / "config.json"
        if not os.path.lexists(path):
            return None
        try:  # a FIFO, a device or a folder there is refused in one line (UnsafeFileError)
            config = loads_bounded(read_regular_text(path, max_bytes=CONFIG_MAX_BYTES, what="a config.json"))
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
        if "config" not in changes:
            for built in ("skeleton", "linears", "tensors"):
                if built in self.__dict__:
                    copy.__dict__[built] = self.__dict__[built]
        return copy

    @cached_property
    def family(self) -> Family:
        """What the passes know of this checkpoint's family (:mod:`pipeline.core.families`)."""
        return family_of(self.config)

    @cached_property
    def skeleton(self) -> Any:
        """The model transformers builds from ``config`` on torch's meta device: its modules and
        parameter shapes, no weights (milliseconds once transformers is imported)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        settings = dict(self.config)
        model_type = settings.pop("model_type", None)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its warnings on a bad config would be more lines of output
        try:
            config = AutoConfig.for_model(str(model_type), **settings)
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config, trust_remote_code=False)
        except Exception as exc:  # transformers' and huggingface_hub's validators raise many types
            raise SourceError(
                f"{self.where} (model_type {model_type!r}) does not describe a causal LM transformers "
                f"builds: {_reason(exc)}"
            ) from None
        finally:
            hf_logging.set_verbosity(verbosity)

    @cached_property
    def linears(self) -> dict[str, tuple[int, int]]:
        """Every linear layer's module name -> (in_features, out_features), from :attr:`skeleton`."""
        import torch

        return {
            name: (module.in_features, module.out_features)
            for name, module in self.skeleton.named_modules()
            if isinstance(module, torch.nn.Linear)
        }

    @cached_property
    def tensors(self) -> dict[str, PlannedTensor]:
        """Every tensor a checkpoint of ``config`` stores (its state dict), by name, from
        :attr:`skeleton`. Of parameters tied together (``lm_head.weight`` and the embedding, with
        ``tie_word_embeddings``) a checkpoint stores one: each of them is ``tied`` to the others."""
        skeleton = self.skeleton
        names: dict[int, list[str]] = {}
        for name, parameter in skeleton.named_parameters(remove_duplicate=False):
            names.setdefault(id(parameter), []).append(name)
        tied = {name: tuple(n for n in group if n != name) for group in names.values() for name in group}
        return {
            name: PlannedTensor(
                tuple(int(d) for d in value.shape), value.is_floating_point(), tied.get(name, ())
            )
            for name, value in skeleton.state_dict(keep_vars=True).items()
        }


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor a checkpoint stores: its shape, whether it is floating-point, and the names of
    the tensors tied to it (any one of them may stand for all)."""

    shape: tuple[int, ...]
    floating: bool = True
    tied: tuple[str, ...] = ()


def _reason(exc: BaseException) -> str:
    """An exception's message on one line (validators' messages span several), shortened."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _teacher_config(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``config.json`` of the checkpoint a pruned source was cut from, if it is still there
    (the distill pass's own ``requires`` names what is wrong when it is not)."""
    teacher = (metadata.get("prune") or {}).get("teacher") or {}
    try:
        path = Path(teacher["path"]) / "config.json"
        config = loads_bounded(read_regular_text(path, max_bytes=CONFIG_MAX_BYTES, what="a config.json"))
    except (KeyError, TypeError, OSError, ValueError, UnsafeFileError):
        return None
    return config if isinstance(config, dict) else None
