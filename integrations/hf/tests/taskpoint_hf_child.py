"""A training process for the tests that need real processes (killed runs, ``torchrun``).

    python taskpoint_hf_child.py --store URL --work DIR --recipes classifier,sft
        [--reference] [--stop RECIPE:STEP:EVENT[:HOW]] [--sigterm RECIPE:STEP]
        [--set KEY=INT ...] [--slow-upload MARKER:SECONDS] [--plain] [--pause STEP:SECONDS]

Runs each recipe in order against the checkpoint ``URL/<recipe>`` (a new attempt per
process), writing ``DIR/results/<recipe>-rank<R>.pt`` when it finishes; a recipe whose
result exists is skipped, so running the same command again continues where a killed
process stopped. ``--stop`` makes the process die (``os._exit(137)``) at that step and event
(``step_end`` or ``save``) unless a result exists; under torchrun only the highest rank
dies, as one failing worker would. ``HOW`` ``raise`` raises instead and ``kill`` sends the
process SIGKILL, both without waiting for the upload in flight first. ``--sigterm`` sends
the highest rank SIGTERM at the end of that step (training goes on). ``--pause`` sleeps
``SECONDS`` at the end of every step from ``STEP`` on. ``--reference`` first runs each recipe uninterrupted,
without any checkpoint. Each rank logs every checkpoint save and load it makes to
``DIR/calls-rank<R>.jsonl``. ``--plain`` saves to a plain ``taskpoint.Checkpoint`` instead (background uploads;
under torchrun every rank's part of one multi-writer commit); ``--slow-upload`` too
(``--store`` must be a ``file://`` URL), whose second upload creates the file ``MARKER``,
then stalls for ``SECONDS``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--recipes", required=True)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--stop", default=None)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--slow-upload", default=None)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--sigterm", default=None)
    parser.add_argument("--pause", default=None)
    parser.add_argument("--save-on-exception", action="store_true")
    opts = parser.parse_args()

    torch.set_num_threads(1)
    import taskpoint
    import taskpoint_hf_testkit as kit

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    overrides = {k: int(v) for k, v in (item.split("=", 1) for item in opts.set)}
    results = opts.work / "results"
    results.mkdir(parents=True, exist_ok=True)
    recipes = opts.recipes.split(",")

    if opts.reference:
        for name in recipes:
            ref = kit.RECIPES[name](None, opts.work / f"{name}-reference", **overrides)
            torch.save(ref.to_dict(), results / f"{name}-reference-rank{rank}.pt")

    stop_recipe, stop_step, stop_event, *stop_how = (
        opts.stop.split(":") if opts.stop else ("", "0", "")
    )
    signal_recipe, signal_step = opts.sigterm.split(":") if opts.sigterm else ("", "0")
    for name in recipes:
        done = results / f"{name}-rank{rank}.pt"
        if done.exists():
            continue
        stop = None
        if name == stop_recipe and rank == world - 1:
            how = stop_how[0] if stop_how else "exit"
            stop = kit.StopAt(int(stop_step), how=how, event=stop_event, settle=how == "exit")
        callbacks: list[object] = []
        if name == signal_recipe and rank == world - 1:
            callbacks.append(kit.SignalAt(int(signal_step)))
        if opts.pause:
            step, seconds = opts.pause.split(":")
            callbacks.append(kit.Pause(int(step), float(seconds)))
        if opts.slow_upload:
            url = f"{opts.store}/{name}"
            slow = kit.SlowUpload(url.removeprefix("file://"), *opts.slow_upload.split(":"))
            checkpoint = taskpoint.Checkpoint(url, progress=slow)
        elif opts.plain:
            checkpoint = taskpoint.Checkpoint(f"{opts.store}/{name}")
        else:
            checkpoint = kit.RecordingCheckpoint(
                taskpoint.Checkpoint(f"{opts.store}/{name}"), opts.work / f"calls-rank{rank}.jsonl",
                rank,
            )
        result = kit.RECIPES[name](
            checkpoint, opts.work / name, stop=stop, callbacks=callbacks,
            callback_options={"save_on_exception": True} if opts.save_on_exception else None,
            **overrides,
        )
        print(f"rank {rank}: {name} resumed from {result.resumed_from}", flush=True)
        torch.save(result.to_dict(), done)


if __name__ == "__main__":
    code = main()
    import taskpoint_hf_testkit as kit

    kit.end_process_group()
    sys.exit(code)
