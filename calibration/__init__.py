"""Calibration data and observers that serve quantization passes. Imports no pass.

``datasets``: shipped text (``data/``, with source and licence) cut into seeded token windows.
``observers``: minmax / percentile / MSE / entropy thresholds from activations collected on the graph.
"""
