"""``gcp-storage-emulator`` with the insert preconditions real GCS has.

The emulator ignores ``ifGenerationMatch`` on uploads, which GCS uses for conditional
writes (``ifGenerationMatch=0``: create only if absent; ``N``: replace only generation N).
This launcher adds them to its insert handler, answering ``412 Precondition Failed`` as GCS
does, and then runs the emulator unchanged: ``python tests/_gcs_emulator.py start ...``.
"""

from __future__ import annotations

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


objects.insert = insert  # before the server module builds its routes from it

if __name__ == "__main__":
    from gcp_storage_emulator.__main__ import main

    sys.exit(main())
