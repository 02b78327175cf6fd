"""``python -m pipeline.report nightly``: the nightly builds of the registry as one HTML page.

Per model/recipe/target: tonight (the ``nightly`` channel now), last night (where the channel
pointed before) and ``stable``, side by side: gate verdict, the candidate score of each suite,
held-out KL and top-1 agreement, TTFT and TPOT. Two plots, embedded as PNG: each recipe's TPOT
and mean gate score over the nights of the channel's history, and tonight's recipes on quality vs
TPOT with the Pareto front (no recipe both faster and better). Tonight is flagged against last
night where a suite's score dropped by more than ``--max-score-drop``, top-1 agreement by more
than ``--max-top1-drop``, or TTFT/TPOT rose by more than ``--max-slowdown``; the flags head the
page and are printed. Reads only registry records (the run manifests they carry).

    python -m pipeline.report nightly [--root artifacts/registry | --uri http://host:5000]
        [--out artifacts/reports/nightly.html]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import html
import io
import os
import statistics
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.errors import PipelineError, print_error
from pipeline.core.files import check_output_file
from pipeline.registry import DEFAULT_ROOT, Ref, Registry, RegistryError, open_registry

DEFAULT_OUT = Path("artifacts/reports/nightly.html")
# Each gate outcome in its own colour; an INCONCLUSIVE reaches the registry only when forced.
VERDICT_CLASSES = {"PASS": "pass", "FAIL": "fail", "INCONCLUSIVE": "inconclusive"}


@dataclass
class Build:
    """One published version, as the report reads it from its record."""

    key: str  # model/recipe/target
    version: int
    published_at: str
    verdict: str
    forced: str | None
    scores: dict[str, float] = field(default_factory=dict)  # suite -> candidate score
    kl: float | None = None
    top1: float | None = None
    perplexity: float | None = None
    tpot_ms: float | None = None
    ttft_ms: float | None = None
    ttft_length: str | None = None

    @property
    def quality(self) -> float | None:
        """The mean gate score over the suites (the Pareto plot's and the trend's quality)."""
        return statistics.mean(self.scores.values()) if self.scores else None


def build_from_record(record: dict[str, Any]) -> Build:
    manifest = record.get("manifest") or {}
    gate = manifest.get("gate") or {}
    quality = manifest.get("quality") or {}
    bench = manifest.get("benchmark") or {}
    ttft = bench.get("ttft") or {}
    first = min(ttft, key=int) if ttft else None
    return Build(
        key=f"{record['model']}/{record['recipe']}/{record['target']}",
        version=int(record["version"]),
        published_at=record["published_at"],
        verdict=str(gate.get("verdict", "not-run")),
        forced=record.get("forced"),
        scores={s: float(row["candidate_mean"]) for s, row in (gate.get("suites") or {}).items()},
        kl=quality.get("kl_mean"),
        top1=quality.get("top1_agreement"),
        perplexity=quality.get("perplexity"),
        tpot_ms=(bench.get("tpot") or {}).get("median_ms"),
        ttft_ms=ttft[first]["median_ms"] if first else None,
        ttft_length=first,
    )


@dataclass
class Recipe:
    """A model/recipe/target's nightly builds in channel order, and its stable build."""

    key: str
    nights: list[Build]
    stable: Build | None

    @property
    def tonight(self) -> Build:
        return self.nights[-1]

    @property
    def last_night(self) -> Build | None:
        return self.nights[-2] if len(self.nights) > 1 else None


def collect(store: Registry) -> list[Recipe]:
    """Every entry with a nightly channel, its builds in the order the channel pointed at them."""
    recipes = []
    for key, channels in sorted(store.index()["channels"].items()):
        if "nightly" not in channels:
            continue
        model, recipe, target = key.split("/")
        ref = Ref(model, recipe, target)
        versions: list[int] = []
        for entry in store.channel_history(ref, "nightly"):
            if not versions or versions[-1] != entry["version"]:
                versions.append(int(entry["version"]))
        nights = [build_from_record(store.resolve(ref.at(v))) for v in versions]
        stable = build_from_record(store.resolve(ref.at("stable"))) if "stable" in channels else None
        recipes.append(Recipe(key, nights, stable))
    return recipes


@dataclass(frozen=True)
class Limits:
    max_score_drop: float = 0.02
    max_top1_drop: float = 0.01
    max_slowdown: float = 0.10


def regressions(recipe: Recipe, limits: Limits) -> list[str]:
    """What got worse tonight against last night, one line each."""
    now, before = recipe.tonight, recipe.last_night
    flags = []
    if now.forced:
        flags.append(f"{recipe.key}@{now.version} was published without a PASS (forced: {now.forced})")
    if before is None:
        return flags
    for suite, score in now.scores.items():
        if suite in before.scores and before.scores[suite] - score > limits.max_score_drop:
            flags.append(
                f"{recipe.key}: {suite} {before.scores[suite]:.3f} -> {score:.3f} "
                f"(v{before.version} -> v{now.version}, drop > {limits.max_score_drop})"
            )
    if now.top1 is not None and before.top1 is not None and before.top1 - now.top1 > limits.max_top1_drop:
        flags.append(f"{recipe.key}: top-1 agreement {before.top1:.3f} -> {now.top1:.3f}")
    for what, new, old in (("TPOT", now.tpot_ms, before.tpot_ms), ("TTFT", now.ttft_ms, before.ttft_ms)):
        if new is not None and old and new / old - 1 > limits.max_slowdown:
            flags.append(f"{recipe.key}: {what} {old:.1f} -> {new:.1f} ms (+{new / old - 1:.0%})")
    return flags


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the (tpot, quality) points no other point beats on both (lower TPOT, higher quality)."""
    front = []
    for i, (tpot, quality) in enumerate(points):
        dominated = any(
            (t <= tpot and q >= quality) and (t < tpot or q > quality)
            for j, (t, q) in enumerate(points)
            if j != i
        )
        if not dominated:
            front.append(i)
    return front


def _png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def plot_trends(recipes: list[Recipe]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (speed, quality) = plt.subplots(1, 2, figsize=(11, 4))
    for recipe in recipes:
        nights = list(range(1, len(recipe.nights) + 1))
        speed.plot(nights, [b.tpot_ms for b in recipe.nights], marker="o", label=recipe.key)
        quality.plot(nights, [b.quality for b in recipe.nights], marker="o", label=recipe.key)
    speed.set(title="TPOT over nights", xlabel="nightly build (channel order)", ylabel="TPOT ms (median)")
    quality.set(title="Mean gate score over nights", xlabel="nightly build (channel order)", ylabel="score")
    quality.legend(fontsize=7)
    for axes in (speed, quality):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    encoded = _png(figure)
    plt.close(figure)
    return encoded


def plot_pareto(recipes: list[Recipe]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tonight = [r for r in recipes if r.tonight.tpot_ms is not None and r.tonight.quality is not None]
    points = [(r.tonight.tpot_ms, r.tonight.quality) for r in tonight]
    front = set(pareto_front(points))  # type: ignore[arg-type]
    figure, axes = plt.subplots(figsize=(6, 4))
    for i, (recipe, (tpot, quality)) in enumerate(zip(tonight, points, strict=True)):
        axes.scatter([tpot], [quality], color="tab:red" if i in front else "tab:gray", zorder=3)
        axes.annotate(
            recipe.key.split("/")[1], (tpot, quality), fontsize=7, xytext=(4, 4), textcoords="offset points"
        )
    if front:
        ordered = sorted(points[i] for i in front)
        axes.step([p[0] for p in ordered], [p[1] for p in ordered], where="post", color="tab:red", alpha=0.5)
    axes.set(
        title="Tonight: quality vs TPOT (red: Pareto front)",
        xlabel="TPOT ms (median)",
        ylabel="mean gate score",
    )
    encoded = _png(figure)
    plt.close(figure)
    return encoded


def _cell(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row(label: str, build: Build | None, suites: list[str]) -> str:
    if build is None:
        return f"<tr><td>{label}</td><td colspan='{7 + len(suites)}'>-</td></tr>"  # the other columns
    verdict = html.escape(build.verdict) + (f" (forced: {html.escape(build.forced)})" if build.forced else "")
    style = VERDICT_CLASSES.get(build.verdict, "")
    cells = [
        label,
        f"v{build.version}",
        html.escape(build.published_at),
        f"<span class='{style}'>{verdict}</span>" if style else verdict,
        *[_cell(build.scores.get(s)) for s in suites],
        _cell(build.kl, 4),
        _cell(build.top1),
        _cell(build.ttft_ms, 1),
        _cell(build.tpot_ms, 2),
    ]
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def render(recipes: list[Recipe], flags: list[str], root: Any) -> str:
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>Nightly report</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}.flag{color:#b00}"
        ".pass{color:#070}.fail{color:#b00;font-weight:bold}.inconclusive{color:#b60;background:#fff3cd}"
        "</style></head><body>",
        f"<h1>Nightly report</h1><p>Registry {html.escape(str(root))}: {len(recipes)} recipes on the "
        "nightly channel.</p>",
        "<h2>Regressions against last night</h2>",
        "<ul>" + "".join(f"<li class='flag'>{html.escape(f)}</li>" for f in flags) + "</ul>"
        if flags
        else "<p>None.</p>",
    ]
    for recipe in recipes:
        builds = [recipe.tonight, recipe.last_night, recipe.stable]
        suites = sorted({s for b in builds if b for s in b.scores})
        ttft = recipe.tonight.ttft_length
        header = ["", "version", "published", "gate", *suites, "KL", "top-1", f"TTFT@{ttft} ms", "TPOT ms"]
        parts.append(f"<h2 id='{html.escape(recipe.key)}'>{html.escape(recipe.key)}</h2><table>")
        parts.append("<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
        parts.append(_row("tonight", recipe.tonight, suites))
        parts.append(_row("last night", recipe.last_night, suites))
        parts.append(_row("stable", recipe.stable, suites))
        parts.append("</table>")
    if recipes:
        parts.append(f"<h2>Trends</h2><img alt='trends' src='data:image/png;base64,{plot_trends(recipes)}'>")
        parts.append(
            f"<h2>Quality vs speed</h2><img alt='pareto' src='data:image/png;base64,{plot_pareto(recipes)}'>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(out: Path, page: str) -> None:
    """Write ``page`` to ``out`` (its folder made) through a temporary file beside it and an
    atomic rename; ``out`` must be absent or a regular file (a symlink, a FIFO, a device or a
    folder there is refused in one line, never replaced), and nothing planted at the temporary
    name is followed or written through (``O_EXCL | O_NOFOLLOW``)."""
    what = "the report, --out"
    with contextlib.suppress(FileExistsError, NotADirectoryError):  # a file there: the check names it
        out.parent.mkdir(parents=True, exist_ok=True)
    check_output_file(out, what)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        with os.fdopen(os.open(tmp, flags, 0o666), "w", encoding="utf-8") as handle:
            handle.write(page)
        os.replace(tmp, check_output_file(out, what))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.report", description=__doc__.splitlines()[0])
    parser.add_argument("channel", choices=["nightly"], help="the report to write")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="the local registry folder")
    parser.add_argument("--uri", help="an MLflow registry instead (registry=mlflow)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--max-score-drop", type=float, default=Limits.max_score_drop)
    parser.add_argument("--max-top1-drop", type=float, default=Limits.max_top1_drop)
    parser.add_argument("--max-slowdown", type=float, default=Limits.max_slowdown)
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print('error: the report draws with matplotlib: pip install -e ".[nightly]"', file=sys.stderr)
        return 2
    try:
        store = open_registry(args.root, args.uri)
        recipes = collect(store)
    except RegistryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    limits = Limits(args.max_score_drop, args.max_top1_drop, args.max_slowdown)
    flags = [flag for recipe in recipes for flag in regressions(recipe, limits)]
    try:
        write_report(args.out, render(recipes, flags, store.root))
    except (PipelineError, OSError) as exc:
        return print_error(exc)
    for flag in flags:
        print(f"regression: {flag}")
    print(f"wrote {args.out} ({len(recipes)} recipes, {len(flags)} regressions flagged)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
