"""``gcp-storage-emulator`` with the insert preconditions and exact uploads real GCS has.

The emulator ignores ``ifGenerationMatch`` on uploads, which GCS uses for conditional
writes (``ifGenerationMatch=0``: create only if absent; ``N``: replace only generation N).
This launcher adds them to its insert handler, answering ``412 Precondition Failed`` as GCS
does. It also parses ``multipart/related`` uploads by their boundary: the emulator hands
the body to ``email``'s parser, which takes a trailing ``\r`` of binary content for part
of a line ending and drops it (a 305121-byte object was stored as 305120 bytes). Then it
runs the emulator: ``python tests/_gcs_emulator.py start ...``.
"""

from __future__ import annotations

import json
import sys
from http import HTTPStatus
from typing import Any

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_insert = objects.insert


def _object_name(request: Any) -> str | None:
    if request.query.get("name"):
        return str(request.query["name"][0])
    data = request.data
    meta = data.get("meta") if isinstance(data, dict) else None
    return meta.get("name") if isinstance(meta, dict) else None


def insert(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
    """The emulator's insert, refused with 412 when ``ifGenerationMatch`` does not hold."""
    wanted = request.query.get("ifGenerationMatch")
    name = _object_name(request) if wanted else None
    if wanted and name is not None:
        try:
            current = str(storage.get_file_obj(request.params["bucket_name"], name)["generation"])
        except NotFound:
            current = "0"
        if current != wanted[0]:
            response.status = HTTPStatus.PRECONDITION_FAILED
            message = f"At least one of the pre-conditions you specified did not hold ({name})"
            response.json({"error": {"code": 412, "message": message,
                                     "errors": [{"reason": "conditionNotMet", "message": message}]}})
            return None
    return _insert(request, response, storage, *args, **kwargs)


def _multipart_related(body: bytes, content_type: str) -> dict[str, Any]:
    """The metadata and the exact content of a ``multipart/related`` upload body.

    Line endings are taken from the first delimiter line (gcsfs writes ``\\n``, the RFC
    ``\\r\\n``), so exactly one of them, and no byte of the content, precedes each
    delimiter."""
    boundary = next(
        (p.split("=", 1)[1].strip().strip('"') for p in content_type.split(";")
         if p.strip().startswith("boundary=")),
        None,
    )
    if boundary is None:
        raise ValueError(f"multipart upload without a boundary: {content_type!r}")
    delimiter = b"--" + boundary.encode()
    first = body.index(delimiter) + len(delimiter)
    eol = b"\r\n" if body[first:first + 2] == b"\r\n" else b"\n"
    parts = []
    for chunk in body[first + len(eol):].split(eol + delimiter)[:-1]:
        chunk = chunk[len(eol):] if chunk.startswith(eol) else chunk
        head, _, content = chunk.partition(eol + eol)
        parts.append((head, content))
    (_, meta), (head, content) = parts[0], parts[1]
    kind = next(
        (line.split(b":", 1)[1].strip().decode() for line in head.split(eol)
         if line.lower().startswith(b"content-type:")),
        "application/octet-stream",
    )
    return {"meta": json.loads(meta), "content": content, "content-type": kind}


objects.insert = insert  # before the server module builds its routes from it

from gcp_storage_emulator import server  # noqa: E402  (routes take the insert above)

_read_data = server._read_data


def read_data(request_handler: Any, query: Any) -> Any:
    """The emulator's request body reader, with exact ``multipart/related`` uploads."""
    content_type = request_handler.headers.get("Content-Type") or ""
    if not content_type.startswith("multipart/related"):
        return _read_data(request_handler, query)
    raw = server._decode_raw_data(server._read_raw_data(request_handler), request_handler)
    return _multipart_related(raw, content_type) if raw else None


server._read_data = read_data

if __name__ == "__main__":
    from gcp_storage_emulator.__main__ import main

    sys.exit(main())
