"""FP16 graph (``quant=fp16``; graph stage): weights and activations in IEEE half precision.

Conversion by ONNX Runtime's own converter (``onnxruntime.transformers.float16
.convert_float_to_float16``, the one its transformer optimizer uses): every float initializer
and activation becomes float16, with Casts at the graph's inputs and outputs
(``keep_io_types``), so the engine's IO (int64 ids, float32 logits and KV cache) stays as the
runtime expects. Ops that overflow or lose too much in half precision stay fp32 behind Casts
(``keep_fp32_ops``): RMSNorm's ``Pow``/``ReduceMean``/``Sqrt`` (squares of hidden states pass
65504, fp16's largest value) and ``Softmax``, as mixed-precision practice does (Micikevicius et
al. 2018, "Mixed Precision Training": reductions in fp32).

For ``target=tensorrt`` this is how an FP16 engine is made: TensorRT 11 builds strongly typed
networks, so half precision must be in the graph (there is no FP16 builder flag any more).
ONNX Runtime on CPU runs the graph too (slower than fp32 there: few fp16 CPU kernels), which is
how ``ensures`` and the gate judge its numerics.

Memory: the converter takes an ``onnx.ModelProto`` with its weights, so this pass holds the fp32
weights once (``pipeline.core.graph_io.load_proto``, no second copy) plus the fp16 ones it makes; the
result is written through ``pipeline.core.graph_io.save_graph`` from the converted protobuf's tensors
(no further copy). Rewriting the converter on onnx-ir would lift that; we keep ONNX Runtime's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.artifacts import Artifact, Kind, read_metadata, write_metadata
from pipeline.core.base import Pass
from pipeline.core.config import check_number, register_pass
from pipeline.core.errors import PassError
from pipeline.core.graph_io import check_data_files, link_folder_files, load_proto, save_graph
from pipeline.runtime.parity import PARITY_PROMPT_TEXT, compare_graphs


@dataclass
class Fp16Config:
    """``quant=fp16``: ONNX Runtime's float16 converter with fp32 islands."""

    _target_: str = "passes.fp16.Fp16Pass"
    keep_fp32_ops: list[str] = field(default_factory=lambda: ["Pow", "ReduceMean", "Sqrt", "Softmax"])
    # The pass fails when the fp16 graph's greedy token differs from the fp32 graph's on more
    # positions of a fixed prompt.
    min_top1_agreement: float = 0.9

    def validate(self) -> None:
        check_number("quant.min_top1_agreement", self.min_top1_agreement, low=0, high=1)


register_pass("quant", "fp16", Fp16Config)


class Fp16Pass(Pass):
    Config = Fp16Config
    name = "fp16"
    drift = "bits16"
    version = 2  # 2: written through pipeline/core/graph_io.py (sharded data, other files hard-linked)
    consumes = Kind.GRAPH
    produces = Kind.GRAPH

    def requires(self, source: Artifact) -> None:
        quantization = source.metadata.get("quantization")
        if quantization:
            raise PassError(
                f"fp16: {source.path} is already quantized ({quantization.get('scheme', '?')}); "
                "quant=fp16 takes the exported fp32 graph"
            )

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        import onnx_ir as ir
        from onnxruntime.transformers.float16 import convert_float_to_float16

        metadata = read_metadata(source.path)
        model_file = metadata.get("model_file", "model.onnx")
        # ONNX Runtime's converter works on protobuf with the weights in it: the one place the
        # fp32 weights are all in memory (plus the fp16 ones it makes); see the module docstring.
        model = load_proto(source.path, model_file)
        casts_before = sum(n.op_type == "Cast" for n in model.graph.node)  # the converter edits in place
        converted = convert_float_to_float16(
            model, keep_io_types=True, op_block_list=list(self.config.keep_fp32_ops), disable_shape_infer=True
        )
        del model
        fp32_ops = sorted({n.op_type for n in converted.graph.node} & set(self.config.keep_fp32_ops))
        casts = sum(n.op_type == "Cast" for n in converted.graph.node) - casts_before
        # The IR wraps the converted protobuf's tensors (no copy); every weight changed: all written.
        saved = save_graph(ir.serde.deserialize_model(converted), out_dir, name=model_file)
        del converted
        link_folder_files(source.path, out_dir)
        quantization = {
            "scheme": "fp16",
            "converter": "onnxruntime.transformers.float16",
            "fp32_ops": fp32_ops,
        }
        write_metadata(out_dir, Kind.GRAPH, {**metadata, "quantization": quantization})
        return {"added_casts": casts, "fp32_ops": fp32_ops, "disk": saved.as_dict()}

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        check_data_files(result.path, self.name)
        agreement = compare_graphs(source.path, result.path, PARITY_PROMPT_TEXT)
        if not agreement["finite"]:
            raise PassError("fp16: the fp16 graph produced non-finite logits on a fixed prompt")
        if agreement["top1_agreement"] < self.config.min_top1_agreement:
            raise PassError(
                f"fp16: the fp16 graph agrees with the fp32 graph on {agreement['top1_agreement']:.0%} of "
                "greedy tokens of a fixed prompt (< quant.min_top1_agreement="
                f"{self.config.min_top1_agreement})"
            )
        return {"vs_input": agreement}
