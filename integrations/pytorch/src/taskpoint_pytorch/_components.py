"""The objects one ``TaskpointState`` saves and restores, and their state in a bundle.

Each kind (``_layout.KINDS``) maps names to objects: models,
optimizers, LR schedulers (anything with ``state_dict``/``load_state_dict``), AMP grad
scalers and ``torch.Generator`` objects; beside them, whether the global RNGs are saved.
:meth:`Components.bundle` takes their state into a bundle, :meth:`Components.load` puts a
bundle's state back into them. Models are unwrapped first (DDP, ``DataParallel``,
``torch.compile``), so a bundle resumes with or without the wrapper.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from taskpoint_pytorch._errors import StateMismatchError
from taskpoint_pytorch._layout import KINDS, LAYOUT, LAYOUT_VERSION
from taskpoint_pytorch._rng import restore_rank_rng
from taskpoint_pytorch._safety import check_weights_only

__all__ = ["Components", "tensors_in", "unwrap"]

T = TypeVar("T")


def unwrap(module: nn.Module) -> nn.Module:
    """The module whose state dict has no wrapper prefixes (DDP, DataParallel, compile)."""
    while True:
        inner: object = None
        if isinstance(module, (DistributedDataParallel, DataParallel)):
            inner = module.module
        elif type(module).__name__ == "OptimizedModule":
            inner = getattr(module, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value`` (a tensor, or dicts, lists, tuples and sets holding them),
    depth first, each as often as it appears."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for child in value.values():
            yield from tensors_in(child)
    elif isinstance(value, (list, tuple, set)):
        for child in value:
            yield from tensors_in(child)


def _named(
    arg: str,
    default: str,
    value: T | Mapping[str, T] | None,
    kind: type | None = None,
    expected: str = "",
) -> dict[str, T]:
    """``value`` as a dict of names to objects: a mapping as given, one object under
    ``default``, ``None`` as empty.

    Raises:
        ValueError: a name in the mapping is empty or not a string.
        TypeError: an object is not a ``kind`` (named ``expected`` in the message), or
            without ``kind`` lacks ``state_dict()`` or ``load_state_dict()``; the
            message names it (``arg``, or ``arg[name]``).
    """
    if value is None:
        return {}
    one = not isinstance(value, Mapping)
    named: dict[str, T] = dict(value) if isinstance(value, Mapping) else {default: value}
    for name, item in named.items():
        if not one and (not isinstance(name, str) or not name):
            raise ValueError(f"{arg} names must be non-empty strings; got {name!r}")
        fits = isinstance(item, kind) if kind is not None else all(
            callable(getattr(item, method, None)) for method in ("state_dict", "load_state_dict")
        )
        if not fits:
            need = (
                "have state_dict() and load_state_dict() (an LR scheduler, say)" if kind is None
                else f"be {expected} (or pass a mapping of names to them)"
            )
            raise TypeError(
                f"{arg if one else f'{arg}[{name!r}]'} must {need}; got {type(item).__name__}"
            )
    return named


class Components:
    """The named objects of one state, checked at construction (raising ``TaskpointState``'s
    ``TypeError`` or ``ValueError``: :func:`_named`), and ``rng``: whether the global RNGs
    are saved too (see ``TaskpointState``'s arguments of the same names)."""

    def __init__(
        self,
        model: nn.Module | Mapping[str, nn.Module] | None,
        optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer] | None,
        scheduler: Any,  # Stateful objects, or a mapping of names to them
        scaler: torch.amp.GradScaler | Mapping[str, torch.amp.GradScaler] | None,
        generators: Mapping[str, torch.Generator] | None,
        rng: bool,
    ) -> None:
        models = _named("model", "model", model, nn.Module, "a torch.nn.Module")
        self.models = {name: unwrap(module) for name, module in models.items()}  # see unwrap
        self.optimizers = _named(
            "optimizer", "optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer"
        )
        self.schedulers: dict[str, Any] = _named("scheduler", "scheduler", scheduler)
        self.scalers = _named(
            "scaler", "scaler", scaler, torch.amp.GradScaler, "a torch.amp.GradScaler"
        )
        if generators is not None and not isinstance(generators, Mapping):
            raise TypeError(
                "generators must be a mapping of names to torch.Generator objects; "
                f"got {type(generators).__name__}"
            )
        self.generators: dict[str, torch.Generator] = _named(
            "generators", "generator", generators, torch.Generator, "a torch.Generator"
        )
        self.rng = bool(rng)  # whether the global RNGs are saved and restored

    def by_kind(self) -> dict[str, Mapping[str, Any]]:
        """Every kind's objects by name (what ``_layout`` checks against)."""
        return {kind: getattr(self, kind) for kind in KINDS}

    def device(self) -> torch.device:
        """Where the first model's first parameter (or buffer) lives; CPU without one."""
        for module in self.models.values():
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                return tensor.device
        return torch.device("cpu")

    def state_bytes(self) -> int:
        """The bytes of the models' and optimizers' tensors: about what a save writes."""
        states = [m.state_dict() for m in self.models.values()]
        states += [o.state_dict() for o in self.optimizers.values()]
        return sum(t.numel() * t.element_size() for t in tensors_in(states))

    def bundle(
        self,
        epoch: int,
        step: int,
        extra: dict[str, Any],
        rng_states: list[dict[str, Any] | None],
        world: int,
        *,
        tensors: bool = True,
    ) -> dict[str, Any]:
        """A new bundle (a fresh ``save_id``, entries in the layout's order) of the objects'
        current state, not copied, and the checked counters, ``extra``, every rank's RNG
        state in rank order (kept only with ``rng``) and the world size. Without
        ``tensors`` the models' and optimizers' entries are empty (DCP saves them).

        Raises:
            TypeError: an entry holds a value ``torch.load(weights_only=True)`` would not
                rebuild (``_safety.check_weights_only``), so the bundle could never restore.
        """
        bundle = {
            "layout": LAYOUT,
            "version": LAYOUT_VERSION,
            "models": {
                n: m.state_dict() if tensors else {} for n, m in self.models.items()
            },
            "optimizers": {
                n: o.state_dict() if tensors else {} for n, o in self.optimizers.items()
            },
            "schedulers": {n: s.state_dict() for n, s in self.schedulers.items()},
            "scalers": {n: s.state_dict() for n, s in self.scalers.items()},
            "generators": {n: g.get_state() for n, g in self.generators.items()},
            "rng": rng_states if self.rng else None,
            "epoch": epoch,
            "step": step,
            "extra": extra,
            "world_size": world,
            "save_id": uuid.uuid4().hex,
            "torch_version": str(torch.__version__),
        }
        for key, value in bundle.items():
            check_weights_only(value, key)
        return bundle

    def load(self, bundle: dict[str, Any], rank: int, world: int, *, tensors: bool = True) -> None:
        """Load a bundle that passed ``_layout``'s checks into the objects, and this rank's
        RNG state into the global generators (with ``rng``; ``_rng.restore_rank_rng``);
        without ``tensors`` not the models' and optimizers' (DCP loaded them).

        Raises:
            StateMismatchError: an optimizer cannot take its saved state.
        """
        for name, module in self.models.items() if tensors else ():
            module.load_state_dict(bundle["models"][name])
        for name, optimizer in self.optimizers.items() if tensors else ():
            try:
                optimizer.load_state_dict(bundle["optimizers"][name])
            except (ValueError, KeyError, RuntimeError) as exc:
                raise StateMismatchError(
                    f"optimizers[{name!r}] cannot take the checkpoint's state: {exc}",
                    component=f"optimizers[{name!r}]",
                ) from exc
        for kind, objects in (("schedulers", self.schedulers), ("scalers", self.scalers)):
            for name, obj in objects.items():
                obj.load_state_dict(bundle[kind][name])
        for name, generator in self.generators.items():
            generator.set_state(bundle["generators"][name].cpu())
        if self.rng:
            restore_rank_rng(bundle.get("rng"), rank, world)
