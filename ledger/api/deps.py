"""Request-scoped dependencies: settings, one database session per request, and the
closed query string.

The session is rolled back and closed when the request ends; endpoints (the boundary)
call ``session.commit()`` themselves once their work succeeded.
"""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from sqlalchemy.orm import Session

from ledger.errors import BadRequest
from ledger.settings import Settings

_DECLARED_QUERY: dict[int, frozenset[str]] = {}


class UnknownQueryParameters(BadRequest):
    code = "unknown_query_parameter"

    def __init__(self, message: str, parameters: list[str]) -> None:
        super().__init__(message)
        self.parameters = parameters


async def get_settings_dep(request: Request) -> Settings:
    """Async: no I/O, so no thread-pool hop (a sync dependency costs one per request)."""
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    session: Session = request.app.state.sessionmaker()
    try:
        yield session
    finally:
        session.rollback()
        session.close()


def declared_query(route: APIRoute) -> frozenset[str]:
    """The query parameter names (aliases) a route declares, its dependencies' included."""
    names = _DECLARED_QUERY.get(id(route))
    if names is None:
        found: set[str] = set()
        stack: list[Dependant] = [route.dependant]
        while stack:
            dep = stack.pop()
            found.update(p.alias for p in dep.query_params)
            stack.extend(dep.dependencies)
        names = _DECLARED_QUERY[id(route)] = frozenset(found)
    return names


async def reject_unknown_query(request: Request) -> None:
    """400 for any query parameter the route does not declare.

    A misspelt or unsupported filter is otherwise silently dropped: ``GET
    /v1/envelopes?request_id=X`` would answer with *every* envelope, and a caller would
    take the first one for X. Wired once for every route (``ledger.api.app``). Async: no
    I/O, so no thread-pool hop."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    unknown = sorted(set(request.query_params.keys()) - declared_query(route))
    if unknown:
        allowed = ", ".join(sorted(declared_query(route))) or "none"
        raise UnknownQueryParameters(
            f"unknown query parameter(s): {', '.join(unknown)[:500]}; this operation "
            f"takes: {allowed}", [u[:100] for u in unknown[:50]])
