"""The tool_call_valid tasks: generated calls after two worked examples, checked by json and
jsonschema; docs, the examples, the scoring, and a real lm-eval run on the tiny engine."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from lm_eval.tasks import TaskManager

from evals.engine_scores import lm_eval_scores
from evals.suites import item_hash, load_suite
from evals.suites.tool_call import syntax_distractors
from evals.tasks import TASKS_DIR, rule_task
from evals.tasks.tool_valid import DEMOS, NO_CALL_CATEGORY, demo_docs, docs, process_results
from pipeline.core.artifacts import Artifact, Kind
from tests.conftest import make_tiny_llama, run_pass


@pytest.fixture(scope="module")
def long_tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    """The tiny model with room for a prompt of the task (about 2000 of its tokens) and a reply."""
    from passes.export import ExportPass
    from passes.ort_build import OrtCpuBuildPass

    source = make_tiny_llama(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=4096)
    graph = run_pass(ExportPass(), Artifact.from_dir(Kind.TORCH, source), tmp_path_factory.mktemp("g"))[0]
    return run_pass(OrtCpuBuildPass(), graph, tmp_path_factory.mktemp("e"))[0]


def test_the_docs_are_the_suites_calling_items_with_the_examples_in_their_hash() -> None:
    items = [i for i in load_suite("tool_call", "quick") if i.category != NO_CALL_CATEGORY]
    quick = docs("quick")
    assert [d["id"] for d in quick] == [i.id for i in items] and len(items) == 36
    assert all(d["hash"] != item_hash(i) for d, i in zip(quick, items, strict=True))
    assert len({d["hash"] for d in quick}) == len(quick)
    assert len(docs("full")) == len(
        [i for i in load_suite("tool_call", "full") if i.category != NO_CALL_CATEGORY]
    )


def test_the_examples_offer_no_function_of_the_suite_and_are_valid_calls() -> None:
    offered = {f["name"] for item in load_suite("tool_call", "full") for f in item.meta["functions"]}
    for (functions, _, calls), doc in zip(DEMOS, demo_docs(), strict=True):
        assert not {f["name"] for f in functions} & offered
        scored = process_results(
            {"meta": json.dumps({"functions": functions}), "target": "[]"}, [doc["reference"]]
        )
        assert scored == {"acc": 1.0, "parsed": 1.0} and json.loads(doc["reference"]) == calls


def test_replies_score_valid_schema_failure_or_parse_failure() -> None:
    doc = docs("quick")[0]
    right = doc["reference"]
    assert process_results(doc, [right + "\n\nRequest: more"]) == {"acc": 1.0, "parsed": 1.0}
    ((broken, _),) = syntax_distractors(random.Random(0), right, 0, 1)
    assert process_results(doc, [broken]) == {"acc": 0.0, "parsed": 0.0}
    wrong_type = json.loads(right)
    name, value = next(iter(wrong_type[0]["arguments"].items()))
    wrong_type[0]["arguments"][name] = [value]
    assert process_results(doc, [json.dumps(wrong_type)]) == {"acc": 0.0, "parsed": 1.0}
    assert process_results(doc, ["I would call the function."]) == {"acc": 0.0, "parsed": 0.0}
    # "[]" parses, but an item whose request needs a call is not answered by none
    assert process_results(doc, ["[]"]) == {"acc": 0.0, "parsed": 1.0}


def test_the_task_puts_both_examples_before_the_item(tmp_path: Path) -> None:
    assert rule_task("tool_call_valid", "rank", "quick") == ("valid", "tool_call_valid_quick")
    assert rule_task("tool_call", "rank", "quick") == ("rank", "tool_call_rank_quick")
    task = TaskManager(include_path=str(TASKS_DIR), include_defaults=False).load(["tool_call_valid_quick"])
    task = task["tasks"]["tool_call_valid_quick"]
    doc = next(iter(task.test_docs()))
    context = task.fewshot_context(doc, num_fewshot=2)
    demos = demo_docs()
    assert context.index(demos[0]["reference"]) < context.index(demos[1]["reference"])
    assert context.endswith(doc["prompt"]) and context.count("Request:") == 3


def test_the_tiny_engine_is_scored_with_a_reason_for_each_failure(long_tiny_engine: Artifact) -> None:
    scores = lm_eval_scores(long_tiny_engine.path, "tool_call_valid", "quick", "rank", limit=3)
    expected = docs("quick")[:3]
    assert [(s.id, s.hash) for s in scores] == [(d["id"], d["hash"]) for d in expected]
    for s in scores:  # a random tiny model writes no valid call
        assert s.score == 0.0 and s.failure in ("parse", "schema"), s
