"""The route class of every router: JSON request bodies are read strictly.

FastAPI parses a JSON body with :func:`json.loads`, which keeps the last of duplicate keys
and accepts ``NaN`` and any nesting; a proxy or an audit reader may see another document
than the one acted on. Envelopes are read with :mod:`ledger.core.jsonstrict` already; this
holds every other body (disputes, keys, API keys, policies) to the same rules, with the same
400 codes (``duplicate_key``, ``not_utf8``, ``too_deep``, ``malformed_json``).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from ledger.core import jsonstrict


def _is_json(content_type: str | None) -> bool:
    """What FastAPI reads as JSON: no Content-Type, ``*/json`` or ``*/*+json``."""
    if not content_type:
        return True
    subtype = content_type.split(";", 1)[0].strip().lower().rpartition("/")[2]
    return subtype == "json" or subtype.endswith("+json")


class StrictJsonRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:  # no declared body (envelope routes read their own)
            return handler

        async def strict_handler(request: Request) -> Response:
            body = await request.body()  # cached: FastAPI's own read gets the same bytes
            if body and _is_json(request.headers.get("content-type")):
                jsonstrict.loads(body, what="request body")
            return await handler(request)

        return strict_handler
