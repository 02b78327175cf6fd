"""The gate's pairing, per-suite verdicts and score cache (scores given as data: no engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evals.drift import DriftRule
from evals.gate import GateError, ItemScore, judge_suite, overall, pair_scores, run_gate
from evals.stats import FAIL, INCONCLUSIVE, PASS, GateThresholds


def scores(values: list[int], prefix: str = "s", salt: str = "") -> list[ItemScore]:
    return [ItemScore(f"{prefix}-{i:03d}", f"h{i}{salt}", float(v)) for i, v in enumerate(values)]


def test_pairing_matches_ids_in_any_order() -> None:
    base = scores([1, 0, 1])
    cand = list(reversed(scores([0, 0, 1])))
    assert pair_scores("s", base, cand) == ([1.0, 0.0, 1.0], [0.0, 0.0, 1.0])


@pytest.mark.parametrize(
    ("candidate", "needle"),
    [
        (scores([1, 0]), "scored on different items (1 unpaired, e.g. s-002)"),
        (scores([1, 0, 1], salt="x"), "item s-000 differs between the two scorings (3 items)"),
        (scores([1, 0, 1]) + scores([1]), "an item id occurs twice"),
    ],
)
def test_unpairable_scorings_are_errors(candidate: list[ItemScore], needle: str) -> None:
    with pytest.raises(GateError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        pair_scores("s", scores([1, 0, 1]), candidate)


def test_an_unchanged_engine_passes_and_a_broken_one_fails() -> None:
    rng_values = [i % 3 != 0 for i in range(300)]  # 200 of 300 right
    base = scores([int(v) for v in rng_values])
    same = judge_suite("s", base, base, GateThresholds())
    assert same["verdict"] == PASS and same["difference"] == 0 and same["p_value"] == 1.0
    broken = scores([int(v and i % 4 != 0) for i, v in enumerate(rng_values)])  # 50 right answers lost
    row = judge_suite("s", base, broken, GateThresholds())
    assert row["verdict"] == FAIL and row["ci_high"] < 0 and row["p_value"] < 1e-6
    assert (
        row["mcnemar"]["b"] == 50 and row["mcnemar"]["c"] == 0 and row["recovery"] == pytest.approx(150 / 200)
    )


QUALITY = {"kl_mean": 0.30, "top1_agreement": 0.71, "perplexity": 40.0, "reference_perplexity": 25.0}
BITS4 = ("bits4", DriftRule(max_kl=0.25, min_top1=0.70, max_ppl_ratio=1.25))


def test_token_drift_fails_an_engine_whose_suites_pass(tmp_path: Path) -> None:
    # The regression quick suites cannot see: scores unchanged, the token statistics far off.
    def score(engine: Path, suite: str) -> list[ItemScore]:
        return scores([1, 0] * 24, prefix=suite)

    kwargs = dict(suites=["a"], thresholds={"a": GateThresholds(0.15, 0.85)}, score_fn=score, settings={})
    record = run_gate(
        (tmp_path / "c", "d-c"), (tmp_path / "b", "d-b"), **kwargs, drift=BITS4, quality=QUALITY
    )
    assert record["suites"]["a"]["verdict"] == PASS
    assert record["verdict"] == FAIL and record["drift"]["verdict"] == FAIL and record["kl"] == 0.30
    assert record["reason"].startswith("token drift: KL 0.3 breaks max_kl=0.25 (family bits4)")
    within = {**QUALITY, "kl_mean": 0.2, "perplexity": 30.0}
    record = run_gate((tmp_path / "c", "d-c"), (tmp_path / "b", "d-b"), **kwargs, drift=BITS4, quality=within)
    assert record["verdict"] == PASS and len(record["drift"]["reasons"]) == 3
    unmeasured = run_gate(
        (tmp_path / "c", "d-c"), (tmp_path / "b", "d-b"), **kwargs, drift=BITS4, quality=None
    )
    assert unmeasured["verdict"] == INCONCLUSIVE and "no valid KL" in unmeasured["reason"]


def test_a_small_suite_that_cannot_tell_is_inconclusive_and_says_how_many_items_would() -> None:
    base = scores([1, 1, 0, 1] * 12)  # 48 items
    cand = scores([1, 0, 0, 1] * 6 + [1, 1, 0, 1] * 5 + [0, 1, 1, 1])  # 7 lost, 1 gained: -12.5 points
    row = judge_suite("s", base, cand, GateThresholds(max_drop=0.15, min_recovery=0.85))
    assert row["verdict"] == INCONCLUSIVE and row["p_value"] > 0.05 and row["ci_low"] < -0.15
    sized = row["resolution"]
    assert sized["discordance"] == pytest.approx(8 / 48) and sized["items_needed"] > 48
    assert f"about {sized['items_needed']} items would settle max_drop=0.15 (it has 48)" in row["reasons"][-1]


def test_the_gate_is_its_worst_row() -> None:
    row = {"reasons": ["r"]}
    assert overall({"a": {**row, "verdict": PASS}, "b": {**row, "verdict": PASS}})[0] == PASS
    assert overall({"a": {**row, "verdict": INCONCLUSIVE}, "b": {**row, "verdict": PASS}}) == (
        INCONCLUSIVE,
        "a: r",
    )
    assert overall({"a": {**row, "verdict": INCONCLUSIVE}, "b": {**row, "verdict": FAIL}}) == (FAIL, "b: r")


def test_run_gate_scores_each_engine_once_and_caches(tmp_path: Path) -> None:
    calls: list[tuple[str, str]] = []
    results = {
        "base": {"a": [1, 1, 0, 1] * 50, "b": [1, 0] * 100},
        "cand": {"a": [1, 1, 0, 1] * 50, "b": [0] * 200},
    }

    def score(engine: Path, suite: str) -> list[ItemScore]:
        calls.append((engine.name, suite))
        return scores(results[engine.name][suite], prefix=suite)

    thresholds = {"a": GateThresholds(), "b": GateThresholds()}
    kwargs = dict(suites=["a", "b"], thresholds=thresholds, score_fn=score, settings={"size": "quick"})
    cand, base = (tmp_path / "cand", "d-cand"), (tmp_path / "base", "d-base")
    record = run_gate(cand, base, **kwargs, cache_dir=tmp_path)
    assert record["verdict"] == FAIL and record["suites"]["a"]["verdict"] == PASS
    assert record["suites"]["b"]["verdict"] == FAIL and record["reason"].startswith("b: ")
    assert sorted(calls) == [("base", "a"), ("base", "b"), ("cand", "a"), ("cand", "b")]
    again = run_gate(cand, base, **kwargs, cache_dir=tmp_path)
    assert len(calls) == 4 and again["suites"] == record["suites"]  # every score from the cache
    same = run_gate(base, base, **kwargs, cache_dir=None)
    assert same["verdict"] == PASS and same["same_engine"] and calls[4:] == [("base", "a"), ("base", "b")]


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", '{"items": 3}', '{"items": [{"nope": 1}]}'])
def test_a_broken_cached_score_record_is_rescored_not_a_traceback(tmp_path: Path, damage: str) -> None:
    calls: list[str] = []

    def score(engine: Path, suite: str) -> list[ItemScore]:
        calls.append(engine.name)
        return scores([1, 0] * 50, prefix=suite)

    kwargs = dict(suites=["a"], thresholds={"a": GateThresholds()}, score_fn=score, settings={})
    first = run_gate((tmp_path / "c", "d-c"), (tmp_path / "b", "d-b"), **kwargs, cache_dir=tmp_path)
    records = sorted((tmp_path / "eval").glob("*.json"))
    assert len(records) == 2 and calls == ["b", "c"]
    records[0].write_text(damage)
    again = run_gate((tmp_path / "c", "d-c"), (tmp_path / "b", "d-b"), **kwargs, cache_dir=tmp_path)
    assert len(calls) == 3 and again["suites"] == first["suites"]  # the broken one scored again
    assert all(json.loads(r.read_text())["items"] for r in records)  # and stored whole
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == [r.name for r in records]


FIELD_DAMAGES = {
    "score of text": lambda r: r["items"][0].update(score="abc"),
    "score above 1": lambda r: r["items"][0].update(score=7),
    "score NaN": lambda r: r["items"][0].update(score=float("nan")),
    "score a boolean": lambda r: r["items"][0].update(score=True),
    "id a number": lambda r: r["items"][0].update(id=3),
    "hash missing": lambda r: r["items"][0].pop("hash"),
    "extra item field": lambda r: r["items"][0].update(extra=1),
    "id twice": lambda r: r["items"].append(dict(r["items"][0])),
    "another engine's key": lambda r: r["key"].update(engine="d-other"),
    "no key": lambda r: r.pop("key"),
    "items an object": lambda r: r.update(items={"a": 1}),
    "failure a number": lambda r: r["items"][0].update(failure=3),
    "failure a long text": lambda r: r["items"][0].update(failure="x" * 500),
}


@pytest.mark.parametrize("damage", sorted(FIELD_DAMAGES))
def test_a_cached_score_record_with_a_bad_field_is_discarded_and_rescored(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A well-formed JSON record whose fields are of the wrong type or out of range (before: a
    TypeError in the statistics, or a score of 7 or NaN judged as it was) is scored again."""
    calls: list[str] = []

    def score(engine: Path, suite: str) -> list[ItemScore]:
        calls.append(engine.name)
        return scores([1, 0] * 50, prefix=suite)

    kwargs = dict(suites=["a"], thresholds={"a": GateThresholds()}, score_fn=score, settings={})
    first = run_gate((tmp_path / "c", "d-c"), (tmp_path / "b", "d-b"), **kwargs, cache_dir=tmp_path)
    for path in sorted((tmp_path / "eval").glob("*.json")):
        record = json.loads(path.read_text())
        FIELD_DAMAGES[damage](record)
        path.write_text(json.dumps(record))
    again = run_gate((tmp_path / "c", "d-c"), (tmp_path / "b", "d-b"), **kwargs, cache_dir=tmp_path)
    assert sorted(calls) == ["b", "b", "c", "c"] and again["suites"] == first["suites"]
    assert sum("discarding it and recomputing" in r.getMessage() for r in caplog.records) == 2
    for path in (tmp_path / "eval").glob("*.json"):  # stored whole again
        assert all(0 <= item["score"] <= 1 for item in json.loads(path.read_text())["items"])


def test_scores_out_of_range_are_refused_not_cached(tmp_path: Path) -> None:
    def score(engine: Path, suite: str) -> list[ItemScore]:
        return [ItemScore("a", "h", float("nan")), ItemScore("b", "h", 0.0)]

    kwargs = dict(suites=["a"], thresholds={"a": GateThresholds()}, score_fn=score, settings={})
    with pytest.raises(
        GateError, match=r"eval suite 'a': the scores of .* are unusable \(item 'a' has a score of nan"
    ):
        run_gate((tmp_path / "c", "d-c"), (tmp_path / "b", "d-b"), **kwargs, cache_dir=tmp_path)
    assert not list(tmp_path.glob("eval/*.json"))  # nothing was cached


def test_a_changed_suite_file_rescores_that_suite_only(tmp_path: Path) -> None:
    calls: list[str] = []

    def score(engine: Path, suite: str) -> list[ItemScore]:
        calls.append(suite)
        return scores([1, 0] * 50, prefix=suite)

    def gate(files: dict[str, str]) -> None:
        thresholds = {"a": GateThresholds(), "b": GateThresholds()}
        settings = {"size": "full", "suites": files}
        run_gate((tmp_path / "c", "d-c"), (tmp_path / "b", "d-b"), ["a", "b"], thresholds, score, settings,
                 cache_dir=tmp_path)  # fmt: skip

    gate({"a.jsonl": "1", "b.jsonl": "1", "b.tokens.json": "1"})
    gate({"a.jsonl": "2", "b.jsonl": "1", "b.tokens.json": "1"})  # suite a regenerated
    assert sorted(calls[:4]) == ["a", "a", "b", "b"] and calls[4:] == ["a", "a"]
    gate({"a.jsonl": "2", "b.jsonl": "1", "b.tokens.json": "2"})  # b's token counts remeasured
    assert calls[6:] == ["b", "b"]


def test_concurrent_jobs_score_an_engine_once(tmp_path: Path) -> None:
    """Jobs of a sweep that need the same scores (the baseline's) compute them once: the others
    wait on the compute lock, then read the record (here two threads of one process, which the
    lock keeps apart as it keeps processes apart)."""
    import threading
    import time

    from evals.gate import cached_scores

    calls: list[str] = []

    def slow_score(engine: Path, suite: str) -> list[ItemScore]:
        calls.append(suite)
        time.sleep(0.5)
        return [ItemScore("a", "h", 1.0), ItemScore("b", "h", 0.0)]

    results: list[list[ItemScore]] = []

    def job() -> None:
        settings = {"size": "quick"}
        results.append(cached_scores(slow_score, tmp_path, "d" * 64, "reasoning", settings, tmp_path))

    threads = [threading.Thread(target=job) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert calls == ["reasoning"]
    assert len(results) == 3 and all(r == results[0] for r in results)
    assert not list((tmp_path / ".staging").glob("*.lock"))  # released and removed


def test_run_gate_logs_each_suite_as_it_starts_and_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Scoring a suite takes minutes on a loaded host: a line as each starts and as it ends, with
    its item count and seconds (and one per engine scored), through the project's logger."""

    def score(engine: Path, suite: str) -> list[ItemScore]:
        return scores([1, 0, 1] * (4 if suite == "a" else 5), prefix=suite)

    thresholds = {"a": GateThresholds(), "b": GateThresholds()}
    kwargs = dict(suites=["a", "b"], thresholds=thresholds, score_fn=score, settings={})
    with caplog.at_level("INFO", logger="evals.gate"):
        run_gate((tmp_path / "c", "d-c"), (tmp_path / "b", "d-b"), **kwargs, cache_dir=tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "evals.gate"]
    started = [i for i, line in enumerate(lines) if line.startswith("gate: suite ") and ": scoring " in line]
    ended = [i for i, line in enumerate(lines) if line.startswith("gate: suite ") and ": done, " in line]
    assert [lines[i].split(":")[1] for i in started] == [" suite 1/2 a", " suite 2/2 b"]
    assert len(ended) == 2 and started[0] < ended[0] < started[1] < ended[1]
    assert " 12 items in " in lines[ended[0]] and " 15 items in " in lines[ended[1]]
    assert lines[ended[0]].endswith(": PASS") and "baseline 66.7%, candidate 66.7%" in lines[ended[0]]
    scored = [line for line in lines if line.startswith("eval: scored a of d-c: 12 items in ")]
    assert len(scored) == 1 and scored[0].endswith(" s")


def test_failure_reasons_are_counted_per_engine_and_old_records_without_them_read(tmp_path: Path) -> None:
    def score(engine: Path, suite: str) -> list[ItemScore]:
        failed = {"b": ["parse"] * 10 + ["schema"] * 10, "c": ["parse"] * 18 + ["schema"] * 2}[engine.name]
        return [
            ItemScore(f"i{i}", "h", 0.0 if i < 20 else 1.0, failed[i] if i < 20 else "") for i in range(40)
        ]

    kwargs = dict(suites=["v"], thresholds={"v": GateThresholds()}, score_fn=score, settings={})
    record = run_gate((tmp_path / "c", "d-c"), (tmp_path / "b", "d-b"), **kwargs, cache_dir=tmp_path)
    failures = {"baseline": {"parse": 10, "schema": 10}, "candidate": {"parse": 18, "schema": 2}}
    assert record["suites"]["v"]["failures"] == failures
    for path in (tmp_path / "eval").glob("*.json"):  # written before reasons were recorded
        old = json.loads(path.read_text())
        for item in old["items"]:
            item.pop("failure")
        path.write_text(json.dumps(old))
    again = run_gate((tmp_path / "c", "d-c"), (tmp_path / "b", "d-b"), **kwargs, cache_dir=tmp_path)
    assert again["suites"]["v"]["failures"] is None and again["suites"]["v"]["n"] == 40
    uncached = run_gate((tmp_path / "c", "d-c"), (tmp_path / "b", "d-b"), **kwargs, cache_dir=None)
    assert uncached["suites"]["v"]["failures"] == failures
