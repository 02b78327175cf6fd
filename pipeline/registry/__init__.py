"""The artifact registry: engines that passed the gate, by model, recipe, target and version,
with movable channels (nightly, candidate, stable). ``local.py`` is the embedded default,
``mlflow.py`` the same operations against an MLflow server; the CLI is
``python -m pipeline.registry``. The registry stores manifests and files: it knows neither
passes nor evals.

    from pipeline import registry
    folder = registry.pull(model="llama", quant="fp8", target="ort-cpu", channel="stable")
"""

from __future__ import annotations

from pathlib import Path

from pipeline.core.artifacts import sha256_file
from pipeline.registry.local import LocalRegistry
from pipeline.registry.records import Registry, check_engine_spec
from pipeline.registry.refs import CHANNELS, DEFAULT_TARGET, Ref, RegistryError

DEFAULT_ROOT = Path("artifacts/registry")
DEFAULT_PULLS = Path("artifacts/pulled")

__all__ = [
    "CHANNELS",
    "DEFAULT_ROOT",
    "LocalRegistry",
    "Ref",
    "Registry",
    "RegistryError",
    "open_registry",
    "pull",
]


def open_registry(root: Path | str | None = None, uri: str | None = None) -> Registry:
    """The MLflow backend at ``uri`` when given (``mlflow.py``), else the local one at ``root``."""
    if uri:
        from pipeline.registry.mlflow import MlflowRegistry

        return MlflowRegistry(uri)
    return LocalRegistry(Path(root) if root else DEFAULT_ROOT)


def pull(
    *,
    model: str,
    quant: str,
    target: str = DEFAULT_TARGET,
    channel: str | None = None,
    version: int | None = None,
    to: Path | str | None = None,
    root: Path | str | None = None,
    uri: str | None = None,
    tensorrt_version: str | None = None,
    gpu_arch: str | None = None,
) -> Path:
    """Pull the engine of ``model``/``quant`` (the recipe's registry name) for ``target``: the
    version given, else the channel's, else the latest. Returns a folder laid out like a run
    folder (``manifest.json``, ``engine/``); every file's sha256 is checked. Without ``to`` it
    goes to ``artifacts/pulled/<model>/<recipe>/<target>/<version>`` (reused when there already and
    every file still hashes to what the registry recorded)."""
    if version is not None and channel is not None:
        raise RegistryError("ask for a version or a channel, not both")
    store = open_registry(root, uri)
    ref = Ref(model, quant, target, version if version is not None else channel)
    record = store.resolve(ref)
    folder = Path(to) if to else DEFAULT_PULLS / model / quant / target / str(record["version"])
    if to is None and (folder / "manifest.json").is_file():
        for entry in record["engine"]["files"]:
            path = folder / "engine" / entry["path"]
            if not path.is_file() or sha256_file(path) != entry["sha256"]:
                raise RegistryError(f"{path} differs from the registry's copy: delete {folder}, pull again")
        check_engine_spec(folder / "engine", f"{folder}: cannot use it")
        return folder
    return store.pull(ref.at(record["version"]), folder, tensorrt_version=tensorrt_version, gpu_arch=gpu_arch)
