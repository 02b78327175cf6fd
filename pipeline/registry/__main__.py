"""``python -m pipeline.registry``: list, show, pull, promote, publish, verify and gc.

    python -m pipeline.registry list
    python -m pipeline.registry show llama/fp8@stable
    python -m pipeline.registry pull llama/fp8@stable --to DIR      # every sha256 checked
    python -m pipeline.registry promote llama/fp8@3 --channel stable
    python -m pipeline.registry publish artifacts/runs/<time> --model llama --recipe fp8 [--force WHY]
                                  # an engine a version already holds: that version, no new one
    python -m pipeline.registry verify                                # exit 1 when anything is wrong
    python -m pipeline.registry gc
    python -m pipeline.registry --uri http://127.0.0.1:5000 list      # the MLflow backend

Bad input (a bad name, an unknown version, a refused publish, a corrupt blob on pull, a --root
that is not a registry) prints one ``error:`` line and exits with code 2; an operating-system
failure (a read-only registry on publish, permission denied, a full disk) one line naming the path
and what was being written, exit code 1. Malformed records are named on ``warning:`` lines and
skipped. Ctrl-C or SIGTERM leaves nothing half-written (exit 130 or 143).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.table import Table

from pipeline.core.errors import PipelineError, os_error_exit_code, print_error
from pipeline.core.files import check_output_folder
from pipeline.core.signals import exit_code, interrupt_on_sigterm
from pipeline.registry import CHANNELS, DEFAULT_ROOT, Ref, open_registry
from pipeline.registry.records import REUSED, Registry, describe


def _list(store: Registry, args: argparse.Namespace) -> int:
    index = store.index()
    if args.json:
        print(json.dumps(index, indent=2))
        return 0
    table = Table(title=f"Registry {store.root}")
    for column in ("model/recipe/target", "version", "channels", "gate", "published", "size"):
        table.add_column(column)
    for entry in index["versions"]:
        key = f"{entry['model']}/{entry['recipe']}/{entry['target']}"
        channels = [c for c, v in index["channels"].get(key, {}).items() if v == entry["version"]]
        gate = entry["verdict"] + (f" (forced: {entry['forced']})" if entry["forced"] else "")
        size = f"{entry['bytes'] / 2**20:.0f} MiB"
        table.add_row(key, str(entry["version"]), ", ".join(channels), gate, entry["published_at"], size)
    Console().print(table if index["versions"] else f"{store.root}: nothing published yet")
    return 0


def _show(store: Registry, args: argparse.Namespace) -> int:
    record = store.resolve(Ref.parse(args.ref, args.target))
    if args.json:
        print(json.dumps(record, indent=2, default=str))
        return 0
    manifest = record["manifest"]
    source = manifest.get("source")
    digest = str(source.get("digest", "?")) if isinstance(source, dict) else "?"
    lines = [
        f"{record['model']}/{record['recipe']}/{record['target']}@{record['version']}",
        f"  published {record['published_at']} by {record.get('published_by')} from {record.get('run')}",
        f"  gate: {record['gate']['verdict']}"
        + (f" (forced: {record['forced']})" if record["forced"] else f" ({record['gate'].get('reason')})"),
        f"  engine digest {record['engine'].get('digest')}",
        f"  source {digest[:12]}, overrides {manifest.get('overrides')}",
    ]
    gate = manifest.get("gate")
    suites = gate.get("suites") if isinstance(gate, dict) else None
    for suite, row in (suites if isinstance(suites, dict) else {}).items():
        lines.append(f"  {suite}: {_optional(_suite_line, row)}")
    if bench := manifest.get("benchmark"):
        lines.append(f"  benchmark: {_optional(_bench_line, bench)}")
    for entry in record["engine"]["files"]:
        lines.append(f"    {entry['sha256'][:12]}  {entry['bytes']:>12,}  {entry['path']}")
    print("\n".join(lines))
    return 0


def _optional(format_line: Any, data: Any) -> str:
    """A manifest section as one line; '?' when it is not what a run writes (shown, not trusted)."""
    try:
        return str(format_line(data))
    except (AttributeError, KeyError, TypeError, ValueError):
        return "? (not in the format a run writes)"


def _suite_line(row: dict[str, Any]) -> str:
    if "candidate_mean" not in row:
        return str(row.get("verdict", "?"))
    line = f"{row['baseline_mean']:.1%} -> {row['candidate_mean']:.1%}"
    if "ci_low" in row:
        line += f", difference {row['difference']:+.1%} [{row['ci_low']:+.1%}, {row['ci_high']:+.1%}]"
    return f"{line}, {row.get('verdict', '?')}"


def _bench_line(bench: dict[str, Any]) -> str:
    parts = [f"TPOT {bench['tpot']['median_ms']:.1f} ms"] if bench.get("tpot") else []
    for length, timing in (bench.get("ttft") or {}).items():
        parts.append(f"TTFT@{length} {timing['median_ms']:.0f} ms")
    return ", ".join(parts) or "not measured"


def _pull(store: Registry, args: argparse.Namespace) -> int:
    # A symlink (even to an empty folder), a file, a FIFO or a device at --to is refused in one
    # line before anything is read; an existing real folder is the store's to judge (empty: used).
    check_output_folder(args.to, "the pulled folder, --to")
    folder = store.pull(
        Ref.parse(args.ref, args.target),
        args.to,
        tensorrt_version=args.tensorrt_version,
        gpu_arch=args.gpu_arch,
    )
    print(f"pulled {args.ref} into {folder} (every sha256 checked)")
    return 0


def _promote(store: Registry, args: argparse.Namespace) -> int:
    moved = store.promote(Ref.parse(args.ref, args.target), args.channel, args.reason)
    print(f"{args.channel} -> version {moved['version']} (moved {len(moved['history'])} times)")
    return 0


def _publish(store: Registry, args: argparse.Namespace) -> int:
    # The store reads (and checks) run_dir/manifest.json; the engine folder must match it.
    record = store.publish(
        args.run_dir, model=args.model, recipe=args.recipe, channel=args.channel, force=args.force
    )
    if record.get(REUSED):  # a version holds this engine already: no new version was made
        print(record[REUSED])
        return 0
    print(f"published {record['model']}/{record['recipe']}/{record['target']}@{record['version']}")
    return 0


def _verify(store: Registry, args: argparse.Namespace) -> int:
    problems = store.verify()
    for problem in problems:
        print(problem)
    logging.disable(logging.WARNING)  # the malformed files are among the problems printed
    try:
        versions = len(store.index()["versions"])
    finally:
        logging.disable(logging.NOTSET)
    print(f"{store.root}: {versions} versions, {len(problems)} problems")
    return 1 if problems else 0


def _gc(store: Registry, args: argparse.Namespace) -> int:
    freed = store.gc()
    print(
        f"removed {freed['staging_files']} staging files and {freed['orphan_blobs']} unreferenced blobs "
        f"({freed['bytes_freed'] / 2**20:.1f} MiB)"
    )
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, like every other user mistake
        self.exit(2, f"error: {message} (see --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="python -m pipeline.registry", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="the local registry folder")
    parser.add_argument("--uri", help="an MLflow tracking server instead, e.g. http://127.0.0.1:5000")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    listing = commands.add_parser("list", help="every version and its channels")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(run=_list)
    for name, run, text in (
        ("show", _show, "one version's record"),
        ("pull", _pull, "copy a version out, sha256-checked"),
        ("promote", _promote, "move a channel to a version"),
    ):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("ref", help="<model>/<recipe>[/<target>][@<version|channel>]")
        sub.add_argument("--target", help="the engine target (default ort-cpu, or the one the ref names)")
        sub.set_defaults(run=run)
        if name == "show":
            sub.add_argument("--json", action="store_true")
        if name == "pull":
            sub.add_argument("--to", type=Path, required=True, help="a new folder")
            sub.add_argument("--tensorrt-version", help="refuse an engine built for another TensorRT")
            sub.add_argument("--gpu-arch", help="refuse an engine built for another compute capability")
        if name == "promote":
            sub.add_argument("--channel", required=True, choices=CHANNELS)
            sub.add_argument("--reason", help="recorded in the channel's history")
    publish = commands.add_parser("publish", help="publish a run folder's engine (gate PASS only)")
    publish.add_argument("run_dir", type=Path)
    publish.add_argument("--model", required=True)
    publish.add_argument("--recipe", required=True)
    publish.add_argument("--channel", choices=CHANNELS)
    publish.add_argument("--force", metavar="REASON", help="publish without a PASS; the reason is recorded")
    publish.set_defaults(run=_publish)
    commands.add_parser("verify", help="check every blob, version and channel").set_defaults(run=_verify)
    commands.add_parser("gc", help="remove what no version references").set_defaults(run=_gc)
    return parser.parse_args(argv)


class _WarningLines(logging.Handler):
    """The registry's warnings (a malformed record skipped, a corrupt blob replaced) as
    ``warning: ...`` lines on whatever ``sys.stderr`` is when they happen."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("warning: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def _warnings_as_lines() -> None:
    logger = logging.getLogger("pipeline.registry")
    if not any(isinstance(h, _WarningLines) for h in logger.handlers):
        logger.addHandler(_WarningLines())
    if logger.level == logging.NOTSET or logger.level > logging.WARNING:
        logger.setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    interrupt_on_sigterm()
    try:
        args = parse_args(argv)
        _warnings_as_lines()
        return int(args.run(open_registry(args.root, args.uri), args))
    except PipelineError as exc:  # RegistryIOError (the OS refused): exit code 1
        return print_error(exc)
    except OSError as exc:  # not foreseen above: still one line naming the path
        print(f"error: {describe(exc)} (while running `{' '.join(sys.argv[1:3])}`)", file=sys.stderr)
        return os_error_exit_code(exc)
    except KeyboardInterrupt as exc:
        print(
            "interrupted: nothing half-written is visible (a publish stops before its version record, "
            "a pull before its rename); `gc` removes what a killed publish staged",
            file=sys.stderr,
        )
        return exit_code(exc)


if __name__ == "__main__":
    sys.exit(main())
