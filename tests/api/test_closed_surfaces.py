"""Closed surfaces: undeclared query parameters are a 400 naming them on every route (and
documented), whatever lists request or dispute IDs needs a reading role (the tlog-tiles
read paths stay public), metrics are not on the API port, and the worker role reads no
envelopes. Real `ledger serve` processes."""

from __future__ import annotations

import base64
import re
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ledger.api.app import create_app
from ledger.settings import Settings
from tests.api.test_roles import _routes
from tests.conftest import provision
from tests.helpers import ApiServer, free_port, run_server, shared_broker_url, signed, statement

ROLE_FOR_PERM = {"envelopes:read": "reviewer", "envelopes:write": "ingester",
                 "keys:read": "admin", "keys:write": "admin", "apikeys:admin": "admin",
                 "audit:read": "auditor", "export": "auditor", "disputes:read": "reviewer",
                 "disputes:write": "reviewer", "policies:read": "admin",
                 "policies:write": "admin", "workers:read": "reviewer", "log:read": "reviewer",
                 "privacy:admin": "admin", "matrix:read": "auditor",
                 "matrix:write": "reviewer"}


def _stored(api: ApiServer) -> tuple[str, int]:
    env = signed(statement(), api.producer)  # type: ignore[attr-defined]
    with api.client("ingester") as c:
        r = c.post("/v1/envelopes", json=env, params={"wait": True})
    assert r.status_code == 201, r.text
    return str(r.json()["request_id"]), int(r.json()["log_index"])


def _problem(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, (r.request.url, r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/problem+json")
    body = dict(r.json())
    assert body["code"] == code, body
    return body


# --- unknown query parameters ----------------------------------------------------------------

def test_search_with_an_unknown_filter_is_400_not_everything(api: ApiServer) -> None:
    rid, _ = _stored(api)
    _stored(api)
    with api.client("reviewer") as c:
        r = c.get("/v1/envelopes", params={"request_id": rid})
        body = _problem(r, 400, "unknown_query_parameter")
        assert body["parameters"] == ["request_id"] and "request_id" in body["detail"]
        both = _problem(c.get("/v1/envelopes", params={"limit": 5, "zeta": 1, "alpha": 2}),
                        400, "unknown_query_parameter")
        assert both["parameters"] == ["alpha", "zeta"]  # declared ones are not named
        assert len(c.get("/v1/envelopes", params={"limit": 5}).json()["items"]) >= 2


def test_every_route_refuses_undeclared_query_parameters(api: ApiServer) -> None:
    """Each operation the API serves, with its role, and one parameter it does not take."""
    rid, index = _stored(api)
    checked = 0
    for method, path, perm in _routes():
        if path in ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"):
            continue
        url = re.sub(r"\{[^}]+\}", "x", path).replace("/log/tile/x", "/log/tile/0/000")
        role = ROLE_FOR_PERM[perm] if perm else None
        with api.client(role) as c:
            r = c.request(method, url, params={"not_a_parameter": "1"},
                          **({"json": {}} if method == "POST" else {}))
        body = _problem(r, 400, "unknown_query_parameter")
        assert body["parameters"] == ["not_a_parameter"], (method, path)
        checked += 1
    assert checked >= 25
    # an alias is a declared name; a path parameter is not a query parameter
    with api.client("reviewer") as c:
        assert c.get("/v1/log/consistency", params={"from": 0}).status_code != 400
        _problem(c.get("/v1/log/consistency", params={"from_size": 0}), 400,
                 "unknown_query_parameter")
        _problem(c.get(f"/v1/envelopes/{rid}", params={"request_id": rid}), 400,
                 "unknown_query_parameter")
        assert c.get(f"/v1/envelopes/{rid}").status_code == 200
        assert c.get("/v1/log/proof", params={"index": index}).status_code == 200


def test_the_400_is_documented_on_every_operation() -> None:
    app = create_app(Settings(database_url="postgresql+psycopg://nobody@127.0.0.1:1/none",
                              metrics_port=0))
    ops = [(p, m, op) for p, item in app.openapi()["paths"].items() for m, op in item.items()]
    assert len(ops) >= 25
    for path, method, op in ops:
        doc = op["responses"].get("400")
        assert doc and "unknown_query_parameter" in doc["description"], (method, path)
        assert "application/problem+json" in doc["content"], (method, path)


# --- who may list IDs ----------------------------------------------------------------------------

def test_id_listing_routes_need_a_role_tlog_tiles_stay_public(api: ApiServer) -> None:
    rid, index = _stored(api)
    with api.client("reviewer") as c:
        assert c.post("/v1/disputes", json={"request_id": rid, "reason": "closed surfaces"}
                      ).status_code in (200, 201)
    with api.client() as anon:
        for url, params in (("/v1/log/proof", {"index": index}), ("/v1/envelopes", {}),
                            (f"/v1/envelopes/{rid}", {}), (f"/v1/envelopes/{rid}/proof", {}),
                            ("/v1/disputes", {}), ("/v1/export", {})):
            _problem(anon.get(url, params=params), 401, "missing_api_key")
        # C2SP tlog-tiles: public, as the spec expects
        cp = anon.get("/log/checkpoint")
        assert cp.status_code == 200, cp.text
        size = int(cp.text.split("\n")[1])
        full, partial = divmod(size, 256)
        bundle = (f"/log/tile/entries/{full:03d}" if not partial
                  else f"/log/tile/entries/{full:03d}.p/{partial}")
        assert anon.get(bundle).status_code == 200
        assert anon.get("/v1/log/checkpoint").status_code == 200
        assert anon.get("/v1/log/consistency", params={"from": 1}).status_code == 200
    for role, allowed in (("reviewer", True), ("auditor", True), ("admin", True),
                          ("ingester", False), ("worker", False)):
        with api.client(role) as c:
            r = c.get("/v1/log/proof", params={"index": index})
        if allowed:
            assert r.status_code == 200 and base64.b64decode(r.json()["entry"]), role
        else:
            _problem(r, 403, "forbidden_role")


def test_worker_role_reads_no_envelopes(api: ApiServer) -> None:
    rid, index = _stored(api)
    with api.client("worker") as c:
        for url, params in (("/v1/envelopes", {}), (f"/v1/envelopes/{rid}", {}),
                            (f"/v1/envelopes/{rid}/proof", {}),
                            ("/v1/log/proof", {"index": index}), ("/v1/disputes", {}),
                            ("/v1/export", {})):
            _problem(c.get(url, params=params), 403, "forbidden_role")
        # what it keeps: the key list and the worker list
        assert c.get("/v1/keys").status_code == 200
        assert c.get("/v1/workers").status_code == 200
    with api.client("reviewer") as c:
        assert c.get(f"/v1/envelopes/{rid}").status_code == 200


# --- metrics ----------------------------------------------------------------------------

def _wait_metrics(url: str) -> str:
    for _ in range(100):
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200:
                return r.text
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"no metrics at {url}")


def _refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return False
    except OSError:
        return True


@pytest.mark.parametrize("workers", [1, 2])
def test_metrics_are_not_on_the_api_port_and_listen_on_loopback_only(
        db_url: str, tmp_path: Path, workers: int) -> None:
    keys, producer = provision(db_url)
    port = free_port()
    env = {"LEDGER_METRICS_PORT": str(port), "LEDGER_BROKER_URL": shared_broker_url(1)}
    with run_server(db_url, workers=workers, extra_env=env, log_dir=tmp_path) as server:
        server.keys = keys
        with server.client() as anon:
            _problem(anon.get("/metrics"), 404, "not_found")
        with server.client("admin") as admin:  # no role opens it on the API port either
            _problem(admin.get("/metrics"), 404, "not_found")
        n = 6
        with server.client("ingester") as c:
            for _ in range(n):
                assert c.post("/v1/envelopes", json=signed(statement(), producer)
                              ).status_code == 201
        text = _wait_metrics(f"http://127.0.0.1:{port}/metrics")
        # with several processes, one listener reports the sum over all of them
        deadline = time.monotonic() + 10
        while True:
            m = re.search(r'^ledger_envelopes_ingested_total\{outcome="created"\} (\S+)$', text,
                          re.M)
            if (m and float(m.group(1)) == n) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
            text = _wait_metrics(f"http://127.0.0.1:{port}/metrics")
        assert m and float(m.group(1)) == n, text[:2000]
        # bound to 127.0.0.1 only: another loopback address of the host is refused
        assert _refused("127.0.0.2", port)
        assert not _refused("127.0.0.1", port)
