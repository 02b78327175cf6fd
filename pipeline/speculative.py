"""The draft engine of ``speculative=draft``: built from the run's source by the draft's own prune
and distill passes plus the recipe's other groups, then placed inside the target engine.

The draft runs through the pass manager and the cache like any recipe (a second run reuses it, and
targets of different quantization share the draft's torch stage). The combined engine is one more
cache entry, keyed by both engines' digests and ``k``: the target's files, the draft in
``draft/``, and ``engine.json`` ``speculative: {draft, k}``, which the runtime follows
(``pipeline/runtime/ort.py`` ``Engine``). Both engines must share a tokenizer (checked when the
combined engine is made and when it is loaded); both ``engine.json`` are read through
``pipeline.core.engine.read_engine_spec``, never trusted as they lie.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from typing import Any

from omegaconf import DictConfig, open_dict

from pipeline.config import SpeculativeConfig, section
from pipeline.core.artifacts import Artifact, Kind, link_tree
from pipeline.core.base import Pass
from pipeline.core.cache import KEY_FIELDS, Cache, key_fields, key_of, key_problem
from pipeline.core.engine import ENGINE_FILE, read_engine_spec
from pipeline.core.errors import ConfigError
from pipeline.core.manager import PassManager, PassRecord
from pipeline.core.plugins import build_passes
from pipeline.manifest import engine_files
from pipeline.runtime.ort import check_draft_specs

log = logging.getLogger(__name__)

DRAFT_DIR = "draft"
ATTACH_VERSION = 1


def speculative_config(cfg: DictConfig) -> SpeculativeConfig:
    config = section(cfg, "speculative")
    assert isinstance(config, SpeculativeConfig)
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
    passes: list[Pass], source: Artifact, target: Artifact, cache: Cache
) -> tuple[Artifact, list[PassRecord]]:
    """The draft engine from its ``passes`` (cached), once ``target`` is known to be able to roll
    back its cache."""
    if read_engine_spec(target.path, graphs=False).io.kv_capacity:
        raise ConfigError(
            "speculative=draft with a sliding-window KV buffer (layout=shared with kv_cache.window or "
            "the model's own windows): "
            "the buffer evicts in place and cannot roll back rejected draft tokens; use layout=concat"
        )
    log.info("draft engine for speculative decoding")
    return PassManager(passes, cache).run(source)


def attach_draft(cache: Cache, target: Artifact, draft: Artifact, k: int) -> tuple[Artifact, bool]:
    """The target engine with ``draft`` inside it (cached); returns (engine, cache hit)."""
    # Keyed and checked as a pass's entry is (pipeline/core/cache.py): entry.json records what its
    # key was computed from, and an entry found under this key must recompute to it.
    fields = key_fields(target.digest, "attach_draft", ATTACH_VERSION, {"k": k, "draft": draft.digest})
    key = key_of(fields)
    found = cache.lookup(key, Kind.ENGINE, lambda record: key_problem(record, key, fields))
    if found is not None:
        return found.artifact, True
    target_spec, draft_spec = read_engine_spec(target.path), read_engine_spec(draft.path)
    check_draft_specs(target_spec, draft_spec)
    spec = copy.deepcopy(target_spec.raw)
    start = time.perf_counter()
    with cache.stage(key, "the engine with its draft") as staging:
        out = staging / "output"
        link_tree(target.path, out)
        (out / DRAFT_DIR).mkdir()
        link_tree(draft.path, out / DRAFT_DIR)
        spec_path = out / ENGINE_FILE
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
            "finite": True,  # links to two entries the manager checked (check_finite); no new weight
            KEY_FIELDS: fields,
        }
        entry = cache.commit(key, staging, Kind.ENGINE, record)
    return entry.artifact, False


def draft_summary(draft: Artifact, records: list[PassRecord], k: int, cache_hit: bool) -> dict[str, Any]:
    """The manifest's ``speculative`` section: k, the draft's passes and its size."""
    spec = read_engine_spec(draft.path, graphs=False)
    return {
        "k": k,
        "draft_digest": draft.digest,
        "draft_bytes": sum(f["bytes"] for f in engine_files(draft.path)),
        "draft_layers": spec.io.num_layers,
        "draft_passes": [r.to_dict() for r in records],
        "attach_cache_hit": cache_hit,
    }
