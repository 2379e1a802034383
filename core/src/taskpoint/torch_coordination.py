"""Re-exports :mod:`taskpoint.distributed.torch_coordination` at its documented old path."""

from taskpoint.distributed.torch_coordination import (
    AnyRank,
    TorchCoordinator,
    TorchrunCoordinator,
    torch_job_coordinator,
)

__all__ = ["AnyRank", "TorchCoordinator", "TorchrunCoordinator", "torch_job_coordinator"]
