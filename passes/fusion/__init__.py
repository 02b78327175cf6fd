"""Graph fusions: rewrite rules (onnxscript's pattern rewriter over onnx-ir), one module per
rule family, and the pass that applies a target's rule set (``fuse.py``)."""
