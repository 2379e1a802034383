"""The save-interval sweep's pure parts (``bench/bench_interval.py``): its failure schedules,
its verdicts and its plot. The sweep itself is a benchmark, run by hand."""

from __future__ import annotations

import importlib.util
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_interval", BENCH / "bench_interval.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_interval"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def test_a_schedule_is_its_seeds_and_every_failure_has_its_own_step(sweep: ModuleType) -> None:
    first = sweep.poisson_schedule("0:30", 3, 72)
    assert first == sweep.poisson_schedule("0:30", 3, 72)
    assert first != sweep.poisson_schedule("1:30", 3, 72)
    for seed in range(200):  # crowded runs: draws often share a step
        failures = sweep.poisson_schedule(seed, 8, 10)
        steps = [f.step for f in failures]
        assert len(steps) == 8 and steps == sorted(set(steps)), steps
        assert steps[0] >= 1 and steps[-1] <= 9
        assert {f.kind for f in failures} <= set(sweep.KINDS)
        assert [f.index for f in failures] == list(range(8))
    with pytest.raises(ValueError, match="no room"):
        sweep.poisson_schedule(0, 5, 5)
    with pytest.raises(ValueError, match="kinds"):
        sweep.poisson_schedule(0, 1, 5, kinds=())


def test_failures_fall_as_a_poisson_process_given_its_count(sweep: ModuleType) -> None:
    """Given K arrivals over a run, a Poisson process's k-th falls at k/(K+1) of it on
    average, and its gaps are alike."""
    draws = [sweep.poisson_schedule(seed, 4, 100_000) for seed in range(3000)]
    for k in range(4):
        mean = statistics.mean(d[k].step for d in draws)
        assert mean == pytest.approx(100_000 * (k + 1) / 5, rel=0.03)
    kinds = [f.kind for d in draws for f in d]
    assert 0.45 < kinds.count("sigkill") / len(kinds) < 0.55


def test_a_run_lasts_its_failures_mean_times_between_failures(sweep: ModuleType) -> None:
    assert sweep.run_steps(30, 3, 0.02, 0.025) == 72  # 3 x 30 s x 0.02 / 25 ms
    assert sweep.run_steps(600, 3, 0.02, 0.025) == 1440
    assert sweep.run_steps(1, 3, 0.01, 1.0) == 4  # always a step per failure and one more
    with pytest.raises(ValueError, match="scale"):
        sweep.run_steps(30, 3, 0, 0.025)


def test_intervals_past_the_run_are_one_run(sweep: ModuleType) -> None:
    chosen = sweep.variants([1, 100, 1000], ["default", "schedule"], 0.6, 0.02)
    keys = {v.label: v.key(72) for v in chosen}
    assert keys["every 100"] == keys["every 1000"] == keys["Lightning: every epoch"]
    assert keys["Trainer: every 500 steps"] == keys["every 100"]
    assert keys["every 1"] != keys["every 100"]
    autos = {v.label: v for v in chosen if v.group == "auto"}
    assert autos["auto"].prior_s == pytest.approx(4 * 3600 * 0.02)
    assert autos["auto+prior"].prior_s == 0.6
    assert len({keys["auto"], keys["auto+prior"]}) == 2
    with pytest.raises(ValueError, match="autos"):
        sweep.variants([1], ["sometimes"], 0.6, 0.02)


def _rows() -> list[dict[str, Any]]:
    return [
        {"label": "every 1", "group": "fixed", "goodput": 0.50, "interval_s": 1.25},
        {"label": "every 10", "group": "fixed", "goodput": 0.60, "interval_s": 12.5},
        {"label": "every 100", "group": "fixed", "goodput": 0.40, "interval_s": 90.0},
        {"label": "Lightning: every epoch", "group": "default", "goodput": 0.40,
         "interval_s": 90.0},
        {"label": "Trainer: every 500 steps", "group": "default", "goodput": 0.40,
         "interval_s": 90.0},
        {"label": "auto", "group": "auto", "goodput": 0.58, "interval_s": 9.0},
        {"label": "auto+prior", "group": "auto", "goodput": 0.55, "interval_s": 5.0},
        {"label": "broken", "group": "fixed", "error": "no life finished"},
    ]


def test_the_verdict_compares_auto_with_the_best_in_hindsight(sweep: ModuleType) -> None:
    verdict = sweep.verdict(_rows())
    assert verdict["best"] == {"label": "every 10", "goodput": 0.60}
    auto, prior = verdict["autos"]["auto"], verdict["autos"]["auto+prior"]
    assert auto["ratio_to_best"] == pytest.approx(0.58 / 0.60) and auto["within_5pct"]
    assert prior["ratio_to_best"] == pytest.approx(0.55 / 0.60) and not prior["within_5pct"]
    assert all(auto["above_defaults"].values()) and len(auto["above_defaults"]) == 2
    line = sweep.summary_line({"mtbf_s": 30, "mtbf_scaled_s": 0.6, "schedule": [{}] * 3,
                               "steps": 72, "verdict": verdict}, 1.5)
    assert "best fixed every 10 0.600" in line and "0.97 of best PASS" in line
    assert "0.92 of best MISS" in line and "load 1.50" in line


def test_the_plot_marks_auto_in_every_schedule(sweep: ModuleType) -> None:
    schedules = [
        {"mtbf_s": m, "title": f"MTBF {m} s", "rows": _rows(),
         "verdict": sweep.verdict(_rows())}
        for m in (30, 120)
    ]
    svg = sweep.figure({"schedules": schedules, "note": "not yet measured",
                        "caption": "scale 0.02"})
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    texts = [t.text for t in root.iter(f"{ns}text")]
    assert "not yet measured" in texts and "MTBF 30 s" in texts and "MTBF 120 s" in texts
    diamonds = [p for p in root.iter(f"{ns}path")]
    assert len(diamonds) == 4  # two autos in each of two panels
    titles = [t.text or "" for p in diamonds for t in p.iter(f"{ns}title")]
    assert sum("auto:" in t for t in titles) == 2
    assert len(list(root.iter(f"{ns}polyline"))) == 2  # one line of fixed intervals a panel


def test_the_tables_are_ready_for_the_guide(sweep: ModuleType) -> None:
    rows = [{**r, "every_steps": int(r["label"].split()[1])} if r["group"] == "fixed"
            and "error" not in r else r for r in _rows()]
    schedules = [{"mtbf_s": m, "mtbf_scaled_s": m * 0.015, "rows": rows,
                  "verdict": sweep.verdict(rows)} for m in (30, 600)]
    text = sweep.tables({"schedules": schedules})
    lines = text.splitlines()
    assert lines[2].startswith("| 30 s (0.45 s) | every 10 (0.600) | 0.580 | 0.97 | 0.550 | 0.92 |")
    assert lines[2].endswith("| 0.400 | 0.400 | auto PASS, auto+prior MISS |")
    assert lines[3].startswith("| 10 min (9 s) |")
    assert lines[5].startswith("| MTBF | 1 | 10 | 100 | 500 (Trainer) | epoch (Lightning) |")
    assert lines[7] == ("| 30 s | 0.500 | 0.600 | 0.400 | 0.400 | 0.400 | 0.580 | 0.550 |")


def test_repeated_runs_report_medians(sweep: ModuleType) -> None:
    def run(goodput: float, blocked: float, sha: str = "same") -> dict[str, object]:
        return {"label": "every 3", "group": "fixed", "goodput": goodput,
                "net_goodput": goodput * 2, "wall_s": 10 / goodput, "interval_s": 5.0,
                "saves": 40, "badput_s": {"blocked": blocked, "restart": 1.0},
                "sha256": sha}

    row = sweep.median_row([run(0.20, 0.5), run(0.17, 0.1), run(0.19, 0.9)])
    assert row["goodput"] == pytest.approx(0.19)
    assert row["goodputs"] == [0.20, 0.17, 0.19]
    assert row["badput_s"] == {"blocked": pytest.approx(0.5), "restart": 1.0}
    assert row["sha256"] == "same"
    assert sweep.median_row([run(0.2, 0.1), run(0.2, 0.1, "other")])["sha256"] is None
    failed = {"label": "every 3", "group": "fixed", "error": "boom"}
    assert sweep.median_row([run(0.2, 0.1), failed]) == failed
    assert sweep.median_row([run(0.2, 0.1)])["goodputs"] == [0.2]
