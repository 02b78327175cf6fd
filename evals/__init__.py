"""Evaluation suites and the gate that judges engines through the runtime (filled by the gate
issue). It knows nothing of how an engine was made: no import of ``passes``."""
