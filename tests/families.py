"""Tiny random checkpoints of each supported family's real config layout, built with transformers'
own config and model classes (never downloaded), and the measures the family tests share: ONNX
Runtime's logits against transformers' forward over long prompts, and a fused engine's decode
against its own prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import make_tokenizer

# Every family's tiny shape: GQA (4 heads, 2 KV heads), 2 layers, room for 4096 positions.
TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
PARITY_POSITIONS = 2048
# The recipes every family builds end to end (test id -> Hydra overrides of the real configs).
QUANT_RECIPES = {
    "int8": ["quant=int8", "fusion=ort"],
    "int4_awq": ["quant=int4_awq", "fusion=ort"],
    "int4_gptq": ["quant=int4_gptq", "fusion=ort"],
    "fp8": ["quant=fp8"],
    "int8-kv": ["kv_cache=shared", "kv_cache.dtype=int8", "fusion=ort"],
    # per-layer sensitivity, the most sensitive layers kept in fp32 within the KL budget
    "int4_awq-mixed": ["quant=int4_awq", "quant.fallback=auto", "fusion=ort"],
}
# Width pruning of MLP channels and of one query head per KV group, recovered by logit KD: short.
PRUNE_KD = [
    "prune=width25",
    "prune.heads_ratio=0.5",
    "prune.calibration.num_samples=4",
    "prune.calibration.seq_len=32",
    "distill=kd",
    "distill.steps=2",
    "distill.seq_len=32",
    "distill.batch_size=2",
    "distill.micro_batch_size=1",
    "fusion=ort",
]
# A depth-pruned, distilled INT4 draft (configs/speculative/draft.yaml), kept short.
DRAFT_KNOBS = [
    "speculative=draft",
    "speculative.draft.prune.depth_ratio=0.5",
    "speculative.draft.prune.calibration.num_samples=4",
    "speculative.draft.prune.calibration.seq_len=32",
    "speculative.draft.distill.steps=2",
    "speculative.draft.distill.seq_len=32",
    "speculative.draft.distill.batch_size=2",
    "speculative.draft.distill.micro_batch_size=1",
]
DRAFT = [*DRAFT_KNOBS, "fusion=ort"]


def make_tiny(model_type: str, folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random tiny checkpoint of ``model_type`` (transformers' ``AutoConfig.for_model`` and
    ``AutoModelForCausalLM.from_config``) with the byte-level BPE tokenizer of the tiny Llama.
    transformers initialises biases to zero and norm weights to one; they are drawn at random
    here, so a pass that drops or misplaces one changes the logits."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):  # ones at init: a misplaced norm would not show
                parameter.uniform_(0.5, 1.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    make_tokenizer(folder)
    return folder


def random_ids(length: int = PARITY_POSITIONS, vocab: int = 320, seed: int = 0) -> np.ndarray:
    """``[1, length]`` token ids past the special ones."""
    return np.random.default_rng(seed).integers(3, vocab, size=(1, length), dtype=np.int64)


def transformers_logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    """transformers' own forward of the checkpoint in ``folder`` (fp32, eager attention)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=False, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits[0].numpy()


def _session(folder: Path) -> Any:
    """An ONNX Runtime session of a graph folder, or of an engine folder as the runtime opens it
    (its cache layout and buffer)."""
    from pipeline.core.engine import graph_io
    from pipeline.core.graph_io import model_file
    from pipeline.runtime.ort import Engine, OrtModel

    if (folder / "engine.json").is_file():
        return Engine(folder, speculative=False, prepack=False).model
    return OrtModel(folder / model_file(folder), graph_io(folder), prepack=False)


def onnx_prefill(graph: Path, ids: np.ndarray) -> np.ndarray:
    """ONNX Runtime's logits of one prefill of ``ids`` through the graph or engine folder."""
    model = _session(graph)
    positions = np.arange(ids.shape[1], dtype=np.int64)[None]
    logits, _ = model.step(ids, np.ones_like(ids), positions, model.empty_cache(1))
    return np.asarray(logits[0], dtype=np.float32)


def onnx_decode(graph: Path, ids: np.ndarray, prefill: int) -> np.ndarray:
    """ONNX Runtime's logits of the last ``len - prefill`` positions of ``ids``, fed one token at a
    time through the cache after a prefill of the first ``prefill`` (graph or engine folder)."""
    model = _session(graph)
    head = ids[:, :prefill]
    positions = np.arange(prefill, dtype=np.int64)[None]
    out, cache = model.step(head, np.ones_like(head), positions, model.empty_cache(1))
    logits = []
    for position in range(prefill, ids.shape[1]):
        mask = np.ones((1, position + 1), dtype=np.int64)
        out, cache = model.step(ids[:, position : position + 1], mask, np.array([[position]]), cache)
        logits.append(np.asarray(out[0, -1], dtype=np.float32))
    return np.stack(logits)


def build(recipe: list[str], source: Path, cache: Path) -> tuple[Any, dict[str, dict[str, Any]]]:
    """Run ``recipe`` (Hydra overrides of the real configs) on the checkpoint ``source`` with the
    real pass manager: (the engine artifact, each pass's metrics by name)."""
    from pipeline.core.artifacts import Artifact, Kind
    from pipeline.core.cache import Cache
    from pipeline.core.manager import PassManager
    from pipeline.core.plugins import build_passes
    from tests.pipeline.recipe import compose_recipe

    passes = build_passes(compose_recipe(recipe))
    engine, records = PassManager(passes, Cache(cache)).run(Artifact.from_dir(Kind.TORCH, source))
    return engine, {record.name: record.metrics for record in records}


def relative_error(candidate: np.ndarray, reference: np.ndarray) -> float:
    """max |candidate - reference| as a fraction of the reference's logit range."""
    return float(np.abs(candidate - reference).max() / (reference.max() - reference.min()))


def dead_heads_pruned_error(folder: Path, family: Any) -> float:
    """Prune heads 1 and 3 of every layer of the checkpoint in ``folder`` after making them dead
    (their o_proj columns zero) with ``passes.prune.pruned_state``: the pruned model must compute
    what the original does, which holds only if each kept head keeps its own q rows, bias and
    norm. Returns the relative error of its logits against the original's on 64 tokens."""
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from passes.prune import Importance, Shape, pruned_config, pruned_state

    config = json.loads((folder / "config.json").read_text())
    state = load_file(folder / "model.safetensors")
    shape = Shape.of(config)
    dead = [h * shape.head_dim + i for h in (1, 3) for i in range(shape.head_dim)]
    for layer in range(shape.layers):
        state[f"model.layers.{layer}.self_attn.o_proj.weight"][:, dead] = 0
    target = Shape(shape.hidden, shape.intermediate, 2, shape.kv_heads, shape.head_dim, shape.layers)
    importance = Importance(
        mlp=np.ones((shape.layers, shape.intermediate)),
        heads=np.tile([1.0, 0.0, 1.0, 0.0], (shape.layers, 1)),
        hidden=np.ones(shape.hidden),
        layers=np.ones(shape.layers),
    )
    pruned, record = pruned_state(state, True, importance, shape, target, family)
    assert record["heads"] == {0: [0, 2], 1: [0, 2]}

    def logits(config: dict[str, Any], weights: dict[str, Any]) -> np.ndarray:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        model.tie_weights()
        with torch.no_grad():
            return model.eval()(torch.from_numpy(random_ids(64))).logits[0].numpy()

    small = pruned_config(config, target, list(range(shape.layers)))
    return relative_error(logits(small, pruned), logits(config, state))


def write_gguf(folder: Path, out: Path, architecture: str) -> Path:
    """Write the checkpoint in ``folder`` as a GGUF file of llama.cpp's ``architecture``
    (``llama``, ``qwen2``, ``qwen3``), in float32, with gguf-py's writer: llama.cpp's tensor
    names (gguf's own map), its permutation of Llama's q/k rows, and the byte-level BPE tokenizer
    as ``tokenizer.ggml`` (``gpt2`` model) metadata, as llama.cpp's converter writes them."""
    import json

    import gguf
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    names = gguf.get_tensor_name_map(arch[architecture], layers)
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    special = {token["id"] for token in tokenizer["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if vocab[t] in special else 1 for t in tokens])
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    for name, tensor in load_file(folder / "model.safetensors").items():
        array = tensor.float().numpy()
        if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            count = heads if "q_proj" in name else kv_heads  # llama.cpp's rotary pairs rows
            shape = array.shape
            array = array.reshape(count, 2, shape[0] // count // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert mapped is not None, name
        writer.add_tensor(mapped, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# Module fixtures a family's test file imports; each file defines ``checkpoint``, its tiny model.
@pytest.fixture(scope="module")
def graph(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The checkpoint's export (the real pass, through the pass manager)."""
    from passes.export import ExportPass
    from pipeline.core.artifacts import Artifact, Kind
    from tests.conftest import run_pass

    return run_pass(
        ExportPass(), Artifact.from_dir(Kind.TORCH, checkpoint), tmp_path_factory.mktemp("graph")
    )[0]


@pytest.fixture(scope="module")
def fused(graph: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    """The export fused for ONNX Runtime, and the fusion pass's record."""
    from passes.fusion.fuse import FusionPass
    from tests.conftest import run_pass

    return run_pass(FusionPass(), graph, tmp_path_factory.mktemp("fused"))


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> np.ndarray:
    """transformers' logits of the checkpoint over the 2048 parity positions."""
    return transformers_logits(checkpoint, random_ids())


def assert_built(engine: Any, by_name: dict[str, dict[str, Any]], packed_qkv: int | None = None) -> None:
    """A recipe's engine was built, fused with both layers' GroupQueryAttention (``packed_qkv``
    sites packed, where given), and every parity a pass recorded is finite with top-1 >= 0.8."""
    from pipeline.core.artifacts import Kind

    assert engine.kind is Kind.ENGINE
    if "fusion" in by_name:
        assert by_name["fusion"]["rewrites"]["group_query_attention"] == 2
        if packed_qkv is not None:
            assert by_name["fusion"]["rewrites"]["packed_qkv"] == packed_qkv
    for metrics in by_name.values():
        for key in ("parity", "parity_vs_input_graph"):
            if key in metrics:
                assert metrics[key].get("finite", True) and metrics[key]["top1_agreement"] >= 0.8, metrics


def assert_pruned_and_distilled(checkpoint: Path, cache: Path) -> None:
    """``PRUNE_KD`` on the checkpoint builds a fused engine of half the query heads and three
    quarters of the MLP channels, whose distillation ran and whose parities hold."""
    engine, by_name = build(PRUNE_KD, checkpoint, cache)
    assert_built(engine, by_name)
    shape = by_name["prune"]["shape"]["after"]
    assert (shape["heads"], shape["kv_heads"], shape["intermediate"]) == (2, 2, 96), shape
    assert by_name["distill"]["tokens_trained"] == 2 * 2 * 32


def assert_drafts_and_serves(checkpoint: Path, cache: Path) -> None:
    """A fused engine of the checkpoint with a depth-pruned, distilled INT4 draft of the same
    checkpoint inside it (the real ``draft_passes`` and ``attach_draft``): its speculative greedy
    output is the target's own, token for token; and the server batches requests of several
    lengths into each one's output alone."""
    from pipeline.core.artifacts import Artifact, Kind
    from pipeline.core.cache import Cache
    from pipeline.runtime import Engine, GenerationConfig
    from pipeline.runtime.serving import Request, ServingLimits
    from pipeline.speculative import attach_draft, build_draft, draft_passes
    from tests.pipeline.recipe import compose_recipe

    target, _ = build(["fusion=ort"], checkpoint, cache)
    source = Artifact.from_dir(Kind.TORCH, checkpoint)
    draft, records = build_draft(draft_passes(compose_recipe(DRAFT)), source, target, Cache(cache))
    assert [record.name for record in records][:3] == ["prune", "distill", "awq"]
    attached, _ = attach_draft(Cache(cache), target, draft, k=3)
    engine = Engine(attached.path)
    assert engine.draft is not None and engine.draft.io.num_layers == 1
    prompt = random_ids(24, seed=1)[0].tolist()
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False)
    alone = engine.generate_ids([prompt], config, use_draft=False).tokens[0]
    assert engine.generate_ids([prompt], config).tokens[0] == alone
    assert engine.last_draft_stats is not None and engine.last_draft_stats.rounds > 0
    rng = np.random.default_rng(2)
    requests = [
        Request(rng.integers(4, 300, size=length).tolist(), max_new_tokens=new, stop_at_eos=False)
        for length, new in ((5, 9), (17, 3), (11, 12), (3, 6))
    ]
    for request, done in zip(requests, engine.serve(requests, ServingLimits(max_sequences=2)), strict=True):
        config = GenerationConfig(max_new_tokens=request.max_new_tokens, stop_at_eos=False)
        assert done.tokens == engine.generate_ids([list(request.prompt)], config, use_draft=False).tokens[0]
