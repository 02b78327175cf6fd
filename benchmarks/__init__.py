"""Benchmarks of the pipeline against its peers, one module a benchmark, each run from the
repository root as ``python -m benchmarks.<name>`` and printing a table (``benchmarks/README.md``
has the commands and the recorded results). They sit above the application: they may import
``pipeline``, ``passes``, ``evals`` and ``calibration``; nothing there imports them. What they
share lives in :mod:`benchmarks.common`."""
