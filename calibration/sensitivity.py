"""Per-layer quantization sensitivity, measured in torch on calibration windows.

Sensitivity of a linear layer = mean over tokens of KL(p_fp32 || p_q), the divergence of the
model's next-token distribution when only that layer is quantized (simulated: its weight replaced
by the dequantized weight, its input by the quantized-dequantized input). Two ways to get it:

- ``fisher_sensitivity`` (the default, linear in depth): the second-order Taylor estimate of that
  KL. At the fp32 weights the KL and its gradient vanish and its Hessian is the Fisher information
  of the model's own next-token distribution, so with dy = the change of the layer's output
  (quantized input and weight vs fp32), KL ~ 0.5 E_tokens E_{label ~ p_fp32}[(dlog p(label)/dy . dy)^2]
  (HAWQ, Dong et al. 2019, arXiv:1905.03696, ranks layers by the same second-order term; NVIDIA
  ModelOpt's AutoQuantize scores layers by (grad_output . dy)^2 the same way). The label
  expectation is sampled (seeded) from the fp32 distribution: per batch of windows one forward
  and ``samples`` backwards, with the scores accumulated in float32 in hooks on each layer's
  output gradient; weights get no gradients. Cost: a few forward+backward passes whatever the
  depth, plus one or two matmuls per layer and sample.
- ``layer_sensitivity`` (``quant.sensitivity.method=exact``): the exact KL, restarting the forward
  at the layer's block (``SensitivityProbe.kl``): about half of (layers x one forward), quadratic
  in depth; kept for small models and to validate the estimate (``benchmarks/sensitivity.py``).

``fallback_search`` then keeps the most sensitive layers in higher precision, fewest first, until
the exact KL of the model with every other layer quantized meets a budget (~2 log2(k) forwards).

Written here, not taken from a library: ModelOpt's AutoQuantize is tied to its own quantizer
modules and search, and ModelOpt's and ONNX Runtime's ONNX tools scan graphs with an inference
session per candidate (minutes per layer for a 650 MB graph on 2 cores); torch restarts mid-model
and computes the Fisher term with plain hooks.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.core.families import family_of

# Weight elements quantized at once (chunks of rows) by the Fisher estimate and the KL probe:
# 64 MiB in float32.
FISHER_CHUNK_ELEMENTS = 1 << 24
_BLOCK = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class LayerQuantizer:
    """How one layer is quantized: ``weight`` maps the fp32 weight [out, in] to its dequantized
    value, row by row (per output channel, or groups within a row: the Fisher estimate applies it
    to chunks of rows); ``activation`` (optional) maps the layer's input to its
    quantized-dequantized value."""

    weight: Callable[[Any], Any]
    activation: Callable[[Any], Any] | None = None


@dataclass
class FallbackResult:
    """Layers kept in higher precision and the KL measured for each number of them tried."""

    modules: list[str]
    kl: float
    budget_met: bool
    trials: dict[int, float] = field(default_factory=dict)


class SensitivityProbe:
    """A Llama causal LM plus cached fp32 reference results on fixed token windows.

    ``input_absmax`` holds max |x| of every linear layer's input on the windows (the minmax
    range a static per-tensor activation quantizer would use).
    """

    def __init__(self, model: Any, windows: np.ndarray, batch_size: int = 8) -> None:
        import torch

        self.model = model
        self.windows = windows
        self.batch_size = batch_size
        self.device = model.get_input_embeddings().weight.device  # where the model computes
        self.family = family_of(model.config)
        self.blocks = list(model.get_submodule(self.family.layers))
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.input_absmax: dict[str, float] = {}
        self._inputs: list[list[tuple[Any, dict[str, Any]]]] = [[] for _ in self.blocks]
        self._final: list[Any] = []  # the last block's output per batch (lm_head runs on its norm)
        self._reference: list[Any] = []  # fp32 log-probabilities per batch
        self.tokens = int(windows.size)

        def block_hook(index: int) -> Callable[..., None]:
            def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                hidden = args[0] if args else kwargs["hidden_states"]
                rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                self._inputs[index].append((hidden.detach(), rest))

            return hook

        def linear_hook(name: str) -> Callable[..., None]:
            def hook(_module: Any, args: tuple[Any, ...]) -> None:
                peak = float(args[0].detach().abs().max().float())
                self.input_absmax[name] = max(self.input_absmax.get(name, 0.0), peak)

            return hook

        handles = [
            b.register_forward_pre_hook(block_hook(i), with_kwargs=True) for i, b in enumerate(self.blocks)
        ]
        handles += [m.register_forward_pre_hook(linear_hook(n)) for n, m in self.linears.items()]
        handles.append(
            model.get_submodule(self.family.final_norm).register_forward_pre_hook(
                lambda _m, a: self._final.append(a[0].detach())
            )
        )
        try:
            with torch.inference_mode():
                for start in range(0, len(windows), batch_size):
                    ids = torch.from_numpy(np.ascontiguousarray(windows[start : start + batch_size]))
                    logits = model(input_ids=ids.to(self.device), use_cache=False).logits
                    self._reference.append(torch.log_softmax(logits.float(), dim=-1))
        finally:
            for handle in handles:
                handle.remove()

    def block_of(self, name: str) -> int:
        """The decoder block a layer belongs to (layers after the last block: len(blocks))."""
        found = _BLOCK.match(name)
        return int(found.group(1)) if found else len(self.blocks)

    def kl(self, quantizers: dict[str, LayerQuantizer]) -> float:
        """Mean next-token KL(fp32 || quantized) with the given layers quantized together.

        Block-major: each block's layers are quantized, every batch is pushed through the block,
        and its weights are restored before the next block, so at most one block's quantized
        copies exist beside the fp32 weights (quantizing every layer at once held a second copy
        of the model: 4.20 GiB peak on the 362M shape for 1.35 GiB of weights). Same operations
        per batch as a whole-model forward, so the same numbers."""
        import torch

        if not quantizers:
            return 0.0
        by_block: dict[int, dict[str, LayerQuantizer]] = {}
        for name, quantizer in quantizers.items():
            by_block.setdefault(self.block_of(name), {})[name] = quantizer
        start = min(by_block)
        batches = range(len(self._reference))
        with torch.inference_mode():
            if start < len(self.blocks):
                hidden = [self._inputs[start][batch][0] for batch in batches]
                for index in range(start, len(self.blocks)):
                    with self._quantized(by_block.get(index, {})):
                        for batch in batches:
                            out = self.blocks[index](hidden[batch], **self._inputs[index][batch][1])
                            hidden[batch] = out[0] if isinstance(out, tuple) else out
            else:
                hidden = list(self._final)
            total = 0.0
            with self._quantized(by_block.get(len(self.blocks), {})):
                for batch, reference in enumerate(self._reference):
                    norm = self.model.get_submodule(self.family.final_norm)
                    logits = self.model.get_submodule(self.family.head)(norm(hidden[batch]))
                    candidate = torch.log_softmax(logits.float(), dim=-1)
                    total += float((reference.exp() * (reference - candidate)).double().sum())
        return max(total / self.tokens, 0.0)  # KL >= 0; float32 rounding can dip below

    @contextlib.contextmanager
    def _quantized(self, quantizers: dict[str, LayerQuantizer]) -> Iterator[None]:
        saved: dict[str, Any] = {}
        handles = []
        try:
            for name, quantizer in quantizers.items():
                module = self.linears[name]
                saved[name] = module.weight.data
                module.weight.data = quantized_weight(quantizer, saved[name])
                if quantizer.activation is not None:
                    act = quantizer.activation
                    handles.append(
                        module.register_forward_pre_hook(lambda _m, a, act=act: (act(a[0]).to(a[0].dtype),))
                    )
            yield
        finally:
            for handle in handles:
                handle.remove()
            for name, weight in saved.items():
                self.linears[name].weight.data = weight


def quantized_weight(quantizer: LayerQuantizer, weight: Any) -> Any:
    """``quantizer.weight`` of ``weight`` in its dtype, made in chunks of rows: the quantizer's
    temporaries (several copies of what it quantizes: 0.6 GB each for the 3B shape's 49152 x 3072
    head in fp32) stay bounded; the result is the same, row by row."""
    import torch

    chunks = row_chunks(weight)
    if len(chunks) == 1:
        return quantizer.weight(weight).to(weight.dtype)
    out = torch.empty_like(weight)
    for rows in chunks:
        out[rows] = quantizer.weight(weight[rows]).to(weight.dtype)
    return out


def row_chunks(weight: Any) -> list[slice]:
    """Slices of ``weight``'s rows holding at most ``FISHER_CHUNK_ELEMENTS`` elements each."""
    rows = max(1, FISHER_CHUNK_ELEMENTS // weight.shape[1])
    return [slice(start, start + rows) for start in range(0, weight.shape[0], rows)]


def output_change(quantizer: LayerQuantizer, weight: Any, x: Any, chunks: list[slice], device: Any) -> Any:
    """``dy = act(x) @ w(W)^T - x @ W^T`` in float32 ``[..., out]``, the weight's change made in
    the chunks of rows ``chunks`` and never kept (a cache would hold a float32 copy of every
    weight; the quantizer's temporaries are several copies of what it quantizes: 0.6 GB each for
    the 3B shape's 49152 x 3072 head)."""
    import torch

    inputs = x.float()
    input_change = None
    if quantizer.activation is not None:
        input_change = quantizer.activation(x).to(device=device, dtype=torch.float32) - inputs
    dy = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32, device=device)
    for rows in chunks:
        chunk = weight[rows].float()
        quantized = quantizer.weight(chunk).to(device=device, dtype=torch.float32)
        if quantized.data_ptr() == chunk.data_ptr():
            quantized = quantized.clone()  # made in place below: never the model's own weight
        moved = None if input_change is None else input_change @ quantized.T  # (act(x) - x) @ w(W)^T
        change = quantized.sub_(chunk)  # w(W) - W, in place
        part = inputs @ change.T
        if moved is not None:  # act(x) @ w(W)^T - x @ W^T
            part += moved
        dy[..., rows] = part
        del change, part, moved
    return dy


def layer_sensitivity(
    probe: SensitivityProbe, quantizers: dict[str, LayerQuantizer], progress: bool = True
) -> dict[str, float]:
    """KL of each layer quantized alone, most sensitive first."""
    from tqdm import tqdm

    scores = {
        name: probe.kl({name: quantizer})
        for name, quantizer in tqdm(
            quantizers.items(), desc="sensitivity", unit="layer", disable=not progress
        )
    }
    return dict(sorted(scores.items(), key=lambda item: -item[1]))


@dataclass
class FisherScores:
    """Per-layer second-order estimates of the KL (nats per token), two ways of summing the Fisher
    term over a window's tokens (see :func:`fisher_sensitivity`)."""

    tokenwise: dict[str, float]
    sequence: dict[str, float]


def fisher_scores(
    probe: SensitivityProbe,
    quantizers: dict[str, LayerQuantizer],
    samples: int = 4,
    seed: int = 0,
    progress: bool = True,
) -> FisherScores:
    """The Fisher estimates of every layer's KL on the probe's windows; one forward and ``samples``
    backwards per batch of windows, whatever the number of layers.

    For a layer with input x and weight W, dy = act(x) @ w(W)^T - x @ W^T (float32); g = the
    gradient of L = sum_t log p(label_t) (labels drawn from the fp32 model, seeded) with respect
    to the layer's output, and s_t = g_t . dy_t per token. ``tokenwise`` = 0.5 mean_t E[s_t^2]
    (what ModelOpt's AutoQuantize sums; drops the cross-token terms of the quadratic form);
    ``sequence`` = 0.5 E[(sum_t s_t)^2] / tokens per window, the unbiased estimate of the Fisher
    quadratic form 0.5 dy^T F dy (the cross terms of independently sampled labels have zero mean)
    but noisier. No per-sample gradient, weight gradient or quantized weight copy is kept: each
    layer's dy is made in the forward (its weight quantized once a batch of windows, not once a
    sample) and held for the backwards (the size of the layer's output on one batch: about what
    autograd keeps for the block anyway).
    """
    import torch
    from tqdm import tqdm

    model, device = probe.model, probe.device
    tokenwise = {name: torch.zeros((), dtype=torch.float64, device=device) for name in quantizers}
    sequence = {name: torch.zeros((), dtype=torch.float64, device=device) for name in quantizers}

    def output_hook(name: str) -> Callable[..., None]:
        quantizer = quantizers[name]

        def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
            if not output.requires_grad:
                return
            weight = module.weight.detach()
            chunks = row_chunks(weight)
            with torch.no_grad():
                dy = output_change(quantizer, weight, args[0].detach(), chunks, device)

            def on_grad(grad: Any) -> None:
                dots = torch.zeros(grad.shape[:-1], dtype=torch.float32, device=device)
                for rows in chunks:  # the order output_change made them in: the same sums
                    dots += (grad[..., rows].float() * dy[..., rows]).sum(-1)  # [batch, tokens]
                tokenwise[name] += dots.double().square().sum()
                sequence[name] += dots.double().sum(-1).square().sum()

            output.register_hook(on_grad)

        return hook

    # Gradients flow to the activations only: the embedding output requires grad, no weight does.
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for parameter, _ in frozen:
        parameter.requires_grad_(False)
    handles = [probe.linears[name].register_forward_hook(output_hook(name)) for name in quantizers]
    embeddings = model.get_input_embeddings()
    handles.append(embeddings.register_forward_hook(lambda _m, _a, out: out.requires_grad_()))
    generator = torch.Generator().manual_seed(seed)
    batches = range(0, len(probe.windows), probe.batch_size)
    try:
        with torch.enable_grad():
            for start in tqdm(batches, desc="sensitivity", unit="batch", disable=not progress):
                ids = torch.from_numpy(np.ascontiguousarray(probe.windows[start : start + probe.batch_size]))
                logits = model(input_ids=ids.to(device), use_cache=False).logits
                logprobs = torch.log_softmax(logits.float(), dim=-1)
                probs = logprobs.detach().exp().reshape(-1, logprobs.shape[-1]).cpu()
                # every sample's labels in one draw (one pass over the vocabulary, not one a sample)
                drawn = torch.multinomial(probs, samples, replacement=True, generator=generator).to(device)
                for sample in range(samples):
                    labels = drawn[:, sample : sample + 1]
                    picked = logprobs.reshape(-1, logprobs.shape[-1]).gather(-1, labels).sum()
                    picked.backward(retain_graph=sample < samples - 1)
                del logits, logprobs, picked
    finally:
        for handle in handles:
            handle.remove()
        for parameter, requires_grad in frozen:
            parameter.requires_grad_(requires_grad)
    scale = 0.5 / (probe.tokens * samples)

    def ranked(sums: dict[str, Any]) -> dict[str, float]:
        scores = {name: float(total) * scale for name, total in sums.items()}
        return dict(sorted(scores.items(), key=lambda item: -item[1]))

    return FisherScores(ranked(tokenwise), ranked(sequence))


def fisher_sensitivity(
    probe: SensitivityProbe,
    quantizers: dict[str, LayerQuantizer],
    samples: int = 4,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, float]:
    """Estimated KL of each layer quantized alone (:func:`fisher_scores`), most sensitive first."""
    return fisher_scores(probe, quantizers, samples, seed, progress).tokenwise


def fallback_search(
    probe: SensitivityProbe,
    quantizers: dict[str, LayerQuantizer],
    ranking: list[str],
    budget: float,
    max_layers: int,
) -> FallbackResult:
    """The fewest most-sensitive layers (a prefix of ``ranking``, at most ``max_layers``) to keep
    in higher precision so that the KL with every other layer quantized is <= ``budget``.

    Exponential then binary search over the prefix length: ~2 log2(k) forwards. Keeping more
    layers can only remove quantization error, so the KL is treated as non-increasing in k; the
    trials are returned so a violation shows in the run record.
    """
    trials: dict[int, float] = {}

    def kl_keeping(count: int) -> float:
        if count not in trials:
            kept = set(ranking[:count])
            trials[count] = probe.kl({n: q for n, q in quantizers.items() if n not in kept})
        return trials[count]

    limit = min(max_layers, len(ranking))
    if kl_keeping(0) <= budget:
        return FallbackResult([], trials[0], True, trials)
    failing, passing, count = 0, None, 1
    while count < limit:
        if kl_keeping(count) <= budget:
            passing = count
            break
        failing, count = count, count * 2
    if passing is None:
        if kl_keeping(limit) > budget:
            return FallbackResult(ranking[:limit], trials[limit], False, trials)
        passing = limit
    while passing - failing > 1:
        middle = (passing + failing) // 2
        if kl_keeping(middle) <= budget:
            passing = middle
        else:
            failing = middle
    return FallbackResult(ranking[:passing], trials[passing], True, trials)
