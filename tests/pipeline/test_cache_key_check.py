"""A cache entry is checked against its key (issue 50, class 1): ``entry.json`` records what its
key was computed from, and a hit recomputes the key from those fields and checks that they are
the request's own. An entry found under another key (one model's export moved under another's,
its output digest the one of what it holds) is evicted with one warning and recomputed, through
the real pass manager; an entry of an earlier version (no such fields) is verified as far as its
record allows, then amended."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.cache import KEY_FIELDS, Cache, key_of
from pipeline.core.manager import PassManager
from tests.conftest import make_tiny_llama
from tests.pipeline.test_cache_untrusted import cache_warnings, one_eviction

Exported = tuple[Path, dict[str, tuple[str, str]]]  # (cache folder, model -> (key, output digest))


@pytest.fixture(scope="module")
def other_source(tmp_path_factory: pytest.TempPathFactory) -> Artifact:
    """A second tiny Llama (another seed: other weights, another export)."""
    return Artifact.from_dir(Kind.TORCH, make_tiny_llama(tmp_path_factory.mktemp("other-llama"), seed=1))


@pytest.fixture(scope="module")
def two_exports(
    tiny_source: Artifact, other_source: Artifact, tmp_path_factory: pytest.TempPathFactory
) -> Exported:
    """One cache holding the ONNX export of both tiny models."""
    from passes.export import ExportPass

    cache_dir = tmp_path_factory.mktemp("two-exports") / "cache"
    found = {}
    for name, source in (("tiny", tiny_source), ("other", other_source)):
        artifact, (record,) = PassManager([ExportPass()], Cache(cache_dir), final_kind=None).run(source)
        found[name] = (record.cache_key, artifact.digest)
    assert found["tiny"][1] != found["other"][1]
    return cache_dir, found


def _entry(cache_dir: Path, key: str) -> dict:
    return json.loads((cache_dir / key / "entry.json").read_text())


def _write_entry(cache_dir: Path, key: str, record: dict) -> None:
    (cache_dir / key / "entry.json").write_text(json.dumps(record))


def _moved(cache_dir: Path, mine: str, theirs: str) -> None:
    """The other model's entry, output and record, in place of ours (its output digest is the
    one of the output it holds: every file check passes)."""
    shutil.rmtree(cache_dir / mine)
    shutil.copytree(cache_dir / theirs, cache_dir / mine)


def _moved_as_is(cache_dir: Path, mine: str, theirs: str) -> str:
    _moved(cache_dir, mine, theirs)
    return "another input digest"


def _moved_with_our_key_fields(cache_dir: Path, mine: str, theirs: str) -> str:
    """Our key's fields copied in (the key recomputes to ours), its input digest left its own."""
    ours = _entry(cache_dir, mine)[KEY_FIELDS]
    _moved(cache_dir, mine, theirs)
    _write_entry(cache_dir, mine, {**_entry(cache_dir, mine), KEY_FIELDS: ours})
    return "input_digest"


def _other_libraries_recorded(cache_dir: Path, mine: str, theirs: str) -> str:
    """Our own entry, its key fields claiming other library versions (as an entry computed with
    another torch and copied from another cache would)."""
    record = _entry(cache_dir, mine)
    record[KEY_FIELDS]["libraries"]["torch"] = "0.0.1"
    _write_entry(cache_dir, mine, record)
    return "another library versions"


def _moved_without_key_fields(cache_dir: Path, mine: str, theirs: str) -> str:
    """As an earlier version wrote it (no key fields): its recorded input digest is not ours."""
    _moved(cache_dir, mine, theirs)
    record = _entry(cache_dir, mine)
    del record[KEY_FIELDS]
    _write_entry(cache_dir, mine, record)
    return "another input digest"


def _key_fields_not_an_object(cache_dir: Path, mine: str, theirs: str) -> str:
    record = _entry(cache_dir, mine)
    record[KEY_FIELDS] = ["x"]
    _write_entry(cache_dir, mine, record)
    return KEY_FIELDS


def _other_config_recorded(cache_dir: Path, mine: str, theirs: str) -> str:
    """Our own entry, its key fields claiming another config (the key no longer recomputes)."""
    record = _entry(cache_dir, mine)
    record[KEY_FIELDS]["config"]["opset"] = 1
    _write_entry(cache_dir, mine, record)
    return "another config"


CASES = {
    "the other model's entry moved as is": _moved_as_is,
    "moved, our key fields copied in": _moved_with_our_key_fields,
    "key fields with other library versions": _other_libraries_recorded,
    "moved, an earlier version's record": _moved_without_key_fields,
    "key fields not an object": _key_fields_not_an_object,
    "key fields with another config": _other_config_recorded,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_entry_not_computed_for_its_key_is_evicted_and_recomputed(
    two_exports: Exported,
    tiny_source: Artifact,
    tmp_path: Path,
    case: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from passes.export import ExportPass

    pristine, found = two_exports
    (mine, digest), (theirs, their_digest) = found["tiny"], found["other"]
    cache_dir = tmp_path / "cache"
    shutil.copytree(pristine, cache_dir, symlinks=True)
    named = CASES[case](cache_dir, mine, theirs)
    manager = PassManager([ExportPass()], Cache(cache_dir), final_kind=None)
    assert manager.cached_prefix(tiny_source) == 0  # the prediction does not count on it either
    with caplog.at_level(logging.WARNING):
        artifact, (record,) = manager.run(tiny_source)
    assert not record.cache_hit and artifact.digest == digest != their_digest
    assert record.input_digest == tiny_source.digest
    one_eviction(caplog, mine[:12], "entry.json", named)
    assert _entry(cache_dir, mine)["output_digest"] == digest
    assert _entry(cache_dir, theirs)["output_digest"] == their_digest  # the other entry untouched
    assert sorted(p.name for p in (cache_dir / ".staging").iterdir()) == []
    caplog.clear()
    _, (again,) = PassManager([ExportPass()], Cache(cache_dir), final_kind=None).run(tiny_source)
    assert again.cache_hit and again.output_digest == digest and cache_warnings(caplog) == []


def test_a_fresh_entry_records_what_its_key_was_computed_from(two_exports: Exported) -> None:
    pristine, found = two_exports
    for key, _ in found.values():
        record = _entry(pristine, key)
        fields = record[KEY_FIELDS]
        assert key_of(fields) == key and fields["input"] == record["input_digest"]
        assert fields["pass"] == record["pass"] == "export" and fields["version"] == record["version"]
        assert set(fields) == {"input", "pass", "version", "config", "libraries"}


def test_an_earlier_versions_own_entry_is_verified_amended_and_served(
    two_exports: Exported, tiny_source: Artifact, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Our own entry as an earlier version wrote it (no key fields): its input digest, pass,
    version and config are ours, so it is a hit (nothing recomputed), and its record gains the
    key fields once."""
    from passes.export import ExportPass

    pristine, found = two_exports
    mine, digest = found["tiny"]
    cache_dir = tmp_path / "cache"
    shutil.copytree(pristine, cache_dir, symlinks=True)
    record = _entry(cache_dir, mine)
    fields = record.pop(KEY_FIELDS)
    _write_entry(cache_dir, mine, record)
    with caplog.at_level(logging.WARNING):
        _, (hit,) = PassManager([ExportPass()], Cache(cache_dir), final_kind=None).run(tiny_source)
    assert hit.cache_hit and hit.output_digest == digest and cache_warnings(caplog) == []
    assert _entry(cache_dir, mine)[KEY_FIELDS] == fields
    _, (again,) = PassManager([ExportPass()], Cache(cache_dir), final_kind=None).run(tiny_source)
    assert again.cache_hit and cache_warnings(caplog) == []


def test_what_a_writer_of_the_cache_can_still_plant(
    two_exports: Exported, tiny_source: Artifact, tmp_path: Path
) -> None:
    """The limit of the check (the README's trust section): a writer who records our key's fields
    and input digest over another output, with that output's digest, is served. Only a cache
    whose writers are trusted is safe to share."""
    from passes.export import ExportPass

    pristine, found = two_exports
    (mine, _), (theirs, their_digest) = found["tiny"], found["other"]
    cache_dir = tmp_path / "cache"
    shutil.copytree(pristine, cache_dir, symlinks=True)
    ours = _entry(cache_dir, mine)
    _moved(cache_dir, mine, theirs)
    forged = {**_entry(cache_dir, mine), KEY_FIELDS: ours[KEY_FIELDS], "input_digest": ours["input_digest"]}
    _write_entry(cache_dir, mine, forged)
    _, (record,) = PassManager([ExportPass()], Cache(cache_dir), final_kind=None).run(tiny_source)
    assert record.cache_hit and record.output_digest == their_digest


def test_fields_that_do_not_give_the_key_they_were_found_under() -> None:
    """(a) alone: fields that are the request's own but found under another key."""
    from pipeline.core.cache import key_fields, key_problem

    fields = key_fields("a" * 64, "export", 1, {"opset": 21})
    record = {"input_digest": "a" * 64, "pass": "export", "version": 1, KEY_FIELDS: fields}
    assert key_problem(record, key_of(fields), fields) is None
    problem = key_problem(record, "0" * 64, fields)
    assert problem is not None and "another key" in problem
    assert "pass version" in str(
        key_problem({**record, KEY_FIELDS: {**fields, "version": 2}}, "0" * 64, fields)
    )


def test_the_engine_with_its_draft_is_checked_against_its_key(
    tiny_engine: Artifact, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``speculative=draft``'s combined engine is a cache entry too (pipeline/speculative.py
    ``attach_draft``): the entry made with one draft, moved under the key of another, is
    evicted with one warning and made again, not served."""
    from pipeline.speculative import attach_draft

    other = tmp_path / "other-draft"
    shutil.copytree(tiny_engine.path, other)
    spec = json.loads((other / "engine.json").read_text())
    (other / "engine.json").write_text(json.dumps({**spec, "session": {"intra_op_num_threads": 1}}))
    drafts = {"tiny": tiny_engine, "other": Artifact.from_dir(Kind.ENGINE, other)}
    cache_dir = tmp_path / "cache"
    made = {name: attach_draft(Cache(cache_dir), tiny_engine, draft, 3) for name, draft in drafts.items()}
    keys = {name: engine.path.parent.name for name, (engine, _) in made.items()}
    assert len(set(keys.values())) == 2 and not any(hit for _, hit in made.values())
    assert _entry(cache_dir, keys["tiny"])[KEY_FIELDS]["config"] == {"k": 3, "draft": tiny_engine.digest}
    assert attach_draft(Cache(cache_dir), tiny_engine, drafts["other"], 3)[1] is True  # a true hit
    _moved(cache_dir, keys["other"], keys["tiny"])
    with caplog.at_level(logging.WARNING):
        engine, hit = attach_draft(Cache(cache_dir), tiny_engine, drafts["other"], 3)
    assert not hit and engine.digest == made["other"][0].digest != made["tiny"][0].digest
    one_eviction(caplog, keys["other"][:12], "entry.json", "another config")
