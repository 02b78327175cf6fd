"""Block streaming of a Hugging Face Llama checkpoint: read, calibrate and write one decoder block
at a time, so a torch pass holds one block, the calibration activations at one layer and the
embeddings, whatever the model's depth.

The scheme of GPTQ's reference code (``llama_sequential``: capture the first block's inputs with a
"Catcher", then onload block ``i``, push the activations through it, quantize, offload) and of
llm-compressor's sequential pipeline (``llmcompressor/pipelines/sequential``: the model on the
``meta`` device, each block onloaded for its calibration step). It is written here rather than
taken from those libraries: both keep the whole model resident (in CPU memory, offloaded to the
GPU block by block) and neither writes the result block by block; accelerate's ``init_empty_weights``
/ ``set_module_tensor_to_device`` do what :meth:`StreamedCheckpoint.materialize` does, but
``torch.device("meta")`` and ``load_state_dict(assign=True)`` now cover it without a dependency.

- :class:`StreamedCheckpoint`: the model skeleton on ``meta`` (module names and shapes, no
  weights), its tensors read from the safetensors shards (``model.safetensors`` or a sharded
  ``model.safetensors.index.json``) with ``safe_open`` only when a module is materialized on the
  placement's device and dtype; :meth:`~StreamedCheckpoint.release` sends it back to ``meta``.
  A file is opened (memory-mapped) for one read and closed after, so its pages do not stay mapped
  into the process. The rotary embedding is rebuilt on the device; the first block's inputs are
  captured from a forward of the embeddings only.
- :class:`CheckpointWriter`: writes each finished module's tensors as one safetensors shard as soon
  as it is produced, then ``model.safetensors.index.json`` and ``config.json`` /
  ``generation_config.json`` (the rest of the folder comes from
  :func:`pipeline.core.torch_model.copy_beside_weights`), so the output model is never whole in memory.

Tied embeddings (``lm_head.weight`` absent from the checkpoint, read from
``model.embed_tokens.weight``) are handled by the key map; :meth:`StreamedCheckpoint.untie_lm_head`
makes the output hold its own head.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.errors import SourceError
from pipeline.core.families import family_of
from pipeline.core.files import loads_bounded
from pipeline.core.placement import CPU_FLOAT32, ResolvedPlacement
from pipeline.core.torch_model import rebuild_computed_buffers

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_METADATA = {"format": "pt"}  # what transformers' save_pretrained writes


@dataclass
class ForwardTime:
    """Time spent pushing calibration windows through blocks (what data parallelism divides):
    wall seconds and this process's CPU seconds (all its threads)."""

    wall: float = 0.0
    cpu: float = 0.0

    @contextlib.contextmanager
    def measure(self) -> Any:
        import time

        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.wall += time.perf_counter() - wall
            self.cpu += time.process_time() - cpu

    def to_dict(self) -> dict[str, float]:
        return {"forward_seconds": round(self.wall, 2), "forward_cpu_seconds": round(self.cpu, 2)}


@dataclass
class LayerInputs:
    """The inputs of one decoder layer for each calibration batch: the hidden states, and the
    keyword arguments transformers passes that layer (its attention mask and rotary position
    embeddings, which differ between a model's full and sliding layers and, in Gemma 3, between
    their RoPE tables), with every layer's kept in ``by_layer`` for :meth:`at`."""

    hidden: list[Any]
    kwargs: list[dict[str, Any]]
    by_layer: list[list[dict[str, Any]]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)

    def at(self, index: int) -> LayerInputs:
        """These hidden states as the inputs of layer ``index``: with that layer's arguments."""
        return LayerInputs(self.hidden, self.by_layer[index] if self.by_layer else self.kwargs, self.by_layer)


class _StopForward(Exception):
    pass


def capture_first_block_inputs(
    model: Any, windows: np.ndarray, batch_size: int, device: Any = "cpu"
) -> LayerInputs:
    """Run the embedding (and mask/rotary set-up) of ``model`` on ``windows`` (token ids, one row a
    window) in batches of ``batch_size``; catch what reaches decoder layer 0, and the arguments
    every layer is called with, then stop (AutoGPTQ's "Catcher", one in place of each layer:
    each passes its input on unchanged, the last stops the forward). Only the embeddings and
    the rotary embedding need weights: the decoder layers, the final norm and the head may stay
    on ``meta``."""
    import torch

    layers = model.get_submodule(family_of(model.config).layers)
    originals = list(layers)
    captured = LayerInputs([], [], [[] for _ in originals])

    class Catcher(torch.nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

        def forward(self, hidden_states: Any, **kwargs: Any) -> Any:
            if self.index == 0:
                captured.hidden.append(hidden_states.detach())
            kwargs.pop("cache", None)
            kwargs.pop("past_key_values", None)
            kwargs["use_cache"] = False
            captured.by_layer[self.index].append(kwargs)
            if self.index == len(originals) - 1:
                raise _StopForward
            return hidden_states

    for index in range(len(originals)):
        layers[index] = Catcher(index)
    try:
        with torch.no_grad():
            for start in range(0, len(windows), batch_size):
                batch = np.ascontiguousarray(windows[start : start + batch_size])
                ids = torch.from_numpy(batch).to(device)
                with contextlib.suppress(_StopForward):
                    model(input_ids=ids, use_cache=False)
    finally:
        for index, layer in enumerate(originals):
            layers[index] = layer
    captured.kwargs = captured.by_layer[0]
    return captured


def weight_files(folder: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it (single file or sharded index)."""
    from safetensors import SafetensorError, safe_open

    index = folder / INDEX_FILE
    try:
        if index.is_file():
            weight_map = loads_bounded(index.read_text())["weight_map"]
            return {key: folder / name for key, name in weight_map.items()}
        single = folder / SINGLE_FILE
        if single.is_file():
            with safe_open(str(single), "pt") as handle:
                return dict.fromkeys(handle.keys(), single)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise SourceError(
            f"cannot read the weight index of {folder} ({' '.join(str(exc).split())}): "
            "re-save or re-download the checkpoint"
        ) from None
    raise SourceError(f"{folder} holds no {SINGLE_FILE} or {INDEX_FILE}: save the checkpoint as safetensors")


class StreamedCheckpoint:
    """A Llama checkpoint as a ``meta`` skeleton whose modules are materialized one at a time.

    ``model`` is the skeleton (a ``LlamaForCausalLM``): use it for module names and shapes, and
    call modules only after :meth:`materialize`. Floating-point tensors are materialized in the
    placement's dtype on its device.
    """

    def __init__(self, folder: Path, placement: ResolvedPlacement = CPU_FLOAT32) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.folder = Path(folder)
        self.placement = placement
        try:
            self.config = AutoConfig.from_pretrained(self.folder, trust_remote_code=False)
        except Exception as exc:  # transformers raises many types for a bad config.json
            raise SourceError(
                f"cannot read the config of {self.folder} ({' '.join(str(exc).split())[:300]}): "
                "re-save or re-download the checkpoint"
            ) from None
        self.family = family_of(self.config, f"{self.folder}/config.json")  # its module paths
        self.files = weight_files(self.folder)
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(self.config, trust_remote_code=False).eval()
        # The checkpoint ties the head to the embedding when it stores no head of its own.
        self.tied = f"{self.family.head}.weight" not in self.files and bool(
            getattr(self.config, "tie_word_embeddings", False)
        )
        self._rotary_on_device()

    @property
    def num_layers(self) -> int:
        return len(self.model.get_submodule(self.family.layers))

    def layer_prefix(self, index: int) -> str:
        return self.family.layer(index)

    def module(self, prefix: str) -> Any:
        return self.model.get_submodule(prefix)

    def source_key(self, name: str) -> str:
        """The checkpoint key of the skeleton's tensor ``name`` (a tied head reads the embedding)."""
        if name in self.files:
            return name
        if name == f"{self.family.head}.weight" and self.tied:
            return f"{self.family.embeddings}.weight"
        raise SourceError(f"{self.folder}: the checkpoint has no tensor {name}: re-save or re-download it")

    def read(self, names: Iterable[str]) -> dict[str, Any]:
        """The checkpoint's tensors for the skeleton's tensor ``names``, on the CPU in their stored
        dtype. Each file is opened for this read only."""
        from safetensors import SafetensorError, safe_open

        by_file: dict[Path, list[tuple[str, str]]] = {}
        for name in names:
            key = self.source_key(name)
            by_file.setdefault(self.files[key], []).append((name, key))
        tensors = {}
        for path, pairs in by_file.items():
            try:
                with safe_open(str(path), "pt") as handle:
                    for name, key in pairs:
                        tensors[name] = handle.get_tensor(key)
            except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
                raise SourceError(
                    f"cannot read {path} ({' '.join(str(exc).split())[:300]}): re-save or re-download it"
                ) from None
        return tensors

    def tensor_names(self, prefix: str) -> list[str]:
        """Full names of the persistent tensors (parameters and buffers) of module ``prefix``."""
        module = self.module(prefix)
        return [f"{prefix}.{name}" for name in module.state_dict(keep_vars=True)]

    def materialize(self, prefix: str) -> Any:
        """Load module ``prefix`` (a decoder block, ``model.embed_tokens``, ``model.norm``,
        ``lm_head``) from the checkpoint onto the placement's device and dtype; return it."""
        module = self.module(prefix)
        names = self.tensor_names(prefix)
        stored = self.read(names)
        state = {}
        for name in names:
            tensor = stored.pop(name)
            dtype = self.placement.dtype if tensor.is_floating_point() else tensor.dtype
            state[name[len(prefix) + 1 :]] = tensor.to(device=self.placement.torch_device, dtype=dtype)
        module.load_state_dict(state, strict=True, assign=True)
        # buffers no checkpoint holds (Gemma's embedding scale) went back to meta with the module
        rebuild_computed_buffers(module, self.config, self.placement.torch_device)
        return module

    def load_model(self) -> Any:
        """The whole model, materialized module by module on the placement's device and dtype,
        in eval mode. Each module's read maps its shard only while it reads, so the peak is the
        weights plus one module: ``from_pretrained`` keeps the checkpoint's pages mapped beside
        the converted weights (a 1.17B bf16 checkpoint loaded in fp32: 6.93 GiB peak for
        4.36 GiB of weights). A tied head shares the embedding, as ``from_pretrained`` ties it."""
        family = self.family
        prefixes = [family.embeddings, *map(self.layer_prefix, range(self.num_layers)), family.final_norm]
        for prefix in prefixes:
            self.materialize(prefix)
        if self.output_tied:
            self.module(family.head).weight = self.module(family.embeddings).weight
        else:
            self.materialize(family.head)
        left = [name for name, tensor in self.model.state_dict(keep_vars=True).items() if tensor.is_meta]
        if left:
            raise SourceError(
                f"{self.folder}: the checkpoint leaves {left[0]} unset: re-save or re-download it"
            )
        return self.model.eval()

    def release(self, prefix: str) -> None:
        """Send module ``prefix`` back to ``meta`` (its memory is freed and handed back to the OS:
        ``pipeline.core.allocator.return_freed_memory``)."""
        from pipeline.core.allocator import return_freed_memory

        self.module(prefix).to("meta")
        return_freed_memory()

    def untie_lm_head(self) -> bool:
        """Make the output hold its own ``lm_head`` (read from the embedding when tied); whether
        the checkpoint was tied. As :func:`pipeline.core.torch_model.untie_lm_head`, for a streamed model."""
        tied = self.tied
        self.config.tie_word_embeddings = False
        self.model.config.tie_word_embeddings = False
        return tied

    @property
    def output_tied(self) -> bool:
        """Whether the output checkpoint ties its head (then it stores no ``lm_head.weight``)."""
        return self.tied and bool(getattr(self.config, "tie_word_embeddings", False))

    def first_block_inputs(self, windows: np.ndarray, batch_size: int) -> LayerInputs:
        """The first decoder block's inputs on ``windows``: the embeddings are materialized for
        the capture and released after it."""
        self.materialize(self.family.embeddings)
        try:
            return capture_first_block_inputs(self.model, windows, batch_size, self.placement.torch_device)
        finally:
            self.release(self.family.embeddings)

    def output_tensors(
        self, prefix: str, overrides: dict[str, Any] | None = None, dtype: Any = None
    ) -> dict[str, Any]:
        """The tensors of materialized module ``prefix`` to write (full names, CPU, contiguous, in
        ``dtype``, default float32 for floating tensors). ``overrides`` (full names) replace the
        module's values (e.g. the exact dequantized weights of quantized linears). A tensor the
        pass left unchanged is taken from the checkpoint, so a lower-precision compute dtype does
        not round it."""
        import torch

        dtype = torch.float32 if dtype is None else dtype
        overrides = overrides or {}
        module = self.module(prefix)
        current = {f"{prefix}.{k}": v.detach() for k, v in module.state_dict().items()}
        lowered = self.placement.dtype != torch.float32
        stored = self.read([n for n in current if n not in overrides]) if lowered else {}
        out = {}
        for name, value in current.items():
            if name in overrides:
                value = overrides[name]
            elif name in stored:
                original = stored.pop(name)
                same = original.to(device=value.device, dtype=value.dtype)
                if torch.equal(same, value):
                    value = original
            target = dtype if value.is_floating_point() else value.dtype
            out[name] = value.to(device="cpu", dtype=target).contiguous()
        return out

    def generation_config(self) -> Any:
        """The checkpoint's generation config (as ``from_pretrained`` gives a model), or None."""
        from transformers import GenerationConfig

        if not self.model.can_generate():
            return None
        try:
            return GenerationConfig.from_pretrained(self.folder)
        except OSError:  # no generation_config.json: transformers derives one from the config
            return GenerationConfig.from_model_config(self.config)

    def _rotary_on_device(self) -> None:
        """Compute the buffers no checkpoint holds (rotary frequencies, Gemma's embedding scale)
        on the device."""
        rebuild_computed_buffers(self.model, self.config, self.placement.torch_device)


class CheckpointWriter:
    """Writes a checkpoint one shard at a time: ``write`` one module's (or a few modules')
    tensors as they are produced, ``finish`` the index and the configs. Shards are named
    ``model-00001-of-000NN.safetensors`` (transformers' scheme) once their number is known."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.weight_map: dict[str, str] = {}
        self.shards: list[str] = []
        self.total_size = 0

    def write(self, tensors: dict[str, Any]) -> None:
        """Write ``tensors`` (full names, CPU) as the next shard."""
        from safetensors.torch import save_file

        if not tensors:
            return
        clash = sorted(set(tensors) & set(self.weight_map))
        if clash:
            raise ValueError(f"tensors written twice: {clash[:3]}")
        name = f"model-{len(self.shards) + 1:05d}.safetensors"
        save_file(tensors, str(self.out_dir / name), metadata=SHARD_METADATA)
        self.shards.append(name)
        for key, value in tensors.items():
            self.weight_map[key] = name
            self.total_size += value.numel() * value.element_size()

    def finish(self, config: Any, generation_config: Any = None, dtype: Any = None) -> None:
        """Rename the shards to their final names and write the index, ``config.json`` (with
        ``dtype``, default float32, as the dtype of the saved weights) and ``generation_config.json``."""
        import torch

        total = len(self.shards)
        final = {old: f"model-{i:05d}-of-{total:05d}.safetensors" for i, old in enumerate(self.shards, 1)}
        for old, new in final.items():
            (self.out_dir / old).rename(self.out_dir / new)
        index = {
            "metadata": {"total_size": self.total_size},
            "weight_map": {key: final[name] for key, name in sorted(self.weight_map.items())},
        }
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        config.dtype = torch.float32 if dtype is None else dtype
        config.save_pretrained(self.out_dir)
        if generation_config is not None:
            generation_config.save_pretrained(self.out_dir)
