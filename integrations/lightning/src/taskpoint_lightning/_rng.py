"""The global random generators, kept in a Lightning checkpoint and restored per rank
(Lightning's checkpoints carry none): collected and set with Lightning's own helpers, stored
as tensors, lists, numbers and strings, which ``torch.load(weights_only=True)`` accepts.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from taskpoint.integration import all_gather_object, warn

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["RNG_FORMAT", "RNG_STATE_KEY", "load_from_checkpoint", "stash_in_checkpoint"]

log = logging.getLogger(__name__)

RNG_FORMAT = 1
"""Version of the stored layout; a newer one is refused rather than misread."""

RNG_STATE_KEY = "taskpoint_rng"
"""The top-level key of a Lightning checkpoint that holds the random state (0.1 kept it in
the callback's own entry, ``checkpoint["callbacks"][state_key]``, still read)."""


def _storable(states: dict[str, Any]) -> dict[str, Any]:
    """Lightning's collected states as plain values and NumPy arrays (which pickle without
    ``torch.save``, so every rank's can be gathered; :func:`_as_tensors` makes them
    tensors for the checkpoint)."""
    version, internal, gauss_next = states["python"]
    out: dict[str, Any] = {
        "torch": states["torch"].numpy(),
        "python": [int(version), [int(v) for v in internal], gauss_next],
    }
    if "numpy" in states:
        name, keys, pos, has_gauss, cached = states["numpy"]
        out["numpy"] = [
            str(name), np.asarray(keys, dtype=np.int64), int(pos), int(has_gauss), float(cached)
        ]
    if "torch.cuda" in states:
        out["torch.cuda"] = [s.cpu().numpy() for s in states["torch.cuda"]]
    return out


def _as_tensors(value: Any) -> Any:
    """``value`` with every NumPy array made a tensor (what ``weights_only`` loads)."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {k: _as_tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_tensors(v) for v in value]
    return value


def _native(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored state (:func:`_storable`, as tensors) as ``_set_rng_states`` takes it."""
    version, internal, gauss_next = stored["python"]
    out: dict[str, Any] = {
        "torch": stored["torch"].cpu(),
        "python": (version, tuple(internal), gauss_next),
    }
    if "numpy" in stored:
        name, keys, pos, has_gauss, cached = stored["numpy"]
        out["numpy"] = (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    cuda = stored.get("torch.cuda")
    if cuda:
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(cuda) == available:
            out["torch.cuda"] = cuda
        else:
            log.warning(
                "not restoring CUDA random state: the checkpoint holds %d device states but "
                "%d CUDA devices are visible; CUDA random draws will differ from the "
                "uninterrupted run",
                len(cuda), available,
            )
    return out


def _mid_epoch(trainer: pl.Trainer) -> bool:
    """Whether training is inside an epoch whose batches are not all done."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    if progress.is_last_batch:
        return False
    total = trainer.num_training_batches
    return not (total != float("inf") and progress.current.ready >= total)


def stash_in_checkpoint(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Keep every rank's random state in ``checkpoint`` (``on_save_checkpoint``; every rank:
    a collective, as Lightning's checkpoint dump is), beside the callbacks' states: the
    process's, kept by the first taskpoint callback. It holds ``{"format", "mid_epoch",
    "ranks"}``: ``ranks`` by global rank, CUDA's only when training on CUDA (a CPU run never
    starts a CUDA context), ``mid_epoch`` when taken inside an epoch, whose iterator a
    resume makes again."""
    if RNG_STATE_KEY in checkpoint:
        return
    cuda = trainer.strategy.root_device.type == "cuda"
    # Gathered as arrays: pickling a tensor calls torch.save, and a rank that is not
    # writing the checkpoint must not save anything (Lightning's own tests count it).
    local = _storable(_collect_rng_states(include_cuda=cuda))
    ranks = [_as_tensors(state) for state in all_gather_object(local)]
    checkpoint[RNG_STATE_KEY] = {
        "format": RNG_FORMAT, "mid_epoch": _mid_epoch(trainer), "ranks": ranks
    }


def load_from_checkpoint(
    trainer: pl.Trainer, checkpoint: dict[str, Any], state_key: str
) -> dict[str, Any] | None:
    """Restore this rank's random state from ``checkpoint`` (``on_load_checkpoint``), before
    Lightning makes the resumed epoch's data iterator, as the uninterrupted run did.

    Returns:
        The states to set again at ``on_train_start`` when saved inside an epoch (Lightning's
        re-made iterator drew from the generators); else ``None``. A checkpoint without
        random state (another callback's, ``save_weights_only=True``) warns.

    Raises:
        ValueError: the stored layout is from a newer version of this adapter.
    """
    stored = checkpoint.get(RNG_STATE_KEY)
    if stored is None:  # written by taskpoint-lightning 0.1: in the callback's entry
        mine = checkpoint.get("callbacks", {}).get(state_key)
        stored = mine.get(RNG_STATE_KEY) if isinstance(mine, dict) else None
    if stored is None:
        if trainer.is_global_zero:
            message = (
                f"the checkpoint being resumed holds no random state from {state_key}: it "
                "was saved by another callback or with save_weights_only=True, so the "
                "resumed run's random draws will differ from an uninterrupted run's"
            )
            warn(log, message, stacklevel=3)
        return None
    if stored.get("format") != RNG_FORMAT:
        raise ValueError(
            f"the checkpoint's random state has format {stored.get('format')!r}; this "
            f"taskpoint-lightning reads format {RNG_FORMAT}: upgrade taskpoint-lightning to "
            "resume from it"
        )
    ranks, rank = stored["ranks"], trainer.global_rank
    if rank >= len(ranks):
        log.warning(
            "the checkpoint holds random state for %d ranks; rank %d uses rank 0's, so its "
            "random draws will differ from an uninterrupted run", len(ranks), rank,
        )
    states = _native(ranks[rank if rank < len(ranks) else 0])
    _set_rng_states(states)
    return states if stored.get("mid_epoch") else None
