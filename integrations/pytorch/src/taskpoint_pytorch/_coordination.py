"""``TorchCoordinator``, re-exported from core
(:mod:`taskpoint.distributed.torch_coordination`), where every adapter shares it."""

from __future__ import annotations

from taskpoint.distributed.torch_coordination import TorchCoordinator

__all__ = ["TorchCoordinator"]
