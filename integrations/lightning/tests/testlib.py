"""Shared pieces of the Lightning adapter's tests and their child-process scripts.

Loaded by path (``conftest.py`` registers it as ``taskpoint_lightning_testlib``), so test
files and scripts share one definition of the model, the data and the helpers.
"""

from __future__ import annotations

import atexit
import io
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import lightning as L
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from taskpoint import Checkpoint, CheckpointLike
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

SAMPLES = 20
BATCH = 4  # five batches per epoch
FEATURES = 8


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x[:, :2].sum(dim=1, keepdim=True) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


class Planned(Exception):
    """The failure a test plans."""


class TinyModule(L.LightningModule):
    """Dropout plus input noise: every step draws from the global torch generator.

    ``fail_at`` holds global steps at which ``training_step`` raises once each (the set
    is shared across attempts, so a retry passes the same step); ``kill_at`` makes the
    process die there with ``os._exit(137)``, after calling ``before_kill`` if set (the
    scripts wait there for the mirror in flight, so the kill lands between two mirrors).
    """

    def __init__(self, fail_at: set[int] | None = None, kill_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1)
        )
        self.fail_at = fail_at if fail_at is not None else set()
        self.kill_at = kill_at
        self.before_kill: Callable[[], object] | None = None
        self.started_at: tuple[int, int] | None = None

    def on_train_start(self) -> None:
        self.started_at = (self.current_epoch, self.global_step)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.kill_at is not None and self.global_step == self.kill_at:
            if self.before_kill is not None:
                self.before_kill()
            os._exit(137)
        if self.global_step in self.fail_at:
            self.fail_at.discard(self.global_step)
            raise Planned(f"planned failure at step {self.global_step}")
        x, y = batch
        x = x + 0.01 * torch.randn_like(x)
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class ShardedModule(TinyModule):
    """:class:`TinyModule` for FSDP, trained with AdamW (sharded optimizer state too).

    On a GPU Lightning's ``FSDPStrategy`` wraps it. On CPU Lightning refuses
    ``FSDPStrategy`` (its accelerator check) and FSDP itself needs ``device_id``, so the
    tests pair :func:`fsdp_strategy` with this module, which then wraps its network in
    ``configure_model`` with ``device_id=torch.device("cpu")``: Lightning's path for a
    model the user wrapped himself. Everything after the wrap (sharded save and load, DCP
    files per rank) is Lightning's and torch's own code.
    """

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        on_cpu = self.trainer.strategy.root_device.type == "cpu"
        if on_cpu and not isinstance(self.net, FullyShardedDataParallel):
            self.net = FullyShardedDataParallel(
                self.net, device_id=torch.device("cpu"), use_orig_params=True
            )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def fsdp_strategy(*, gpu: bool) -> Any:
    """``FSDPStrategy(state_dict_type="sharded")``; without ``gpu`` over gloo, allowed on
    CPU (see :class:`ShardedModule`): the connector refuses only the exact
    ``FSDPStrategy`` type without a GPU, not a subclass."""
    from lightning.pytorch.strategies import FSDPStrategy

    if gpu:
        return FSDPStrategy(state_dict_type="sharded")

    class CPUFSDPStrategy(FSDPStrategy):
        pass

    return CPUFSDPStrategy(state_dict_type="sharded", process_group_backend="gloo")


def full_state(module: L.LightningModule) -> dict[str, torch.Tensor]:
    """The module's weights and optimizer state, gathered whole on every rank, on the CPU
    and flattened to ``{name: tensor}`` (works for FSDP-sharded and plain modules alike)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    out = {f"model.{k}": v.detach().cpu().clone() for k, v in
           get_model_state_dict(module, options=options).items()}
    optimizer = module.trainer.optimizers[0]
    state = get_optimizer_state_dict(module, optimizer, options=options)["state"]
    for param, values in state.items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{param}.{key}"] = value.detach().cpu().clone()
    return out


class ResumableSampler(Sampler[int]):
    """A random permutation per epoch from the global generator, resumable mid-epoch."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._perm: list[int] = []
        self._pos = 0
        self._resume: tuple[list[int], int] | None = None

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        if self._resume is not None:
            (self._perm, self._pos), self._resume = self._resume, None
        else:
            self._perm, self._pos = torch.randperm(self.n).tolist(), 0
        while self._pos < len(self._perm):
            index = self._perm[self._pos]
            self._pos += 1
            yield index

    def state_dict(self) -> dict[str, Any]:
        return {"perm": list(self._perm), "pos": self._pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        perm, pos = list(state["perm"]), int(state["pos"])
        self._resume = (perm, pos) if pos < len(perm) else None


class ResumableLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader Lightning can resume mid-epoch (it has ``state_dict``)."""

    def __init__(self, ds: TensorDataset) -> None:
        super().__init__(ds, batch_size=BATCH, sampler=ResumableSampler(len(ds)))

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()  # type: ignore[attr-defined,no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)  # type: ignore[attr-defined]


def loader(kind: str) -> DataLoader:  # type: ignore[type-arg]
    """``"shuffle"``: a plain shuffling loader; ``"resumable"``: :class:`ResumableLoader`."""
    if kind == "resumable":
        return ResumableLoader(dataset())
    return DataLoader(dataset(), batch_size=BATCH, shuffle=True)


def trainer(callbacks: list[Any], max_epochs: int = 5, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "max_epochs": max_epochs,
        "accelerator": "cpu",
        "devices": 1,
        "deterministic": True,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "callbacks": callbacks,
    }
    options.update(kwargs)
    return L.Trainer(**options)


def end_process_group() -> None:
    """Destroys the process group Lightning leaves up after ``fit``.

    Left to interpreter exit, gloo's teardown sometimes aborts the process ("terminate
    called without an active exception", exit -6) after training ended cleanly, with or
    without taskpoint: gloo's threads still hold work whose tensors the finalising
    interpreter frees (pytorch/pytorch#179291; Lightning destroys the group at exit for
    NCCL only). Every process that loads this module runs it at exit (below), spawned
    ``ddp_spawn`` workers and torchrun ranks included; scripts may call it earlier.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


atexit.register(end_process_group)


def exit_now() -> NoReturn:
    """End a script that finished its work as the interpreter's exit would, short of the
    interpreter's finalisation: destroy the process group, run the ``atexit`` handlers
    (taskpoint's end record of the life among them), flush the output, ``os._exit(0)``.
    Finalisation is where gloo's threads race the freeing of what they hold and abort the
    process; destroying the group first does not always prevent it, since Lightning's
    strategy (FSDP's above all) keeps references to it (a two-node FSDP reference run
    aborted so after ``end_process_group``)."""
    end_process_group()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(bool(torch.isfinite(t).all()) for t in b.values()), "reference diverged"
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert not unequal, f"tensors differ bitwise: {unequal}"


class RecordingCheckpoint:
    """A CheckpointLike that delegates to a real Checkpoint and logs who saved."""

    def __init__(self, inner: Checkpoint, log_file: str | os.PathLike[str] | None = None) -> None:
        self.inner = inner
        self.log_file = Path(log_file) if log_file is not None else None
        self.saves: list[Any] = []

    def _record(self, data: Any) -> None:
        self.saves.append(data)
        if self.log_file is not None:
            rank = (
                torch.distributed.get_rank() if torch.distributed.is_initialized() else -1
            )
            with self.log_file.open("a") as fh:
                fh.write(f"{os.getpid()} {rank}\n")

    def save_sync(self, data: Any, /) -> None:
        self._record(data)
        self.inner.save_sync(data)

    async def save(self, data: Any, /) -> None:
        self._record(data)
        await self.inner.save(data)

    def load_sync(self) -> Path | None:
        return self.inner.load_sync()

    async def load(self) -> Path | None:
        return await self.inner.load()


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: ``"file"``, or ``"link->target"`` for a symbolic link."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = f"link->{os.readlink(p)}" if p.is_symlink() else "file"
    return out


def unreadable_ckpts(root: Path) -> list[str]:
    """The ``.ckpt`` entries under ``root`` that ``torch.load`` cannot read in full."""
    bad = []
    for p in sorted(root.rglob("*.ckpt")):
        try:
            torch.load(p, map_location="cpu", weights_only=False)
        except Exception as exc:
            bad.append(f"{p.name}: {type(exc).__name__}")
    return bad


class VerifyingCheckpoint(RecordingCheckpoint):
    """After each save, reads the store back: which entries it holds, which are unreadable.

    ``mirrors`` gets one ``(local entries, stored entries, unreadable stored .ckpt,
    Lightning-reported files missing from the store)`` per save.
    """

    def __init__(self, inner: Checkpoint) -> None:
        super().__init__(inner)
        self.mirrors: list[tuple[dict[str, str], dict[str, str], list[str]]] = []

    def save_sync(self, data: Any, /) -> None:
        local = tree(Path(data))
        super().save_sync(data)
        restored = self.inner.load_sync()
        assert restored is not None
        self.mirrors.append((local, tree(restored), unreadable_ckpts(restored)))


class SlowCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint in two halves with a pause between: a half-written file
    sits on disk for ``pause`` seconds."""

    def __init__(self, pause: float = 0.3) -> None:
        super().__init__()
        self.pause = pause

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getvalue()
        os.makedirs(os.path.dirname(os.fspath(path)), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data[: len(data) // 2])
            fh.flush()
            time.sleep(self.pause)
            fh.write(data[len(data) // 2 :])


class SlowUpload:
    """A ``progress=`` callback for a checkpoint stored in the local folder ``store``: the
    first upload that starts once the store holds a committed checkpoint (the second
    mirror's) creates the file ``marker``, then stalls for ``seconds``."""

    def __init__(
        self, store: str | os.PathLike[str], marker: str | os.PathLike[str], seconds: str | float
    ) -> None:
        self.store, self.marker, self.seconds = Path(store), Path(marker), float(seconds)
        self._done = False

    def __call__(self, moved: int) -> None:
        if self._done or not any((self.store / "checkpoints").glob("*.manifest.json")):
            return
        self._done = True
        self.marker.write_text(str(time.time()))
        time.sleep(self.seconds)


def checkpoint_like(obj: object) -> CheckpointLike:
    assert isinstance(obj, CheckpointLike)
    return obj
