"""One simulated node's process for ``bench_netns.py`` (run inside its network namespace).

Usage: python _netns_node.py SPEC_JSON_FILE

The spec: ``{"mode", "rank", "world", "base", "options", "data", "work", "sync",
"rounds"}``. ``data`` is this node's share: a folder holding ``rank-<rank>/`` (its shard
files and a ``meta.json``, from ``_common.make_data``). ``mode`` is what the node does in
each round ``i`` (to the fresh location ``base/i``, so nothing is reused from an earlier
round):

``alone``
    ``Checkpoint.save_sync(data)``, then ``load_sync()``: the single-writer path.
``parts``
    ``save_part_sync(data)`` with a :class:`taskpoint.StoreCoordinator` of ``world``
    writers, then ``load_sync(part=rank)``: each node restores its own files.
``dcp``
    ``dcp.save`` through ``TaskpointStorageWriter`` of the shards in ``data`` as DTensors
    sharded over the ``world`` ranks (a gloo process group across the nodes), then
    ``dcp.load`` through ``TaskpointStorageReader`` into zeroed DTensors of the same layout
    (each rank fetches its own shard file and ``.metadata``), checked against the saved.
``hf``
    One ``TaskpointTrainerCallback`` for the whole run (to ``base``), over a gloo process
    group: in round ``i`` each node's own ``output_dir`` gets ``checkpoint-<i+1>`` (and
    loses the one before), laid out as FSDP's ``SHARDED_STATE_DICT`` writes it (this
    rank's shard files ``pytorch_model_fsdp_0/__<rank>_<j>.distcp``, new bytes every
    round, its ``rng_state_<rank>.pth``; node 0 also ``trainer_state.json`` and the shards'
    ``.metadata``, a real DCP one describing each shard file as its rank's chunk of one
    tensor); the timed step is ``on_save`` and waiting for the commit. Then
    ``restore_last_checkpoint`` into the emptied ``output_dir``, which brings each node the
    shared files and its own rank's files only (checked: no other rank's shard arrives).
    No model is trained: the callback sees the files an FSDP Trainer on several nodes
    leaves, with real ``TrainingArguments`` and ``TrainerState``.

Each timed step (``save-<i>``, ``load-<i>``) starts when the driver says go: the node
writes ``sync/ready-<step>-<rank>``, waits for ``sync/go-<step>``, runs the step and writes
``sync/done-<step>-<rank>.json`` (``{"end": time.time()}`` or ``{"error": ...}``).
Preparation and checks between steps are not timed. Torch modes read ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` from the environment.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import taskpoint

HANG_S = 900.0
"""Bounds a wait for the driver: only a hang reaches it."""


class Steps:
    """This node's side of the driver's go/done files."""

    def __init__(self, sync: Path, rank: int) -> None:
        self.sync, self.rank = sync, rank

    def run(self, name: str, step: Callable[[], Any]) -> Any:
        (self.sync / f"ready-{name}-{self.rank}").touch()
        go = self.sync / f"go-{name}"
        deadline = time.monotonic() + HANG_S
        while not go.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the driver never said go for {name}")
            time.sleep(0.005)
        try:
            value = step()
        except BaseException as exc:
            self._write(name, {"error": f"{type(exc).__name__}: {exc}",
                               "trace": traceback.format_exc()[-4000:]})
            raise
        self._write(name, {"end": time.time()})
        return value

    def _write(self, name: str, record: dict[str, Any]) -> None:
        done = self.sync / f"done-{name}-{self.rank}.json"
        tmp = done.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, done)


def run_alone(spec: dict[str, Any], steps: Steps) -> None:
    data, work = Path(spec["data"]), Path(spec["work"])
    for i in range(spec["rounds"]):
        ckpt = taskpoint.Checkpoint(f"{spec['base']}/{i}", storage_options=spec["options"],
                                    workdir=work / "tp")
        ckpt.committed()  # connected before the clock starts
        steps.run(f"save-{i}", lambda ckpt=ckpt: ckpt.save_sync(data))
        restored = steps.run(f"load-{i}", lambda ckpt=ckpt: ckpt.load_sync(into=work / "restore"))
        assert restored is not None and (restored / "rank-0" / "meta.json").exists()
        shutil.rmtree(work / "restore")


def run_parts(spec: dict[str, Any], steps: Steps) -> None:
    data, work, rank = Path(spec["data"]), Path(spec["work"]), spec["rank"]
    for i in range(spec["rounds"]):
        url = f"{spec['base']}/{i}"
        ckpt = taskpoint.Checkpoint(url, storage_options=spec["options"], workdir=work / "tp")
        coord = taskpoint.StoreCoordinator(
            url, rank=rank, world_size=spec["world"], session=f"round-{i}",
            storage_options=spec["options"], poll=0.02, timeout=HANG_S,
        )
        ckpt.committed()
        steps.run(f"save-{i}", lambda ckpt=ckpt, coord=coord: ckpt.save_part_sync(data, coordinator=coord))
        restored = steps.run(
            f"load-{i}", lambda ckpt=ckpt: ckpt.load_sync(into=work / "restore", part=rank)
        )
        assert restored is not None and (restored / f"rank-{rank}" / "meta.json").exists()
        shutil.rmtree(work / "restore")


def _shard_files(spec: dict[str, Any]) -> list[Path]:
    return sorted(Path(spec["data"], f"rank-{spec['rank']}").glob("shard-*.bin"))


def _shards(spec: dict[str, Any]) -> list[Any]:
    """This rank's shard files as float32 tensors of 1024 columns (the rows that fit)."""
    import numpy as np
    import torch

    tensors = []
    for path in _shard_files(spec):
        rows = path.stat().st_size // 4096
        array = np.fromfile(path, dtype=np.float32, count=rows * 1024).reshape(rows, 1024)
        tensors.append(torch.from_numpy(array))
    return tensors


def run_dcp(spec: dict[str, Any], steps: Steps) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from taskpoint_pytorch import TaskpointStorageReader, TaskpointStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    work = Path(spec["work"])
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        local = _shards(spec)
        state = {f"layer{j}.weight": DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
                 for j, t in enumerate(local)}
        for i in range(spec["rounds"]):
            ckpt = taskpoint.Checkpoint(f"{spec['base']}/{i}", storage_options=spec["options"],
                                        workdir=work / "tp")
            ckpt.committed()
            writer = TaskpointStorageWriter(ckpt, staging=work / "dcp-save")
            steps.run(f"save-{i}", lambda writer=writer: dcp.save(state, storage_writer=writer))
            target = {name: DTensor.from_local(torch.zeros_like(t), mesh, [Shard(0)], run_check=False)
                      for name, t in zip(state, local, strict=True)}
            reader = TaskpointStorageReader(ckpt, staging=work / "dcp-load")
            steps.run(f"load-{i}", lambda reader=reader, target=target: dcp.load(target, storage_reader=reader))
            for name, t in zip(state, local, strict=True):
                assert torch.equal(target[name].to_local(), t), name
    finally:
        dist.destroy_process_group()


def _dcp_metadata(world: int, files: list[Path]) -> bytes:
    """The ``.metadata`` ``dcp.save`` writes for these shards: tensor ``shard_<j>`` stored as
    one chunk per rank, rank ``r``'s in ``__<r>_<j>.distcp`` (every node's share is the same
    size). ``restore_last_checkpoint`` reads it to leave out other nodes' shards."""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    described: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for j, path in enumerate(files):
        size = path.stat().st_size
        rows = size // 4
        chunks = [
            ChunkStorageMetadata(offsets=torch.Size([r * rows]), sizes=torch.Size([rows]))
            for r in range(world)
        ]
        described[f"shard_{j}"] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([world * rows]), chunks
        )
        for r, chunk in enumerate(chunks):
            storage[MetadataIndex(f"shard_{j}", chunk.offsets, 0)] = _StorageInfo(
                f"__{r}_{j}.distcp", 0, size
            )
    return pickle.dumps(Metadata(state_dict_metadata=described, storage_data=storage))


def _write_hf_checkpoint(
    out: Path, step: int, rank: int, files: list[Path], metadata: bytes
) -> None:
    """What a Trainer with FSDP ``SHARDED_STATE_DICT`` leaves on this rank's node after
    saving ``checkpoint-<step>`` with ``save_total_limit=1``: the one before is gone. Every
    step's shards hold other bytes (each 32-bit word plus ``step``), so nothing is
    deduplicated against the checkpoint before."""
    import numpy as np

    shutil.rmtree(out / f"checkpoint-{step - 1}", ignore_errors=True)
    folder = out / f"checkpoint-{step}"
    shards = folder / "pytorch_model_fsdp_0"
    shards.mkdir(parents=True, exist_ok=True)
    for j, path in enumerate(files):
        (np.fromfile(path, dtype=np.uint32) + np.uint32(step)).tofile(shards / f"__{rank}_{j}.distcp")
    (folder / f"rng_state_{rank}.pth").write_bytes(os.urandom(15_000))
    if rank == 0:
        (shards / ".metadata").write_bytes(metadata)
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def run_hf(spec: dict[str, Any], steps: Steps) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from taskpoint_hf import TaskpointTrainerCallback, restore_last_checkpoint
    from transformers import TrainerControl, TrainerState, TrainingArguments

    rank, work, files = spec["rank"], Path(spec["work"]), _shard_files(spec)
    metadata = _dcp_metadata(spec["world"], files)
    out = work / "out"
    out.mkdir(parents=True)
    try:
        args = TrainingArguments(
            output_dir=str(out), use_cpu=True, save_total_limit=1, report_to=[],
            save_on_each_node=False,
        )
        state = TrainerState(is_world_process_zero=rank == 0, is_local_process_zero=True)
        control = TrainerControl()
        # One run: one checkpoint location and callback, saving at steps 1, 2, ... (on one
        # node the first save starts the upload process: a warm-up round absorbs that).
        ckpt = taskpoint.Checkpoint(spec["base"], storage_options=spec["options"],
                                    workdir=work / "tp")
        ckpt.committed()
        callback = TaskpointTrainerCallback(ckpt, str(out))
        callback.on_train_begin(args, state, control)
        for i in range(spec["rounds"]):
            state.global_step = i + 1
            _write_hf_checkpoint(out, i + 1, rank, files, metadata)

            def save() -> None:
                callback.on_save(args, state, control)
                callback.wait()  # committed

            steps.run(f"save-{i}", save)
            shutil.rmtree(out)  # a fresh machine for every node
            resumed = steps.run(f"load-{i}", lambda: restore_last_checkpoint(ckpt, args))
            assert resumed is not None and resumed.name == f"checkpoint-{i + 1}", resumed
            shard = resumed / "pytorch_model_fsdp_0" / f"__{rank}_0.distcp"
            assert shard.stat().st_size == files[0].stat().st_size
            assert (resumed / f"rng_state_{rank}.pth").exists()
            others = [r for r in range(spec["world"]) if r != rank]  # each node its own share
            assert not [r for r in others if (shard.parent / f"__{r}_0.distcp").exists()]
        callback.on_train_end(args, state, control)
    finally:
        dist.destroy_process_group()


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    steps = Steps(Path(spec["sync"]), spec["rank"])
    Path(spec["work"]).mkdir(parents=True, exist_ok=True)
    try:
        {"alone": run_alone, "parts": run_parts, "dcp": run_dcp, "hf": run_hf}[spec["mode"]](
            spec, steps
        )
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
