"""The graph passes' one graph API (pipeline/core/graph_io.py): lazy weights, unchanged data files
hard-linked and only changed bytes written, no unreferenced data file, and the parity helper."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from passes.kv_cache import KvCachePass
from pipeline.core.artifacts import ARTIFACT_FILE, Artifact, Kind
from pipeline.core.errors import PassError
from pipeline.core.graph_io import (
    check_data_files,
    link_folder_files,
    load_graph,
    save_graph,
    unreferenced_data_files,
)
from pipeline.runtime.parity import compare_graphs

SHARD = 64 * 1024  # the tiny graph's 450 KB of weights in several shards


def sharded_copy(graph: Artifact, out: Path) -> Path:
    """``graph`` re-saved with every tensor in memory: fresh shards of at most SHARD bytes."""
    from onnx_ir.external_data import load_to_model

    model = load_to_model(load_graph(graph.path))
    out.mkdir(parents=True)
    stats = save_graph(model, out, shard_bytes=SHARD)
    assert stats.linked_bytes == 0 and stats.written_bytes > 0
    assert len(stats.data_files) > 3
    link_folder_files(graph.path, out)
    shutil.copy2(graph.path / ARTIFACT_FILE, out / ARTIFACT_FILE)
    return out


def test_load_graph_leaves_external_data_on_disk(tiny_graph: Artifact, tmp_path: Path) -> None:
    import onnx
    import onnx_ir as ir

    linked = tmp_path / "linked"
    linked.mkdir()
    for path in tiny_graph.path.iterdir():
        os.link(path, linked / path.name)
    with pytest.raises(Exception, match="hard link"):  # why onnx.load is not used on graph folders
        onnx.load(str(linked / "model.onnx"))
    model = load_graph(linked)
    tensors = [v.const_value for v in model.graph.initializers.values()]
    external = [t for t in tensors if isinstance(t, ir.ExternalTensor)]
    assert sum(t.nbytes for t in external) > 0.9 * (linked / "model.onnx.data").stat().st_size
    assert all(t.raw is None for t in external)  # nothing mapped or read yet
    first = external[0]
    assert first.numpy().shape == tuple(first.shape.numpy())  # touched: now readable through the link
    assert all(t.raw is None for t in external[1:])


def test_save_links_unchanged_files_and_writes_only_changed_bytes(
    tiny_graph: Artifact, tmp_path: Path
) -> None:
    import onnx_ir as ir

    source = sharded_copy(tiny_graph, tmp_path / "sharded")
    model = load_graph(source)
    large = [v for v in model.graph.initializers.values() if v.const_value.nbytes >= 1024]
    changed = large[-1]
    changed_file = changed.const_value.location
    before = np.array(changed.const_value.numpy())
    changed.const_value = ir.Tensor(before * 2, name=changed.name)
    out = tmp_path / "out"
    out.mkdir()
    stats = save_graph(model, out, shard_bytes=SHARD)

    source_files = {p.name for p in source.glob("*.data")}
    kept = source_files - {changed_file}
    for name in kept:  # the same inode, not a copy
        assert (out / name).stat().st_ino == (source / name).stat().st_ino
        assert (out / name).stat().st_nlink > 1
    assert not (out / changed_file).exists() or (out / changed_file).stat().st_nlink == 1
    new_files = {p.name for p in out.glob("*.data")} - kept
    assert new_files and all((out / n).stat().st_nlink == 1 for n in new_files)
    assert stats.linked_bytes == sum((source / n).stat().st_size for n in kept)
    # only the partly changed file's tensors are written anew: at most that file's bytes
    assert 0 < stats.written_bytes <= (source / changed_file).stat().st_size
    assert unreferenced_data_files(out) == []

    reloaded = {v.name: v.const_value.numpy() for v in load_graph(out).graph.initializers.values()}
    original = {v.name: v.const_value.numpy() for v in load_graph(source).graph.initializers.values()}
    assert reloaded.keys() == original.keys()
    for name, value in original.items():
        expected = value * 2 if name == changed.name else value
        np.testing.assert_array_equal(reloaded[name], expected)


def test_check_data_files_refuses_an_unreferenced_data_file(tiny_graph: Artifact, tmp_path: Path) -> None:
    step = KvCachePass()
    out = tmp_path / "kv"
    out.mkdir()
    step.run(tiny_graph, out)
    result = Artifact.from_dir(Kind.GRAPH, out)
    step.ensures(tiny_graph, result)  # as written: fine, and linked to the input, not copied
    assert (out / "model.onnx.data").stat().st_ino == (tiny_graph.path / "model.onnx.data").stat().st_ino
    (out / "model.onnx.data.stale.data").write_bytes(b"\0" * 4096)
    with pytest.raises(PassError, match=r"model\.onnx\.data\.stale\.data is external data no tensor"):
        step.ensures(tiny_graph, Artifact.from_dir(Kind.GRAPH, out))
    check_data_files(tiny_graph.path, "export")


def test_parity_helper_catches_perturbed_logits(tiny_graph: Artifact, tmp_path: Path) -> None:
    import onnx_ir as ir

    same = compare_graphs(tiny_graph.path, tiny_graph.path, steps=3)
    assert same["max_abs_diff"] == 0.0 and same["kl"] == 0.0 and same["top1_agreement"] == 1.0
    assert same["tokens"] == 16 + 3 and same["finite"]

    model = load_graph(tiny_graph.path)
    head = model.graph.initializers["lm_head.weight_t"]
    head.const_value = ir.Tensor(np.asarray(head.const_value.numpy()) * -3.0, name=head.name)
    out = tmp_path / "perturbed"
    out.mkdir()
    save_graph(model, out)
    link_folder_files(tiny_graph.path, out)
    shutil.copy2(tiny_graph.path / ARTIFACT_FILE, out / ARTIFACT_FILE)
    perturbed = compare_graphs(tiny_graph.path, out, steps=3)
    assert perturbed["max_abs_diff"] > 0.5
    assert perturbed["kl"] > 0.01
    assert perturbed["top1_agreement"] < 0.5


def test_parity_sessions_keep_the_weights_mapped_and_engines_prepack(tiny_graph: Artifact) -> None:
    """The parity checks open ONNX Runtime without MLAS prepacking (the weights held once, from
    the mapped data file); an engine session, which serves, keeps it."""
    from pipeline.core.engine import graph_io
    from pipeline.runtime.ort import OrtModel
    from pipeline.runtime.parity import _parity_model

    def prepacking(model: OrtModel) -> bool:
        options = model.session.get_session_options()
        try:
            return options.get_session_config_entry("session.disable_prepacking") != "1"
        except RuntimeError:  # not set: ONNX Runtime's default, prepacking on
            return True

    assert not prepacking(_parity_model(tiny_graph.path, "all"))
    assert prepacking(OrtModel(tiny_graph.path / "model.onnx", graph_io(tiny_graph.path)))
