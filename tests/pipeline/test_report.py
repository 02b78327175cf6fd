"""The nightly report: written from a registry with three nights of int8 and two of int4, opened
and checked (plots rendered as PNG images, numbers equal to the manifests', regressions flagged)."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import pytest

from pipeline.registry import LocalRegistry, Ref
from pipeline.report import main, pareto_front
from tests.pipeline.registry.conftest import make_run

pytest.importorskip("matplotlib")

# recipe -> nights of (reasoning score, tool_call score, top-1, TTFT ms, TPOT ms)
NIGHTS = {
    "int8": [
        (0.550, 0.560, 0.970, 900.0, 10.0),
        (0.556, 0.561, 0.971, 905.0, 10.2),
        (0.520, 0.560, 0.972, 910.0, 12.0),
    ],
    "int4_awq": [(0.530, 0.540, 0.930, 700.0, 8.0), (0.531, 0.539, 0.931, 702.0, 7.9)],
}


def publish_night(
    store: LocalRegistry,
    folder: Path,
    recipe: str,
    night: int,
    verdict: str = "PASS",
    force: str | None = None,
) -> None:
    reasoning, tool_call, top1, ttft, tpot = NIGHTS[recipe][night]
    run = make_run(folder, seed=night + 10 * len(recipe))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["gate"] = {
        "verdict": verdict,
        "reason": "every suite passed",
        "suites": {
            "reasoning": {"candidate_mean": reasoning, "baseline_mean": 0.56},
            "tool_call": {"candidate_mean": tool_call, "baseline_mean": 0.56},
        },
    }
    manifest["quality"] = {"kl_mean": 0.01 * (night + 1), "top1_agreement": top1, "perplexity": 25.0}
    manifest["benchmark"] = {"ttft": {"512": {"median_ms": ttft}}, "tpot": {"median_ms": tpot}}
    (run / "manifest.json").write_text(json.dumps(manifest))
    store.publish(run, model="llama", recipe=recipe, channel="nightly", force=force)


def png_images(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r"src='data:image/png;base64,([^']+)'", page)]


def test_the_nightly_report_shows_tonight_last_night_and_stable(tmp_path: Path) -> None:
    import matplotlib.image

    store = LocalRegistry(tmp_path / "reg")
    for night in range(3):
        for recipe, nights in NIGHTS.items():
            if night < len(nights):
                publish_night(store, tmp_path / "runs" / f"{recipe}-{night}", recipe, night)
    store.promote(Ref.parse("llama/int8@1"), "stable")
    out = tmp_path / "report" / "nightly.html"
    assert main(["nightly", "--root", str(tmp_path / "reg"), "--out", str(out)]) == 0
    page = out.read_text()

    images = png_images(page)
    assert len(images) == 2
    for image in images:
        pixels = matplotlib.image.imread(io.BytesIO(image), format="png")
        assert pixels.shape[0] > 300 and pixels.shape[1] > 500
        assert pixels.std() > 0.05  # drawn on, not a blank canvas

    int8 = page.split("<h2 id='llama/int8/ort-cpu'>")[1].split("</table>")[0]
    rows = {
        row.split("</td>")[0].removeprefix("<tr><td>"): row
        for row in int8.split("\n")
        if row.startswith("<tr><td>")
    }
    # tonight is version 3, last night version 2, stable version 1: their numbers, as published
    assert (
        "<td>v3</td>" in rows["tonight"]
        and "<td>0.520</td>" in rows["tonight"]
        and "<td>12.00</td>" in rows["tonight"]
    )
    assert "<td>v2</td>" in rows["last night"] and "<td>0.556</td>" in rows["last night"]
    assert (
        "<td>v1</td>" in rows["stable"]
        and "<td>900.0</td>" in rows["stable"]
        and "<td>0.0100</td>" in rows["stable"]
    )
    assert "<h2 id='llama/int4_awq/ort-cpu'>" in page

    flags = re.findall(r"<li class='flag'>([^<]+)</li>", page)
    assert flags == [
        "llama/int8/ort-cpu: reasoning 0.556 -&gt; 0.520 (v2 -&gt; v3, drop &gt; 0.02)",
        "llama/int8/ort-cpu: TPOT 10.2 -&gt; 12.0 ms (+18%)",
    ]


def test_each_gate_outcome_has_its_own_colour(tmp_path: Path) -> None:
    store = LocalRegistry(tmp_path / "reg")
    publish_night(store, tmp_path / "runs" / "0", "int4_awq", 0)
    forced = "12 items cannot tell; the full gate runs tomorrow"
    publish_night(store, tmp_path / "runs" / "1", "int4_awq", 1, verdict="INCONCLUSIVE", force=forced)
    out = tmp_path / "nightly.html"
    assert main(["nightly", "--root", str(tmp_path / "reg"), "--out", str(out)]) == 0
    page = out.read_text()
    assert f"<td><span class='inconclusive'>INCONCLUSIVE (forced: {forced})</span></td>" in page
    assert "<td><span class='pass'>PASS</span></td>" in page
    assert ".inconclusive{" in page and ".fail{" in page
    assert f"llama/int4_awq/ort-cpu@2 was published without a PASS (forced: {forced})" in page


def test_an_empty_registry_gives_an_empty_report(tmp_path: Path) -> None:
    out = tmp_path / "nightly.html"
    assert main(["nightly", "--root", str(tmp_path / "none"), "--out", str(out)]) == 0
    assert "0 recipes on the nightly channel" in out.read_text() and not png_images(out.read_text())


def test_the_pareto_front_keeps_what_nothing_beats_on_both() -> None:
    # (TPOT, quality): 1 is slower and worse than 0; 3 equals 2 on speed but is worse
    points = [(8.0, 0.55), (9.0, 0.54), (10.0, 0.60), (10.0, 0.58), (6.0, 0.50)]
    assert pareto_front(points) == [0, 2, 4]
