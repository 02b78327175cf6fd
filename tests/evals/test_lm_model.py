"""The ``pipeline-engine`` lm-eval model on the tiny engine: scores checked against the
engine's own logits computed here, generation stopping, chat templating, ``simple_evaluate``
on our tasks with logged samples, and the command line (ours and lm-eval's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lm_eval import simple_evaluate
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

from evals.lm_model import MODEL_NAME, EngineLM, cut_at_stop
from evals.suites import item_hash, load_suite
from evals.tasks import TASKS_DIR, task_path
from pipeline.core.errors import EngineError

ROOT = Path(__file__).resolve().parents[2]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class Req:
    """What the model reads of an lm-eval ``Instance``."""

    def __init__(self, *args: Any) -> None:
        self.args = args


@pytest.fixture(scope="module")
def lm(tiny_engine: Any) -> EngineLM:
    return EngineLM(engine=str(tiny_engine.path))


@pytest.fixture(scope="module")
def chat_engine(tiny_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny engine with a ChatML template beside its tokenizer."""
    folder = tmp_path_factory.mktemp("chat") / "engine"
    shutil.copytree(tiny_engine.path, folder)
    (folder / "chat_template.jinja").write_text(CHATML)
    return folder


def direct_log_probs(lm: EngineLM, tokens: list[int]) -> np.ndarray:
    """log_softmax of the engine's logits over ``tokens`` in one forward from an empty cache."""
    model = lm.engine.model
    ids = np.asarray(tokens, dtype=np.int64)[None]
    logits, _ = model.step(ids, np.ones_like(ids), np.arange(len(tokens))[None], model.empty_cache(1))
    x = logits[0].astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def direct_score(lm: EngineLM, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    logp = direct_log_probs(lm, context + continuation)[len(context) - 1 : -1]
    picked = logp[np.arange(len(continuation)), continuation]
    return float(picked.sum()), bool((logp.argmax(-1) == continuation).all())


# ---------------------------------------------------------------------------- scoring


def test_loglikelihood_equals_direct_forward(lm: EngineLM) -> None:
    context = "The quick brown fox"
    continuations = [" jumps over the lazy dog", " counts one, two", " decodes tokens"]
    results = lm.loglikelihood([Req(context, c) for c in continuations], disable_tqdm=True)
    for continuation, (logprob, greedy) in zip(continuations, results, strict=True):
        ctx, cont = lm._encode_pair(context, continuation)
        expected, expected_greedy = direct_score(lm, ctx, cont)
        assert logprob == pytest.approx(expected, abs=1e-4)
        assert greedy == expected_greedy
        assert logprob < 0


def test_long_contexts_prefill_in_chunks_and_score_as_one_forward(
    tiny_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prefill_chunk=5: no step runs more than 5 context tokens, and every score equals the
    one-step prefill's (prefill_chunk=0) and the direct forward's, to float rounding."""
    context = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    requests = [Req(context, c) for c in (" fifteen", " sixteen seventeen", " zero")]
    chunked = EngineLM(engine=str(tiny_engine.path), prefill_chunk=5)
    whole = EngineLM(engine=str(tiny_engine.path), prefill_chunk="0")
    widths: list[int] = []
    step = chunked.engine.model.step

    def recording(ids: Any, *args: Any) -> Any:
        widths.append(ids.shape[1])
        return step(ids, *args)

    monkeypatch.setattr(chunked.engine.model, "step", recording)
    scores = chunked.loglikelihood(requests, disable_tqdm=True)
    context_tokens = len(chunked._encode_pair(*requests[0].args)[0])
    assert context_tokens > 10 and max(widths[:-3]) == 5  # the context in chunks, then 3 continuations
    assert sum(widths[:-3]) == context_tokens - 1  # its last token is fed with each continuation
    one_step = whole.loglikelihood(requests, disable_tqdm=True)
    assert [a for a, _ in scores] == pytest.approx([a for a, _ in one_step], abs=1e-4)
    for request, (logprob, greedy) in zip(requests, scores, strict=True):
        expected, expected_greedy = direct_score(whole, *whole._encode_pair(*request.args))
        assert logprob == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy
    with pytest.raises(EngineError, match="prefill_chunk"):
        EngineLM(engine=str(tiny_engine.path), prefill_chunk="-1")


def test_contexts_sharing_a_prefix_run_it_once_and_score_as_one_forward(
    lm: EngineLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    header = "Tools: search(query), weather(city), calendar(date). Answer with one call.\n"
    questions = ["Rain in Paris?", "Meetings on Monday?", "Who wrote Dune?", "Rain in Oslo?"]
    requests = [Req(header + q, answer) for q in questions for answer in (" weather", " search")]
    requests.append(Req("An unrelated context", " x"))
    before = lm.prefix_tokens_reused
    scores = lm.loglikelihood(requests, disable_tqdm=True)
    assert lm.prefix_tokens_reused - before >= 3 * len(lm.tok_encode(header)) - 3  # 3 of 4 reuse it
    for request, (logprob, greedy) in zip(requests, scores, strict=True):
        expected, expected_greedy = direct_score(lm, *lm._encode_pair(*request.args))
        assert logprob == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy

    # A cache that cannot be cut back (a sliding window that evicts) scores every context afresh.
    def refuse(cache: Any, length: int) -> Any:
        raise EngineError("a sliding-window KV buffer cannot be rolled back")

    monkeypatch.setattr(lm.engine.model, "truncate_cache", refuse)
    before = lm.prefix_tokens_reused
    afresh = lm.loglikelihood(requests, disable_tqdm=True)
    assert [a for a, _ in afresh] == pytest.approx([a for a, _ in scores], abs=1e-4)
    assert [g for _, g in afresh] == [g for _, g in scores] and lm.prefix_tokens_reused == before


def test_greedy_flag(lm: EngineLM) -> None:
    context = lm.tok_encode("Once upon a time")
    greedy = []
    for _ in range(3):  # the argmax continuation, one token at a time
        greedy.append(int(direct_log_probs(lm, context + greedy)[-1].argmax()))
    other = list(greedy)
    other[1] = (greedy[1] + 1) % lm.engine.io.vocab_size
    (lp_greedy, flag_greedy), (lp_other, flag_other) = lm._loglikelihood_tokens(
        [(None, context, greedy), (None, context, other)], disable_tqdm=True
    )
    assert flag_greedy is True and flag_other is False
    assert lp_greedy == pytest.approx(direct_score(lm, context, greedy)[0], abs=1e-4)
    assert lp_other == pytest.approx(direct_score(lm, context, other)[0], abs=1e-4)
    assert lp_greedy > lp_other


def test_loglikelihood_rolling(tiny_engine: Any, lm: EngineLM) -> None:
    text = "Engines decode tokens one by one, and the cache keeps keys and values."
    tokens = lm.tok_encode(text)
    logp = direct_log_probs(lm, [lm.prefix_token_id, *tokens])[:-1]
    expected = float(logp[np.arange(len(tokens)), tokens].sum())
    assert lm.loglikelihood_rolling([Req(text)], disable_tqdm=True)[0] == pytest.approx(expected, abs=1e-4)
    # Windows of 16 tokens: every token still predicted once, with less context.
    windowed = EngineLM(engine=str(tiny_engine.path), max_length=16)
    score = windowed.loglikelihood_rolling([Req(text * 3)], disable_tqdm=True)[0]
    assert len(lm.tok_encode(text * 3)) > 16 and np.isfinite(score) and score < 0


def test_overflow_is_an_error_or_truncated(tiny_engine: Any, lm: EngineLM) -> None:
    long_text = "one two three four five " * 60
    with pytest.raises(EngineError, match="exceeds this model's max_length 256") as error:
        lm.loglikelihood([Req(long_text, " six")], disable_tqdm=True)
    assert "\n" not in str(error.value)
    truncating = EngineLM(engine=str(tiny_engine.path), overflow="truncate")
    ((logprob, _),) = truncating.loglikelihood([Req(long_text, " six")], disable_tqdm=True)
    ctx, cont = lm._encode_pair(long_text, " six")
    tokens = (ctx + cont)[-257:]
    assert logprob == pytest.approx(direct_score(lm, tokens[: -len(cont)], cont)[0], abs=1e-4)
    with pytest.raises(EngineError, match="prompt plus 8 new tokens"):
        lm.generate_until([Req(long_text, {"until": [], "max_gen_toks": 8})], disable_tqdm=True)


# ---------------------------------------------------------------------------- generation


class ScriptedModel:
    """A step model whose greedy choice at call ``k`` is ``script[k]`` (every row)."""

    def __init__(self, script: list[int], vocab: int) -> None:
        self.script, self.vocab, self.calls = script, vocab, 0

    def empty_cache(self, batch: int) -> None:
        return None

    def step(self, input_ids: np.ndarray, *_: Any) -> tuple[np.ndarray, None]:
        logits = np.zeros((*input_ids.shape, self.vocab), dtype=np.float32)
        logits[:, -1, self.script[min(self.calls, len(self.script) - 1)]] = 1.0
        self.calls += 1
        return logits, None


def test_generate_until_stops_at_until(tiny_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    lm = EngineLM(engine=str(tiny_engine.path))
    script = lm.tok_encode("one, two. three, four. five")
    model = ScriptedModel(script, lm.engine.io.vocab_size)
    monkeypatch.setattr(lm.engine, "model", model)
    request = {"until": ["."], "max_gen_toks": 40}
    assert lm.generate_until([Req("count:", request)], disable_tqdm=True) == ["one, two"]
    # Decoding ended at the token that completed the stop string, not at max_gen_toks.
    assert model.calls == len(lm.tok_encode("one, two."))
    model.calls = 0
    two_stops = {"until": ["four", ", t"], "max_gen_toks": 40}
    assert lm.generate_until([Req("count:", two_stops)], disable_tqdm=True) == ["one"]
    model.calls = 0
    no_stop = {"until": [], "max_gen_toks": 5}
    assert lm.generate_until([Req("count:", no_stop)], disable_tqdm=True) == [lm.tok_decode(script[:5])]
    assert model.calls == 5


def test_generate_until_on_the_engine(tiny_engine: Any, lm: EngineLM) -> None:
    prompts = ["The quick brown fox", "Once upon a time, there was"]
    free = lm.generate_until([Req(p, {"until": [], "max_gen_toks": 12}) for p in prompts], disable_tqdm=True)
    assert all(isinstance(text, str) for text in free)
    stop = free[0][2:4]
    stopped = lm.generate_until([Req(prompts[0], {"until": [stop], "max_gen_toks": 12})], disable_tqdm=True)
    assert stopped == [cut_at_stop(free[0], [stop])]
    batched = EngineLM(engine=str(tiny_engine.path), batch_size=2)
    assert (
        batched.generate_until(
            [Req(p, {"until": [], "max_gen_toks": 12}) for p in prompts], disable_tqdm=True
        )
        == free
    )


def test_generation_reuses_the_shared_prefix_and_generates_as_from_scratch(
    tiny_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts that share a prefix (a few-shot task's worked examples) prefill it once; each
    generates what it would from an empty cache."""
    shared = "Examples: the quick brown fox jumps over the lazy dog. Then: "
    prompts = [shared + tail for tail in ("one", "two three", "one more", "zebra")] + ["unrelated"]
    requests = [Req(p, {"until": [], "max_gen_toks": 10}) for p in prompts]
    lm = EngineLM(engine=str(tiny_engine.path))
    assert lm._reuses_prefixes()
    reused = lm.generate_until(requests, disable_tqdm=True)
    assert lm.prefix_tokens_reused >= 3 * len(lm.tok_encode(shared)) - 3
    monkeypatch.setattr(EngineLM, "_reuses_prefixes", lambda self: False)
    scratch = EngineLM(engine=str(tiny_engine.path))
    assert scratch.generate_until(requests, disable_tqdm=True) == reused
    assert scratch.prefix_tokens_reused == 0


def test_log_likelihoods_match_lm_evals_hf_model_on_the_same_checkpoint(
    lm: EngineLM, chat_engine: Path, tiny_llama: Path
) -> None:
    """lm-eval's own ``hf`` model on the checkpoint the tiny engine was exported from: the same
    requests give the same log-likelihoods and greedy flags, by default (raw prompts) and under
    the chat template (ours with chat=true, hf with lm-eval's rendering)."""
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=str(tiny_llama), dtype="float32", device="cpu", batch_size=1)
    requests = [Req("The quick brown fox", " jumps over"), Req("1 2 3", " 4"), Req("", "hello world")]
    ours = lm.loglikelihood(requests, disable_tqdm=True)
    theirs = hf.loglikelihood(requests, disable_tqdm=True)
    for (mine, greedy), (reference, hf_greedy) in zip(ours, theirs, strict=True):
        assert mine == pytest.approx(reference, abs=1e-3) and greedy == hf_greedy
    # The chat convention: lm-eval renders the turn with hf's template, we wrap it ourselves.
    hf.tokenizer.chat_template = CHATML
    rendered = hf.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}])
    chat = EngineLM(engine=str(chat_engine), chat=True)
    ((wrapped, _),) = chat.loglikelihood([Req("What is 2 + 2?", " 4")], disable_tqdm=True)
    ((hf_templated, _),) = hf.loglikelihood([Req(rendered, "4")], disable_tqdm=True)
    assert wrapped == pytest.approx(hf_templated, abs=1e-3)


# ---------------------------------------------------------------------------- chat template


def test_chat_template_wraps_context(chat_engine: Path, tiny_engine: Any) -> None:
    assert EngineLM(engine=str(chat_engine)).chat is False  # lm-eval's convention: raw unless asked
    chat = EngineLM(engine=str(chat_engine), chat="true")
    assert chat.chat is True
    wrapped = chat.wrap("What is 2 + 2?")
    assert wrapped == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    ((logprob, _),) = chat.loglikelihood([Req("What is 2 + 2?", " 4")], disable_tqdm=True)
    # lm-eval's split: the newline opening the assistant turn is scored with the answer
    ctx = chat.tok_encode(wrapped.removesuffix("\n"))
    cont = chat.tok_encode(wrapped + "4")[len(ctx) :]
    assert logprob == pytest.approx(direct_score(chat, ctx, cont)[0], abs=1e-4)
    # A context lm-eval rendered with our apply_chat_template is not wrapped again.
    rendered = chat.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}])
    assert rendered == wrapped
    assert chat.loglikelihood([Req(rendered, "4")], disable_tqdm=True)[0][0] == pytest.approx(logprob)
    raw = EngineLM(engine=str(chat_engine), chat="false")
    assert raw.chat is False and raw.wrap("x") == "x"
    # No template: raw prompts, and asking for one is a one-line error.
    assert EngineLM(engine=str(tiny_engine.path)).chat is False
    with pytest.raises(EngineError, match="no chat template"):
        EngineLM(engine=str(tiny_engine.path), chat=True)


def test_bad_model_args_are_one_line_errors(tmp_path: Path, tiny_engine: Any) -> None:
    cases = [
        ({"engine": str(tmp_path)}, "is not an engine folder"),
        ({}, "needs engine="),
        ({"engine": str(tiny_engine.path), "bogus": 1}, "unknown model_args bogus"),
        ({"engine": str(tiny_engine.path), "overflow": "wrap"}, "overflow='wrap'"),
        ({"engine": str(tiny_engine.path), "max_length": 4096}, "exceeds the engine's max_length 256"),
    ]
    for args, message in cases:
        with pytest.raises(EngineError, match=message) as error:
            EngineLM(**args)
        assert "\n" not in str(error.value)
    assert get_model(MODEL_NAME) is EngineLM
    assert get_model("hf").__name__ == "HFLM"  # lm-eval's own models still resolve


# ---------------------------------------------------------------------------- lm-eval end to end


def test_simple_evaluate_logs_ids_and_hashes(lm: EngineLM) -> None:
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    results = simple_evaluate(
        model=lm,
        tasks=["reasoning_rank_quick", "reasoning_gen_quick"],
        limit=4,
        log_samples=True,
        task_manager=manager,
        gen_kwargs={"max_gen_toks": 8},
        bootstrap_iters=0,
    )
    items = load_suite("reasoning", "quick")[:4]
    for task, metrics in (("reasoning_rank_quick", {"acc", "acc_norm"}), ("reasoning_gen_quick", {"acc"})):
        samples = results["samples"][task]
        assert [s["doc"]["id"] for s in samples] == [item.id for item in items]
        assert [s["doc"]["hash"] for s in samples] == [item_hash(item) for item in items]
        assert [s["doc_id"] for s in samples] == [0, 1, 2, 3]
        for sample in samples:
            assert metrics <= set(sample) and all(sample[m] in (0.0, 1.0) for m in metrics)
        assert {f"{m},none" for m in metrics} <= set(results["results"][task])
    ranked = results["samples"]["reasoning_rank_quick"][0]
    assert len(ranked["resps"]) == len(items[0].choices)  # one log-likelihood per candidate


@dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr: str
    out: Path


@pytest.fixture(scope="module")
def cli_runs(tiny_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, CliRun]:
    """The command lines under test, started together (each spends most of its time indexing
    lm-eval's own tasks) from a directory that is not the repository."""
    cwd = tmp_path_factory.mktemp("cli")
    lm_eval_cli = Path(sys.executable).with_name("lm_eval")
    lm_eval_command = [str(lm_eval_cli)] if lm_eval_cli.exists() else [sys.executable, "-m", "lm_eval"]
    ours = [sys.executable, "-m", "evals.tasks", "--model", MODEL_NAME]
    commands = {
        "ours": [*ours, "--model_args", f"engine={tiny_engine.path}", "--tasks", "reasoning_rank_quick",
                 "--limit", "2", "--log_samples", "--output_path", str(cwd / "ours")],
        "not_an_engine": [*ours, "--model_args", f"engine={cwd}", "--tasks", "reasoning_rank_quick",
                          "--limit", "2"],
        "lm_eval": [*lm_eval_command, "--model", MODEL_NAME, "--model_args", f"engine={tiny_engine.path}",
                    "--tasks", str(task_path("reasoning_gen_quick")), "--limit", "2",
                    "--gen_kwargs", "max_gen_toks=4", "--log_samples", "--output_path", str(cwd / "lm_eval")],
    }  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    started = {
        name: subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, command in commands.items()
    }
    runs = {}
    for name, process in started.items():
        try:
            stdout, stderr = process.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        runs[name] = CliRun(process.returncode, stdout, stderr, cwd / name)
    return runs


def read_samples(folder: Path, task: str) -> list[dict[str, Any]]:
    (path,) = folder.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_command_line(cli_runs: dict[str, CliRun]) -> None:
    """``python -m evals.tasks`` with task names, from a directory that is not the repository."""
    done = cli_runs["ours"]
    assert done.returncode == 0, done.stderr[-2000:]
    assert "reasoning_rank_quick" in done.stdout
    samples = read_samples(done.out, "reasoning_rank_quick")
    assert [s["doc"]["id"] for s in samples] == [item.id for item in load_suite("reasoning", "quick")[:2]]


def test_command_line_not_an_engine(cli_runs: dict[str, CliRun]) -> None:
    bad = cli_runs["not_an_engine"]
    folder = bad.out.parent
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        f"error: {folder} is not an engine folder (no engine.json): build one first"
    )
    assert "Traceback" not in bad.stderr


def test_lm_eval_command_with_task_file(cli_runs: dict[str, CliRun]) -> None:
    """lm-eval's own command finds the model when a task is given as one of our YAML files."""
    done = cli_runs["lm_eval"]
    assert done.returncode == 0, done.stderr[-2000:]
    samples = read_samples(done.out, "reasoning_gen_quick")
    assert [s["doc"]["hash"] for s in samples] == [item_hash(i) for i in load_suite("reasoning", "quick")[:2]]
