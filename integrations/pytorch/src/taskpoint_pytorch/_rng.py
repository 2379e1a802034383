"""Capture and restore the global random number generators in a ``weights_only`` form.

``random.getstate()`` and ``numpy.random.get_state()`` return tuples holding Python and
NumPy objects that ``torch.load(weights_only=True)`` refuses to rebuild. They are stored
here as tensors, lists, numbers and strings only, and turned back on restore.
A bundle holds every rank's state, in rank order; each rank restores its own
(:func:`restore_rank_rng`).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch
from taskpoint.integration import snapshot_rng

__all__ = ["capture_rng", "restore_rank_rng"]

log = logging.getLogger(__name__)


def _to_plain(value: Any) -> Any:
    """A bit generator's state with its arrays as lists (its other values are plain)."""
    if isinstance(value, np.ndarray):
        return {"ndarray": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {str(k): _to_plain(v) for k, v in value.items()}
    return value


def _from_plain(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"ndarray", "dtype"}:
            return np.asarray(value["ndarray"], dtype=np.dtype(value["dtype"]))
        return {k: _from_plain(v) for k, v in value.items()}
    return value


def capture_rng() -> dict[str, Any]:
    """This process's Python, NumPy, torch CPU and CUDA (every device, once CUDA is in use)
    generator states: core's :func:`taskpoint.integration.snapshot_rng`, in a form a bundle
    holds.

    Returns:
        A dict of tensors, lists, numbers and strings only.
    """
    (version, internal, gauss_next), numpy_state, cpu, cuda = snapshot_rng()
    return {
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": _to_plain(numpy_state),
        "torch": cpu,
        "cuda": cuda,
    }


def restore_rank_rng(states: list[dict[str, Any] | None] | None, rank: int, world: int) -> None:
    """Set the global generators to this rank's entry of a bundle's RNG states (each as
    made by :func:`capture_rng`).

    With as many states as ranks, each rank takes its own; otherwise (the world size
    changed) every rank takes rank 0's, and rank 0 logs a warning that the run will not
    match an uninterrupted one. Nothing happens when ``states`` is empty or ``None`` (saved
    with ``rng=False``) or the chosen entry is ``None``. CUDA states are restored for the
    devices present, from device 0 up; where CUDA is unavailable they are skipped with a
    log line, so a GPU checkpoint resumes on CPU.

    Args:
        states: every saving rank's state, in rank order, as the bundle holds them.
        rank: this process's global rank.
        world: the world size now.
    """
    if not states:
        return
    if len(states) == world:
        state = states[rank]
    else:
        state = states[0]
        if rank == 0:
            log.warning(
                "checkpoint was saved by %d rank(s), this job has %d: every rank "
                "restores rank 0's RNG state, so the run will not match an "
                "uninterrupted one", len(states), world,
            )
    if state is None:
        return
    py = state["python"]
    internal = tuple(int(v) for v in py["internal"].tolist())
    random.setstate((py["version"], internal, py["gauss_next"]))
    np.random.set_state(_from_plain(state["numpy"]))
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda") or []
    if not cuda:
        return
    if not torch.cuda.is_available():
        log.info("CUDA is unavailable here: %d saved CUDA RNG state(s) not restored", len(cuda))
        return
    count = torch.cuda.device_count()
    if count != len(cuda):
        log.info(
            "checkpoint holds CUDA RNG states for %d device(s), this process sees %d: "
            "restoring the first %d", len(cuda), count, min(count, len(cuda)),
        )
    for index, device_state in enumerate(cuda[:count]):
        torch.cuda.set_rng_state(device_state.cpu(), index)
