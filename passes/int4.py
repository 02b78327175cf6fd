"""INT4 weight-only group quantization shared by ``quant=int4_gptq`` and ``quant=int4_awq``: the
settings both stages agree on and the torch-stage pass base (:class:`TorchInt4Pass`). The numbers
(codes, scales, zero points, packing, ``extras/int4/``) are ``passes/formats/int4.py``.

A tied ``lm_head`` (SmolLM2: ``lm_head.weight is model.embed_tokens.weight``) is untied before it
is quantized: the embedding keeps its fp32 values, the head gets its own quantized weight, and
the export (which already writes the head as its own initializer) is unchanged in size.

The torch stage is block-streamed (``calibration/streaming.py``; GPTQ's reference
``llama_sequential``, llm-compressor's sequential pipeline): the model is a ``meta`` skeleton,
each decoder block is read from the safetensors shards onto ``pipeline.device`` in
``pipeline.torch_dtype``, calibrated and quantized on the previous block's outputs, written as its
own shard and freed. Peak memory is one block, one layer's calibration activations and the
embeddings, whatever the depth; the results equal those of the model held whole
(:meth:`TorchInt4Pass.quantize_model`, which the tests compare). Statistics (Gram matrices,
Hessians, activation means) are accumulated in float32 whatever the compute dtype, and the saved
weights are float32 as before: quantized layers hold exactly the dequantized parameters,
tensors the pass did not change keep their stored values.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from abc import abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from calibration.datasets import CalibrationConfig, check_context, shard
from calibration.streaming import ForwardTime, LayerInputs, capture_first_block_inputs
from calibration.workload import CalibratesInRanks
from passes.export import EXTRAS_DIR  # export copies extras/ into the graph artifact
from passes.formats.int4 import (
    BITS,
    GROUP_SIZES,
    INFO_FILE,
    INT4_DIR,
    PARAMS_FILE,
    QuantizedLinear,
    check_group_size,
    dequantize,
    packed_params,
    save_packed_params,
    unpack_uint4,
)
from passes.selection import select_modules
from pipeline.core.artifacts import Artifact, Kind, write_metadata
from pipeline.core.base import Pass
from pipeline.core.distributed import Group
from pipeline.core.errors import CalibrationError, ConfigError, PassError
from pipeline.core.families import LLAMA, Family, family_of
from pipeline.core.files import read_json
from pipeline.core.planned_model import PlannedModel
from pipeline.core.torch_model import LM_HEAD, linear_layers

log = logging.getLogger(__name__)


class Lowering(enum.StrEnum):
    matmulnbits = "matmulnbits"  # com.microsoft.MatMulNBits (ONNX Runtime CPU/GPU kernels)
    qdq = "qdq"  # UINT4/INT4 initializer + block-wise DequantizeLinear + MatMul (TensorRT's form)


# --------------------------------------------------------------------------------------------
# Configs. Users type a flat recipe (quant.group_size=64 quant.exclude=[lm_head]); each pass of
# the recipe gets its own subset as constructor kwargs.


@dataclass
class Int4Settings:
    """What both stages must agree on: the grid and which layers are quantized."""

    # Input channels sharing one scale and zero point (MatMulNBits block_size). 32 by default: on
    # the default model GPTQ perplexity is 28.8 at 32 vs 29.5 at 64 (fp32 24.9) for +5% engine size
    # and no measurable decode cost; it is also ONNX Runtime GenAI's int4 default, and 128 (the
    # AWQ/GPTQ papers' choice) does not divide the default model's width 576 = 9 x 64.
    group_size: int = 32
    # Zero point fixed at 8 (signed INT4 in the Q/DQ graph: the only INT4 TensorRT accepts).
    symmetric: bool = False
    # fnmatch patterns over module names (model.layers.3.mlp.down_proj, lm_head) kept in fp32.
    exclude: list[str] = field(default_factory=list)


@dataclass
class Int4LoweringSettings:
    """How the graph stage writes the INT4 layers."""

    lowering: Lowering = Lowering.matmulnbits
    # MatMulNBits accuracy_level. 4 (default, as ORT GenAI's builder uses for CPU): ONNX Runtime
    # quantizes the activations to int8 per block and uses integer dot products: a decode-shaped
    # (1 x 576 x 1536) INT4 matmul takes 0.07 ms against 0.19 ms at 0 (fp32 MatMul: 0.46 ms), a
    # prefill-shaped one (512 rows) ~1.8x longer than at 0. On the default model (GPTQ) decode is
    # faster at 4 (TPOT 26-30 vs 29-32 ms in alternating runs; 39 vs 75 ms in one loaded run),
    # prefill slower (TTFT@512 1.38-1.47 vs 1.05-1.17 s), perplexity 28.88 vs 28.84. 0: unset,
    # fp32 compute; the graph then equals the fake-quantized torch model to ~1e-4 (the tests check
    # this). Ignored by the Q/DQ lowering (ONNX Runtime fuses DQ + MatMul into MatMulNBits at its
    # session option ``session.qdq_matmulnbits_accuracy_level``, default 4).
    accuracy_level: int = 4


def validate_settings(config: Any, where: str = "quant") -> None:
    """Checks that need no model: group size, calibration sizes, lowering knobs."""
    if config.group_size not in GROUP_SIZES:
        raise ConfigError(
            f"{where}.group_size={config.group_size} is not supported: choose one of "
            f"{', '.join(map(str, GROUP_SIZES))}"
        )
    calibration = getattr(config, "calibration", None)
    if calibration is not None:
        if calibration.num_samples < 1:
            raise ConfigError(
                f"{where}.calibration.num_samples={calibration.num_samples}: at least one calibration "
                "window is needed"
            )
        if calibration.seq_len < 2:
            raise ConfigError(f"{where}.calibration.seq_len={calibration.seq_len}: must be at least 2")
    accuracy = getattr(config, "accuracy_level", 0)
    if accuracy not in (0, 1, 2, 3, 4):
        raise ConfigError(f"{where}.accuracy_level={accuracy}: choose 0 (unset), 1, 2, 3 or 4")


# --------------------------------------------------------------------------------------------
# The torch stage: a model is quantized one decoder layer at a time (GPTQ's sequential scheme),
# so only one layer's calibration activations are alive at once.


def first_layer_inputs(model: Any, windows: np.ndarray, batch_size: int) -> LayerInputs:
    """The first decoder layer's inputs of an in-memory ``model`` on ``windows`` (on its device)."""
    device = model.get_input_embeddings().weight.device
    return capture_first_block_inputs(model, windows, batch_size, device)


def run_layer(layer: Any, inputs: LayerInputs) -> list[Any]:
    """The layer's output hidden states for each batch."""
    import torch

    outputs = []
    with torch.no_grad():
        for hidden, kwargs in zip(inputs.hidden, inputs.kwargs, strict=True):
            out = layer(hidden, **kwargs)
            outputs.append((out[0] if isinstance(out, tuple) else out).detach())
    return outputs


@contextlib.contextmanager
def input_hooks(modules: dict[str, Any], callback: Callable[[str, Any], None]) -> Iterator[None]:
    """Call ``callback(name, input)`` with the (detached) input of each module on every forward."""
    handles = [
        module.register_forward_pre_hook(lambda _m, args, name=name: callback(name, args[0].detach()))
        for name, module in modules.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def check_finite(tensor: Any, what: str, module: str, dataset: str) -> None:
    """NaN/inf in collected statistics is a CalibrationError naming the layer and the data."""
    import torch

    if not bool(torch.isfinite(tensor).all()):
        raise CalibrationError(
            f"quant: the {what} of {module} contain NaN/inf on the calibration windows "
            f"(quant.calibration.dataset={dataset}): the checkpoint overflows in fp32; check its weights"
        )


CALIBRATION_BATCH = 8  # windows per forward: bounds activation memory, keeps matmuls large


@dataclass
class TorchInt4Config(Int4Settings):
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)

    def validate(self) -> None:
        validate_settings(self)


class TorchInt4Pass(CalibratesInRanks, Pass):
    """Base of the torch-stage INT4 passes: calibrate and quantize (subclass) one decoder block at a
    time, streamed from the checkpoint and written as it is done (``calibration.streaming``)."""

    consumes = Kind.TORCH
    produces = Kind.TORCH
    placement_knobs = ("device", "torch_dtype")
    memory_profile = "block"
    algorithm: ClassVar[str]
    drift = "bits4"
    group: Group = Group()  # the ranks sharing the calibration windows (set by run_rank)
    forward_time: ForwardTime = ForwardTime()  # this rank's calibration forwards (reset by run_rank)
    family: Family = LLAMA  # the checkpoint's (pipeline.core.families; set by run_rank)

    def targets(self, model: Any, folder: Path) -> list[str]:
        """The quantized layers' names, after the exclude (and fallback) and group-size checks."""
        return self._select({name: m.in_features for name, m in linear_layers(model).items()}, folder)

    def _select(self, widths: dict[str, int], folder: Path | None) -> list[str]:
        selected = select_modules(widths, self.config.exclude, folder)
        check_group_size(self.config.group_size, {name: widths[name] for name in selected})
        return selected

    def check_model(self, facts: PlannedModel) -> PlannedModel:
        # Every candidate layer: the sensitivity fallback, known only once it ran, can only keep
        # some of them out of INT4.
        self._select({name: shape[0] for name, shape in facts.linears.items()}, None)
        check_context(self.config.calibration, facts, f"{self.config_group or 'quant'}.calibration")
        return facts

    def requires(self, source: Artifact) -> None:
        if (source.path / EXTRAS_DIR / INT4_DIR).exists():
            raise PassError(f"{self.name}: {source.path} is already INT4-quantized; select one quant recipe")

    @abstractmethod
    def quantize_block(
        self, prefix: str, layer: Any, inputs: LayerInputs, wanted: set[str]
    ) -> dict[str, QuantizedLinear]:
        """Quantize the linears of decoder ``layer`` (module names ``prefix + name``) that are in
        ``wanted``, in place (fake-quantized weights); set ``inputs.hidden`` to the inputs of the
        next layer; return the parameters."""

    @abstractmethod
    def quantize_head(self, norm: Any, head: Any, hidden: list[Any]) -> dict[str, QuantizedLinear]:
        """Quantize ``lm_head`` (``head``) on the final ``norm`` of the last layer's outputs."""

    def quantize_model(
        self, model: Any, windows: np.ndarray, targets: list[str]
    ) -> dict[str, QuantizedLinear]:
        """Quantize ``targets`` of an in-memory ``model`` in place; the parameters. The same steps
        as :meth:`run`, on a model held whole (tests compare the two)."""
        wanted = set(targets)
        results: dict[str, QuantizedLinear] = {}
        family = self.family = family_of(model.config)
        inputs = first_layer_inputs(model, windows, CALIBRATION_BATCH)
        for index, layer in enumerate(model.get_submodule(family.layers)):
            inputs = inputs.at(index)  # this layer's mask and rotary, the hidden states so far
            results.update(self.quantize_block(f"{family.layer(index)}.", layer, inputs, wanted))
        if LM_HEAD in wanted:
            norm, head = model.get_submodule(family.final_norm), model.get_submodule(family.head)
            results.update(self.quantize_head(norm, head, inputs.hidden))
        return results

    def run_rank(self, source: Artifact, out_dir: Path, group: Group) -> dict[str, Any]:
        """The pass in one rank of ``group`` (all of it for one process): each rank pushes its
        share of the calibration windows through the blocks, :meth:`quantize_block` reduces the
        statistics across ranks (``self.group``), so every rank quantizes alike; rank 0 writes
        and returns the metrics, the others return {}."""
        import time

        import torch
        from tqdm.auto import tqdm

        from calibration.datasets import token_windows
        from calibration.streaming import CheckpointWriter, StreamedCheckpoint
        from pipeline.core.torch_model import copy_beside_weights, load_tokenizer

        self.group = group
        self.forward_time = ForwardTime()
        checkpoint = StreamedCheckpoint(source.path, self.placement)
        family = self.family = checkpoint.family
        windows = token_windows(load_tokenizer(source.path), self.config.calibration)
        mine = shard(windows, group.rank, group.world, CALIBRATION_BATCH)
        targets = self.targets(checkpoint.model, source.path)
        wanted = set(targets)
        untied = LM_HEAD in wanted and checkpoint.untie_lm_head()
        writer = CheckpointWriter(out_dir) if group.main else None
        if group.main:
            copy_beside_weights(source.path, out_dir)
        params: dict[str, Any] = {}
        modules: list[str] = []

        def finish(prefix: str, results: dict[str, QuantizedLinear]) -> None:
            """Write module ``prefix`` (quantized weights exact, in float32) and free it."""
            if writer:
                overrides = {f"{name}.weight": layer.dequantize() for name, layer in results.items()}
                writer.write(checkpoint.output_tensors(prefix, overrides))
            for name, layer in results.items():
                params.update(packed_params(name, layer))
                modules.append(name)
            checkpoint.release(prefix)

        started = time.perf_counter()
        with torch.no_grad():
            inputs = checkpoint.first_block_inputs(mine, CALIBRATION_BATCH)
            if writer:
                writer.write(self._unchanged(checkpoint, family.embeddings))  # no INT4 pass changes it
            layers = range(checkpoint.num_layers)
            for index in tqdm(layers, desc=self.name, unit="layer", disable=not group.main):
                prefix = checkpoint.layer_prefix(index)
                layer = checkpoint.materialize(prefix)
                inputs = inputs.at(index)  # this layer's mask and rotary, the hidden states so far
                finish(prefix, self.quantize_block(prefix + ".", layer, inputs, wanted))
            norm = checkpoint.materialize(family.final_norm)
            if LM_HEAD in wanted:
                head = checkpoint.materialize(LM_HEAD)
                results = self.quantize_head(norm, head, inputs.hidden)
                finish(LM_HEAD, results)
            elif writer and not checkpoint.output_tied:
                writer.write(self._unchanged(checkpoint, LM_HEAD))
            finish(family.final_norm, {})
        seconds = time.perf_counter() - started
        if writer is None:
            return {}
        writer.finish(checkpoint.config, checkpoint.generation_config())
        info = {
            "algorithm": self.algorithm,
            "group_size": self.config.group_size,
            "symmetric": self.config.symmetric,
            "exclude": list(self.config.exclude),
            "config": self.keyed_config(),
        }
        save_packed_params(out_dir / EXTRAS_DIR / INT4_DIR, params, modules, info)
        summary = {k: v for k, v in info.items() if k != "config"} | {"modules": len(modules), "bits": BITS}
        write_metadata(out_dir, Kind.TORCH, {**source.metadata, "quantization": summary})
        log.info("%s: %d layers quantized in %.1f s", self.name, len(modules), seconds)
        return {
            "quantized_layers": len(modules),
            "untied_lm_head": bool(untied),
            "calibration_tokens": int(windows.size),
            "seconds_quantize": round(seconds, 1),
            # This process's share: with N processes, 1/N of the windows (rank 0's time).
            "calibration": {"processes": group.world, "windows": len(mine), **self.forward_time.to_dict()},
        }

    @staticmethod
    def _unchanged(checkpoint: Any, prefix: str) -> dict[str, Any]:
        """A module the pass does not change, as stored (float32, the dtype of today's outputs)."""
        import torch

        names = checkpoint.tensor_names(prefix)
        return {
            name: value.to(torch.float32 if value.is_floating_point() else value.dtype).contiguous()
            for name, value in checkpoint.read(names).items()
        }

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        """The saved checkpoint holds exactly the dequantized stored parameters (checked one
        tensor at a time, so the check is bounded in memory too)."""
        import torch
        from safetensors import safe_open

        folder = result.path / EXTRAS_DIR / INT4_DIR
        info = read_json(folder / INFO_FILE, what="INT4 parameters") if (folder / INFO_FILE).is_file() else {}
        missing = set(info.get("modules", []))
        worst = 0.0
        with safe_open(str(folder / PARAMS_FILE), "pt") if missing else contextlib.nullcontext() as stored:
            for path in sorted(result.path.glob("*.safetensors")):
                with safe_open(str(path), "pt") as handle:
                    for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                        name = key.removesuffix(".weight")
                        if not key.endswith(".weight") or name not in missing:
                            continue
                        missing.discard(name)
                        scales = stored.get_tensor(f"{name}.scales")
                        width = scales.shape[1] * info["group_size"]
                        packed = stored.get_tensor(f"{name}.qweight").numpy()
                        codes = torch.from_numpy(unpack_uint4(packed, width))
                        zeros = stored.get_tensor(f"{name}.zeros")
                        expected = dequantize(codes, scales, zeros, info["group_size"])
                        diff = (handle.get_tensor(key).float() - expected).abs().max()
                        worst = max(worst, float(diff))
        if missing or worst > 0:
            raise PassError(
                f"{self.name}: the saved weights differ from the stored INT4 parameters "
                f"(max |diff| {worst:.3g}, missing {sorted(missing)[:3]})"
            )
        return {}
