"""RMSNorm rules: the exported ``x * rsqrt(mean(x^2) + eps) * weight`` subgraph becomes
``SimplifiedLayerNormalization`` (or, for standard-op targets, ONNX ``RMSNormalization``, opset
23); a residual ``Add`` feeding one becomes
``com.microsoft.SkipSimplifiedLayerNormalization``, whose fourth output carries the sum on.

Algorithm: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization". Specs: ONNX Runtime
contrib ops ``SimplifiedLayerNormalization`` (registered in the ONNX domain) and
``SkipSimplifiedLayerNormalization`` (``docs/ContribOperators.md``).
onnxscript's ``ort_fusions.rms_normalization`` expects ``Reciprocal(Sqrt(.))`` and its skip rule
needs fully inferred [B, S, D] shapes; the TorchScript export writes ``Div(1, Sqrt(.))`` and
leaves batch and sequence dims unnamed, so these rules accept both forms and check the hidden
size against the scale instead.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import pattern

from passes.fusion.common import constant_scalar

FLOAT_TYPES = frozenset([ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16])


class RmsNorm(pattern.RewriteRuleClassBase):
    """``Mul(scale, Mul(x, 1/Sqrt(ReduceMean(Pow(x, 2)) + eps)))`` -> ``SimplifiedLayerNormalization``
    (ONNX Runtime), or the ONNX standard ``RMSNormalization`` (opset 23) with ``standard``."""

    def __init__(self, name: str, scale_first: bool, standard: bool = False) -> None:
        super().__init__(name)
        self._scale_first = scale_first
        self._standard = standard

    def pattern(self, op: Any, x: Any, scale: Any, epsilon: Any, one: Any) -> Any:
        x = pattern.OrValue([op.Cast(x, to=ir.DataType.FLOAT), x])
        mean_square = op.ReduceMean(op.Pow(x, 2.0), [-1], keepdims=1)
        rms = op.Sqrt(op.Add(mean_square, epsilon))
        inverse = pattern.OrValue([op.Reciprocal(rms), op.Div(one, rms)])
        normalized = op.Mul(x, inverse)
        normalized = pattern.OrValue([op.Cast(normalized, to=ir.DataType.FLOAT), normalized])
        return op.Mul(scale, normalized) if self._scale_first else op.Mul(normalized, scale)

    def check(self, context: Any, x: Any, scale: Any, epsilon: Any, one: Any = None, **_: Any) -> Any:
        result = pattern.MatchResult()
        if not isinstance(constant_scalar(epsilon), float):
            return result.fail("epsilon is not a constant scalar", epsilon)
        if one is not None and constant_scalar(one) != 1.0:
            return result.fail("Div numerator is not 1", one)
        if x.dtype not in FLOAT_TYPES or scale.dtype not in FLOAT_TYPES:
            return result.fail("input or scale is not floating point", [x, scale])
        if scale.const_value is None or scale.shape is None or scale.shape.rank() != 1:
            return result.fail("scale is not a constant vector", scale)
        return result

    def rewrite(self, op: Any, x: Any, scale: Any, epsilon: Any, **_: Any) -> Any:
        # Same attributes in both: normalize the last axis, accumulate in float.
        # ONNX Runtime registers SimplifiedLayerNormalization in the ONNX domain.
        normalize = op.RMSNormalization if self._standard else op.SimplifiedLayerNormalization
        return normalize(x, scale, axis=-1, epsilon=constant_scalar(epsilon), stash_type=1)


class SkipRmsNorm(pattern.RewriteRuleClassBase):
    """``SimplifiedLayerNormalization(Add(a, b))`` -> ``SkipSimplifiedLayerNormalization(a, b)``.

    The kernel takes no broadcasting: both operands must be [batch, seq, hidden]. Shape inference
    cannot see through contrib ops (``MatMulNBits``), so an operand of unknown shape is accepted
    when the other one is known to be [batch, seq, hidden] of the model's hidden size.
    """

    def __init__(self, name: str, hidden_size: int) -> None:
        super().__init__(name)
        self._hidden = hidden_size

    def pattern(self, op: Any, a: Any, b: Any, scale: Any) -> Any:
        total = op.Add(a, b)
        normalized = op.SimplifiedLayerNormalization(
            total, scale, axis=-1, _allow_other_attributes=True, _outputs=["normalized"]
        )
        return normalized, total

    def check(self, context: Any, a: Any, b: Any, scale: Any, normalized: Any, **_: Any) -> Any:
        result = pattern.MatchResult()
        if scale.shape is None or scale.shape.rank() != 1 or scale.shape[0] != self._hidden:
            return result.fail("the scale is not a vector of the hidden size", scale)
        known = [v.shape is not None and v.shape.rank() == 3 and v.shape[2] == self._hidden for v in (a, b)]
        unknown = [v.shape is None for v in (a, b)]
        if not (all(known) or (any(known) and all(k or u for k, u in zip(known, unknown, strict=True)))):
            return result.fail("operands are not both [batch, seq, hidden]", [a, b])
        if normalized.producer().attributes.get_int("stash_type", 1) != 1:
            return result.fail("stash_type is not float", normalized)
        return result

    def rewrite(self, op: Any, a: Any, b: Any, scale: Any, normalized: Any, **_: Any) -> Any:
        epsilon = normalized.producer().attributes.get_float("epsilon", 1e-5)
        out, _mean, _inv_std, total = op.SkipSimplifiedLayerNormalization(
            a, b, scale, epsilon=epsilon, _outputs=4, _domain="com.microsoft"
        )
        return out, total


RMS_NORM_RULES = pattern.RewriteRuleSet(
    [RmsNorm.rule("RmsNorm", scale_first=True), RmsNorm.rule("RmsNormScaleLast", scale_first=False)]
)
# The ONNX standard op (opset 23), for targets that parse standard ops only (TensorRT).
ONNX_RMS_NORM_RULES = pattern.RewriteRuleSet(
    [
        RmsNorm.rule("OnnxRmsNorm", scale_first=True, standard=True),
        RmsNorm.rule("OnnxRmsNormScaleLast", scale_first=False, standard=True),
    ]
)


def skip_rms_norm_rules(hidden_size: int) -> pattern.RewriteRuleSet:
    return pattern.RewriteRuleSet([SkipRmsNorm.rule("SkipRmsNorm", hidden_size)])
