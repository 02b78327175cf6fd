"""LLM optimization pipeline: checkpoint -> passes -> ONNX -> engine -> benchmark.

The entry point is ``python -m pipeline``; see the README's architecture section.
"""

__version__ = "0.1.0"
