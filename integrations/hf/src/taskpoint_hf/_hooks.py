"""How the callback reaches past its own hooks: the ``CallbackHandler`` calling it (whose
``on_log`` it wraps, so its figures reach every logging callback) and the ``Trainer`` that
owns it (whose ``train`` it wraps, since the Trainer has no hook for an exception out of
training)."""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler

__all__ = ["FiguresIntoLogs", "LogHook", "OnException", "guard_train"]

_DEPTH = 12
"""How many frames above a hook the handler and the Trainer are looked for."""


def _caller_self(callback: TrainerCallback, accept: Callable[[object], bool]) -> Any:
    """The first ``self`` above the caller's frame that ``accept`` takes, if any."""
    frame = sys._getframe(2)
    for _ in range(_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and owner is not callback and accept(owner):
            return owner
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _holds(handler: object, callback: TrainerCallback) -> bool:
    return isinstance(handler, CallbackHandler) and any(c is callback for c in handler.callbacks)


class FiguresIntoLogs:
    """Stands in for a ``CallbackHandler``'s ``on_log``: adds the figures of ``callback``
    (its ``_add_figures(state, control, logs)``) before any callback sees the logs; the
    Trainer has already kept its copy in ``state.log_history``, which never gets them."""

    def __init__(self, callback: Any, handler: CallbackHandler) -> None:
        self.callback = callback
        self.handler = handler
        self.original = handler.on_log

    def __call__(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float],
        **kwargs: Any,
    ) -> TrainerControl:
        if logs is not None and _holds(self.handler, self.callback):
            self.callback._add_figures(state, control, logs)
        return self.original(args, state, control, logs, **kwargs)  # type: ignore[no-any-return]


class LogHook:
    """Which handler's ``on_log`` adds ``callback``'s figures."""

    def __init__(self, callback: TrainerCallback) -> None:
        self.callback = callback
        self._handler: weakref.ref[CallbackHandler] | None = None

    def hook(self) -> CallbackHandler | None:
        """Hook the ``on_log`` of the handler calling the callback's hook now (once per
        handler), so the figures reach the callbacks listed before it too; the handler."""
        handler: CallbackHandler | None = _caller_self(
            self.callback, lambda o: _holds(o, self.callback)
        )
        if handler is None:
            return None
        current = handler.on_log
        if not (isinstance(current, FiguresIntoLogs) and current.callback is self.callback):
            handler.on_log = FiguresIntoLogs(self.callback, handler)  # type: ignore[method-assign]
        self._handler = weakref.ref(handler)
        return handler

    def hooked(self) -> CallbackHandler | None:
        """The handler whose ``on_log`` adds the figures, while it holds the callback."""
        handler = self._handler() if self._handler is not None else None
        if handler is None or not _holds(handler, self.callback):
            return None
        return handler


OnException = Callable[[BaseException, Any], None]
"""A guard's ``on_exception(exc, trainer)``: ``exc`` is leaving ``trainer.train()``."""


class _GuardedTrain:
    """Stands in for a Trainer's ``train``: when training ends by an exception, each
    guarding callback's ``on_exception`` runs (in the order they guarded) before the
    exception leaves ``train()``."""

    def __init__(self, train: Callable[..., Any]) -> None:
        self.train = train
        self.guards: list[weakref.ref[OnException]] = []
        functools.update_wrapper(self, train)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.train(*args, **kwargs)
        except BaseException as exc:
            for ref in list(self.guards):
                on_exception = ref()
                if on_exception is not None:
                    on_exception(exc, self.train.__self__)  # type: ignore[attr-defined]
            raise


def guard_train(callback: TrainerCallback, on_exception: OnException) -> bool:
    """Make the ``train()`` of the ``transformers.Trainer`` (or subclass, such as TRL's)
    whose handler is calling ``callback``'s hook now call ``on_exception(exc, trainer)`` (a
    bound method, held weakly) before an exception leaves it.

    Returns:
        Whether it already did (so a ``train()`` call under way is guarded); ``False``
        where no Trainer is calling.
    """
    from transformers import Trainer

    trainer = _caller_self(
        callback,
        lambda o: isinstance(o, Trainer) and _holds(getattr(o, "callback_handler", None), callback),
    )
    if trainer is None:
        return False
    current = trainer.__dict__.get("train")
    if not isinstance(current, _GuardedTrain):
        current = _GuardedTrain(trainer.train)
        trainer.train = current
    if any(ref() == on_exception for ref in current.guards):
        return True
    current.guards.append(weakref.WeakMethod(on_exception))
    return False
