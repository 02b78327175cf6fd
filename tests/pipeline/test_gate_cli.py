"""``python -m pipeline.gate`` before it scores anything: every user mistake is one ``error:``
line with exit code 2 (an eval config that does not exist, out-of-range or unknown ``--set``
values, a folder without a manifest), and an engine folder that no longer matches its run's
manifest (a file modified, added, removed, or a symlink leading out) is refused by name. The
engines here are never run: every refusal comes before scoring."""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.core.artifacts import folder_digest, write_json
from pipeline.core.errors import EngineError, PipelineError
from pipeline.gate import earlier_report, kept_rules, load_eval_config, main, resolve_engine
from pipeline.manifest import engine_files
from tests.pipeline.registry.conftest import engine_spec, tiny_graph_bytes


@pytest.fixture(autouse=True)
def _keep_sigterm() -> Iterator[None]:
    """``main`` makes SIGTERM raise in this process; put pytest's handler back afterwards."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


def make_engine_run(folder: Path, seed: int = 0) -> Path:
    """A run folder: ``engine/`` (a valid engine.json, a real ONNX graph, a tokenizer) and its manifest."""
    engine = folder / "engine"
    (engine / "sub").mkdir(parents=True)
    write_json(engine / "engine.json", engine_spec())
    (engine / "model.onnx").write_bytes(tiny_graph_bytes(bytes([seed]) * 1000))
    (engine / "tokenizer.json").write_text('{"vocab": {}}\n')
    (engine / "sub" / "weights.bin").write_bytes(b"w" * 100)
    manifest = {"engine": {"path": "engine", "target": "ort-cpu", "files": engine_files(engine)}}
    write_json(folder / "manifest.json", manifest)
    return folder


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    return make_engine_run(tmp_path / "base"), make_engine_run(tmp_path / "cand", seed=1)


def _gate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_matching_engine_folder_is_accepted_with_its_digest(runs: tuple[Path, Path]) -> None:
    base, _ = runs
    for folder in (base, base / "engine"):
        artifact, manifest = resolve_engine(folder, "baseline")
        assert artifact.path == base / "engine" and artifact.digest == folder_digest(base / "engine")
        assert manifest["engine"]["target"] == "ort-cpu"


def _outside_symlink(engine: Path) -> None:
    target = engine.parent.parent / "secret.bin"
    target.write_bytes((engine / "model.onnx").read_bytes())  # even the same bytes
    (engine / "model.onnx").unlink()
    (engine / "model.onnx").symlink_to(target)


ENGINE_CHANGES: list[tuple[str, Callable[[Path], Any], str]] = [
    ("modified", lambda e: (e / "model.onnx").write_bytes(b"\x07" * 1000), "model.onnx changed since"),
    ("grown", lambda e: (e / "sub" / "weights.bin").write_bytes(b"w" * 101), "weights.bin changed since"),
    ("added", lambda e: (e / "extra.onnx").write_bytes(b"x"), "extra.onnx is not listed in"),
    ("removed", lambda e: (e / "sub" / "weights.bin").unlink(), "weights.bin is missing"),
    ("symlink out", _outside_symlink, "model.onnx leads out of the engine folder"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "change", "needle"), ENGINE_CHANGES, ids=[c[0] for c in ENGINE_CHANGES])
def test_an_engine_folder_that_no_longer_matches_its_manifest_is_one_line(
    runs: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
    case: str,
    change: Callable[[Path], Any],
    needle: str,
) -> None:
    base, cand = runs
    change(cand / "engine")
    with pytest.raises(EngineError, match=needle):
        resolve_engine(cand, "candidate")
    code, err = _gate(capsys, "--baseline", str(base), "--candidate", str(cand), "--eval", "quick")
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --candidate") and needle in err[0], err


@pytest.mark.parametrize(
    ("manifest", "needle"),
    [
        ("{oops", "is unreadable"),
        ("[1]", "records no engine"),
        ('{"engine": 5}', "records no engine"),
        ('{"engine": {"files": "x"}}', "lists no engine files"),
        ('{"engine": {"files": [{"path": "../x", "sha256": "0", "bytes": 1}]}}', "leaves the engine folder"),
    ],
)
def test_a_malformed_manifest_is_one_line(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], manifest: str, needle: str
) -> None:
    base, cand = runs
    (cand / "manifest.json").write_text(manifest)
    code, err = _gate(capsys, "--baseline", str(base), "--candidate", str(cand), "--eval", "quick")
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --candidate") and needle in err[0], err


def test_a_folder_without_a_manifest_or_engine_is_one_line(
    runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, cand = runs
    (cand / "manifest.json").unlink()
    code, err = _gate(capsys, "--baseline", str(base), "--candidate", str(cand), "--eval", "quick")
    assert code == 2 and len(err) == 1 and "no manifest.json beside it" in err[0], err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = _gate(capsys, "--baseline", str(empty), "--candidate", str(base), "--eval", "quick")
    assert code == 2 and len(err) == 1 and "not an engine folder" in err[0], err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--eval", "fulll"], "--eval fulll: no such eval config; choose one of full, quick"),
        (["--eval", "none"], "--eval none: no such eval config"),
        (["--eval", "../eval/quick"], "no such eval config"),
        (["--set", "confidence=1.5"], "confidence"),
        (["--set", "confidence=0"], "confidence"),
        (["--set", "resamples=-1"], "resamples"),
        (["--set", "resamples=0"], "resamples"),
        (["--set", "limit=0"], "limit"),
        (["--set", "threads=-2"], "threads"),
        (["--set", "drift.bits8.max_kl=-0.1"], "eval.drift.bits8.max_kl=-0.1"),
        (["--set", "family=bits3"], "eval.family=bits3: no such recipe family"),
        (["--set", "confidance=0.9"], "confidance"),
        (["--set", "resamples=many"], "resamples"),
        (["--set", "limit"], "--set 'limit': write KEY=VALUE"),
        (["--set", "suites=[maths]"], "unknown suite 'maths'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        # every --set is kept and each KEY=VALUE checked: the bad one is named on its own
        (["--set", "limit=5", "--set", "confidence=1.5"], "--set confidence=1.5: eval.confidence=1.5"),
        (["--set", "confidence=1.5", "--set", "limit=5"], "--set confidence=1.5: eval.confidence=1.5"),
        (["--set", "limit=5", "resamples=0", "--set", "seed=1"], "--set resamples=0: eval.resamples=0"),
        (["--set", "limit=5", "bogus=1"], "--set bogus=1:"),
        (["--set", "limit=5", "--set"], "--set: expected at least one argument"),
        # the suite-validity report is measured on every item of every category
        (["--validity", "validity.json"], "--validity: a category's validity is measured on all its items"),
        (["--eval", "full", "--set", "limit=5", "--validity", "validity.json"], "use --eval full"),
    ],
)
def test_gate_settings_mistakes_are_one_line(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    base, cand = runs
    args = ["--eval", "quick", *argv] if argv[0] != "--eval" else argv
    code, err = _gate(capsys, "--baseline", str(base), "--candidate", str(cand), *args)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_out_of_range_settings_never_build_a_config() -> None:
    for item in ("confidence=1.5", "confidence=0", "resamples=-1"):
        with pytest.raises(PipelineError, match=item.split("=")[0]):
            load_eval_config("quick", [item])
    config = load_eval_config("quick", ["confidence=0.9", "resamples=100", "limit=5"])
    assert (config.confidence, config.resamples, config.limit) == (0.9, 100, 5)


def test_every_set_flag_is_kept(runs: tuple[Path, Path]) -> None:
    """Repeated ``--set`` flags and several KEY=VALUEs after one all reach the config."""
    from pipeline.gate import parse_args

    base, cand = runs
    argv = ["--baseline", str(base), "--candidate", str(cand), "--eval", "quick"]
    args = parse_args([*argv, "--set", "limit=5", "seed=3", "--set", "resamples=100", "--set", "threads=2"])
    assert args.set == ["limit=5", "seed=3", "resamples=100", "threads=2"]
    config = load_eval_config("quick", list(args.set))
    assert (config.limit, config.seed, config.resamples, config.threads) == (5, 3, 100, 2)
    assert parse_args(argv).set == []


def test_engine_and_run_folder_forms_agree(runs: tuple[Path, Path], tmp_path: Path) -> None:
    """A copied run folder (same files) is accepted; the copy is judged on its own files."""
    base, _ = runs
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    assert resolve_engine(copy, "candidate")[0].digest == resolve_engine(base, "baseline")[0].digest


def test_the_gate_puts_items_to_the_model_as_its_chat_setting_says(tmp_path: Path) -> None:
    from pipeline.config import EvalConfig
    from pipeline.core.errors import PipelineError
    from pipeline.gate import resolve_chat

    raw, jinja, in_config = (tmp_path / name for name in ("raw", "jinja", "in-config"))
    for folder in (raw, jinja, in_config):
        folder.mkdir()
        (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    (jinja / "chat_template.jinja").write_text("{{ messages }}")
    (in_config / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert [resolve_chat(EvalConfig(), f) for f in (raw, jinja, in_config)] == [False, True, True]
    assert resolve_chat(EvalConfig(chat=False), jinja) is False
    with pytest.raises(PipelineError, match=r"eval.chat=true: .*raw's tokenizer has no chat template"):
        resolve_chat(EvalConfig(chat=True), raw)


def test_a_recipe_calibrated_on_short_windows_warns_when_long_context_is_scored(tmp_path: Path) -> None:
    from pipeline.config import EvalConfig
    from pipeline.gate import calibration_length, long_context_warning

    configs = [{"alpha": 0.8, "calibration": {"seq_len": 256}}, {"calibration": {"seq_len": 512}}, {}, None]
    assert calibration_length(configs) == 256 and calibration_length([{}, None]) is None
    engine = make_engine_run(tmp_path / "run") / "engine"
    write_json(engine / "engine.json", {**engine_spec(), "max_length": 8192})
    tmp_path = engine
    warning = long_context_warning(EvalConfig(), tmp_path, 256)
    assert warning is not None and "256-token windows, 1/32 of the engine's 8192-token context" in warning
    assert "quant.calibration.seq_len" in warning
    assert long_context_warning(EvalConfig(), tmp_path, 2048) is None  # a quarter of the context
    assert long_context_warning(EvalConfig(suites=["reasoning"]), tmp_path, 256) is None  # not scored
    assert long_context_warning(EvalConfig(), tmp_path, None) is None  # nothing calibrated


def test_an_engine_json_field_out_of_range_is_refused_before_scoring(
    runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The manifest's digests still match (it is re-recorded), so only the typed reader sees it."""
    base, cand = runs
    spec = engine_spec()
    spec["session"]["intra_op_num_threads"] = "abc"
    write_json(cand / "engine" / "engine.json", spec)
    write_json(cand / "manifest.json", {"engine": {"path": "engine", "files": engine_files(cand / "engine")}})
    code, lines = _gate(capsys, "--baseline", str(base), "--candidate", str(cand))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: --candidate: ") and "intra_op_num_threads" in lines[0], lines


def test_a_new_validity_report_keeps_the_earlier_rules_not_scored_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One rule can be measured at a time (``--set suites=[long_context]``): the rules of the
    report already written are kept where it measured the same reference under today's settings."""
    from evals.suites import load_suite
    from evals.validity import build_report, rule_settings, write_report

    items = load_suite("tool_call", "full")
    matched = rule_settings(
        {"suites": {"tool_call.jsonl": "h"}, "chat": True, "rank_metric": "acc_norm"}, "rank"
    )
    scores = {item.id: float(n % 2) for n, item in enumerate(items)}
    earlier = build_report({"tool_call": (matched, items, scores)}, "ref", confidence=0.95)
    path = tmp_path / "validity.json"
    write_report(path, earlier)
    assert earlier_report(path) == earlier
    today = lambda rule: matched  # noqa: E731
    assert kept_rules(earlier, ["long_context"], "ref", today) == ["tool_call"]
    assert "tool_call kept from the earlier report" in capsys.readouterr().out
    assert kept_rules(earlier, ["tool_call"], "ref", today) == []  # scored again now
    assert kept_rules(earlier, ["long_context"], "another", today) == []
    assert "tool_call not kept: the earlier report measured another reference" in capsys.readouterr().out
    assert kept_rules(earlier, ["long_context"], "ref", lambda rule: {**matched, "chat": False}) == []
    assert "tool_call not kept: its suite or settings changed" in capsys.readouterr().out
    assert kept_rules(None, ["long_context"], "ref", today) == []
    path.write_text("{not json")
    assert earlier_report(path) is None and "nothing kept from it" in capsys.readouterr().out
    assert earlier_report(tmp_path / "absent.json") is None
