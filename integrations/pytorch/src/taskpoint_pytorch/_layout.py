"""What a state bundle holds, and whether a restored one fits the state restoring it.

A bundle is one ``torch.save`` file (:data:`STATE_FILE`) of plain tensors, numbers, strings
and containers: ``layout`` and ``version`` name its format, one entry per component kind
(:data:`KINDS`) maps component names to their state, and the counters, extra state, RNG
states and world size follow (:data:`REQUIRED`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from taskpoint.integration import rank_and_size
from torch import nn

from taskpoint_pytorch._errors import StateLayoutError, StateMismatchError

__all__ = [
    "KINDS",
    "LAYOUT",
    "LAYOUT_VERSION",
    "STATE_FILE",
    "check_fit",
    "check_layout",
]

log = logging.getLogger(__name__)

LAYOUT = "taskpoint-pytorch/state"
"""The ``layout`` tag every bundle carries."""
LAYOUT_VERSION = 1
"""The newest bundle layout version this package writes and reads."""
STATE_FILE = "state.pt"
"""The bundle's file name in the store (and inside a restored directory)."""

KINDS = ("models", "optimizers", "schedulers", "scalers", "generators")
"""The component kinds, each a mapping of names to states in a bundle."""
REQUIRED = frozenset({*KINDS, "rng", "epoch", "step", "extra", "world_size", "save_id"})
"""The entries every bundle has."""
_LISTED = 10


def listed(items: list[str], show: Callable[[str], str] = repr) -> str:
    """``items`` for a message, each through ``show``: the first few, and how many more."""
    more = f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
    return ", ".join(show(item) for item in items[:_LISTED]) + more


def check_layout(
    bundle: Any, where: str, parts: Mapping[str, Mapping[str, Any]], rng: bool
) -> None:
    """Check ``bundle`` is a bundle of this layout, a version this package reads, with
    every entry and the same component names as ``parts`` (``where`` names it in messages).

    Raises:
        StateLayoutError: it is not; the message says what it holds instead.
    """
    if not isinstance(bundle, dict) or "layout" not in bundle:
        held = (
            f"a dict with keys [{listed(sorted(map(str, bundle)))}]"
            if isinstance(bundle, dict)
            else f"a {type(bundle).__name__}"
        )
        raise StateLayoutError(
            f"{where!r} is not a TaskpointState bundle: it holds {held} and no "
            f"'layout' entry. A file saved with plain torch.save is loaded with torch.load; "
            f"TaskpointState restores bundles of layout {LAYOUT!r} only"
        )
    if bundle["layout"] != LAYOUT:
        raise StateLayoutError(
            f"{where!r} has bundle layout {bundle['layout']!r}; this TaskpointState "
            f"reads {LAYOUT!r}"
        )
    version = bundle.get("version")
    if not isinstance(version, int) or not 1 <= version <= LAYOUT_VERSION:
        raise StateLayoutError(
            f"{where!r} has {LAYOUT!r} version {version!r}; this taskpoint-pytorch "
            f"reads versions 1 to {LAYOUT_VERSION}: upgrade taskpoint-pytorch to restore it"
        )
    missing = sorted(REQUIRED - set(bundle))
    if missing:
        raise StateLayoutError(
            f"{where!r} is a damaged {LAYOUT!r} bundle: it lacks the entries {missing}"
        )
    differences = []
    for kind in KINDS:
        saved = sorted(bundle[kind])
        mine = sorted(parts[kind])
        if saved != mine:
            differences.append(f"{kind}: checkpoint has {saved}, this state has {mine}")
    if differences:
        raise StateLayoutError(
            f"{where!r} holds other components than this TaskpointState ("
            + "; ".join(differences)
            + "). Restore into a TaskpointState built with the same names"
        )
    if rng and bundle.get("rng") is None and rank_and_size()[0] == 0:
        log.warning(
            "checkpoint %s was saved without RNG states (rng=False): the resumed run "
            "will not draw the same random numbers as an uninterrupted one", where,
        )


def check_fit(bundle: dict[str, Any], parts: Mapping[str, Mapping[str, Any]]) -> None:
    """Check each model's keys and shapes, each optimizer's parameter groups and each
    enabled scaler against ``bundle`` (models in ``parts`` unwrapped).

    Raises:
        StateMismatchError: one does not fit; names the component and the keys.
    """
    for name, module in parts["models"].items():
        _check_model(f"models[{name!r}]", module, bundle["models"][name])
    for name, optimizer in parts["optimizers"].items():
        _check_optimizer(f"optimizers[{name!r}]", optimizer, bundle["optimizers"][name])
    for name, scaler in parts["scalers"].items():
        if scaler.is_enabled() and not bundle["scalers"][name]:
            raise StateMismatchError(
                f"scalers[{name!r}] is enabled but was saved from a disabled GradScaler "
                "(its state is empty); enable or disable it as when it was saved",
                component=f"scalers[{name!r}]",
            )


def _check_model(component: str, module: nn.Module, saved: Mapping[str, Any]) -> None:
    current = module.state_dict()
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for key in sorted(set(current) & set(saved)):
        have, got = current[key], saved[key]
        if isinstance(have, torch.Tensor) and isinstance(got, torch.Tensor) and have.shape != got.shape:
            shapes[key] = (tuple(got.shape), tuple(have.shape))
    if not (missing or unexpected or shapes):
        return
    parts = []
    if missing:
        parts.append(f"in the model but not the checkpoint: [{listed(missing)}]")
    if unexpected:
        parts.append(f"in the checkpoint but not the model: [{listed(unexpected)}]")
    if shapes:
        differ = listed(list(shapes), lambda k: f"{k!r} saved {shapes[k][0]} vs model {shapes[k][1]}")
        parts.append(f"shapes differ: {differ}")
    raise StateMismatchError(
        f"{component} does not match the checkpoint: " + "; ".join(parts)
        + ". Build the model as it was when the checkpoint was saved",
        component=component,
        missing=missing,
        unexpected=unexpected,
        shapes=shapes,
    )


def _check_optimizer(component: str, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    groups = saved.get("param_groups")
    if not isinstance(groups, list):
        raise StateMismatchError(
            f"{component}: the checkpoint's optimizer state has no param_groups list",
            component=component,
        )
    saved_sizes = [len(group.get("params", [])) for group in groups]
    current_sizes = [len(group["params"]) for group in optimizer.param_groups]
    if saved_sizes != current_sizes:
        raise StateMismatchError(
            f"{component} has parameter groups of sizes {current_sizes}, the checkpoint's "
            f"optimizer had {saved_sizes}; build the optimizer over the same parameters",
            component=component,
        )
