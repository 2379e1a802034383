"""A child process for the tests: trains TinyModule against a store, resuming from it.

Usage: python train_script.py STORE_URL WORKDIR OUT [--mode step|epoch] [--kill-at N]
[--devices N] [--strategy ddp|ddp_spawn] [--log FILE] [--slow-upload MARKER:SECONDS]
[--max-epochs N]. Dies with os._exit(137) at
global step N when asked, once the mirror in flight has committed; writes the final
weights to OUT (global rank zero) and prints ``STARTED <epoch> <step>``. ``--slow-upload``
mirrors to a plain ``taskpoint.Checkpoint`` (``STORE_URL`` a ``file://`` URL) whose second
upload creates the file MARKER, then stalls for SECONDS. ``--strategy ddp_spawn`` mirrors to
a plain ``taskpoint.Checkpoint``, which Lightning pickles into the workers it spawns; rank
zero's worker prints the ``STARTED`` line then.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning as L
import testlib as lib
import torch
from taskpoint import Checkpoint
from taskpoint_lightning import TaskpointModelCheckpoint, resume_ckpt_path


class ReportStart(L.Callback):
    """Prints ``STARTED <epoch> <step>`` from global rank zero as training starts."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            print("STARTED", trainer.current_epoch, trainer.global_step, flush=True)


class CountSaves(L.Callback):
    """Prints ``TORCH_SAVES <rank> <n>`` at the end: how often this rank called
    ``torch.save`` while training. Only the rank writing checkpoints should."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        real = torch.save
        self.count = 0

        def counting(*args: object, **kwargs: object) -> object:
            self.count += 1
            return real(*args, **kwargs)  # type: ignore[arg-type]

        torch.save = counting  # type: ignore[assignment]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # One write, starting on a line of its own: the spawned ranks share this pipe, and
        # print() may hand the pipe a line in several pieces that the other rank's interleave.
        sys.stdout.flush()
        os.write(1, f"\nTORCH_SAVES {trainer.global_rank} {self.count}\n".encode())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("workdir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--mode", choices=["step", "epoch"], default="step")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--log", default=None)
    parser.add_argument("--slow-upload", default=None)
    parser.add_argument("--strategy", choices=["ddp", "ddp_spawn"], default="ddp")
    parser.add_argument("--max-epochs", type=int, default=5)
    args = parser.parse_args()

    if args.slow_upload:
        slow = lib.SlowUpload(args.store.removeprefix("file://"), *args.slow_upload.split(":"))
        ckpt = Checkpoint(args.store, progress=slow)
    elif args.strategy == "ddp_spawn":
        ckpt = Checkpoint(args.store)
    else:
        ckpt = lib.RecordingCheckpoint(Checkpoint(args.store), args.log)
    dirpath = args.workdir / "ckpts"
    L.seed_everything(0)
    model = lib.TinyModule(kill_at=args.kill_at)
    every = {"every_n_epochs": 1} if args.mode == "epoch" else {"every_n_train_steps": 3}
    mc = TaskpointModelCheckpoint(ckpt, dirpath=dirpath, save_last=True, **every)
    model.before_kill = mc.wait  # mirrors upload in the background: die between two
    extra = {"devices": args.devices, "strategy": args.strategy} if args.devices > 1 else {}
    spawn = args.strategy == "ddp_spawn"
    callbacks = [mc, ReportStart(), CountSaves()] if spawn else [mc]
    trainer = lib.trainer(
        callbacks, max_epochs=args.max_epochs, default_root_dir=args.workdir, **extra
    )
    loader = lib.loader("shuffle" if args.devices > 1 else "resumable")
    trainer.fit(model, loader, ckpt_path=resume_ckpt_path(ckpt, dirpath=dirpath))
    if trainer.is_global_zero:
        torch.save(lib.weights(model), args.out)
        if not spawn:  # (spawned, the workers trained and ReportStart printed)
            assert model.started_at is not None
            print("STARTED", *model.started_at, "RESUMED", trainer.ckpt_path, flush=True)
    lib.exit_now()


if __name__ == "__main__":
    main()
