"""Tests of the benchmarks (``benchmarks/``, a package: imported as ``from benchmarks import x``)."""
