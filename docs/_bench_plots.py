"""Draws the benchmarks guide's figures from ``bench/results.json`` (no plotting library: the
docs environment has none, and the picture is a few dozen rectangles).

``tests/test_docs.py::test_benchmark_figures_are_current`` checks that
``docs/assets/bench-checkpoint.svg`` and the guide's table are what this module makes of the
results; ``TASKPOINT_UPDATE_DOCS=1`` rewrites the picture. Not part of any package.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

CONTENDERS = (
    ("raw", "raw fs.put / fs.get", "#9e9e9e"),
    ("ref", "reference: tarfile + put", "#f0883e"),
    ("tp", "taskpoint", "#3f51b5"),
)
"""The bars of each group: results.json's key prefix, the legend, the colour."""

LOW, HIGH = 1e-3, 1e2
"""The logarithmic axis, in seconds."""


def table(results: dict[str, Any]) -> str:
    """The guide's Markdown table of ``results`` (bench_checkpoint.py's rows)."""
    lines = [
        "| store | MB | shape | save vs ref | save : raw | load vs ref | load : raw | bg blocked "
        "| loop step | RSS save / load |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in results["rows"]:
        r = row["ratios"]
        loop = f"{r['loop_step_slowdown']:.2f}" if row.get("loop_step") else "\u2013"  # an en dash: no loop figure
        lines.append(
            f"| {row['store']} | {row['size_mb']} | {row['shape']} | {r['save_vs_reference']:.1f}x "
            f"| {r['save_vs_raw']:.2f} | {r['load_vs_reference']:.1f}x | {r['load_vs_raw']:.2f} "
            f"| {r['background_blocked']:.2f} | {loop} "
            f"| {row['tp_save_rss_mb']:.0f} / {row['tp_load_rss_mb']:.0f} MB |"
        )
    return "\n".join(lines) + "\n"


def _x(seconds: float, left: float, width: float) -> float:
    clamped = min(max(seconds, LOW), HIGH)
    return left + width * (math.log10(clamped) - math.log10(LOW)) / (
        math.log10(HIGH) - math.log10(LOW)
    )


def figure(results: dict[str, Any]) -> str:
    """Save and restore seconds of every row, raw / reference / taskpoint, as an SVG."""
    rows = results["rows"]
    bar, gap, label_w, panel_w, top = 8, 10, 170, 330, 58
    group_h = bar * len(CONTENDERS) + gap
    height = top + group_h * len(rows) + 40
    width = label_w + 2 * panel_w + 60
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" font-family="sans-serif" font-size="13">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    legend_x = label_w
    for _, name, colour in CONTENDERS:
        out.append(f'<rect x="{legend_x}" y="8" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{legend_x + 14}" y="17">{escape(name)}</text>')
        legend_x += 34 + 7.2 * len(name)
    for p, (what, title) in enumerate((("save", "save (s)"), ("load", "restore (s)"))):
        left = label_w + p * (panel_w + 30)
        out.append(f'<text x="{left + panel_w / 2}" y="40" text-anchor="middle" '
                   f'font-weight="bold">{title}</text>')
        for exp in range(int(math.log10(LOW)), int(math.log10(HIGH)) + 1):
            x = _x(10.0**exp, left, panel_w)
            out.append(f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" '
                       f'y2="{top + group_h * len(rows)}" stroke="#dddddd"/>')
            label = f"{10.0**exp:g}"
            out.append(f'<text x="{x:.1f}" y="{top + group_h * len(rows) + 14}" '
                       f'text-anchor="middle" fill="#555555">{label}</text>')
        for i, row in enumerate(rows):
            y0 = top + i * group_h
            for j, (key, _, colour) in enumerate(CONTENDERS):
                seconds = row[f"{key}_{what}"]
                x1 = _x(seconds, left, panel_w)
                out.append(f'<rect x="{left}" y="{y0 + j * bar}" width="{x1 - left:.1f}" '
                           f'height="{bar - 1}" fill="{colour}">'
                           f"<title>{escape(key)} {what}: {seconds:.3f} s</title></rect>")
    for i, row in enumerate(rows):
        y = top + i * group_h + bar * len(CONTENDERS) / 2 + 4
        text = f"{row['store']} · {row['size_mb']} MB · {row['shape']}"
        out.append(f'<text x="{label_w - 8}" y="{y:.1f}" text-anchor="end">{escape(text)}</text>')
    out.append(f'<text x="{label_w}" y="{height - 6}" fill="#555555">seconds, logarithmic; '
               f"shorter is faster. A {results['cpus']}-core VM; "
               "S3 is a SeaweedFS server on the same cores</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"
