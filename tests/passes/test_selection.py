"""Layer selection shared by every quantization pass: exclude patterns and the sensitivity fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from passes.selection import FALLBACK_FILE, check_patterns, fallback_modules, select_modules
from pipeline.core.errors import ConfigError

NAMES = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.mlp.down_proj",
    "model.layers.1.mlp.down_proj",
    "lm_head",
]


def test_exclude_patterns_select_modules() -> None:
    assert select_modules(NAMES, ["lm_head", "*.0.*"]) == ["model.layers.1.mlp.down_proj"]
    assert select_modules(NAMES, ["*down_proj"]) == [NAMES[0], NAMES[3]]
    with pytest.raises(ConfigError, match=r"quant.exclude pattern 'lm_haed' matches no linear module"):
        select_modules(NAMES, ["lm_haed"])
    with pytest.raises(ConfigError, match=r"quant.weight_only pattern 'up' matches no linear module"):
        check_patterns(NAMES, ["up"], "quant.weight_only")


def test_fallback_recorded_by_the_sensitivity_pass_is_excluded_too(tmp_path: Path) -> None:
    assert fallback_modules(tmp_path) == []
    (tmp_path / FALLBACK_FILE).parent.mkdir(parents=True)
    (tmp_path / FALLBACK_FILE).write_text(json.dumps({"modules": ["model.layers.1.mlp.down_proj"]}))
    assert fallback_modules(tmp_path) == ["model.layers.1.mlp.down_proj"]
    assert select_modules(NAMES, ["lm_head"], tmp_path) == NAMES[:2]
    assert select_modules(NAMES, [], None) == NAMES
