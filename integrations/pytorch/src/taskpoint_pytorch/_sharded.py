"""Sharded state: models and optimizers through ``torch.distributed.checkpoint``.

``TaskpointState(..., sharded=True)`` saves each model's and optimizer's state with
``torch.distributed.checkpoint.state_dict.get_model_state_dict`` /
``get_optimizer_state_dict`` (sharded ``DTensor`` under FSDP2, so no rank ever holds the
whole state) and writes it with ``dcp.save`` through
:class:`~taskpoint_pytorch.TaskpointStorageWriter`: every rank uploads its own shards, and
one commit covers them all. The rest of the bundle (schedulers, scalers, generators, every
rank's RNG state, the counters and ``extra``) is one small ``torch.save`` blob, equal on
every rank, stored once beside the shards under ``rest`` (as bytes). Restoring loads with DCP into the
current sharding, whatever the world size (DCP reshards), and reads ``rest`` with
``weights_only=True``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import taskpoint
import torch
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from taskpoint_pytorch._dcp import TaskpointStorageReader, TaskpointStorageWriter
from taskpoint_pytorch._errors import StateError

__all__ = ["load_sharded", "owner_of", "save_sharded"]

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
    failed = [
        f"rank {rank}: {type(error).__name__}: {error}"
        for rank, (error, _) in sorted(exc.failures.items())
    ]
    return StateError(f"cannot {what}: " + "; ".join(failed))


def save_sharded(
    checkpoint: taskpoint.Checkpoint,
    models: Mapping[str, nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    rest: dict[str, Any],
) -> None:
    """Commit the sharded state and ``rest`` (a collective: every rank calls it).

    Raises:
        StateError: any rank failed (naming each failed rank and its error).
    """
    blob = io.BytesIO()
    torch.save(rest, blob)
    state: dict[str, Any] = {
        "models": {name: get_model_state_dict(m) for name, m in models.items()},
        "optimizers": {
            name: get_optimizer_state_dict(owner_of(o, models), o)
            for name, o in optimizers.items()
        },
        REST: blob.getvalue(),  # bytes: DCP stores it once, as a non-tensor value
    }
    writer = TaskpointStorageWriter(checkpoint)
    try:
        dcp_save(state, storage_writer=writer)
    except CheckpointException as exc:
        raise _translate(exc, "save the sharded state") from None
    finally:
        writer.close()


def load_sharded(
    checkpoint: taskpoint.Checkpoint,
    models: Mapping[str, nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
) -> dict[str, Any]:
    """Load the newest sharded state into ``models`` and ``optimizers``; the ``rest``
    bundle (a collective: every rank calls it, after checking a checkpoint exists).

    Raises:
        StateError: any rank failed (naming each failed rank and its error).
    """
    state: dict[str, Any] = {
        "models": {name: get_model_state_dict(m) for name, m in models.items()},
        "optimizers": {
            name: get_optimizer_state_dict(owner_of(o, models), o)
            for name, o in optimizers.items()
        },
        REST: b"",
    }
    try:
        dcp_load(state, storage_reader=TaskpointStorageReader(checkpoint), planner=_SafeLoadPlanner())
    except CheckpointException as exc:
        raise _translate(exc, "restore the sharded state") from None
    options = StateDictOptions(strict=True)
    for name, module in models.items():
        set_model_state_dict(module, state["models"][name], options=options)
    for name, optimizer in optimizers.items():
        set_optimizer_state_dict(
            owner_of(optimizer, models), optimizer, state["optimizers"][name], options=options
        )
    raw = state[REST]
    if not isinstance(raw, bytes):
        raise StateError(f"the checkpoint's {REST!r} entry is not a state bundle")
    rest = torch.load(io.BytesIO(raw), weights_only=True)
    if not isinstance(rest, dict):
        raise StateError(f"the checkpoint's {REST!r} entry is not a state bundle")
    return rest
