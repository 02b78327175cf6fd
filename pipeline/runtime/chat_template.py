"""An engine's chat template, rendered in a sandbox with bounds on time, size and output.

A chat template is Jinja code that came with the checkpoint: untrusted input, like every file of
an engine folder. transformers already renders it in Jinja's ``ImmutableSandboxedEnvironment``
(no attribute escapes, no mutation of what it is given), but the sandbox bounds nothing: two
nested ``range(100000)`` loops stall the gate for hours with no message, ``"x" * 10**10`` or
``"x"|center(10**10)`` asks for tens of GB, and ``10 ** 10 ** 9`` runs one CPU-bound
multiplication that nothing interrupts. :func:`render_chat` renders the same template in the
same environment (transformers' filters, globals and extensions) with these bounds:

- time: a deadline checked at every line the compiled template runs (a trace function that
  follows the template's own frames only, so the rest of the process runs untraced);
- size: every value a call, filter, arithmetic operator or ``~`` join produces is at most
  :data:`MAX_VALUE_ITEMS` long, counted as it would print (nested lists included), and an
  integer argument past that bound (a width, a count) is
  refused before the call runs; a power or product of integers past :data:`MAX_INT_BITS` too;
- output: the rendered text is streamed and refused past :data:`MAX_OUTPUT_CHARS`.

Past a bound, one :class:`ChatTemplateError` line names the file the template came from. Our own
renderer, not ``tokenizer.apply_chat_template``, because transformers compiles the template in
an environment of its own making that takes no bounds; the rendering rules (the special-token
variables, ``continue_final_message``) are transformers' ``render_jinja_template``, and a test
compares the two on real templates.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import FrameType
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pipeline.core.errors import EngineError, first_line

# The wall time one render may take; a real template renders in well under a millisecond.
MAX_RENDER_SECONDS = 5.0
# The rendered text: a million-token context is about 4 Mi characters.
MAX_OUTPUT_CHARS = 1 << 24
# The length of any string, list or mapping the template computes, and of any integer argument.
MAX_VALUE_ITEMS = 1 << 24
# An integer the template computes (a ``**`` or ``*`` of integers) has at most this many bits.
MAX_INT_BITS = 4096
# How deep values the template computes may nest (lists in lists).
MAX_NESTING = 64
# The template's own source: real ones are a few KiB, tool-calling ones tens of KiB.
MAX_SOURCE_CHARS = 1 << 20
# The file name the compiled template's code runs under: the deadline follows these frames only.
_TEMPLATE_CODE = "<chat template>"
# transformers' marker for the end of the message to continue (render_jinja_template).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(EngineError):
    """A chat template that cannot be rendered within the bounds, or at all."""


class _Overrun(Exception):
    """Raised inside the render when a bound is passed; turned into one line by the caller."""


_SIZED = (str, bytes, list, tuple, dict, set, frozenset)
_CONTAINERS = (list, tuple, dict, set, frozenset)
# The rendered size of each container a render has sized, by id (the container is kept with it,
# so the id stays its own): a list repeated 16,000 times inside another is sized once.
_sizes: ContextVar[dict[int, tuple[Any, int]] | None] = ContextVar("chat_template_sizes", default=None)


def _size(value: Any, depth: int = 0) -> int:
    """About how many items ``str(value)`` writes: a string its characters, a container its items
    and, recursively, theirs (a container that appears twice counts twice). Past
    :data:`MAX_VALUE_ITEMS`, :class:`_Overrun`: ``[[0] * 16000] * 16000`` holds 16,000 items, but
    printing it writes 256 million."""
    if not isinstance(value, _CONTAINERS):
        return len(value) if isinstance(value, (str, bytes)) else 1
    sizes = _sizes.get()
    known = sizes.get(id(value)) if sizes is not None else None
    if known is not None and known[0] is value:
        return known[1]
    if depth > MAX_NESTING:
        raise _Overrun(f"nests values more than {MAX_NESTING} deep")
    total = len(value)
    for item in (*value.keys(), *value.values()) if isinstance(value, dict) else value:
        if isinstance(item, _SIZED):
            total += _size(item, depth + 1)
            if total > MAX_VALUE_ITEMS:
                raise _Overrun(f"computes a value of more than {MAX_VALUE_ITEMS:,} items")
    if sizes is not None:
        sizes[id(value)] = (value, total)
    return total


def _check_value(value: Any) -> Any:
    if isinstance(value, _SIZED) and _size(value) > MAX_VALUE_ITEMS:
        raise _Overrun(f"computes a value of {len(value):,} items (the bound is {MAX_VALUE_ITEMS:,})")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise _Overrun(f"computes an integer of {value.bit_length():,} bits (the bound is {MAX_INT_BITS})")
    return value


def _check_arguments(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """An integer argument is a width or a count: past the value bound, refused before the call."""
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (tuple, list)) and len(value) <= 64 else (value,)
        for item in items:
            if isinstance(item, int) and not isinstance(item, bool) and abs(item) > MAX_VALUE_ITEMS:
                raise _Overrun(f"passes {item:,} to a call (the bound is {MAX_VALUE_ITEMS:,})")
            _check_value(item)


def _bounded(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)  # keeps jinja's pass_context / pass_environment marks
    def call(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args, kwargs)
        return _check_value(function(*args, **kwargs))

    return call


def _bounded_join(join: Callable[[Any], str]) -> Callable[[Any], str]:
    def bounded(parts: Any) -> str:
        parts = tuple(parts)
        total = sum(_size(part) for part in parts)  # a list printed by the join counts as printed
        if total > MAX_VALUE_ITEMS:
            raise _Overrun(f"joins {total:,} characters (the bound is {MAX_VALUE_ITEMS:,})")
        return join(parts)

    return bounded


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with every operator, call and filter result bounded in size."""

    intercepted_binops = frozenset({"*", "**", "+", "%", "//", "/", "-"})
    concat = staticmethod(_bounded_join("".join))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (left, right))
        big = ints and operator == "**" and right > 0 and left not in (-1, 0, 1)
        if big and abs(left).bit_length() * min(right, MAX_INT_BITS + 1) > MAX_INT_BITS:
            raise _Overrun(f"raises {left} to the power {right} (the bound is {MAX_INT_BITS} bits)")
        if operator == "*":
            if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise _Overrun(f"multiplies integers past {MAX_INT_BITS} bits")
            for sequence, count in ((left, right), (right, left)):
                repeated = isinstance(sequence, (str, list, tuple)) and isinstance(count, int)
                if repeated and len(sequence) * max(count, 0) > MAX_VALUE_ITEMS:
                    raise _Overrun(f"repeats {len(sequence):,} items {count:,} times")
        if operator == "%":
            _check_arguments(right if isinstance(right, tuple) else (right,), {})
        return _check_value(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # jinja's signature
        _check_arguments(args, kwargs)
        return _check_value(super().call(__context, __obj, *args, **kwargs))


@functools.lru_cache(maxsize=1)
def _environment() -> BoundedSandbox:
    """A :class:`BoundedSandbox` with transformers' chat-template filters, globals and extensions
    (``tojson``, ``raise_exception``, ``strftime_now``, ``dict``, ``namespace``, ``generation``)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    theirs = _compile_jinja_template("").environment  # the one place transformers builds it
    environment = BoundedSandbox(
        trim_blocks=theirs.trim_blocks,
        lstrip_blocks=theirs.lstrip_blocks,
        extensions=[type(extension) for extension in theirs.extensions.values()],
    )
    environment.globals.update(theirs.globals)
    environment.globals["namespace"] = _bounded_namespace(theirs.globals["namespace"])
    environment.filters.update({name: _bounded(f) for name, f in theirs.filters.items()})
    environment.tests.update(theirs.tests)
    environment.finalize = _check_value  # every {{ }} value, before it is printed
    return environment


def _bounded_namespace(namespace: type) -> type:
    """transformers' ``namespace``, whose attributes (the only state a loop carries from one
    iteration to the next) are bounded as they are set: ``ns.l = [ns.l, ns.l]`` forty times
    would otherwise build a value whose printing, or comparison, runs in C for hours."""

    def set_bounded(self: Any, name: str, value: Any) -> None:
        namespace.__setitem__(self, name, _check_value(value))

    return type("BoundedNamespace", (namespace,), {"__setitem__": set_bounded})


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    environment = _environment()
    code = environment.compile(source, name=None, filename=_TEMPLATE_CODE)
    template = environment.template_class.from_code(environment, code, environment.make_globals(None))
    namespace = template.root_render_func.__globals__  # the compiled module's: its ``~`` joins
    for name in ("str_join", "markup_join"):
        namespace[name] = _bounded_join(namespace[name])
    return template


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`_Overrun` in the template's own frames once ``seconds`` have passed."""
    deadline = time.monotonic() + seconds

    def in_template(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and time.monotonic() > deadline:
            raise _Overrun(f"ran past {seconds:g} s")
        return in_template

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        return in_template if frame.f_code.co_filename == _TEMPLATE_CODE else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)


def template_file(folder: Path) -> Path:
    """The file of ``folder`` that holds its chat template, for messages."""
    for name in ("chat_template.jinja", "chat_template.json"):
        if (folder / name).is_file():
            return folder / name
    return folder / "tokenizer_config.json"


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    *,
    where: Path | str,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    seconds: float = MAX_RENDER_SECONDS,
) -> str:
    """``tokenizer``'s chat template applied to ``messages`` (``tokenize=False``), as transformers'
    ``apply_chat_template`` renders it, within the bounds above. ``where`` names the template's
    file in errors (:func:`template_file`)."""
    source = tokenizer.get_chat_template() if getattr(tokenizer, "chat_template", None) else None
    if not source:
        raise ChatTemplateError(f"{where}: the tokenizer has no chat template")
    if not isinstance(source, str) or len(source) > MAX_SOURCE_CHARS:
        size = len(source) if isinstance(source, str) else 0
        raise ChatTemplateError(
            f"{where}: the chat template is {size:,} characters, more than the {MAX_SOURCE_CHARS:,} a chat "
            "template needs: replace it"
        )
    chat = [{str(key): value for key, value in message.items()} for message in messages]
    if continue_final_message:  # transformers' render_jinja_template: tag the end of the text to continue
        if not chat or not isinstance(chat[-1].get("content"), str):
            raise ChatTemplateError(
                f"{where}: continue_final_message needs a final message with text content"
            )
        final = chat[-1]["content"]
        chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
    try:
        template = _compile(source)
        context = {
            **tokenizer.special_tokens_map,
            "messages": chat,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        pieces, size = [], 0
        sizes = _sizes.set({})
        try:
            with _deadline(seconds):
                for piece in template.generate(context):
                    size += len(piece)
                    if size > MAX_OUTPUT_CHARS:
                        raise _Overrun(f"renders more than {MAX_OUTPUT_CHARS:,} characters")
                    pieces.append(piece)
        finally:
            _sizes.reset(sizes)
        text = "".join(pieces)
    except _Overrun as exc:
        raise ChatTemplateError(f"{where}: the chat template {exc}: fix or replace the template") from None
    except MemoryError:
        raise ChatTemplateError(
            f"{where}: the chat template ran out of memory: fix or replace the template"
        ) from None
    except RecursionError:
        raise ChatTemplateError(
            f"{where}: the chat template nests too deeply: fix or replace the template"
        ) from None
    except (TemplateError, TypeError, ValueError, LookupError, ArithmeticError, AttributeError) as exc:
        raise ChatTemplateError(f"{where}: the chat template fails ({first_line(exc)})") from None
    if continue_final_message:
        if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise ChatTemplateError(
                f"{where}: continue_final_message: the chat template drops part of the final message"
            )
        at = text.rindex(_CONTINUE_TAG.strip())
        text = text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
