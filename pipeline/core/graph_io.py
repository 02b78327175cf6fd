"""One graph API for the graph passes (issue 21, item 4): open a graph folder with its weights left
on disk, rewrite it, and write it back with the unchanged weights linked, not copied.

On onnx-ir (``onnx_ir``, the ONNX project's in-memory IR, which the onnxscript rewriter and our
fusion rules already use):

- :func:`load_graph`: ``onnx_ir.load`` keeps every external initializer an ``ExternalTensor``
  (memory-mapped on first touch, never read before), so a pass holds only the tensors it changes.
- :func:`save_graph`: writes ``model.onnx`` and its external data. A source data file whose every
  tensor the output still references unchanged (same file, same offsets) is hard-linked into the
  output folder (copied only across file systems, as ``pipeline.core.artifacts.link_tree``); every
  other tensor (new, changed, or kept from a partly changed file) goes to new shard files of at
  most ``shard_bytes`` each, through onnx-ir's own writer (``convert_tensors_to_external``: it
  streams an external tensor's bytes with ``copy_file_range``, never through Python memory).
  No file lands in the output that no tensor references.
- :func:`link_folder_files`: the folder's other files (tokenizer, config, ``extras/``) hard-linked.
- :func:`unreferenced_data_files` / :func:`check_data_files`: every graph pass's ``ensures``
  refuses an output folder holding an external-data file no tensor references.
- :func:`compare_graphs`: the one parity check of the graph passes: a prompt prefilled and ``steps``
  greedy decode steps with the KV cache, through real ONNX Runtime sessions, reporting max |logit
  difference|, mean KL(reference || candidate) and top-1 agreement.

Hard links and onnx's loaders: ``onnx.load`` and onnx-ir refuse an external-data file with more
than one hard link (a guard against a link to a file outside the model folder planted by someone
with write access to it). Our graph folders are cache entries the pipeline writes, and sharing
their unchanged files between entries by hard links is what keeps a build's disk use at one copy
of the weights, so :func:`load_graph` keeps onnx-ir's containment checks (the path, and the path
with symlinks resolved, must stay inside the folder) and drops only the link-count one. Code that
reads weights of a graph folder must go through :func:`load_graph` (``onnx.load(...,
load_external_data=False)`` is fine for structure); ONNX Runtime itself loads such folders.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.artifacts import ARTIFACT_FILE, read_metadata
from pipeline.core.errors import PassError

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
# Tensors below this many bytes stay inline in model.onnx (as the passes' onnx.save_model did).
INLINE_BYTES = 1024
# New external data is written in shards of at most this size (a tensor is never split).
SHARD_BYTES = 1 << 30
DATA_SUFFIXES = (".data", ".onnx_data")


def model_file(folder: Path) -> str:
    """The ONNX file of a graph/engine folder (``artifact.json``'s ``model_file``)."""
    return str(read_metadata(folder).get("model_file", MODEL_FILE))


# --------------------------------------------------------------------------------------------
# Loading


def _linked_external_tensor_class() -> type:
    import onnx_ir as ir

    class LinkedExternalTensor(ir.ExternalTensor):
        """An ``ExternalTensor`` whose data file may have several hard links (see the module
        docstring); onnx-ir's path-containment checks still apply."""

        __slots__ = ()

        def _check_path_containment(self) -> None:
            if not self._base_dir:
                return
            base = os.path.realpath(os.fspath(self._base_dir))
            for path, root in ((os.path.abspath(self.path), os.path.abspath(self._base_dir)),
                               (os.path.realpath(self.path), base)):  # fmt: skip
                if os.path.commonpath([path, root]) != root:
                    raise ValueError(
                        f"External data location '{self._location}' resolves to '{path}', outside the "
                        f"model folder '{root}'"
                    )

    return LinkedExternalTensor


_LINKED: type | None = None


def _linked_class() -> type:
    global _LINKED
    if _LINKED is None:
        _LINKED = _linked_external_tensor_class()
    return _LINKED


def _all_tensors(model: Any) -> Iterator[Any]:
    """Every tensor of ``model``: initializers of all graphs and tensor attributes."""
    import onnx_ir as ir

    for graph in model.graphs():
        for value in graph.initializers.values():
            if value.const_value is not None:
                yield value.const_value
        for node in graph:
            for attr in node.attributes.values():
                if attr.is_ref() or attr.value is None:
                    continue
                if attr.type == ir.AttributeType.TENSOR:
                    yield attr.value
                elif attr.type == ir.AttributeType.TENSORS:
                    yield from attr.value


def graph_ops(model_file: Path) -> set[str]:
    """Op types of an ONNX graph (weights not loaded)."""
    import onnx

    return {node.op_type for node in onnx.load(str(model_file), load_external_data=False).graph.node}


def graph_layer_windows(model_file: Path) -> dict[int, int]:
    """Each layer's ``GroupQueryAttention`` ``local_window_size`` (-1: unbounded), keyed by the
    layer of its past key, the graph input ``past_key_values.<layer>.key`` (through a ``Cast``,
    as an fp16 graph with fp32 IO has it); kernels whose layer cannot be told are left out."""
    import re

    import onnx

    graph = onnx.load(str(model_file), load_external_data=False).graph
    producers = {output: node for node in graph.node for output in node.output}
    windows: dict[int, int] = {}
    for node in graph.node:
        if node.op_type != "GroupQueryAttention" or len(node.input) <= 3:
            continue
        past = node.input[3]
        while past in producers and producers[past].op_type == "Cast":
            past = producers[past].input[0]
        match = re.fullmatch(r"past_key_values\.(\d+)\.key", past)
        if match is not None:
            window = next((a.i for a in node.attribute if a.name == "local_window_size"), -1)
            windows[int(match.group(1))] = int(window)
    return windows


def load_graph(folder: Path, name: str | None = None) -> Any:
    """The graph of ``folder`` as an ``onnx_ir.Model`` whose external initializers stay on disk
    (``ExternalTensor``, memory-mapped when a pass first reads one, never before)."""
    import onnx_ir as ir

    folder = Path(folder)
    path = folder / (name or model_file(folder))
    if not path.is_file():
        raise PassError(f"{folder} holds no {path.name}: not a graph folder")
    model = ir.load(path)
    linked = _linked_class()
    for tensor in _all_tensors(model):
        if type(tensor) is ir.ExternalTensor:
            tensor.__class__ = linked
    return model


def load_proto(folder: Path, name: str | None = None) -> Any:
    """The graph of ``folder`` as an ``onnx.ModelProto`` with its weights read into it, for code
    that needs protobuf (ONNX Runtime's float16 converter): one copy of the weights in memory.
    ``onnx.load`` refuses our hard-linked data files; this reads each tensor's bytes itself,
    inside the folder only (the same containment as :func:`load_graph`)."""
    import onnx

    folder = Path(folder)
    path = folder / (name or model_file(folder))
    proto = onnx.load(str(path), load_external_data=False)
    root = os.path.realpath(folder)
    handles: dict[str, Any] = {}
    try:
        for tensor in proto_tensors(proto.graph):
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {entry.key: entry.value for entry in tensor.external_data}
            file = os.path.realpath(folder / info["location"])
            if os.path.commonpath([file, root]) != root:
                raise PassError(f"{path}: external data {info['location']} lies outside {folder}")
            if file not in handles:
                handles[file] = open(file, "rb")  # noqa: SIM115 - closed below
            handle = handles[file]
            handle.seek(int(info.get("offset", 0)))
            length = int(info["length"]) if "length" in info else -1
            tensor.raw_data = handle.read(length)
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
    finally:
        for handle in handles.values():
            handle.close()
    return proto


def proto_tensors(graph: Any) -> Iterator[Any]:
    """Every TensorProto of an ONNX graph: initializers (sparse ones too) and those in node
    attributes, subgraphs included."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from proto_tensors(attr.g)
            for sub in attr.graphs:
                yield from proto_tensors(sub)


# --------------------------------------------------------------------------------------------
# Saving


@dataclass
class SaveStats:
    """What :func:`save_graph` put on disk: bytes written anew, hard-linked, copied (across file
    systems), and the external-data files of the output."""

    written_bytes: int = 0
    linked_bytes: int = 0
    copied_bytes: int = 0
    data_files: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "written_bytes": self.written_bytes,
            "linked_bytes": self.linked_bytes,
            "copied_bytes": self.copied_bytes,
            "data_files": list(self.data_files),
        }


def external_refs(folder: Path) -> dict[str, set[tuple[int, int]]]:
    """``{location: {(offset, length)}}`` of every external tensor the ONNX files of ``folder``
    reference (protos read without their data)."""
    refs: dict[str, set[tuple[int, int]]] = {}
    for path in sorted(Path(folder).glob("*.onnx")):
        for location, offset, length in _proto_refs(path):
            refs.setdefault(location, set()).add((offset, length))
    return refs


def _proto_refs(path: Path) -> Iterator[tuple[str, int, int]]:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    for tensor in proto_tensors(proto.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        yield info["location"], int(info.get("offset", 0)), int(info.get("length", -1))


def _link_or_copy(source: Path, target: Path) -> bool:
    """Hard-link ``source`` as ``target``; copy where a link cannot be made (another file system,
    a file system without hard links, the link-count limit). True when linked. An existing
    ``target`` is an error, never overwritten."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
        return True
    except OSError as error:
        if error.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    shutil.copy2(source, target)
    return False


def _shard_names(count: int, taken: set[str], name: str) -> list[str]:
    """Names of ``count`` new data files for graph file ``name``, none of them in ``taken``
    (deterministic): ``model.onnx.data`` alone, ``model-00001-of-00003.data``... when sharded."""
    stem = name.removesuffix(".onnx")
    generation = 0
    while True:
        base = stem if generation == 0 else f"{stem}.{generation}"
        names = (
            [f"{base}.onnx.data"]
            if count == 1
            else [f"{base}-{i:05d}-of-{count:05d}.data" for i in range(1, count + 1)]
        )
        if not taken.intersection(names):
            return names
        generation += 1


def _shards(tensors: Sequence[Any], shard_bytes: int) -> list[list[Any]]:
    groups: list[list[Any]] = [[]]
    size = 0
    for tensor in tensors:
        if groups[-1] and size + tensor.nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    return groups if groups[0] else []


def save_graph(
    model: Any,
    out_dir: Path,
    *,
    name: str = MODEL_FILE,
    source_dirs: Iterable[Path] | None = None,
    shard_bytes: int = SHARD_BYTES,
    inline_bytes: int = INLINE_BYTES,
) -> SaveStats:
    """Write ``model`` as ``out_dir/name`` plus external data (see the module docstring): data
    files of ``source_dirs`` (default: every folder the model's external tensors live in) that the
    model still references in full are hard-linked; all other tensors of at least
    ``inline_bytes`` go to new shard files of at most ``shard_bytes`` each (named after ``name``,
    avoiding the linked files' names); smaller ones stay inline. The model's initializers point at
    the output folder's files afterwards. ``out_dir`` must be empty of data files."""
    import onnx_ir as ir
    from onnx_ir.external_data import convert_tensors_to_external

    out_dir = Path(out_dir)
    linked_class = _linked_class()
    tensors = list({id(t): t for t in _all_tensors(model)}.values())  # a shared tensor once
    external = [t for t in tensors if isinstance(t, ir.ExternalTensor)]
    dirs = (
        {Path(d).resolve() for d in source_dirs}
        if source_dirs is not None
        else {Path(t.base_dir).resolve() for t in external if t.base_dir}
    )
    # Which source files the model references in full: every tensor offset their folder's graphs
    # referenced is still referenced (a tensor is identified by its file and offset).
    used: dict[tuple[Path, str], set[int]] = {}
    for tensor in external:
        if tensor.base_dir and Path(tensor.base_dir).resolve() in dirs:
            key = (Path(tensor.base_dir).resolve(), str(tensor.location))
            used.setdefault(key, set()).add(tensor.offset or 0)
    sources = {d: external_refs(d) for d in {d for d, _ in used}}
    whole = {
        key
        for key, offsets in used.items()
        if (wanted := sources[key[0]].get(key[1])) is not None and {o for o, _ in wanted} <= offsets
    }
    linked_names = {location for _, location in whole}
    if len(linked_names) < len(whole):
        whole = set()  # two source folders with a file of the same name: write everything anew
        linked_names = set()
    stats = SaveStats()
    for base, location in sorted(whole):
        source, target = base / location, out_dir / location
        size = source.stat().st_size
        with writing(target, f"the external data of {name}, linked or copied from {source}"):
            linked = _link_or_copy(source, target)
        if linked:
            stats.linked_bytes += size
        else:
            stats.copied_bytes += size
    # Repoint kept tensors at the output folder; collect the rest.
    to_write: list[Any] = []
    for tensor in tensors:
        if isinstance(tensor, ir.ExternalTensor) and tensor.base_dir:
            key = (Path(tensor.base_dir).resolve(), str(tensor.location))
            if key in whole:
                tensor.base_dir = str(out_dir)
                if type(tensor) is ir.ExternalTensor:
                    tensor.__class__ = linked_class
                continue
        if tensor.nbytes >= inline_bytes:
            to_write.append(tensor)
    _inline_small(model, inline_bytes, whole)
    groups = _shards(to_write, shard_bytes)
    names = _shard_names(len(groups), linked_names | {name}, name)
    written: dict[int, Any] = {}
    for group, shard in zip(groups, names, strict=True):
        size = sum(int(t.nbytes) for t in group) / 2**20
        with writing(out_dir / shard, f"the external data of {name}: {len(group)} tensors, {size:.1f} MiB"):
            converted = convert_tensors_to_external(group, out_dir, shard)
        for old, new in zip(group, converted, strict=True):
            new.__class__ = linked_class
            written[id(old)] = new
        stats.written_bytes += (out_dir / shard).stat().st_size
    _replace_tensors(model, written)
    with writing(out_dir / name, "the ONNX graph"):
        ir.save(model, out_dir / name)
    stats.data_files = tuple(sorted(linked_names | set(names)))
    return stats


@contextlib.contextmanager
def writing(path: Path, what: str) -> Iterator[None]:
    """An OSError raised while writing ``path`` names it and says what was being written (the
    note ``describe_os_error`` shows), with its reason: numpy's and onnx-ir's writers report a
    full disk as a bare ``OSError("2048 requested and 1024 written")`` with no errno and no
    path, so a short write is named for what caused it (disk full, or the file size limit)."""
    try:
        yield
    except OSError as exc:
        error = exc
        if exc.errno is None:
            code = _short_write_cause(path)
            error = OSError(
                code, os.strerror(code) if code != errno.EIO else f"short write ({exc})", str(path)
            )
        elif error.filename is None:
            error.filename = str(path)
        error.add_note(f"writing {what}")
        if error is exc:
            raise
        raise error from exc


def _short_write_cause(path: Path) -> int:
    """Why a write to ``path`` stopped short: ENOSPC (no space left), EFBIG (the file reached
    RLIMIT_FSIZE, ``ulimit -f``) or EIO (neither shows)."""
    import resource

    try:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and path.stat().st_size >= limit:
            return errno.EFBIG
        disk = os.statvfs(path.parent)
        if disk.f_bavail * disk.f_frsize < (1 << 20):  # what is left would not hold a tensor
            return errno.ENOSPC
    except OSError:
        pass
    return errno.EIO


def _inline_small(model: Any, inline_bytes: int, whole: set[tuple[Path, str]]) -> int:
    """Load external tensors below ``inline_bytes`` that are not in a linked file into memory
    (they are serialized inline in the ONNX file). Returns how many."""
    import onnx_ir as ir

    count = 0
    replacements: dict[int, Any] = {}
    for tensor in _all_tensors(model):
        if not isinstance(tensor, ir.ExternalTensor) or tensor.nbytes >= inline_bytes:
            continue
        if tensor.base_dir and (Path(tensor.base_dir).resolve(), str(tensor.location)) in whole:
            continue
        replacements[id(tensor)] = ir.Tensor(np.array(tensor.numpy()), dtype=tensor.dtype, name=tensor.name)
        count += 1
    _replace_tensors(model, replacements)
    return count


def _replace_tensors(model: Any, replacements: dict[int, Any]) -> None:
    import onnx_ir as ir

    if not replacements:
        return
    for graph in model.graphs():
        for value in graph.initializers.values():
            if id(value.const_value) in replacements:
                value.const_value = replacements[id(value.const_value)]
        for node in graph:
            for key, attr in list(node.attributes.items()):
                if attr.is_ref() or attr.value is None:
                    continue
                if attr.type == ir.AttributeType.TENSOR and id(attr.value) in replacements:
                    node.attributes[key] = ir.AttrTensor(key, replacements[id(attr.value)])
                elif attr.type == ir.AttributeType.TENSORS and any(id(t) in replacements for t in attr.value):
                    node.attributes[key] = ir.AttrTensors(
                        key, [replacements.get(id(t), t) for t in attr.value]
                    )


# --------------------------------------------------------------------------------------------
# The rest of the folder, and the check on data files


def data_files(folder: Path) -> set[str]:
    """Every file of ``folder`` (POSIX relative paths) that is external data: referenced by one of
    its ONNX files as a tensor location, or named like external data (``*.data``, ``*.onnx_data``)."""
    folder = Path(folder)
    names = set(external_refs(folder))
    for path in folder.rglob("*"):
        if path.is_file() and path.name.endswith(DATA_SUFFIXES):
            names.add(path.relative_to(folder).as_posix())
    return names


def unreferenced_data_files(folder: Path) -> list[str]:
    """External-data files of ``folder`` (``*.data``, ``*.onnx_data``) that no tensor of its ONNX
    files references: left-overs that would double the folder's size."""
    folder = Path(folder)
    referenced = set(external_refs(folder))
    return sorted(
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if path.is_file()
        and path.name.endswith(DATA_SUFFIXES)
        and path.relative_to(folder).as_posix() not in referenced
    )


def check_data_files(folder: Path, who: str) -> None:
    """``ensures`` of every graph pass: refuse an output with an unreferenced external-data file,
    or a referenced one that is missing."""
    folder = Path(folder)
    stale = unreferenced_data_files(folder)
    if stale:
        raise PassError(
            f"{who}: {folder / stale[0]} is external data no tensor of the graph references "
            f"({len(stale)} such file(s)); a pass must not leave unreferenced weights behind"
        )
    missing = sorted(location for location in external_refs(folder) if not (folder / location).is_file())
    if missing:
        raise PassError(f"{who}: {folder / missing[0]} is referenced by the graph but missing")


def check_model(path: Path) -> None:
    """``onnx.checker.check_model(..., full_check=True)`` on the graph of ``path`` without reading
    its weights: the checker refuses external data with several hard links (our linked files),
    so each external initializer is checked as a graph input of its type and shape instead."""
    import onnx
    from onnx import helper

    proto = onnx.load(str(path), load_external_data=False)
    graph = proto.graph
    external = [t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    kept = [t for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    inputs = {i.name for i in graph.input}
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.input.extend(
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in external
        if t.name not in inputs
    )
    onnx.checker.check_model(proto, full_check=True)


def new_initializer(graph: Any, name: str, array: np.ndarray) -> Any:
    """Register ``array`` as the initializer ``name`` of the onnx-ir ``graph``; its value."""
    import onnx_ir as ir

    tensor = ir.Tensor(array, name=name)
    value = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


def link_folder_files(source: Path, out_dir: Path, skip: Iterable[str] = ()) -> None:
    """Hard-link (copy across file systems) the files of graph folder ``source`` that are not the
    graph (tokenizer, config, ``extras/``...) into ``out_dir``: everything except its ONNX files,
    its external data, ``artifact.json`` and the top-level names in ``skip``."""
    source, out_dir = Path(source), Path(out_dir)
    excluded = set(skip) | {ARTIFACT_FILE} | data_files(source)
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source).as_posix()
        if not path.is_file() or (path.suffix == ".onnx" and path.parent == source):
            continue
        if rel in excluded or rel.split("/", 1)[0] in excluded:
            continue
        if (out_dir / rel).exists():
            continue
        _link_or_copy(path, out_dir / rel)


def link_graph_folder(source: Path, out_dir: Path, skip: Iterable[str] = ()) -> SaveStats:
    """``out_dir`` as a hard-linked copy of graph folder ``source`` (graph and data files
    included, ``artifact.json`` and ``skip`` excepted): for passes that change no tensor."""
    source, out_dir = Path(source), Path(out_dir)
    stats = SaveStats()
    skipped = set(skip) | {ARTIFACT_FILE}
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source).as_posix()
        if not path.is_file() or rel.split("/", 1)[0] in skipped:
            continue
        if _link_or_copy(path, out_dir / rel):
            stats.linked_bytes += path.stat().st_size
        else:
            stats.copied_bytes += path.stat().st_size
    stats.data_files = tuple(sorted(external_refs(out_dir)))
    return stats


__all__ = [
    "DATA_FILE",
    "MODEL_FILE",
    "SaveStats",
    "check_data_files",
    "link_folder_files",
    "link_graph_folder",
    "load_graph",
    "new_initializer",
    "save_graph",
    "unreferenced_data_files",
]
