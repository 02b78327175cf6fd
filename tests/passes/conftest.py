"""The family test files' shared module fixtures (``tests/families.py``): each such file defines
``checkpoint``, its tiny model, and gets its export, fused graph and transformers' logits."""

from tests.families import fused, graph, reference  # noqa: F401 - fixtures
