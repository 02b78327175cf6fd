"""GPTQ: INT4 weight-only quantization with Hessian-based error feedback (torch stage), and the
``quant=int4_gptq`` recipe (GPTQ in torch, then ``passes.matmulnbits`` in the graph).

Algorithm: Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers" (ICLR 2023, arXiv:2210.17323), Algorithm 1: for each linear
layer, ``H = 2 X^T X`` over the calibration inputs ``X``; columns are quantized one at a time and
each column's rounding error, scaled by the inverse Hessian's Cholesky factor, is pushed onto the
columns not yet quantized (lazy batch updates of 128 columns). ``act_order`` quantizes columns by
decreasing ``diag(H)`` with "static groups" (AutoGPTQ): group parameters are fixed from the
unchanged weights first, so groups stay contiguous along the input dim, as MatMulNBits needs.
Layers are processed sequentially (the paper; AutoGPTQ, gpt-fast's ``quantize.py``): decoder layer
``i`` is calibrated on the outputs of the already-quantized layers ``< i``. ``lm_head`` (untied
from the embedding) is quantized last, on the final RMSNorm's outputs.

Data parallel (``quant.calibration.num_processes``): each rank pushes its run of the calibration
batches through the layers and the ``X^T X`` sums and token counts are summed across ranks before
each solve, so every rank solves the same matrix and quantizes alike; the solve itself is
repeated in every rank.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from passes.formats.int4 import MAXQ, QuantizedLinear, group_params
from passes.int4 import LayerInputs, TorchInt4Config, TorchInt4Pass, check_finite, input_hooks, run_layer
from pipeline.core.distributed import Group
from pipeline.core.errors import CalibrationError, ConfigError
from pipeline.core.torch_model import LM_HEAD

log = logging.getLogger(__name__)

BLOCK_COLUMNS = 128  # lazy-batch width of the paper; a multiple of every group size


@dataclass
class GptqConfig(TorchInt4Config):
    _target_: str = "passes.gptq.GptqPass"
    # Dampening added to the Hessian's diagonal, as a fraction of its mean (the paper: 1%).
    damp_percent: float = 0.01
    # Quantize columns by decreasing Hessian diagonal (static groups).
    act_order: bool = True

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.damp_percent, int | float) or not 0 <= self.damp_percent <= 1:
            raise ConfigError(f"quant.damp_percent={self.damp_percent}: must be between 0 and 1")


def gptq_quantize(
    weight: Any,
    hessian: Any,
    group_size: int,
    symmetric: bool = False,
    damp_percent: float = 0.01,
    act_order: bool = True,
    name: str = "layer",
) -> QuantizedLinear:
    """GPTQ of ``weight`` [out, in] given ``hessian`` [in, in] = 2 X^T X / n (float32).

    Runs on one thread: thousands of small ops and 576-1536-wide factorizations, which two
    threads run several times slower than one on a shared 2-core machine (cholesky_inverse of a
    1536 x 1536 matrix: 1.0 s on 2 threads vs 0.12 s on 1, measured).
    """
    with single_thread():
        return _gptq(weight, hessian, group_size, symmetric, damp_percent, act_order, name)


def _gptq(
    weight: Any,
    hessian: Any,
    group_size: int,
    symmetric: bool,
    damp_percent: float,
    act_order: bool,
    name: str,
) -> QuantizedLinear:
    import torch

    # On the CPU in float32 whatever the placement: the column loop runs in numpy (see
    # _quantize_columns); the parameters come back on the CPU, where the pass stores them.
    W = weight.detach().float().cpu().clone()
    H = hessian.detach().float().cpu().clone()
    columns = W.shape[1]
    dead = torch.diag(H) == 0  # an input channel that is always 0: its weights do not matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    scales = zeros = None
    if act_order:  # static groups: fixed from the weights before any error feedback
        scales, zeros = group_params(W, group_size, symmetric)
        perm = torch.argsort(torch.diag(H), descending=True)
    else:
        perm = torch.arange(columns)
        scales = torch.empty(W.shape[0], columns // group_size)
        zeros = torch.empty_like(scales)
    W = W[:, perm]
    H = H[perm][:, perm]
    H[range(columns), range(columns)] += damp_percent * torch.mean(torch.diag(H))
    try:
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    except torch.linalg.LinAlgError:
        raise CalibrationError(
            f"quant: the Hessian of {name} is not positive definite after dampening "
            f"(quant.damp_percent={damp_percent}): raise quant.damp_percent or quant.calibration.num_samples"
        ) from None

    codes = torch.zeros_like(W, dtype=torch.uint8)
    group_of = perm // group_size  # the (original) group of each permuted column
    _quantize_columns(W, Hinv, codes, scales, zeros, group_of, group_size, symmetric, act_order)
    codes = codes[:, torch.argsort(perm)]
    return QuantizedLinear(codes, scales.float().contiguous(), zeros.to(torch.uint8).contiguous())


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _quantize_columns(
    W: Any,
    Hinv: Any,
    codes: Any,
    scales: Any,
    zeros: Any,
    group_of: Any,
    group_size: int,
    symmetric: bool,
    act_order: bool,
) -> None:
    """The paper's Algorithm 1 with lazy batch updates, on the permuted ``W`` (modified in place).

    The column loop runs in numpy on the transposed weight (each column a contiguous row): per
    column it is ~10 small vector ops, where numpy's call overhead is a fraction of torch's
    (1.6x faster on a 1536 x 512 weight, measured).
    """
    import torch

    WT = W.T.contiguous().numpy()  # [in, out]; a view of the same memory is not needed
    HinvN = Hinv.numpy()
    order = group_of.numpy()
    columns = WT.shape[0]
    for i1 in range(0, columns, BLOCK_COLUMNS):
        i2 = min(i1 + BLOCK_COLUMNS, columns)
        W1 = WT[i1:i2].copy()
        Q1 = np.zeros_like(W1)
        Err1 = np.zeros_like(W1)
        Hinv1 = HinvN[i1:i2, i1:i2]
        if act_order:  # static groups: each column's parameters are known up front
            S1, Z1 = scales.T.numpy()[order[i1:i2]], zeros.T.numpy()[order[i1:i2]]
        else:
            S1, Z1 = np.empty_like(W1), np.empty_like(W1)
        for i in range(i2 - i1):
            if not act_order and i % group_size == 0:
                # Parameters from the weights as updated so far (this block's updates live in W1;
                # groups never straddle blocks because BLOCK_COLUMNS is a multiple of group_size).
                g = (i1 + i) // group_size
                s, z = group_params(torch.from_numpy(W1[i : i + group_size].T.copy()), group_size, symmetric)
                scales[:, g], zeros[:, g] = s[:, 0], z[:, 0]
                S1[i : i + group_size], Z1[i : i + group_size] = s[:, 0].numpy(), z[:, 0].numpy()
            w, scale, zero = W1[i], S1[i], Z1[i]
            q = np.clip(np.round(w / scale) + zero, 0, MAXQ)
            Q1[i] = q
            error = (w - (q - zero) * scale) / Hinv1[i, i]
            W1[i:] -= np.outer(Hinv1[i, i:], error)
            Err1[i] = error
        codes[:, i1:i2] = torch.from_numpy(Q1.T.astype(np.uint8))
        WT[i2:] -= HinvN[i1:i2, i2:].T @ Err1


class Hessians:
    """Running ``2 X^T X / n`` of each named layer's inputs; in a group of ranks, the sums and
    token counts are summed across them when a layer's Hessian is taken (every rank the same)."""

    def __init__(self, group: Group | None = None) -> None:
        self.sums: dict[str, Any] = {}
        self.counts: dict[str, int] = {}
        self.group = group or Group()

    def add(self, name: str, x: Any) -> None:
        import torch

        rows = x.reshape(-1, x.shape[-1]).float()
        if name not in self.sums:
            # float32 on the inputs' device, whatever the compute dtype
            self.sums[name] = torch.zeros(rows.shape[1], rows.shape[1], device=rows.device)
            self.counts[name] = 0
        self.sums[name].addmm_(rows.T, rows)
        self.counts[name] += rows.shape[0]

    def pop(self, name: str) -> Any:
        import torch

        total = self.group.sum(self.sums.pop(name))
        count = self.group.sum(torch.tensor([self.counts.pop(name)], dtype=torch.float64))
        return 2.0 * total / float(count[0])


class GptqPass(TorchInt4Pass):
    Config = GptqConfig
    name = "gptq"
    version = 2  # 2: streamed, the output written in shards (same tensors)
    algorithm = "gptq"
    calibrates_in_ranks = True  # X^T X sums over the windows: summed across ranks

    def quantize_block(
        self, prefix: str, layer: Any, inputs: LayerInputs, wanted: set[str]
    ) -> dict[str, QuantizedLinear]:
        results: dict[str, QuantizedLinear] = {}
        linears = {
            prefix + name: module
            for name, module in layer.named_modules()
            if prefix + name in wanted and hasattr(module, "in_features")
        }
        if linears:
            hessians = Hessians(self.group)
            with input_hooks(linears, hessians.add), self.forward_time.measure():
                run_layer(layer, inputs)
            for name, module in linears.items():
                results[name] = self._quantize(name, module, hessians.pop(name))
        with self.forward_time.measure():
            inputs.hidden = run_layer(layer, inputs)  # the quantized layer feeds the next one
        return results

    def quantize_head(self, norm: Any, head: Any, hidden: list[Any]) -> dict[str, QuantizedLinear]:
        hessians = Hessians(self.group)
        for h in hidden:
            hessians.add(LM_HEAD, norm(h))
        return {LM_HEAD: self._quantize(LM_HEAD, head, hessians.pop(LM_HEAD))}

    def _quantize(self, name: str, module: Any, hessian: Any) -> QuantizedLinear:
        check_finite(hessian, "input Hessian", name, self.config.calibration.dataset)
        quantized = gptq_quantize(
            module.weight,
            hessian,
            self.config.group_size,
            symmetric=self.config.symmetric,
            damp_percent=self.config.damp_percent,
            act_order=self.config.act_order,
            name=name,
        )
        module.weight.data.copy_(quantized.dequantize())
        return quantized
