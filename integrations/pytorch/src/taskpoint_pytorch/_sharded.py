"""Sharded state (``TaskpointState(..., sharded=True)``): models and optimizers through
``torch.distributed.checkpoint``.

Their state comes from ``get_model_state_dict`` / ``get_optimizer_state_dict`` (sharded
``DTensor`` under FSDP2: no rank ever holds the whole state) and goes through
:class:`~taskpoint_pytorch.TaskpointStorageWriter`, one commit for every rank's shards. The
rest of the bundle (schedulers, scalers, generators, every rank's RNG state, the counters,
``extra``), equal on every rank, is one ``torch.save`` blob stored once beside the shards
under ``rest`` and read back with ``weights_only=True``. A restore loads into the current
sharding, whatever the world size (DCP reshards). The ranks agree (``_agreement``) before
any of them calls ``dcp.save`` or ``dcp.load``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import taskpoint
import torch
from taskpoint.integration import (
    broadcast_from_zero,
    describe_error,
    gather_or_raise,
    rank_and_size,
)
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from taskpoint_pytorch._agreement import agree_to_save, settle_every_rank
from taskpoint_pytorch._components import Components
from taskpoint_pytorch._dcp import TaskpointStorageReader, TaskpointStorageWriter, need_checkpoint
from taskpoint_pytorch._errors import StateError
from taskpoint_pytorch._layout import check_layout

__all__ = ["ShardedState", "owner_of"]

log = logging.getLogger(__name__)

REST = "rest"
"""The key of the bundle's non-sharded part in the DCP state dict."""


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, unpickling the non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def owner_of(optimizer: torch.optim.Optimizer, models: Mapping[str, nn.Module]) -> nn.Module:
    """The model whose parameters ``optimizer`` updates.

    Raises:
        ValueError: none of ``models`` holds its first parameter.
    """
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    for module in models.values():
        if first is not None and any(p is first for p in module.parameters()):
            return module
    raise ValueError(
        "sharded=True needs each optimizer's parameters to belong to one of the state's "
        "models (get_optimizer_state_dict maps them by the model's names)"
    )


def _translate(exc: CheckpointException, what: str) -> StateError:
    failures = sorted(exc.failures.items())  # rank: (error, its traceback)
    failed = [f"rank {rank}: {describe_error(error)}" for rank, (error, _) in failures]
    return StateError(f"cannot {what}: " + "; ".join(failed))


def _state_dict(
    models: Mapping[str, nn.Module], optimizers: Mapping[str, torch.optim.Optimizer], rest: bytes
) -> dict[str, Any]:
    """What DCP saves or loads: the models' and optimizers' (sharded) state, and ``rest``."""
    return {
        "models": {name: get_model_state_dict(m) for name, m in models.items()},
        "optimizers": {
            name: get_optimizer_state_dict(owner_of(o, models), o) for name, o in optimizers.items()
        },
        REST: rest,
    }


class ShardedState:
    """The saves and restores of one ``TaskpointState(..., sharded=True)``.

    Args:
        components: the objects saved and restored.

    Raises:
        ValueError: an optimizer's parameters belong to none of the models.
    """

    def __init__(self, components: Components) -> None:
        for optimizer in components.optimizers.values():
            owner_of(optimizer, components.models)
        self._components = components

    @contextlib.contextmanager
    def saving(
        self, checkpoint: object, epoch: int, step: int,
        extra: Mapping[str, Any] | None, background: bool | None,
    ) -> Iterator[None]:
        """Every rank: gather RNG states, agree the bundle's rest is valid, ``dcp.save``
        (DCP's collectives are blocking: on the calling thread, async saves too); then
        yields ``None``: the save is committed, the body has nothing to upload.

        Raises:
            ValueError: ``background`` is true, or a counter is bad.
            TypeError: ``checkpoint`` is not a :class:`taskpoint.Checkpoint`, or a value
                would not load with ``weights_only=True``.
            StateError: another rank failed, or DCP failed on any rank.
        """
        rank, world = rank_and_size()

        def prepare() -> None:
            if background:
                raise ValueError("sharded=True saves are blocking: background=True is refused")
            need_checkpoint(checkpoint, "TaskpointState(sharded=True)")

        extra_state, rng_states = agree_to_save(
            prepare, epoch, step, extra, self._components.rng
        )
        save_id = broadcast_from_zero(uuid.uuid4().hex)
        blob = io.BytesIO()
        local_error: Exception | None = None
        try:
            rest = self._components.bundle(epoch, step, extra_state, rng_states, world, tensors=False)
            rest["save_id"] = save_id
            rest["sharded"] = True
            torch.save(rest, blob)
        except Exception as exc:
            local_error = exc
        gather_or_raise(None, local_error, "save the state", failure=StateError)
        assert isinstance(checkpoint, taskpoint.Checkpoint)
        # The rest as bytes: stored once, not per rank.
        state = _state_dict(self._components.models, self._components.optimizers, blob.getvalue())
        writer = TaskpointStorageWriter(checkpoint)
        try:
            dcp_save(state, storage_writer=writer)
        except CheckpointException as exc:
            raise _translate(exc, "save the sharded state") from None
        finally:
            writer.close()
        if rank == 0:
            log.debug("committed sharded state (epoch=%d, step=%d) from %d ranks", epoch, step, world)
        yield None

    async def restore(self, checkpoint: object, map_location: object) -> dict[str, Any] | None:
        """:meth:`restore_sync`, on the calling thread (DCP's collectives are blocking)."""
        return self.restore_sync(checkpoint, map_location)

    def restore_sync(self, checkpoint: object, map_location: object) -> dict[str, Any] | None:
        """Every rank: agree a checkpoint exists, ``dcp.load`` into the current sharding
        (``map_location`` is not used: each tensor loads where its shard lives), then apply
        the rest of the bundle.

        Returns:
            The rest of the bundle restored, or ``None`` when nothing was committed yet.

        Raises:
            TypeError: ``checkpoint`` is not a :class:`taskpoint.Checkpoint`.
            StateLayoutError: the rest is not a bundle of this layout.
            StateError: ranks see different checkpoints, another rank failed, or DCP
                failed on any rank.
        """
        settle_every_rank()
        rank, world = rank_and_size()
        error: Exception | None = None
        newest: str | None = None
        try:
            committed = need_checkpoint(checkpoint, "TaskpointState(sharded=True)").committed()
            newest = committed[0].key if committed else None
        except Exception as exc:
            error = exc
        seen = gather_or_raise(newest, error, "restore the state", failure=StateError)
        if any(n is None for n in seen) and any(n is not None for n in seen):
            found = ", ".join(f"rank {r}: {n or 'nothing'}" for r, n in enumerate(seen))
            raise StateError(
                f"ranks see different checkpoints ({found}); every rank must read the same "
                "store (a memory:// store is private to its process)"
            )
        if newest is None:
            return None
        assert isinstance(checkpoint, taskpoint.Checkpoint)
        models, optimizers = self._components.models, self._components.optimizers
        state = _state_dict(models, optimizers, b"")
        reader = TaskpointStorageReader(checkpoint)
        try:
            dcp_load(state, storage_reader=reader, planner=_SafeLoadPlanner())
        except CheckpointException as exc:
            raise _translate(exc, "restore the sharded state") from None
        for name, module in models.items():  # strictly (the default options)
            set_model_state_dict(module, state["models"][name])
        for name, optimizer in optimizers.items():
            set_optimizer_state_dict(owner_of(optimizer, models), optimizer, state["optimizers"][name])
        if not isinstance(state[REST], bytes):
            raise StateError(f"the checkpoint's {REST!r} entry is not a state bundle")
        rest: dict[str, Any] = torch.load(io.BytesIO(state[REST]), weights_only=True)
        where = f"{checkpoint.url} (sharded state)"
        check_layout(rest, where, self._components.by_kind(), self._components.rng)
        self._components.load(rest, rank, world, tensors=False)
        return rest
