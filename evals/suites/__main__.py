"""``python -m evals.suites --write`` regenerates and freezes every suite (and measures the
long-context prompts with the default model's tokenizer when it is present);
``python -m evals.suites --check`` regenerates in memory and exits 1 on any drift."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from evals.suites import long_context
from evals.suites.common import WRITE_HINT, SuiteError
from evals.suites.store import DATA_DIR, check, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.suites", description=__doc__)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="regenerate and freeze all suites")
    action.add_argument("--check", action="store_true", help="compare the frozen files with their generators")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR, help="folder of the frozen files")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=long_context.DEFAULT_TOKENIZER,
        help="folder with the default model's tokenizer.json (long-context token counts)",
    )
    args = parser.parse_args(argv)
    try:
        if args.write:
            for line in write(args.data_dir, args.tokenizer):
                print(line)
            return 0
        problems = check(args.data_dir)
    except SuiteError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        print(f"error: {problems[0]}{more}; {WRITE_HINT}", file=sys.stderr)
        return 1
    print("suites match their generators")
    return 0


if __name__ == "__main__":
    sys.exit(main())
