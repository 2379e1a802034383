"""One node's process for the two-node tests (``test_nodes.py``), started by torchrun.

Usage: torchrun --nnodes=2 --node_rank=K ... nodes_script.py STORE_URL RESULTS
[--reference] [--kill-at N] [--fail-restore] [--fsdp [--gpu]]. Trains TinyModule with DDP on 2
nodes x 1 CPU process (``--fsdp``: ShardedModule with ``FSDPStrategy(state_dict_type=
"sharded")``, each rank writing its own shard files; ``--gpu``: on the node's GPU, with
Lightning's own FSDPStrategy and wrapping), its ``dirpath`` ("ckpts") relative to the node's own working
directory, mirroring after each epoch and resuming from the store; ``--reference`` trains
uninterrupted without a store. Every rank writes its final state (DDP: weights; FSDP: the
gathered weights and optimizer state) to ``RESULTS/<run>-rank<R>.pt`` and prints
``rank R: STARTED <epoch> <step>``; ``--kill-at`` makes every rank die at that global step
(once the mirror in flight has committed). ``--fail-restore`` makes the restore fail on
node 1 (its store read raises). An error in ``resume_ckpt_path`` is printed as
``rank R: error after <seconds>s: ...`` before exiting with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
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
    parser.add_argument("results", type=Path)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--fail-restore", action="store_true")
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    args.results.mkdir(parents=True, exist_ok=True)

    L.seed_everything(0)
    model = (lib.ShardedModule if args.fsdp else lib.TinyModule)(kill_at=args.kill_at)
    callbacks: list[object] = []
    ckpt_path = None
    if not args.reference:
        ckpt = Checkpoint(args.store)
        mc = TaskpointModelCheckpoint(ckpt, dirpath="ckpts", save_last=True, every_n_epochs=1)
        model.before_kill = mc.wait
        callbacks.append(mc)
        if args.fail_restore and int(os.environ["GROUP_RANK"]) == 1:
            def unreadable(**kwargs: object) -> None:
                raise OSError("simulated: node 1 cannot read the store")
            ckpt.load_sync = unreadable  # type: ignore[method-assign]
        started = time.monotonic()
        try:
            ckpt_path = resume_ckpt_path(ckpt, dirpath="ckpts", timeout=60)
        except Exception as exc:
            traceback.print_exc()
            print(
                f"rank {rank}: error after {time.monotonic() - started:.1f}s: "
                f"{type(exc).__name__}: {exc}",
                flush=True,
            )
            sys.exit(1)
    trainer = lib.trainer(
        callbacks, default_root_dir=".", num_nodes=2, devices=1,
        strategy=lib.fsdp_strategy(gpu=args.gpu) if args.fsdp else "ddp",
        accelerator="gpu" if args.gpu else "cpu",
        enable_checkpointing=not args.reference,
    )
    trainer.fit(model, lib.loader("shuffle"), ckpt_path=ckpt_path)
    assert model.started_at is not None
    name = "reference" if args.reference else "run"
    state = lib.full_state(model) if args.fsdp else lib.weights(model)
    torch.save(state, args.results / f"{name}-rank{rank}.pt")
    print(f"rank {rank}: STARTED", *model.started_at, flush=True)
    lib.exit_now()


if __name__ == "__main__":
    main()
