"""The save at a failure (``TaskpointState(save_on_exception=True)``): when an exception ends
the attempt, the state as it was at the last save call is committed, so the retry resumes
at that call's step instead of recomputing the steps since the last save.

A save call is a step boundary: the state is consistent there. At each call a
:class:`FailureSave` notes what a save at that point needs: the checkpoint, the counters and
``extra``; the global RNGs', the generators' and the schedulers' states, which are small
and copied; and the models' parameters and buffers and the AMP scalers' state tensors, for
core's :class:`taskpoint.integration.WriteWatch` to tell whether they were written since.

The failure is core's :meth:`taskpoint.TaskContext.on_failure` (through
:class:`taskpoint.integration.FailureHook`): the task's function raised,
or an uncaught exception ends a process of the environment contract. If nothing was
written since the last call, the small states are set back to that call's and the state is
saved, blocking, as a save call at that step would save it. Otherwise nothing is saved,
and a warning says what changed. It saves nothing either when that call saved (its save is
committed or uploading), after a store error (the same store would fail again), or under
``torch.distributed`` (a failing rank cannot run the collectives a save needs).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from taskpoint import CheckpointError, CheckpointLike
from taskpoint.integration import (
    FailureHook,
    WriteWatch,
    is_distributed,
    module_tensors,
    reset_rng,
    snapshot_rng,
)
from torch import nn

from taskpoint_pytorch._components import Components

__all__ = ["FailureSave"]

log = logging.getLogger(__name__)

Save = Callable[[CheckpointLike, int, int, "Mapping[str, Any] | None"], None]


@dataclass
class _Mark:
    """The last save call: what a save at the failure commits, and how to check it."""

    checkpoint: CheckpointLike
    epoch: int
    step: int
    extra: dict[str, Any] | None
    rng: tuple[Any, ...] | None
    schedulers: dict[str, Any]
    generators: dict[str, torch.Tensor]
    saved: bool = False

    @property
    def at(self) -> int:
        """The loop's counter at that call (``step``, else ``epoch``), for messages."""
        return self.step or self.epoch


class FailureSave:
    """Saves a plain loop's state at the failure of its attempt (see the module docs).

    Args:
        components: the state's objects.
        save: commits a blocking save of the objects' current state with these counters
            and ``extra`` (the state's own save, so it is the same bundle).
    """

    def __init__(self, components: Components, save: Save) -> None:
        self._components = components
        self._save = save
        self._mark: _Mark | None = None
        self._writes = WriteWatch(components.optimizers.values())
        self._modules: list[nn.Module] | None = None  # the models' modules, found once
        self._hook = FailureHook(self.at_failure, "save_on_exception=True")

    def note(
        self, checkpoint: CheckpointLike, epoch: int, step: int, extra: Mapping[str, Any] | None
    ) -> None:
        """A save call: remember the state as it is now, and be called at this attempt's
        failure. Costs a pass over the models' tensors and a copy of the RNG states."""
        self._hook.follow(stacklevel=3)
        components = self._components
        if self._modules is None:
            self._modules = self._find_modules()
        self._writes.note(self._tensors(self._modules))
        self._mark = _Mark(
            checkpoint, epoch, step, None if extra is None else dict(extra),
            rng=snapshot_rng() if components.rng else None,
            schedulers={n: copy.deepcopy(s.state_dict()) for n, s in components.schedulers.items()},
            generators={n: g.get_state() for n, g in components.generators.items()},
        )

    def saved(self) -> None:
        """The last noted call saved (or queued its background save)."""
        if self._mark is not None:
            self._mark.saved = True

    def at_failure(self, exc: BaseException) -> None:
        """``exc`` ends the attempt: save the state of the last call if it is still that
        (see the module docs). Logs what it did; raises nothing."""
        mark, self._mark = self._mark, None
        if mark is None or mark.saved:
            return
        why = self._unsaved_because(mark, exc)
        if why is not None:
            log.warning(
                "no save at the failure (%s): %s; the retry resumes at the last committed save",
                type(exc).__name__, why,
            )
            return
        components = self._components
        if mark.rng is not None:
            reset_rng(mark.rng)
        for name, scheduler in components.schedulers.items():
            scheduler.load_state_dict(mark.schedulers[name])
        for name, generator in components.generators.items():
            generator.set_state(mark.generators[name])
        try:
            self._save(mark.checkpoint, mark.epoch, mark.step, mark.extra)
        except Exception as error:
            log.warning("the save at the failure (%s) failed: %s: %s",
                        type(exc).__name__, type(error).__name__, error)
            return
        log.warning("saved the state of step %d at the failure (%s): the retry resumes there",
                    mark.at, type(exc).__name__)

    def _unsaved_because(self, mark: _Mark, exc: BaseException) -> str | None:
        """Why the state is not saved at this failure, or ``None`` when it is."""
        at = mark.at
        if isinstance(exc, CheckpointError):
            return "the checkpoint store failed, and would fail this save too"
        if is_distributed():
            return "under torch.distributed a failing rank cannot run a save's collectives"
        written = self._writes.written(self._tensors(self._find_modules()))
        return None if written is None else f"since the save call at step {at}, {written}"

    def _find_modules(self) -> list[nn.Module]:
        return [sub for model in self._components.models.values() for sub in model.modules()]

    def _tensors(self, modules: list[nn.Module]) -> list[torch.Tensor]:
        """The parameters and buffers of ``modules`` and the scalers' state tensors."""
        tensors = module_tensors(modules)
        for scaler in self._components.scalers.values():
            for name in ("_scale", "_growth_tracker"):
                value = getattr(scaler, name, None)
                if isinstance(value, torch.Tensor):
                    tensors.append(value)
        return tensors
