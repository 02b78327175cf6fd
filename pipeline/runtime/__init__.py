"""Runtimes that execute engines: ONNX Runtime on CPU today (``ort.py``), generation loop
(``generate.py``)."""

from pipeline.runtime.generate import GenerationConfig, GenerationResult
from pipeline.runtime.ort import Engine, OrtModel

__all__ = ["Engine", "GenerationConfig", "GenerationResult", "OrtModel"]
