"""Fixtures of the pipeline tests that use the test passes (``passes_for_tests.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.artifacts import Artifact
from tests.pipeline.passes_for_tests import make_source


@pytest.fixture
def source(tmp_path: Path) -> Artifact:
    return make_source(tmp_path)
