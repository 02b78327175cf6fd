"""The ``engine.json`` contract: what the export records about a decoder's inputs and outputs
(:class:`IOSpec`, in ``artifact.json``) and the file an engine folder is known by. The export
writes it, the builders (ONNX Runtime and TensorRT) copy it into the engine, and the runtime reads
it; so it lives in the kernel, below all three.

``engine.json`` is untrusted input (engine folders lie on shared storage, and come from the
registry): :func:`read_engine_spec` is its one reader, an :class:`EngineSpec` of typed,
range-checked fields whose every named file is confined to the folder, checked before anything
is loaded (by the runtime's ``Engine``, the benchmark, the gate, the registry, speculative
drafts).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from pipeline.core.artifacts import read_metadata
from pipeline.core.errors import EngineError, first_line
from pipeline.core.files import (
    UnsafeFileError,
    confined,
    loads_bounded,
    read_json,
    read_regular,
    read_regular_text,
    regular_size,
)

ENGINE_FILE = "engine.json"
KV_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8, "float8_e4m3fn": np.uint8}
# Cache types numpy has no dtype for: held on the host as their raw 8-bit codes (uint8) and
# handed to ONNX Runtime with the ONNX element type (onnx.TensorProto.FLOAT8E4M3FN = 17).
KV_ONNX_ELEMENT_TYPES = {"float8_e4m3fn": 17}
# The extra input of an int8-KV engine's prefill graph (``prefill_model_file``,
# passes/fusion/int8_prefill.py): [batch, k] indices into the step's tokens whose logits it computes.
LOGITS_POSITIONS = "logits_positions"


@dataclass(frozen=True)
class IOSpec:
    """Names and shapes of the decoder's inputs and outputs (ONNX Runtime GenAI convention)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    kv_dtype: str = "float32"
    has_position_ids: bool = True
    # False once attention is fused into a kernel that masks causally from sequence lengths only
    # (GroupQueryAttention): such a graph takes right padding, not left-padded batches.
    left_padding: bool = True
    # "concat": present = past + new tokens, a new tensor each step. "shared": one buffer per
    # layer of the engine's max_length, bound as past and present (updated in place).
    kv_layout: str = "concat"
    # Sliding-window attention bound (0: none); the graph enforces it, recorded for consumers.
    window: int = 0
    # Positions of each layer's shared buffer that keeps only that layer's window (0, or empty
    # for every layer: the engine's max_length); GroupQueryAttention evicts the oldest rows in
    # place. Gemma 3's local layers keep their window, its global ones max_length.
    kv_capacity: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Records written before buffers were per layer hold one int for every layer (0: none),
        # and JSON gives a list: both read as the tuple.
        capacity = self.kv_capacity
        if isinstance(capacity, int):
            capacity = (capacity,) * self.num_layers if capacity else ()
        object.__setattr__(self, "kv_capacity", tuple(capacity))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IOSpec:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def layer_capacity(self, layer: int, max_length: int) -> int:
        """Positions of layer ``layer``'s shared buffer: its window buffer, else ``max_length``."""
        return (self.kv_capacity[layer] if self.kv_capacity else 0) or max_length

    def past_names(self) -> list[str]:
        return [f"past_key_values.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]

    def present_names(self) -> list[str]:
        return [f"present.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]

    def kv_itemsize(self) -> int:
        """Bytes one cached key or value element takes."""
        return np.dtype(KV_NUMPY_DTYPES[self.kv_dtype]).itemsize


def graph_io(folder: Path) -> IOSpec:
    """The IO spec recorded in a graph or engine artifact folder."""
    metadata = read_metadata(folder)
    if "io" not in metadata:
        raise EngineError(f"{folder} records no IO spec (artifact.json): re-export it")
    return IOSpec.from_dict(metadata["io"])


# --------------------------------------------------------------------------------------------
# engine.json, read as untrusted input


TARGETS = ("ort-cpu", "ort-cuda", "ort-trt", "tensorrt")
KV_LAYOUTS = ("concat", "shared")
OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")
# The first execution provider each ONNX Runtime target runs on.
TARGET_PROVIDERS = {
    "ort-cpu": "CPUExecutionProvider",
    "ort-cuda": "CUDAExecutionProvider",
    "ort-trt": "TensorrtExecutionProvider",
}
# What a provider option's value is a cache folder of: only the runtime's own (ORT_TRT_CACHE).
CACHE_PLACEHOLDER = "{cache}"
# Files transformers reads from an engine folder as its tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
# The tokenizer files whose token ids are checked against the graph's vocabulary
# (:func:`check_tokenizer_ids`), each read bounded: tokenizer.json and vocab.json hold the whole
# vocabulary (megabytes for a large one), the others a few kilobytes.
TOKENIZER_JSON_MAX_BYTES = 256 << 20
TOKENIZER_CONFIG_MAX_BYTES = 16 << 20
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
MAX_ENGINE_JSON_BYTES = 4 << 20
MAX_GRAPH_BYTES = 2 << 30  # protobuf's limit: larger weights are external data
SPECULATIVE_K_MAX = 64
_SHAPES = re.compile(r"[A-Za-z0-9_.]+:\d+(x\d+)*(,[A-Za-z0-9_.]+:\d+(x\d+)*)*")
_KNOWN_KEYS = frozenset(
    {
        "schema_version",
        "target",
        "providers",
        "provider_options",
        "model_file",
        "prefill_model_file",
        "io",
        "kv_cache",
        "tokens",
        "max_length",
        "session",
        "tensorrt",
        "speculative",
    }
)


def _int_option(low: int, high: int) -> Callable[[Any], bool]:
    return lambda value: type(value) is int and low <= value <= high


def _is_bool(value: Any) -> bool:
    return type(value) is bool


def _one_of(*choices: str) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, str) and value in choices


def _shapes(value: Any) -> bool:
    return isinstance(value, str) and len(value) < 1 << 16 and _SHAPES.fullmatch(value) is not None


_DEVICE = {"device_id": (_int_option(0, 64), "an integer 0..64")}
_BOOL = (_is_bool, "true or false")
# Execution providers an engine may name, each with the options it may set and what each takes.
PROVIDER_OPTIONS: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "CPUExecutionProvider": {},
    "CUDAExecutionProvider": {
        **_DEVICE,
        "gpu_mem_limit": (_int_option(1, 1 << 50), "a byte count"),
        "arena_extend_strategy": (
            _one_of("kNextPowerOfTwo", "kSameAsRequested"),
            "kNextPowerOfTwo or kSameAsRequested",
        ),
        "cudnn_conv_algo_search": (
            _one_of("EXHAUSTIVE", "HEURISTIC", "DEFAULT"),
            "EXHAUSTIVE, HEURISTIC or DEFAULT",
        ),
        "do_copy_in_default_stream": _BOOL,
        "enable_cuda_graph": _BOOL,
        "use_tf32": _BOOL,
    },
    "TensorrtExecutionProvider": {
        **_DEVICE,
        "trt_max_workspace_size": (_int_option(1, 1 << 50), "a byte count"),
        "trt_builder_optimization_level": (_int_option(0, 5), "an integer 0..5"),
        "trt_engine_cache_enable": _BOOL,
        "trt_timing_cache_enable": _BOOL,
        # a folder ONNX Runtime writes to: only the runtime's own cache (resolved on the machine)
        "trt_engine_cache_path": (_one_of(CACHE_PLACEHOLDER), f"{CACHE_PLACEHOLDER!r}"),
        "trt_timing_cache_path": (_one_of(CACHE_PLACEHOLDER), f"{CACHE_PLACEHOLDER!r}"),
        "trt_profile_min_shapes": (_shapes, "name:AxB,... shapes"),
        "trt_profile_opt_shapes": (_shapes, "name:AxB,... shapes"),
        "trt_profile_max_shapes": (_shapes, "name:AxB,... shapes"),
        "trt_fp16_enable": _BOOL,
        "trt_int8_enable": _BOOL,
        "trt_cuda_graph_enable": _BOOL,
        "trt_max_partition_iterations": (_int_option(1, 1 << 20), "an integer 1.."),
        "trt_min_subgraph_size": (_int_option(1, 1 << 20), "an integer 1.."),
    },
}


@dataclass(frozen=True)
class TokenSpec:
    """Special tokens of the engine's tokenizer (``engine.json`` ``tokens``)."""

    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None


@dataclass(frozen=True)
class DraftSpec:
    """``engine.json`` ``speculative``: the draft engine's folder (inside this one) and ``k``."""

    draft: str
    k: int
    folder: Path


@dataclass(frozen=True)
class EngineSpec:
    """An engine folder's ``engine.json``, every field typed and range-checked and every file it
    names resolved inside the folder (:func:`read_engine_spec`)."""

    folder: Path
    target: str
    model_file: str
    model_path: Path
    io: IOSpec
    max_length: int
    tokens: TokenSpec
    providers: tuple[str, ...] = ()
    provider_options: tuple[dict[str, Any], ...] | None = None
    prefill_model_file: str | None = None
    prefill_model_path: Path | None = None
    intra_op_num_threads: int = 0
    graph_optimization_level: str = "all"
    kv_cache: dict[str, Any] = field(default_factory=dict, compare=False)
    tensorrt: dict[str, Any] | None = field(default=None, compare=False)
    speculative: DraftSpec | None = None
    schema_version: int = 1
    # The JSON as read (checked): consumers that copy or compare it (attach_draft, check_draft).
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def path(self) -> Path:
        return self.folder / ENGINE_FILE


class _Fields:
    """Typed reads of one JSON object of ``engine.json``, each refusal one line naming the field."""

    def __init__(self, data: Any, where: str, prefix: str = "") -> None:
        self.where, self.prefix = where, prefix
        if not isinstance(data, dict):
            raise self.error(f"{prefix.rstrip('.') or 'the file'} is {_kind(data)}, not a JSON object")
        self.data = data

    def error(self, message: str) -> EngineError:
        return EngineError(f"{self.where}: {message}: rebuild the engine")

    def bad(self, key: str, wanted: str) -> EngineError:
        return self.error(f"{self.prefix}{key}={_shown(self.data[key])} must be {wanted}")

    def integer(self, key: str, low: int, high: int, default: int | None = None) -> int:
        if key not in self.data:
            if default is None:
                raise self.error(f"{self.prefix}{key} is missing")
            return default
        value = self.data[key]
        if type(value) is not int or not low <= value <= high:
            raise self.bad(key, f"an integer from {low} to {high}")
        return value

    def capacities(self, key: str, layers: int) -> tuple[int, ...]:
        """Window-buffer positions, one per layer (empty: none); a record's single int (every
        layer, written before buffers were per layer) reads as that many."""
        value = self.data.get(key, [])
        if type(value) is int:
            value = [value] * layers if value else []
        if (
            not isinstance(value, list)
            or len(value) not in (0, layers)
            or any(type(size) is not int or not (size == 0 or 2 <= size <= 1 << 24) for size in value)
        ):
            raise self.bad(key, f"a list of {layers} integers, each 0 or from 2 to {1 << 24} (one per layer)")
        return tuple(value) if any(value) else ()

    def boolean(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if type(value) is not bool:
            raise self.bad(key, "true or false")
        return value

    def choice(self, key: str, choices: Sequence[str], default: str | None = None) -> str:
        if key not in self.data and default is not None:
            return default
        if key not in self.data:
            raise self.error(f"{self.prefix}{key} is missing")
        value = self.data[key]
        if not isinstance(value, str) or value not in choices:
            raise self.bad(key, f"one of {', '.join(choices)}")
        return value

    def optional_token(self, key: str, vocab: int) -> int | None:
        value = self.data.get(key)
        if value is None:
            return None
        if type(value) is not int or not 0 <= value < vocab:
            raise self.bad(key, f"a token id from 0 to {vocab - 1} (the vocabulary) or null")
        return value

    def mapping(self, key: str, required: bool = False) -> dict[str, Any] | None:
        if key not in self.data or (self.data[key] is None and not required):
            if required:
                raise self.error(f"{self.prefix}{key} is missing")
            return None
        value = self.data[key]
        if not isinstance(value, dict):
            raise self.bad(key, "a JSON object")
        return value


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "null" if value is None else f"a {type(value).__name__}"
    )


def _shown(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else _kind(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_io(data: Any, where: str) -> IOSpec:
    """``engine.json`` ``io``, checked field by field (the export's :class:`IOSpec`)."""
    io = _Fields(data, where, "io.")
    return IOSpec(
        num_layers=io.integer("num_layers", 1, 4096),
        num_kv_heads=io.integer("num_kv_heads", 1, 4096),
        head_dim=io.integer("head_dim", 1, 4096),
        vocab_size=io.integer("vocab_size", 1, 1 << 24),
        kv_dtype=io.choice("kv_dtype", tuple(KV_NUMPY_DTYPES), "float32"),
        has_position_ids=io.boolean("has_position_ids", True),
        left_padding=io.boolean("left_padding", True),
        kv_layout=io.choice("kv_layout", KV_LAYOUTS, "concat"),
        window=io.integer("window", 0, 1 << 24, 0),
        kv_capacity=io.capacities("kv_capacity", io.integer("num_layers", 1, 4096)),
    )


def confined_file(folder: Path, name: Any, where: str, what: str, base: Path | None = None) -> Path:
    """The regular file ``name`` (a relative path from ``engine.json``, or from a graph: relative
    to ``base``, the graph's folder) inside ``folder``, every symlink resolved and confined to it;
    one line naming it otherwise."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise EngineError(f"{where}: {what} {_shown(name)} is not a file name: rebuild the engine")
    rel = PurePosixPath(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise EngineError(
            f"{where}: {what} {name!r} leaves the engine folder {folder}: "
            "every file it names must be inside it"
        )
    path = (base or folder) / rel
    try:
        regular_size(path, within=folder, what=what)
    except FileNotFoundError:
        raise EngineError(
            f"{where}: {what} {path} is missing: the engine folder is incomplete, rebuild it"
        ) from None
    except UnsafeFileError as exc:
        raise EngineError(f"{where}: {what}: {exc}") from None
    except OSError as exc:
        raise EngineError(f"{where}: {what} {path} is unreadable ({exc.strerror or exc})") from None
    return path


def check_graph_file(path: Path, folder: Path, where: str, vocab_size: int | None = None) -> None:
    """Open the ONNX graph at ``path`` (its protobuf, without the weights) and confine every
    external-data location it names to ``folder``: a regular file there, long enough for the
    offset and length each tensor records. With ``vocab_size`` (``io.vocab_size``), the
    vocabulary the graph declares (:func:`graph_vocab_sizes`) must be that. One line for a graph
    that cannot be parsed or disagrees."""
    import onnx

    try:
        data = read_regular(path, max_bytes=MAX_GRAPH_BYTES, within=folder, what="an engine graph")
        proto = onnx.load_model_from_string(data)
    except UnsafeFileError as exc:
        raise EngineError(f"{where}: {exc}") from None
    except OSError as exc:
        raise EngineError(f"{where}: {path} is unreadable ({exc.strerror or exc})") from None
    except Exception as exc:  # protobuf's DecodeError and onnx's own: the bytes are no ONNX model
        raise EngineError(
            f"{where}: {path} is not a readable ONNX graph ({first_line(exc)}): rebuild the engine"
        ) from None
    if not proto.graph.node or not proto.graph.output:
        raise EngineError(f"{where}: {path} is an ONNX graph with no nodes or outputs: rebuild the engine")
    sizes: dict[str, int] = {}
    for tensor in _external_tensors(proto.graph, onnx.TensorProto.EXTERNAL):
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location")
        what = f"external data of tensor {tensor.name!r} in {path.name}"
        if location not in sizes:
            data = confined_file(folder, location, where, what, base=path.parent)
            sizes[str(location)] = regular_size(data, within=folder, what=what)
        try:
            offset, length = int(info.get("offset", 0)), int(info.get("length", 0))
        except ValueError:
            raise EngineError(
                f"{where}: {what}: offset/length are not integers: rebuild the engine"
            ) from None
        if offset < 0 or length < 0 or offset + length > sizes[str(location)]:
            raise EngineError(
                f"{where}: {what}: bytes {offset}..{offset + length} lie past the end of {location} "
                f"({sizes[str(location)]} bytes): the engine folder is truncated, rebuild it"
            )
    if vocab_size is not None:
        for what, size in graph_vocab_sizes(proto.graph):
            if size != vocab_size:
                raise EngineError(
                    f"{where}: {path} has a vocabulary of {size} tokens ({what}), but io.vocab_size is "
                    f"{vocab_size}: the graph is not this engine's; rebuild the engine"
                )


# Ops a token-id tensor or an embedding table passes through unchanged in its first dimension
# (a cast of the ids to int32, an fp16 table cast up, a QDQ table dequantized).
_PASS_THROUGH = {"Cast", "Identity", "DequantizeLinear"}
# Embedding lookups by the token ids: op type -> (attribute naming the gathered axis, its default).
_GATHERS = {"Gather": ("axis", 0), "GatherBlockQuantized": ("gather_axis", 0)}


def graph_vocab_sizes(graph: Any) -> list[tuple[str, int]]:
    """The vocabulary sizes a decoder graph declares statically, each with where it is read:
    the last dimension of its ``logits`` output ([batch, tokens, vocab]: another rank is no
    decoder's), and the gathered dimension of each embedding table ``input_ids`` index (a
    ``Gather`` or ``GatherBlockQuantized`` of an initializer or constant, through casts and
    dequantization). A size not fixed in the protobuf is left out."""
    found: list[tuple[str, int]] = []
    for output in graph.output:
        if output.name == "logits" and output.type.HasField("tensor_type"):
            dims = output.type.tensor_type.shape.dim
            if len(dims) == 3 and dims[-1].HasField("dim_value") and dims[-1].dim_value > 0:
                found.append(("the last dimension of its logits output", int(dims[-1].dim_value)))
    tables: dict[str, list[int]] = {t.name: list(t.dims) for t in graph.initializer}
    producers: dict[str, Any] = {}
    for node in graph.node:
        for name in node.output:
            producers[name] = node
        if node.op_type == "Constant" and node.output:
            for attr in node.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    tables[node.output[0]] = list(attr.t.dims)
    ids = {"input_ids"}
    for node in graph.node:  # topological order: a cast of the ids comes before its consumers
        if node.op_type in _PASS_THROUGH and node.input and node.input[0] in ids:
            ids.update(node.output)
        gather = _GATHERS.get(node.op_type)
        if gather is None or len(node.input) < 2 or node.input[1] not in ids:
            continue
        table = _table_dims(node.input[0], tables, producers)
        attr = next((a for a in node.attribute if a.name == gather[0]), None)
        axis = int(attr.i) if attr is not None else gather[1]
        if not table or not -len(table) <= axis < len(table):
            continue
        axis %= len(table)
        # a 4-bit table packed two to a byte halves its quantized (last) axis, never the gathered one
        if node.op_type == "GatherBlockQuantized" and axis == len(table) - 1:
            continue
        if table[axis] > 0:
            found.append((f"the embedding table {node.input[0]!r} {node.op_type} indexes", table[axis]))
    return found


def _table_dims(name: str, tables: dict[str, list[int]], producers: dict[str, Any]) -> list[int] | None:
    """The static shape of the tensor ``name``: an initializer or constant, followed back through
    :data:`_PASS_THROUGH` ops a few steps; None when it is computed."""
    for _ in range(4):
        if name in tables:
            return tables[name]
        node = producers.get(name)
        if node is None or node.op_type not in _PASS_THROUGH or not node.input:
            return None
        name = node.input[0]
    return None


def _external_tensors(graph: Any, external: int) -> Iterator[Any]:
    tensors = [*graph.initializer]
    for sparse in graph.sparse_initializer:
        tensors += [sparse.values, sparse.indices]
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                tensors.append(attr.t)
            tensors.extend(attr.tensors)
            if attr.HasField("g"):
                yield from _external_tensors(attr.g, external)
            for sub in attr.graphs:
                yield from _external_tensors(sub, external)
    yield from (t for t in tensors if t.data_location == external)


# --------------------------------------------------------------------------------------------
# the tokenizer's token ids, read from its files (no transformers) against the graph's vocabulary


@dataclass
class _Worst:
    """The largest token id past the vocabulary found so far, and where."""

    vocab_size: int
    id: int = -1
    token: str | None = None
    path: Path | None = None
    highest: int = -1  # the largest id any file gives
    known: set[str] = field(default_factory=set)  # every token some file gives an id


def check_tokenizer_ids(folder: Path, vocab_size: int) -> None:
    """Refuse, in one line, an engine folder whose tokenizer gives a token an id the graph has no
    row for (``io.vocab_size``: ONNX Runtime's ``Gather`` would fail at the first generation) or
    an id that is not a non-negative integer. The ids are read from the files themselves, bounded,
    without transformers: ``tokenizer.json`` (``model.vocab``: token -> id, or Unigram's list of
    [piece, score] whose index is the id; ``added_tokens[].id``), ``tokenizer_config.json``
    (``added_tokens_decoder``'s keys), ``added_tokens.json`` and ``vocab.json``; the special tokens
    ``tokenizer_config.json`` and ``special_tokens_map.json`` name are named in the message, and
    one that no file gives an id (transformers adds it after the largest) must fit too. A
    tokenizer smaller than the vocabulary is normal (a padded embedding table); a binary
    ``tokenizer.model`` (SentencePiece) is not read."""
    roles: dict[str, str] = {}
    worst = _Worst(vocab_size)
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        data = _tokenizer_file(folder, name, TOKENIZER_CONFIG_MAX_BYTES)
        for key in SPECIAL_TOKEN_KEYS if data is not None else ():
            value = data.get(key)
            content = value.get("content") if isinstance(value, dict) else value
            if isinstance(content, str):
                roles.setdefault(content, f"{key} in {name}")
        if name == "tokenizer_config.json" and data is not None:
            _added_tokens_decoder(folder / name, data.get("added_tokens_decoder"), worst)
    for name in ("added_tokens.json", "vocab.json"):
        data = _tokenizer_file(folder, name, TOKENIZER_JSON_MAX_BYTES)
        for token, value in (data or {}).items():
            _note(folder / name, "", token, value, worst)
    data = _tokenizer_file(folder, "tokenizer.json", TOKENIZER_JSON_MAX_BYTES)
    if data is not None:
        _tokenizer_json(folder / "tokenizer.json", data, worst)
    if worst.path is not None:
        role = roles.get(worst.token) if worst.token is not None else None
        shown = f" ({_shown_token(worst.token)}{f', the {role}' if role else ''})" if worst.token else ""
        raise EngineError(
            f"{worst.path}: token id {worst.id}{shown} is past the graph's vocabulary of {vocab_size} "
            f"(io.vocab_size in {ENGINE_FILE}): the tokenizer is not this engine's; rebuild the engine"
        )
    # A special token no file gives an id: transformers adds it after the largest id when it loads.
    missing = [token for token in roles if token not in worst.known] if worst.highest >= 0 else []
    if missing and worst.highest + len(missing) >= vocab_size:
        token = missing[-1]
        raise EngineError(
            f"{folder}: the {roles[token]} {_shown_token(token)} is in no vocabulary of the tokenizer, so "
            f"transformers would add it as token id {worst.highest + len(missing)}, past the graph's "
            f"vocabulary of {vocab_size} (io.vocab_size in {ENGINE_FILE}): rebuild the engine"
        )


# The tokenizer files check_tokenizer_ids reads, and the checks that passed, by those files'
# identities (device, inode, size, modification time) and the vocabulary: a run reads an engine
# folder several times (the gate, each Engine, the benchmark, publish), and a large tokenizer.json
# takes a fraction of a second to parse; a file changed since is read again.
_TOKENIZER_ID_FILES = ("special_tokens_map.json", "tokenizer_config.json", "added_tokens.json", "vocab.json")
_TOKENIZER_ID_FILES += ("tokenizer.json",)
_tokenizers_checked: dict[tuple[Any, ...], None] = {}


def _check_tokenizer_ids_once(folder: Path, vocab_size: int) -> None:
    """:func:`check_tokenizer_ids`, skipped for files already found sound at this vocabulary."""
    identity: list[Any] = [vocab_size]
    for name in _TOKENIZER_ID_FILES:
        try:
            info = os.stat(folder / name)
            identity.append((info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns))
        except OSError:
            identity.append(None)
    key = tuple(identity)
    if key in _tokenizers_checked:
        return
    check_tokenizer_ids(folder, vocab_size)
    if len(_tokenizers_checked) >= 64:
        _tokenizers_checked.clear()
    _tokenizers_checked[key] = None


def _tokenizer_file(folder: Path, name: str, max_bytes: int) -> dict[str, Any] | None:
    """The JSON object of the tokenizer file ``name`` in ``folder`` (read bounded), None if absent."""
    path = folder / name
    if not os.path.lexists(path):
        return None
    try:
        data = read_json(path, what=f"a {name}", max_bytes=max_bytes, within=folder)
    except UnsafeFileError as exc:
        raise EngineError(f"{exc}: rebuild the engine") from None
    except OSError as exc:
        raise EngineError(f"{path} is unreadable ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise EngineError(f"{path} is {_kind(data)}, not a JSON object: rebuild the engine")
    return data


def _shown_token(token: Any) -> str:
    text = repr(token) if isinstance(token, str) else _shown(token)
    return text if len(text) <= 60 else text[:57] + "..."


def _note(path: Path, field: str, token: Any, value: Any, worst: _Worst) -> None:
    """Check the id ``value`` ``path`` gives ``token`` (at ``field``), keeping the worst."""
    if type(value) is not int or value < 0:
        where = f" {field}" if field else ""
        raise EngineError(
            f"{path}:{where} token {_shown_token(token)} has the id {_shown(value)}, not a non-negative "
            "integer: the tokenizer is broken; rebuild the engine"
        )
    worst.highest = max(worst.highest, value)
    if isinstance(token, str):
        worst.known.add(token)
    if value >= worst.vocab_size and value > worst.id:
        worst.id, worst.path = value, path
        worst.token = token if isinstance(token, str) else None


def _added_tokens_decoder(path: Path, decoder: Any, worst: _Worst) -> None:
    if decoder is None:
        return
    if not isinstance(decoder, dict):
        raise EngineError(
            f"{path}: added_tokens_decoder is {_kind(decoder)}, not an object of token ids: "
            "rebuild the engine"
        )
    for key, entry in decoder.items():
        token = entry.get("content") if isinstance(entry, dict) else None
        value: Any = int(key) if key.isascii() and key.isdigit() and len(key) <= 18 else key
        _note(path, "added_tokens_decoder", token, value, worst)


def _tokenizer_json(path: Path, data: dict[str, Any], worst: _Worst) -> None:
    model = data.get("model")
    if model is not None and not isinstance(model, dict):
        raise EngineError(f"{path}: model is {_kind(model)}, not an object: rebuild the engine")
    vocab = (model or {}).get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        for token, value in vocab.items():
            _note(path, "model.vocab", token, value, worst)
    elif isinstance(vocab, list):  # Unigram: [piece, score], the id is the index
        if vocab:
            last = vocab[-1]
            piece = last[0] if isinstance(last, list) and last and isinstance(last[0], str) else None
            _note(path, "model.vocab", piece, len(vocab) - 1, worst)
            worst.known.update(e[0] for e in vocab if isinstance(e, list) and e and isinstance(e[0], str))
    elif vocab is not None:
        raise EngineError(f"{path}: model.vocab is {_kind(vocab)}, not a vocabulary: rebuild the engine")
    added = data.get("added_tokens")
    if added is None:
        return
    if not isinstance(added, list):
        raise EngineError(f"{path}: added_tokens is {_kind(added)}, not a list: rebuild the engine")
    for entry in added:
        if not isinstance(entry, dict):
            raise EngineError(
                f"{path}: an entry of added_tokens is {_kind(entry)}, not an object: rebuild the engine"
            )
        _note(path, "added_tokens", entry.get("content"), entry.get("id"), worst)


def _providers(spec: _Fields, target: str) -> tuple[tuple[str, ...], tuple[dict[str, Any], ...] | None]:
    data = spec.data
    providers = data.get("providers", [TARGET_PROVIDERS.get(target, "CPUExecutionProvider")])
    known = ", ".join(PROVIDER_OPTIONS)
    if not isinstance(providers, list) or not providers or len(providers) > len(PROVIDER_OPTIONS):
        raise spec.bad("providers", f"a list of execution providers ({known})")
    for name in providers:
        if not isinstance(name, str) or name not in PROVIDER_OPTIONS:
            raise spec.error(
                f"providers: {_shown(name)} is not an execution provider this runtime allows ({known})"
            )
    if len(set(providers)) != len(providers):
        raise spec.error(f"providers {providers} names one twice")
    first = TARGET_PROVIDERS[target]
    if providers[0] != first:
        raise spec.error(f"a {target} engine runs on {first} first, not {providers[0]}")
    options = data.get("provider_options")
    if options is None:
        return tuple(providers), None
    if not isinstance(options, list) or len(options) != len(providers):
        raise spec.bad("provider_options", f"a list of {len(providers)} objects, one per provider")
    checked = []
    for provider, entry in zip(providers, options, strict=True):
        if not isinstance(entry, dict):
            raise spec.error(f"provider_options of {provider} is {_kind(entry)}, not an object")
        allowed = PROVIDER_OPTIONS[provider]
        for key, value in entry.items():
            if key not in allowed:
                keys = ", ".join(allowed) or "none"
                raise spec.error(f"{provider} option {_shown(key)} is not allowed (allowed: {keys})")
            valid, wanted = allowed[key]
            if not valid(value):
                raise spec.error(f"{provider} option {key}={_shown(value)} must be {wanted}")
        checked.append(dict(entry))
    return tuple(providers), tuple(checked)


def _check_tensorrt(trt: _Fields) -> None:
    """``engine.json`` ``tensorrt`` (what ``passes/tensorrt_build.py`` records and
    ``pipeline/runtime/tensorrt.py`` compares and steps with): strings, the GPU, the profiles."""
    data = trt.data
    for key in ("version", "compute_capability", "hardware_compatibility"):
        if key in data and not isinstance(data[key], (str, int, float)):
            raise trt.bad(key, "a string")
    gpu = trt.mapping("gpu") or {}
    for key in ("name", "compute_capability"):
        if key in gpu and not isinstance(gpu[key], (str, int, float)):
            raise trt.error(f"tensorrt.gpu.{key}={_shown(gpu[key])} must be a string")
    profiles = trt.mapping("profiles") or {}
    for name, shapes in profiles.items():
        if not isinstance(shapes, dict):
            raise trt.error(f"tensorrt.profiles.{name} must be an object of input shapes")
        for tensor, dims in shapes.items():
            if (
                not isinstance(dims, list)
                or len(dims) != 3
                or any(
                    not isinstance(shape, list)
                    or any(type(d) is not int or not 0 <= d < 1 << 31 for d in shape)
                    for shape in dims
                )
            ):
                raise trt.error(
                    f"tensorrt.profiles.{name}.{tensor} must be three shapes (min, opt, max) of integers"
                )
    if "decode" in profiles and len(profiles["decode"].get("input_ids", [[], [], []])[2]) < 2:
        raise trt.error("tensorrt.profiles.decode.input_ids must give [batch, tokens] shapes")


def _tokens(spec: _Fields, vocab: int) -> TokenSpec:
    data = spec.mapping("tokens") or {}
    tokens = _Fields(data, spec.where, "tokens.")
    eos = data.get("eos_token_ids", [])
    if (
        not isinstance(eos, list)
        or len(eos) > 1024
        or any(type(t) is not int or not 0 <= t < vocab for t in eos)
    ):
        raise tokens.bad("eos_token_ids", f"a list of token ids from 0 to {vocab - 1}")
    return TokenSpec(
        eos_token_ids=tuple(eos),
        pad_token_id=tokens.optional_token("pad_token_id", vocab),
        bos_token_id=tokens.optional_token("bos_token_id", vocab),
    )


def _speculative(spec: _Fields, folder: Path, nested: bool) -> DraftSpec | None:
    plan = spec.mapping("speculative")
    if plan is None:
        return None
    if nested:
        raise spec.error("a draft engine has a draft of its own (speculative)")
    fields = _Fields(plan, spec.where, "speculative.")
    k = fields.integer("k", 1, SPECULATIVE_K_MAX)
    name = plan.get("draft")
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise spec.error(f"speculative.draft {_shown(name)} is not a folder name")
    rel = PurePosixPath(name)
    draft = folder / rel
    if rel.is_absolute() or ".." in rel.parts or rel == PurePosixPath("."):
        raise spec.error(f"speculative.draft {name!r} is not a folder inside {folder}")
    try:
        resolved = confined(draft, folder)
    except UnsafeFileError as exc:
        raise EngineError(f"{spec.where}: speculative.draft: {exc}") from None
    if resolved == Path(os.path.realpath(folder)) or not draft.is_dir():
        raise spec.error(f"speculative.draft {draft} is not a folder inside the engine")
    return DraftSpec(draft=name, k=k, folder=draft)


def read_engine_spec(folder: Path | str, *, graphs: bool = True, _nested: bool = False) -> EngineSpec:
    """The checked ``engine.json`` of an engine folder, before anything is loaded from it.

    Every field is typed and range-checked, strings come from their known sets, execution
    providers and their options from :data:`PROVIDER_OPTIONS`; every file it names (the graph,
    the prefill graph, the tokenizer files, the draft engine's folder and, ``graphs``, each ONNX
    graph's external-data files) is resolved, symlinks included, and must be a regular file
    inside the folder. A draft engine is read the same way. Any refusal is one
    :class:`EngineError` line naming the file, the field and the fix."""
    folder = Path(folder)
    path = folder / ENGINE_FILE
    where = str(path)
    if not os.path.lexists(path):
        raise EngineError(f"{folder} is not an engine folder (no {ENGINE_FILE}): build one first")
    try:
        text = read_regular_text(path, max_bytes=MAX_ENGINE_JSON_BYTES, within=folder, what="an engine.json")
        data = loads_bounded(text)
    except UnsafeFileError as exc:
        raise EngineError(f"{exc}") from None
    except (ValueError, RecursionError) as exc:
        raise EngineError(f"{where} is not valid JSON ({first_line(exc)}): rebuild the engine") from None
    except OSError as exc:
        raise EngineError(f"{where} is unreadable ({exc.strerror or exc})") from None
    spec = _Fields(data, where)
    unknown = sorted(set(data) - _KNOWN_KEYS)
    if unknown:
        raise spec.error(f"unknown field {unknown[0]!r} (known: {', '.join(sorted(_KNOWN_KEYS))})")
    schema = spec.integer("schema_version", 1, 1, 1)
    target = spec.choice("target", TARGETS)
    io = parse_io(spec.mapping("io", required=True), where)
    max_length = spec.integer("max_length", 1, 1 << 24, 2048)
    if io.kv_capacity and io.kv_layout != "shared":
        raise spec.error(
            f"io.kv_capacity={list(io.kv_capacity)} with kv_layout {io.kv_layout!r}: only a shared "
            "layout holds window buffers"
        )
    session = _Fields(spec.mapping("session") or {}, where, "session.")
    threads = session.integer("intra_op_num_threads", 0, 4096, 0)
    optimization = session.choice("graph_optimization_level", OPTIMIZATION_LEVELS, "all")
    kv_cache = spec.mapping("kv_cache") or {}
    tensorrt = spec.mapping("tensorrt")
    if target == "tensorrt":
        providers, options = (), None
        if tensorrt is None:
            raise spec.error("a tensorrt engine records its build in 'tensorrt', which is missing")
        _check_tensorrt(_Fields(tensorrt, where, "tensorrt."))
    else:
        providers, options = _providers(spec, target)
    model_path = confined_file(folder, data.get("model_file"), where, "model_file")
    prefill_name = data.get("prefill_model_file")
    prefill_path = None
    if prefill_name is not None:
        if target == "tensorrt":
            raise spec.error("a tensorrt engine has no prefill_model_file")
        prefill_path = confined_file(folder, prefill_name, where, "prefill_model_file")
    for name in TOKENIZER_FILES:
        if os.path.lexists(folder / name):
            confined_file(folder, name, where, "tokenizer file")
    if graphs and target != "tensorrt":
        for graph in (model_path, prefill_path):
            if graph is not None:
                check_graph_file(graph, folder, where, io.vocab_size)
    if graphs:
        _check_tokenizer_ids_once(folder, io.vocab_size)
    engine = EngineSpec(
        folder=folder,
        target=target,
        model_file=str(data["model_file"]),
        model_path=model_path,
        io=io,
        max_length=max_length,
        tokens=_tokens(spec, io.vocab_size),
        providers=providers,
        provider_options=options,
        prefill_model_file=None if prefill_name is None else str(prefill_name),
        prefill_model_path=prefill_path,
        intra_op_num_threads=threads,
        graph_optimization_level=optimization,
        kv_cache=dict(kv_cache),
        tensorrt=None if tensorrt is None else dict(tensorrt),
        speculative=_speculative(spec, folder, _nested),
        schema_version=schema,
        raw=data,
    )
    if engine.speculative is not None:
        read_engine_spec(engine.speculative.folder, graphs=graphs, _nested=True)
    return engine
