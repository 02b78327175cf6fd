"""lm-eval's command line (lm-evaluation-harness 0.4.13) with the ``pipeline-engine`` model
registered and this folder on the task include path:

    python -m evals.tasks --model pipeline-engine --model_args engine=<engine folder> \\
        --tasks reasoning_rank_quick [--limit N] [--log_samples --output_path DIR] [...]

Every lm-eval option works (``ls tasks``, ``validate``, ``--gen_kwargs``, ...); ``--include_path``
defaults to ``evals/tasks``. lm-eval's own ``lm_eval`` command cannot see a model registered
outside lm-eval when tasks are given by name, but it can when a task is given by the path of
one of our YAML files (``--tasks <evals/tasks>/reasoning_rank_quick.yaml``): resolving that
file imports this package, which registers the model. A user error (not an engine folder,
a prompt longer than the engine, a stale frozen suite) prints one line and exits with code 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from evals.tasks import TASKS_DIR
from pipeline.core.errors import PipelineError


def with_include_path(args: Sequence[str]) -> list[str]:
    """``args`` plus ``--include_path evals/tasks`` unless an include path is given."""
    args = list(args)
    if args and not any(a == "--include_path" or a.startswith("--include_path=") for a in args):
        args += ["--include_path", str(TASKS_DIR)]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from lm_eval.__main__ import cli_evaluate

    args = with_include_path(sys.argv[1:] if argv is None else argv)
    sys.argv = [sys.argv[0] if sys.argv else "evals.tasks", *args]  # lm-eval's parser reads sys.argv
    try:
        cli_evaluate()
    except PipelineError as error:  # SuiteError is one
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
