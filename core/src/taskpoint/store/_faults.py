"""What a failed store call means: worth repeating, or refused credentials.

The object-store clients (botocore, aiohttp, azure-core, requests, fsspec) report the same
few conditions in many shapes: an HTTP status on the exception or on the one it was raised
from, an exception class of their own, an ``OSError`` with or without an ``errno``. This
module reads them all without importing any of those libraries; :mod:`taskpoint.store.store`
decides from its answers whether to retry and what to tell the user.
"""

from __future__ import annotations

import asyncio
import errno
import re

__all__ = ["is_denied", "is_transient", "status_of"]

_PERMANENT_OS_ERRORS = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
)
_PERMANENT_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EINVAL}
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
# Exception classes of the object-store clients (matched by name along the MRO, so that
# none of those libraries has to be importable) that mean "the network or the service
# hiccuped": botocore, aiohttp, azure-core, requests, fsspec.
_TRANSIENT_NAMES = {
    "HTTPClientError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "ResponseStreamingError",
    "IncompleteReadError",
    "ClientOSError",
    "ClientConnectionError",
    "ServerDisconnectedError",
    "ClientPayloadError",
    "ServerTimeoutError",
    "ServiceRequestError",
    "ServiceResponseError",
    "ChunkedEncodingError",
    "FSTimeoutError",
}
# Words in an error's text that mean the store refused who we are: never retried.
_DENIED = re.compile(
    r"\b(Forbidden|Unauthori[sz]ed|AccessDenied|Access Denied|InvalidAccessKeyId|"
    r"SignatureDoesNotMatch|AuthenticationFailed|AuthorizationFailure|InvalidClientTokenId|"
    r"Invalid Credentials)\b",
    re.IGNORECASE,
)


def status_of(exc: BaseException) -> int | None:
    """The HTTP status a client exception carries, when it or the exception it was raised
    from (``__cause__``) carries one. s3fs raises ``OSError`` from botocore's
    ``ClientError``: SeaweedFS's 412 to a conditional write names no ``Condition``, so s3fs
    makes it ``OSError(EINVAL)`` rather than ``FileExistsError``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        status = _own_status(current)
        if status is not None:
            return status
        current = current.__cause__
    return None


def _own_status(exc: BaseException) -> int | None:
    for attr in ("status_code", "status", "code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
        if isinstance(value, str) and value.isdigit() and 100 <= int(value) < 600:
            return int(value)
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(value, int):
            return value
    return None


def is_denied(exc: BaseException) -> bool:
    """Whether ``exc`` says the store refused the credentials or the permission."""
    if isinstance(exc, PermissionError):
        return True
    status = status_of(exc)
    if status in (401, 403):
        return True
    name = type(exc).__name__
    return "Authentication" in name or (
        isinstance(exc, OSError) and exc.errno is None and bool(_DENIED.search(str(exc)))
    )


def is_transient(exc: BaseException) -> bool:
    """Whether a failed store call is worth repeating.

    Transient: connection resets and refusals, timeouts, HTTP 408, 429 and 5xx
    (throttling and server errors) however the client library reports them, and generic
    I/O errors. Permanent: missing objects, refused credentials or permissions, full or
    read-only disks, other HTTP 4xx, and every other exception.
    """
    if is_denied(exc):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    if isinstance(exc, _PERMANENT_OS_ERRORS):
        return False
    status = status_of(exc)
    if status is not None:
        return status in _TRANSIENT_STATUS
    if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__):
        return True
    if isinstance(exc, OSError):
        return exc.errno not in _PERMANENT_ERRNOS
    return False
