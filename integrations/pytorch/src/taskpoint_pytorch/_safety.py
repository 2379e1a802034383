"""Check, before anything is written, that a bundle loads with ``weights_only=True``.

``torch.load(weights_only=True)`` rebuilds tensors, Python primitives and plain
containers only. A value outside that set would save fine and then make every resume fail,
so saving refuses it up front and names where it sits.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

__all__ = ["check_weights_only"]

_PRIMITIVES: frozenset[type] = frozenset(
    {type(None), bool, int, float, complex, str, bytes, bytearray}
)
_LEAVES: frozenset[type] = _PRIMITIVES | {
    torch.Size, torch.dtype, torch.device, torch.layout, torch.Tensor, torch.nn.Parameter
}
_MAPPINGS: frozenset[type] = frozenset({dict, collections.OrderedDict, collections.Counter})
_SEQUENCES: frozenset[type] = frozenset({list, tuple, set})

ACCEPTED = (
    "tensors, numbers (int, float, complex, bool), strings, bytes, None, torch.Size, "
    "torch.dtype, torch.device, and lists, tuples, sets and dicts of them"
)
"""What the error message says a bundle may hold."""


def _user_safe_types() -> set[type]:
    """The classes registered with ``torch.serialization.add_safe_globals``."""
    entries = [e[0] if isinstance(e, tuple) else e for e in torch.serialization.get_safe_globals()]
    return {entry for entry in entries if isinstance(entry, type)}


def _describe(kind: type) -> str:
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def check_weights_only(value: Any, where: str) -> None:
    """Raise ``TypeError`` if ``value`` holds anything ``weights_only`` loading rejects.

    Types registered with ``torch.serialization.add_safe_globals`` are accepted too (they
    must be registered again in the process that restores).

    Args:
        value: the object about to be saved.
        where: how to name ``value`` in the error, e.g. ``"extra"``.

    Raises:
        TypeError: naming the first offending entry's path and type.
    """
    stack: list[tuple[str, Any]] = [(where, value)]
    while stack:
        path, item = stack.pop()
        kind = type(item)
        if kind in _LEAVES:
            continue
        if kind in _MAPPINGS:
            for key, child in item.items():
                if type(key) not in _PRIMITIVES:
                    raise TypeError(
                        f"{path} has a key of type {_describe(type(key))} ({key!r}), which "
                        "torch.load(weights_only=True) cannot rebuild; use str or int keys"
                    )
                stack.append((f"{path}[{key!r}]", child))
            continue
        if kind in _SEQUENCES:
            stack.extend((f"{path}[{index}]", child) for index, child in enumerate(item))
            continue
        if kind in _user_safe_types():  # looked up only for a value of no builtin type
            continue
        hint = ""
        if kind.__module__ == "numpy":
            hint = " (convert NumPy values with .item(), .tolist() or torch.from_numpy())"
        elif isinstance(item, torch.Tensor):
            hint = " (a tensor subclass: save a plain tensor, e.g. via .as_subclass(torch.Tensor))"
        raise TypeError(
            f"{path} is a {_describe(kind)}, which torch.load(weights_only=True) cannot "
            f"rebuild, so the checkpoint could never be restored{hint}. A state bundle may "
            f"hold {ACCEPTED}"
        )
