"""How the store classifies the object-store clients' own exceptions (no server needed).

The fault tests in ``test_object_stores.py`` show the end-to-end behaviour; these pin the
classification of each client's exception types, built as the libraries build them.
"""

from __future__ import annotations

import errno

import pytest
from taskpoint.store.store import is_transient
from taskpoint.store.transfer import Transfer


def botocore_errors() -> list[tuple[BaseException, bool]]:
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        EndpointConnectionError,
        ReadTimeoutError,
    )

    def client_error(code: str, status: int) -> ClientError:
        response = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
        return ClientError(response, "PutObject")  # type: ignore[arg-type]

    return [
        (ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), True),
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), True),
        (ConnectionClosedError(endpoint_url="http://127.0.0.1:1"), True),
        (client_error("SlowDown", 503), True),
        (client_error("InternalError", 500), True),
        (client_error("AccessDenied", 403), False),
        (client_error("InvalidArgument", 400), False),
    ]


def azure_errors() -> list[tuple[BaseException, bool]]:
    from azure.core.exceptions import (
        ClientAuthenticationError,
        HttpResponseError,
        ResourceNotFoundError,
        ServiceRequestError,
        ServiceResponseError,
    )

    def status(cls: type[HttpResponseError], code: int) -> HttpResponseError:
        error = cls(message=f"status {code}")
        error.status_code = code
        return error

    return [
        (ServiceRequestError("connection refused"), True),
        (ServiceResponseError("connection reset"), True),
        (status(HttpResponseError, 503), True),
        (status(HttpResponseError, 429), True),
        (status(ClientAuthenticationError, 403), False),
        (status(HttpResponseError, 409), False),
        (ResourceNotFoundError("no such blob"), False),
    ]


def gcsfs_errors() -> list[tuple[BaseException, bool]]:
    from gcsfs.retry import HttpError

    return [
        (HttpError({"code": 503, "message": "Backend Error"}), True),
        (HttpError({"code": 429, "message": "rateLimitExceeded"}), True),
        (HttpError({"code": 400, "message": "bad request"}), False),
        (OSError("Forbidden: b/bucket/o\nno access"), False),  # what gcsfs raises for 403
    ]


def aiohttp_errors() -> list[tuple[BaseException, bool]]:
    import aiohttp

    return [
        (aiohttp.ServerDisconnectedError(), True),
        (aiohttp.ClientPayloadError("truncated"), True),
        (aiohttp.ServerTimeoutError(), True),
    ]


CASES = {
    "botocore": botocore_errors,
    "azure": azure_errors,
    "gcsfs": gcsfs_errors,
    "aiohttp": aiohttp_errors,
}


@pytest.mark.parametrize("library", sorted(CASES))
def test_client_exceptions_are_classified(library: str) -> None:
    for exc, transient in CASES[library]():
        assert is_transient(exc) is transient, f"{type(exc).__name__}: {exc}"


def test_s3fs_translated_errors_are_classified() -> None:
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    def translated(code: str, status: int) -> BaseException:
        response = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
        return translate_boto_error(ClientError(response, "PutObject"))  # type: ignore[arg-type,no-any-return]

    assert is_transient(translated("InternalError", 500))
    assert not is_transient(translated("InvalidAccessKeyId", 403))
    assert not is_transient(translated("NoSuchBucket", 404))
    assert not is_transient(OSError(errno.ENOSPC, "disk full"))


def test_transfer_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASKPOINT_PART_SIZE", str(16 * 2**20))
    monkeypatch.setenv("TASKPOINT_TRANSFER_CONCURRENCY", "3")
    assert Transfer.from_env() == Transfer(part_size=16 * 2**20, concurrency=3)
    monkeypatch.setenv("TASKPOINT_PART_SIZE", "lots")
    with pytest.raises(ValueError, match="TASKPOINT_PART_SIZE must be a whole number; got 'lots'"):
        Transfer.from_env()
    with pytest.raises(ValueError, match="concurrency must be at least 1"):
        Transfer(concurrency=0)


def test_s3_parts_grow_to_fit_any_object_in_ten_thousand_parts() -> None:
    transfer = Transfer()
    assert transfer.s3_part_size() == transfer.s3_part_size(2**30) == 8 * 2**20
    assert Transfer(part_size=2**20).s3_part_size() == 5 * 2**20  # S3's minimum
    for size in (8 * 2**20 * 10_000 + 1, 500 * 2**30, 5 * 2**40):  # past 10,000 x 8 MiB
        part = transfer.s3_part_size(size)
        assert part > 8 * 2**20
        assert -(-size // part) <= 10_000 < -(-size // (part - 1))
