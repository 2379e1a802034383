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
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from taskpoint_pytorch._errors import StateMismatchError
from taskpoint_pytorch._layout import LAYOUT, LAYOUT_VERSION
from taskpoint_pytorch._rng import restore_rank_rng

__all__ = ["Components", "unwrap"]

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


def _named(
    arg: str, default: str, value: T | Mapping[str, T] | None, check: Callable[[str, Any], None]
) -> dict[str, T]:
    """``value`` as a dict of names to objects: a mapping as given, one object under
    ``default``, ``None`` as empty; ``check`` runs on each object.

    Raises:
        ValueError: a name in the mapping is empty or not a string.
    """
    if value is None:
        return {}
    if isinstance(value, Mapping):
        named: dict[str, T] = {}
        for name, item in value.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"{arg} names must be non-empty strings; got {name!r}")
            check(f"{arg}[{name!r}]", item)
            named[name] = item
        return named
    check(arg, value)
    return {default: value}


def _is_a(kind: type | tuple[type, ...], expected: str) -> Callable[[str, Any], None]:
    """A check raising ``TypeError`` for a value that is not a ``kind``."""

    def check(where: str, value: Any) -> None:
        if not isinstance(value, kind):
            raise TypeError(
                f"{where} must be {expected} (or pass a mapping of names to them); "
                f"got {type(value).__name__}"
            )

    return check


def _is_stateful(where: str, value: Any) -> None:
    """Raise ``TypeError`` unless ``value`` has ``state_dict()`` and ``load_state_dict()``."""
    if not (callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )):
        raise TypeError(
            f"{where} must have state_dict() and load_state_dict() (an LR scheduler, say); "
            f"got {type(value).__name__}"
        )


class Components:
    """The named objects of one state, checked at construction, and ``rng``: whether the
    global RNGs are saved too (see ``TaskpointState``'s arguments of the same names).

    Raises:
        TypeError: an object of the wrong kind.
        ValueError: an empty or non-string name in a mapping.
    """

    def __init__(
        self,
        model: nn.Module | Mapping[str, nn.Module] | None,
        optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer] | None,
        scheduler: Any,  # Stateful objects, or a mapping of names to them
        scaler: torch.amp.GradScaler | Mapping[str, torch.amp.GradScaler] | None,
        generators: Mapping[str, torch.Generator] | None,
        rng: bool,
    ) -> None:
        self.models = _named("model", "model", model, _is_a(nn.Module, "a torch.nn.Module"))
        self.optimizers = _named(
            "optimizer", "optimizer", optimizer,
            _is_a(torch.optim.Optimizer, "a torch.optim.Optimizer"),
        )
        self.schedulers: dict[str, Any] = _named("scheduler", "scheduler", scheduler, _is_stateful)
        self.scalers = _named(
            "scaler", "scaler", scaler, _is_a(torch.amp.GradScaler, "a torch.amp.GradScaler")
        )
        if generators is not None and not isinstance(generators, Mapping):
            raise TypeError(
                "generators must be a mapping of names to torch.Generator objects; "
                f"got {type(generators).__name__}"
            )
        self.generators: dict[str, torch.Generator] = _named(
            "generators", "generator", generators, _is_a(torch.Generator, "a torch.Generator")
        )
        self.rng = bool(rng)  # whether the global RNGs are saved and restored

    def unwrapped_models(self) -> dict[str, nn.Module]:
        """The models by name, each without its wrappers (see :func:`unwrap`)."""
        return {name: unwrap(module) for name, module in self.models.items()}

    def by_kind(self) -> dict[str, Mapping[str, Any]]:
        """Every kind's objects by name, models unwrapped (what ``_layout`` checks against)."""
        return {
            "models": self.unwrapped_models(),
            "optimizers": self.optimizers,
            "schedulers": self.schedulers,
            "scalers": self.scalers,
            "generators": self.generators,
        }

    def layout(self) -> dict[str, list[str]]:
        """The component names per kind, sorted."""
        return {kind: sorted(objects) for kind, objects in self.by_kind().items()}

    def device(self) -> torch.device:
        """Where the first model's first parameter (or buffer) lives; CPU without one."""
        for module in self.models.values():
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                return tensor.device
        return torch.device("cpu")

    def state_bytes(self) -> int:
        """The bytes of the models' and optimizers' tensors: about what a save writes."""
        total = 0
        for state in itertools.chain(
            (unwrap(m).state_dict() for m in self.models.values()),
            (o.state_dict() for o in self.optimizers.values()),
        ):
            stack: list[Any] = [state]
            while stack:
                item = stack.pop()
                if isinstance(item, torch.Tensor):
                    total += item.numel() * item.element_size()
                elif isinstance(item, Mapping):
                    stack.extend(item.values())
                elif isinstance(item, (list, tuple)):
                    stack.extend(item)
        return total

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
        ``tensors`` the models' and optimizers' entries are empty (DCP saves them)."""
        return {
            "layout": LAYOUT,
            "version": LAYOUT_VERSION,
            "models": {
                n: unwrap(m).state_dict() if tensors else {} for n, m in self.models.items()
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

    def load(self, bundle: dict[str, Any], rank: int, world: int, *, tensors: bool = True) -> None:
        """Load a bundle that passed ``_layout``'s checks into the objects, and this rank's
        RNG state into the global generators (with ``rng``; ``_rng.restore_rank_rng``);
        without ``tensors`` not the models' and optimizers' (DCP loaded them).

        Raises:
            StateMismatchError: an optimizer cannot take its saved state.
        """
        for name, module in self.models.items() if tensors else ():
            unwrap(module).load_state_dict(bundle["models"][name])
        for name, optimizer in self.optimizers.items() if tensors else ():
            try:
                optimizer.load_state_dict(bundle["optimizers"][name])
            except (ValueError, KeyError, RuntimeError) as exc:
                raise StateMismatchError(
                    f"optimizers[{name!r}] cannot take the checkpoint's state: {exc}",
                    component=f"optimizers[{name!r}]",
                ) from exc
        stateful: dict[str, Mapping[str, Any]] = {
            "schedulers": self.schedulers, "scalers": self.scalers
        }
        for kind, objects in stateful.items():
            for name, obj in objects.items():
                obj.load_state_dict(bundle[kind][name])
        for name, generator in self.generators.items():
            generator.set_state(bundle["generators"][name].cpu())
        if self.rng:
            restore_rank_rng(bundle.get("rng"), rank, world)
