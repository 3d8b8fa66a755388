import io
from typing import Any

from django.conf import settings
from rest_framework.parsers import JSONParser

from telemachus.errors import PayloadTooLarge


class BoundedJSONParser(JSONParser):
    """JSON parser with a body-size limit. DRF reads the request stream directly, which bypasses
    Django's DATA_UPLOAD_MAX_MEMORY_SIZE, so the limit is enforced here: by Content-Length when
    given, and by reading at most limit + 1 bytes otherwise."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict | None = None) -> Any:
        limit = settings.TELEMACHUS_MAX_BODY_BYTES
        request = (parser_context or {}).get("request")
        declared = request.META.get("CONTENT_LENGTH") if request is not None else None
        too_large = PayloadTooLarge(f"Request body exceeds {limit} bytes.", limit=limit)
        if declared and declared.isdigit() and int(declared) > limit:
            raise too_large
        body = stream.read(limit + 1) if stream is not None else b""
        if len(body) > limit:
            raise too_large
        return super().parse(io.BytesIO(body), media_type, parser_context)
