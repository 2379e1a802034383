"""A child process for the preemption tests: trains TinyModule, mirroring every 3 steps, and
signals or fails itself at a step of its first attempt.

Usage: python preempt_script.py OUT [--task] [--sigterm-at STEP]
[--sigterm-rank R] [--fail-at STEP [--fail-rank R]] [--exit-hard] [--kill-group-at STEP]
[--step-sleep SECONDS] [--slow-uploads SECONDS] [--devices N] [--every STEPS] [--reference].

``--task`` trains inside ``@env.task(isolation="process", retries=$TP_RETRIES)`` of an
environment rooted at ``$TP_ROOT`` (action ``lt.train_task/r1``): each attempt is a process
of its own, and the runner writes the attempt records. Without it, the checkpoint is the environment contract's
(``TASKPOINT_ROOT``/``TASKPOINT_ACTION``/``TASKPOINT_RUN_ID``/``TASKPOINT_ATTEMPT``, set by the
test), and with ``--devices 2`` Lightning starts the second rank (DDP, gloo, CPU), or, under
``torchrun --nproc_per_node=2``, joins torchrun's. ``--every`` sets the save interval in
steps (default 3); ``--reference`` trains uninterrupted without a checkpoint or a store.

At the start of the batch after ``STEP`` of an attempt that did not resume:
``--sigterm-at`` sends SIGTERM to the process (on global rank ``R`` only, with
``--sigterm-rank``), ``--fail-at`` raises (on rank ``R`` only, with ``--fail-rank``; with
``--exit-hard`` the process then ends with ``os._exit(3)`` as soon as ``fit`` raises),
``--kill-group-at`` SIGKILLs the process group (the upload process with it, as a lost
machine would). ``--step-sleep`` makes each step
take that long and ``--slow-uploads`` makes every upload after the first stall that long (both
in the first attempt only).
Global rank zero writes the final weights to OUT (rank R > 0 to ``OUT`` with ``-rankR``
before its suffix); every rank of an attempt prints ``STARTED <epoch> <step> rank <R>``, and
``ENDED <step> rank <R> <exception type>`` when training ends on an exception, and a rank
that signals itself ``SIGNALLED <unix time> rank <R>`` just before; the rank
that fails with ``--fail-at`` first prints ``COMMITTED <steps> rank <R>``, the steps of the
checkpoints in the store at that moment.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import lightning as L
import taskpoint
import testlib as lib
import torch
from taskpoint_lightning import TaskpointModelCheckpoint, resume_ckpt_path


class Trigger(L.Callback):
    """Signals, raises or kills at the start of the batch after ``step``, once."""

    def __init__(self, args: argparse.Namespace, checkpoint: taskpoint.Checkpoint | None) -> None:
        self.args, self.checkpoint = args, checkpoint

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        args, step = self.args, trainer.global_step
        if trainer.ckpt_path is not None:
            return  # a resumed attempt runs to the end, at full speed
        if step == args.kill_group_at:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        if step == args.fail_at and args.fail_rank in (None, trainer.global_rank):
            if self.checkpoint is not None:
                steps = sorted(m.step for m in self.checkpoint.committed())
                say("COMMITTED", *steps, "rank", trainer.global_rank)
            raise lib.Planned(f"planned failure at step {step}")
        if step == args.sigterm_at and args.sigterm_rank in (None, trainer.global_rank):
            say("SIGNALLED", time.time(), "rank", trainer.global_rank)
            os.kill(os.getpid(), signal.SIGTERM)
        if args.step_sleep:
            time.sleep(args.step_sleep)


def say(*words: object) -> None:
    """Print one line in one write, starting on a line of its own: the ranks share the
    pipe, and print() may hand it a line in pieces that another rank's interleave."""
    sys.stdout.flush()
    os.write(1, ("\n" + " ".join(map(str, words)) + "\n").encode())


class Report(L.Callback):
    """Prints where each rank started and, on an exception, where it ended."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        say("STARTED", trainer.current_epoch, trainer.global_step, "rank", trainer.global_rank)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        say("ENDED", trainer.global_step, "rank", trainer.global_rank, type(exception).__name__)


class SlowUploads:
    """A ``progress=`` callback: every upload after the first commit stalls ``seconds``."""

    def __init__(self, store: str, seconds: float) -> None:
        self.store, self.seconds = Path(store.removeprefix("file://")), seconds
        self._stalled_at = 0

    def __call__(self, moved: int) -> None:
        commits = len(list((self.store / "checkpoints").glob("*.manifest.json")))
        if commits > self._stalled_at:
            self._stalled_at = commits
            time.sleep(self.seconds)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--task", action="store_true")
    parser.add_argument("--sigterm-at", type=int, default=None)
    parser.add_argument("--sigterm-rank", type=int, default=None)
    parser.add_argument("--fail-at", type=int, default=None)
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--exit-hard", action="store_true")
    parser.add_argument("--kill-group-at", type=int, default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--slow-uploads", type=float, default=None)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--reference", action="store_true")
    return parser.parse_args()


def train(argv: list[str]) -> dict[str, torch.Tensor]:
    """One attempt: resume from the store, train to the end (or the trigger)."""
    sys.argv[1:] = argv  # (in a process-isolated attempt, for arguments())
    args = arguments()
    L.seed_everything(0)
    model = lib.TinyModule()
    extra = {"devices": args.devices, "strategy": "ddp"} if args.devices > 1 else {}
    workdir = Path(args.out).parent / "work"  # (both ranks: Lightning uses rank 0's dirpath)
    loader = lib.loader("shuffle" if args.devices > 1 else "resumable")
    if args.reference:
        trainer = lib.trainer(
            [Report()], default_root_dir=workdir, enable_checkpointing=False, **extra
        )
        trainer.fit(model, loader)
        return {k: v.cpu() for k, v in lib.weights(model).items()}
    context = taskpoint.ctx()
    assert context is not None and context.checkpoint is not None, "no taskpoint context"
    ckpt: taskpoint.Checkpoint = context.checkpoint
    if args.slow_uploads and context.attempt == 0:
        ckpt = taskpoint.Checkpoint(
            ckpt.url, attempt=context.attempt, progress=SlowUploads(ckpt.url, args.slow_uploads)
        )
    dirpath = workdir / "ckpts"
    mc = TaskpointModelCheckpoint(
        ckpt, dirpath=dirpath, save_last=True, every_n_train_steps=args.every
    )
    trainer = lib.trainer([Trigger(args, ckpt), Report(), mc], default_root_dir=workdir, **extra)
    try:
        trainer.fit(model, loader, ckpt_path=resume_ckpt_path(ckpt, dirpath=dirpath))
    except BaseException:
        if args.exit_hard:  # as a launcher tearing the process down at once would
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(3)
        raise
    return {k: v.cpu() for k, v in lib.weights(model).items()}


# The task is a module attribute: a process-isolated attempt imports it from this file.
env = taskpoint.TaskEnvironment(name="lt", root=os.environ.get("TP_ROOT"), run_id="r1")


@env.task(retries=int(os.environ.get("TP_RETRIES", "1")), backoff=0.0, isolation="process")
def train_task(argv: list[str]) -> dict[str, torch.Tensor]:
    return train(argv)


def main() -> None:
    args = arguments()
    weights = train_task(sys.argv[1:]) if args.task else train(sys.argv[1:])
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    out = args.out if rank == 0 else args.out.with_stem(f"{args.out.stem}-rank{rank}")
    torch.save(weights, out)
    lib.exit_now()


if __name__ == "__main__":
    main()
