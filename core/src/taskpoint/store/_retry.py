"""Repeating a store call through transient failures, and naming what finally failed.

:class:`RetryPolicy` says how often to try and how long to wait between tries; :func:`run`
runs one store operation under it. Transient failures (:func:`taskpoint.store._faults.is_transient`)
are retried with exponential backoff, each with a WARNING; a permanent failure, or the last
transient one, becomes :class:`~taskpoint.CheckpointStoreError` naming the URL and the
number of tries. ``FileNotFoundError`` and taskpoint's own errors pass through unchanged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from taskpoint.errors import CheckpointError, CheckpointStoreError
from taskpoint.store._faults import is_denied, is_transient

__all__ = ["RetryPolicy", "run"]

log = logging.getLogger("taskpoint.store")
"""The store's logger: its retries are reported under the name they always had."""

T = TypeVar("T")


class RetryPolicy:
    """How store calls retry transient failures.

    Args:
        attempts: total tries per call (1 disables retrying).
        initial: seconds to wait before the first retry; doubles each retry.
        maximum: the longest wait between tries, in seconds.
    """

    def __init__(self, attempts: int = 5, initial: float = 0.2, maximum: float = 5.0) -> None:
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1; got {attempts!r}")
        self.attempts = attempts
        self.initial = initial
        self.maximum = maximum

    def _key(self) -> tuple[int, float, float]:
        return (self.attempts, self.initial, self.maximum)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RetryPolicy):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"RetryPolicy(attempts={self.attempts!r}, initial={self.initial!r}, "
            f"maximum={self.maximum!r})"
        )

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0-based)."""
        return float(min(self.maximum, self.initial * (2**retry)))


def run(
    policy: RetryPolicy,
    what: str,
    url: str,
    fn: Callable[[], T],
    on_missing: Callable[[FileNotFoundError], None],
) -> T:
    """Run ``fn``, retrying transient failures; translate all but FileNotFoundError.

    Args:
        policy: how many tries, and the waits between them.
        what: the operation as a verb, for messages (``"read"``, ``"upload to"``).
        url: what the operation works on, for messages and the error's ``url``.
        fn: the operation.
        on_missing: handed each FileNotFoundError before it propagates; it may raise a
            better error instead (a missing bucket).

    Raises:
        FileNotFoundError: ``fn`` found nothing, and ``on_missing`` raised nothing else.
        CheckpointError: raised by ``fn``, passed on unchanged.
        CheckpointStoreError: ``fn`` failed permanently, or transiently on every try.
    """
    for retry in range(policy.attempts):
        try:
            return fn()
        except FileNotFoundError as exc:
            on_missing(exc)
            raise
        except CheckpointError:
            raise
        except Exception as exc:
            last = retry == policy.attempts - 1
            if not is_transient(exc) or last:
                tries = f" after {retry + 1} tries" if retry else ""
                hint = (
                    " (the store refused the credentials or the permission: check "
                    "storage_options or the credentials in the environment)"
                    if is_denied(exc)
                    else ""
                )
                raise CheckpointStoreError(
                    f"checkpoint store failed to {what} {url}{tries}: "
                    f"{type(exc).__name__}: {exc}{hint}",
                    url=url,
                ) from exc
            delay = policy.delay(retry)
            log.warning(
                "transient store error on %s %s (%s: %s); retrying in %.1fs",
                what, url, type(exc).__name__, exc, delay,
            )
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover
