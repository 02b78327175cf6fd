"""The MLflow backend: the local registry's operations against an MLflow tracking server's Model
Registry (``registry=mlflow registry.uri=http://127.0.0.1:5000``; ``pip install -e ".[mlflow]"``).

Mapping: one registered model per model/recipe/target, named ``<model>~<recipe>~<target>``
(MLflow names may not hold ``/``; ``~`` is outside our name characters, so the name parses back),
tagged with the three names. A publish is one MLflow run in the experiment
``llm-pipeline-registry`` holding the engine files (artifact ``engine/``, exactly the files the
run manifest lists, hashed as they are staged) and ``manifest.json``; then a model version of
that run, whose number the server assigns (so concurrent publishers get distinct versions), with
the version record (names, gate verdict, forced reason, engine digest, files with sha256,
TensorRT build) and headline manifest fields as tags. Channels are registered-model aliases;
their history is a registered-model tag. An engine a version already holds (the same file
list: path and sha256 of every file) is not uploaded again; the channel moves to that version.
Publishers of one engine that race (MLflow has no lock) each make a version, then every one but
the earliest deletes its own. The model version is the commit: a publisher killed
before it leaves a run no version references, which ``gc`` deletes.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.core.artifacts import sha256_file, write_json
from pipeline.core.files import loads_bounded
from pipeline.registry.records import (
    ENGINE_DIR,
    MANIFEST_FILE,
    REUSED,
    Publication,
    check_engine_spec,
    check_history,
    check_record,
    check_tensorrt,
    load_json,
    now,
    prepare_publication,
    pulled_folder,
    safe_relative,
    stage_file,
)
from pipeline.registry.refs import Ref, RegistryError, check_channel

log = logging.getLogger(__name__)

EXPERIMENT = "llm-pipeline-registry"
TAG = "llm_pipeline"  # prefix of our tags
SEPARATOR = "~"


def model_name(ref: Ref) -> str:
    return SEPARATOR.join(ref.key)


class MlflowRegistry:
    """The registry's operations over MLflow's Model Registry at ``uri``."""

    def __init__(self, uri: str) -> None:
        try:
            from mlflow import MlflowClient
        except ImportError:
            raise RegistryError('registry.backend=mlflow needs MLflow: pip install -e ".[mlflow]"') from None
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        self.root = uri  # for messages, like LocalRegistry.root

    def _call(self, what: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        from mlflow.exceptions import MlflowException

        try:
            return function(*args, **kwargs)
        except MlflowException as exc:
            raise RegistryError(f"MLflow at {self.uri}: {what} failed ({str(exc).splitlines()[0]})") from None
        except OSError as exc:  # the server is down or unreachable
            raise RegistryError(
                f"MLflow at {self.uri} is unreachable ({exc}); is `mlflow server` running?"
            ) from None

    def _experiment_id(self) -> str:
        experiment = self._call("get experiment", self.client.get_experiment_by_name, EXPERIMENT)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self._call("create experiment", self.client.create_experiment, EXPERIMENT)
        except RegistryError:  # a concurrent publisher created it first
            return self._call("get experiment", self.client.get_experiment_by_name, EXPERIMENT).experiment_id

    # -- publish ------------------------------------------------------------------------------

    def publish(
        self,
        run_dir: Path | str,
        *,
        model: str,
        recipe: str,
        channel: str | None = None,
        force: str | None = None,
        manifest: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """As :meth:`LocalRegistry.publish`, into MLflow (the same checks of the run's record and
        engine folder; every file hashed as it is staged). An engine a version already holds is
        not uploaded again: the channel moves to that version, returned with ``reused``."""
        publication = prepare_publication(run_dir, model, recipe, channel, force, manifest)
        ref = publication.ref
        name = model_name(ref)
        holder = self._holder(publication)
        if holder is not None:  # nothing uploaded: that version holds this engine already
            return self._reuse(publication, holder)
        with tempfile.TemporaryDirectory(prefix="publish-") as tmp:
            staged = Path(tmp) / ENGINE_DIR
            for entry in publication.files:
                target = staged / entry["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                stage_file(
                    publication.engine_dir / entry["path"], target, entry, within=publication.engine_dir
                )
            write_json(Path(tmp) / MANIFEST_FILE, publication.manifest)
            experiment = self._experiment_id()
            run = self._call(
                "create run",
                self.client.create_run,
                experiment,
                tags={f"{TAG}.ref": str(ref), f"{TAG}.pending": "1"},
            )
            run_id = run.info.run_id
            self._call("upload engine", self.client.log_artifacts, run_id, str(staged), ENGINE_DIR)
            self._call("upload manifest", self.client.log_artifact, run_id, str(Path(tmp) / MANIFEST_FILE))
            self._call("finish run", self.client.set_terminated, run_id)
        self._ensure_model(ref)
        record = publication.record(0)
        tags = self._version_tags(record)
        version = self._call(
            "create model version",
            self.client.create_model_version,
            name,
            f"runs:/{run_id}/{ENGINE_DIR}",
            run_id=run_id,
            tags=tags,
            await_creation_for=60,
        )
        self._call("mark run published", self.client.set_tag, run_id, f"{TAG}.pending", "0")
        record["version"] = int(version.version)
        # No lock spans the check above and the server assigning the number: a publisher of the
        # same engine that raced this one made its version too. The earliest stays; a later one
        # deletes itself (and its run) and moves the channel to the earliest instead.
        holder = self._holder(publication)
        if holder is not None and holder["version"] < record["version"]:
            self._call(
                "delete the duplicate version", self.client.delete_model_version, name, version.version
            )
            self._call("delete the duplicate run", self.client.delete_run, run_id)
            return self._reuse(publication, holder)
        if channel:
            self._move_channel(ref, int(version.version), channel, f"published {version.version}")
        log.info("published %s to %s", ref.at(record["version"]), self.uri)
        return record

    def _holder(self, publication: Publication) -> dict[str, Any] | None:
        """The earliest version of the publication's registered model holding its engine (read
        from the version tags; a malformed version is skipped: ``list`` and ``verify`` name it)."""
        records = []
        for version in self._versions(model_name(publication.ref)):
            try:
                records.append(self._record(version, with_manifest=False))
            except RegistryError:
                continue
        return publication.holder(records)

    def _reuse(self, publication: Publication, holder: dict[str, Any]) -> dict[str, Any]:
        """The publish of an engine the version ``holder`` holds already: the channel asked for
        moved to it (unless it points there), that version's record returned with ``reused``."""
        ref = publication.ref.at(holder["version"])
        channel = publication.channel
        moved = False
        if channel:
            registered = self._call("get model", self.client.get_registered_model, model_name(ref))
            if str((registered.aliases or {}).get(channel)) != str(holder["version"]):
                self._move_channel(ref, holder["version"], channel, f"published {holder['version']} again")
                moved = True
        result = publication.reused(self._record(self._version(ref)), moved)
        log.info("%s (%s)", result[REUSED], self.uri)
        return result

    def _ensure_model(self, ref: Ref) -> None:
        from mlflow.exceptions import MlflowException

        tags = {f"{TAG}.model": ref.model, f"{TAG}.recipe": ref.recipe, f"{TAG}.target": ref.target}
        try:
            self.client.create_registered_model(model_name(ref), tags=tags)
        except MlflowException as exc:
            if "RESOURCE_ALREADY_EXISTS" not in str(exc) and "already exists" not in str(exc):
                raise RegistryError(f"MLflow at {self.uri}: create model failed ({exc})") from None

    @staticmethod
    def _version_tags(record: dict[str, Any]) -> dict[str, str]:
        """The record (without the manifest, which is the run's artifact) and headline fields."""
        compact = {k: v for k, v in record.items() if k not in ("manifest", "version")}
        manifest = record["manifest"]
        bench = manifest.get("benchmark") or {}
        headline = {
            "gate.verdict": record["gate"]["verdict"],
            "engine.digest": record["engine"]["digest"],
            "source.digest": (manifest.get("source") or {}).get("digest"),
            "forced": record["forced"],
            "tpot_ms": (bench.get("tpot") or {}).get("median_ms"),
            "kl_mean": (manifest.get("quality") or {}).get("kl_mean"),
        }
        tags = {f"{TAG}.{k}": str(v) for k, v in headline.items() if v is not None}
        tags[f"{TAG}.record"] = json.dumps(compact, sort_keys=True, default=str)
        return tags

    # -- read ---------------------------------------------------------------------------------

    def _version(self, ref: Ref) -> Any:
        name = model_name(ref)
        if ref.selector is None:
            versions = self._versions(name)
            if not versions:
                raise RegistryError(f"nothing is published as {ref.at(None)} at {self.uri}")
            return max(versions, key=lambda v: int(v.version))
        from mlflow.exceptions import MlflowException

        try:
            if isinstance(ref.selector, str):
                return self.client.get_model_version_by_alias(name, ref.selector)
            return self.client.get_model_version(name, str(ref.selector))
        except MlflowException:
            what = (
                f"channel {ref.selector} of {ref.at(None)} points at no version"
                if isinstance(ref.selector, str)
                else f"{ref} does not exist"
            )
            raise RegistryError(f"{what} at {self.uri}") from None
        except OSError as exc:
            raise RegistryError(f"MLflow at {self.uri} is unreachable ({exc})") from None

    def _versions(self, name: str) -> list[Any]:
        return list(self._call("list versions", self.client.search_model_versions, f"name='{name}'"))

    def _record(self, version: Any, with_manifest: bool = True) -> dict[str, Any]:
        """The version record from its tags (and the manifest artifact), checked like a local
        record: a malformed one is a one-line error naming the version."""
        where = f"MLflow model version {version.name} {version.version}"
        try:
            record = loads_bounded(version.tags[f"{TAG}.record"])
        except (KeyError, TypeError, ValueError) as exc:
            raise RegistryError(f"{where}: its {TAG}.record tag is missing or not JSON ({exc})") from None
        if not isinstance(record, dict):
            raise RegistryError(f"{where}: its {TAG}.record tag is not an object")
        record["version"] = int(version.version)
        record["run_id"] = version.run_id
        if with_manifest:
            with tempfile.TemporaryDirectory(prefix="manifest-") as tmp:
                path = self._call(
                    "download manifest", self.client.download_artifacts, version.run_id, MANIFEST_FILE, tmp
                )
                record["manifest"] = load_json(Path(path), f"the manifest of {where}")
        return check_record(record, where, with_manifest)

    def resolve(self, ref: Ref) -> dict[str, Any]:
        return self._record(self._version(ref))

    def index(self) -> dict[str, Any]:
        versions, channels = [], {}
        for registered in self._call("list models", self.client.search_registered_models):
            if f"{TAG}.model" not in registered.tags:
                continue
            key = registered.name.replace(SEPARATOR, "/")
            for version in self._versions(registered.name):
                try:
                    record = self._record(version, with_manifest=False)
                except RegistryError as exc:
                    log.warning("%s; skipped", exc)
                    continue
                versions.append(
                    {
                        "model": record["model"],
                        "recipe": record["recipe"],
                        "target": record["target"],
                        "version": record["version"],
                        "published_at": record["published_at"],
                        "verdict": record["gate"]["verdict"],
                        "forced": record["forced"],
                        "engine_digest": record["engine"]["digest"],
                        "bytes": sum(int(f["bytes"]) for f in record["engine"]["files"]),
                    }
                )
            if registered.aliases:
                channels[key] = {alias: int(v) for alias, v in registered.aliases.items()}
        versions.sort(key=lambda v: (v["model"], v["recipe"], v["target"], v["version"]))
        return {"versions": versions, "channels": dict(sorted(channels.items()))}

    # -- pull ---------------------------------------------------------------------------------

    def pull(
        self, ref: Ref, to: Path | str, *, tensorrt_version: str | None = None, gpu_arch: str | None = None
    ) -> Path:
        """As :meth:`LocalRegistry.pull`: every file's sha256 checked against the version record."""
        version = self._version(ref)
        record = self._record(version)
        check_tensorrt(record, tensorrt_version, gpu_arch)
        with pulled_folder(to, record) as staging:
            self._call(
                "download engine", self.client.download_artifacts, version.run_id, ENGINE_DIR, str(staging)
            )
            self._check_files(record, staging / ENGINE_DIR)
            name = f"{record['model']}/{record['recipe']}/{record['target']}@{record['version']}"
            check_engine_spec(staging / ENGINE_DIR, f"{name}: nothing was pulled")
        return Path(to)

    @staticmethod
    def _check_files(record: dict[str, Any], folder: Path) -> None:
        name = f"{record['model']}/{record['recipe']}/{record['target']}@{record['version']}"
        for entry in record["engine"]["files"]:
            path = folder / safe_relative(entry["path"], name)
            if not path.is_file():
                raise RegistryError(
                    f"{name}: file {entry['path']} ({entry['sha256']}) is missing from MLflow"
                )
            actual = sha256_file(path)
            if actual != entry["sha256"]:
                raise RegistryError(
                    f"{name}: blob {entry['sha256']} ({entry['path']}) is corrupt (its content hashes to "
                    f"{actual}); nothing was pulled"
                )

    # -- channels -----------------------------------------------------------------------------

    def promote(self, ref: Ref, channel: str, reason: str | None = None) -> dict[str, Any]:
        check_channel(channel)
        version = int(self._version(ref).version)
        return self._move_channel(ref, version, channel, reason or "promoted")

    def _move_channel(self, ref: Ref, version: int, channel: str, reason: str) -> dict[str, Any]:
        name = model_name(ref)
        self._call("set alias", self.client.set_registered_model_alias, name, channel, str(version))
        history = [*self.channel_history(ref, channel), {"version": version, "at": now(), "reason": reason}]
        self._call(
            "record channel history",
            self.client.set_registered_model_tag,
            name,
            f"{TAG}.history.{channel}",
            json.dumps(history),
        )
        return {"version": version, "history": history}

    def channel_history(self, ref: Ref, channel: str) -> list[dict[str, Any]]:
        check_channel(channel)
        registered = self._call("get model", self.client.get_registered_model, model_name(ref))
        where = f"MLflow model {registered.name}: tag {TAG}.history.{channel}"
        try:
            history = loads_bounded(registered.tags.get(f"{TAG}.history.{channel}", "[]"))
        except ValueError as exc:
            raise RegistryError(f"{where} is not JSON ({exc})") from None
        return check_history(history, where)

    # -- maintenance --------------------------------------------------------------------------

    def verify(self) -> list[str]:
        """Every version's files downloaded and hashed: the problems found, one line each."""
        problems = []
        for registered in self._call("list models", self.client.search_registered_models):
            for version in self._versions(registered.name) if f"{TAG}.model" in registered.tags else []:
                try:
                    self._record(version, with_manifest=False)
                except RegistryError as exc:
                    problems.append(f"{exc}; skipped")
        for entry in self.index()["versions"]:
            ref = Ref(entry["model"], entry["recipe"], entry["target"], entry["version"])
            version = self._version(ref)
            record = self._record(version, with_manifest=False)
            with tempfile.TemporaryDirectory(prefix="verify-") as tmp:
                try:
                    self._call(
                        "download engine", self.client.download_artifacts, version.run_id, ENGINE_DIR, tmp
                    )
                    self._check_files(record, Path(tmp) / ENGINE_DIR)
                except RegistryError as exc:
                    problems.append(str(exc))
        return problems

    def gc(self, grace_seconds: float = 3600.0) -> dict[str, int]:
        """Delete the runs of publishers that stopped before creating their model version (older
        than ``grace_seconds``, so a publisher still uploading keeps its run). MLflow marks them
        deleted; ``mlflow gc`` on the server then frees their artifacts."""
        experiment = self._call("get experiment", self.client.get_experiment_by_name, EXPERIMENT)
        if experiment is None:
            return {"staging_files": 0, "orphan_blobs": 0, "bytes_freed": 0}
        referenced = {v.run_id for v in self._call("list versions", self.client.search_model_versions, "")}
        runs = self._call(
            "list runs", self.client.search_runs, [experiment.experiment_id], max_results=50_000
        )
        cutoff = (time.time() - grace_seconds) * 1000  # MLflow times are in ms
        orphans = [r for r in runs if r.info.run_id not in referenced and r.info.start_time <= cutoff]
        for run in orphans:
            self._call("delete run", self.client.delete_run, run.info.run_id)
        return {"staging_files": 0, "orphan_blobs": len(orphans), "bytes_freed": 0}
