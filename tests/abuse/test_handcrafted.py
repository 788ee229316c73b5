"""Handcrafted abuse cases that the other suites do not cover (``tests/api/test_ingest.py``
BAD_INPUTS holds the envelope-body classes, ``test_batch_and_search.py`` the envelope cursors,
``test_roles.py`` the role matrix). Each is a clear 4xx problem+json and writes nothing:
no envelope, log entry, dispute, event, key, API key, policy or audit record.
"""

from __future__ import annotations

import base64
import http.client
import json
import select
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import psycopg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi.routing import APIRoute

from ledger.api.app import ROUTERS
from ledger.api.routing import StrictJsonRoute
from ledger.core.canonical import canonical_json
from ledger.core.keys import public_raw
from ledger.services.envelopes import SearchFilters
from tests.helpers import ApiServer, signed, statement

TABLES = ("envelopes", "log_entries", "disputes", "dispute_events", "api_keys", "signing_keys",
          "audit_events", "reverification_policies", "replay_jobs")


def snapshot(api: ApiServer) -> dict[str, int]:
    url = api.db_url.replace("postgresql+psycopg://", "postgresql://")  # type: ignore[attr-defined]
    with psycopg.connect(url) as conn:
        out = {t: int(conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0])  # type: ignore[index]
               for t in TABLES}
        out["log_size"] = int(conn.execute("SELECT size FROM log_state").fetchone()[0])  # type: ignore[index]
    return out


def assert_problem(r: httpx.Response | http.client.HTTPResponse, body: bytes | None,
                   status: int, code: str | None = None) -> dict[str, Any]:
    got = r.status_code if isinstance(r, httpx.Response) else r.status
    raw = r.content if isinstance(r, httpx.Response) else body
    assert got == status, (got, (raw or b"")[:300])
    assert (r.headers.get("content-type") or "").startswith("application/problem+json")
    problem = json.loads(raw or b"")
    assert problem["status"] == status and problem["detail"]
    if code is not None:
        assert problem["code"] == code, problem
    return problem


@pytest.fixture(scope="module")
def stored(api: ApiServer) -> dict[str, Any]:
    """One stored envelope and one dispute on it, made before any case runs."""
    env = signed(statement(), api.producer)  # type: ignore[attr-defined]
    with api.client("ingester") as c:
        created = c.post("/v1/envelopes", json=env)
    assert created.status_code == 201, created.text
    rid = created.json()["request_id"]
    with api.client("reviewer") as c:
        dispute = c.post("/v1/disputes", json={"request_id": rid, "reason": "fixture"})
    assert dispute.status_code == 201, dispute.text
    return {"envelope": env, "request_id": rid, "dispute_id": dispute.json()["id"]}


# --- envelopes ----------------------------------------------------------------------------

def test_same_envelope_under_another_request_id_is_refused(api: ApiServer,
                                                           stored: dict[str, Any]) -> None:
    """The stored envelope with only the request_id in its payload changed, signature kept:
    the signature covers the payload bytes, so the copy is refused, alone or in a batch."""
    st = json.loads(base64.b64decode(stored["envelope"]["payload"]))
    st["predicate"]["request_id"] = "rebound-" + stored["request_id"]
    forged = {**stored["envelope"], "payload": base64.b64encode(canonical_json(st)).decode()}
    before = snapshot(api)
    with api.client("ingester") as c:
        assert_problem(c.post("/v1/envelopes", json=forged), None, 422, "bad_signature")
        batch = c.post("/v1/envelopes/batch?atomic=true", json={"envelopes": [forged]})
    assert_problem(batch, None, 422, "batch_rejected")
    assert batch.json()["results"][0]["problem"]["code"] == "bad_signature"
    with api.client("reviewer") as c:
        assert c.get(f"/v1/envelopes/rebound-{stored['request_id']}").status_code == 404
    assert snapshot(api) == before


def test_worker_never_ingests(api: ApiServer) -> None:
    """A `worker` API key posting a valid envelope is 403; an envelope signed by a
    worker-purpose signing key is 422 (test_ingest checks the code; here: nothing written)."""
    worker_key = Ed25519PrivateKey.generate()
    with api.client("admin") as admin:
        assert admin.post("/v1/keys", json={
            "public_key": base64.b64encode(public_raw(worker_key)).decode(),
            "purpose": "worker", "name": "abuse-gpu"}).status_code == 201
    valid = signed(statement(), api.producer)  # type: ignore[attr-defined]
    before = snapshot(api)
    with api.client("worker") as c:
        assert_problem(c.post("/v1/envelopes", json=valid), None, 403, "forbidden_role")
        assert_problem(c.post("/v1/envelopes/batch", json={"envelopes": [valid]}), None, 403,
                       "forbidden_role")
    with api.client("ingester") as c:
        r = c.post("/v1/envelopes", json=signed(statement(), worker_key))
    assert_problem(r, None, 422, "wrong_key_purpose")
    assert snapshot(api) == before


# --- API keys -----------------------------------------------------------------------------

def test_revoked_api_key_cannot_ingest(api: ApiServer) -> None:
    with api.client("admin") as admin:
        created = admin.post("/v1/api-keys", json={"name": "abuse-revoked", "role": "ingester"})
        assert created.status_code == 201
        key = created.json()["key"]
        with httpx.Client(base_url=api.base_url,
                          headers={"Authorization": f"Bearer {key}"}) as c:
            probe = c.post("/v1/envelopes", content=b"{")  # the key works: the body is judged
            assert_problem(probe, None, 400, "malformed_json")
        assert admin.post(f"/v1/api-keys/{created.json()['id']}/revoke").status_code == 200
    before = snapshot(api)
    with httpx.Client(base_url=api.base_url, headers={"Authorization": f"Bearer {key}"}) as c:
        r = c.post("/v1/envelopes", json=signed(statement(), api.producer))  # type: ignore[attr-defined]
    assert_problem(r, None, 401, "revoked_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    assert snapshot(api) == before


def _malformed_authorizations(api: ApiServer) -> Iterator[str | None]:
    good = api.keys["ingester"]
    yield from (None, "", "Bearer", "Bearer ", "Bearer  \t", "bearer" + good,
                "Basic " + base64.b64encode(good.encode()).decode(), "Token " + good,
                "Bearer " + good + "x", "Bearer " + good[:-1], "Bearer " + good + " " + good,
                "Bearer lk_" + "A" * 8000, "Bearer lk_\xff\xfe", "Bearer " + good.upper(),
                "Bearer " + api.keys["worker"][:12] + good[12:])


def test_malformed_api_keys_are_401_and_write_nothing(api: ApiServer) -> None:
    body = json.dumps(signed(statement(), api.producer)).encode()  # type: ignore[attr-defined]
    before = snapshot(api)
    for value in _malformed_authorizations(api):
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        if value is not None:
            headers["Authorization"] = value
        response, problem, _ = _raw_post(api, "/v1/envelopes", headers, iter([body]))
        assert_problem(response, problem, 401)
    assert snapshot(api) == before


# --- request bodies read by FastAPI -------------------------------------------------------

def _valid_bodies(api: ApiServer, stored: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(role, path, a body the endpoint would accept) for every JSON-body endpoint."""
    key = base64.b64encode(public_raw(Ed25519PrivateKey.generate())).decode()
    return [
        ("admin", "/v1/api-keys", {"name": "abuse-strict", "role": "reviewer"}),
        ("admin", "/v1/keys", {"name": "abuse-strict", "purpose": "producer",
                               "public_key": key}),
        ("admin", "/v1/reverification-policies", {"name": "abuse-strict",
                                                  "interval_seconds": 60, "sample_size": 1}),
        ("reviewer", "/v1/disputes", {"reason": "abuse", "request_id": stored["request_id"],
                                      "priority": "high"}),
        ("reviewer", f"/v1/disputes/{stored['dispute_id']}/comments", {"text": "abuse"}),
        ("reviewer", f"/v1/disputes/{stored['dispute_id']}/resolve",
         {"note": "abuse", "resolution": "upheld"}),
        ("admin", "/v1/keys/" + "0" * 64 + "/revoke", {"reason": "abuse"}),
    ]


def _abused(valid: dict[str, Any]) -> Iterator[tuple[str, bytes, str]]:
    """(case, raw body, expected code); every valid body holds the string "abuse"."""
    text = json.dumps(valid)
    first = next(iter(valid))
    yield ("duplicate key", (f'{{"{first}": "decoy", ' + text[1:]).encode(), "duplicate_key")
    yield ("not utf-8", text.replace('"abuse', '"abuse\xff', 1).encode("latin-1"), "not_utf8")
    yield ("deep", (text[:-1] + ', "x": ' + "[" * 100 + "]" * 100 + "}").encode(), "too_deep")
    yield ("huge integer", (text[:-1] + ', "x": 1' + "0" * 5000 + "}").encode(), "malformed_json")
    yield ("NaN", (text[:-1] + ', "x": NaN}').encode(), "malformed_json")
    yield ("lone surrogate", (text[:-1] + ', "x": "\\ud800"}').encode(), "malformed_json")


def test_every_route_with_a_json_body_reads_it_strictly() -> None:
    routes = [r for router in ROUTERS for r in router.routes
              if isinstance(r, APIRoute) and r.body_field is not None]
    assert len(routes) >= 7
    for route in routes:
        assert isinstance(route, StrictJsonRoute), route.path


def test_every_json_body_is_read_strictly(api: ApiServer, stored: dict[str, Any]) -> None:
    """Duplicate keys, invalid UTF-8, deep nesting, huge integers, NaN and lone surrogates
    are 400s with their own codes on every endpoint, not only on envelopes: a duplicate
    key is not settled by whichever value the parser kept."""
    before = snapshot(api)
    checked = 0
    for role, path, valid in _valid_bodies(api, stored):
        for case, raw, code in _abused(valid):
            with api.client(role) as c:
                r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["code"] == code, (path, case, r.text)
            assert_problem(r, None, 400, code)
            checked += 1
    assert checked == 7 * 6
    assert snapshot(api) == before


# --- filters and cursors ------------------------------------------------------------------

def test_filter_and_cursor_injection(api: ApiServer, stored: dict[str, Any]) -> None:
    before = snapshot(api)
    with api.client("reviewer") as c:
        for params in ({"request_id": "' OR 1=1 --"}, {"state": "opened' --"},
                       {"priority": "high; DROP TABLE disputes"},
                       {"fingerprint_id": "fp-' OR '1'='1"}, {"before": "now()"},
                       {"before": "2026-01-01T00:00:00"}, {"limit": "1 OR 1=1"},
                       {"limit": str(10**30)}, {"limit": "-1"}):
            assert_problem(c.get("/v1/disputes", params=params), None, 422)
        # filters are compared as values: no wildcard, no SQL
        assert c.get("/v1/envelopes", params={"model_name": "tiny-demo"}).json()["items"]
        for name in ("%", "tiny%", "tiny-demo' OR '1'='1", "tiny-demo\\", "*"):
            r = c.get("/v1/envelopes", params={"model_name": name})
            assert r.status_code == 200 and r.json()["items"] == [], name
        # a cursor names a position in one query; forged ones are refused or find nothing
        digest = SearchFilters().digest()
        for after in ("1 OR 1=1", True, 1.5, None, [1], {"$gt": 0}, -2, 2**63, 2**80):
            forged = base64.urlsafe_b64encode(json.dumps(
                {"after": after, "q": digest}).encode()).decode().rstrip("=")
            assert_problem(c.get("/v1/envelopes", params={"cursor": forged}), None, 400,
                           "bad_cursor")
        last = base64.urlsafe_b64encode(json.dumps(
            {"after": 2**63 - 1, "q": digest}).encode()).decode().rstrip("=")
        r = c.get("/v1/envelopes", params={"cursor": last})
        assert r.status_code == 200 and r.json()["items"] == []
    with api.client("auditor") as c:
        assert_problem(c.get("/v1/export", params={"request_id": "' OR 1=1"}), None, 422)
        assert_problem(c.get("/v1/export", params={"request_id": [stored["request_id"], "a b"]}),
                       None, 422)
    assert snapshot(api) == before


# --- oversized bodies ---------------------------------------------------------------------

def _raw_post(api: ApiServer, path: str, headers: dict[str, str],
              chunks: Iterator[bytes] | None = None, chunked: bool = False,
              ) -> tuple[http.client.HTTPResponse, bytes, int]:
    """POST over a bare socket, stopping the upload as soon as the server answers (or stops
    reading); returns the response, its body and how many body bytes went out."""
    url = urlsplit(api.base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    try:
        head = f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        sock.sendall(head.encode("latin-1"))  # header values may hold any byte but CR LF
        sent = 0
        sock.settimeout(5)
        for chunk in chunks or ():
            if select.select([sock], [], [], 0)[0]:
                break  # the answer is in: the server did not wait for the rest
            frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" if chunked else chunk
            try:
                sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                break
            sent += len(chunk)
        else:
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        sock.settimeout(30)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response, response.read(), sent
    finally:
        sock.close()


def test_oversized_batch_is_413_before_the_body_is_read(api: ApiServer) -> None:
    before = snapshot(api)
    response, body, sent = _raw_post(api, "/v1/envelopes/batch", {
        "Authorization": f"Bearer {api.keys['ingester']}",
        "Content-Type": "application/json", "Content-Length": str(70_000_000)})
    assert sent == 0
    assert_problem(response, body, 413, "too_large")
    assert snapshot(api) == before


def test_chunked_60mb_envelope_is_413_without_being_read_whole(api: ApiServer) -> None:
    total, piece = 60_000_000, b"A" * 65_536
    chunks = (piece for _ in range(total // len(piece)))
    before = snapshot(api)
    response, body, sent = _raw_post(api, "/v1/envelopes", {
        "Authorization": f"Bearer {api.keys['ingester']}",
        "Content-Type": "application/json", "Transfer-Encoding": "chunked"}, chunks, True)
    assert_problem(response, body, 413, "too_large")
    # refused at the 4 MiB envelope limit, not after buffering all 60 MB (socket buffers
    # take a few MB more before the sender notices)
    assert sent < total // 2, sent
    assert snapshot(api) == before
    assert httpx.get(api.base_url + "/healthz").status_code == 200


def test_a_newline_in_a_comment_gets_a_readable_message(api: ApiServer,
                                                       stored: dict[str, Any]) -> None:
    """Issue 13: a 422 that says what is wrong, not the regular expression it failed."""
    with api.client("reviewer") as c:
        r = c.post(f"/v1/disputes/{stored['dispute_id']}/comments",
                   json={"text": "line one\nline two"})
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["detail"] == ("body.text: must be one line of text: no newlines, tabs or "
                              "other control characters")
    assert "\\x00" not in r.text and "^[" not in r.text
