"""``python -m pipeline.lint <graph or engine folder | model.onnx>``: the TensorRT compatibility
lint of :mod:`pipeline.core.lint` from the command line (one line per finding, exit 1 on errors)."""

import sys

from pipeline.core.lint import main

if __name__ == "__main__":
    sys.exit(main())
