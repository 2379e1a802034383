"""What a save at a failure needs from a torch job's live state: whether its tensors were
written since the last step boundary (:class:`WriteWatch`), and the global random number
generators' states to set back to that boundary's (:func:`snapshot_rng`, :func:`reset_rng`).

An adapter that saves at a failure (``taskpoint_pytorch``'s ``save_on_exception``,
``taskpoint_hf``'s) notes the state at each step boundary, where it is consistent. When an
exception ends the attempt, a save there is right only if nothing was written since: the
RNGs are set back (the failed step may have drawn from them already) and the state is saved
as that boundary's save would have saved it. The tensors are too large to copy at every
step, so a write is told from their version counters, which every in-place write bumps, and
from a pre-hook on each optimizer's ``step`` (fused optimizers included). A write that
bypasses the counters is not seen: one through a tensor's ``.data``, or a kernel that
updates the parameters without an optimizer ``step`` call.

torch (and NumPy, when present) are imported on first use: core never depends on them.
"""

from __future__ import annotations

import importlib
import random
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["WriteWatch", "module_tensors", "reset_rng", "snapshot_rng"]


def module_tensors(modules: Iterable[Any]) -> list[Any]:
    """The parameters and buffers of each of ``modules`` (``torch.nn.Module`` objects, each
    listed with its submodules: ``[m for model in models for m in model.modules()]``), read
    from the modules' own tables: walking the module tree at every step costs ten times as
    much, so a caller finds the modules once and passes them at every call."""
    return [
        t for module in modules for table in (module._parameters, module._buffers)
        for t in table.values() if t is not None
    ]


class WriteWatch:
    """Tells whether tensors were written since :meth:`note` (see the module's docs).

    Args:
        optimizers: the job's optimizers (``torch.optim.Optimizer`` objects, or wrappers
            holding one as ``.optimizer``, as accelerate's do); each gets a step pre-hook,
            which holds this watch weakly. More can be added with :meth:`watch`.
    """

    def __init__(self, optimizers: Iterable[Any] = ()) -> None:
        self._stepped = False
        self._hooked: weakref.WeakSet[Any] = weakref.WeakSet()
        self._tensors: list[Any] | None = None
        self._versions = 0
        for optimizer in optimizers:
            self.watch(optimizer)

    def watch(self, optimizer: Any) -> None:
        """Count a ``step`` of ``optimizer`` (or of the torch optimizer it wraps) as a
        write; once per optimizer object."""
        while hasattr(getattr(optimizer, "optimizer", None), "register_step_pre_hook"):
            optimizer = optimizer.optimizer  # the wrapped one: a wrapper's hooks may never run
        if not hasattr(optimizer, "register_step_pre_hook") or optimizer in self._hooked:
            return
        this = weakref.ref(self)  # an optimizer must not keep a dropped watch alive

        def stepping(optimizer: object, args: object, kwargs: object) -> None:
            watch = this()
            if watch is not None:
                watch._stepped = True

        optimizer.register_step_pre_hook(stepping)
        self._hooked.add(optimizer)

    def note(self, tensors: Sequence[Any]) -> None:
        """A step boundary: remember ``tensors`` (the state's parameters, buffers and other
        tensors an optimizer or scaler writes) and their version counters. Costs a pass
        over them (about 0.4 µs a tensor)."""
        self._stepped = False
        self._tensors = list(tensors)
        self._versions = sum(t._version for t in self._tensors)

    def written(self, tensors: Sequence[Any]) -> str | None:
        """Why the state is not as :meth:`note` saw it, or ``None`` when it is: an
        optimizer stepped, ``tensors`` are other tensors than those noted (one was added
        or replaced), or one of them was written in place. Before any :meth:`note`: says
        so."""
        noted = self._tensors
        if noted is None:
            return "no step boundary was noted"
        if self._stepped:
            return "an optimizer stepped"
        if len(tensors) != len(noted) or any(a is not b for a, b in zip(tensors, noted, strict=True)):
            return "the state's tensors are other tensors (one was added or replaced)"
        if sum(t._version for t in tensors) != self._versions:
            return (
                "a tensor of the state was written in place (a forward pass in training "
                "mode updates BatchNorm's statistics)"
            )
        return None


def _numpy() -> Any:
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None


def _cuda_states(torch: Any) -> list[Any]:
    """Every CUDA device's generator state once CUDA is in use (asking earlier would start
    a context per device); empty before."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return []
    return [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]


def snapshot_rng() -> tuple[Any, ...]:
    """The global generators' states as they are now: Python's, NumPy's (when installed),
    torch's CPU one and every CUDA device's (once CUDA is in use); to set back in this
    process with :func:`reset_rng` (tens of microseconds)."""
    torch = importlib.import_module("torch")
    numpy = _numpy()
    numpy_state = numpy.random.get_state(legacy=False) if numpy is not None else None
    return random.getstate(), numpy_state, torch.get_rng_state(), _cuda_states(torch)


def reset_rng(snapshot: tuple[Any, ...]) -> None:
    """Set the global generators back to a :func:`snapshot_rng` of this process."""
    torch = importlib.import_module("torch")
    python, numpy_state, cpu, cuda = snapshot
    random.setstate(python)
    if numpy_state is not None:
        _numpy().random.set_state(numpy_state)
    torch.set_rng_state(cpu)
    for index, device_state in enumerate(cuda):
        torch.cuda.set_rng_state(device_state, index)
