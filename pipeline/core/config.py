"""What every config needs from the kernel: a pass registers its config dataclass as a Hydra
schema (:func:`register_pass`); :func:`build_config` makes the config a pass is built with a tree
of dataclasses and validates it once (each dataclass's ``validate()``); and a config refuses a
value out of range with one line naming the knob as the command line writes it (``check_int``,
``check_ints``, ``check_number``).
The application's own schemas (model, bench, eval, registry, ...) are in ``pipeline/config.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

from hydra.core.config_store import ConfigStore

from pipeline.core.errors import ConfigError


def _show(value: Any) -> str:
    """A value as it would be written on the command line."""
    if isinstance(value, list | tuple):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return "null" if value is None else str(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# Upper bounds shared by many knobs: nothing sensible lies beyond them, and a value past them
# only turns into an allocation that fails (or a loop that never ends) long after start-up.
MAX_SEED = 2**32 - 1  # numpy's and torch's seeds
MAX_TOKENS = 1 << 20  # a sequence length, window or token count: 1M tokens
MAX_SAMPLES = 1 << 16  # calibration or eval windows, requests
MAX_BATCH = 1024  # rows per forward, concurrent requests
MAX_REPEATS = 1000  # repeats, warm-up runs, candidates of a search
MAX_THREADS = 1024  # thread or process counts


def check_int(name: str, value: Any, low: int, high: int | None = None, *, optional: bool = False) -> None:
    """``name=value`` must be a whole number >= ``low`` and <= ``high`` when given (or null when
    ``optional``)."""
    if value is None and optional:
        return
    rule = f"from {low} to {high}" if high is not None else f"of at least {low}"
    if not _is_int(value):
        null = " or null" if optional else ""
        raise ConfigError(f"{name}={_show(value)}: must be a whole number {rule}{null}")
    if value < low:
        raise ConfigError(f"{name}={_show(value)}: must be at least {low}")
    if high is not None and value > high:
        raise ConfigError(f"{name}={_show(value)}: must be at most {high}")


def check_ints(
    name: str, values: Any, low: int, high: int | None = None, *, count: int | None = None
) -> None:
    """A list of whole numbers, each >= ``low`` and <= ``high`` when given (exactly ``count`` of
    them when given)."""
    each = f"each from {low} to {high}" if high is not None else f"each at least {low}"
    if not isinstance(values, list | tuple) or (count is not None and len(values) != count):
        what = f"a list of {count} whole numbers" if count else "a list of whole numbers"
        raise ConfigError(f"{name}={_show(values)}: must be {what}, {each}")
    for value in values:
        if not _is_int(value) or value < low or (high is not None and value > high):
            rule = f"from {low} to {high}" if high is not None else f"of at least {low}"
            raise ConfigError(f"{name}={_show(values)}: each must be a whole number {rule}")


def check_number(
    name: str,
    value: Any,
    *,
    above: float | None = None,
    low: float | None = None,
    below: float | None = None,
    high: float | None = None,
    optional: bool = False,
) -> None:
    """``name=value`` must be a number in the given bounds (``above``/``below`` exclusive,
    ``low``/``high`` inclusive)."""
    if value is None and optional:
        return
    rules = [f"more than {above}" if above is not None else "", f"at least {low}" if low is not None else ""]
    rules.append(f"less than {below}" if below is not None else "")
    rules.append(f"at most {high}" if high is not None else "")
    rule = " and ".join(r for r in rules if r)
    ok = _is_number(value)
    ok = ok and (above is None or value > above) and (low is None or value >= low)
    ok = ok and (below is None or value < below) and (high is None or value <= high)
    if not ok:
        null = " (or null)" if optional else ""
        raise ConfigError(f"{name}={_show(value)}: must be a number {rule}{null}")


_WHERE: contextvars.ContextVar[str] = contextvars.ContextVar("config_where", default="")


@contextlib.contextmanager
def config_where(where: str) -> Iterator[None]:
    """While a pass config is built from the recipe node at ``where`` (``quant``, ``prune``,
    ``quant.a``), :func:`knob` names its nested settings from there, so a check in a config shared
    by many passes (the calibration windows) names the knob as the command line writes it."""
    token = _WHERE.set(where)
    try:
        yield
    finally:
        _WHERE.reset(token)


def knob(name: str) -> str:
    """``name`` (``calibration.seq_len``) under the node being built (``quant.calibration.seq_len``)."""
    where = _WHERE.get()
    return f"{where}.{name}" if where else name


def register_pass(group: str, name: str, node: type) -> None:
    """Register a pass's config dataclass as ``<name>_schema`` in ``group``.

    A YAML option in ``configs/<group>/`` then lists ``<name>_schema`` first in its defaults,
    which makes Hydra type-check every key of that option.
    """
    ConfigStore.instance().store(group=group, name=f"{name}_schema", node=node)


T = TypeVar("T")


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a field's type names (``X`` or ``X | None``), if any."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        found = [
            arg for arg in typing.get_args(hint) if isinstance(arg, type) and dataclasses.is_dataclass(arg)
        ]
        return found[0] if len(found) == 1 else None
    return None


def _typed(cls: type[T], values: Mapping[str, Any]) -> T:
    """``cls(**values)`` with each mapping given for a dataclass field made that dataclass."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in values.items():
        nested = _dataclass_in(hints.get(name))
        kwargs[name] = _typed(nested, value) if nested is not None and isinstance(value, Mapping) else value
    return cls(**kwargs)


def validate_tree(config: Any) -> None:
    """Call ``validate()`` on every dataclass of ``config``, the nested ones first."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            validate_tree(value)
    check = getattr(config, "validate", None)
    if callable(check):
        check()


def build_config(cls: type[T], values: Mapping[str, Any]) -> T:
    """The config a pass is built with: a tree of dataclasses whether ``values`` come from Hydra
    (plain data: nested mappings) or from code (dataclasses or mappings), validated once. Hydra's
    instantiate would hand nested configs over as dicts; building them here keeps every pass
    config typed end to end. An unknown key raises TypeError (the caller names the pass)."""
    config = _typed(cls, values)
    validate_tree(config)
    return config
