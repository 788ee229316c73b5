"""Ingest over real HTTP into a real PostgreSQL: signatures over exact bytes, every
bad-input class (4xx, nothing written), idempotent repeats and 409 conflicts."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.core.canonical import canonical_json
from ledger.producer import sign_payload_bytes
from tests.helpers import ApiServer, signed, statement


def counts(api: ApiServer) -> tuple[int, int, int]:
    url = api.db_url.replace("postgresql+psycopg://", "postgresql://")  # type: ignore[attr-defined]
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM envelopes), (SELECT count(*) FROM log_entries), "
            "(SELECT size FROM log_state)").fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def post_raw(api: ApiServer, body: bytes, role: str = "ingester") -> Any:
    with api.client(role) as c:
        return c.post("/v1/envelopes", content=body,
                      headers={"Content-Type": "application/json"})


def test_ingest_then_get_returns_stored_bytes_verbatim(api: ApiServer) -> None:
    env = signed(statement(), api.producer)  # type: ignore[attr-defined]
    r = post_raw(api, json.dumps(env).encode())
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["outcome"] == "created" and created["log_index"] >= 0
    assert created["fingerprint_id"].startswith("fp-")
    rid = json.loads(base64.b64decode(env["payload"]))["predicate"]["request_id"]
    with api.client("reviewer") as c:
        got = c.get(f"/v1/envelopes/{rid}")
    assert got.status_code == 200
    assert got.json()["dsse"] == env
    # the payload bytes come back exactly as signed
    assert got.json()["dsse"]["payload"] == env["payload"]
    assert got.json()["index"]["log_index"] == created["log_index"]
    assert got.json()["index"]["prompt_tokens"] == 8


def test_same_bytes_again_is_200_with_same_index(api: ApiServer) -> None:
    body = json.dumps(signed(statement(), api.producer)).encode()  # type: ignore[attr-defined]
    first = post_raw(api, body)
    before = counts(api)
    again = post_raw(api, body)
    # whitespace in the DSSE wrapper does not change the stored (canonical) envelope
    spaced = post_raw(api, json.dumps(json.loads(body), indent=2).encode())
    assert first.status_code == 201
    assert again.status_code == 200 and spaced.status_code == 200
    assert again.json()["log_index"] == first.json()["log_index"] == spaced.json()["log_index"]
    assert again.json()["outcome"] == "existing"
    assert counts(api) == before


def test_other_bytes_under_same_request_id_is_409_with_both_digests(api: ApiServer) -> None:
    st = statement()
    first = post_raw(api, json.dumps(signed(st, api.producer)).encode())  # type: ignore[attr-defined]
    st2 = json.loads(json.dumps(st))
    st2["predicate"]["output"]["finish_reason"] = "stop"
    before = counts(api)
    r = post_raw(api, json.dumps(signed(st2, api.producer)).encode())  # type: ignore[attr-defined]
    assert r.status_code == 409
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["code"] == "request_id_conflict"
    assert body["existing_dsse_sha256"] == first.json()["dsse_sha256"]
    assert body["submitted_dsse_sha256"] != body["existing_dsse_sha256"]
    assert counts(api) == before


def test_reencoded_payload_with_same_meaning_is_rejected(api: ApiServer) -> None:
    """The signature covers the exact payload bytes; the same JSON written differently
    (spaces, key order) under the original signature must fail."""
    st = statement()
    original = canonical_json(st)
    env = sign_payload_bytes(original, api.producer)  # type: ignore[attr-defined]
    reencoded = json.dumps(json.loads(original), indent=1, sort_keys=False).encode()
    assert reencoded != original and json.loads(reencoded) == json.loads(original)
    env["payload"] = base64.b64encode(reencoded).decode()
    before = counts(api)
    r = post_raw(api, json.dumps(env).encode())
    assert r.status_code == 422
    assert r.json()["code"] == "bad_signature"
    assert counts(api) == before
    # and the re-encoded bytes signed properly are fine: we never re-serialise
    ok = post_raw(api, json.dumps(sign_payload_bytes(reencoded, api.producer)).encode())  # type: ignore[attr-defined]
    assert ok.status_code == 201, ok.text


def _mutate_statement(fn: Callable[[dict[str, Any]], None]) -> Callable[[ApiServer], bytes]:
    def build(api: ApiServer) -> bytes:
        st = statement()
        fn(st)
        payload = json.dumps(st, separators=(",", ":")).encode()
        return json.dumps(sign_payload_bytes(payload, api.producer)).encode()  # type: ignore[attr-defined]
    return build


def _raw_payload(payload: bytes) -> Callable[[ApiServer], bytes]:
    def build(api: ApiServer) -> bytes:
        return json.dumps(sign_payload_bytes(payload, api.producer)).encode()  # type: ignore[attr-defined]
    return build


def _envelope(fn: Callable[[dict[str, Any], ApiServer], None]) -> Callable[[ApiServer], bytes]:
    def build(api: ApiServer) -> bytes:
        env = signed(statement(), api.producer)  # type: ignore[attr-defined]
        fn(env, api)
        return json.dumps(env).encode()
    return build


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def fn(st: dict[str, Any]) -> None:
        obj = st
        parts = path.split(".")
        for p in parts[:-1]:
            obj = obj[p]
        if value is _DELETE:
            del obj[parts[-1]]
        else:
            obj[parts[-1]] = value
    return fn


_DELETE = object()
OTHER_KEY = Ed25519PrivateKey.generate()


def _other_signer(env: dict[str, Any], api: ApiServer) -> None:
    resigned = sign_payload_bytes(base64.b64decode(env["payload"]), OTHER_KEY)
    env["signatures"] = resigned["signatures"]


def _sig_over_other_bytes(env: dict[str, Any], api: ApiServer) -> None:
    other = signed(statement(), api.producer)  # type: ignore[attr-defined]
    env["signatures"] = other["signatures"]


BAD_INPUTS: dict[str, tuple[Callable[[ApiServer], bytes], int, str]] = {
    "not json": (lambda api: b"{not json", 400, "malformed_json"),
    "not utf-8": (lambda api: b'{"payload": "\xff\xfe"}', 400, "not_utf8"),
    "dsse not an object": (lambda api: b"[1, 2]", 400, "malformed_dsse"),
    "dsse missing signatures": (_envelope(lambda e, a: e.pop("signatures")), 400, "malformed_dsse"),
    "dsse extra field": (_envelope(lambda e, a: e.update(extra=1)), 400, "malformed_dsse"),
    "dsse duplicate key": (lambda api: b'{"payload":"e30=","payload":"e30=","payloadType":"x",'
                           b'"signatures":[]}', 400, "duplicate_key"),
    "bad base64 payload": (_envelope(lambda e, a: e.update(payload="@@@=")), 400, "bad_base64"),
    "bad base64 sig": (_envelope(lambda e, a: e["signatures"][0].update(sig="!!")), 400,
                       "bad_base64"),
    "short signature": (_envelope(lambda e, a: e["signatures"][0].update(sig="AAAA")), 422,
                        "bad_signature"),
    "bad keyid": (_envelope(lambda e, a: e["signatures"][0].update(keyid="abc")), 400,
                  "malformed_dsse"),
    "wrong payloadType": (_envelope(lambda e, a: e.update(payloadType="text/plain")), 422,
                          "wrong_payload_type"),
    "signature over other bytes": (_envelope(_sig_over_other_bytes), 422, "bad_signature"),
    "unknown key": (_envelope(_other_signer), 422, "unknown_key"),
    "payload not json": (_raw_payload(b"hello"), 400, "malformed_json"),
    "payload NaN": (_raw_payload(b'{"x": NaN}'), 400, "malformed_json"),
    "payload duplicate key": (_raw_payload(b'{"a":1,"a":2}'), 400, "duplicate_key"),
    "payload deep": (_raw_payload(b"[" * 100 + b"]" * 100), 400, "too_deep"),
    "wrong predicateType": (_mutate_statement(_set("predicateType", "urn:other")), 422,
                            "wrong_predicate_type"),
    "wrong _type": (_mutate_statement(_set("_type", "https://in-toto.io/Statement/v0.1")), 422,
                    "invalid_envelope"),
    "missing field": (_mutate_statement(_set("predicate.sampling", _DELETE)), 422,
                      "invalid_envelope"),
    "mistyped field": (_mutate_statement(_set("predicate.channel", 3)), 422, "invalid_envelope"),
    "string token id": (_mutate_statement(_set("predicate.prompt_token_ids", ["1"])), 422,
                        "invalid_envelope"),
    "negative token id": (_mutate_statement(_set("predicate.prompt_token_ids", [1, -5])), 422,
                          "invalid_envelope"),
    "absurd token id": (_mutate_statement(_set("predicate.prompt_token_ids", [2**40])), 422,
                        "invalid_envelope"),
    "huge integer": (_raw_payload(b'{"predicateType":"urn:inference-ledger:envelope:v1","x":'
                                  + b"9" * 5000 + b"}"), 400, "malformed_json"),
    "temperature out of range": (_mutate_statement(_set("predicate.sampling.temperature", -1.0)),
                                 422, "invalid_envelope"),
    "top_p out of range": (_mutate_statement(_set("predicate.sampling.top_p", 1.5)), 422,
                           "invalid_envelope"),
    "seed out of range": (_mutate_statement(_set("predicate.sampling.seed", 2**53)), 422,
                          "invalid_envelope"),
    "max_tokens zero": (_mutate_statement(_set("predicate.sampling.max_tokens", 0)), 422,
                        "invalid_envelope"),
    "bad channel": (_mutate_statement(_set("predicate.channel", "fast")), 422,
                    "invalid_envelope"),
    "naive recorded_at": (_mutate_statement(_set("predicate.recorded_at", "2026-01-01T00:00:00")),
                          422, "invalid_envelope"),
    "recorded in the future": (_mutate_statement(_set("predicate.recorded_at",
                                                      "2099-01-01T00:00:00+00:00")), 422,
                               "recorded_in_future"),
    "bad request_id": (_mutate_statement(_set("predicate.request_id", "a b")), 422,
                       "invalid_envelope"),
    "subject mismatch": (_mutate_statement(_set("subject", [{"name": "x", "digest": {
        "sha256": "00" * 32}}])), 422, "invalid_envelope"),
    "logprobs length mismatch": (_mutate_statement(_set("predicate.output.logprobs", [-1.0])),
                                 422, "invalid_envelope"),
    "unknown predicate field": (_mutate_statement(_set("predicate.colour", "blue")), 422,
                                "invalid_envelope"),
    "too many prompt tokens": (_mutate_statement(_set("predicate.prompt_token_ids",
                                                      [1] * 262_145)), 422, "invalid_envelope"),
    # PostgreSQL's text and jsonb hold no NUL: refused as invalid, never a 500
    "NUL in model_name": (_mutate_statement(_set("predicate.artifacts.model_name", "a\x00b")),
                          422, "invalid_envelope"),
    "NUL in a runtime field": (_mutate_statement(_set("predicate.runtime.engine", "a\x00b")),
                               422, "invalid_envelope"),
    "NUL in a runtime extra": (_mutate_statement(_set("predicate.runtime.hostname", "a\x00b")),
                               422, "invalid_envelope"),
    "NUL in a runtime extra's name": (_mutate_statement(_set("predicate.runtime.a\x00b", 1)),
                                      422, "invalid_envelope"),
    "NUL in an engine flag": (_mutate_statement(_set("predicate.runtime.engine_flags",
                                                     {"x": ["a\x00b"]})), 422,
                              "invalid_envelope"),
    "NUL in an engine flag's name": (_mutate_statement(_set("predicate.runtime.engine_flags",
                                                            {"a\x00b": 1})), 422,
                                     "invalid_envelope"),
    # integers of a runtime are I-JSON safe: beyond, the fingerprint cannot be computed
    "huge integer in a runtime extra": (_mutate_statement(_set("predicate.runtime.gpu_mem",
                                                               2**60)), 422,
                                        "invalid_envelope"),
    "huge integer in an engine flag": (_mutate_statement(_set("predicate.runtime.engine_flags",
                                                              {"x": 2**60})), 422,
                                       "invalid_envelope"),
    "payload over size limit": (lambda api: b'{"payload":"' + b"A" * (5 * 1024 * 1024)
                                + b'"}', 413, "too_large"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_4xx_problem_and_writes_nothing(api: ApiServer, case: str) -> None:
    build, status, code = BAD_INPUTS[case]
    before = counts(api)
    r = post_raw(api, build(api))
    assert r.status_code == status, (case, r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["code"] == code, (case, body)
    assert body["status"] == status and body["detail"] and body["type"].endswith(code)
    assert counts(api) == before


def test_the_key_and_role_are_answered_before_anything_about_the_body(api: ApiServer) -> None:
    """A single POST reads its producer keys in the API key's statement, so the key IDs its
    bytes name are looked for before the key is checked; the answers must not change: an
    unknown, malformed or revoked key is 401 and a role without the permission 403, for
    every body (a valid envelope, each bad input, an oversized one), and nothing is stored.
    With a valid ingester key the same bodies get their own 4xx (the test above)."""
    with api.client("admin") as admin:
        made = admin.post("/v1/api-keys", json={"name": "order-revoked", "role": "ingester"})
        assert made.status_code == 201, made.text
        revoked = made.json()["key"]
        assert admin.post(f"/v1/api-keys/{made.json()['id']}/revoke").status_code == 200
    callers = {"unknown key": ("lk_" + "x" * 43, 401, "bad_api_key"),
               "malformed key": ("not-a-ledger-key", 401, "bad_api_key"),
               "revoked key": (revoked, 401, "revoked_api_key"),
               "reviewer": (api.keys["reviewer"], 403, "forbidden_role")}
    bodies = {"valid envelope": json.dumps(signed(statement(), api.producer)).encode(),  # type: ignore[attr-defined]
              **{case: build(api) for case, (build, _s, _c) in BAD_INPUTS.items()}}
    before = counts(api)
    with api.client() as c:
        for who, (key, status, code) in callers.items():
            for case, body in bodies.items():
                r = c.post("/v1/envelopes", content=body,
                           headers={"Authorization": f"Bearer {key}",
                                    "Content-Type": "application/json"})
                assert (r.status_code, r.json()["code"]) == (status, code), (who, case, r.text)
    assert counts(api) == before


def test_revoked_and_not_yet_valid_keys_are_refused_old_envelopes_stay(api: ApiServer) -> None:
    key = Ed25519PrivateKey.generate()
    future = Ed25519PrivateKey.generate()
    from ledger.core.keys import public_raw

    with api.client("admin") as admin:
        r = admin.post("/v1/keys", json={"public_key": base64.b64encode(public_raw(key)).decode(),
                                         "purpose": "producer", "name": "rotating"})
        assert r.status_code == 201
        keyid = r.json()["keyid"]
        r = admin.post("/v1/keys", json={
            "public_key": base64.b64encode(public_raw(future)).decode(), "purpose": "producer",
            "name": "future", "not_before": "2099-01-01T00:00:00Z"})
        assert r.status_code == 201
    st = statement()
    env = signed(st, key)
    # compact JSON, as producers send it: the key IDs are found in the bytes, so the API
    # remembers the key's row for the next request (ledger.services.credentials) ...
    assert post_raw(api, compact(env)).status_code == 201
    with api.client("admin") as admin:
        assert admin.post(f"/v1/keys/{keyid}/revoke", json={"reason": "rotated"}).status_code == 200
    before = counts(api)
    # ... and finds it changed before storing the next envelope it signed
    r = post_raw(api, compact(signed(statement(), key)))
    assert r.status_code == 422 and r.json()["code"] == "revoked_key"
    r = post_raw(api, json.dumps(signed(statement(), future)).encode())
    assert r.status_code == 422 and r.json()["code"] == "key_not_yet_valid"
    assert counts(api) == before
    # the envelope signed before revocation is still served, and still verifies
    with api.client("auditor") as c:
        got = c.get(f"/v1/envelopes/{st['predicate']['request_id']}")
        assert got.status_code == 200 and got.json()["dsse"] == env
        k = c.get(f"/v1/keys/{keyid}").json()
        assert k["status"] == "revoked" and k["revoked_reason"] == "rotated"


def test_worker_key_cannot_sign_envelopes(api: ApiServer) -> None:
    worker_key = Ed25519PrivateKey.generate()
    from ledger.core.keys import public_raw

    with api.client("admin") as admin:
        assert admin.post("/v1/keys", json={
            "public_key": base64.b64encode(public_raw(worker_key)).decode(),
            "purpose": "worker", "name": "gpu-1"}).status_code == 201
    r = post_raw(api, json.dumps(signed(statement(), worker_key)).encode())
    assert r.status_code == 422 and r.json()["code"] == "wrong_key_purpose"


def test_api_key_revocation_and_role_change_take_effect_on_the_next_ingest(
        api: ApiServer) -> None:
    """Ingest reads its API key in a raw statement of its own, or (single envelopes)
    admits it from memory and checks its row again before storing: either way a revoked
    key, or one given another role, is refused from the next request on, single and
    batch."""
    env = lambda: signed(statement(), api.producer)  # type: ignore[attr-defined]  # noqa: E731
    with api.client("admin") as admin:
        made = admin.post("/v1/api-keys", json={"name": "ingest-revoke", "role": "ingester"})
        assert made.status_code == 201, made.text
        kid, key = made.json()["id"], made.json()["key"]
        demoted = admin.post("/v1/api-keys", json={"name": "ingest-demote", "role": "ingester"})
        did, dkey = demoted.json()["id"], demoted.json()["key"]
        with api.client() as c:
            for k in (key, dkey):
                r = c.post("/v1/envelopes", json=env(), headers={"Authorization": f"Bearer {k}"})
                assert r.status_code == 201, r.text
            assert admin.post(f"/v1/api-keys/{kid}/revoke").status_code == 200
            assert admin.post(f"/v1/api-keys/{did}/role", json={"role": "reviewer"}
                              ).status_code == 200
            before = counts(api)
            for path, body in (("/v1/envelopes", env()),
                               ("/v1/envelopes/batch", {"envelopes": [env()]})):
                r = c.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 401 and r.json()["code"] == "revoked_api_key", r.text
                r = c.post(path, json=body, headers={"Authorization": f"Bearer {dkey}"})
                assert r.status_code == 403 and r.json()["code"] == "forbidden_role", r.text
            # an unauthorised request is refused before its body is looked at
            r = c.post("/v1/envelopes", content=b"{not json",
                       headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 401
            assert counts(api) == before


def compact(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def test_a_remembered_key_is_not_read_again(api: ApiServer) -> None:
    """After one request read them, the API key and producer key of single-envelope
    POSTs come from memory (ledger.services.credentials): the ingest reads' connections
    run nothing for the next ones, which are stored all the same."""
    from ledger.api.app import INGEST_READS_APPLICATION

    url = api.db_url.replace("postgresql+psycopg://", "postgresql://")  # type: ignore[attr-defined]

    def last_reads() -> list[Any]:
        with psycopg.connect(url, autocommit=True) as conn:
            return conn.execute(
                "SELECT pid, query_start FROM pg_stat_activity WHERE application_name = %s "
                "ORDER BY pid", (INGEST_READS_APPLICATION,)).fetchall()

    with api.client("admin") as admin:  # a key no earlier test's request was admitted with
        made = admin.post("/v1/api-keys", json={"name": "remembered", "role": "ingester"})
        assert made.status_code == 201, made.text
    headers = {"Authorization": f"Bearer {made.json()['key']}",
               "Content-Type": "application/json"}
    with api.client() as c:
        r = c.post("/v1/envelopes", content=compact(signed(statement(), api.producer)),  # type: ignore[attr-defined]
                   headers=headers)
        assert r.status_code == 201, r.text
        before, stored = last_reads(), counts(api)
        assert before  # the first request read on one
        for _ in range(5):
            r = c.post("/v1/envelopes", content=compact(signed(statement(), api.producer)),  # type: ignore[attr-defined]
                       headers=headers)
            assert r.status_code == 201, r.text
    assert last_reads() == before
    assert counts(api)[0] == stored[0] + 5


def test_ingest_survives_its_pooled_connections_being_dropped(api: ApiServer) -> None:
    """The ingest reads use pooled connections without a pre-ping; a connection the
    server dropped (a restart, an idle timeout) is replaced and the statement run again,
    so the request still succeeds (201), not 503."""
    from ledger.api.app import INGEST_READS_APPLICATION

    url = api.db_url.replace("postgresql+psycopg://", "postgresql://")  # type: ignore[attr-defined]
    for _ in range(3):
        r = post_raw(api, json.dumps(signed(statement(), api.producer)).encode())  # type: ignore[attr-defined]
        assert r.status_code == 201, r.text
        with psycopg.connect(url, autocommit=True) as conn:
            dropped = conn.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = %s", (INGEST_READS_APPLICATION,)).fetchone()
        assert dropped is not None and dropped[0] >= 1  # the pool held one: it is gone now
        r = post_raw(api, json.dumps(signed(statement(), api.producer)).encode())  # type: ignore[attr-defined]
        assert r.status_code == 201, r.text


@pytest.mark.parametrize("body", [b"1", b"null", b"true", b"1.5", b'"x"'])
def test_a_scalar_body_is_a_400_not_a_500(api: ApiServer, body: bytes) -> None:
    """A JSON document that is a bare scalar once made the strict reader's depth check
    raise TypeError (a 500)."""
    for path in ("/v1/envelopes", "/v1/envelopes/batch"):
        with api.client("ingester") as c:
            r = c.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, body, r.text)
        assert r.headers["content-type"].startswith("application/problem+json")
