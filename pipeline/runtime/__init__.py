"""Runtimes that execute engines: ONNX Runtime (``ort.py``: CPU, CUDA and TensorRT providers),
TensorRT plans (``tensorrt.py``), the generation loop (``generate.py``), speculative decoding
(``speculative.py``) and serving with continuous batching and prefix caching (``serving.py``)."""

from pipeline.runtime.generate import GenerationConfig, GenerationResult
from pipeline.runtime.ort import Engine, OrtModel
from pipeline.runtime.serving import Completion, Request, Server, ServingError, ServingLimits

__all__ = [
    "Completion",
    "Engine",
    "GenerationConfig",
    "GenerationResult",
    "OrtModel",
    "Request",
    "Server",
    "ServingError",
    "ServingLimits",
]
