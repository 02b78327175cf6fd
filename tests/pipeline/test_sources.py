"""Model sources: every bad input is a one-line SourceError naming the file and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.artifacts import Kind
from pipeline.config import DEFAULT_MODEL_PACKAGE, ModelConfig
from pipeline.errors import SourceError
from pipeline.sources import check_hf_llama, fetch_bundled, resolve_source
from pipeline.torch_model import load_causal_lm


@pytest.fixture
def checkpoint(tiny_llama: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_llama, tmp_path / "ckpt"))


def one_line(error: pytest.ExceptionInfo[SourceError]) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_local_checkpoint_resolves(checkpoint: Path, tmp_path: Path) -> None:
    artifact = resolve_source(ModelConfig(name="tiny", path=str(checkpoint)), tmp_path / "models")
    assert artifact.kind == Kind.TORCH
    assert artifact.metadata["architecture"] == "LlamaForCausalLM"
    assert artifact.metadata["origin"]["kind"] == "local"
    assert len(artifact.digest) == 64


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(SourceError) as error:
        resolve_source(ModelConfig(name="x", path=str(tmp_path / "nope")), tmp_path)
    assert "does not exist" in one_line(error) and "nope" in str(error.value)


def test_folder_without_config(checkpoint: Path) -> None:
    (checkpoint / "config.json").unlink()
    with pytest.raises(SourceError, match=r"config\.json is missing"):
        check_hf_llama(checkpoint)


def test_unsupported_architecture(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(SourceError) as error:
        check_hf_llama(checkpoint)
    assert "MistralForCausalLM" in one_line(error) and "only Llama" in str(error.value)


def test_pickle_weights_are_refused(checkpoint: Path) -> None:
    (checkpoint / "model.safetensors").rename(checkpoint / "pytorch_model.bin")
    with pytest.raises(SourceError) as error:
        check_hf_llama(checkpoint)
    assert "pytorch_model.bin" in one_line(error) and "safetensors" in str(error.value)


@pytest.mark.parametrize("damage", ["truncate", "garbage-header"])
def test_corrupt_weights(checkpoint: Path, damage: str) -> None:
    weights = checkpoint / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100] if damage == "truncate" else b"\xff" * 64 + data[64:])
    with pytest.raises(SourceError) as error:
        check_hf_llama(checkpoint)
    assert "model.safetensors is corrupt" in one_line(error)


def test_corrupt_weights_with_valid_header_fail_at_load(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config["hidden_size"] = 128  # the stored tensors no longer fit the declared shape
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(SourceError) as error:
        load_causal_lm(checkpoint)
    assert "cannot load the checkpoint" in one_line(error)


def test_missing_tokenizer(checkpoint: Path) -> None:
    (checkpoint / "tokenizer.json").unlink()
    with pytest.raises(SourceError, match="no tokenizer"):
        check_hf_llama(checkpoint)


def test_wrong_gguf_digest(tmp_path: Path) -> None:
    downloads = tmp_path / "models" / "downloads"
    downloads.mkdir(parents=True)
    (downloads / "model.gguf").write_bytes(b"not the real model")
    model = ModelConfig(name="llama", package=DEFAULT_MODEL_PACKAGE, gguf_file="model.gguf", sha256="0" * 64)
    with pytest.raises(SourceError) as error:
        fetch_bundled(model, tmp_path / "models")
    message = one_line(error)
    assert "model.gguf has sha256" in message and "expected " + "0" * 64 in message
    assert not any(p.name.startswith("llama-") for p in (tmp_path / "models").iterdir())


def test_model_without_path_or_package(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"set model\.path"):
        resolve_source(ModelConfig(name="x"), tmp_path)
