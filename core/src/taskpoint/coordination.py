"""Re-exports :mod:`taskpoint.distributed.coordination` at its documented old path."""

from taskpoint.distributed.coordination import (
    COORDINATION,
    Coordinator,
    StoreCoordinator,
    check_agreement,
)

__all__ = ["COORDINATION", "Coordinator", "StoreCoordinator", "check_agreement"]
