"""Re-exports :mod:`taskpoint.runtime.step_boundary` at its documented old path."""

from taskpoint.runtime.step_boundary import (
    MARGIN_S,
    SETTLE_S,
    StepBoundary,
    record_preempted,
    settle_time,
)

__all__ = ["MARGIN_S", "SETTLE_S", "StepBoundary", "record_preempted", "settle_time"]
