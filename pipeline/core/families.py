"""What the passes know of a model family, keyed by ``config.json``'s ``model_type``: one typed,
frozen :class:`Family` per family, read by every pass instead of naming Llama's modules.

A family says where its modules lie (the decoder stack, embeddings, final norm and head; in each
block the attention and MLP containers, the projections and the norms), what its config may add
to a Llama block (projection biases, per-head q/k norms, a ``head_dim`` of its own, a sliding
window), and which norm or linear smooths which projections for AWQ and SmoothQuant.

The two anchors, whose shapes this follows:

- llm-compressor's per-architecture mappings (``modifiers/awq/mappings.py``
  ``AWQ_MAPPING_REGISTRY`` and ``modifiers/transform/smoothquant/utils.py``
  ``DEFAULT_SMOOTHQUANT_MAPPINGS``): a smoothing group is a producer (a norm, or the linear
  before) and the projections it feeds. Llama, Mistral, Qwen2 and Qwen3 all use the default
  mapping: input norm -> q/k/v, v -> o, post-attention norm -> gate/up, up -> down.
- ONNX Runtime GenAI's model builder (``src/python/py/models/builders/``): one base that reads
  head size, window, activation, norm and rope from the config, with thin per-family classes
  (Qwen2 adds nothing but its biases, found on the modules; Qwen3 its q/k norms; Mistral
  nothing).

Adding a family is one more :class:`Family` in :data:`FAMILIES` and its test; the config bounds
of a family live beside it in ``pipeline/source_config.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pipeline.core.errors import SourceError

# How a smoothing group's producer absorbs the inverse of the scale its consumers take:
# "norm": the norm's gain; "up": the output rows of the linear before (MLP up -> down);
# "v": the output rows of v_proj, one scale per KV head shared by the query heads it serves (-> o).
SMOOTHING_KINDS = ("norm", "up", "v")


@dataclass(frozen=True)
class Smoothing:
    """One AWQ / SmoothQuant group, its module names relative to a decoder block."""

    name: str  # "qkv", "o", "gate_up", "down": the group's name in records and per-group settings
    kind: str  # one of SMOOTHING_KINDS
    producer: str  # "input_layernorm", "self_attn.v_proj", ...
    consumers: tuple[str, ...]  # the projections that take the scale: "self_attn.q_proj", ...
    # What AWQ runs to score a scale: the block the consumers belong to ("self_attn" is called
    # with the layer's attention arguments), or None where the consumer alone is scored.
    scored_by: str | None


@dataclass(frozen=True)
class Family:
    """Where a family's modules lie and what its config may add; names as transformers has them."""

    model_type: str
    architectures: tuple[str, ...]  # config.json ``architectures`` accepted for this model_type
    smoothing: tuple[Smoothing, ...]
    layers: str = "model.layers"
    embeddings: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    head: str = "lm_head"
    rotary: str = "model.rotary_emb"
    attention: str = "self_attn"
    mlp: str = "mlp"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    input_norm: str = "input_layernorm"
    post_attention_norm: str = "post_attention_layernorm"
    qk_norms: tuple[str, str] | None = None  # per-head RMSNorm of q and k before rotary (Qwen3)
    fixed_biases: tuple[str, ...] = ()  # projections that always carry a bias (Qwen2: q, k, v)
    bias_flags: tuple[str, ...] = ("attention_bias", "mlp_bias")  # config keys that add biases
    window_key: str | None = None  # the config key of the sliding window (Mistral, Qwen2, Qwen3)
    # Whether the window applies to the ``sliding_attention`` layers of ``layer_types`` only
    # (Qwen2, Qwen3); Mistral's model windows every layer and ignores a ``layer_types`` key.
    per_layer_types: bool = False
    # ``head_dim`` where the config leaves it out and the family's default is not the quotient
    # hidden_size / num_attention_heads (Qwen3Config: 128).
    default_head_dim: int | None = None
    # Norms of a block beside the input and post-attention ones (Gemma 3's pre- and
    # post-feedforward norms), sliced with the hidden channels as they are.
    extra_norms: tuple[str, ...] = ()
    # What an RMSNorm adds to its weight before it scales (Gemma: ``x * (1 + weight)``; 0: Llama's
    # ``x * weight``): a smoothing scale s divides the gain, so the weight becomes (offset + w) / s - offset.
    norm_offset: float = 0.0
    # How messages name the family (default: the capitalized model_type).
    title: str = ""

    def layer(self, index: int) -> str:
        """The module name of decoder block ``index``: ``model.layers.3``."""
        return f"{self.layers}.{index}"

    @property
    def attention_projections(self) -> tuple[str, ...]:
        """q, k, v, o, relative to a decoder block: ``self_attn.q_proj``, ..."""
        return tuple(f"{self.attention}.{name}" for name in (self.q, self.k, self.v, self.o))

    @property
    def mlp_projections(self) -> tuple[str, ...]:
        """gate, up, down, relative to a decoder block."""
        return tuple(f"{self.mlp}.{name}" for name in (self.gate, self.up, self.down))

    @property
    def projections(self) -> tuple[str, ...]:
        """Every linear of a decoder block, in module order."""
        return self.attention_projections + self.mlp_projections

    @property
    def norms(self) -> tuple[str, ...]:
        """A decoder block's norms of the hidden channels, relative to it."""
        return (self.input_norm, self.post_attention_norm, *self.extra_norms)


def layer_windows(config: Mapping[str, Any], bound: int = 0) -> tuple[int, ...]:
    """Each decoder block's attention window, as transformers builds the model of ``config``: a
    block of a windowed family attends to itself and the ``window - 1`` positions before it
    (``sliding_window_overlay``), on every layer (Mistral) or on the ``sliding_attention`` layers
    of ``layer_types`` (Qwen2 and Qwen3 past ``max_window_layers`` with ``use_sliding_window``);
    0: every position. Narrowed to ``bound`` where a build sets one (``kv_cache.window``; 0: none).
    Read through transformers' own config class, which derives ``layer_types`` and drops a window
    the config turns off."""
    from transformers import AutoConfig

    family = family_of(config)
    settled = AutoConfig.for_model(**dict(config))
    layers = int(settled.num_hidden_layers)  # transformers' default where the config leaves it out
    own = [0] * layers
    if family.window_key is not None:
        size = getattr(settled, family.window_key, None)
        size = size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 0
        types = getattr(settled, "layer_types", None) if family.per_layer_types else None
        own = [size if types is None or types[i] == "sliding_attention" else 0 for i in range(layers)]
    return tuple(min(size, bound) if size and bound else (size or bound) for size in own)


def head_dim(config: Mapping[str, Any]) -> int:
    """The width of one attention head: ``head_dim`` where the config sets it (Qwen3's differs
    from ``hidden_size / num_attention_heads``), else its family's default, else that quotient."""
    if config.get("head_dim"):
        return int(config["head_dim"])
    family = FAMILIES.get(config.get("model_type"))  # type: ignore[arg-type]
    if family is not None and family.default_head_dim:
        return family.default_head_dim
    return int(config["hidden_size"] // config["num_attention_heads"])


# Llama's, and llm-compressor's default for Mistral, Qwen2 and Qwen3 as well.
DEFAULT_SMOOTHING = (
    Smoothing(
        "qkv",
        "norm",
        "input_layernorm",
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "self_attn",
    ),
    Smoothing("o", "v", "self_attn.v_proj", ("self_attn.o_proj",), None),
    Smoothing("gate_up", "norm", "post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    Smoothing("down", "up", "mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)

LLAMA = Family(model_type="llama", architectures=("LlamaForCausalLM",), smoothing=DEFAULT_SMOOTHING)

# Qwen2 and Qwen2.5: a Llama block whose q, k and v projections carry a bias (transformers'
# ``Qwen2Attention``: ``bias=True`` on q/k/v, none on o); with ``use_sliding_window``, the layers
# from ``max_window_layers`` on attend within ``sliding_window``.
QWEN2 = Family(
    model_type="qwen2",
    architectures=("Qwen2ForCausalLM",),
    smoothing=DEFAULT_SMOOTHING,
    fixed_biases=("q_proj", "k_proj", "v_proj"),
    bias_flags=(),
    window_key="sliding_window",
    per_layer_types=True,
)

# Mistral: a Llama block with a ``head_dim`` of its own and a sliding window on every layer
# (``sliding_window``: each token attends to itself and the window - 1 before it; null: none).
MISTRAL = Family(
    model_type="mistral",
    architectures=("MistralForCausalLM",),
    smoothing=DEFAULT_SMOOTHING,
    bias_flags=(),
    window_key="sliding_window",
)

# Qwen3: a Llama block with a ``head_dim`` of its own and a per-head RMSNorm of q and k before
# rotary (transformers' ``Qwen3Attention``: ``q_norm``, ``k_norm`` of ``head_dim`` weights,
# shared by every head); ``attention_bias`` adds biases to q/k/v/o; its window as Qwen2's.
QWEN3 = Family(
    model_type="qwen3",
    architectures=("Qwen3ForCausalLM",),
    smoothing=DEFAULT_SMOOTHING,
    qk_norms=("q_norm", "k_norm"),
    bias_flags=("attention_bias",),
    window_key="sliding_window",
    per_layer_types=True,
    default_head_dim=128,
)

# Gemma 3 (text; transformers' ``Gemma3ForCausalLM``, ``model_type`` gemma3_text): embeddings scaled
# by sqrt(hidden); RMSNorm in Gemma's ``x * (1 + weight)`` form; a norm after the attention before
# the residual, and one before and one after the MLP; GeLU-tanh (``hidden_activation``); per-head
# q/k norms as Qwen3's; ``query_pre_attn_scalar``; local layers of ``layer_types`` within
# ``sliding_window``, with their own RoPE table (``rope_parameters`` per layer type).
# llm-compressor's Gemma mapping: input norm -> q/k/v, v -> o, pre-feedforward norm -> gate/up,
# up -> down (the post-attention norm feeds the residual, not a projection).
GEMMA3 = Family(
    model_type="gemma3_text",
    architectures=("Gemma3ForCausalLM",),
    smoothing=(
        DEFAULT_SMOOTHING[0],
        DEFAULT_SMOOTHING[1],
        Smoothing("gate_up", "norm", "pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        DEFAULT_SMOOTHING[3],
    ),
    qk_norms=("q_norm", "k_norm"),
    bias_flags=("attention_bias",),
    window_key="sliding_window",
    per_layer_types=True,
    default_head_dim=256,
    extra_norms=("pre_feedforward_layernorm", "post_feedforward_layernorm"),
    norm_offset=1.0,
    title="Gemma 3",
)

FAMILIES: Mapping[str, Family] = MappingProxyType(
    {family.model_type: family for family in (LLAMA, QWEN2, MISTRAL, QWEN3, GEMMA3)}
)


@dataclass(frozen=True)
class Imported:
    """A family converted at import into the layout of one of :data:`FAMILIES` (its weights
    re-sliced, nothing recomputed), so that the passes never see it: ``pipeline/phi3.py``."""

    model_type: str
    architectures: tuple[str, ...]
    title: str
    into: str  # the model_type of the converted checkpoint


# Phi-3, Phi-3.5-mini (Phi3ForCausalLM): a Mistral block with q/k/v and gate/up packed.
PHI3_IMPORT = Imported("phi3", ("Phi3ForCausalLM",), "Phi-3", MISTRAL.model_type)
IMPORTED: Mapping[str, Imported] = MappingProxyType({PHI3_IMPORT.model_type: PHI3_IMPORT})


def divide_gain(weight: Any, scales: Any, offset: float) -> None:
    """Divide an RMSNorm's gain by ``scales`` in place (a torch tensor): Llama's gain is the
    weight, Gemma's ``offset + weight`` (:attr:`Family.norm_offset`), so its weight becomes
    ``(offset + weight) / scales - offset``."""
    if offset:  # in float32: (offset + w) / s - offset in bf16 loses a small gain's digits
        weight.copy_((weight.float() + offset) / scales.float() - offset)
    else:
        weight.div_(scales)


def supported(imported: bool = True) -> str:
    """The families we build, for messages: ``Llama (LlamaForCausalLM)``; with ``imported``, also
    those converted at import, each saying into what."""
    built = [
        f"{f.title or f.model_type.capitalize()} ({', '.join(f.architectures)})" for f in FAMILIES.values()
    ]
    imported = [
        f"{f.title} ({', '.join(f.architectures)}, converted to {FAMILIES[f.into].architectures[0]})"
        for f in (IMPORTED.values() if imported else ())
    ]
    return ", ".join(built + imported)


def family_of(config: Any, where: str = "config.json") -> Family:
    """The family of a checkpoint's ``config.json`` (a mapping, or transformers' config object);
    one line naming the supported ones if none."""
    model_type = (
        config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)
    )
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None and isinstance(model_type, str) and model_type in IMPORTED:
        imported = IMPORTED[model_type]
        raise SourceError(
            f"{where} declares model_type {model_type!r}: a {imported.title} checkpoint is built from its "
            f"conversion to {FAMILIES[imported.into].architectures[0]}'s layout; give its folder as "
            "model.path (the source converts it once)"
        )
    if family is None:
        raise SourceError(
            f"{where} declares model_type {model_type!r}: the supported families are {supported()}"
        )
    return family
