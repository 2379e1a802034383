"""S3 uploads signed with a payload hash computed on a worker thread, not the event loop's.

Over ``http://`` (a MinIO or SeaweedFS on a private network, a test server), and wherever
``payload_signing_enabled`` is set, botocore's SigV4 signs every byte of a request's body:
it reads the body and hashes it with SHA-256 while it signs. aiobotocore signs on the one
event-loop thread that runs every transfer of the process, so the parts of an upload wait
for one another's hashing there, one at a time, and training's threads compete with it.
boto3 hashes each part on its own transfer thread.

Here the SHA-256 is computed where the part's CRC32 already is, on a worker thread, and
signing takes it from the request body (:class:`_Prehashed`), where it was computed from
the very bytes sent. The signer is botocore's own ``S3SigV4Auth`` in every other respect:
a body without a hash, a request botocore would not sign the payload of (HTTPS with a
checksum), a streaming upload, a presigned URL, and every other operation are signed as
botocore signs them. :func:`prepare` chooses it for a client's ``PutObject`` and
``UploadPart`` requests; the transfer calls it before each request, and after a client's
first it finds the handlers registered (by their ids) and changes nothing.

This module imports botocore: the store imports it only for S3 transfers (``taskpoint[s3]``).
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import botocore.auth  # type: ignore[import-untyped]
from isal import isal_zlib

try:
    from botocore.handlers import set_operation_specific_signer  # type: ignore[import-untyped]
except ImportError:  # a botocore without it: its own signer hashes, as before
    set_operation_specific_signer = None

__all__ = ["digests", "payload_signed", "prepare"]

_SIGNER = "taskpoint-s3v4"
"""The signature version name :class:`_Prehashed` is registered under in botocore."""
_OPERATIONS = ("PutObject", "UploadPart")
_HANDLER_ID = "taskpoint-prehashed-payload"


class _Prehashed(botocore.auth.S3SigV4Auth):  # type: ignore[misc]
    """botocore's S3 SigV4 signer, taking the body's SHA-256 from its ``sha256`` attribute
    (hex) where it has one, rather than reading and hashing the body itself.

    Whether the payload is signed at all stays botocore's decision: its own ``payload``
    runs on the request with the body set aside, and answers the hash of an empty body
    exactly where it would have hashed this one (its other answers, ``UNSIGNED-PAYLOAD``
    and the streaming ones, do not depend on the body and are returned as they are).
    """

    def payload(self, request: Any) -> str:
        body = getattr(request, "data", None)
        digest = getattr(body, "sha256", None)
        if not isinstance(digest, str):
            return str(super().payload(request))
        request.data = b""
        try:
            answer = str(super().payload(request))
        finally:
            request.data = body
        return digest if answer == botocore.auth.EMPTY_SHA256_HASH else answer


def _choose(signature_version: Any, context: Any, signing_name: Any, **kwargs: Any) -> Any:
    """A ``choose-signer`` handler, run before botocore's own: botocore's choice, with
    ``s3v4`` replaced by :class:`_Prehashed` for standard (not presigned) requests."""
    chosen = set_operation_specific_signer(context=context, signing_name=signing_name)
    presigning = isinstance(signature_version, str) and signature_version.endswith(
        ("-query", "-presign-post")
    )
    version = signature_version if chosen is None else chosen
    return _SIGNER if version == "s3v4" and not presigning else chosen


def prepare(client: Any) -> None:
    """Have ``client`` (an aiobotocore S3 client) sign ``PutObject`` and ``UploadPart``
    with :class:`_Prehashed`; a second call for the same client changes nothing. Where
    botocore lacks the handler that makes its own choice, nothing changes: its signer hashes
    the body as it always has, and the hash computed for it goes unused."""
    if set_operation_specific_signer is None:
        return
    botocore.auth.AUTH_TYPE_MAPS.setdefault(_SIGNER, _Prehashed)
    events = client.meta.events
    for operation in _OPERATIONS:
        events.register_first(
            f"choose-signer.s3.{operation}", _choose, unique_id=f"{_HANDLER_ID}-{operation}"
        )


def payload_signed(client: Any, checksummed: bool) -> bool:
    """Whether botocore signs the SHA-256 of an upload's body on ``client``: where its
    ``s3`` config's ``payload_signing_enabled`` says so, else over plain HTTP, or over
    HTTPS without a checksum header (``checksummed``)."""
    meta = getattr(client, "meta", None)
    config = getattr(getattr(meta, "config", None), "s3", None) or {}
    explicit = config.get("payload_signing_enabled")
    if explicit is not None:
        return bool(explicit)
    endpoint = str(getattr(meta, "endpoint_url", "") or "")
    return not endpoint.startswith("https") or not checksummed


def digests(
    data: bytes | memoryview, *, crc32: bool, sha256: bool
) -> tuple[str | None, str | None]:
    """``data``'s CRC32 as S3's ``x-amz-checksum-crc32`` carries it (base64, big-endian)
    and its SHA-256 as SigV4 signs it (hex), each only if asked for. Both release the GIL:
    run on a worker thread, the parts of an upload hash in parallel. The CRC32 is ISA-L's,
    the same function as zlib's at about five times its speed (0.02 s for 200 MB against
    0.09 s on the benchmarks' 2-core VM)."""
    crc = (
        base64.b64encode(isal_zlib.crc32(data).to_bytes(4, "big")).decode() if crc32 else None
    )
    return crc, hashlib.sha256(data).hexdigest() if sha256 else None
