"""``POST /v1/envelopes`` without a query string is answered by ``IngestFastPath`` (past
FastAPI's routing); with one (``?wait=false``) by the FastAPI route. Both must give the
same answer to every kind of request, and the fast path must really be the one taken."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from ledger.api.routes.envelopes import IngestFastPath
from ledger.db.session import make_engine
from ledger.settings import Settings
from tests.conftest import provision
from tests.helpers import TEST_PEPPER, ApiServer, record_passed_on, signed, statement

FAST, ROUTED = "/v1/envelopes", "/v1/envelopes?wait=false"


def _answer(r: httpx.Response) -> dict[str, Any]:
    """What a client sees, less what differs between two stored envelopes."""
    body = r.json()
    for volatile in ("log_index", "request_id", "dsse_sha256", "existing_dsse_sha256",
                     "submitted_dsse_sha256", "fingerprint_id", "position"):
        body.pop(volatile, None)
    if isinstance(body.get("detail"), str):  # names the request id
        body["detail"] = body["detail"].replace(r.request.headers.get("x-rid", ""), "RID")
    return {"status": r.status_code, "type": r.headers.get("content-type"),
            "www": r.headers.get("www-authenticate"), "body": body}


def _cases(api: ApiServer, path: str, tag: str) -> dict[str, httpx.Response]:
    producer = api.producer  # type: ignore[attr-defined]
    env = signed(statement(f"fast-{tag}"), producer)
    other = signed(statement(f"fast-{tag}", output_len=5), producer)
    bad_sig = signed(statement(f"fast-{tag}-sig"), producer)
    bad_sig["signatures"][0]["sig"] = bad_sig["signatures"][0]["sig"][::-1]
    raw = json.dumps(env).encode()
    headers = {"Content-Type": "application/json", "x-rid": f"fast-{tag}"}
    out: dict[str, httpx.Response] = {}
    with api.client("ingester") as c:
        out["new"] = c.post(path, content=raw, headers=headers)
        out["same again"] = c.post(path, content=raw, headers=headers)
        out["other bytes"] = c.post(path, content=json.dumps(other).encode(), headers=headers)
        out["bad signature"] = c.post(path, content=json.dumps(bad_sig).encode(),
                                      headers=headers)
        out["not json"] = c.post(path, content=b"{not json", headers=headers)
        out["a scalar"] = c.post(path, content=b"1", headers=headers)
    with api.client("reviewer") as c:
        out["wrong role"] = c.post(path, content=raw, headers=headers)
    with api.client() as c:
        out["no key"] = c.post(path, content=raw, headers=headers)
        out["not bearer"] = c.post(path, content=raw,
                                   headers={**headers, "Authorization": "Basic eDp5"})
    return out


def test_fast_path_and_route_give_the_same_answers(api: ApiServer) -> None:
    fast, routed = _cases(api, FAST, "a"), _cases(api, ROUTED, "b")
    statuses = {name: r.status_code for name, r in fast.items()}
    assert statuses == {"new": 201, "same again": 200, "other bytes": 409,
                        "bad signature": statuses["bad signature"], "not json": 400,
                        "a scalar": 400, "wrong role": 403, "no key": 401,
                        "not bearer": 401}, statuses
    assert 400 <= statuses["bad signature"] < 500
    for name in fast:
        assert _answer(fast[name]) == _answer(routed[name]), name


def test_the_fast_path_answers_without_the_route_and_passes_the_rest_on(db_url: str) -> None:
    keys, producer = provision(db_url)
    settings = Settings(database_url=db_url, api_key_pepper=TEST_PEPPER, metrics_port=0)
    engine = make_engine(settings, pool_size=2)
    from ledger.api.app import create_app

    app = create_app(settings, engine)
    reached: list[str] = []
    try:
        with TestClient(app) as client:
            record_passed_on(app, IngestFastPath, lambda scope: reached.append(
                f"{scope['method']} {scope['path']}?{scope['query_string']!r}"))
            auth = {"Authorization": f"Bearer {keys['ingester']}"}
            body = json.dumps(signed(statement("fast-inproc"), producer)).encode()
            assert client.post(FAST, content=body, headers=auth).status_code == 201
            assert client.post(FAST, content=b"{", headers=auth).status_code == 400
            assert reached == []                                    # answered by the fast path
            assert client.post(ROUTED, content=body, headers=auth).status_code == 200
            assert client.get("/v1/envelopes/fast-inproc", headers=auth).status_code in (
                200, 403)
            assert len(reached) == 2, reached                       # the rest went on
    finally:
        engine.dispose()


@pytest.mark.parametrize("path", [FAST, ROUTED])
def test_a_chunked_body_over_the_request_limit_is_413_either_way(api: ApiServer,
                                                                 path: str) -> None:
    def chunks() -> Any:
        for _ in range(80):
            yield b" " * (1 << 20)                             # 80 MiB, no Content-Length

    with api.client("ingester") as c:
        r = c.post(path, content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
