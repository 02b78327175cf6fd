"""Export: torch Llama -> ONNX decoder with an explicit KV cache (torch stage -> graph stage).

Algorithm: trace a wrapper around ``LlamaForCausalLM`` whose inputs and outputs are flat
tensors in the ONNX Runtime GenAI convention (``input_ids``, ``attention_mask``,
``position_ids``, ``past_key_values.{i}.key/value`` -> ``logits``, ``present.{i}.key/value``),
rebuilding transformers' ``DynamicCache`` from the past tensors inside the trace. Batch,
sequence and past length are dynamic axes; weights go to external data (``model.onnx.data``).
We use the TorchScript exporter (``torch.onnx.export(dynamo=False)``): on the default model
it exports in ~12 s against ~65 s for the dynamo exporter, with logits equal to ~1e-4 (DESIGN.md).
Attention is traced from transformers' eager implementation by default (faster on ONNX Runtime
than the SDPA decomposition; see ``ExportConfig.attention``).
Spec: ONNX Runtime GenAI ``genai_config.json`` decoder IO names.

Bounded memory (issue 21): the model is traced without its weights and the weights are attached
from the checkpoint afterwards, one tensor at a time, so ``run`` never holds the model (measured
on the 362M shape: peak RSS 0.78x its fp32 weights, 4.84x before; see ``large_allocations_unmapped``
for the allocator setting that takes). The
trace runs on a skeleton whose parameters are placeholders that occupy no memory (one scalar
broadcast to the parameter's shape, ``expand``: stride 0) and is exported with
``export_params=False``, so every parameter (or the ``weight.T`` the exporter folds from it)
stays a graph input of the traced graph. Each of those inputs is then resolved to its checkpoint
tensor (by its name, or as the transposed weight of the ``MatMul`` that consumes it) and becomes
an initializer whose data is read lazily from the safetensors (memory-mapped by ``safe_open``)
while onnx-ir writes the external data, in shards of at most ``SHARD_BYTES``. The exporter
deduplicates initializers of equal value (``_jit_pass_onnx_deduplicate_initializers``: the
RMSNorm weights of a fresh model are all ones), so the placeholders carry one scalar per class of
equal checkpoint tensors (hashed in float32, one tensor at a time): the traced graph is the one
the exporter makes from the real weights (same nodes, initializer names and values; a test
compares with an export of the loaded model). We do not use the dynamo exporter's fake-tensor
mode: it is the slower exporter here and would change the graph.

No device or dtype knob (``placement_knobs`` stays empty): the exporter traces a weightless
skeleton on the CPU and computes nothing, and the graph's precision is set by the graph passes
(``quant=fp16``, ``int8``, ...); the weights are written in float32, as the checkpoint's values.

``ensures``: no file in the output that ``model.onnx`` does not reference (the exporter's
per-tensor files of earlier versions survived beside the consolidated data); ONNX Runtime
logits vs torch on a fixed prompt, prefill and one decode step; max abs difference and top-1
agreement are recorded, and the pass fails below ``min_top1_agreement``. ONNX Runtime runs
first and is released (its memory returned, see ``large_allocations_unmapped``) before torch
loads the fp32 model, so the two never coexist. The session does not prepack (the data file
stays memory-mapped) and torch loads module by module (``StreamedCheckpoint.load_model``): the
whole pass peaked at 1.07x the fp32 weights on the 3B shape (``quant=none``, 11.80 GiB;
``benchmarks/scaling.py``), where ``ensures`` alone had peaked at 1.84x on the 362M shape.
"""

from __future__ import annotations

import enum
import gc
import hashlib
import io as bytes_io
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from calibration.streaming import StreamedCheckpoint
from pipeline.core.allocator import large_allocations_unmapped
from pipeline.core.artifacts import ARTIFACT_FILE, Artifact, Kind, link_tree, write_metadata
from pipeline.core.base import Pass
from pipeline.core.config import register_pass
from pipeline.core.engine import IOSpec, graph_io
from pipeline.core.errors import PassError, SourceError
from pipeline.core.families import family_of, head_dim
from pipeline.core.files import copy_regular, link_root, read_json
from pipeline.core.planned_model import PlannedModel
from pipeline.core.progress import phases
from pipeline.core.torch_model import load_tokenizer, rebuild_computed_buffers, switch_longrope
from pipeline.runtime.ort import OrtModel

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
EXTRAS_DIR = "extras"  # torch-stage passes leave data for graph-stage passes here
WRAPPER_SCOPE = "/model/"  # node-name prefix of the flat-KV wrapper module
WRAPPER_PREFIX = "model."  # parameter-name prefix of the flat-KV wrapper module
# The external data (pipeline/graph_io.save_graph): one file, DATA_FILE, up to SHARD_BYTES; past it
# shards model-00001-of-0000N.data of at most SHARD_BYTES each (a tensor is never split). 1 GiB:
# the default model (540 MB in fp32) stays one file, and a graph pass that rewrites some layers
# links the shards it leaves unchanged.
DATA_FILE = "model.onnx.data"
SHARD_BYTES = 1 << 30
INLINE_BYTES = 1024  # smaller tensors stay inside model.onnx
CARRIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class Attention(enum.StrEnum):
    eager = "eager"
    sdpa = "sdpa"


MIN_OPSET, MAX_OPSET = 18, 23


@dataclass
class ExportConfig:
    """ONNX export settings."""

    _target_: str = "passes.export.ExportPass"
    # transformers attention code traced into the graph. "eager" exports MatMul-Add-Softmax-MatMul;
    # "sdpa" exports torch's SDPA decomposition with extra IsNaN/Where guards. Measured on the
    # default model (ORT CPU, 2 threads): eager prefill 0.59 s @512 and 5.3 s @2048 tokens vs
    # 0.78 s and 8.4 s for sdpa; decode the same (30 vs 32 ms/token).
    attention: Attention = Attention.eager
    # ONNX opset of the exported graph. 21 carries every Q/DQ form we emit: FP8 E4M3 (>= 19) and
    # block-wise INT4 DequantizeLinear (>= 21); ONNX Runtime runs it at the same speed as 17.
    opset: int = 21
    # Prompt used by `ensures` to compare ONNX Runtime against torch.
    parity_prompt: str = "The quick brown fox jumps over the lazy dog. Once upon a time, there was"
    # The pass fails when ONNX Runtime's greedy token differs from torch's on more positions.
    min_top1_agreement: float = 0.99

    def validate(self) -> None:
        # torch's ONNX exporter writes opset 18 and up; ONNX Runtime 1.32 runs up to 23.
        if not MIN_OPSET <= self.opset <= MAX_OPSET:
            raise PassError(
                f"export.opset={self.opset}: choose an opset from {MIN_OPSET} to {MAX_OPSET} "
                f"(default {ExportConfig.opset})"
            )
        if not 0 <= self.min_top1_agreement <= 1:
            raise PassError(f"export.min_top1_agreement={self.min_top1_agreement}: must be from 0 to 1")


register_pass("export", "onnx", ExportConfig)


def _token_ids(hf_config: dict[str, Any], generation: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    eos = generation.get("eos_token_id", hf_config.get("eos_token_id"))
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else hf_config.get("pad_token_id")
    if pad is None:
        pad = eos_ids[0] if eos_ids else 0
    return {"eos_token_ids": eos_ids, "pad_token_id": int(pad), "bos_token_id": hf_config.get("bos_token_id")}


class ExportPass(Pass):
    Config = ExportConfig
    name = "export"
    # 3: weights attached from the checkpoint after a weightless trace, external data in shards
    # (same graph; the data file's layout differs).
    version = 3
    consumes = Kind.TORCH
    produces = Kind.GRAPH
    # placement_knobs stays (): see the module docstring (the trace computes nothing; graph passes
    # set the graph's precision). memory_profile stays "whole": ``ensures`` loads the fp32 model
    # (module by module: StreamedCheckpoint.load_model).
    loads_module_by_module = True

    def check_model(self, facts: PlannedModel) -> PlannedModel:
        return facts.replace(opset=self.config.opset)

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        import onnx_ir as ir

        from pipeline.core.graph_io import save_graph, writing

        with phases("export", 3) as start:
            start("trace the weightless model")
            checkpoint = Checkpoint(source.path)
            skeleton = placeholder_model(source.path, checkpoint, Attention(self.config.attention).value)
            with large_allocations_unmapped():
                traced, io = self._export(skeleton)
            start("attach weights")
            model = ir.serde.deserialize_model(traced)
            del traced
            attach_weights(model, skeleton, checkpoint, user_inputs=len(_input_names(io)))
            linear_weights = name_linear_weights(model.graph)
            start("write external data")
            # onnx-ir evaluates the lazy tensors one at a time as it writes them (serially).
            saved = save_graph(
                model, out_dir, name=MODEL_FILE, shard_bytes=SHARD_BYTES, inline_bytes=INLINE_BYTES
            )
        for name in CARRIED_FILES:
            if (source.path / name).is_file():
                with writing(out_dir / name, f"{name}, carried with the graph from {source.path}"):
                    copy_regular(
                        source.path / name,
                        out_dir / name,
                        within=link_root(source.path),
                        what="a tokenizer file",
                    )
        if (source.path / EXTRAS_DIR).is_dir():  # side data of torch-stage passes for graph passes
            # hard links, not a copy: AWQ's and GPTQ's extras/int4 are 0.18x the fp32 weights
            with writing(out_dir / EXTRAS_DIR, f"the side data of the torch passes ({EXTRAS_DIR}/)"):
                (out_dir / EXTRAS_DIR).mkdir()
                link_tree(source.path / EXTRAS_DIR, out_dir / EXTRAS_DIR)
        hf_config = read_json(source.path / "config.json", what="a config.json")
        gen_path = source.path / "generation_config.json"
        generation = read_json(gen_path, what="a generation config") if gen_path.is_file() else {}
        tokens = _token_ids(hf_config, generation, load_tokenizer(source.path))
        config = skeleton.config
        write_metadata(
            out_dir,
            Kind.GRAPH,
            {
                "io": {**io.__dict__},
                "tokens": tokens,
                "model_type": hf_config.get("model_type", "llama"),
                "hidden_size": config.hidden_size,
                "num_attention_heads": config.num_attention_heads,
                "max_length": int(getattr(config, "max_position_embeddings", 2048)),
                "opset": self.config.opset,
                "model_file": MODEL_FILE,
                "linear_weights": linear_weights,
            },
        )
        return {
            "nodes": sum(1 for _ in model.graph),
            "opset": self.config.opset,
            "data_files": list(saved.data_files),
            "written_bytes": saved.written_bytes,
        }

    def _export(self, model: Any, export_params: bool = False) -> tuple[Any, IOSpec]:
        """Trace ``model`` with a flat KV-cache signature; return the ONNX ``ModelProto`` and its IO
        spec. Without ``export_params`` the parameters stay graph inputs (after the exporter's
        constant folding and deduplication) and the proto holds no weights."""
        import onnx
        import torch

        config = model.config
        io = IOSpec(
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim(config.to_dict()),
            vocab_size=config.vocab_size,
        )
        wrapper = _flat_kv_decoder(model, io.num_layers)
        # Example inputs only fix ranks and dtypes (all sizes are dynamic axes); seeded for repeatability.
        generator = torch.Generator().manual_seed(0)
        batch, seq, past = 2, 4, 3
        input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
        attention_mask = torch.ones(batch, past + seq, dtype=torch.int64)
        position_ids = torch.arange(past, past + seq).expand(batch, seq)
        shape = (batch, io.num_kv_heads, past, io.head_dim)
        past_kv = [torch.randn(shape, generator=generator) for _ in io.past_names()]
        dynamic_axes: dict[str, dict[int, str]] = {
            "input_ids": {0: "batch_size", 1: "sequence_length"},
            "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
            "position_ids": {0: "batch_size", 1: "sequence_length"},
            "logits": {0: "batch_size", 1: "sequence_length"},
        }
        dynamic_axes.update({n: {0: "batch_size", 2: "past_sequence_length"} for n in io.past_names()})
        dynamic_axes.update({n: {0: "batch_size", 2: "total_sequence_length"} for n in io.present_names()})
        log.info("exporting %d layers to ONNX (opset %d)", io.num_layers, self.config.opset)
        # In memory: without weights the proto is small (and never external data, whatever the model).
        buffer = bytes_io.BytesIO()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                wrapper,
                (input_ids, attention_mask, position_ids, *past_kv),
                buffer,
                input_names=_input_names(io),
                output_names=["logits", *io.present_names()],
                dynamic_axes=dynamic_axes,
                opset_version=self.config.opset,
                export_params=export_params,
                dynamo=False,
            )
        return onnx.load_from_string(buffer.getvalue()), io

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        from pipeline.core.graph_io import check_data_files

        check_data_files(result.path, "export")  # unreferenced *.data files, missing referenced ones
        # Stricter: the exporter's per-tensor files (onnx__MatMul_662, ...) carry no .data suffix.
        stray = unreferenced_files(result.path)
        if stray:
            raise PassError(
                f"export: {result.path / stray[0]} is not referenced by {MODEL_FILE} ({len(stray)} such "
                "file(s): external data left behind?); an export output holds only the graph, its data "
                "and the checkpoint's config and tokenizer files"
            )
        parity = check_parity(source.path, result.path, self.config.parity_prompt)
        if parity["top1_agreement"] < self.config.min_top1_agreement:
            raise PassError(
                f"export: ONNX Runtime agrees with torch on {parity['top1_agreement']:.1%} of greedy tokens "
                f"(< {self.config.min_top1_agreement:.0%}; max |logit diff| {parity['max_abs_diff']:.3g}); "
                "the exported graph is wrong"
            )
        return {"parity": parity}


# --------------------------------------------------------------------------------------------
# Weights: a weightless skeleton to trace, then the checkpoint's tensors attached lazily


class Checkpoint:
    """The tensors of a safetensors checkpoint (one file or an index of shards), read one at a
    time: each read maps its file (``safe_open``) and unmaps it again, so pages of the checkpoint
    never accumulate in this process."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        index = folder / SAFETENSORS_INDEX
        if index.is_file():
            weight_map = read_json(index, what="a safetensors index").get("weight_map", {})
            self.files = {name: folder / file for name, file in weight_map.items()}
        elif (folder / SAFETENSORS_FILE).is_file():
            with safe_open(str(folder / SAFETENSORS_FILE), framework="pt") as handle:
                self.files = {name: folder / SAFETENSORS_FILE for name in handle.keys()}  # noqa: SIM118
        else:
            raise PassError(
                f"export: {folder} has neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX}; "
                "save the checkpoint as safetensors"
            )

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def float32(self, name: str) -> Any:
        """Tensor ``name`` as a float32 torch tensor (exact: the loader casts the same way)."""
        import torch
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as handle:
            return handle.get_tensor(name).to(torch.float32)


def _input_names(io: IOSpec) -> list[str]:
    return ["input_ids", "attention_mask", "position_ids", *io.past_names()]


def _value_classes(names: list[str], checkpoint: Checkpoint) -> dict[str, int]:
    """Tensor name -> class index, equal for tensors of equal shape and equal float32 values (the
    exporter's deduplication criterion, ``torch.equal``; bitwise here, so -0.0 and 0.0 differ),
    read and hashed one tensor at a time."""
    import torch

    classes: dict[tuple[tuple[int, ...], bytes], int] = {}
    result = {}
    for name in names:
        tensor = checkpoint.float32(name).contiguous()
        digest = hashlib.blake2b(tensor.reshape(-1).view(torch.uint8).numpy()).digest()
        key = (tuple(tensor.shape), digest)
        result[name] = classes.setdefault(key, len(classes) + 1)
        del tensor
    return result


def placeholder_model(folder: Path, checkpoint: Checkpoint, attention: str) -> Any:
    """The checkpoint's ``LlamaForCausalLM`` without its weights: every parameter a float32
    placeholder of its shape holding one scalar (stride 0: no memory), equal for parameters whose
    checkpoint tensors are equal, so the exporter folds and deduplicates as for the real weights.
    Buffers (the rotary frequencies) are real. Each parameter's checkpoint name is kept in
    ``model.checkpoint_names`` (parameter id -> name)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    config._attn_implementation = attention  # what from_pretrained(attn_implementation=...) sets
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=torch.float32)
    model.tie_weights()
    # Every name each (possibly tied) parameter has; the checkpoint holds one of them.
    aliases: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
    sources: dict[int, str] = {}
    for key, names in aliases.items():
        found = [n for n in names if n in checkpoint]
        if not found:
            raise PassError(
                f"export: the checkpoint in {folder} has no tensor {names[0]}; "
                "re-save it with save_pretrained"
            )
        sources[key] = found[0]
    classes = _value_classes(sorted(set(sources.values())), checkpoint)
    replaced: dict[int, Any] = {}
    checkpoint_names: dict[int, str] = {}
    for module in model.modules():
        for pname, parameter in list(module._parameters.items()):
            if parameter is None:
                continue
            if id(parameter) not in replaced:
                value = torch.full((), float(classes[sources[id(parameter)]]), dtype=torch.float32)
                new = torch.nn.Parameter(value.expand(parameter.shape), requires_grad=False)
                replaced[id(parameter)] = new
                checkpoint_names[id(new)] = sources[id(parameter)]
            module._parameters[pname] = replaced[id(parameter)]
    try:
        rebuild_computed_buffers(model, config)  # rotary frequencies, Gemma's embedding scale
        switch_longrope(model, family_of(config).rotary)  # both factor tables, chosen in the graph
    except SourceError as exc:
        raise PassError(f"export: {exc}") from None
    model.checkpoint_names = checkpoint_names
    return model.eval()


def attach_weights(model: Any, skeleton: Any, checkpoint: Checkpoint, user_inputs: int) -> None:
    """Turn the parameter inputs of the traced ``model`` (onnx-ir, traced without parameters) into
    initializers that read their checkpoint tensor when written: an input named after a parameter
    holds it; one the exporter folded holds the transposed weight of the ``MatMul`` consuming it."""
    import onnx_ir as ir

    graph = model.graph
    by_name = dict(skeleton.named_parameters(remove_duplicate=False))
    names = skeleton.checkpoint_names
    offset = family_of(skeleton.config).norm_offset
    parameters = list(graph.inputs)[user_inputs:]
    for value in parameters:
        name = value.name or ""
        source: tuple[str, bool, float] | None = None
        if name.startswith(WRAPPER_PREFIX) and name.removeprefix(WRAPPER_PREFIX) in by_name:
            parameter = by_name[name.removeprefix(WRAPPER_PREFIX)]
            if tuple(value.shape) == tuple(parameter.shape):
                source = (names[id(parameter)], False, 0.0)
        else:
            for use in value.uses():
                module = _matmul_module(use.node)
                parameter = by_name.get(f"{module}.weight") if module and use.idx == 1 else None
                if parameter is not None and tuple(value.shape) == tuple(parameter.shape)[::-1]:
                    source = (names[id(parameter)], True, 0.0)
                    break
                # Gemma's RMSNorm scales by (1 + weight): the exporter folds the sum into one input
                # of the norm's Mul (``/model/model/layers.0/input_layernorm/Mul_2``).
                module = _scope_module(use.node)
                parameter = by_name.get(f"{module}.weight") if offset and module else None
                if (
                    parameter is not None
                    and use.node.op_type == "Mul"
                    and tuple(value.shape) == tuple(parameter.shape)
                ):
                    source = (names[id(parameter)], False, offset)
                    break
        if source is None:
            raise PassError(
                f"export: cannot tell which checkpoint tensor the traced input {name} "
                f"{tuple(value.shape)} holds; this transformers version exports an unexpected graph"
            )
        value.const_value = ir.LazyTensor(
            _reader(checkpoint, *source), dtype=ir.DataType.FLOAT, shape=ir.Shape(value.shape), name=name
        )
    for _ in parameters:
        graph.inputs.pop()
    for value in parameters:
        graph.register_initializer(value)


def _reader(checkpoint: Checkpoint, name: str, transpose: bool, offset: float) -> Callable[[], Any]:
    def read() -> Any:
        import onnx_ir as ir

        tensor = checkpoint.float32(name)
        array = (tensor.T if transpose else tensor).contiguous().numpy()
        return ir.tensor(array + offset if offset else array)  # offset: Gemma's folded 1 + weight

    return read


def _scope_module(node: Any) -> str | None:
    """The module a node was traced in (``model.layers.0.input_layernorm`` for
    ``/model/model/layers.0/input_layernorm/Mul_2``); None for a node without a scope."""
    scope, _, _ = (node.name or "").rpartition("/")
    return scope.removeprefix(WRAPPER_SCOPE).strip("/").replace("/", ".") or None


def _matmul_module(node: Any) -> str | None:
    """The module a linear layer's ``MatMul`` node belongs to (``model.layers.0.mlp.up_proj``), from
    its name (``/model/model/layers.0/mlp/up_proj/MatMul``); None for other nodes."""
    if node.op_type != "MatMul" or not (node.name or "").endswith("/MatMul") or len(node.inputs) != 2:
        return None
    return node.name.removeprefix(WRAPPER_SCOPE).removesuffix("/MatMul").strip("/").replace("/", ".")


def name_linear_weights(graph: Any) -> dict[str, str]:
    """Rename each linear layer's weight initializer after its module; return module -> name.

    The TorchScript exporter folds ``weight.T`` into anonymous initializers (``onnx::MatMul_662``)
    but names each MatMul node after its module scope (``/model/model/layers.0/mlp/up_proj/MatMul``).
    Quantization passes select layers by module name (``quant.exclude=[lm_head]``), so the weight
    ([in, out], i.e. the transposed torch weight) is renamed ``<module>.weight_t``. ``graph`` is
    an onnx-ir graph whose parameters are initializers.
    """
    renamed: dict[str, str] = {}
    for node in graph:
        module = _matmul_module(node)
        if module is None:
            continue
        weight = node.inputs[1]
        if (
            weight is None
            or weight.name not in graph.initializers
            or len(weight.uses()) != 1
            or len(weight.shape) != 2
        ):
            continue
        new_name = f"{module}.weight_t"
        graph.initializers.pop(weight.name)
        weight.name = new_name
        if weight.const_value is not None:
            weight.const_value.name = new_name
        graph.register_initializer(weight)
        renamed[module] = new_name
    return renamed


def external_files(model_path: Path) -> set[str]:
    """The external-data files an ONNX model references (``location`` entries), without loading them."""
    import onnx

    from pipeline.core.graph_io import proto_tensors

    model = onnx.load(str(model_path), load_external_data=False)
    files = set()
    for tensor in proto_tensors(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            files.update(entry.value for entry in tensor.external_data if entry.key == "location")
    return files


def unreferenced_files(folder: Path) -> list[str]:
    """Files in an export output that belong to none of: the graph, the external data it
    references, ``artifact.json``, the carried checkpoint files, ``extras/``."""
    expected = {MODEL_FILE, ARTIFACT_FILE, EXTRAS_DIR, *CARRIED_FILES, *external_files(folder / MODEL_FILE)}
    return sorted(path.name for path in folder.iterdir() if path.name not in expected)


def _flat_kv_decoder(model: Any, num_layers: int) -> Any:
    """Wrap ``model`` as a module of flat tensors: (ids, mask, positions, *past) -> (logits, *present).

    Built inside a function so that importing this module (at start-up) does not import torch.
    """
    import torch
    from transformers import DynamicCache

    class FlatKVDecoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):  # type: ignore[no-untyped-def]
            # Full caches on every layer (no config: no DynamicSlidingWindowLayer, which would
            # slice a windowed layer's present to its window and hide the attention from the
            # fusion rule): present = past + new, and a sliding window lives in the attention
            # mask transformers builds. The fused graph's GroupQueryAttention takes the window
            # (local_window_size), and with kv_cache=shared its buffer holds only the window.
            cache = DynamicCache()
            for layer in range(num_layers):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
            )
            flat = []
            for layer in out.past_key_values.layers:
                flat += [layer.keys, layer.values]
            return (out.logits, *flat)

    return FlatKVDecoder().eval()


def check_parity(torch_dir: Path, graph_dir: Path, prompt: str) -> dict[str, Any]:
    """Compare ONNX Runtime with torch on ``prompt``: prefill plus one greedy decode step.

    ONNX Runtime runs first and is released before torch loads the model: the two never hold
    their weights at the same time."""
    import torch

    ids = load_tokenizer(torch_dir)(prompt)["input_ids"]
    with large_allocations_unmapped():  # what ONNX Runtime frees goes back before torch loads
        ort_prefill, ort_decode, next_token = _ort_logits(graph_dir, ids)
    model = StreamedCheckpoint(torch_dir).load_model()  # module by module: the file not mapped beside
    with torch.no_grad():
        full = torch.tensor([[*ids, next_token]])
        reference = model(full).logits[0].numpy()
    del model
    ort_logits = np.concatenate([ort_prefill[0], ort_decode[0]], axis=0)
    agree = (ort_logits.argmax(-1) == reference.argmax(-1)).mean()
    return {
        "tokens": len(ids) + 1,
        "max_abs_diff": float(np.abs(ort_logits - reference).max()),
        "prefill_max_abs_diff": float(np.abs(ort_prefill[0] - reference[:-1]).max()),
        "decode_max_abs_diff": float(np.abs(ort_decode[0, -1] - reference[-1]).max()),
        "top1_agreement": float(agree),
    }


def _ort_logits(graph_dir: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """ONNX Runtime's prefill logits on ``ids``, its decode logits for the greedy next token, and
    that token; the session is released on return."""
    onnx_model = OrtModel(graph_dir / MODEL_FILE, graph_io(graph_dir), prepack=False)  # weights once
    prompt_ids = np.array([ids], dtype=np.int64)
    mask = np.ones_like(prompt_ids)
    positions = np.arange(len(ids), dtype=np.int64)[None]
    ort_prefill, cache = onnx_model.step(prompt_ids, mask, positions, onnx_model.empty_cache(1))
    next_token = int(ort_prefill[0, -1].argmax())
    ort_decode, _ = onnx_model.step(
        np.array([[next_token]]), np.ones((1, len(ids) + 1), np.int64), np.array([[len(ids)]]), cache
    )
    del onnx_model, cache
    gc.collect()
    return ort_prefill, ort_decode, next_token
