"""Save-interval sweep for issue #34: the goodput benchmark's job under three failure rates,
saved at fixed intervals from very short to very long, at the frameworks' defaults, and at
``every_s="auto"``; goodput against interval, per failure rate.

Run: uv run python bench/bench_interval.py [--scale 0.015] [--failures 3] [--step-s 0.025]
        [--size-mb 8] [--intervals 1,3,10,30,100,300] [--mtbfs 30,120,600]
        [--autos default,schedule] [--seed 0] [--repeats 1] [--json PATH] [--svg PATH]
     uv run python bench/bench_interval.py --replot PATH.json [--svg PATH] [--note TEXT]

The driver is :mod:`bench_goodput`'s, imported: each run is its taskpoint side (the job
``bench/_goodput_job.py``, ``TaskpointState(model, opt, blocking=False)`` and
``save_sync(ckpt, step=step, every=N)`` at every step, or ``every_s="auto"``), restarted
after each failure as an orchestrator restarts a pod, on SeaweedFS S3 on loopback, its
goodput and badput by cause accounted the same way (see that module's docstring).

Scaled to the machine. The failure rates are real-world ones (``--mtbfs``: a mean time
between failures of 30 s, 2 min and 10 min); the sweep runs them ``--scale`` times as fast
(0.015: a real minute is 0.9 s here). A step of the job (``--step-s``, 25 ms of "compute"
on ``--size-mb`` of state) stands for one real training step of ``step_s / scale`` (1.67 s
by default), so a step count means the same here and at full scale, and so do the
frameworks' defaults, which count steps:

- Lightning's ``ModelCheckpoint`` saves every epoch: an epoch here is
  :data:`LIGHTNING_EPOCH_STEPS` steps (ImageNet-1k's 1.28 M images at a global batch of 1024);
- Hugging Face ``Trainer`` saves every 500 steps (``save_steps``): 500 steps here.

The save's cost to training (the blocked call, and what the upload takes from the steps
beside it) is what the machine makes of ``--size-mb``: it is printed, with the real cost it
stands for at this scale (cost / scale). What does not scale is the restart: a new process
imports torch and taskpoint (a few seconds on 2 cores), which stands for minutes at full
scale. It costs every interval of a schedule the same (the same failures at the same
steps) but for noise, so besides goodput the bench prints a net goodput: the uninterrupted
run's time over itself plus what the interval decides (time blocked in saves, steps
recomputed, steps slowed by the uploads beside them), without restarts, restores and the
first start.

The failures: per schedule, ``--failures`` (K) failures over K mean times between failures
of training (the run's length: ``K x MTBF x scale / step_s`` steps). Their times are a
Poisson process of rate 1/MTBF in training time, conditioned on its count being K (the
times are then K uniform draws over the run, sorted), rounded up to steps; their kinds are
drawn from ``--kinds`` (SIGKILL without warning and an exception by default: with a
preemption warning, a SIGTERM, the preemption save makes the interval moot). Both are seeded
by ``--seed`` and the schedule, so every interval of a schedule meets the same failures at
the same steps. A failure hits the life that reaches its step, as in the goodput bench.

The variants of each schedule:

- fixed: a save every N steps for each N of ``--intervals`` (log-spaced, from every step to
  beyond the run); every N at least the run's length is one run, "end only";
- the frameworks' defaults above (the same run as a fixed interval when they coincide);
- ``auto``: ``save_sync(ckpt, step=step, every_s="auto")``, with the library's prior mean
  time between failures scaled like everything else (``TASKPOINT_MTBF_PRIOR_S`` set to
  ``MTBF_PRIOR_S x scale``: what a job that sets nothing gets);
- ``auto+prior``: the same with the prior set to the schedule's own MTBF (scaled), as a
  platform's figure would set it (``--autos`` picks which of the two run).

Auto's other bounds stay the library's: its longest interval (an hour) is longer than any
run here either way, and its overhead bound (2% of training time) is a share, which scaling
leaves alone. Auto's interval on the plot is its mean over the run (steps over saves).

A run's goodput moves by several percent from one run to the next under the same failures
(the restarts: process starts on a shared machine). ``--repeats K`` runs every variant K
times, round robin (each pass runs every variant once, in an order shuffled per pass, so
a drift in the machine's load meets them all alike), each on a run of its own, and reports each figure's median; the
best fixed interval in hindsight is then picked from medians, which a single lucky run
cannot win.

Reported per schedule: goodput (the uninterrupted run's time over the run's wall time) of
every variant, the best fixed interval in hindsight (fixed and defaults), each auto's goodput
and its ratio to the best (target: at least 0.95) and to each framework default's (target:
above it); one summary line per schedule with PASS/MISS and the load average. ``--json``
writes every figure, ``--svg`` the plot of goodput against interval per schedule with auto
marked (default ``docs/assets/bench-interval.svg``; ``--replot`` redraws it from a JSON).
The defaults take about 15 minutes alone on a 2-core machine; ``--mtbfs 30 --intervals
1,10,100`` checks the script in two or three. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import random
import signal
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from html import escape
from pathlib import Path
from typing import Any

from _common import Moto, Weed, note
from bench_goodput import (
    Failure,
    Side,
    _stop,
    account,
    clean_up,
    job_env,
    run_side,
    start_store,
    view,
)
from taskpoint.runtime.interval import MTBF_PRIOR_S

MTBFS_S = (30.0, 120.0, 600.0)
"""The real-world mean times between failures of the three schedules (seconds)."""
LIGHTNING_EPOCH_STEPS = 1250
"""Steps in an epoch, for Lightning's default of a save every epoch: ImageNet-1k (1.28 M
images) at a global batch of 1024."""
TRAINER_SAVE_STEPS = 500
"""Hugging Face ``Trainer``'s default ``save_steps``."""
INTERVALS = (1, 3, 10, 30, 100, 300)
"""The fixed intervals (steps), about half a decade apart; the frameworks' defaults
add 500 steps and an epoch (past every run's end: a save at the end only)."""
KINDS = ("sigkill", "exception")
"""The failures drawn by default: those without a warning."""
ASSET = Path(__file__).resolve().parent.parent / "docs" / "assets" / "bench-interval.svg"


# -- the schedules (pure) -----------------------------------------------------------------


def run_steps(mtbf_s: float, failures: int, scale: float, step_s: float) -> int:
    """The length of a schedule's run in steps: ``failures`` mean times between failures
    of training (at least ``failures + 1`` steps, so each failure has a step of its own).

    Raises:
        ValueError: a figure is not positive (``failures`` may be 0: one MTBF of training).
    """
    for name, value in (("mtbf_s", mtbf_s), ("scale", scale), ("step_s", step_s)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number; got {value!r}")
    if failures < 0:
        raise ValueError(f"failures must be 0 or more; got {failures!r}")
    return max(failures + 1, round(max(failures, 1) * mtbf_s * scale / step_s))


def poisson_schedule(seed: int | str, failures: int, steps: int,
                     kinds: Sequence[str] = KINDS) -> list[Failure]:
    """``failures`` failures in a run of ``steps`` steps: the arrivals of a Poisson process
    over the run conditioned on their count (uniform draws, sorted), each at the step that
    holds it (rounded up; a failure that would share a step with the one before moves to
    the next), its kind drawn from ``kinds``. The same ``seed`` gives the same schedule.

    Raises:
        ValueError: ``steps`` leaves no room for the failures, or ``kinds`` is empty.
    """
    if failures < 0 or steps <= failures:
        raise ValueError(f"a run of {steps} steps has no room for {failures} failures")
    if not kinds:
        raise ValueError("kinds must name at least one kind of failure")
    rng = random.Random(str(seed))
    times = sorted(rng.random() for _ in range(failures))
    chosen: list[Failure] = []
    last = 0
    for index, t in enumerate(times):
        step = min(max(last + 1, math.ceil(t * steps)), steps - (failures - index))
        chosen.append(Failure(index, rng.choice(list(kinds)), step))
        last = step
    return chosen


@dataclass(frozen=True)
class Variant:
    """One way of saving in a schedule: ``label``, its ``group`` (``fixed``, ``default``,
    ``auto``), ``every`` steps (fixed and defaults) or ``every_s`` (``"auto"``), and for
    auto the prior, in scaled seconds."""

    label: str
    group: str
    every: int | None = None
    every_s: str | None = None
    prior_s: float | None = None

    def key(self, steps: int) -> str:
        """The run this variant is: variants with the same key share it."""
        if self.every is not None:
            return f"every-{min(self.every, steps)}"
        return self.label.replace("+", "-")


def variants(intervals: Sequence[int], autos: Sequence[str], mtbf_scaled_s: float,
             scale: float) -> list[Variant]:
    """The variants of a schedule: the fixed ``intervals``, the frameworks' defaults and
    the ``autos`` (``default``: the library's prior scaled; ``schedule``: the schedule's
    MTBF as the prior)."""
    out = [Variant(f"every {n}", "fixed", every=n) for n in intervals]
    out.append(Variant("Lightning: every epoch", "default", every=LIGHTNING_EPOCH_STEPS))
    out.append(Variant("Trainer: every 500 steps", "default", every=TRAINER_SAVE_STEPS))
    for which in autos:
        if which == "default":
            out.append(Variant("auto", "auto", every_s="auto", prior_s=MTBF_PRIOR_S * scale))
        elif which == "schedule":
            out.append(Variant("auto+prior", "auto", every_s="auto", prior_s=mtbf_scaled_s))
        else:
            raise ValueError(f"--autos takes default and/or schedule; got {which!r}")
    return out


def estimate_s(mtbfs: Sequence[float], intervals: Sequence[int], autos: Sequence[str],
               failures: int, scale: float, step_s: float, start_s: float) -> float:
    """About how long a sweep takes (seconds), if a life starts in ``start_s``: per
    schedule its reference run and each distinct run, ``failures + 1`` lives' starts and
    its steps (a fifth more for saves and recomputed steps)."""
    total = 0.0
    for mtbf in mtbfs:
        steps = run_steps(mtbf, failures, scale, step_s)
        runs = len({v.key(steps) for v in variants(intervals, autos, mtbf * scale, scale)})
        total += start_s + steps * step_s + runs * ((failures + 1) * start_s
                                                     + 1.2 * steps * step_s)
    return total


def verdict(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The schedule's targets from its ``rows`` (``label``, ``group``, ``goodput``; a row
    that failed has no goodput): the best fixed interval in hindsight (fixed and defaults),
    and per auto its ratio to the best (target >= 0.95) and whether it beats each default;
    with ``net_goodput`` in the rows, auto's net goodput over the best fixed one's too."""
    fixed = [r for r in rows if r["group"] in ("fixed", "default") and r.get("goodput")]
    best = max(fixed, key=lambda r: r["goodput"], default=None)
    best_net = max((r.get("net_goodput") or 0.0 for r in fixed), default=0.0)
    defaults = [r for r in rows if r["group"] == "default" and r.get("goodput")]
    autos: dict[str, Any] = {}
    for r in rows:
        if r["group"] != "auto" or not r.get("goodput"):
            continue
        ratio = r["goodput"] / best["goodput"] if best else None
        autos[r["label"]] = {
            "goodput": r["goodput"], "ratio_to_best": ratio,
            "within_5pct": ratio is not None and ratio >= 0.95,
            "above_defaults": {d["label"]: r["goodput"] > d["goodput"] for d in defaults},
            "ratio_to_defaults": {d["label"]: r["goodput"] / d["goodput"] for d in defaults},
            "net_ratio_to_best": (r["net_goodput"] / best_net
                                  if best_net and r.get("net_goodput") else None),
        }
    return {"best": None if best is None else {k: best[k] for k in ("label", "goodput")},
            "autos": autos}


NONE = "\u2013"  # an en dash: no figure


def _mtbf_text(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


def tables(results: dict[str, Any]) -> str:
    """The guide's two Markdown tables of ``results``: per schedule the best fixed
    interval, each auto against it and the defaults; then goodput per interval."""
    out = ["| MTBF (scaled) | best fixed (goodput) | auto | auto / best | auto+prior | / best "
           "| Lightning | Trainer | targets |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for sched in results["schedules"]:
        v = sched["verdict"]
        goodput = {r["label"]: r.get("goodput") for r in sched["rows"]}
        best = v["best"]
        cells = [f"{_mtbf_text(sched['mtbf_s'])} ({sched['mtbf_scaled_s']:.2g} s)",
                 NONE if best is None else f"{best['label']} ({best['goodput']:.3f})"]
        verdicts = []
        for label in ("auto", "auto+prior"):
            a = v["autos"].get(label)
            if a is None:
                cells += [NONE, NONE]
                continue
            cells += [f"{a['goodput']:.3f}", f"{a['ratio_to_best']:.2f}"]
            ok = a["within_5pct"] and all(a["above_defaults"].values())
            verdicts.append(f"{label} {'PASS' if ok else 'MISS'}")
        for label in ("Lightning: every epoch", "Trainer: every 500 steps"):
            cells.append(NONE if goodput.get(label) is None else f"{goodput[label]:.3f}")
        cells.append(", ".join(verdicts) or NONE)
        out.append("| " + " | ".join(cells) + " |")
    intervals = sorted({r["every_steps"] for s in results["schedules"] for r in s["rows"]
                        if r["group"] == "fixed" and r.get("every_steps")})
    head = [str(n) for n in intervals] + ["500 (Trainer)", "epoch (Lightning)", "auto",
                                          "auto+prior"]
    out += ["", "| MTBF | " + " | ".join(head) + " |",
            "| --- |" + " ---: |" * len(head)]
    for sched in results["schedules"]:
        by = {r["label"]: r for r in sched["rows"]}
        labels = [f"every {n}" for n in intervals] + [
            "Trainer: every 500 steps", "Lightning: every epoch", "auto", "auto+prior"]
        cells = []
        for label in labels:
            r = by.get(label, {})
            cells.append(NONE if r.get("goodput") is None else f"{r['goodput']:.3f}")
        out.append(f"| {_mtbf_text(sched['mtbf_s'])} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


# -- the plot (pure) ----------------------------------------------------------------------

_FIXED, _DEFAULT, _AUTO = "#3f51b5", "#f0883e", ("#2e7d32", "#c2185b")


def _ticks(lo: float, hi: float) -> list[float]:
    """Ticks at 1, 2 and 5 times the powers of ten between ``lo`` and ``hi``."""
    out = []
    for exp in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        out += [m * 10.0**exp for m in (1, 2, 5) if lo <= m * 10.0**exp <= hi]
    return out


def figure(results: dict[str, Any]) -> str:
    """Goodput against interval, one panel per schedule, as an SVG: the fixed intervals
    joined by a line (the best ringed), the frameworks' defaults as squares, each auto as a
    dashed line at its goodput and a diamond at its mean interval; the interval axis in
    seconds at real scale, logarithmic. ``results["note"]``, when set, heads the picture
    (e.g. that the figures are not yet measured)."""
    schedules = [s for s in results["schedules"] if any(r.get("goodput") for r in s["rows"])]
    panel_w, panel_h, left, top, gap = 300, 220, 54, 64, 40
    caption = results.get("caption", "")
    width = round(max(left + len(schedules) * (panel_w + gap) + 10, 60 + 6.2 * len(caption),
                      560))
    height = top + panel_h + 84
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    if results.get("note"):
        out.append(f'<text x="{left}" y="18" font-weight="bold" fill="#b00020">'
                   f'{escape(str(results["note"]))}</text>')
    legend = [("fixed interval", _FIXED), ("framework default", _DEFAULT),
              ("auto", _AUTO[0]), ("auto+prior", _AUTO[1])]
    x = left
    for name, colour in legend:
        out.append(f'<rect x="{x}" y="30" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{x + 14}" y="39">{escape(name)}</text>')
        x += 30 + 6.5 * len(name)
    for p, sched in enumerate(schedules):
        x0 = left + p * (panel_w + gap)
        rows = [r for r in sched["rows"] if r.get("goodput") and r.get("interval_s")]
        xs = [r["interval_s"] for r in rows]
        lo, hi = min(xs) / 1.5, max(xs) * 1.5
        goodputs = [r["goodput"] for r in rows]
        y_lo = max(0.0, math.floor((min(goodputs) - 0.02) * 20) / 20)
        y_hi = min(1.0, math.ceil((max(goodputs) + 0.02) * 20) / 20)
        if y_hi <= y_lo:
            y_lo, y_hi = max(0.0, y_lo - 0.05), min(1.0, y_hi + 0.05)

        def px(seconds: float, x0: float = x0, lo: float = lo, hi: float = hi) -> float:
            return x0 + panel_w * math.log(seconds / lo) / math.log(hi / lo)

        def py(goodput: float, y_lo: float = y_lo, y_hi: float = y_hi) -> float:
            return top + panel_h * (1 - (goodput - y_lo) / (y_hi - y_lo))

        out.append(f'<text x="{x0 + panel_w / 2}" y="{top - 8}" text-anchor="middle" '
                   f'font-weight="bold">{escape(sched["title"])}</text>')
        out.append(f'<rect x="{x0}" y="{top}" width="{panel_w}" height="{panel_h}" '
                   'fill="none" stroke="#999999"/>')
        for t in _ticks(lo, hi):
            out.append(f'<line x1="{px(t):.1f}" y1="{top}" x2="{px(t):.1f}" '
                       f'y2="{top + panel_h}" stroke="#eeeeee"/>')
            out.append(f'<text x="{px(t):.1f}" y="{top + panel_h + 14}" '
                       f'text-anchor="middle" fill="#555555">{t:g}</text>')
        for i in range(5):
            g = y_lo + (y_hi - y_lo) * i / 4
            out.append(f'<line x1="{x0}" y1="{py(g):.1f}" x2="{x0 + panel_w}" '
                       f'y2="{py(g):.1f}" stroke="#eeeeee"/>')
            out.append(f'<text x="{x0 - 4}" y="{py(g) + 4:.1f}" text-anchor="end" '
                       f'fill="#555555">{g:.2f}</text>')
        mtbf = sched["mtbf_s"]
        if lo <= mtbf <= hi:
            out.append(f'<line x1="{px(mtbf):.1f}" y1="{top}" x2="{px(mtbf):.1f}" '
                       f'y2="{top + panel_h}" stroke="#999999" stroke-dasharray="2,3"/>')
            out.append(f'<text x="{px(mtbf) + 3:.1f}" y="{top + 12}" fill="#777777">MTBF</text>')
        fixed = sorted((r for r in rows if r["group"] == "fixed"),
                       key=lambda r: r["interval_s"])
        points = " ".join(f"{px(r['interval_s']):.1f},{py(r['goodput']):.1f}" for r in fixed)
        out.append(f'<polyline points="{points}" fill="none" stroke="{_FIXED}"/>')
        best = (sched.get("verdict") or {}).get("best") or {}
        for r in rows:
            cx, cy = px(r["interval_s"]), py(r["goodput"])
            tip = (f"<title>{escape(r['label'])}: every {r['interval_s']:.3g} s, "
                   f"goodput {r['goodput']:.3f}</title>")
            if r["group"] == "fixed":
                out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3.5" fill="{_FIXED}">'
                           f"{tip}</circle>")
            elif r["group"] == "default":
                out.append(f'<rect x="{cx - 4:.1f}" y="{cy - 4:.1f}" width="8" height="8" '
                           f'fill="{_DEFAULT}">{tip}</rect>')
            else:
                colour = _AUTO[1] if r["label"] == "auto+prior" else _AUTO[0]
                out.append(f'<line x1="{x0}" y1="{cy:.1f}" x2="{x0 + panel_w}" y2="{cy:.1f}" '
                           f'stroke="{colour}" stroke-dasharray="5,4"/>')
                out.append(f'<path d="M{cx:.1f},{cy - 6:.1f} l6,6 l-6,6 l-6,-6 z" '
                           f'fill="{colour}">{tip}</path>')
                out.append(f'<text x="{x0 + panel_w - 4}" y="{cy - 4:.1f}" '
                           f'text-anchor="end" fill="{colour}">{escape(r["label"])}</text>')
            if r["label"] == best.get("label"):
                out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="7" fill="none" '
                           'stroke="#000000"/>')
        out.append(f'<text x="{x0 + panel_w / 2}" y="{top + panel_h + 30}" '
                   'text-anchor="middle" fill="#555555">interval between saves '
                   "(s at real scale, log)</text>")
    out.append(f'<text x="14" y="{top + panel_h / 2}" fill="#555555" '
               f'transform="rotate(-90 14 {top + panel_h / 2})" text-anchor="middle">'
               "goodput</text>")
    out.append(f'<text x="{left}" y="{height - 12}" fill="#555555">{escape(caption)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# -- running --------------------------------------------------------------------------------


def _auto_available() -> bool:
    """Whether the PyTorch adapter's ``save_sync`` takes ``every_s`` (saves by time)."""
    from taskpoint_pytorch import TaskpointState

    return "every_s" in inspect.signature(TaskpointState.save_sync).parameters


def _auto_choices(url: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    """The save intervals the run's attempts recorded (``every_s="auto"``'s choices), if
    the library records them."""
    from taskpoint.format.history import read_attempts
    from taskpoint.store.store import Store

    return [{"attempt": r.attempt, **r.interval} for r in read_attempts(Store(url, options))
            if getattr(r, "interval", None)]


def _row(variant: Variant, figures: dict[str, Any], steps: int, step_s: float,
         scale: float) -> dict[str, Any]:
    """One variant's figures: the goodput bench's accounting plus the interval (seconds at
    real scale: a fixed one's, auto's mean over the run's saves) and the net goodput: the
    uninterrupted run's time over itself plus what the interval decides (time blocked in
    saves, steps recomputed, steps slowed by uploads beside them), leaving out restarts,
    restores and the first start, which cost every interval the same but for noise."""
    b = figures["badput_s"]
    wall = figures["wall_s"]
    uninterrupted = figures["goodput"] * wall
    if variant.every is not None:
        every = min(variant.every, steps)
        interval = every * step_s / scale
    else:
        interval = steps * step_s / max(figures["saves"], 1) / scale
    return {
        "label": variant.label, "group": variant.group, "every_steps": variant.every,
        "every_s": variant.every_s, "prior_scaled_s": variant.prior_s,
        "interval_s": interval, "goodput": figures["goodput"],
        "net_goodput": uninterrupted / (uninterrupted + b["blocked"] + b["recomputed"]
                                        + max(0.0, figures["other_s"]["slower_steps"])),
        "wall_s": wall, "saves": figures["saves"], "badput_s": b,
        "lives": figures["lives"], "sha256": figures["sha256"],
        "failures": figures["failures"],
    }


def median_row(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One variant's figures over its repeated runs: each figure's median (goodput, net
    goodput, wall time, saves, each cause of badput, the interval), the runs' goodputs in
    ``goodputs``, its auto choices from every run; a run that failed makes the row failed,
    and the final weights must be the same in every run (else ``sha256`` is ``None``)."""
    failed = [r for r in runs if "error" in r]
    if failed or not runs:
        return failed[0] if failed else {"error": "no run"}
    first = runs[0]
    row = {**first}
    for key in ("goodput", "net_goodput", "wall_s", "interval_s"):
        row[key] = statistics.median(r[key] for r in runs)
    row["saves"] = round(statistics.median(r["saves"] for r in runs))
    row["badput_s"] = {cause: statistics.median(r["badput_s"][cause] for r in runs)
                       for cause in first["badput_s"]}
    row["goodputs"] = [r["goodput"] for r in runs]
    row["sha256"] = first["sha256"] if len({r["sha256"] for r in runs}) == 1 else None
    if any("auto_choices" in r for r in runs):
        row["auto_choices"] = [{**c, "repeat": i} for i, r in enumerate(runs)
                               for c in r.get("auto_choices", [])]
    return row


def _print_row(r: dict[str, Any], exact: bool) -> None:
    if "error" in r:
        note(f"{r['label']:<26} FAILED: {r['error']}")
        return
    b = r["badput_s"]
    note(f"{r['label']:<26} every {r['interval_s']:8.1f} s  goodput {r['goodput']:.3f}  "
         f"net {r['net_goodput']:.3f}  wall {r['wall_s']:6.1f} s  saves {r['saves']:4d}  "
         f"blocked {b['blocked']:5.1f}  recomputed {b['recomputed']:5.1f}  restart+restore "
         f"{b['restart'] + b['restore']:5.1f}  other {b['other']:+5.1f}"
         + ("" if exact else "  NOT EXACT")
         + (f"  (the run of {r['same_run_as']})" if r.get("same_run_as") else "")
         + (f"  (medians; goodputs {', '.join(f'{g:.3f}' for g in r['goodputs'])})"
            if len(r.get("goodputs", ())) > 1 else ""))
    for c in r.get("auto_choices", []):  # scaled seconds, as the library saw them
        note(f"{'':<28}attempt {c.get('attempt')} chose every {_num(c.get('interval_s'))} s "
             f"({c.get('rule')}): save cost {_num(c.get('save_cost_s'))} s, upload "
             f"{_num(c.get('upload_s'))} s, MTBF "
             f"{_num(c.get('mtbf_s'))} s from {c.get('failures')} failure(s) in "
             f"{_num(c.get('observed_s'))} s")


def _num(value: object) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) else "?"


def summary_line(sched: dict[str, Any], load: float) -> str:
    """One line for a schedule: best fixed, each auto against it and the defaults."""
    v = sched["verdict"]
    best = v["best"]
    head = (f"MTBF {sched['mtbf_s']:g} s ({sched['mtbf_scaled_s']:.2f} s scaled, "
            f"{len(sched['schedule'])} failure(s), {sched['steps']} steps): best fixed ")
    parts = [head + ("none" if best is None else f"{best['label']} {best['goodput']:.3f}")]
    if not v["autos"]:
        parts.append("auto not run")
    for label, a in v["autos"].items():
        ratio = a["ratio_to_best"]
        parts.append(f"{label} {a['goodput']:.3f} = "
                     + ("?" if ratio is None else f"{ratio:.2f}")
                     + f" of best {'PASS' if a['within_5pct'] else 'MISS'}"
                     + ("" if a.get("net_ratio_to_best") is None
                        else f" (net {a['net_ratio_to_best']:.2f})")
                     + ", "
                     + ", ".join(f"{x:.2f}x {d.split(':')[0]}"
                                 f" {'PASS' if a['above_defaults'][d] else 'MISS'}"
                                 for d, x in a["ratio_to_defaults"].items()))
    parts.append(f"load {load:.2f}")
    return "; ".join(parts)


def run_schedule(mtbf_s: float, args: argparse.Namespace, base: dict[str, str],
                 options: dict[str, Any], prefix: str, folder: Path,
                 auto_ok: bool) -> dict[str, Any]:
    """Run every variant of one schedule, after its uninterrupted reference."""
    mtbf_scaled = mtbf_s * args.scale
    steps = run_steps(mtbf_s, args.failures, args.scale, args.step_s)
    failures = poisson_schedule(f"{args.seed}:{mtbf_s:g}", args.failures, steps, args.kinds)
    limit = 60 + steps * args.step_s * 20
    title = f"MTBF {mtbf_s:g} s ({mtbf_scaled:.2f} s scaled)"
    print(f"\n{title}: {steps} steps ({steps * args.step_s:.1f} s of compute); failures "
          + ", ".join(f"{f.kind}@{f.step}" for f in failures), flush=True)
    reference = run_side(Side("none", 1), {**base, "BENCH_STEPS": str(steps)},
                         folder / "reference", [], args.grace, 0, limit)
    ref = view(reference.lives[-1])
    assert ref.end is not None
    start = min(t0 for t0, _ in ref.steps.values()) - ref.spawn
    autos = args.autos if auto_ok else []
    print(f"  uninterrupted run {ref.end - ref.spawn:.1f} s, {start:.1f} s of it the start; "
          f"at that, this schedule takes about "
          f"{args.repeats * estimate_s([mtbf_s], args.intervals, autos, args.failures, args.scale, args.step_s, start) / 60:.1f} min",
          flush=True)
    runs: dict[str, list[dict[str, Any]]] = {}  # per distinct run, one row per repeat
    distinct: dict[str, Variant] = {}  # a default past the run's end is a fixed interval's run
    for variant in variants(args.intervals, args.autos, mtbf_scaled, args.scale):
        if variant.group != "auto" or auto_ok:
            distinct.setdefault(variant.key(steps), variant)
    for repeat in range(args.repeats):  # round robin: a drift in the machine hits all alike
        order = list(distinct.items())
        if args.repeats > 1:  # and a pass's order is shuffled, seeded: no variant always last
            random.Random(f"{args.seed}:{mtbf_s:g}:{repeat}").shuffle(order)
            print(f"  repeat {repeat + 1} of {args.repeats}", flush=True)
        for key, variant in order:
            root = f"s3://bench/{prefix}/{mtbf_s:g}/{key}/{repeat}"
            env = {**base, "BENCH_STEPS": str(steps), "TASKPOINT_ROOT": root,
                   "TASKPOINT_ACTION": "train", "TASKPOINT_RUN_ID": "interval",
                   "TASKPOINT_GRACE_PERIOD": f"{args.grace:g}"}
            if variant.every_s is not None:
                env["BENCH_EVERY_S"] = variant.every_s
            if variant.prior_s is not None:
                env["TASKPOINT_MTBF_PRIOR_S"] = f"{variant.prior_s:g}"
            try:
                run = run_side(Side("taskpoint", variant.every or 1), env,
                               folder / key / str(repeat), failures, args.grace,
                               args.restart_delay, limit)
                row = _row(variant, account(run, ref), steps, args.step_s, args.scale)
                if variant.group == "auto":
                    row["auto_choices"] = _auto_choices(f"{root}/train/interval", options)
            except RuntimeError as exc:
                row = {"label": variant.label, "group": variant.group, "error": str(exc)}
            runs.setdefault(key, []).append(row)
            if args.repeats > 1:
                _print_row(row, row.get("sha256") == ref.sha256)
    if args.repeats > 1:
        print("  medians:", flush=True)
    rows: list[dict[str, Any]] = []
    done: dict[str, dict[str, Any]] = {}
    for variant in variants(args.intervals, args.autos, mtbf_scaled, args.scale):
        key = variant.key(steps)
        if variant.group == "auto" and not auto_ok:
            rows.append({"label": variant.label, "group": variant.group,
                         "error": "the adapter's save_sync takes no every_s yet"})
        elif key in done:
            rows.append({**done[key], "label": variant.label, "group": variant.group,
                         "every_steps": variant.every, "same_run_as": done[key]["label"]})
        else:
            row = median_row(runs[key])
            row.update(label=variant.label, group=variant.group)
            rows.append(row)
            done[key] = row
        _print_row(rows[-1], rows[-1].get("sha256") == ref.sha256)
    sched = {"mtbf_s": mtbf_s, "mtbf_scaled_s": mtbf_scaled, "steps": steps, "title": title,
             "schedule": [asdict(f) for f in failures],
             "uninterrupted_s": ref.end - ref.spawn, "reference_sha256": ref.sha256,
             "rows": rows}
    sched["verdict"] = verdict(rows)
    return sched


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive step counts; got {text!r}")
    return values


def _floats(text: str) -> list[float]:
    values = [float(x) for x in text.split(",") if x]
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"need positive seconds; got {text!r}")
    return values


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _caption(results: dict[str, Any]) -> str:
    a = results["args"]
    return (f"scale {a['scale']}: a step of {a['step_s']} s stands for "
            f"{float(a['step_s']) / float(a['scale']):g} s; {a['size_mb']} MiB of state; "
            f"{a['failures']} failures a schedule ({a['kinds']}); seed {a['seed']}; "
            f"load {results['load_start'][0]:.2f} at the start, "
            f"{results.get('load_end', [float('nan')])[0]:.2f} at the end")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mtbfs", type=_floats, default=list(MTBFS_S),
                        help="real mean times between failures (s), one schedule each")
    parser.add_argument("--scale", type=float, default=0.015,
                        help="seconds here per real second")
    parser.add_argument("--failures", type=int, default=3, help="failures per schedule")
    parser.add_argument("--kinds", type=_names, default=list(KINDS),
                        help="kinds of failure drawn: sigkill, exception, sigterm")
    parser.add_argument("--step-s", type=float, default=0.025, help="compute per step (s)")
    parser.add_argument("--size-mb", type=float, default=8, help="state size (MiB)")
    parser.add_argument("--intervals", type=_ints, default=list(INTERVALS),
                        help="fixed intervals, in steps")
    parser.add_argument("--autos", type=_names, default=["default", "schedule"],
                        help="auto's priors: default (the library's, scaled), schedule")
    parser.add_argument("--seed", type=int, default=0, help="seeds the schedules and the job")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each variant, round robin; medians are reported")
    parser.add_argument("--grace", type=float, default=30.0, help="SIGTERM's grace period (s)")
    parser.add_argument("--restart-delay", type=float, default=0.0, help="seconds")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--svg", type=Path, default=ASSET, help="write the plot here")
    parser.add_argument("--note", default="", help="a line heading the plot")
    parser.add_argument("--replot", type=Path, help="only redraw the plot from this JSON")
    parser.add_argument("--keep", action="store_true", help="keep the logs' folder")
    args = parser.parse_args()
    if args.replot:
        results = json.loads(args.replot.read_text())
        if args.note:
            results["note"] = args.note
        args.svg.write_text(figure(results))
        print(tables(results))
        print(f"plot written to {args.svg}")
        return
    if not set(args.kinds) <= {"sigkill", "exception", "sigterm"}:
        parser.error("--kinds takes sigkill, exception and/or sigterm")
    if not (0 < args.scale <= 1) or args.step_s <= 0 or args.failures < 0 or args.repeats < 1:
        parser.error("--scale must be in (0, 1], --step-s positive, --failures 0 or more, "
                     "--repeats 1 or more")
    signal.signal(signal.SIGTERM, _stop)
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} "
          f"{load_start[2]:.2f} ({os.cpu_count()} cores)", flush=True)
    auto_ok = _auto_available()
    if not auto_ok:
        print("the PyTorch adapter's save_sync takes no every_s: auto is not run", flush=True)
    print(f"scale {args.scale:g}: a step of {args.step_s:g} s stands for "
          f"{args.step_s / args.scale:g} s; an epoch is {LIGHTNING_EPOCH_STEPS} steps "
          f"({LIGHTNING_EPOCH_STEPS * args.step_s / args.scale / 60:.0f} min at real scale), "
          f"Trainer's default {TRAINER_SAVE_STEPS} steps "
          f"({TRAINER_SAVE_STEPS * args.step_s / args.scale / 60:.0f} min)", flush=True)
    guess = args.repeats * estimate_s(args.mtbfs, args.intervals, args.autos if auto_ok else [],
                       args.failures, args.scale, args.step_s, 4.0)
    print(f"expect about {guess / 60:.0f} min if a life starts in 4 s (each schedule's "
          "reference run tells)", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="tp-bench-interval-"))
    server: Weed | Moto | None = None
    results: dict[str, Any] = {"args": {k: ",".join(map(str, v)) if isinstance(v, list)
                                        else str(v) for k, v in vars(args).items()},
                               "load_start": load_start, "schedules": [],
                               "note": args.note}
    started = time.time()
    try:
        server = start_store()
        print(f"store s3:// ({server.name} on 127.0.0.1); state {args.size_mb:g} MiB",
              flush=True)
        base = job_env(server, args.size_mb, args.step_s, args.seed)
        prefix = uuid.uuid4().hex[:8]
        lines: list[str] = []
        for mtbf in args.mtbfs:
            sched = run_schedule(mtbf, args, base, server.options, prefix,
                                 folder / f"{mtbf:g}", auto_ok)
            load = os.getloadavg()[0]
            sched["load_end"] = load
            results["schedules"].append(sched)
            lines.append(summary_line(sched, load))
            fixed = [r for r in sched["rows"] if r.get("saves") and r["group"] == "fixed"]
            if fixed:  # the final wait for the last upload weighs least where saves are most
                most = max(fixed, key=lambda r: r["saves"])
                cost = most["badput_s"]["blocked"] / most["saves"]
                sched["blocked_per_save_s"] = cost
                print(f"  a save blocked training {cost * 1000:.0f} ms ({most['label']}'s "
                      f"blocked time over its saves, the final wait for the last upload "
                      f"included; {cost / args.scale:.1f} s at real scale)", flush=True)
            measured = [c["save_cost_s"] for r in sched["rows"] for c in r.get("auto_choices", [])
                        if isinstance(c.get("save_cost_s"), (int, float))]
            if measured:  # the library's own figure: blocked plus the upload's drag on steps
                cost = statistics.median(measured)
                sched["auto_save_cost_s"] = cost
                print(f"  auto measured a save's cost at {cost * 1000:.0f} ms (median of its "
                      f"choices; {cost / args.scale:.1f} s at real scale)", flush=True)
        load_end = os.getloadavg()
        results["load_end"] = load_end
        results["duration_s"] = time.time() - started
        results["caption"] = _caption(results)
        print("", flush=True)
        for line in lines:
            print(line, flush=True)
        print(f"load average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}; "
              f"the sweep took {results['duration_s'] / 60:.1f} min", flush=True)
        print("\nfor docs/benchmarks.md:\n" + tables(results), flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))
        args.svg.write_text(figure(results))
        print(f"plot written to {args.svg}", flush=True)
    finally:
        clean_up(server, folder, keep=args.keep)


if __name__ == "__main__":
    main()
