"""Arranging passes along pipeline.order, and recipes that expand to passes of two stages."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pipeline.core.artifacts import Kind
from pipeline.core.base import Pass, Recipe
from pipeline.core.errors import ConfigError
from pipeline.core.plugins import arrange
from tests.pipeline.passes_for_tests import AppendPass, ToEnginePass, ToGraphPass


@dataclass
class TwoStageConfig:
    _target_: str = "tests.pipeline.test_plugins.TwoStage"
    text: str = "q"


class GraphTouch(ToEnginePass):
    """graph -> graph stand-in for the graph half of a recipe."""

    name = "graph-touch"
    produces = Kind.GRAPH


class TwoStage(Recipe):
    Config = TwoStageConfig
    name = "two-stage"

    def passes(self) -> list[Pass]:
        return [AppendPass(text=self.config.text), GraphTouch()]


def names(passes: list[Pass]) -> list[str]:
    return [p.name for p in passes]


def test_recipe_passes_are_split_around_export() -> None:
    entries = [("quant", step) for step in TwoStage(text="z").passes()]
    entries += [("export", ToGraphPass()), ("target", ToEnginePass())]
    assert names(arrange(entries, Kind.TORCH)) == ["append", "to-graph", "graph-touch", "to-engine"]


def test_torch_pass_after_export_is_a_config_error() -> None:
    entries = [("export", ToGraphPass()), ("prune", AppendPass()), ("target", ToEnginePass())]
    with pytest.raises(ConfigError, match=r"pass 'append' \(prune\) consumes a torch model.*'to-graph'"):
        arrange(entries, Kind.TORCH)


def test_arrangement_keeps_the_order_of_same_stage_passes() -> None:
    entries = [("a", AppendPass(text="1")), ("b", AppendPass(text="2")), ("export", ToGraphPass())]
    placed = arrange(entries, Kind.TORCH)
    assert [getattr(p.config, "text", None) for p in placed] == ["1", "2", None]
