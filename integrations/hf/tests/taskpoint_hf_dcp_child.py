"""One rank of the DCP selection tests (``test_selection.py``), a "node" of its own.

    torchrun --standalone --nproc_per_node=W taskpoint_hf_dcp_child.py --store URL
        --root DIR (--save | --restore [--flyte-like])

Rank ``R`` works in ``DIR/node<R>/out`` (no two ranks share a disk). ``--save`` writes
``checkpoint-4`` there as an FSDP Trainer with ``SHARDED_STATE_DICT`` and
``save_on_each_node=False`` would: ``dcp.save`` over a gloo group of :func:`model_state`
into ``pytorch_model_fsdp_0`` (a tensor sharded by rows as a DTensor, plus a replicated
tensor and a number, which DCP's planner stores once, in one rank's file) and of
:func:`optimizer_state` into ``optimizer_0`` (sharded only), this rank's
``rng_state_<R>.pth``, and on rank 0 ``trainer_state.json`` and ``config.json``; then
``TaskpointTrainerCallback.on_save`` commits every node's files as one multi-writer
checkpoint. ``--restore`` runs ``restore_last_checkpoint`` into the (emptied) folder,
through a Flyte-like ``CheckpointLike`` without parts with ``--flyte-like``, lists the
files it finds there, and ``dcp.load``s both folders from there into zeroed state of this
job's layout (``W`` may differ from the saving job's), checking every value. Each rank
writes ``DIR/results/<save|restore>-rank<R>.json``: ``{"files": [...]}`` (restore) or
``{"error": "..."}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

ROWS = 12
"""The sharded tensors' rows: divisible by 2 and 3 ranks."""


def model_state(mesh: Any, *, zeros: bool = False) -> dict[str, Any]:
    """A sharded weight, a replicated buffer and a number (zeroed: the load's template)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    weight = torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4)
    buffer = torch.arange(5, dtype=torch.float32) + 100
    if zeros:
        weight, buffer = torch.zeros_like(weight), torch.zeros_like(buffer)
    return {
        "weight": distribute_tensor(weight, mesh, [Shard(0)]),
        "buffer": buffer,
        "epoch": 0 if zeros else 7,
    }


def optimizer_state(mesh: Any, *, zeros: bool = False) -> dict[str, Any]:
    """Sharded tensors only: every rank's file holds its own rows and nothing else."""
    from torch.distributed.tensor import Shard, distribute_tensor

    avg = torch.arange(ROWS * 2, dtype=torch.float32).reshape(ROWS, 2) * 0.5
    return {"exp_avg": distribute_tensor(torch.zeros_like(avg) if zeros else avg, mesh, [Shard(0)])}


class FlyteLike:
    """Another system's checkpoint: the CheckpointLike methods, no parts, no ``url``."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def save_sync(self, data: Any) -> None:
        self._inner.save_sync(data)

    async def save(self, data: Any) -> None:
        await self._inner.save(data)

    def load_sync(self) -> Path | None:
        return self._inner.load_sync()  # type: ignore[no-any-return]

    async def load(self) -> Path | None:
        return await self._inner.load()  # type: ignore[no-any-return]


def save(store: str, out: Path, rank: int, mesh: Any) -> dict[str, Any]:
    import taskpoint
    import torch.distributed.checkpoint as dcp
    from taskpoint_hf import TaskpointTrainerCallback
    from transformers import TrainerControl, TrainerState, TrainingArguments

    folder = out / "checkpoint-4"
    dcp.save(model_state(mesh), checkpoint_id=folder / "pytorch_model_fsdp_0")
    dcp.save(optimizer_state(mesh), checkpoint_id=folder / "optimizer_0")
    torch.save(torch.get_rng_state(), folder / f"rng_state_{rank}.pth")
    if rank == 0:
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
        (folder / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    args = TrainingArguments(
        output_dir=str(out), use_cpu=True, report_to=[], save_on_each_node=False
    )
    state = TrainerState(is_world_process_zero=rank == 0, is_local_process_zero=True)
    state.global_step = 4
    control = TrainerControl()
    callback = TaskpointTrainerCallback(taskpoint.Checkpoint(store), str(out))
    callback.on_train_begin(args, state, control)
    callback.on_save(args, state, control)
    assert callback.wait(120), "the save did not commit"
    callback.on_train_end(args, state, control)
    return {}


def restore(store: str, out: Path, mesh: Any, flyte_like: bool) -> dict[str, Any]:
    import taskpoint
    import torch.distributed.checkpoint as dcp
    from taskpoint_hf import restore_last_checkpoint
    from transformers import TrainingArguments

    checkpoint: Any = taskpoint.Checkpoint(store)
    if flyte_like:
        checkpoint = FlyteLike(checkpoint)
    args = TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[])
    resumed = restore_last_checkpoint(checkpoint, args)
    assert resumed is not None and resumed.name == "checkpoint-4", resumed
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())

    model = model_state(mesh, zeros=True)
    dcp.load(model, checkpoint_id=resumed / "pytorch_model_fsdp_0")
    want = model_state(mesh)
    assert torch.equal(model["weight"].to_local(), want["weight"].to_local())
    assert torch.equal(model["buffer"], want["buffer"]), model["buffer"]
    assert model["epoch"] == 7, model["epoch"]
    optimizer = optimizer_state(mesh, zeros=True)
    dcp.load(optimizer, checkpoint_id=resumed / "optimizer_0")
    assert torch.equal(optimizer["exp_avg"].to_local(), optimizer_state(mesh)["exp_avg"].to_local())
    return {"files": files}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--restore", action="store_true")
    parser.add_argument("--flyte-like", action="store_true")
    opts = parser.parse_args()

    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = opts.root / f"node{rank}" / "out"
    results = opts.root / "results"
    results.mkdir(parents=True, exist_ok=True)
    what = "save" if opts.save else "restore"
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (world,))
        if opts.save:
            shutil.rmtree(out, ignore_errors=True)
            result = save(opts.store, out, rank, mesh)
        else:
            result = restore(opts.store, out, mesh, opts.flyte_like)
    except Exception as exc:
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        (results / f"{what}-rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
