"""lm-eval model over our engines: ``pipeline-engine``, a ``TemplateLM`` (lm-evaluation-harness
0.4.13, ``lm_eval.api.model``) that runs an engine folder through the runtime
(``pipeline.runtime.Engine``; ``OrtModel.step`` for scoring, ``Engine.generate_ids`` for
generation). It knows nothing of how the engine was made.

Use it from Python (``simple_evaluate(model=EngineLM(engine=folder), ...)`` or
``model="pipeline-engine", model_args={"engine": folder}`` once this module is imported) or from
the command line, ``python -m evals.tasks --model pipeline-engine --model_args engine=<folder>
--tasks reasoning_rank_quick`` (see ``evals/tasks/__main__.py``).

``model_args``:

- ``engine`` (required): the engine folder (``engine.json``); anything else is a one-line
  ``EngineError``.
- ``threads``: ONNX Runtime intra-op threads (0: the engine's setting).
- ``batch_size``: rows per ``generate_until`` batch (left-padded; ``auto`` means 1). At 1,
  prompts are generated in token order, each on the KV cache of the prefix it shares with the
  one before (a few-shot task's worked examples run once). Scoring runs one context at a time:
  the context is run once and its KV cache shared by every candidate continuation, which is
  what multiple-choice ranking needs.
- ``chat``: wrap each request's context in the tokenizer's chat template as one user turn,
  so the continuation (ranking) or the generation starts the assistant turn. Default: off, raw
  prompts, lm-eval's convention for every model (its ``hf`` model templates only under
  ``--apply_chat_template``), so the same task gives the same log-likelihoods through
  ``--model hf`` and ``--model pipeline-engine``. With ``chat`` on, a continuation's leading
  whitespace is dropped (the answer opens the assistant turn; lm-eval does the same with
  ``--apply_chat_template``). Contexts that lm-eval already rendered with this model's
  ``apply_chat_template`` (``--apply_chat_template``) are never wrapped twice. The eval gate
  sets ``chat`` explicitly (``eval.chat``) and records it. ``loglikelihood_rolling``
  (perplexity) always scores raw text.
- ``max_length``: token limit (default and ceiling: the engine's ``max_length``).
- ``max_gen_toks``: default new-token limit for generation (a task's ``max_gen_toks`` wins).
- ``overflow``: ``error`` (default: a request longer than ``max_length`` stops the run with a
  one-line ``EngineError``) or ``truncate`` (keep the last tokens, as lm-eval's HF model does).
- ``prefill_chunk``: tokens a step when a scored context is prefilled (default 512; 0: one
  step). Long contexts prefill about twice as fast in chunks (``pipeline.runtime.generate``).
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models stay resolvable once ours is registered)
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from tqdm import tqdm

from pipeline.core.errors import EngineError, first_line
from pipeline.runtime import Engine, GenerationConfig
from pipeline.runtime.chat_template import render_chat, template_file
from pipeline.runtime.generate import PREFILL_CHUNK, common_prefix_length, prefill, prompt_step

MODEL_NAME = "pipeline-engine"
LM_EVAL_VERSION = "0.4.13"
OVERFLOW = ("error", "truncate")
# lm-eval passes these to every model; an engine decides its own device and batch sizing.
_IGNORED_ARGS = ("device", "max_batch_size", "trust_remote_code")


class _AllStopped(Exception):
    """Raised from the token callback once every row has hit a stop string or EOS."""


def _as_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise EngineError(f"model_args {name}={value!r}: use true or false")


def _as_int(value: Any, name: str, minimum: int = 0) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise EngineError(f"model_args {name}={value!r}: use an integer") from None
    if number < minimum:
        raise EngineError(f"model_args {name}={value!r}: must be at least {minimum}")
    return number


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any non-empty stop string."""
    cut = len(text)
    for stop in until:
        if stop and (index := text.find(stop)) != -1:
            cut = min(cut, index)
    return text[:cut]


@register_model(MODEL_NAME)
class EngineLM(TemplateLM):
    """An engine folder as an lm-eval model (see the module docstring for ``model_args``)."""

    backend = "causal"

    def __init__(
        self,
        engine: str | Path | None = None,
        threads: int | str = 0,
        batch_size: int | str | None = 1,
        chat: bool | str | None = None,
        max_length: int | str | None = None,
        max_gen_toks: int | str = 256,
        overflow: str = "error",
        prefill_chunk: int | str = PREFILL_CHUNK,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        unknown = sorted(set(kwargs) - set(_IGNORED_ARGS))
        if unknown:
            raise EngineError(
                f"{MODEL_NAME}: unknown model_args {', '.join(unknown)}; known: engine, threads, batch_size, "
                "chat, max_length, max_gen_toks, overflow, prefill_chunk"
            )
        if engine is None or str(engine).strip() == "":
            raise EngineError(f"{MODEL_NAME}: model_args needs engine=<engine folder>")
        self.engine = Engine(Path(str(engine)).expanduser(), threads=_as_int(threads, "threads"))
        try:
            self.tokenizer = self.engine.tokenizer
        except Exception as exc:  # transformers raises OSError, ValueError, ... with long messages
            raise EngineError(
                f"{self.engine.folder}: cannot load its tokenizer ({first_line(exc)})"
            ) from None
        self._batch_size = self._parse_batch_size(batch_size)
        self._max_length = self.engine.max_length
        if max_length not in (None, ""):
            limit = _as_int(max_length, "max_length", minimum=2)
            if limit > self.engine.max_length:
                raise EngineError(
                    f"model_args max_length={limit} exceeds the engine's max_length {self.engine.max_length}"
                )
            self._max_length = limit
        self.max_gen_toks = _as_int(max_gen_toks, "max_gen_toks", minimum=1)
        if overflow not in OVERFLOW:
            raise EngineError(f"model_args overflow={overflow!r}: use one of {', '.join(OVERFLOW)}")
        self.overflow = overflow
        self.prefill_chunk = _as_int(prefill_chunk, "prefill_chunk")
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        self.chat = False if chat in (None, "") else _as_bool(chat, "chat")
        if self.chat and not has_template:
            raise EngineError(f"{self.engine.folder}: chat=true but its tokenizer has no chat template")
        self._rendered: set[str] = set()  # contexts rendered by apply_chat_template (lm-eval's own)
        # Context tokens taken from the previous context's cache instead of run again (scoring).
        self.prefix_tokens_reused = 0

    # ------------------------------------------------------------------ properties
    @staticmethod
    def _parse_batch_size(value: int | str | None) -> int:
        if value in (None, "") or str(value).startswith("auto"):
            return 1
        return _as_int(value, "batch_size", minimum=1)

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def eot_token_id(self) -> int:
        if self.engine.eos_token_ids:
            return int(self.engine.eos_token_ids[0])
        if self.tokenizer.eos_token_id is None:
            raise EngineError(f"{self.engine.folder}: no end-of-sequence token in engine.json or tokenizer")
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is scored after: the tokenizer's BOS, else the end-of-text token,
        as lm-eval's ``hf`` model does (``TemplateLM``'s own default is the end-of-text token)."""
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records in ``results["config"]``."""
        return {
            "engine": str(self.engine.folder),
            "engine_target": self.engine.spec.get("target"),
            "max_length": self.max_length,
            "chat": self.chat,
            "overflow": self.overflow,
        }

    # ------------------------------------------------------------------ text handling
    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string``. Special tokens are added only when asked (as lm-eval's HF model
        does by default): a chat-templated text carries its own."""
        return list(self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"])

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render lm-eval's chat history (``--apply_chat_template``) with the tokenizer's template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise EngineError(
                f"{self.engine.folder}: its tokenizer has no chat template; drop --apply_chat_template"
            )
        text = render_chat(
            self.tokenizer,
            chat_history,
            where=template_file(self.engine.folder),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )
        self._rendered.add(text)
        return text

    def wrap(self, context: str) -> str:
        """The text the model sees for a request's context: one user turn up to the start of the
        assistant turn when ``chat`` is on (unless lm-eval already rendered it), else as is."""
        if not self.chat or context in self._rendered:
            return context
        return render_chat(
            self.tokenizer,
            [{"role": "user", "content": context}],
            where=template_file(self.engine.folder),
            add_generation_prompt=True,
        )

    # ------------------------------------------------------------------ scoring
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(log P(continuation | context), greedy)`` per request, split as lm-eval's ``hf`` model
        splits it (``TemplateLM._encode_pair``: the context's trailing whitespace moves to the
        continuation; an empty context is scored after ``prefix_token_id``). Under a chat template
        the continuation loses its leading whitespace, as lm-eval drops the target delimiter
        under ``--apply_chat_template``, and the newline that opens the assistant turn is scored
        with it, as there."""
        encoded = []
        for request in requests:
            context, continuation = request.args[:2]
            templated = context in self._rendered
            if self.chat and not templated:
                context, templated = self.wrap(context), True
            if templated:
                continuation = continuation.lstrip()
            if context == "":
                continuation_enc = self.tok_encode(continuation)
                if continuation_enc and continuation_enc[0] == self.prefix_token_id:
                    context_enc, continuation_enc = continuation_enc[:1], continuation_enc[1:]
                else:
                    context_enc = [self.prefix_token_id]
            else:
                context_enc, continuation_enc = self._encode_pair(context, continuation)
            encoded.append((request.args[:2], context_enc, continuation_enc))
        return self._loglikelihood_tokens(encoded, disable_tqdm=disable_tqdm)

    def _fit(self, tokens: list[int], n_continuation: int) -> list[int]:
        """``tokens`` (context + continuation) cut to ``max_length`` inputs, or an error."""
        if n_continuation > self.max_length:
            raise EngineError(
                f"a {n_continuation}-token continuation exceeds this model's max_length {self.max_length}"
            )
        if len(tokens) - 1 <= self.max_length:
            return tokens
        if self.overflow == "error":
            raise EngineError(
                f"a {len(tokens) - 1}-token request exceeds this model's max_length {self.max_length}: "
                "use a larger engine, a shorter task, or model_args overflow=truncate"
            )
        return tokens[-(self.max_length + 1) :]

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[Any, list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """Sum of the continuation's token log-probabilities and whether greedy decoding would
        produce it. Requests sharing a context share one forward pass over it: the context (less
        its last token) runs once, then each continuation runs on that cache. Contexts are taken
        in token order, so that neighbours share their longest common prefix (the schema block of
        tool_call items, a long_context haystack, a chat template's opening): the cache of the
        previous context is cut back to the shared prefix (``truncate_cache``) and only the rest
        of the new context runs on it. The result equals one forward over context + continuation
        (to float rounding: the same positions, split into chunks)."""
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        groups: dict[tuple[int, ...], list[tuple[int, list[int], list[int]]]] = defaultdict(list)
        for index, (_, context, continuation) in enumerate(requests):
            if not context:
                raise EngineError(
                    "a loglikelihood request has no context tokens (lm-eval gives the prefix token)"
                )
            if not continuation:
                results[index] = (0.0, True)
                continue
            tokens = self._fit(list(context) + list(continuation), len(continuation))
            start = len(tokens) - len(continuation) - 1  # the input position that predicts continuation[0]
            groups[tuple(tokens[:start])].append((index, tokens[start:-1], list(continuation)))
        model = self.engine.model
        bar = tqdm(
            total=len(requests),
            desc="Running loglikelihood requests",
            disable=disable_tqdm or self.rank != 0,
        )
        bar.update(len(requests) - sum(len(group) for group in groups.values()))
        previous: tuple[int, ...] = ()
        cache: Any = None
        for prefix, members in sorted(groups.items()):  # token order: neighbours share prefixes
            shared = common_prefix_length(previous, prefix)
            cache = self._cut(cache, shared) if shared else None
            if cache is None:  # nothing shared, or a cache that cannot be cut back
                shared, cache = 0, model.empty_cache(1)
            if len(prefix) > shared:
                cache = prefill(model, prefix[shared:], cache, start=shared, chunk=self.prefill_chunk)
            self.prefix_tokens_reused += shared
            previous = prefix
            for index, inputs, targets in members:
                ids = np.asarray(inputs, dtype=np.int64)[None]
                total = len(prefix) + len(inputs)
                logits, _ = prompt_step(
                    model,
                    ids,
                    np.ones((1, total), dtype=np.int64),
                    np.arange(len(prefix), total)[None],
                    cache,
                )
                logprobs = _log_softmax(logits[0])
                picked = logprobs[np.arange(len(targets)), targets]
                answer = (float(picked.sum()), bool((logprobs.argmax(-1) == np.asarray(targets)).all()))
                results[index] = answer
                key = requests[index][0]
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                bar.update(1)
        bar.close()
        return results  # type: ignore[return-value]

    def _cut(self, cache: Any, length: int) -> Any:
        """The cache of its first ``length`` positions, or None where the model cannot cut one
        back (a sliding-window buffer that evicts, a model without ``truncate_cache``)."""
        truncate = getattr(self.engine.model, "truncate_cache", None)
        if truncate is None:
            return None
        try:
            return truncate(cache, length)
        except EngineError:  # a sliding window overwrote what it would roll back to
            return None

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts (raw, no chat template), in disjoint windows of
        ``max_length`` tokens, each token predicted once (lm-eval's rolling windows)."""
        results = []
        for request in tqdm(
            requests, desc="Running loglikelihood_rolling requests", disable=disable_tqdm or self.rank != 0
        ):
            (text,) = request.args[:1]
            windows = [
                (None, *lm_utils.make_disjoint_window(window))
                for window in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            scores = self._loglikelihood_tokens(windows, disable_tqdm=True)
            total = float(sum(score for score, _ in scores))
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return results

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Generate for each request until one of its ``until`` strings, EOS or ``max_gen_toks``
        new tokens; the returned text stops before the stop string. Greedy unless the request
        asks for sampling (``do_sample`` / ``temperature``)."""
        results: list[str | None] = [None] * len(requests)
        batches: dict[str, list[tuple[int, str, list[int]]]] = defaultdict(list)
        for index, request in enumerate(requests):
            context, gen_kwargs = request.args[:2]
            key = json.dumps(gen_kwargs, sort_keys=True, default=str)
            batches[key].append((index, context, self.tok_encode(self.wrap(context))))
        bar = tqdm(
            total=len(requests),
            desc="Running generate_until requests",
            disable=disable_tqdm or self.rank != 0,
        )
        eos_text = self.tok_decode([self.eot_token_id]) or None
        for key, rows in batches.items():
            options = normalize_gen_kwargs(json.loads(key), default_max_gen_toks=self.max_gen_toks)
            until = [s for s in handle_stop_sequences(options.get("until"), eos_text) if s]
            new_tokens = int(options["max_gen_toks"])
            if new_tokens >= self.max_length:
                raise EngineError(
                    f"max_gen_toks={new_tokens} leaves no room for a prompt in {self.max_length}"
                )
            config = GenerationConfig(
                max_new_tokens=new_tokens,
                do_sample=bool(options.get("do_sample", False)),
                temperature=float(options.get("temperature") or 1.0),
                top_k=int(options.get("top_k") or 0),
                top_p=float(options.get("top_p") or 1.0),
                seed=options.get("seed"),
            )
            reuse = self._reuses_prefixes()
            # token order: neighbours share their longest prefix; else similar lengths batch together
            rows.sort(key=(lambda row: row[2]) if reuse else (lambda row: -len(row[2])))
            previous: list[int] = []
            cache: Any = None
            for start in range(0, len(rows), self.batch_size):
                batch = rows[start : start + self.batch_size]
                prompts = [self._fit_prompt(ids, new_tokens) for _, _, ids in batch]
                if reuse:
                    texts, previous, cache = self._generate_after_prefix(
                        prompts[0], config, until, previous, cache
                    )
                else:
                    texts = self._generate(prompts, config, until)
                for (index, context, _), text in zip(batch, texts, strict=True):
                    results[index] = text
                    self.cache_hook.add_partial("generate_until", (context, json.loads(key)), text)
                bar.update(len(batch))
        bar.close()
        return results  # type: ignore[return-value]

    def _fit_prompt(self, ids: list[int], new_tokens: int) -> list[int]:
        room = self.max_length - new_tokens
        if len(ids) <= room:
            return ids
        if self.overflow == "error":
            raise EngineError(
                f"a {len(ids)}-token prompt plus {new_tokens} new tokens exceeds this model's max_length "
                f"{self.max_length}: use a larger engine, lower max_gen_toks, or model_args overflow=truncate"
            )
        return ids[-room:]

    def _reuses_prefixes(self) -> bool:
        """Whether generation runs one prompt at a time on the cache of the previous prompt's
        shared prefix (the worked examples of a few-shot task, the schemas of tool_call items):
        batches of one, no draft model, and a model whose cache can be cut back."""
        model = self.engine.model
        return self.batch_size == 1 and self.engine.draft is None and hasattr(model, "truncate_cache")

    def _generate_after_prefix(
        self,
        prompt: list[int],
        config: GenerationConfig,
        until: Sequence[str],
        previous: list[int],
        cache: Any,
    ) -> tuple[list[str], list[int], Any]:
        """``_generate`` for one prompt whose prefix shared with ``previous`` (the prompt tokens
        that ``cache`` holds) is not run again: the cache is cut back to it and only the rest of
        the prompt is prefilled. Returns the text, and the prompt tokens and cache to hand to the
        next call. Equal to generating from scratch up to float rounding (the prompt in chunks)."""
        model = self.engine.model
        kept = len(prompt) - 1  # the last prompt token is fed by the generation's first step
        shared = min(common_prefix_length(previous, prompt), kept)
        cache = self._cut(cache, shared) if shared and cache is not None else None
        if cache is None:  # nothing shared, or a cache that cannot be cut back
            shared, cache = 0, model.empty_cache(1)
        if kept > shared:
            cache = prefill(model, prompt[shared:kept], cache, start=shared, chunk=self.prefill_chunk)
        self.prefix_tokens_reused += shared
        texts = self._generate([prompt[kept:]], config, until, cache=cache, past=kept)
        return texts, prompt[:kept], cache

    def _generate(
        self,
        prompts: list[list[int]],
        config: GenerationConfig,
        until: Sequence[str],
        cache: Any = None,
        past: int = 0,
    ) -> list[str]:
        """Texts generated for a batch of prompts, each cut at its first stop string. Decoding
        ends as soon as every row has stopped (EOS or a stop string). ``cache`` holding ``past``
        prompt positions: one prompt, its tokens after them."""
        tokens: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)

        def on_tokens(step_tokens: np.ndarray) -> None:
            for row, token in enumerate(step_tokens):
                if done[row]:
                    continue
                if token < 0:  # the runtime marks rows that ended with EOS
                    done[row] = True
                    continue
                tokens[row].append(int(token))
                if int(token) in self.engine.eos_token_ids or (
                    until and any(stop in self.tok_decode(tokens[row]) for stop in until)
                ):
                    done[row] = True
            if all(done):
                raise _AllStopped

        with contextlib.suppress(_AllStopped):
            self.engine.generate_ids(prompts, config, on_tokens, cache=cache, past=past)
        return [cut_at_stop(self.tok_decode(row), until) for row in tokens]
