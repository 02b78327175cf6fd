"""Calibration windows: sizes, determinism, disjointness, and one-line errors naming the knob."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from calibration.datasets import DATA_DIR, CalibrationConfig, calibration_text, token_windows
from pipeline.core.errors import CalibrationError


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path):
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_windows_have_the_asked_shape_and_are_seeded(tokenizer) -> None:
    config = CalibrationConfig(num_samples=8, seq_len=32, seed=3)
    first, again = token_windows(tokenizer, config), token_windows(tokenizer, config)
    assert first.shape == (8, 32) and first.dtype == np.int64
    np.testing.assert_array_equal(first, again)
    other = token_windows(tokenizer, CalibrationConfig(num_samples=8, seq_len=32, seed=4))
    assert not np.array_equal(first, other)


def test_windows_are_distinct_text(tokenizer) -> None:
    windows = token_windows(tokenizer, CalibrationConfig(num_samples=32, seq_len=64))
    assert len({tuple(w) for w in windows}) == 32


def test_shipped_text_declares_its_source_and_licence() -> None:
    assert len(calibration_text("python_reference")) > 400_000
    source = (DATA_DIR / "SOURCE.md").read_text()
    assert "PSF License" in source and (DATA_DIR / "PSF-LICENSE.txt").is_file()


@pytest.mark.parametrize(
    ("config", "text", "needle"),
    [
        (CalibrationConfig(num_samples=0), None, "quant.calibration.num_samples must be at least 1"),
        (CalibrationConfig(seq_len=1), None, "quant.calibration.seq_len must be at least 2"),
        (CalibrationConfig(seq_len=64), "too short", "than one sequence of quant.calibration.seq_len=64"),
        (
            CalibrationConfig(num_samples=9999, seq_len=64),
            None,
            "quant.calibration.num_samples=9999 x quant.calibration.seq_len=64 needs",
        ),
        (CalibrationConfig(dataset="wiki"), None, "quant.calibration.dataset='wiki' is unknown"),
    ],
)
def test_bad_calibration_settings_are_one_line_errors(
    tokenizer,
    config: CalibrationConfig,
    text: str | None,
    needle: str,
) -> None:
    with pytest.raises(CalibrationError) as error:
        token_windows(tokenizer, config, text)
    assert needle in str(error.value) and "\n" not in str(error.value)
