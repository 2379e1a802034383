"""A child process for the tests: trains TinyModule against a store, resuming from it.

Usage: python train_script.py STORE_URL WORKDIR OUT [--mode step|epoch] [--kill-at N]
[--devices N] [--log FILE]. Dies with os._exit(137) at global step N when asked; writes
the final weights to OUT (global rank zero) and prints ``STARTED <epoch> <step>``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning as L
import testlib as lib
import torch
from taskpoint import Checkpoint
from taskpoint_lightning import TaskpointModelCheckpoint, resume_ckpt_path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("workdir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--mode", choices=["step", "epoch"], default="step")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--log", default=None)
    args = parser.parse_args()

    ckpt = lib.RecordingCheckpoint(Checkpoint(args.store), args.log)
    dirpath = args.workdir / "ckpts"
    L.seed_everything(0)
    model = lib.TinyModule(kill_at=args.kill_at)
    every = {"every_n_epochs": 1} if args.mode == "epoch" else {"every_n_train_steps": 3}
    mc = TaskpointModelCheckpoint(ckpt, dirpath=dirpath, save_last=True, **every)
    extra = {"devices": args.devices, "strategy": "ddp"} if args.devices > 1 else {}
    trainer = lib.trainer([mc], default_root_dir=args.workdir, **extra)
    loader = lib.loader("shuffle" if args.devices > 1 else "resumable")
    trainer.fit(model, loader, ckpt_path=resume_ckpt_path(ckpt, dirpath=dirpath))
    if trainer.is_global_zero:
        assert model.started_at is not None
        torch.save(lib.weights(model), args.out)
        print("STARTED", *model.started_at, "RESUMED", trainer.ckpt_path, flush=True)


if __name__ == "__main__":
    main()
