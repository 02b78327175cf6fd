"""The kernel: the pass contract (:mod:`~pipeline.core.base`), the pass manager and the cache,
artifacts, errors, the ``engine.json`` contract, and the I/O and placement helpers passes share.
It imports nothing of ours above it (``[tool.importlinter]`` in ``pyproject.toml``)."""
