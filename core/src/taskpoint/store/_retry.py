"""Repeating a store call through transient failures, and naming what finally failed.

:class:`RetryPolicy` says how often to try, how long to wait between tries, and how long a
try may go without moving a byte before it is abandoned (its stall timeout, applied by
:mod:`taskpoint.store._watchdog`); :func:`run` runs one store operation under it. Transient
failures (:func:`taskpoint.store._faults.is_transient`, an abandoned try among them) are
retried with exponential backoff, each with a WARNING; a permanent failure, or the last
transient one, becomes :class:`~taskpoint.CheckpointStoreError` naming the URL, the number
of tries and how long they took. ``FileNotFoundError`` and taskpoint's own errors pass
through unchanged.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import TypeVar

from taskpoint._env import seconds_from_env
from taskpoint.errors import CheckpointError, CheckpointStoreError
from taskpoint.store._faults import is_denied, is_transient

__all__ = ["STALL_TIMEOUT_ENV", "RetryPolicy", "run"]

STALL_TIMEOUT_ENV = "TASKPOINT_STALL_TIMEOUT"
"""The environment variable that sets :attr:`RetryPolicy.stall_timeout`'s default."""

_DEFAULT_STALL_S = 30.0

log = logging.getLogger("taskpoint.store")
"""The store's logger: its retries are reported under the name they always had."""

T = TypeVar("T")


class RetryPolicy:
    """How store calls retry transient failures, and when a silent try is given up.

    A store call is tried up to ``attempts`` times. Each try on a network store (S3, GCS,
    Azure, any asynchronous fsspec backend) is abandoned once it has moved no bytes for
    ``stall_timeout`` seconds, which counts as a transient failure: a link that goes
    silent (cut, black-holed) costs one stall timeout per try, never an unbounded wait,
    while a large transfer on a slow but working link, which keeps moving bytes, is never
    cut. So a call whose store cannot be reached at all fails, with
    :class:`~taskpoint.CheckpointStoreError`, within :meth:`budget` seconds (153 s by
    default), and an outage shorter than that is carried through.

    Calls on the local disk and on ``memory://`` have no stall timeout.

    Args:
        attempts: total tries per call (1 disables retrying).
        initial: seconds to wait before the first retry; doubles each retry.
        maximum: the longest wait between tries, in seconds.
        stall_timeout: seconds a try may go without moving a byte before it is abandoned
            (and retried); by default ``$TASKPOINT_STALL_TIMEOUT``, else 30. A call that
            moves few bytes (a listing, a manifest) is so limited to this long per try.

    Raises:
        ValueError: ``attempts`` is below 1, a wait is negative, or ``stall_timeout`` (or
            ``$TASKPOINT_STALL_TIMEOUT``) is not a positive number of seconds.
    """

    def __init__(
        self,
        attempts: int = 5,
        initial: float = 0.2,
        maximum: float = 5.0,
        stall_timeout: float | None = None,
    ) -> None:
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1; got {attempts!r}")
        if initial < 0 or maximum < 0:
            raise ValueError(
                f"waits between tries cannot be negative; got initial={initial!r}, "
                f"maximum={maximum!r}"
            )
        if stall_timeout is None:
            stall_timeout = _stall_from_env()
        elif not (isinstance(stall_timeout, (int, float)) and math.isfinite(stall_timeout)
                  and stall_timeout > 0):
            raise ValueError(
                f"stall_timeout must be a positive number of seconds; got {stall_timeout!r}"
            )
        self.attempts = attempts
        self.initial = initial
        self.maximum = maximum
        self.stall_timeout = float(stall_timeout)

    def _key(self) -> tuple[int, float, float, float]:
        return (self.attempts, self.initial, self.maximum, self.stall_timeout)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RetryPolicy):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"RetryPolicy(attempts={self.attempts!r}, initial={self.initial!r}, "
            f"maximum={self.maximum!r}, stall_timeout={self.stall_timeout!r})"
        )

    def budget(self) -> float:
        """The longest, in seconds, a store call spends on a store that moves no bytes at
        all before it raises: every try abandoned after :attr:`stall_timeout`, plus the
        waits between tries. (A try that moves bytes and then stalls lasts longer by the
        time it was moving them.)"""
        waits = sum(self.delay(retry) for retry in range(self.attempts - 1))
        return self.attempts * self.stall_timeout + waits

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0-based)."""
        return float(min(self.maximum, self.initial * (2**retry)))


def _stall_from_env() -> float:
    return seconds_from_env(
        os.environ, STALL_TIMEOUT_ENV, _DEFAULT_STALL_S, "a positive number of seconds"
    )


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
    started = time.monotonic()
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
                took = time.monotonic() - started
                tries = f" after {retry + 1} tries over {took:.1f} s" if retry else (
                    f" after {took:.1f} s" if took >= 1 else ""
                )
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
