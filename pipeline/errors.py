"""Errors a user can cause. The entry point prints them as one line and exits with code 2."""


class PipelineError(Exception):
    """A user-facing error: the message names the bad input and the fix."""


class ConfigError(PipelineError):
    """The recipe is inconsistent (bad pass order, unknown pass target, ...)."""


class SourceError(PipelineError):
    """The model source is missing, corrupt, unverifiable or unsupported."""


class PassError(PipelineError):
    """A pass's precondition (`requires`) or postcondition (`ensures`) failed."""


class EngineError(PipelineError):
    """An engine folder cannot be loaded or run."""


class CalibrationError(PipelineError):
    """Calibration data or collected statistics are unusable (too little text, NaN/inf, ...)."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (library messages can span many lines)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
