"""A sweep's jobs on other processes and hosts: the paths they share, and checks before the
launcher starts a job (one line and exit 2 for a launcher that cannot work, instead of a hang or
one failure per job).

- :func:`anchor_paths`: a relative path names the same folder for every job, under the
  directory the sweep was launched from (a Ray worker runs in its session folder);
- ``hydra/launcher=ray_cluster`` with ``hydra.launcher.ray.init.address=HOST:PORT``: something
  must answer there (a TCP connection within :data:`CONNECT_TIMEOUT_S`); ``ray.init`` itself
  retries an address nobody answers for minutes.
- the shared store (``pipeline.cache_dir`` and a local registry's ``registry.root``) must be
  writable: every job writes there (checked from the launching host: a worker host that mounts
  it read-only still fails in its own job, with one line).

The checks are a Hydra callback (``configs/pipeline.yaml``): once per sweep, in the launching
process.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipeline.config import nearest_existing
from pipeline.core.errors import ConfigError, one_line

CONNECT_TIMEOUT_S = 5.0
# Folders a job reads and writes; a relative one is under the directory the sweep ran from.
LAUNCH_RELATIVE = ("pipeline.cache_dir", "pipeline.models_dir", "registry.root", "model.path")
LOCAL_RAY = (None, "", "auto", "local")  # ray.init starts or finds a local cluster itself


def anchor_paths(cfg: DictConfig, launch_dir: Path) -> None:
    """Make the relative paths of :data:`LAUNCH_RELATIVE` absolute under ``launch_dir`` when this
    job runs elsewhere (a Ray worker), which would otherwise build a cache and a registry of its
    own in its session folder. Jobs in the launch directory keep their paths as given."""
    if Path.cwd().resolve() == launch_dir.resolve():
        return
    for dotted in LAUNCH_RELATIVE:
        value = OmegaConf.select(cfg, dotted, default=None)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            OmegaConf.update(cfg, dotted, str(launch_dir / value))


def check_ray_address(address: str | None, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A :class:`ConfigError` unless a Ray cluster's port answers at ``address`` (``host:port``
    or ``ray://host:port``)."""
    if address in LOCAL_RAY:
        return
    assert address is not None
    knob = f"hydra.launcher.ray.init.address={address}"
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{knob}: give HOST:PORT of the Ray head (`ray start --head` prints it), or auto")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"{knob}: no Ray cluster answers there ({reason} within {timeout_s:.0f} s); start one "
            "with `ray start --head` or fix the address"
        ) from None


def check_writable(knob: str, folder: str) -> None:
    """A :class:`ConfigError` unless ``folder`` (or the nearest existing folder above it, where it
    will be made) can be written by this user."""
    existing = nearest_existing(Path(folder).expanduser().absolute())
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{knob}={folder}: {existing} is not a writable folder, and every job of the sweep writes "
            "there: choose shared storage the jobs can write"
        )


class SweepChecks(Callback):
    """Runs :func:`check_ray_address` and :func:`check_writable` when a multirun starts. Hydra
    turns a callback's exception into a warning and goes on, so a failed check prints its line
    and exits (2) itself."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            self._check(config)
        except ConfigError as exc:
            print(one_line(f"error: {exc}"), file=sys.stderr)
            sys.exit(exc.exit_code)

    @staticmethod
    def _check(config: DictConfig) -> None:
        launcher = config.hydra.launcher
        if str(launcher.get("_target_", "")).endswith("RayLauncher"):
            check_ray_address(OmegaConf.select(launcher, "ray.init.address", default=None))
        check_writable("pipeline.cache_dir", str(config.pipeline.cache_dir))
        registry = config.get("registry")
        if registry and registry.get("backend", "local") == "local" and registry.get("root"):
            check_writable("registry.root", str(registry.root))
