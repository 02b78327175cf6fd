"""Per-layer quantization sensitivity, measured in torch on calibration windows.

Sensitivity of a linear layer = mean over tokens of KL(p_fp32 || p_q), the divergence of the
model's next-token distribution when only that layer is quantized (simulated: its weight replaced
by the dequantized weight, its input by the quantized-dequantized input). This is the layer-wise
scan of mixed-precision quantization (HAWQ, Dong et al. 2019, arXiv:1905.03696, ranks layers by a
second-order proxy of the same loss; ModelOpt's and llm-compressor's tooling rank them by output
divergence, as here). ``fallback_search`` then keeps the most sensitive layers in higher precision,
fewest first, until the KL of the model with every other layer quantized meets a budget.

Cost: one reference forward caches each decoder block's input; a layer's scan restarts at its
own block, so a full scan costs about half of (layers x one forward). Written here, not taken
from a library: ModelOpt's and ONNX Runtime's tools scan ONNX graphs with an inference session
per candidate (minutes per layer for a 650 MB graph on 2 cores); torch restarts mid-model.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_BLOCK = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class LayerQuantizer:
    """How one layer is quantized: ``weight`` maps the fp32 weight [out, in] to its dequantized
    value; ``activation`` (optional) maps the layer's input to its quantized-dequantized value."""

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
        self.blocks = list(model.model.layers)
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
                peak = float(args[0].detach().abs().max())
                self.input_absmax[name] = max(self.input_absmax.get(name, 0.0), peak)

            return hook

        handles = [
            b.register_forward_pre_hook(block_hook(i), with_kwargs=True) for i, b in enumerate(self.blocks)
        ]
        handles += [m.register_forward_pre_hook(linear_hook(n)) for n, m in self.linears.items()]
        handles.append(
            model.model.norm.register_forward_pre_hook(lambda _m, a: self._final.append(a[0].detach()))
        )
        try:
            with torch.inference_mode():
                for start in range(0, len(windows), batch_size):
                    ids = torch.from_numpy(np.ascontiguousarray(windows[start : start + batch_size]))
                    logits = model(input_ids=ids, use_cache=False).logits
                    self._reference.append(torch.log_softmax(logits.float(), dim=-1))
        finally:
            for handle in handles:
                handle.remove()

    def block_of(self, name: str) -> int:
        """The decoder block a layer belongs to (layers after the last block: len(blocks))."""
        found = _BLOCK.match(name)
        return int(found.group(1)) if found else len(self.blocks)

    def kl(self, quantizers: dict[str, LayerQuantizer]) -> float:
        """Mean next-token KL(fp32 || quantized) with the given layers quantized together."""
        import torch

        if not quantizers:
            return 0.0
        start = min(self.block_of(name) for name in quantizers)
        total = 0.0
        with self._quantized(quantizers), torch.inference_mode():
            for batch, reference in enumerate(self._reference):
                if start < len(self.blocks):
                    hidden, _ = self._inputs[start][batch]
                    for block, inputs in zip(self.blocks[start:], self._inputs[start:], strict=True):
                        out = block(hidden, **inputs[batch][1])
                        hidden = out[0] if isinstance(out, tuple) else out
                else:
                    hidden = self._final[batch]
                logits = self.model.lm_head(self.model.model.norm(hidden))
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
                module.weight.data = quantizer.weight(saved[name]).to(saved[name].dtype)
                if quantizer.activation is not None:
                    act = quantizer.activation
                    handles.append(module.register_forward_pre_hook(lambda _m, a, act=act: (act(a[0]),)))
            yield
        finally:
            for handle in handles:
                handle.remove()
            for name, weight in saved.items():
                self.linears[name].weight.data = weight


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
