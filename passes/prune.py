"""Structured pruning of a Llama checkpoint (torch stage), following Minitron: Muralidharan et al.
2024, "Compact Language Models via Pruning and Knowledge Distillation" (NVIDIA), section 2.

Importance comes from activations on calibration text (one forward pass with hooks, no
gradients), as in Minitron's activation-based estimation:

- MLP channels: mean ``|act(x W_gate) * (x W_up)|`` of each intermediate channel (the input of
  ``down_proj``);
- attention heads: mean L2 norm of each query head's output (the ``o_proj`` input split per
  head). GQA groups are kept whole: every KV group drops the same number of its least important
  query heads, so ``num_key_value_heads`` and the grouping stay valid;
- embedding (hidden) channels: mean ``|x|`` per channel of every RMSNorm output (Minitron's
  LayerNorm-activation criterion), summed over the norms;
- layers (depth): Block Importance, 1 - cos(hidden in, hidden out) averaged over tokens (Men et
  al. 2024, "ShortGPT"; Minitron also ranks layers by it): the least important layers go.

Each ratio removes that fraction of its dimension (rounded; heads per group); the lowest scores
go. The output is a plain HF checkpoint: config sizes updated (``intermediate_size``,
``num_attention_heads`` with an explicit ``head_dim``, ``hidden_size``, ``num_hidden_layers``
and ``layer_types``), weights sliced, the tied embedding kept tied, rebuilt through
``LlamaForCausalLM`` so layer indices are renumbered, reloaded and checked by ``ensures``. Pruned
models lose a lot (measured on the default model: 25% of MLP channels cost most of its
perplexity); the distill pass recovers it.

Metrics: parameters before/after, and perplexity and KL (teacher || pruned) on held-out
calibration windows (a seed and windows disjoint from those that ranked the channels).

Placement (``pipeline.device``, ``pipeline.torch_dtype``): the importance forwards and the
held-out quality forwards run on the placement's device in its dtype; the scores and the
perplexity/KL are accumulated in float64 whatever the compute dtype. The pruned weights are
sliced from the checkpoint's tensors read in float32 (not from the model in the compute dtype),
so a bfloat16 ranking never rounds the output, which stays float32 safetensors.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from calibration.datasets import CalibrationConfig, check_context, check_windows, token_windows
from calibration.workload import CalibratesOnWindows
from pipeline.core.artifacts import Artifact, Kind, write_metadata
from pipeline.core.base import Pass
from pipeline.core.config import MAX_BATCH, register_pass
from pipeline.core.errors import PassError
from pipeline.core.families import LLAMA, Family, family_of, head_dim
from pipeline.core.files import read_json
from pipeline.core.planned_model import PlannedModel

log = logging.getLogger(__name__)

HOLDOUT_WINDOWS = 8  # held-out calibration windows for the before/after perplexity and KL


@dataclass
class PruneConfig:
    """Fractions of each dimension to remove (0: keep it whole), ranked on calibration text."""

    _target_: str = "passes.prune.PrunePass"
    mlp_ratio: float = 0.0  # MLP intermediate channels
    heads_ratio: float = 0.0  # query heads of every KV group
    hidden_ratio: float = 0.0  # embedding (hidden) channels
    depth_ratio: float = 0.0  # decoder layers
    calibration: CalibrationConfig = field(default_factory=lambda: CalibrationConfig(num_samples=32))
    batch_size: int = 8

    def validate(self) -> None:
        ratios = {k: getattr(self, k) for k in ("mlp_ratio", "heads_ratio", "hidden_ratio", "depth_ratio")}
        for name, value in ratios.items():
            _check_ratio(name, value)
        if not any(ratios.values()):
            raise PassError("prune: every ratio is 0, nothing to prune; use prune=none or set a ratio")
        if not isinstance(self.batch_size, int) or not 1 <= self.batch_size <= MAX_BATCH:
            raise PassError(f"prune.batch_size={self.batch_size}: must be from 1 to {MAX_BATCH}")
        check_windows(self.calibration, "prune.calibration")


register_pass("prune", "prune", PruneConfig)


def _check_ratio(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0 or math.isnan(value):
        raise PassError(f"prune.{name}={value}: a ratio must be in [0, 1) (0 keeps the dimension whole)")


@dataclass(frozen=True)
class Shape:
    """The sizes pruning changes, from a Llama config."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int

    @classmethod
    def of(cls, config: dict[str, Any]) -> Shape:
        heads = int(config["num_attention_heads"])
        return cls(
            hidden=int(config["hidden_size"]),
            intermediate=int(config["intermediate_size"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim(config),
            layers=int(config["num_hidden_layers"]),
        )


def kept(total: int, ratio: float) -> int:
    """How many of ``total`` remain after removing ``ratio`` of them (rounded half up, at least one)."""
    return max(1, total - math.floor(total * ratio + 0.5))


def target_shape(shape: Shape, config: PruneConfig) -> Shape:
    """The pruned sizes; a ratio that would break GQA grouping is a one-line error."""
    per_group = shape.heads // shape.kv_heads
    keep_per_group = kept(per_group, config.heads_ratio)
    if config.heads_ratio and per_group == 1:
        raise PassError(
            "prune.heads_ratio: every KV group has a single query head; pruning one would break GQA grouping"
        )
    if config.heads_ratio and keep_per_group == per_group:
        raise PassError(
            f"prune.heads_ratio={config.heads_ratio}: each of the {shape.kv_heads} KV groups has "
            f"{per_group} query heads, so this removes none; {1 / per_group:.2f} removes one head a group"
        )
    return Shape(
        hidden=kept(shape.hidden, config.hidden_ratio),
        intermediate=kept(shape.intermediate, config.mlp_ratio),
        heads=keep_per_group * shape.kv_heads,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        layers=kept(shape.layers, config.depth_ratio),
    )


# --------------------------------------------------------------------------------------------
# Importance


@dataclass
class Importance:
    """Per-dimension scores (higher: more important), from one pass over calibration windows."""

    mlp: np.ndarray  # [layers, intermediate]
    heads: np.ndarray  # [layers, heads]
    hidden: np.ndarray  # [hidden]
    layers: np.ndarray  # [layers] block importance


def _device(model: Any) -> Any:
    return next(model.parameters()).device


def measure_importance(model: Any, windows: np.ndarray, batch_size: int, shape: Shape) -> Importance:
    """Scores from forwards of ``model`` on its device in its dtype, accumulated there in float64."""
    import torch

    family = family_of(model.config)
    layers = model.get_submodule(family.layers)
    device = _device(model)
    mlp = torch.zeros(shape.layers, shape.intermediate, dtype=torch.float64, device=device)
    heads = torch.zeros(shape.layers, shape.heads, dtype=torch.float64, device=device)
    hidden = torch.zeros(shape.hidden, dtype=torch.float64, device=device)
    block = torch.zeros(shape.layers, dtype=torch.float64, device=device)
    tokens = 0
    hooks = []

    def on_down(index: int) -> Any:
        def hook(_: Any, args: tuple[Any, ...]) -> None:
            mlp[index] += args[0].detach().abs().double().sum(dim=(0, 1))

        return hook

    def on_o_proj(index: int) -> Any:
        def hook(_: Any, args: tuple[Any, ...]) -> None:
            x = args[0].detach().double()
            heads[index] += x.view(*x.shape[:-1], shape.heads, shape.head_dim).norm(dim=-1).sum(dim=(0, 1))

        return hook

    def on_norm(_: Any, __: Any, output: Any) -> None:
        hidden.add_(output.detach().abs().double().sum(dim=(0, 1)))

    def on_layer(index: int) -> Any:
        def hook(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            before = (args[0] if args else kwargs["hidden_states"]).detach().double()
            after = (output[0] if isinstance(output, tuple) else output).detach().double()
            cosine = torch.nn.functional.cosine_similarity(before, after, dim=-1)
            block[index] += (1.0 - cosine).sum()

        return hook

    down, o_proj = family.mlp_projections[-1], family.attention_projections[-1]
    for index, layer in enumerate(layers):
        hooks.append(layer.get_submodule(down).register_forward_pre_hook(on_down(index)))
        hooks.append(layer.get_submodule(o_proj).register_forward_pre_hook(on_o_proj(index)))
        for norm in family.norms:
            hooks.append(layer.get_submodule(norm).register_forward_hook(on_norm))
        hooks.append(layer.register_forward_hook(on_layer(index), with_kwargs=True))
    hooks.append(model.get_submodule(family.final_norm).register_forward_hook(on_norm))
    try:
        with torch.inference_mode():
            for start in range(0, len(windows), batch_size):
                batch = torch.from_numpy(np.ascontiguousarray(windows[start : start + batch_size]))
                model(input_ids=batch.to(device), use_cache=False)
                tokens += batch.numel()
    finally:
        for handle in hooks:
            handle.remove()
    return Importance(
        mlp=(mlp / tokens).cpu().numpy(),
        heads=(heads / tokens).cpu().numpy(),
        hidden=(hidden / tokens).cpu().numpy(),
        layers=(block / tokens).cpu().numpy(),
    )


def top(scores: np.ndarray, count: int) -> np.ndarray:
    """Indices of the ``count`` highest scores, in their original order (ties: lower index)."""
    order = np.argsort(-scores, kind="stable")[:count]
    return np.sort(order)


def kept_heads(scores: np.ndarray, shape: Shape, target: Shape) -> np.ndarray:
    """Query heads kept in one layer: the best ``target.heads // kv_heads`` of every KV group."""
    per_group, keep = shape.heads // shape.kv_heads, target.heads // target.kv_heads
    return np.concatenate(
        [
            group * per_group + top(scores[group * per_group : (group + 1) * per_group], keep)
            for group in range(shape.kv_heads)
        ]
    )


# --------------------------------------------------------------------------------------------
# Slicing


def checkpoint_state(folder: Path) -> dict[str, Any]:
    """The checkpoint's tensors as float32 CPU tensors (exact: as ``load_causal_lm`` casts them on
    the CPU in float32), read file by file from the safetensors."""
    from passes.export import Checkpoint

    checkpoint = Checkpoint(folder)
    return {name: checkpoint.float32(name) for name in checkpoint.files}


def pruned_state(
    state: dict[str, Any],
    tied: bool,
    importance: Importance,
    shape: Shape,
    target: Shape,
    family: Family = LLAMA,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pruned model's state dict (sliced from ``state``, the checkpoint's tensors, named as
    ``family`` names them; ``tied``: the model ties lm_head to the embedding) and what was kept
    (indices, for the record)."""
    import torch

    hidden = torch.from_numpy(top(importance.hidden, target.hidden))
    layers = [int(i) for i in top(importance.layers, target.layers)]
    out: dict[str, Any] = {}

    def rows(t: Any, index: Any) -> Any:
        return t.index_select(0, index).contiguous()

    def cols(t: Any, index: Any) -> Any:
        return t.index_select(1, index).contiguous()

    embeddings, final_norm, head = (
        f"{name}.weight" for name in (family.embeddings, family.final_norm, family.head)
    )
    q, k, v, o = family.attention_projections
    gate, up, down = family.mlp_projections
    out[embeddings] = cols(state[embeddings], hidden)
    out[final_norm] = rows(state[final_norm], hidden)
    if head in state and not tied:
        out[head] = cols(state[head], hidden)
    record: dict[str, Any] = {"layers": layers, "mlp_channels": {}, "heads": {}}
    for new, old in enumerate(layers):
        src, dst = f"{family.layer(old)}.", f"{family.layer(new)}."
        channels = torch.from_numpy(top(importance.mlp[old], target.intermediate))
        head_index = kept_heads(importance.heads[old], shape, target)
        q_rows = torch.from_numpy(
            np.concatenate([np.arange(h * shape.head_dim, (h + 1) * shape.head_dim) for h in head_index])
        )
        record["mlp_channels"][new] = len(channels)
        record["heads"][new] = [int(h) for h in head_index]
        for norm in family.norms:
            out[f"{dst}{norm}.weight"] = rows(state[f"{src}{norm}.weight"], hidden)
        for norm in family.qk_norms or ():  # one weight of head_dim shared by every head: kept
            name = f"{family.attention}.{norm}.weight"
            out[f"{dst}{name}"] = state[f"{src}{name}"].clone()
        out[f"{dst}{q}.weight"] = cols(rows(state[f"{src}{q}.weight"], q_rows), hidden)
        for kv in (k, v):
            out[f"{dst}{kv}.weight"] = cols(state[f"{src}{kv}.weight"], hidden)
        out[f"{dst}{o}.weight"] = rows(cols(state[f"{src}{o}.weight"], q_rows), hidden)
        for proj in (gate, up):
            out[f"{dst}{proj}.weight"] = cols(rows(state[f"{src}{proj}.weight"], channels), hidden)
        out[f"{dst}{down}.weight"] = rows(cols(state[f"{src}{down}.weight"], channels), hidden)
        # A projection's bias follows its output rows (Qwen2's q/k/v; Llama's attention_bias and
        # mlp_bias): q keeps its heads' rows, k and v all (KV heads are not pruned), o and down
        # the kept hidden channels, gate and up the kept MLP channels.
        kept_rows = {q: q_rows, k: None, v: None, o: hidden, gate: channels, up: channels, down: hidden}
        for proj, index in kept_rows.items():
            if (bias := state.get(f"{src}{proj}.bias")) is not None:
                out[f"{dst}{proj}.bias"] = bias.clone() if index is None else rows(bias, index)
    return out, record


def pruned_config(config: dict[str, Any], target: Shape, layers: list[int]) -> dict[str, Any]:
    pruned = dict(config)
    pruned.update(
        hidden_size=target.hidden,
        intermediate_size=target.intermediate,
        num_attention_heads=target.heads,
        num_key_value_heads=target.kv_heads,
        head_dim=target.head_dim,  # explicit: hidden / heads no longer gives it
        num_hidden_layers=target.layers,
    )
    types = config.get("layer_types")
    if not isinstance(types, list) and family_of(config).window_key is not None:
        # Derived by transformers from the layer count (Qwen2's max_window_layers): written out,
        # so the kept layers keep their own types after depth pruning renumbers them.
        from transformers import AutoConfig

        types = getattr(AutoConfig.for_model(**config), "layer_types", None)
    if isinstance(types, list):
        pruned["layer_types"] = [types[i] for i in layers]
    return pruned


def _perplexity(mean_nll: float) -> float:
    """``exp(mean_nll)``, infinite for a model so diverged that it overflows (never a traceback)."""
    return math.exp(mean_nll) if mean_nll < 709.0 else math.inf


def holdout_quality(teacher: Any, student: Any, windows: np.ndarray) -> dict[str, float]:
    """Perplexity of both and mean KL(teacher || student) per token on ``windows``: each model runs
    on its own device in its own dtype; the log-probabilities and sums are float64 (on the CPU)."""
    import torch

    nll_t = nll_s = kl = 0.0
    count = 0
    with torch.inference_mode():
        for window in windows:
            ids = torch.from_numpy(np.ascontiguousarray(window[None]))
            logits_t = teacher(input_ids=ids.to(_device(teacher)), use_cache=False).logits
            logits_s = student(input_ids=ids.to(_device(student)), use_cache=False).logits
            lt = torch.log_softmax(logits_t.double().cpu()[0, :-1], -1)
            ls = torch.log_softmax(logits_s.double().cpu()[0, :-1], -1)
            targets = ids[0, 1:]
            nll_t -= float(lt.gather(-1, targets[:, None]).sum())
            nll_s -= float(ls.gather(-1, targets[:, None]).sum())
            kl += float((lt.exp() * (lt - ls)).sum())
            count += len(targets)
    return {
        "teacher_perplexity": _perplexity(nll_t / count),
        "perplexity": _perplexity(nll_s / count),
        "kl_vs_teacher": kl / count,
        "tokens": count,
    }


class PrunePass(CalibratesOnWindows, Pass):
    """Torch -> torch: the pruned checkpoint."""

    Config = PruneConfig
    name = "prune"
    knob_group = "prune"
    drift = "pruned"
    version = 2  # 2: the teacher (path, digest) in the metadata, for distill
    consumes = Kind.TORCH
    produces = Kind.TORCH
    placement_knobs = ("device", "torch_dtype")
    loads_module_by_module = True  # StreamedCheckpoint.load_model

    def check_model(self, facts: PlannedModel) -> PlannedModel:
        hf = dict(facts.config)
        check_context(self.config.calibration, facts, f"{self.config_group or 'prune'}.calibration")
        target = target_shape(Shape.of(hf), self.config)
        # Which layers the ranking keeps is known only once it ran; the facts need only how many.
        return facts.replace(config=pruned_config(hf, target, list(range(target.layers))), teacher=hf)

    def run(self, source: Artifact, out_dir: Path) -> dict[str, Any]:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from calibration.streaming import StreamedCheckpoint
        from pipeline.core.torch_model import copy_beside_weights, load_tokenizer

        config = self.config
        hf = read_json(source.path / "config.json", what="a config.json")
        shape = Shape.of(hf)
        target = target_shape(shape, config)
        # Module by module: the checkpoint's pages are not kept mapped beside the weights.
        model = StreamedCheckpoint(source.path, self.placement).load_model()
        tokenizer = load_tokenizer(source.path)
        windows = token_windows(tokenizer, config.calibration, knob="prune.calibration")
        holdout = self._holdout(tokenizer, windows)
        log.info(
            "prune: ranking on %d windows x %d tokens; %s -> %s",
            len(windows), config.calibration.seq_len, asdict(shape), asdict(target),
        )  # fmt: skip
        importance = measure_importance(model, windows, config.batch_size, shape)
        family = family_of(hf)
        state, kept_record = pruned_state(
            checkpoint_state(source.path), model.config.tie_word_embeddings, importance, shape, target, family
        )
        pruned_hf = pruned_config(hf, target, kept_record["layers"])
        settings = {k: v for k, v in pruned_hf.items() if k not in ("architectures", "model_type")}
        # float32 whatever the checkpoint's dtype: the sliced weights load exact, as LlamaForCausalLM(config)
        student = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(family.model_type, **settings), dtype=torch.float32, trust_remote_code=False
        )
        missing, unexpected = student.load_state_dict(state, strict=False)
        head = f"{family.head}.weight"
        missing = [m for m in missing if not (m == head and student.config.tie_word_embeddings)]
        if missing or unexpected:
            raise PassError(
                f"prune: the sliced weights do not fit the pruned config ({missing or unexpected})"
            )
        student = student.to(torch.float32).eval()

        copy_beside_weights(source.path, out_dir, skip=("config.json",))
        student.save_pretrained(out_dir, safe_serialization=True)
        del state
        student = student.to(device=self.placement.torch_device, dtype=self.placement.dtype)
        quality = holdout_quality(model, student, holdout)
        params_before = sum(p.numel() for p in model.parameters())
        params_after = sum(p.numel() for p in student.parameters())
        info = {
            "algorithm": "minitron-activation",
            "ratios": {
                k: getattr(config, k) for k in ("mlp_ratio", "heads_ratio", "hidden_ratio", "depth_ratio")
            },
            "shape_before": asdict(shape),
            "shape_after": asdict(target),
            "layers_kept": kept_record["layers"],
            "heads_kept": kept_record["heads"],
            "block_importance": [round(float(v), 6) for v in importance.layers],
            # The unpruned checkpoint, for distillation (passes/distill.py checks the digest).
            "teacher": {"path": str(source.path.resolve()), "digest": source.digest},
        }
        write_metadata(out_dir, Kind.TORCH, {**source.metadata, "prune": info})
        log.info(
            "prune: %d -> %d parameters; held-out perplexity %.2f -> %.2f",
            params_before, params_after, quality["teacher_perplexity"], quality["perplexity"],
        )  # fmt: skip
        return {
            "parameters": {
                "before": params_before,
                "after": params_after,
                "ratio": params_after / params_before,
            },
            "shape": {"before": asdict(shape), "after": asdict(target)},
            "layers_kept": kept_record["layers"],
            "holdout": quality,
        }

    def _holdout(self, tokenizer: Any, ranking: np.ndarray) -> np.ndarray:
        """Windows for before/after quality: another seed, none of the ranking windows."""
        config = self.config.calibration
        every = token_windows(
            tokenizer,
            CalibrationConfig(
                config.dataset, config.num_samples + HOLDOUT_WINDOWS, config.seq_len, config.seed + 1
            ),
            knob="prune.calibration",
        )
        used = {w.tobytes() for w in ranking}
        fresh = [w for w in every if w.tobytes() not in used][:HOLDOUT_WINDOWS]
        return np.stack(fresh)

    def ensures(self, source: Artifact, result: Artifact) -> dict[str, Any]:
        """The pruned checkpoint reloads offline with the recorded sizes and a tied head stays tied."""
        from pipeline.core.torch_model import load_causal_lm

        model = load_causal_lm(result.path)
        after = result.metadata["prune"]["shape_after"]
        config = model.config
        actual = {
            "hidden": config.hidden_size,
            "intermediate": config.intermediate_size,
            "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "layers": config.num_hidden_layers,
        }
        if actual != after:
            raise PassError(f"prune: the saved checkpoint has {actual}, the pass meant {after}")
        if (
            config.tie_word_embeddings
            and model.get_output_embeddings().weight.data_ptr()
            != model.get_input_embeddings().weight.data_ptr()
        ):
            raise PassError("prune: the saved checkpoint's lm_head is no longer tied to its embedding")
        return {"reloaded": True}
