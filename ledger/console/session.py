"""Console sign-in: an API key exchanged for a session cookie, and CSRF tokens.

- The cookie is 32 random bytes; the database keeps only their HMAC under the API-key
  pepper (``console_sessions``, as ``api_keys`` keeps keys), so a read of the table signs
  nobody in, and an insider who can write the table but lacks the pepper cannot make a
  session for someone else's key. It is ``HttpOnly``,
  ``SameSite=Strict``, ``Secure`` when the request came over TLS, scoped to ``/console``.
- Every request re-checks the API key behind the session: a revoked key, or a key whose
  role lost the permission, loses the console at once.
- Roles are the API's (:data:`ledger.api.auth.PERMISSIONS`): a page needs the permission
  its API twin needs. Ingester and worker keys hold no reading permission, so they get no
  console at all.
- Each session has its own CSRF token; every form carries it and every POST compares it
  in constant time. The sign-in form itself (no session yet) uses a double-submit token: a
  short-lived cookie and the same value in the form.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ledger.db.models import ApiKey, ConsoleSession
from ledger.errors import Forbidden
from ledger.services.apikeys import Principal, authenticate, hash_key

COOKIE = "ledger_console"
LOGIN_COOKIE = "ledger_console_login"
SESSION_HOURS = 8
#: Roles that may sign in: those that can read records (the API's ``envelopes:read``).
CONSOLE_ROLES = frozenset({"reviewer", "auditor", "admin"})


@dataclass(frozen=True, slots=True)
class ConsoleUser:
    principal: Principal
    csrf_token: str

    @property
    def role(self) -> str:
        return self.principal.role


class NotSignedIn(Exception):
    """No valid session: the page redirects to the sign-in form."""


def _digest(token: str, pepper: str) -> bytes:
    return hash_key(token, pepper)


def sign_in(session: Session, api_key: str, pepper: str) -> tuple[str, ConsoleUser]:
    """(cookie value, user) for a valid API key of a console role; raises
    Unauthorized/Forbidden otherwise."""
    principal = authenticate(session, api_key.strip(), pepper)
    if principal.role not in CONSOLE_ROLES:
        raise Forbidden(f"an {principal.role} key has no console: sign in with a reviewer, "
                        "auditor or admin key", code="forbidden_role")
    token = secrets.token_urlsafe(32)
    csrf = secrets.token_urlsafe(32)
    now = datetime.now(UTC)
    session.add(ConsoleSession(token_sha256=_digest(token, pepper), api_key_id=principal.key_id,
                               csrf_token=csrf, created_at=now,
                               expires_at=now + timedelta(hours=SESSION_HOURS)))
    session.execute(delete(ConsoleSession).where(ConsoleSession.expires_at < now))
    session.flush()
    return token, ConsoleUser(principal, csrf)


def current_user(session: Session, token: str | None, pepper: str) -> ConsoleUser:
    if not token or len(token) > 100:
        raise NotSignedIn
    row = session.execute(
        select(ConsoleSession.csrf_token, ConsoleSession.expires_at, ApiKey.id, ApiKey.name,
               ApiKey.role, ApiKey.revoked_at)
        .join(ApiKey, ApiKey.id == ConsoleSession.api_key_id)
        .where(ConsoleSession.token_sha256 == _digest(token, pepper))).first()
    if (row is None or row.revoked_at is not None or row.expires_at <= datetime.now(UTC)
            or row.role not in CONSOLE_ROLES):
        raise NotSignedIn
    return ConsoleUser(Principal(str(row.id), row.name, row.role), row.csrf_token)


def sign_out(session: Session, token: str | None, pepper: str) -> None:
    if token:
        session.execute(delete(ConsoleSession).where(
            ConsoleSession.token_sha256 == _digest(token, pepper)))


def csrf_ok(expected: str | None, given: str | None) -> bool:
    return bool(expected and given) and hmac.compare_digest(
        str(expected).encode(), str(given).encode())
