"""Number formats and their packing (INT4, INT8, FP8): quantize and dequantize, scales, the
layouts ONNX Runtime and TensorRT read. Plain functions on tensors and arrays; no pass here, so
the algorithms (``passes/gptq.py``, ``awq.py``, ``smoothquant.py``, ``sensitivity.py``) and the
graph passes that lower them import these without importing each other."""
