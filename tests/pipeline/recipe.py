"""Compose the real recipe (configs/) with Hydra's compose API, as the entry point does."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from pipeline.config import register_pipeline_schemas
from pipeline.core.plugins import discover_passes

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def compose_recipe(overrides: list[str] | None = None) -> DictConfig:
    register_pipeline_schemas()
    discover_passes()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("pipeline", overrides=overrides or [])
