"""An FSDP2 worker for the sharded-checkpoint torchrun tests (gloo, CPU).

Usage: torchrun --nproc_per_node=N tp_torch_fsdp_worker.py MODE URL OUT [--kill-rank R]
       [--kill-epoch E] [--then-kill-rank R2 --then-kill-epoch E2]

Modes:

``train``
    Trains a small ``fully_shard`` model with AdamW, saving a sharded ``TaskpointState``
    after each epoch. In the first incarnation of the group (TORCHELASTIC_RESTART_COUNT 0)
    rank R SIGKILLs itself in the middle of the save of epoch E: after uploading its shards,
    before the commit. In the second incarnation rank R2 SIGKILLs itself mid-run, after the
    first step of epoch E2 (counting from 1). Each rank appends JSON events (start, resume) to
    ``OUT/events-rank<R>.jsonl``; when done, rank 0 writes the full (gathered) model and
    optimizer state to ``OUT/final.pt``. Then the same processes train again from scratch
    without checkpoints and write ``OUT/reference.pt``. Last, they run the DCP scenarios
    and write each rank's outcomes to ``OUT/dcp-rank<R>.json``.
``reshard``
    Restores the newest sharded state of URL into a model sharded over this world size and
    writes the full state to ``OUT/reshard-<world size>.pt`` (rank 0); each rank writes
    what its reader restored (``Checkpoint.load_sync`` calls: paths asked for, files and
    bytes restored) and its INFO line to ``OUT/reshard-<world size>-rank<R>.json``.
``hang``
    Rank 1 never arrives; rank 0 saves a part with a 3 s ``TorchCoordinator`` and writes
    its error to ``OUT/hang-rank0.json``, then exits 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import taskpoint
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from taskpoint_pytorch import (
    TaskpointState,
    TaskpointStorageReader,
    TaskpointStorageWriter,
    TorchCoordinator,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

EPOCHS = 4
STEPS = 3  # per epoch


def log(out: Path, rank: int, **event: Any) -> None:
    with (out / f"events-rank{rank}.jsonl").open("a") as fh:
        fh.write(json.dumps({"pid": os.getpid(), **event}) + "\n")


def watch_loads(checkpoint: taskpoint.Checkpoint) -> list[dict[str, Any]]:
    """Record each ``load_sync`` of ``checkpoint`` (a reader's restores): the paths it
    asked for and the files and bytes the restore held."""
    seen: list[dict[str, Any]] = []
    load = checkpoint.load_sync

    def recording(**kwargs: Any) -> Any:
        path = load(**kwargs)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path else []
        asked = kwargs.get("paths")
        seen.append({
            "paths": None if asked is None else sorted(asked),
            "files": [p.relative_to(path).as_posix() for p in files],
            "bytes": sum(p.stat().st_size for p in files),
        })
        return path

    checkpoint.load_sync = recording  # type: ignore[method-assign]
    return seen


class Fetched(logging.Handler):
    """Keeps the DCP reader's INFO lines saying what each rank fetched."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        reader_log = logging.getLogger("taskpoint_pytorch._dcp")
        reader_log.setLevel(logging.INFO)
        reader_log.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if "fetched" in record.getMessage():
            self.lines.append(record.getMessage())


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6), nn.ReLU(), nn.Linear(6, 2))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole model and optimizer state, gathered on rank 0 (a collective)."""
    msd, osd = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {"model": msd, "optimizer": osd}


def train(args: argparse.Namespace, rank: int, restart: int, out: Path, *, reference: bool) -> None:
    model, optimizer = make_model()
    torch.manual_seed(100 + rank)  # per-rank stream: the noise below draws from it
    checkpoint = taskpoint.Checkpoint(args.url)
    state = TaskpointState(model, optimizer, sharded=True)
    if not reference:
        log(out, rank, event="start", restart=restart)
        loads = watch_loads(checkpoint)
        resume = state.restore_sync(checkpoint)
        log(out, rank, event="resume", epoch=resume.epoch if resume else None, loads=loads)
        start = resume.epoch if resume else 0
        if restart == 0 and rank == args.kill_rank:
            upload = taskpoint.Checkpoint.upload_part

            def upload_then_die(self: taskpoint.Checkpoint, path: Any) -> Any:
                record = upload(self, path)
                if state_epoch[0] == args.kill_epoch:
                    os.kill(os.getpid(), signal.SIGKILL)
                return record

            taskpoint.Checkpoint.upload_part = upload_then_die  # type: ignore[method-assign]
    else:
        start = 0
    state_epoch = [0]
    for epoch in range(start, EPOCHS):
        for step in range(STEPS):
            if (
                not reference and restart == 1 and rank == args.then_kill_rank
                and epoch + 1 == args.then_kill_epoch and step == 1
            ):
                os.kill(os.getpid(), signal.SIGKILL)
            data = torch.Generator().manual_seed(1000 * epoch + 10 * step + rank)
            x = torch.randn(4, 8, generator=data) + 0.01 * torch.randn(4, 8)
            y = torch.randn(4, 2, generator=data)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if not reference:
            state_epoch[0] = epoch + 1
            state.save_sync(checkpoint, epoch=epoch + 1, step=(epoch + 1) * STEPS)
    full = full_state(model, optimizer)
    if rank == 0:
        torch.save(full, out / ("reference.pt" if reference else "final.pt"))


def dcp_scenarios(args: argparse.Namespace, rank: int, out: Path) -> None:
    outcomes: dict[str, Any] = {}

    def attempt(name: str, fn: Any) -> None:
        started = time.monotonic()
        try:
            result = fn()
            outcomes[name] = result if isinstance(result, str) else "ok"
        except BaseException as exc:  # dcp raises CheckpointException, a BaseException
            outcomes[name] = f"{type(exc).__name__}: {exc}"
        outcomes[f"{name}-seconds"] = time.monotonic() - started

    base = Path(args.out)
    model, _ = make_model()
    sharded = {"model": model.state_dict()}

    ckpt = taskpoint.Checkpoint(f"file://{base / 'dcp-store'}")
    attempt("save", lambda: dcp.save(sharded, storage_writer=TaskpointStorageWriter(ckpt)))

    def async_then_load() -> str:
        for p in model.parameters():
            p.data.add_(1.0)
        future = dcp.async_save(
            {"model": model.state_dict()}, storage_writer=TaskpointStorageWriter(ckpt)
        )
        future.result()
        expected = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        fresh, _ = make_model()
        target = {"model": fresh.state_dict()}
        loads, lines = watch_loads(ckpt), Fetched()
        dcp.load(target, storage_reader=TaskpointStorageReader(ckpt))
        outcomes["load-fetched"], outcomes["load-log"] = loads, lines.lines
        got = {k: v.full_tensor() for k, v in fresh.state_dict().items()}
        same = all(torch.equal(expected[k], got[k]) for k in expected)
        parts = sorted((ckpt.committed()[0].parts or {}).keys())
        return f"equal={same} parts={parts} commits={len(ckpt.committed())}"

    attempt("async-then-load", async_then_load)

    # Ranks naming different locations fail on every rank before anything is uploaded.
    where = base / f"disagree-{rank}"
    attempt(
        "disagree",
        lambda: dcp.save(
            sharded, storage_writer=TaskpointStorageWriter(taskpoint.Checkpoint(f"file://{where}"))
        ),
    )
    outcomes["disagree-uploaded"] = sorted(
        str(p.relative_to(base)) for p in (base / f"disagree-{rank}").rglob("objects/*")
    )
    outcomes["disagree-committed"] = len(taskpoint.Checkpoint(f"file://{where}").committed())
    outcomes["disagree-leases"] = len(list(where.glob("leases/*.json")))

    # One rank's upload fails: every rank fails, nothing is committed.
    failing = taskpoint.Checkpoint(f"file://{base / 'failing-store'}")
    if rank == 1:
        def broken(path: Any) -> Any:
            raise taskpoint.CheckpointStoreError("store unavailable (simulated)", url="x")

        failing.upload_part = broken  # type: ignore[method-assign]
    writer = TaskpointStorageWriter(failing)
    attempt("rank1-upload-fails", lambda: dcp.save(sharded, storage_writer=writer))
    outcomes["rank1-upload-fails-committed"] = len(failing.committed())
    writer.close()  # finish never ran on rank 0: release its lease
    dist.barrier()  # every rank's close has run before any rank counts the leases
    outcomes["rank1-upload-fails-leases"] = len(list((base / "failing-store").glob("leases/*.json")))

    # save_part_sync with TorchCoordinator: a path two ranks fill differently.
    coord = TorchCoordinator(timeout=60)
    folder = base / f"part-{rank}"
    folder.mkdir(exist_ok=True)
    (folder / "shared.txt").write_text(f"rank {rank}")
    parts = taskpoint.Checkpoint(f"file://{base / 'parts-store'}")
    attempt("conflict", lambda: parts.save_part_sync(folder, coordinator=coord))
    (folder / "shared.txt").write_text("same")
    (folder / f"own-{rank}.txt").write_text(f"rank {rank}")
    attempt("parts-ok", lambda: parts.save_part_sync(folder, coordinator=coord))
    restored = taskpoint.Checkpoint(f"file://{base / 'parts-store'}").load_sync(part=rank)
    outcomes["part-files"] = sorted(p.name for p in restored.iterdir()) if restored else None
    (out / f"dcp-rank{rank}.json").write_text(json.dumps(outcomes))


def reshard(args: argparse.Namespace, rank: int, world: int, out: Path) -> None:
    model, optimizer = make_model()
    state = TaskpointState(model, optimizer, sharded=True)
    checkpoint = taskpoint.Checkpoint(args.url)
    loads, lines = watch_loads(checkpoint), Fetched()
    resume = state.restore_sync(checkpoint)
    (out / f"reshard-{world}-rank{rank}.json").write_text(
        json.dumps({"loads": loads, "log": lines.lines})
    )
    full = full_state(model, optimizer)
    if rank == 0:
        torch.save({**full, "epoch": resume.epoch if resume else None}, out / f"reshard-{world}.pt")


def hang(args: argparse.Namespace, rank: int, out: Path) -> None:
    coord = TorchCoordinator(timeout=3)
    if rank == 1:
        time.sleep(600)
    folder = out / "hang-part"
    folder.mkdir(exist_ok=True)
    (folder / "f").write_text("x")
    started = time.monotonic()
    try:
        taskpoint.Checkpoint(args.url).save_part_sync(folder, coordinator=coord)
        outcome = "ok"
    except taskpoint.CheckpointError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    (out / "hang-rank0.json").write_text(
        json.dumps({"error": outcome, "seconds": time.monotonic() - started})
    )
    os._exit(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "reshard", "hang"])
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-epoch", type=int, default=-1)
    parser.add_argument("--then-kill-rank", type=int, default=-1)
    parser.add_argument("--then-kill-epoch", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(args.out)
    try:
        if args.mode == "train":
            train(args, rank, restart, out, reference=False)
            train(args, rank, restart, out, reference=True)
            dcp_scenarios(args, rank, out)
        elif args.mode == "reshard":
            reshard(args, rank, world, out)
        else:
            hang(args, rank, out)
    finally:
        dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
