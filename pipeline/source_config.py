"""Bounds on the ``config.json`` fields a pass or the engine reads, checked when a source is resolved.

A checkpoint's ``config.json`` is untrusted input: transformers checks the types of some fields and
only warns about others (a ``bos_token_id`` outside the vocabulary, a RoPE ``factor`` below 1), and
the engine's own bounds (``pipeline/core/engine.py``: ``max_length`` and ``io.vocab_size`` up to
2^24, token ids inside the vocabulary, at most 4096 heads of at most 4096 values) are checked only
once an export wrote ``engine.json``, hours in. So every field that the passes, transformers'
Llama (which the torch passes and the export run) or the engine read is bounded here, declared once
as data (:data:`BOUNDS`: model_type -> the fields' rules and the relations between fields), and
checked at start-up by :func:`pipeline.sources.check_hf_llama`: each refusal is one line naming the
field in ``config.json`` and the fix. The ranges fit real checkpoints generously (Llama 3.1 405B:
hidden 16384, MLP 53248, 126 layers, 128 heads, 131072 positions, vocabulary 128256; SmolLM2;
Llama 3.2 1B). A field that is absent keeps transformers' default; a new model family (issue 51)
is one more entry of :data:`BOUNDS`, reusing the rules below.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.core.errors import SourceError
from pipeline.core.families import head_dim

ENGINE_MAX = 1 << 24  # engine.json's max_length and io.vocab_size bound (pipeline/core/engine.py)
ENGINE_MAX_HEADS = 4096  # engine.json's io.num_kv_heads and io.head_dim bound
MAX_LAYERS = 1024  # the skeleton the header check builds takes ~2.5 ms a layer
MAX_EOS_TOKENS = 1024  # engine.json's tokens.eos_token_ids bound
MAX_ROPE_FACTORS = ENGINE_MAX_HEADS // 2  # longrope's short_factor/long_factor: head_dim / 2 each
FIX = "re-save the checkpoint"
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
DTYPES = ("float32", "float16", "bfloat16", "float64", "float", "half", "double")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past a float's range
        return False


def shown(value: Any) -> str:
    """A config value as a message shows it: its ``repr`` (escapes keep it one line), shortened."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class Integer:
    """An integer from ``low`` to ``high``; ``most`` says what ``high`` is (the message's words)."""

    low: int = 1
    high: int = ENGINE_MAX
    most: str = ""
    nullable: bool = False

    def problem(self, value: Any, config: Mapping[str, Any]) -> str | None:
        if not _is_int(value) or value < self.low:
            if self.low == 1:
                return "not a positive integer"
            return f"not an integer from {self.low} to {self.high}"
        if value > self.high:
            return f"more than the {self.high} {self.most}".rstrip()
        return None


@dataclass(frozen=True)
class Number:
    """A finite number (JSON int or float) above ``low`` (or at it, with ``closed_low``) and below
    ``high`` (or at it, with ``closed_high``); None: unbounded on that side."""

    low: float | None = None
    high: float | None = None
    closed_low: bool = False
    closed_high: bool = False
    nullable: bool = False

    def problem(self, value: Any, config: Mapping[str, Any]) -> str | None:
        if _is_finite(value):
            low_ok = self.low is None or value > self.low or (self.closed_low and value == self.low)
            high_ok = self.high is None or value < self.high or (self.closed_high and value == self.high)
            if low_ok and high_ok:
                return None
        if self.closed_low and self.closed_high:
            return f"not a finite number from {self.low:g} to {self.high:g}"
        parts = []
        if self.low is not None:
            parts.append(f"at least {self.low:g}" if self.closed_low else f"more than {self.low:g}")
        if self.high is not None:
            parts.append(f"at most {self.high:g}" if self.closed_high else f"less than {self.high:g}")
        bound = " and ".join(parts)
        return "not a finite number" + (" of " if bound.startswith("at") else " " if bound else "") + bound


@dataclass(frozen=True)
class Flag:
    """``true`` or ``false``."""

    nullable: bool = False

    def problem(self, value: Any, config: Mapping[str, Any]) -> str | None:
        return None if isinstance(value, bool) else "not true or false"


@dataclass(frozen=True)
class Choice:
    """One of ``names`` (after removing ``prefix``); ``names`` may be a function (the names an
    installed library knows), ``hint`` the choice the message suggests."""

    names: tuple[str, ...] | Callable[[], tuple[str, ...]]
    what: str
    prefix: str = ""
    hint: str = ""
    nullable: bool = False

    def problem(self, value: Any, config: Mapping[str, Any]) -> str | None:
        names = self.names() if callable(self.names) else self.names
        if isinstance(value, str) and value.removeprefix(self.prefix) in names:
            return None
        return f"not {self.what} ({self.hint or ', '.join(names)})"


@dataclass(frozen=True)
class TokenId:
    """A token id below the config's ``vocab_size`` (the engine's bound), or null; with ``many``
    also a list of at most :data:`MAX_EOS_TOKENS` of them."""

    many: bool = False
    nullable: bool = True

    def problem(self, value: Any, config: Mapping[str, Any]) -> str | None:
        vocab = vocabulary(config)
        ids = value if self.many and isinstance(value, list) else [value]
        if len(ids) <= MAX_EOS_TOKENS and all(_is_int(i) and 0 <= i < vocab for i in ids):
            return None
        if self.many:
            return f"not a token id or a list of token ids below vocab_size {vocab}"
        return f"not a token id below vocab_size {vocab}"


@dataclass(frozen=True)
class NumberList:
    """A list of at most ``most`` finite numbers more than 0."""

    most: int = MAX_ROPE_FACTORS
    nullable: bool = True

    def problem(self, value: Any, config: Mapping[str, Any]) -> str | None:
        if (
            isinstance(value, list)
            and len(value) <= self.most
            and all(_is_finite(v) and v > 0 for v in value)
        ):
            return None
        return f"not a list of at most {self.most} finite numbers more than 0"


@dataclass(frozen=True)
class LayerTypes:
    """One of ``names`` per layer (``num_hidden_layers`` of them): what prune slices by layer."""

    names: tuple[str, ...]
    nullable: bool = True

    def problem(self, value: Any, config: Mapping[str, Any]) -> str | None:
        layers = config.get("num_hidden_layers")
        if isinstance(value, list) and len(value) == layers and all(v in self.names for v in value):
            return None
        return f"not a list of {layers} layer types (one a layer: {', '.join(self.names)})"


@dataclass(frozen=True)
class Table:
    """A JSON object (or null) whose keys have rules of their own (unknown keys are left to
    transformers, which ignores them with a warning)."""

    fields: Mapping[str, Rule]
    nullable: bool = True

    def problem(self, value: Any, config: Mapping[str, Any]) -> str | None:
        return None if isinstance(value, dict) else "not a JSON object"


Rule = Integer | Number | Flag | Choice | TokenId | NumberList | LayerTypes | Table


# A bound between fields: the message after ``<path> has`` when it does not hold, else None. It reads
# the fields already checked one by one, an absent one at its family's default.
Relation = Callable[[Mapping[str, Any]], "str | None"]


@dataclass(frozen=True)
class FamilyBounds:
    """What a model family's ``config.json`` may hold: each field's rule (checked in order: a rule
    may read a field before it, as token ids read ``vocab_size``), then the relations between
    fields. ``defaults``: what transformers gives the absent fields that rules and relations read."""

    fields: Mapping[str, Rule]
    relations: tuple[Relation, ...]
    defaults: Mapping[str, Any]
    # Features of the family's config this build does not implement: each message says the fix.
    refused: tuple[Relation, ...] = ()


def vocabulary(config: Mapping[str, Any]) -> int:
    """The vocabulary size token ids must stay below."""
    vocab = config.get("vocab_size")
    return vocab if _is_int(vocab) else 0


def _activations() -> tuple[str, ...]:
    """The activations the installed transformers knows (``hidden_act``)."""
    from transformers.activations import ACT2CLS

    return tuple(sorted(ACT2CLS))


def _ropes(config: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """The RoPE tables of ``config`` (``rope_scaling``, ``rope_parameters``), by key; a table per
    layer type (Gemma 3's ``rope_parameters.sliding_attention``) by its dotted key."""
    tables = []
    for key in ROPE_KEYS:
        table = config.get(key)
        if isinstance(table, dict) and set(table) & set(LAYER_TYPES):
            tables += [
                (f"{key}.{kind}", table[kind]) for kind in LAYER_TYPES if isinstance(table.get(kind), dict)
            ]
        elif isinstance(table, dict):
            tables.append((key, table))
    return tables


def heads_divide_hidden(config: Mapping[str, Any]) -> str | None:
    """transformers' LlamaConfig refuses it, an explicit ``head_dim`` or not."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if hidden % heads:
        return f"hidden_size={hidden}, not a multiple of the number of attention heads ({heads})"
    return None


def head_dim_fits(config: Mapping[str, Any]) -> str | None:
    if config.get("head_dim") is None and head_dim(config) > ENGINE_MAX_HEADS:
        return (
            f"hidden_size={config['hidden_size']} / num_attention_heads={config['num_attention_heads']}: "
            f"heads of {head_dim(config)} values, more than the {ENGINE_MAX_HEADS} an engine holds"
        )
    return None


def kv_heads_divide_heads(config: Mapping[str, Any]) -> str | None:
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    if kv_heads is not None and heads % kv_heads:
        return (
            f"num_attention_heads={heads}, not a multiple of num_key_value_heads={kv_heads} (each KV "
            "head serves a whole group of query heads)"
        )
    return None


def llama3_frequencies(config: Mapping[str, Any]) -> str | None:
    """llama3 RoPE divides by ``high_freq_factor - low_freq_factor``: the high one must be more."""
    for key, rope in _ropes(config):
        high, low = rope.get("high_freq_factor"), rope.get("low_freq_factor")
        kind = rope.get("rope_type", rope.get("type"))
        if kind == "llama3" and _is_finite(high) and _is_finite(low) and not high > low:
            return (
                f"{key}.high_freq_factor={shown(high)}, not more than {key}.low_freq_factor={shown(low)} "
                "(llama3 RoPE divides by their difference)"
            )
    return None


def longrope_factors(config: Mapping[str, Any]) -> str | None:
    """longrope's ``short_factor`` and ``long_factor``: one value a rotated pair of a head."""
    for key, rope in _ropes(config):
        factor = rope.get("partial_rotary_factor") or 1.0
        pairs = int(head_dim(config) * factor) // 2
        for name in ("short_factor", "long_factor"):
            if rope.get(name) and len(rope[name]) != pairs:
                return (
                    f"{key}.{name} of {len(rope[name])} values, not head_dim * partial_rotary_factor / 2 "
                    f"= {pairs} (one a rotated pair)"
                )
    return None


# RoPE (transformers' modeling_rope_utils.RopeParameters): in ``rope_parameters`` (transformers 5),
# or ``rope_scaling`` beside a top-level ``rope_theta`` (older checkpoints: Llama 3.x, SmolLM2).
ROPE = Table(
    {
        "rope_type": Choice(ROPE_TYPES, "a RoPE type transformers knows"),
        "type": Choice(ROPE_TYPES, "a RoPE type transformers knows"),
        "rope_theta": Number(low=0, nullable=True),
        "factor": Number(low=1, closed_low=True, nullable=True),
        "original_max_position_embeddings": Integer(most="positions an engine holds (2^24)", nullable=True),
        "low_freq_factor": Number(low=0, nullable=True),
        "high_freq_factor": Number(low=0, nullable=True),
        "attention_factor": Number(low=0, closed_low=True, nullable=True),
        "beta_fast": Number(low=0, nullable=True),
        "beta_slow": Number(low=0, nullable=True),
        "mscale": Number(nullable=True),
        "mscale_all_dim": Number(nullable=True),
        "truncate": Flag(nullable=True),
        "partial_rotary_factor": Number(low=0, high=1, closed_high=True, nullable=True),
        "short_factor": NumberList(),
        "long_factor": NumberList(),
    }
)
ROPE_KEYS = ("rope_scaling", "rope_parameters")
LAYER_TYPES = ("full_attention", "sliding_attention")

# The fields every family of a Llama block reads (transformers' LlamaConfig, Qwen2Config, ...).
COMMON_FIELDS: Mapping[str, Rule] = {
    "vocab_size": Integer(most="tokens an engine's vocabulary holds (2^24; Llama 3: 128256)"),
    "hidden_size": Integer(high=1 << 18, most="a Llama's hidden size stays under (405B: 16384)"),
    "intermediate_size": Integer(high=1 << 20, most="a Llama's MLP width stays under (405B: 53248)"),
    "num_hidden_layers": Integer(high=MAX_LAYERS, most="a Llama has (405B: 126)"),
    "num_attention_heads": Integer(high=ENGINE_MAX_HEADS, most="heads an engine holds (405B: 128)"),
    "num_key_value_heads": Integer(
        high=ENGINE_MAX_HEADS, most="KV heads an engine holds (405B: 8)", nullable=True
    ),
    "head_dim": Integer(high=ENGINE_MAX_HEADS, most="values a head holds in an engine", nullable=True),
    "max_position_embeddings": Integer(
        most="positions an engine holds (its max_length bound, 2^24; Llama 3.1: 131072)"
    ),
    "bos_token_id": TokenId(),
    "eos_token_id": TokenId(many=True),
    "pad_token_id": TokenId(),
    "rms_norm_eps": Number(low=0, high=1),
    "rope_theta": Number(low=0),
    "rope_scaling": ROPE,
    "rope_parameters": ROPE,
    "hidden_act": Choice(_activations, "an activation transformers knows", hint="Llama's: silu"),
    "tie_word_embeddings": Flag(),
    "use_cache": Flag(),
    "attention_dropout": Number(low=0, high=1, closed_low=True, closed_high=True, nullable=True),
    "initializer_range": Number(low=0, high=1, closed_low=True, closed_high=True),
    "torch_dtype": Choice(DTYPES, "a floating-point dtype", prefix="torch.", nullable=True),
    "dtype": Choice(DTYPES, "a floating-point dtype", prefix="torch.", nullable=True),
}
COMMON_RELATIONS: tuple[Relation, ...] = (
    heads_divide_hidden,
    head_dim_fits,
    kv_heads_divide_heads,
    llama3_frequencies,
    longrope_factors,
)

# RoPE types the export cannot trace exactly per layer type: longrope switches between its short
# and long factors on the sequence length, which the export follows for the model's one rotary
# (pipeline/core/torch_model.switched_longrope), not yet for a table per layer type (Gemma 3's).
UNBUILT_ROPE_TYPES = ("longrope",)


def rope_refused(config: Mapping[str, Any]) -> str | None:
    for key, rope in _ropes(config):
        kind = rope.get("rope_type", rope.get("type"))
        if kind in UNBUILT_ROPE_TYPES and "." in key:
            return (
                f"{key}.rope_type={shown(kind)}: this build does not export {kind} RoPE per layer type yet "
                "(its factors switch on the sequence length); use a checkpoint without it"
            )
    return None


COMMON_REFUSED: tuple[Relation, ...] = (rope_refused,)

LLAMA = FamilyBounds(
    fields={
        **COMMON_FIELDS,
        "attention_bias": Flag(),
        "mlp_bias": Flag(),
        "layer_types": LayerTypes(("full_attention", "sliding_attention")),
    },
    relations=COMMON_RELATIONS,
    # LlamaConfig's defaults of the fields the rules and relations read
    defaults={"vocab_size": 32000, "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32},
    refused=COMMON_REFUSED,
)


QWEN2 = FamilyBounds(
    fields={
        **COMMON_FIELDS,
        "use_sliding_window": Flag(),
        "sliding_window": Integer(most="positions an engine holds (2^24)", nullable=True),
        "max_window_layers": Integer(low=0, high=MAX_LAYERS, most="layers a model has", nullable=True),
        "layer_types": LayerTypes(("full_attention", "sliding_attention")),
    },
    relations=COMMON_RELATIONS,
    # Qwen2Config's defaults of the fields the rules and relations read
    defaults={"vocab_size": 151936, "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32},
    refused=COMMON_REFUSED,
)

QWEN3 = FamilyBounds(
    fields={**QWEN2.fields, "attention_bias": Flag()},
    relations=COMMON_RELATIONS,
    # Qwen3Config's defaults of the fields the rules and relations read
    defaults={**QWEN2.defaults, "head_dim": 128},
    refused=COMMON_REFUSED,
)

MISTRAL = FamilyBounds(
    fields={
        **COMMON_FIELDS,
        "sliding_window": Integer(most="positions an engine holds (2^24)", nullable=True),
    },
    relations=COMMON_RELATIONS,
    # MistralConfig's defaults of the fields the rules and relations read
    defaults={"vocab_size": 32000, "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32},
    refused=COMMON_REFUSED,
)


def softcapping_refused(config: Mapping[str, Any]) -> str | None:
    """Soft-capping (``tanh(x / cap) * cap``) of the final logits or of the attention scores:
    GroupQueryAttention has ``softcap`` but the attention it fuses does not, and the export has
    no path for the final one yet; Gemma 3's checkpoints leave both null."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:
            return (
                f"{key}={shown(config[key])}: this build does not implement logit soft-capping (it would "
                "be silently dropped); use a checkpoint whose config leaves it null"
            )
    return None


def bidirectional_refused(config: Mapping[str, Any]) -> str | None:
    if config.get("use_bidirectional_attention"):
        return (
            "use_bidirectional_attention=true: an encoder, not a causal language model this build "
            "serves; use a causal checkpoint"
        )
    return None


# Gemma 3 (Gemma3TextConfig): rope_parameters hold one table per layer type.
GEMMA3 = FamilyBounds(
    fields={
        **COMMON_FIELDS,
        "hidden_activation": Choice(
            _activations, "an activation transformers knows", hint="Gemma's: gelu_pytorch_tanh"
        ),
        "query_pre_attn_scalar": Number(low=0),
        "attention_bias": Flag(),
        "sliding_window": Integer(most="positions an engine holds (2^24)", nullable=True),
        "layer_types": LayerTypes(LAYER_TYPES),
        "rope_parameters": Table({kind: ROPE for kind in LAYER_TYPES}),
        "final_logit_softcapping": Number(low=0, nullable=True),
        "attn_logit_softcapping": Number(low=0, nullable=True),
        "use_bidirectional_attention": Flag(nullable=True),
    },
    relations=COMMON_RELATIONS,
    # Gemma3TextConfig's defaults of the fields the rules and relations read
    defaults={
        "vocab_size": 262208,
        "hidden_size": 2304,
        "num_attention_heads": 8,
        "num_hidden_layers": 26,
        "head_dim": 256,
    },
    refused=(*COMMON_REFUSED, softcapping_refused, bidirectional_refused),
)


def partial_rotary_refused(config: Mapping[str, Any]) -> str | None:
    """A rotary of part of each head (Phi-4-mini's ``partial_rotary_factor`` 0.75): Mistral's block,
    which Phi-3 is converted to, rotates the whole head."""
    tables = [("", config)] + [(f"{key}.", table) for key, table in _ropes(config)]
    for prefix, table in tables:
        factor = table.get("partial_rotary_factor")
        if factor is not None and factor != 1:
            return (
                f"{prefix}partial_rotary_factor={shown(factor)}: this build rotates whole heads only (a "
                "partial rotary is not implemented); use a checkpoint whose factor is 1.0"
            )
    return None


# Phi-3 and Phi-3.5-mini (Phi3Config), converted to Mistral's layout at import (pipeline/phi3.py).
PHI3 = FamilyBounds(
    fields={
        **COMMON_FIELDS,
        "sliding_window": Integer(most="positions an engine holds (2^24)", nullable=True),
        "original_max_position_embeddings": Integer(
            high=ENGINE_MAX, most="positions an engine holds (2^24)", nullable=True
        ),
        "resid_pdrop": Number(low=0, high=1, closed_low=True, closed_high=True, nullable=True),
        "embd_pdrop": Number(low=0, high=1, closed_low=True, closed_high=True, nullable=True),
        "partial_rotary_factor": Number(low=0, high=1, closed_high=True, nullable=True),
        "attention_bias": Flag(),
    },
    relations=COMMON_RELATIONS,
    # Phi3Config's defaults of the fields the rules and relations read
    defaults={"vocab_size": 32064, "hidden_size": 3072, "num_attention_heads": 32, "num_hidden_layers": 32},
    refused=(*COMMON_REFUSED, partial_rotary_refused),
)

# model_type -> what its config.json may hold (the families of pipeline/core/families.py).
BOUNDS: dict[str, FamilyBounds] = {
    "llama": LLAMA,
    "qwen2": QWEN2,
    "mistral": MISTRAL,
    "qwen3": QWEN3,
    "gemma3_text": GEMMA3,
    "phi3": PHI3,
}

# generation_config.json: the export reads its eos_token_id before config.json's (passes/export.py).
GENERATION_FIELDS: Mapping[str, Rule] = {
    "bos_token_id": TokenId(),
    "eos_token_id": TokenId(many=True),
    "pad_token_id": TokenId(),
}


def _check_fields(
    data: Mapping[str, Any],
    fields: Mapping[str, Rule],
    config: Mapping[str, Any],
    where: str,
    prefix: str = "",
) -> None:
    for key, rule in fields.items():
        if key not in data or (data[key] is None and rule.nullable):
            continue
        value = data[key]
        if problem := rule.problem(value, config):
            raise SourceError(f"{where} has {prefix}{key}={shown(value)}, {problem}: {FIX}")
        if isinstance(rule, Table):
            _check_fields(value, rule.fields, config, where, f"{prefix}{key}.")


def check_config(config: Mapping[str, Any], where: str) -> None:
    """Refuse, in one line naming ``where`` (the ``config.json``) and the field, a value of
    ``config`` outside its family's bounds (:data:`BOUNDS`; a model_type without an entry is
    refused elsewhere, by its architecture)."""
    family = BOUNDS.get(str(config.get("model_type")))
    if family is None:
        return
    settled = {**family.defaults, **config}
    _check_fields(config, family.fields, settled, where)
    for relation in family.relations:
        if problem := relation(settled):
            raise SourceError(f"{where} has {problem}: {FIX}")
    for feature in family.refused:
        if problem := feature(settled):
            raise SourceError(f"{where} has {problem}")


def check_generation_config(generation: Mapping[str, Any], config: Mapping[str, Any], where: str) -> None:
    """Refuse, in one line naming ``where``, a ``generation_config.json`` token id outside the
    vocabulary of ``config`` (checked first, by :func:`check_config`)."""
    family = BOUNDS.get(str(config.get("model_type")))
    settled = {**family.defaults, **config} if family else config
    _check_fields(generation, GENERATION_FIELDS, settled, where)
