"""Re-exports :mod:`taskpoint.runtime.step_boundary` at its documented old path."""

from taskpoint.runtime.step_boundary import (
    ASSUMED_RATE,
    MARGIN_S,
    SAVE_OVERHEAD_S,
    SETTLE_S,
    StepBoundary,
    estimate_save_s,
    record_preempted,
    settle_time,
)

__all__ = [
    "ASSUMED_RATE",
    "MARGIN_S",
    "SAVE_OVERHEAD_S",
    "SETTLE_S",
    "StepBoundary",
    "estimate_save_s",
    "record_preempted",
    "settle_time",
]
