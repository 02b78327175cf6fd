"""The run's last step: publish the engine to the registry when the gate PASSed (or the user
forced it with a reason), under names derived from the recipe's options."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.config import RegistryConfig
from pipeline.registry import RegistryError, open_registry
from pipeline.registry.records import REUSED
from pipeline.registry.refs import check_channel, check_name

# Optimization groups named in a recipe's registry name after its quant option, when not none.
NAMED_GROUPS = ("prune", "distill", "kv_cache", "fusion", "speculative")


def check_registry(config: RegistryConfig) -> None:
    """Refuse bad registry settings before the run, not after an hour of passes."""
    if config.backend not in ("local", "mlflow"):
        raise RegistryError(f"registry.backend={config.backend!r}: choose local or mlflow")
    if config.backend == "mlflow":
        if not config.uri:
            raise RegistryError("registry=mlflow needs registry.uri (e.g. http://127.0.0.1:5000)")
        open_registry(uri=config.uri)  # MLflow is installed
    for what, name in (("registry.model", config.model), ("registry.recipe", config.recipe)):
        if name is not None:
            check_name(what, name)
    if config.channel is not None:
        check_channel(config.channel)
    if config.force is not None and not config.force.strip():
        raise RegistryError("registry.force needs the reason to publish without a PASS")


def registry_names(choices: Mapping[str, str | None], config: RegistryConfig) -> tuple[str, str]:
    """(model, recipe) of a run: the config's names, else its options, e.g. ``llama`` and
    ``int4_awq+kv_cache-shared+fusion-ort``."""
    model = config.model or choices.get("model") or "model"
    if config.recipe:
        return model, config.recipe
    parts = [choices.get("quant") or "none"]
    parts += [f"{g}-{choices[g]}" for g in NAMED_GROUPS if choices.get(g) not in (None, "none")]
    return model, "+".join(parts)


def publish_run(
    config: RegistryConfig, run_dir: Path, manifest: dict[str, Any], choices: Mapping[str, str | None]
) -> str:
    """Publish if the verdict allows; return the line to print either way (an engine a version
    already holds is not published again: the line names that version)."""
    check_registry(config)
    verdict = (manifest.get("gate") or {}).get("verdict", "not-run")
    if verdict == "FAIL" and config.force is None:
        return "not published: the gate FAILed"
    if verdict == "INCONCLUSIVE" and config.force is None:
        return (
            "not published to any channel: the gate was INCONCLUSIVE (no regression shown, no PASS either); "
            "run eval=full or more items (eval.limit) to settle it, or publish with registry.force='<why>'"
        )
    if verdict != "PASS" and config.force is None:
        return (
            f"not published: no gate verdict ({verdict}); run with eval=quick|full to publish, "
            "registry=none to skip this step"
        )
    model, recipe = registry_names(choices, config)
    store = open_registry(config.root, config.uri if config.backend == "mlflow" else None)
    # The run's own record, not whatever manifest.json holds by now; the engine folder is checked
    # against it file by file before anything is stored.
    record = store.publish(
        run_dir, model=model, recipe=recipe, channel=config.channel, force=config.force, manifest=manifest
    )
    if record.get(REUSED):  # a version holds this very engine already: no new version
        return f"{record[REUSED]} (registry {store.root})"
    where = f" (channel {config.channel})" if config.channel else ""
    forced = f" [forced: {config.force}]" if record["forced"] else ""
    name = f"{model}/{recipe}/{record['target']}@{record['version']}"
    return f"published {name}{where}{forced} to {store.root}"
