"""The draft engine of ``speculative=draft``: built from the run's source by the draft's own prune
and distill passes plus the recipe's other groups, then placed inside the target engine.

The draft runs through the pass manager and the cache like any recipe (a second run reuses it, and
targets of different quantization share the draft's torch stage). The combined engine is one more
cache entry, keyed by both engines' digests and ``k``: the target's files, the draft in
``draft/``, and ``engine.json`` ``speculative: {draft, k}``, which the runtime follows
(``pipeline/runtime/ort.py`` ``Engine``). Both engines must share a tokenizer (checked when the
combined engine is loaded).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline.artifacts import Artifact, Kind
from pipeline.base import Pass
from pipeline.cache import Cache, library_versions
from pipeline.config import SpeculativeConfig
from pipeline.errors import ConfigError, EngineError
from pipeline.manager import PassManager, PassRecord
from pipeline.plugins import build_passes

log = logging.getLogger(__name__)

DRAFT_DIR = "draft"
ATTACH_VERSION = 1
ENGINE_FILE = "engine.json"


def speculative_config(cfg: DictConfig) -> SpeculativeConfig:
    config = OmegaConf.to_object(cfg.speculative)
    assert isinstance(config, SpeculativeConfig)
    if config.enabled and config.k < 1:
        raise ConfigError(f"speculative.k={config.k}: the draft proposes at least 1 token a round")
    return config


def draft_passes(cfg: DictConfig) -> list[Pass]:
    """The draft's passes: the recipe with its prune and distill groups replaced by the draft's,
    and its quant too when the draft names one."""
    draft = cfg.copy()
    with open_dict(draft):
        draft.prune = cfg.speculative.draft.prune
        draft.distill = cfg.speculative.draft.distill
        if cfg.speculative.draft.quant:
            draft.quant = cfg.speculative.draft.quant
    if not draft.prune:
        raise ConfigError(
            "speculative.draft.prune is empty: a draft is a pruned copy of the source (e.g. "
            "speculative.draft.prune.depth_ratio=0.75)"
        )
    return build_passes(draft)


def build_draft(
    cfg: DictConfig, source: Artifact, target: Artifact, cache: Cache
) -> tuple[Artifact, list[PassRecord]]:
    """The draft engine (cached), once ``target`` is known to be able to roll back its cache."""
    if json.loads((target.path / ENGINE_FILE).read_text())["io"].get("kv_capacity"):
        raise ConfigError(
            "speculative=draft with a sliding-window KV buffer (kv_cache.window with layout=shared): "
            "the buffer evicts in place and cannot roll back rejected draft tokens; use layout=concat"
        )
    log.info("draft engine for speculative decoding")
    return PassManager(draft_passes(cfg), cache).run(source)


def attach_draft(cache: Cache, target: Artifact, draft: Artifact, k: int) -> tuple[Artifact, bool]:
    """The target engine with ``draft`` inside it (cached); returns (engine, cache hit)."""
    payload = {
        "step": "attach_draft",
        "version": ATTACH_VERSION,
        "target": target.digest,
        "draft": draft.digest,
        "k": k,
        "libraries": library_versions(),
    }
    key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    found = cache.lookup(key, Kind.ENGINE)
    if found is not None:
        return found.artifact, True
    _check_vocabulary(target, draft)
    start = time.perf_counter()
    with cache.stage(key) as staging:
        out = staging / "output"
        _link_tree(target.path, out)
        _link_tree(draft.path, out / DRAFT_DIR)
        spec_path = out / ENGINE_FILE
        spec = json.loads(spec_path.read_text())
        spec["speculative"] = {"draft": DRAFT_DIR, "k": k}
        spec_path.unlink()  # a hard link to the target's entry: write a new file, never through it
        spec_path.write_text(json.dumps(spec, indent=2) + "\n")
        produced = Artifact.from_dir(Kind.ENGINE, out)
        record = {
            "pass": "attach_draft",
            "version": ATTACH_VERSION,
            "config": {"k": k, "draft": draft.digest},
            "input_digest": target.digest,
            "output_digest": produced.digest,
            "seconds": round(time.perf_counter() - start, 3),
            "metrics": {},
        }
        entry = cache.commit(key, staging, Kind.ENGINE, record)
    return entry.artifact, False


def _link_tree(source: Path, destination: Path) -> None:
    """Copy a folder as hard links (cache entries are never written in place), else by copy."""

    def link(src: str, dst: str) -> Any:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
        return dst

    shutil.copytree(source, destination, copy_function=link, dirs_exist_ok=True)


def _check_vocabulary(target: Artifact, draft: Artifact) -> None:
    target_spec = json.loads((target.path / ENGINE_FILE).read_text())
    draft_spec = json.loads((draft.path / ENGINE_FILE).read_text())
    sizes = target_spec["io"]["vocab_size"], draft_spec["io"]["vocab_size"]
    if sizes[0] != sizes[1]:
        raise EngineError(
            f"the draft's vocabulary has {sizes[1]} tokens, the target's {sizes[0]}: a draft must "
            "share the target's tokenizer"
        )


def draft_summary(draft: Artifact, records: list[PassRecord], k: int, cache_hit: bool) -> dict[str, Any]:
    """The manifest's ``speculative`` section: k, the draft's passes and its size."""
    spec = json.loads((draft.path / ENGINE_FILE).read_text())
    files = [p for p in draft.path.rglob("*") if p.is_file()]
    return {
        "k": k,
        "draft_digest": draft.digest,
        "draft_bytes": sum(p.stat().st_size for p in files),
        "draft_layers": spec["io"]["num_layers"],
        "draft_passes": [r.to_dict() for r in records],
        "attach_cache_hit": cache_hit,
    }
