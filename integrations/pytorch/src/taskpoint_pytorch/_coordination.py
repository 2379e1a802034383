"""``TorchCoordinator``, re-exported from core (:mod:`taskpoint.torch_coordination`), where
every adapter shares it."""

from __future__ import annotations

from taskpoint.torch_coordination import TorchCoordinator

__all__ = ["TorchCoordinator"]
