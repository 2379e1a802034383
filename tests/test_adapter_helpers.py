"""Small helpers ``taskpoint.integration`` gives adapters so that each states a rule once:
:func:`warn` (a warning both logged and issued) and :func:`check_wait` (a wait in seconds
or no limit)."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import taskpoint
from taskpoint.integration import check_wait, warn

log = logging.getLogger("taskpoint.test_adapter_helpers")


def _adapter_function() -> None:
    """Stands in for an adapter's public function that warns from a helper."""
    _helper()


def _helper() -> None:
    warn(log, "100% of the rank's state is missing")


def test_warn_logs_and_issues_a_taskpoint_warning_blaming_the_callers_caller(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger=log.name), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _adapter_function()
    assert [r.getMessage() for r in caplog.records] == ["100% of the rank's state is missing"]
    (warning,) = seen
    assert warning.category is taskpoint.TaskpointWarning
    assert str(warning.message) == "100% of the rank's state is missing"
    assert warning.filename == __file__
    assert warning.lineno == _adapter_function.__code__.co_firstlineno + 2  # its call of _helper


def test_warn_takes_a_stacklevel_counted_from_its_caller() -> None:
    with pytest.warns(taskpoint.TaskpointWarning) as seen:
        warn(log, "here", stacklevel=1)
    assert seen[0].filename == __file__


@pytest.mark.parametrize("value", [None, 0, 0.5, 60, math.inf])
def test_check_wait_takes_seconds_of_at_least_zero_or_none(value: float | None) -> None:
    checked = check_wait(value, "preempt_timeout")
    assert checked == value and (checked is None or isinstance(checked, float))


@pytest.mark.parametrize("value", [-1, -0.5, math.nan, True, "60", [60]])
def test_check_wait_names_the_argument_and_the_value(value: object) -> None:
    with pytest.raises(ValueError, match=r"preempt_timeout must be a number of seconds >= 0 or None; got "):
        check_wait(value, "preempt_timeout")
