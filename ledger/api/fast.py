"""What the ASGI fast paths share (:class:`~ledger.api.routes.envelopes.IngestFastPath`,
:class:`~ledger.api.routes.log.LogReadFastPath`): they answer a few hot requests past
FastAPI's routing and dependency solving, with the route's own steps, and must answer
errors as the app does."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response


async def error_response(request: Request, exc: Exception) -> Response:
    """The app's answer to ``exc``, as Starlette's ExceptionMiddleware finds it: the
    handler of the nearest class. The catch-all (``Exception``) is the outer
    ServerErrorMiddleware's, and what only an outer middleware answers (the body limit's
    413) must reach it: without a nearer handler ``exc`` is raised again."""
    handlers = request.app.exception_handlers
    handler = next((handlers[cls] for cls in type(exc).__mro__
                    if cls is not Exception and cls in handlers), None)
    if handler is None:
        raise exc
    response: Response = await handler(request, exc)
    return response
