"""The role matrix: every route with every role (and none), against PERMISSIONS."""

from __future__ import annotations

import re
from typing import Any

from fastapi.routing import APIRoute

from ledger.api.app import ROUTERS, create_app
from ledger.api.auth import PERMISSIONS
from ledger.settings import Settings
from tests.helpers import ApiServer

PUBLIC = {"/healthz", "/readyz", "/v1/schemas/envelope", "/openapi.json",
          "/docs", "/docs/oauth2-redirect", "/redoc",
          # the log's hashes and signed notes: no request or dispute IDs
          "/v1/log/checkpoint", "/v1/log/consistency"}


def _permission(route: APIRoute) -> str | None:
    stack = [route.dependant]
    while stack:
        dep = stack.pop()
        perm = getattr(dep.call, "permission", None)
        if perm:
            return str(perm)
        stack.extend(dep.dependencies)
    return None


def _routes() -> list[tuple[str, str, str | None]]:
    out = []
    for router in ROUTERS:
        for route in router.routes:
            assert isinstance(route, APIRoute)
            for method in sorted(route.methods):
                out.append((method, route.path, _permission(route)))
    # nothing the application serves escapes the walk
    app = create_app(Settings(database_url="postgresql+psycopg://nobody@127.0.0.1:1/none"))
    served = {(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops}
    assert served == {(m, p.replace(":path}", "}")) for m, p, _ in out}
    return out


def test_every_route_is_public_or_names_a_permission() -> None:
    for method, path, perm in _routes():
        # the C2SP tlog-tiles read paths stay public; /v1/log/proof (an entry, naming a
        # request or dispute, by index) needs a role since the closed-surfaces change
        if path in PUBLIC or path.startswith("/log/"):
            assert perm is None, (method, path)
        else:
            assert perm in PERMISSIONS, f"{method} {path} has no permission"


def test_role_matrix(api: ApiServer) -> None:
    checked = 0
    for method, path, perm in _routes():
        if perm is None:
            continue
        url = re.sub(r"\{[^}]+\}", "x", path)
        kwargs: dict[str, Any] = {"json": {}} if method in ("POST", "PUT", "PATCH") else {}
        with api.client() as anon:
            r = anon.request(method, url, **kwargs)
            assert r.status_code == 401, (method, path, r.status_code)
            bad = anon.request(method, url, headers={"Authorization": "Bearer lk_nope"}, **kwargs)
            assert bad.status_code == 401, (method, path)
        for role in ("ingester", "reviewer", "auditor", "worker", "admin"):
            with api.client(role) as c:
                r = c.request(method, url, **kwargs)
            allowed = role in PERMISSIONS[perm]
            if allowed:
                assert r.status_code not in (401, 403), (method, path, role, r.text)
            else:
                assert r.status_code == 403, (method, path, role, r.status_code)
                assert r.json()["code"] == "forbidden_role"
            checked += 1
    assert checked >= 5 * 10


def test_admin_actions_are_recorded_in_the_audit_table(api: ApiServer) -> None:
    with api.client("admin") as admin:
        created = admin.post("/v1/api-keys", json={"name": "audited-key", "role": "reviewer"})
        assert created.status_code == 201
        key = created.json()["key"]
        assert key.startswith("lk_")
        again = admin.post("/v1/api-keys", json={"name": "audited-key", "role": "reviewer"})
        assert again.status_code == 409
        listed = admin.get("/v1/api-keys").json()
        assert all("key" not in k and "key_hash" not in k for k in listed)
        revoked = admin.post(f"/v1/api-keys/{created.json()['id']}/revoke")
        assert revoked.status_code == 200
    with api.client("auditor") as auditor:
        events = auditor.get("/v1/audit-events", params={"limit": 1000}).json()["items"]
    actions = [(e["action"], e["target"]) for e in events]
    assert ("api_key.create", created.json()["id"]) in actions
    assert ("api_key.revoke", created.json()["id"]) in actions
    assert all(e["role"] == "admin" for e in events if e["action"].startswith("api_key"))
    # the revoked key no longer works
    with api.client() as c:
        r = c.get("/v1/keys", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 401 and r.json()["code"] == "revoked_api_key"
