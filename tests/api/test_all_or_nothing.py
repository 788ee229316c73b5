"""All or nothing, one set of limits: an atomic batch with any failed item (a request_id
conflict included) stores nothing; every batch item is held to the single-envelope limits
(bytes, tokens, canonical base64, the recorded_at window). Real `ledger serve`, real
PostgreSQL; every "nothing stored" is a row count before and after."""

from __future__ import annotations

import base64
import json
import secrets
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.core.keys import public_raw
from tests.helpers import ApiServer, signed, statement

B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def counts(api: ApiServer) -> tuple[int, int, int, int]:
    url = api.db_url.replace("postgresql+psycopg://", "postgresql://")  # type: ignore[attr-defined]
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM envelopes), (SELECT count(*) FROM log_entries), "
            "(SELECT size FROM log_state), (SELECT count(*) FROM fingerprints)").fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2]), int(row[3])


def stored(api: ApiServer, request_id: str) -> bool:
    url = api.db_url.replace("postgresql+psycopg://", "postgresql://")  # type: ignore[attr-defined]
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM envelopes WHERE request_id = %s",
                           (request_id,)).fetchone()
    assert row is not None
    return int(row[0]) == 1


def rid(env: dict[str, Any]) -> str:
    return str(json.loads(base64.b64decode(env["payload"]))["predicate"]["request_id"])


def batch(api: ApiServer, envelopes: list[dict[str, Any]], atomic: bool) -> Any:
    with api.client("ingester") as c:
        return c.post("/v1/envelopes/batch", params={"atomic": atomic} if atomic else None,
                      json={"envelopes": envelopes}, timeout=120)


def problem_of(r: Any, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:600])
    assert r.headers["content-type"].startswith("application/problem+json")
    body = dict(r.json())
    assert body["code"] == code and body["status"] == status, body
    return body


def single(api: ApiServer, env: dict[str, Any]) -> Any:
    with api.client("ingester") as c:
        return c.post("/v1/envelopes", json=env, timeout=120)


# --- conflicts ----------------------------------------------------------------------------

def test_atomic_batch_with_a_conflict_stores_nothing(api: ApiServer) -> None:
    key = api.producer  # type: ignore[attr-defined]
    taken = statement()
    assert single(api, signed(taken, key)).status_code == 201
    other = statement(taken["predicate"]["request_id"], output_len=5)  # other bytes, same ID
    items = [signed(statement(), key), signed(other, key), signed(statement(), key)]
    before = counts(api)
    r = batch(api, items, atomic=True)
    body = problem_of(r, 409, "batch_rejected")
    assert body["failed_positions"] == [1]
    assert "#1" in body["detail"] and taken["predicate"]["request_id"] in body["detail"]
    assert [x["status"] for x in body["results"]] == [424, 409, 424]
    assert body["results"][1]["problem"]["code"] == "request_id_conflict"
    assert all(x["log_index"] is None for x in body["results"] if x["status"] == 424)
    assert counts(api) == before
    assert not stored(api, rid(items[0])) and not stored(api, rid(items[2]))

    # the same batch, not atomic: the two new ones are stored, the conflict reported
    r = batch(api, items, atomic=False)
    assert r.status_code == 200, r.text
    assert [x["status"] for x in r.json()["results"]] == [201, 409, 201]
    assert counts(api)[0] == before[0] + 2
    assert stored(api, rid(items[0])) and stored(api, rid(items[2]))


def test_atomic_batch_with_mixed_failures_is_422_naming_each(api: ApiServer) -> None:
    key = api.producer  # type: ignore[attr-defined]
    taken = statement()
    assert single(api, signed(taken, key)).status_code == 201
    conflict = signed(statement(taken["predicate"]["request_id"], output_len=6), key)
    unsigned = signed(statement(), Ed25519PrivateKey.generate())  # unknown key
    items = [signed(statement(), key), conflict, unsigned]
    before = counts(api)
    body = problem_of(batch(api, items, atomic=True), 422, "batch_rejected")
    assert body["failed_positions"] == [1, 2]
    assert [x["status"] for x in body["results"]] == [424, 409, 422]
    assert counts(api) == before


def test_atomic_batch_of_repeats_and_new_items_stores_the_new_ones(api: ApiServer) -> None:
    key = api.producer  # type: ignore[attr-defined]
    repeat = signed(statement(), key)
    assert single(api, repeat).status_code == 201
    before = counts(api)
    r = batch(api, [repeat, signed(statement(), key)], atomic=True)
    assert r.status_code == 200, r.text
    assert [x["status"] for x in r.json()["results"]] == [200, 201]
    assert counts(api)[0] == before[0] + 1


# --- the byte limit holds for every item ------------------------------------------------

def _big_statement(min_bytes: int) -> dict[str, Any]:
    """A valid statement whose envelope is over ``min_bytes``: the most output tokens the
    limits allow, each with logprobs, a logits digest and top-2 alternatives."""
    st = statement(output_len=65_536)
    out = st["predicate"]["output"]
    out["top_logprobs"] = [[{"token_id": (t + 1) % 259, "logprob": -1.25 - i / 65_536},
                            {"token_id": (t + 2) % 259, "logprob": -2.5 - i / 65_536}]
                           for i, t in enumerate(out["token_ids"])]
    st["predicate"]["sampling"]["logprobs"] = 2
    st["predicate"]["prompt_token_ids"] = [(5 * i + 1) % 259 for i in range(200_000)]
    return st


def test_a_12_mib_item_is_413_in_a_batch_and_nothing_of_it_is_stored(api: ApiServer) -> None:
    key = api.producer  # type: ignore[attr-defined]
    big = signed(_big_statement(12 * 1024 * 1024), key)
    size = len(json.dumps(big, separators=(",", ":")))
    assert size > 12 * 1024 * 1024, size
    before = counts(api)
    # alone: 413, as before
    problem_of(single(api, big), 413, "too_large")
    assert counts(api) == before

    # in a plain batch: 413 for that item, the others stored
    small = [signed(statement(), key), signed(statement(), key)]
    r = batch(api, [small[0], big, small[1]], atomic=False)
    assert r.status_code == 200, r.text[:500]
    results = r.json()["results"]
    assert [x["status"] for x in results] == [201, 413, 201]
    assert results[1]["problem"]["code"] == "too_large"
    assert results[1]["log_index"] is None
    assert not stored(api, rid(big))
    assert counts(api)[0] == before[0] + 2

    # in an atomic batch: 413, nothing stored at all
    before = counts(api)
    fresh = [signed(statement(), key), signed(statement(), key)]
    body = problem_of(batch(api, [fresh[0], big, fresh[1]], atomic=True), 413,
                      "batch_rejected")
    assert body["failed_positions"] == [1]
    assert body["results"][1]["problem"]["code"] == "too_large"
    assert counts(api) == before
    assert not stored(api, rid(big)) and not any(stored(api, rid(f)) for f in fresh)


def test_token_limits_hold_for_batch_items_as_for_single_envelopes(api: ApiServer) -> None:
    key = api.producer  # type: ignore[attr-defined]
    long_prompt = signed(statement(prompt_len=262_145), key)  # max_prompt_tokens + 1
    before = counts(api)
    alone = single(api, long_prompt)
    assert alone.status_code == 422, alone.text[:300]
    r = batch(api, [signed(statement(), key), long_prompt], atomic=False)
    results = r.json()["results"]
    assert [x["status"] for x in results] == [201, 422]
    assert results[1]["problem"]["code"] == alone.json()["code"]
    assert not stored(api, rid(long_prompt))
    assert counts(api)[0] == before[0] + 1


# --- canonical base64 --------------------------------------------------------------------

def non_canonical(text: str) -> str:
    """The same bytes, another base64 text: set an unused low bit of the last character."""
    pad = len(text) - len(text.rstrip("="))
    assert pad in (1, 2), "canonical base64 without padding has no second text"
    i = len(text) - pad - 1
    alt = text[:i] + B64[B64.index(text[i]) ^ 1] + text[i + 1:]
    assert base64.b64decode(alt) == base64.b64decode(text) and alt != text
    return alt


def _padded_payload_statement() -> dict[str, Any]:
    for n in range(3):  # the request_id length moves the payload length mod 3
        st = statement("pad-" + "x" * n + "-" + secrets.token_hex(8))
        env = signed(st, Ed25519PrivateKey.generate())
        if env["payload"].endswith("="):
            return st
    raise AssertionError("no padded payload")


@pytest.mark.parametrize("where", ["sig", "payload"])
def test_non_canonical_base64_is_refused_alone_and_in_batches(api: ApiServer,
                                                              where: str) -> None:
    key = api.producer  # type: ignore[attr-defined]
    st = _padded_payload_statement()
    env = signed(st, key)
    assert single(api, env).status_code == 201  # the canonical form is stored
    twin = json.loads(json.dumps(env))
    if where == "sig":
        twin["signatures"][0]["sig"] = non_canonical(env["signatures"][0]["sig"])
    else:
        twin["payload"] = non_canonical(env["payload"])
    before = counts(api)
    # the same signature / payload bytes in another text: refused, not a 409 conflict
    problem_of(single(api, twin), 400, "non_canonical_base64")
    r = batch(api, [twin], atomic=False)
    assert r.status_code == 200
    item = r.json()["results"][0]
    assert item["status"] == 400 and item["problem"]["code"] == "non_canonical_base64"
    body = problem_of(batch(api, [signed(statement(), key), twin], atomic=True), 400,
                      "batch_rejected")
    assert body["failed_positions"] == [1]
    assert counts(api) == before
    # a new envelope in non-canonical form is refused just the same
    fresh = signed(_padded_payload_statement(), key)
    fresh["signatures"][0]["sig"] = non_canonical(fresh["signatures"][0]["sig"])
    problem_of(single(api, fresh), 400, "non_canonical_base64")
    assert counts(api) == before


# --- the recorded_at window ----------------------------------------------------------------

def test_recorded_at_before_the_key_is_valid_is_refused(api: ApiServer) -> None:
    today = Ed25519PrivateKey.generate()
    backfill = Ed25519PrivateKey.generate()
    with api.client("admin") as admin:
        for k, name, nb in ((today, "registered-today", None),
                            (backfill, "backfill", "2000-01-01T00:00:00Z")):
            body: dict[str, Any] = {"public_key": base64.b64encode(public_raw(k)).decode(),
                                    "purpose": "producer", "name": name}
            if nb:
                body["not_before"] = nb
            assert admin.post("/v1/keys", json=body).status_code == 201
    old = "2001-06-01T12:00:00+00:00"
    st = statement()
    st["predicate"]["recorded_at"] = old
    before = counts(api)
    problem_of(single(api, signed(st, today)), 422, "recorded_before_key_valid")
    r = batch(api, [signed(st, today)], atomic=False)
    assert r.json()["results"][0]["problem"]["code"] == "recorded_before_key_valid"
    # later than now + skew: refused too, alone and in a batch
    future = statement()
    future["predicate"]["recorded_at"] = (datetime.now(UTC) + timedelta(hours=2)).isoformat()
    problem_of(single(api, signed(future, today)), 422, "recorded_in_future")
    r = batch(api, [signed(future, today)], atomic=False)
    assert r.json()["results"][0]["problem"]["code"] == "recorded_in_future"
    assert counts(api) == before
    # a key registered with an earlier not_before may backfill
    assert single(api, signed(st, backfill)).status_code == 201
    # a few minutes of clock skew before not_before are tolerated
    skewed = statement()
    skewed["predicate"]["recorded_at"] = (datetime.now(UTC) - timedelta(minutes=2)).isoformat()
    assert single(api, signed(skewed, today)).status_code == 201
