"""A chat template renders as transformers renders it, and within bounds on time, size and
output (issue 50, item 4): past them, one line naming the template's file."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.core.errors import PipelineError
from pipeline.runtime import chat_template
from pipeline.runtime.chat_template import ChatTemplateError, render_chat, template_file

# Real templates' forms, each trimmed to what it exercises: ChatML with a default system turn
# (SmolLM2, Qwen2.5), Llama 3.1 (bos_token, namespace, strftime_now, tojson, raise_exception),
# Gemma (role alternation checked with raise_exception, loop.index0, trim), Mistral ([INST]).
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{- bos_token }}{%- set ns = namespace(system='') %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set ns.system = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{{- 'Today Date: ' + strftime_now('%d %b %Y')[:0] + ns.system + '<|eot_id|>' }}"
    "{%- for message in messages %}{%- if message['role'] not in ['user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' ~ message['role']|tojson) }}{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA, "mistral": MISTRAL}
HISTORIES = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue"},
        {"role": "user", "content": "Another one, please."},
    ],
]
# Each is refused by one bound: (template, what the error says).
RUNAWAY = {
    "nested ranges": (
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
        "ran past",
    ),
    "nested loops over strings": (
        "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "ran past",
    ),
    "repeated string": ("{{ 'x' * 10000000000 }}", "repeats"),
    "repeated list": ("{{ ([1] * 100000000)|length }}", "repeats"),
    "center filter": ("{{ 'x'|center(10000000000) }}", "passes"),
    "ljust method": ("{{ 'x'.ljust(10000000000) }}", "passes"),
    "huge power": ("{{ 10 ** 1000000000 }}", "power"),
    "squared in a loop": (
        "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
        "bits",
    ),
    "doubling join": (
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "joins",
    ),
    "doubling plus": (
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "items",
    ),
    "percent width": ("{{ '%*d' % (10000000000, 1) }}", "passes"),
    "a list printed as 256 million items": ("{{ [[0] * 16000] * 16000 }}", "more than 16,777,216 items"),
    "doubling a namespace list": (
        "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
        "{{ ns.l|length }}",
        "more than 16,777,216 items",
    ),
    "comparing two doubled lists": (
        "{% set ns = namespace(a=[1], b=[1]) %}{% for i in range(40) %}{% set ns.a = [ns.a, ns.a] %}"
        "{% set ns.b = [ns.b, ns.b] %}{% endfor %}{{ ns.a == ns.b }}",
        "items",
    ),
    "doubling through a macro": (
        "{% macro f(x, n) %}{% if n > 0 %}{{ f([x, x], n - 1) }}{% else %}{{ x|length }}{% endif %}"
        "{% endmacro %}{{ f([1], 40) }}",
        "items",
    ),
    "long output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "renders more than"),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def with_template(tokenizer: Any, source: str) -> Any:
    tokenizer.chat_template = source
    return tokenizer


def in_thread(call: Any, limit: float) -> Any:
    """``call()``'s result or exception, failing the test if it runs past ``limit`` seconds
    (a daemon thread: a hang without the bounds fails here instead of stalling the suite)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the test
            outcome["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    start = time.monotonic()
    worker.start()
    worker.join(limit)
    assert not worker.is_alive(), f"still rendering after {limit} s"
    outcome["seconds"] = time.monotonic() - start
    return outcome


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("history", range(len(HISTORIES)))
def test_renders_as_transformers_renders(tokenizer: Any, name: str, history: int) -> None:
    tok = with_template(tokenizer, TEMPLATES[name])
    messages = HISTORIES[history]
    if name == "gemma" and messages[0]["role"] == "system":
        with pytest.raises(ChatTemplateError, match=r"^x: the chat template fails \(Conversation roles must"):
            render_chat(tok, messages, where="x", add_generation_prompt=True)
        return
    for add in (True, False):
        ours = render_chat(tok, messages, where="x", add_generation_prompt=add)
        assert ours == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
    if messages[-1]["role"] == "user" and name != "gemma":  # continue the last turn, as lm-eval asks
        ours = render_chat(tok, messages, where="x", continue_final_message=True)
        theirs = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
        assert ours == theirs


@pytest.mark.parametrize("case", sorted(RUNAWAY))
def test_a_runaway_template_is_one_line_naming_its_file(tokenizer: Any, case: str) -> None:
    source, says = RUNAWAY[case]
    tok = with_template(tokenizer, source)
    where = "/e/chat_template.jinja"
    outcome = in_thread(lambda: render_chat(tok, HISTORIES[0], where=where, seconds=1.0), 20)
    error = outcome.get("error")
    assert isinstance(error, ChatTemplateError) and isinstance(error, PipelineError), outcome
    message = str(error)
    assert "\n" not in message and message.startswith("/e/chat_template.jinja: the chat template ")
    assert says in message and message.endswith("fix or replace the template")


def test_the_time_bound_holds_at_its_default(tokenizer: Any) -> None:
    tok = with_template(tokenizer, RUNAWAY["nested ranges"][0])
    outcome = in_thread(lambda: render_chat(tok, HISTORIES[0], where="f"), 30)
    assert isinstance(outcome.get("error"), ChatTemplateError)
    assert chat_template.MAX_RENDER_SECONDS <= outcome["seconds"] < chat_template.MAX_RENDER_SECONDS + 5


def test_the_bounds_leave_the_rest_of_the_process_untraced(tokenizer: Any) -> None:
    import sys

    def tracer(*_: Any) -> None:
        return None

    sys.settrace(tracer)
    try:
        render_chat(with_template(tokenizer, CHATML), HISTORIES[0], where="x")
        assert sys.gettrace() is tracer  # a caller's tracer (a debugger, coverage) is put back
    finally:
        sys.settrace(None)


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("{% for m in messages %}", "fails (Unexpected end of template"),
        ("{{ raise_exception('no system role') }}", "fails (no system role)"),
        ("{{ messages.__class__.__mro__ }}", "fails"),  # the sandbox's own refusal
        ("{{ 1 // 0 }}", "fails (integer division or modulo by zero)"),
        ("{% if 1 %}" * 3000 + "{% endif %}" * 3000, ""),
    ],
)
def test_a_broken_template_is_one_line(tokenizer: Any, source: str, says: str) -> None:
    tok = with_template(tokenizer, source)
    try:
        render_chat(tok, HISTORIES[0], where="t.json")
    except ChatTemplateError as exc:
        assert str(exc).startswith("t.json: ") and says in str(exc) and "\n" not in str(exc)
    else:
        assert source.startswith("{% if 1 %}")  # deep but renderable: nothing to refuse


def test_a_template_too_long_for_a_chat_template_is_refused(tokenizer: Any) -> None:
    tok = with_template(tokenizer, "x" * (chat_template.MAX_SOURCE_CHARS + 1))
    with pytest.raises(ChatTemplateError, match=r"^t: the chat template is 1,048,577 characters"):
        render_chat(tok, HISTORIES[0], where="t")


PIECES = st.sampled_from(
    [
        "{{ 'ab' * N }}",
        "{% for i in range(N) %}X{% endfor %}",
        "{{ 'x'|center(N) }}",
        "{{ N ** N }}",
        "{{ (messages|tojson) * N }}",
        "{% for i in range(N) %}{% for j in range(N) %}{% endfor %}{% endfor %}",
        "{{ messages[0]['content'] ~ bos_token }}",
        "{{ '%s' % N }}",
        "{{ [N] * N }}",
    ]
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(PIECES, st.integers(0, 10**12)), min_size=1, max_size=4))
def test_any_template_renders_or_is_one_line_in_bounded_time(tokenizer: Any, parts: list[Any]) -> None:
    source = "".join(piece.replace("N", str(n)) for piece, n in parts)
    tok = with_template(tokenizer, source)
    outcome = in_thread(lambda: render_chat(tok, HISTORIES[0], where="w", seconds=0.5), 15)
    if "error" in outcome:
        assert isinstance(outcome["error"], ChatTemplateError), outcome
        assert "\n" not in str(outcome["error"])
    else:
        assert len(outcome["value"]) <= chat_template.MAX_OUTPUT_CHARS


def test_template_file_names_where_the_template_lies(tmp_path: Path) -> None:
    assert template_file(tmp_path) == tmp_path / "tokenizer_config.json"
    (tmp_path / "chat_template.jinja").write_text("{{ 1 }}")
    assert template_file(tmp_path) == tmp_path / "chat_template.jinja"


def test_the_engine_and_the_gates_model_refuse_a_runaway_template(tiny_engine: Any, tmp_path: Path) -> None:
    """The issue's case: an engine folder whose chat_template.jinja nests two range(100000)
    loops. Generation with chat=true and the gate's lm-eval model stop within the bound."""
    from evals.lm_model import EngineLM
    from pipeline.runtime import Engine

    folder = tmp_path / "engine"
    shutil.copytree(tiny_engine.path, folder)
    (folder / "chat_template.jinja").write_text(RUNAWAY["nested ranges"][0])
    engine = Engine(folder)
    outcome = in_thread(lambda: engine.generate(["hi"], chat=True), 30)
    assert isinstance(outcome.get("error"), ChatTemplateError), outcome
    assert str(outcome["error"]).startswith(f"{folder / 'chat_template.jinja'}: the chat template ran past")
    model = EngineLM(engine=str(folder), chat=True)
    outcome = in_thread(lambda: model.wrap("What is 2 + 2?"), 30)
    assert isinstance(outcome.get("error"), ChatTemplateError), outcome
