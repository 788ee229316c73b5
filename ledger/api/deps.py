"""Request-scoped dependencies: settings and one database session per request.

The session is rolled back and closed when the request ends; endpoints (the boundary)
call ``session.commit()`` themselves once their work succeeded.
"""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import Request
from sqlalchemy.orm import Session

from ledger.settings import Settings


def get_settings_dep(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    session: Session = request.app.state.sessionmaker()
    try:
        yield session
    finally:
        session.rollback()
        session.close()
