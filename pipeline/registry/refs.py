"""Registry names and references: ``<model>/<recipe>[/<target>][@<version|channel>]``.

Names become folder names, so they are checked before anything touches the disk: letters,
digits and ``. _ + -`` only, never a path separator or ``..``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.core.errors import PipelineError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
CHANNELS = ("nightly", "candidate", "stable")
DEFAULT_TARGET = "ort-cpu"


class RegistryError(PipelineError):
    """A registry operation was refused: a bad name, a missing version, a failed gate, a corrupt blob."""

    exit_code = 2  # a user mistake


class RegistryIOError(RegistryError):
    """The operating system refused a read or write (read-only registry, permission denied, disk
    full): not the user's input, so the CLI exits with code 1."""

    exit_code = 1


MAX_VERSION_DIGITS = 12  # a version number: a trillion versions; longer is no version


def _shown(value: object) -> str:
    """``value`` quoted (control characters escaped), cut short: an error stays one short line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_name(what: str, value: str) -> str:
    """``value`` if it is a registry name (:data:`NAME`: 1 to 128 of letters, digits, ``. _ + -``,
    starting with a letter or digit, no ``..``); else a one-line RegistryError naming ``what``."""
    if not isinstance(value, str) or not NAME.fullmatch(value) or ".." in value:
        raise RegistryError(
            f"{what} {_shown(value)} is not a registry name: use 1 to 128 letters, digits, '.', '_', "
            "'+' or '-', starting with a letter or digit (no path separators, no '..')"
        )
    return value


def check_channel(channel: str) -> str:
    if not isinstance(channel, str) or channel not in CHANNELS:
        raise RegistryError(f"unknown channel {_shown(channel)}: use one of {', '.join(CHANNELS)}")
    return channel


@dataclass(frozen=True)
class Ref:
    """One registry entry (model, recipe, target) and which of its versions: a number, a channel,
    or None for the latest."""

    model: str
    recipe: str
    target: str = DEFAULT_TARGET
    selector: int | str | None = None

    def __post_init__(self) -> None:
        check_name("model", self.model)
        check_name("recipe", self.recipe)
        check_name("target", self.target)
        if isinstance(self.selector, str):
            check_channel(self.selector)
        elif isinstance(self.selector, int) and self.selector < 1:
            raise RegistryError(f"version {self.selector} does not exist: versions count from 1")
        elif isinstance(self.selector, int) and self.selector >= 10**MAX_VERSION_DIGITS:
            raise RegistryError(
                f"version {_shown(self.selector)} does not exist: a version is a number of at most "
                f"{MAX_VERSION_DIGITS} digits"
            )

    @classmethod
    def parse(cls, text: str, target: str | None = None) -> Ref:
        """``llama/fp8``, ``llama/fp8@3``, ``llama/fp8@stable``, ``llama/fp8/tensorrt@nightly``."""
        name, _, selector = text.partition("@")
        parts = name.split("/")
        if len(parts) not in (2, 3) or not all(parts) or (selector == "" and "@" in text):
            raise RegistryError(
                f"{text!r} is not a reference: write <model>/<recipe>[/<target>][@<version|channel>], "
                "e.g. llama/fp8@stable"
            )
        if len(parts) == 3 and target and parts[2] != target:
            raise RegistryError(f"{text!r} names target {parts[2]!r} but {target!r} was asked for")
        chosen = parts[2] if len(parts) == 3 else (target or DEFAULT_TARGET)
        which: int | str | None = None
        if selector.isascii() and selector.isdigit():  # int() takes other digits, '²' it refuses
            if len(selector) > MAX_VERSION_DIGITS:
                raise RegistryError(
                    f"version {_shown(selector)} does not exist: a version is a number of at most "
                    f"{MAX_VERSION_DIGITS} digits"
                )
            which = int(selector)
        elif selector:
            which = selector
        return cls(parts[0], parts[1], chosen, which)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.model, self.recipe, self.target)

    def at(self, selector: int | str | None) -> Ref:
        return Ref(self.model, self.recipe, self.target, selector)

    def __str__(self) -> str:
        text = f"{self.model}/{self.recipe}/{self.target}"
        return f"{text}@{self.selector}" if self.selector is not None else text
