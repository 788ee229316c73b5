"""Property-based API fuzzing with schemathesis against the live /openapi.json: no 5xx,
every response documented and conforming to its schema (bounded number of cases)."""

from __future__ import annotations

import re

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from ledger.api.auth import PERMISSIONS
from tests.api.test_roles import _routes
from tests.helpers import ApiServer

schemathesis.experimental.OPEN_API_3_1.enable()  # FastAPI emits OpenAPI 3.1

ROLE_PREFERENCE = ("admin", "ingester", "reviewer", "auditor", "worker")


def _role_for(method: str, path: str, routes: list[tuple[str, str, str | None]]) -> str | None:
    for m, p, perm in routes:
        if m == method.upper() and p == path and perm is not None:
            return next(r for r in ROLE_PREFERENCE if r in PERMISSIONS[perm])
    return None


@pytest.fixture(scope="module")
def live_schema(api: ApiServer):
    return schemathesis.from_uri(api.base_url + "/openapi.json", base_url=api.base_url)


schema = schemathesis.from_pytest_fixture("live_schema")
ROUTES = _routes()


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_and_never_5xx(case, api: ApiServer) -> None:  # type: ignore[no-untyped-def]
    role = _role_for(case.method, case.path, ROUTES)
    if role:
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {api.keys[role]}"}
    response = case.call(timeout=30)
    assert response.status_code < 500, (case.method, case.path, response.text[:500])
    case.validate_response(response)
    if response.status_code >= 400:
        assert re.match(r"application/problem\+json", response.headers["content-type"])
