"""The run summary's note on the KV-cache pass."""

from __future__ import annotations

from pipeline.summary import _kv_cache_note


def test_the_kv_cache_note_names_layout_dtype_calibration_and_window() -> None:
    assert _kv_cache_note({"layout": "concat", "dtype": "fp32", "window": 0}) == "concat, fp32"
    kv = {
        "layout": "shared",
        "dtype": "int8",
        "window": 256,
        "capacity": 320,
        "calibration": {"tokens": 4096},
    }
    assert _kv_cache_note(kv) == "shared, int8 (calibrated on 4096 tokens), window 256 in 320 positions"
