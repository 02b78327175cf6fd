"""The lm-eval task YAML over the frozen suites: every task loads from any working directory
with the suite's items as docs (ids and hashes), and the generative scoring rules accept each
item's reference answer and reject its wrong candidates."""

from __future__ import annotations

from pathlib import Path

import pytest
from lm_eval.tasks import TaskManager

from evals.suites import SPECS, item_hash, load_suite
from evals.tasks import FIXED_SCORING, SCORINGS, SIZES, TASK_NAMES, TASKS_DIR, task_name
from evals.tasks.docs import docs, reference_text
from evals.tasks.scoring import last_number, match_choice, named_choices, process_results, score


def test_every_suite_has_its_tasks() -> None:
    assert {task_name(suite, "rank") for suite in SPECS} <= set(TASK_NAMES)
    assert {p.stem for p in TASKS_DIR.glob("*.yaml")} == set(TASK_NAMES)
    assert len(TASK_NAMES) == (len(SPECS) * len(SCORINGS) + len(FIXED_SCORING)) * len(SIZES)


def test_tasks_load_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    assert set(TASK_NAMES) <= set(manager.all_subtasks)
    assert {"suites_rank_quick", "suites_gen_quick", "suites_rank", "suites_gen"} <= set(manager.all_tags)
    quick = [task_name(suite, scoring, "quick") for suite in SPECS for scoring in SCORINGS]
    loaded = manager.load([*quick, "reasoning_rank"])["tasks"]
    for suite in SPECS:
        items = load_suite(suite, "quick")
        rank, gen = loaded[f"{suite}_rank_quick"], loaded[f"{suite}_gen_quick"]
        assert rank.OUTPUT_TYPE == "multiple_choice" and gen.OUTPUT_TYPE == "generate_until"
        for task in (rank, gen):
            task_docs = list(task.test_docs())
            assert [d["id"] for d in task_docs] == [item.id for item in items]
            assert [d["hash"] for d in task_docs] == [item_hash(item) for item in items]
            assert task.doc_to_text(task_docs[0]) == items[0].prompt
        assert rank.doc_to_choice(task_docs[0]) == items[0].choices
        assert rank.doc_to_target(task_docs[0]) == items[0].answer
    assert len(loaded["reasoning_rank"].test_docs()) == len(load_suite("reasoning", "full"))
    assert not list(tmp_path.iterdir())  # nothing written to the working directory


@pytest.mark.parametrize("suite", sorted(SPECS))
def test_references_score_right_and_wrong_candidates_wrong(suite: str) -> None:
    for doc, item in zip(docs(suite, "quick"), load_suite(suite, "quick"), strict=True):
        assert reference_text(item) == doc["reference"]
        assert score(doc["reference"], doc), doc["id"]
        assert process_results(doc, [f"The answer is {doc['choices'][doc['answer']]}"]) == {"acc": 1.0}
        for index, choice in enumerate(doc["choices"]):
            # a syntax distractor (tool_call) holds the right names and values in broken JSON;
            # the AST rule reads calls out of prose, as BFCL's does, and may read it as right
            if index != doc["answer"] and not item.meta["choice_kinds"][index].startswith("syntax_"):
                assert not score(choice, doc), (doc["id"], choice)


def test_rules() -> None:
    assert last_number("5-3 is 2, so 1,234 items") == 1234
    assert last_number("It is -7.") == -7 and last_number("5-3") == 3 and last_number("none") is None
    choices = ["The gate is locked.", "The gate is unlocked.", "Nothing can be concluded."]
    assert named_choices("so the gate is unlocked", choices) == {1}
    assert match_choice("The gate is locked.", "The gate is locked.", choices)
    assert not match_choice("The gate is locked or the gate is unlocked", "The gate is locked.", choices)
    tool_doc = next(d for d in docs("tool_call", "quick") if d["category"] == "simple")
    assert not score("I cannot help with that.", tool_doc)
    with pytest.raises(ValueError, match="unknown match rule"):
        score("1", {**tool_doc, "match": "regex"})
