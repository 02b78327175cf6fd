"""Child processes of ours (the benchmark, the llama.cpp peer, the ranks of a calibration launch)
start from a clean environment: a recipe's ``hydra.job.env_set`` could otherwise point PYTHONPATH,
PYTHONSTARTUP or the dynamic loader's preloads at code, which the child would run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Environment variables a child process of ours never inherits: the interpreter's own (a recipe's
# ``hydra.job.env_set`` could point PYTHONPATH or PYTHONSTARTUP at code) and the dynamic loader's
# preloads. ``-I`` (isolated mode) ignores the PYTHON* ones anyway; dropping them also keeps them
# from the child's own children.
_UNSAFE_ENV = ("LD_PRELOAD", "LD_AUDIT")
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # holds pipeline/, passes/, evals/
# The first line of every ``python -I -c`` we run: isolated mode drops PYTHONPATH, the user site
# and the current folder from sys.path, so the project root, the first argument, is put there.
_PROJECT_ON_PATH = "import sys; sys.path.insert(0, sys.argv.pop(1))\n"


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child of ours, without PYTHON* variables or loader
    preloads (see :func:`isolated_python`)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("PYTHON") and key not in _UNSAFE_ENV
    }
    return {**env, **(extra or {})}


def isolated_python(module: str, *args: str) -> list[str]:
    """The command line that runs ``python -m module args`` in Python's isolated mode (``-I``:
    neither PYTHONPATH, PYTHONSTARTUP nor a ``sitecustomize.py`` outside the installation is
    used), with the project root put on its path; run it with :func:`child_environment`. ``module``
    is one of ours, named in our code (never read from input)."""
    run = f"import runpy; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
    return [sys.executable, "-I", "-c", _PROJECT_ON_PATH + run, str(PROJECT_ROOT), *args]


def isolated_script(script: str, *args: str) -> list[str]:
    """:func:`isolated_python` for a script of ours given as text (``python -I -c``: a constant
    of the calling module, never text read from input), which sees ``args`` as ``sys.argv[1:]``."""
    return [sys.executable, "-I", "-c", _PROJECT_ON_PATH + script, str(PROJECT_ROOT), *args]
