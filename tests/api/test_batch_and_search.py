"""Batch ingest (per-item results, atomic mode) and search with cursor pagination."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.core.keys import public_raw
from tests.api.test_ingest import counts
from tests.helpers import ApiServer, signed, statement


def test_batch_reports_each_item_and_stores_the_valid_ones(api: ApiServer) -> None:
    key = api.producer  # type: ignore[attr-defined]
    good = [signed(statement(), key) for _ in range(3)]
    repeat = good[0]
    bad = signed(statement(), key)
    bad["signatures"][0]["sig"] = good[1]["signatures"][0]["sig"]
    conflict_st = statement()
    with api.client("ingester") as c:
        first = c.post("/v1/envelopes", json=signed(conflict_st, key))
        assert first.status_code == 201
        conflict_st["predicate"]["output"]["finish_reason"] = "stop"
        before = counts(api)
        r = c.post("/v1/envelopes/batch", json={"envelopes": [
            *good, repeat, bad, signed(conflict_st, key), {"payload": 1}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [x["status"] for x in body["results"]] == [201, 201, 201, 200, 422, 409, 400]
    assert (body["created"], body["existing"], body["conflicts"], body["rejected"]) == (3, 1, 1, 2)
    assert body["results"][4]["problem"]["code"] == "bad_signature"
    assert body["results"][3]["log_index"] == body["results"][0]["log_index"]
    indices = [x["log_index"] for x in body["results"][:3]]
    assert indices == list(range(indices[0], indices[0] + 3))
    after = counts(api)
    assert after == (before[0] + 3, before[1] + 3, before[2] + 3)


def test_a_batch_item_postgresql_could_not_store_is_rejected_alone(api: ApiServer) -> None:
    """A NUL in a stored string (model_name here) is the item's 422, not the statement's
    failure: the batch's other items are stored."""
    key = api.producer  # type: ignore[attr-defined]
    nul = statement()
    nul["predicate"]["artifacts"]["model_name"] = "tiny\x00demo"
    before = counts(api)
    with api.client("ingester") as c:
        r = c.post("/v1/envelopes/batch", json={"envelopes": [
            signed(statement(), key), signed(nul, key), signed(statement(), key)]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [x["status"] for x in body["results"]] == [201, 422, 201]
    assert body["results"][1]["problem"]["code"] == "invalid_envelope"
    assert counts(api) == (before[0] + 2, before[1] + 2, before[2] + 2)


def test_atomic_batch_with_one_bad_item_writes_nothing(api: ApiServer) -> None:
    key = api.producer  # type: ignore[attr-defined]
    items = [signed(statement(), key) for _ in range(4)]
    items[2]["payloadType"] = "text/plain"
    before = counts(api)
    with api.client("ingester") as c:
        r = c.post("/v1/envelopes/batch?atomic=true", json={"envelopes": items})
    assert r.status_code == 422
    assert r.headers["content-type"].startswith("application/problem+json")
    statuses = [x["status"] for x in r.json()["results"]]
    assert statuses == [424, 424, 422, 424]
    assert counts(api) == before
    items[2] = signed(statement(), key)
    with api.client("ingester") as c:
        ok = c.post("/v1/envelopes/batch?atomic=true", json={"envelopes": items})
    assert ok.status_code == 200 and ok.json()["created"] == 4


def test_batch_shape_errors(api: ApiServer) -> None:
    with api.client("ingester") as c:
        assert c.post("/v1/envelopes/batch", json={"envelopes": []}).json()["code"] == "empty_batch"
        assert c.post("/v1/envelopes/batch", json=[1]).json()["code"] == "malformed_batch"
        r = c.post("/v1/envelopes/batch", json={"envelopes": [{}] * 1001})
        assert r.status_code == 413 and r.json()["code"] == "too_many_items"


def test_search_filters_and_cursor_pagination(api: ApiServer) -> None:
    model = "cd" * 32
    base = datetime.now(UTC) - timedelta(days=3)
    # envelopes dated days back need a key valid since then (recorded_before_key_valid)
    key = Ed25519PrivateKey.generate()
    with api.client("admin") as admin:
        assert admin.post("/v1/keys", json={
            "public_key": base64.b64encode(public_raw(key)).decode(), "purpose": "producer",
            "name": "search-backfill", "not_before": (base - timedelta(days=1)).isoformat()}
        ).status_code == 201
    runtime_bf16 = {"engine": "reference", "engine_version": "0.1.0", "device": "cpu",
                    "dtype": "bfloat16", "batch_invariant": True}
    envs = []
    for i in range(25):
        st = statement(model_sha256=model, channel="performance" if i % 5 == 0 else "deterministic",
                       runtime=runtime_bf16 if i % 2 else None)
        st["predicate"]["recorded_at"] = (base + timedelta(hours=i)).isoformat()
        envs.append(signed(st, key))
    with api.client("ingester") as c:
        assert c.post("/v1/envelopes/batch", json={"envelopes": envs}).json()["created"] == 25
    with api.client("reviewer") as c:
        seen: list[dict[str, object]] = []
        cursor = None
        while True:
            params = {"model_sha256": model, "limit": 7}
            if cursor:
                params["cursor"] = cursor
            page = c.get("/v1/envelopes", params=params).json()
            seen.extend(page["items"])
            cursor = page["next_cursor"]
            if not cursor:
                break
        assert len(seen) == 25
        idx = [s["log_index"] for s in seen]
        assert idx == sorted(idx) and len(set(idx)) == 25
        perf = c.get("/v1/envelopes", params={"model_sha256": model, "channel": "performance"})
        assert len(perf.json()["items"]) == 5
        fps = {s["fingerprint_id"] for s in seen}
        assert len(fps) == 2
        one_fp = sorted(fps)[0]
        by_fp = c.get("/v1/envelopes", params={"model_sha256": model, "fingerprint_id": one_fp})
        assert {s["fingerprint_id"] for s in by_fp.json()["items"]} == {one_fp}
        window = c.get("/v1/envelopes", params={
            "model_sha256": model, "recorded_after": (base + timedelta(hours=10)).isoformat(),
            "recorded_before": (base + timedelta(hours=15)).isoformat()})
        assert len(window.json()["items"]) == 5
        desc = c.get("/v1/envelopes", params={"model_sha256": model, "order": "desc",
                                              "limit": 3}).json()
        assert [s["log_index"] for s in desc["items"]] == sorted(idx, reverse=True)[:3]
        # a cursor is bound to its query; garbage and foreign cursors are 400s
        first = c.get("/v1/envelopes", params={"model_sha256": model, "limit": 2}).json()
        foreign = c.get("/v1/envelopes", params={"channel": "performance",
                                                 "cursor": first["next_cursor"]})
        assert foreign.status_code == 400 and foreign.json()["code"] == "bad_cursor"
        for junk in ("x", "eyJhZnRlciI6IjEifQ"):  # not base64 JSON; {"after":"1"}
            r = c.get("/v1/envelopes", params={"cursor": junk})
            assert r.status_code == 400 and r.json()["code"] == "bad_cursor"
        for injected in ("' OR 1=1 --", json.dumps({"after": 1})):
            r = c.get("/v1/envelopes", params={"cursor": injected})
            assert r.status_code == 422 and r.json()["code"] == "invalid_request"
        naive = c.get("/v1/envelopes", params={"recorded_after": "2026-01-01T00:00:00"})
        assert naive.status_code == 422


def test_unknown_envelope_is_404_problem(api: ApiServer) -> None:
    with api.client("reviewer") as c:
        r = c.get("/v1/envelopes/no-such-request")
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/problem+json")
