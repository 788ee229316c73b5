"""API-key authentication and the role matrix.

Every route names one permission; :data:`PERMISSIONS` says which roles hold it. The
role-matrix test walks every route with every role against this table.

Least privilege: a role holds only what its component does over the API. A replay worker
reads its jobs, envelopes and proofs from the database, never over the API, so the
``worker`` role reads no envelopes, proofs or log entries here. Whatever lists request or
dispute IDs (envelope search, disputes, log entries by index) needs a reading role; the
C2SP tlog-tiles paths (``/log/...``) stay public, as that spec expects (docs/deployment.md).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from ledger.api.deps import get_session, get_settings_dep
from ledger.db.session import AutocommitReads
from ledger.errors import Forbidden, Unauthorized
from ledger.services.apikeys import (
    Principal,
    authenticate,
    authenticate_reads,
    authenticate_reads_with_keys,
)
from ledger.services.keys import ReadKeys
from ledger.settings import Settings

ALL_ROLES = frozenset({"ingester", "reviewer", "auditor", "worker", "admin"})

PERMISSIONS: dict[str, frozenset[str]] = {
    "envelopes:write": frozenset({"ingester"}),
    "envelopes:read": frozenset({"reviewer", "auditor", "admin"}),
    "log:read": frozenset({"reviewer", "auditor", "admin"}),
    "keys:read": ALL_ROLES,
    "keys:write": frozenset({"admin"}),
    "apikeys:admin": frozenset({"admin"}),
    "audit:read": frozenset({"auditor", "admin"}),
    "export": frozenset({"auditor", "admin"}),
    "disputes:read": frozenset({"reviewer", "auditor", "admin"}),
    "disputes:write": frozenset({"reviewer", "admin"}),
    "matrix:read": frozenset({"reviewer", "auditor", "admin"}),
    "matrix:write": frozenset({"reviewer", "admin"}),
    "policies:read": frozenset({"reviewer", "auditor", "admin"}),
    "policies:write": frozenset({"admin"}),
    "workers:read": frozenset({"reviewer", "auditor", "worker", "admin"}),
    "workers:write": frozenset({"worker"}),
    "privacy:admin": frozenset({"admin"}),  # erasure, retention policies
}

_bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer lk_...`")


def _presented(creds: HTTPAuthorizationCredentials | None) -> str:
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise Unauthorized("send an API key as `Authorization: Bearer <key>`",
                           code="missing_api_key")
    return creds.credentials


async def bearer_key(request: Request) -> str:
    """The API key a request presents (401 ``missing_api_key`` without one), parsed as the
    routes' ``Depends(_bearer)`` parses it (``HTTPBearer``: the first Authorization
    header, split at its first space, the rest stripped; the scheme ``bearer`` in any
    case), without building its pydantic credentials: for the fast paths
    (:class:`~ledger.api.routes.envelopes.IngestFastPath`, the log's reads), which answer
    without FastAPI's dependencies. ``tests/api/test_auth.py`` holds the two to the same
    answers."""
    scheme, _, param = (request.headers.get("Authorization") or "").partition(" ")
    key = param.strip()
    if not scheme or not key or scheme.lower() != "bearer":
        raise Unauthorized("send an API key as `Authorization: Bearer <key>`",
                           code="missing_api_key")
    return key


def check_role(principal: Principal, permission: str) -> None:
    roles = PERMISSIONS[permission]
    if principal.role not in roles:
        raise Forbidden(f"role {principal.role!r} may not {permission}; allowed: "
                        f"{', '.join(sorted(roles))}", code="forbidden_role")


def require(permission: str) -> Callable[..., Iterator[Principal]]:
    if permission not in PERMISSIONS:
        raise KeyError(f"unknown permission {permission!r}")

    def dependency(
        request: Request,
        creds: HTTPAuthorizationCredentials | None = Depends(_bearer),
        session: Session = Depends(get_session),
        settings: Settings = Depends(get_settings_dep),
    ) -> Iterator[Principal]:
        principal = authenticate(session, _presented(creds),
                                 settings.api_key_pepper.get_secret_value())
        check_role(principal, permission)
        request.state.principal = principal
        yield principal

    dependency.permission = permission  # type: ignore[attr-defined]
    return dependency


@dataclass(frozen=True, slots=True)
class Credentials:
    """An API key as presented, not yet checked, and the permission it must hold: the
    route checks both in its own thread-pool hop (:func:`ledger.services.apikeys.
    authenticate_reads`, then :func:`check_role`), before it acts on anything else."""

    api_key: str
    permission: str


def presented(permission: str) -> Callable[..., Coroutine[Any, Any, Credentials]]:
    """:func:`require` for a route that checks the key itself, in the one thread-pool hop
    it makes anyway (ingest, the hot path): a missing key is refused here, at once; the
    key and its role are checked by the route before it reads or stores anything. An
    async dependency, so it costs no hop of its own."""
    if permission not in PERMISSIONS:
        raise KeyError(f"unknown permission {permission!r}")

    async def dependency(
        creds: HTTPAuthorizationCredentials | None = Depends(_bearer),
    ) -> Credentials:
        return Credentials(_presented(creds), permission)

    dependency.permission = permission  # type: ignore[attr-defined]
    return dependency


def authorize_reads(reads: AutocommitReads, settings: Settings, key: str,
                    permission: str) -> Principal:
    """The caller of ``key``, checked to hold ``permission``, in one statement on
    ``reads`` (:func:`require_reads`, and the log routes' fast path in its one hop)."""
    principal = authenticate_reads(reads, key, settings.api_key_pepper.get_secret_value())
    check_role(principal, permission)
    return principal


def authorize_reads_with_keys(reads: AutocommitReads, settings: Settings, key: str,
                              permission: str, keyids: Iterable[str]
                              ) -> tuple[Principal, ReadKeys]:
    """:func:`authorize_reads`, with the signing keys of ``keyids`` read in the same
    statement (single-envelope ingest: one round trip for both). The key and its role are
    checked before this returns: 401 or 403, and the keys read are dropped with it."""
    principal, keys = authenticate_reads_with_keys(
        reads, key, settings.api_key_pepper.get_secret_value(), keyids)
    check_role(principal, permission)
    return principal, keys


def require_reads(permission: str) -> Callable[..., AsyncIterator[AutocommitReads]]:
    """:func:`require` for async routes that only read (the log's proofs): the key and
    its role are checked in one thread-pool hop, one raw statement on the API's
    autocommit read engine (``app.state.log_reads``: no BEGIN, ROLLBACK or ping), and
    the route reads on the same connection (:meth:`AutocommitReads.run`). Checked
    before the route's parameters, as :func:`require` does (a role without the
    permission gets 403 whatever it asked)."""
    if permission not in PERMISSIONS:
        raise KeyError(f"unknown permission {permission!r}")

    async def dependency(
        request: Request,
        creds: HTTPAuthorizationCredentials | None = Depends(_bearer),
    ) -> AsyncIterator[AutocommitReads]:
        key = _presented(creds)
        settings = request.app.state.settings
        reads = AutocommitReads(request.app.state.log_reads)
        try:
            request.state.principal = await run_in_threadpool(
                authorize_reads, reads, settings, key, permission)
            yield reads
        finally:
            reads.release()  # autocommit: giving the connection back sends nothing

    dependency.permission = permission  # type: ignore[attr-defined]
    return dependency
