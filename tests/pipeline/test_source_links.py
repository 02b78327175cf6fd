"""A symlink in a model folder must not publish a host file (issue 50, class 1), and a symlink loop
is one line (class 2). A model folder is untrusted input; the files beside its weights
(``chat_template.jinja``, ``special_tokens_map.json``, the tokenizer, any extra file or subfolder)
are copied into the engine folder by the passes and the export, and from there published. So a
link whose target, every link followed, leaves the model folder is refused in one ``error:`` line
(exit 2) naming it, before anything is hashed, loaded or copied. The only links allowed stay
inside: a plain folder's, or a Hugging Face hub snapshot's into the blobs of its own
``models--*`` repo folder. The victim here is a file made in tmp, standing in for ``/etc/shadow``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pipeline.config import ModelConfig
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.errors import SourceError
from pipeline.sources import check_hf_llama, resolve_source
from tests.conftest import make_tiny_llama
from tests.pipeline.test_errors import assert_one_error_line
from tests.pipeline.test_source_untrusted import index_of, one_line, run_cli

SECRET = b"root:$6$not-really-a-hash:19000:0:99999:7:::\n"
# Every file the passes and the export copy from a source into the engine folder (passes/export.py
# CARRIED_FILES, pipeline/core/engine.py TOKENIZER_FILES, copy_beside_weights: everything else).
CARRIED = (
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "config.json",
    "model.safetensors",
    "notes.txt",
    "extras/deep/notes.txt",
)


@pytest.fixture
def checkpoint(tiny_llama: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_llama, tmp_path / "ckpt"))


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    from transformers import LlamaForCausalLM

    source = make_tiny_llama(tmp_path / "single")
    folder = tmp_path / "sharded"
    LlamaForCausalLM.from_pretrained(source).save_pretrained(
        folder, safe_serialization=True, max_shard_size="100KB"
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    assert len(list(folder.glob("*.safetensors"))) > 1
    return folder


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A host file nobody may publish (``/etc/shadow``), outside every model folder."""
    folder = tmp_path / "etc"
    folder.mkdir()
    path = folder / "shadow"
    path.write_bytes(SECRET)
    return path


def link(path: Path, target: Path | str) -> Path:
    """Make ``path`` (replacing a file there) a symlink to ``target``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(path):
        path.unlink()
    path.symlink_to(target)
    return path


def refused(folder: Path, needle: str = "outside") -> str:
    with pytest.raises(SourceError) as error:
        resolve_source(ModelConfig(name="x", path=str(folder)), folder.parent / "models")
    line = one_line(error)
    assert needle in line, line
    return line


def holding_secret(root: Path, victim: Path) -> list[Path]:
    """Files under ``root`` (links not followed) other than the victim that hold its bytes."""
    return [
        path
        for path in root.rglob("*")
        if path != victim and not path.is_symlink() and path.is_file() and SECRET in path.read_bytes()
    ]


@pytest.mark.parametrize("name", CARRIED)
def test_a_link_to_a_host_file_is_refused_whatever_file_it_stands_for(
    checkpoint: Path, victim: Path, name: str
) -> None:
    """Today ``chat_template.jinja -> /etc/shadow`` is copied into the engine and published."""
    if name in ("config.json", "model.safetensors"):  # a valid file outside: its place alone refuses it
        shutil.copy(checkpoint / name, victim)
    path = link(checkpoint / name, victim)
    line = refused(checkpoint)
    assert f"{path} is a symlink to {victim}" in line and "replace the link with the file itself" in line
    assert victim.read_bytes() == SECRET or name in ("config.json", "model.safetensors")


@pytest.mark.parametrize(
    "target",
    ["../etc/shadow", "../ckpt/../etc/shadow", "./../etc/shadow", "extras/../../etc/shadow"],
)
def test_a_relative_link_with_dotdot_that_leaves_is_refused(
    checkpoint: Path, victim: Path, target: str
) -> None:
    assert checkpoint.parent / "etc" / "shadow" == victim
    (checkpoint / "extras").mkdir()
    link(checkpoint / "chat_template.jinja", target)
    refused(checkpoint)


def test_a_link_to_a_link_that_leaves_is_refused(checkpoint: Path, victim: Path) -> None:
    """chat_template.jinja -> zz-hop (inside) -> the victim: the link followed to its end leaves."""
    link(checkpoint / "zz-hop", victim)
    link(checkpoint / "chat_template.jinja", "zz-hop")
    line = refused(checkpoint)
    assert f"{checkpoint / 'chat_template.jinja'} is a symlink to zz-hop" in line and str(victim) in line


def test_a_link_in_a_subfolder_is_refused(checkpoint: Path, victim: Path) -> None:
    path = link(checkpoint / "extras" / "templates" / "chat.jinja", victim)
    assert str(path) in refused(checkpoint)


def test_a_shard_the_index_names_that_is_a_link_outside_is_refused(sharded: Path, tmp_path: Path) -> None:
    """The shard's content is right (a copy outside): only where it lies refuses it."""
    shard = sorted(set(index_of(sharded)["weight_map"].values()))[-1]
    outside = tmp_path / "elsewhere" / shard
    outside.parent.mkdir()
    shutil.move(sharded / shard, outside)
    link(sharded / shard, outside)
    assert f"{sharded / shard} is a symlink to {outside}" in refused(sharded)


def test_the_engine_never_holds_the_host_file_and_the_cli_says_one_line(
    checkpoint: Path, victim: Path, tmp_path: Path
) -> None:
    path = link(checkpoint / "chat_template.jinja", victim)
    line = assert_one_error_line(run_cli(checkpoint, tmp_path), 2, "is a symlink to")
    assert str(path) in line and "outside the model folder" in line
    assert victim.read_bytes() == SECRET
    assert holding_secret(tmp_path, victim) == []  # no engine, cache entry or record holds a copy
    assert not any((tmp_path / "cache").rglob("artifact.json")), "a pass ran"


# --- the links that stay inside


def test_links_inside_a_plain_folder_pass(checkpoint: Path) -> None:
    """A relative link with '..' that stays inside, and a link to a link inside, both pass."""
    (checkpoint / "templates").mkdir()
    shutil.move(checkpoint / "tokenizer_config.json", checkpoint / "templates" / "tokenizer_config.json")
    link(checkpoint / "tokenizer_config.json", "templates/../templates/tokenizer_config.json")
    link(checkpoint / "templates" / "copy.json", "../tokenizer_config.json")
    check_hf_llama(checkpoint)


def test_a_model_path_that_is_a_link_to_the_folder_passes(checkpoint: Path, tmp_path: Path) -> None:
    """The folder is confined as resolved: its own links, through whatever path names it, stay inside."""
    link(checkpoint / "notes.txt", checkpoint / "config.json")  # absolute, inside
    alias = link(tmp_path / "alias", checkpoint)
    artifact = resolve_source(ModelConfig(name="x", path=str(alias)), tmp_path / "models")
    assert artifact.metadata["origin"]["path"] == str(checkpoint.resolve())


def hub_snapshot(source: Path, hub: Path, repo: str = "models--org--tiny", rev: str = "abc123") -> Path:
    """A hub cache repo: snapshots/<rev>/<file> -> ../../blobs/<hash>."""
    blobs, snapshot = hub / repo / "blobs", hub / repo / "snapshots" / rev
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for index, path in enumerate(sorted(source.iterdir())):
        shutil.copy(path, blobs / f"{rev}-blob{index}")
        link(snapshot / path.name, Path("..") / ".." / "blobs" / f"{rev}-blob{index}")
    return snapshot


def test_a_hub_snapshot_may_link_into_its_own_blobs_and_snapshots(tiny_llama: Path, tmp_path: Path) -> None:
    snapshot = hub_snapshot(tiny_llama, tmp_path / "hub")
    other = hub_snapshot(tiny_llama, tmp_path / "hub", rev="def456")
    link(snapshot / "tokenizer.json", other / "tokenizer.json")  # into another revision of the same repo
    artifact = resolve_source(ModelConfig(name="hub", path=str(snapshot)), tmp_path / "models")
    assert artifact.digest == Artifact.from_dir(Kind.TORCH, tiny_llama).digest


@pytest.mark.parametrize("where", ["victim", "other-repo", "hub-root"])
def test_a_hub_snapshot_link_that_leaves_its_repo_is_refused(
    tiny_llama: Path, tmp_path: Path, victim: Path, where: str
) -> None:
    snapshot = hub_snapshot(tiny_llama, tmp_path / "hub")
    if where == "victim":
        target: Path | str = Path("..") / ".." / ".." / ".." / "etc" / "shadow"
    elif where == "other-repo":  # another repo's blob: not this model's
        other = hub_snapshot(tiny_llama, tmp_path / "hub", repo="models--else--where")
        shutil.copy(victim, other.parent.parent / "blobs" / "planted")
        target = Path("..") / ".." / ".." / "models--else--where" / "blobs" / "planted"
    else:
        shutil.copy(victim, tmp_path / "hub" / "planted")
        target = Path("..") / ".." / ".." / "planted"
    path = link(snapshot / "chat_template.jinja", target)
    line = refused(snapshot, "outside its hub repo folder")
    assert str(path) in line and str(tmp_path / "hub" / "models--org--tiny") in line


# --- symlink loops: one line, and the hint says what it is


@pytest.mark.parametrize("shape", ["self", "pair", "parent"])
def test_a_symlink_loop_as_model_path_is_one_line(tmp_path: Path, shape: str) -> None:
    """Today: a RuntimeError traceback (Path.resolve on the loop)."""
    if shape == "self":
        model = link(tmp_path / "loop", "loop")
    elif shape == "pair":
        link(tmp_path / "b", tmp_path / "a")
        model = link(tmp_path / "a", tmp_path / "b")
    else:  # a loop on the way to the folder
        link(tmp_path / "loop", "loop")
        model = tmp_path / "loop" / "ckpt"
    with pytest.raises(SourceError) as error:
        resolve_source(ModelConfig(name="x", path=str(model)), tmp_path / "models")
    line = one_line(error)
    assert "symlink loop" in line and "remove or fix the link" in line and "permissions" not in line
    assert str(model) in line


def test_a_symlink_loop_as_model_path_is_one_cli_line(tmp_path: Path) -> None:
    loop = link(tmp_path / "loop", "loop")
    line = assert_one_error_line(run_cli(loop, tmp_path), 2, "is a symlink loop")
    assert str(loop) in line and "remove or fix the link" in line
    assert not (tmp_path / "models").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("shape", ["self", "pair", "subfolder"])
def test_a_symlink_loop_inside_the_model_folder_says_to_fix_the_link(checkpoint: Path, shape: str) -> None:
    """Today: '... cannot be read (Too many levels of symbolic links): fix its permissions'."""
    if shape == "self":
        path = link(checkpoint / "notes.txt", "notes.txt")
    elif shape == "pair":
        link(checkpoint / "zz", "notes.txt")
        path = link(checkpoint / "notes.txt", "zz")
    else:
        path = link(checkpoint / "extras" / "chat.jinja", "chat.jinja")
    line = refused(checkpoint, "is a symlink loop")
    assert str(path) in line and "remove or fix the link" in line and "permissions" not in line


# ---------------------------------------------------------------------------- a link swapped later


@pytest.mark.parametrize("name", ["chat_template.jinja", "special_tokens_map.json", "extras/deep/notes.txt"])
def test_a_link_swapped_to_a_host_file_after_the_check_is_not_copied(
    checkpoint: Path, victim: Path, tmp_path: Path, name: str
) -> None:
    """The folder passed its check; then, while the run goes on, a file beside the weights becomes
    a link to a host file. The torch passes' copy (copy_beside_weights) and the export's copy of
    the tokenizer files open what the link resolves to at that moment and refuse it."""
    from pipeline.core.files import UnsafeFileError
    from pipeline.core.torch_model import copy_beside_weights

    (checkpoint / "extras" / "deep").mkdir(parents=True)
    for path in (checkpoint / name, checkpoint / "chat_template.jinja"):
        path.write_text("{}" if path.suffix == ".json" else "{{ messages }}")
    check_hf_llama(checkpoint)
    link(checkpoint / name, victim)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UnsafeFileError, match=r"lies outside .*ckpt: every file it names must be inside"):
        copy_beside_weights(checkpoint, out)
    assert holding_secret(tmp_path, victim) == []


def test_the_export_copies_no_tokenizer_file_swapped_after_the_check(
    checkpoint: Path, victim: Path, tmp_path: Path
) -> None:
    from passes.export import ExportPass
    from pipeline.core.cache import Cache
    from pipeline.core.files import UnsafeFileError
    from pipeline.core.manager import PassManager

    (checkpoint / "chat_template.jinja").write_text("{{ messages }}")
    source = resolve_source(ModelConfig(name="x", path=str(checkpoint)), tmp_path / "models")
    link(checkpoint / "chat_template.jinja", victim)
    with pytest.raises(UnsafeFileError, match=r"chat_template.jinja .*lies outside"):
        PassManager([ExportPass()], Cache(tmp_path / "cache"), final_kind=None).run(source)
    assert holding_secret(tmp_path, victim) == []


def test_links_inside_the_folder_are_still_copied(checkpoint: Path, tmp_path: Path) -> None:
    from pipeline.core.torch_model import copy_beside_weights

    (checkpoint / "real.txt").write_text("kept")
    link(checkpoint / "notes.txt", checkpoint / "real.txt")
    out = tmp_path / "out"
    out.mkdir()
    copy_beside_weights(checkpoint, out)
    assert (out / "notes.txt").read_text() == "kept" and not (out / "notes.txt").is_symlink()
