"""One way to page (issue #14): every list's cursor carries the whole sort key, so rows that
share a timestamp are neither skipped nor repeated. Pages of one item walk disputes opened
at the same instant, runs created at the same instant, and envelopes, seeing each exactly
once; and a cursor is bound to the list and query that made it."""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import httpx
import psycopg
from psycopg.types.json import Jsonb

from tests.helpers import ApiServer, signed, statement

SAME_INSTANT = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def _db(api: ApiServer) -> psycopg.Connection[Any]:
    url = api.db_url.replace("postgresql+psycopg://", "postgresql://")  # type: ignore[attr-defined]
    return psycopg.connect(url)


def walk(c: httpx.Client, path: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Every item of a list, one page of one item at a time."""
    seen: list[dict[str, Any]] = []
    cursor = None
    for _ in range(1000):
        r = c.get(path, params={**params, "limit": 1, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        page = r.json()
        assert set(page) >= {"items", "next_cursor"}, page
        assert len(page["items"]) <= 1
        seen += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            return seen
    raise AssertionError(f"{path} did not end")


def _stored_envelopes(api: ApiServer, n: int, model_name: str) -> list[str]:
    key = api.producer  # type: ignore[attr-defined]
    sts = [statement() for _ in range(n)]
    for st in sts:
        st["predicate"]["artifacts"]["model_name"] = model_name
    with api.client("ingester") as c:
        r = c.post("/v1/envelopes/batch", json={"envelopes": [signed(st, key) for st in sts]})
    assert r.status_code == 200 and r.json()["created"] == n, r.text
    return [st["predicate"]["request_id"] for st in sts]


def test_disputes_opened_at_the_same_instant_are_each_seen_once(api: ApiServer) -> None:
    request_ids = _stored_envelopes(api, 5, "paging-disputes")
    with api.client("reviewer") as c:
        opened = [c.post("/v1/disputes", json={"request_id": rid, "reason": "paging"})
                  for rid in request_ids]
    assert all(r.status_code == 201 for r in opened), [r.text for r in opened]
    ids = {r.json()["id"] for r in opened}
    with _db(api) as conn:
        conn.execute("UPDATE disputes SET opened_at = %s WHERE id = ANY(%s)",
                     (SAME_INSTANT, [uuid.UUID(i) for i in ids]))
    with api.client("reviewer") as c:
        seen = walk(c, "/v1/disputes", {})
        mine = [d["id"] for d in seen if d["id"] in ids]
        assert Counter(mine) == Counter(ids)  # each exactly once
        assert len(seen) == len({d["id"] for d in seen})
        # the older cursor (opened_at alone) is kept, and shows why it was not enough
        first = c.get("/v1/disputes", params={"limit": 1,
                                              "before": "2026-03-01T12:00:01+00:00"}).json()
        assert first["items"][0]["id"] in ids
        behind = c.get("/v1/disputes", params={"limit": 10,
                                               "before": first["next_before"]}).json()
        assert not {d["id"] for d in behind["items"]} & ids
        # a cursor of one query is refused under another
        r = c.get("/v1/disputes", params={"limit": 1, "priority": "high",
                                          "cursor": first["next_cursor"]})
        assert r.status_code == 400 and r.json()["code"] == "bad_cursor"


def test_envelopes_are_each_seen_once_both_ways(api: ApiServer) -> None:
    request_ids = _stored_envelopes(api, 4, "paging-envelopes")
    with api.client("reviewer") as c:
        for order in ("asc", "desc"):
            seen = [e["request_id"] for e in walk(
                c, "/v1/envelopes", {"model_name": "paging-envelopes", "order": order})]
            assert seen == (request_ids if order == "asc" else request_ids[::-1])


def test_runs_created_at_the_same_instant_are_each_seen_once(api: ApiServer) -> None:
    ids = [uuid.uuid4() for _ in range(4)]
    with _db(api) as conn:
        for i, run_id in enumerate(ids):
            conn.execute(
                "INSERT INTO reverification_runs (id, kind, window_start, window_end, sampled,"
                " details, created_at) VALUES (%s, 'gate', %s, %s, 0, %s, %s)",
                (run_id, SAME_INSTANT, SAME_INSTANT,
                 Jsonb({"new_fingerprint": f"fp-paging-{i}", "model_sha256": "0" * 64}),
                 SAME_INSTANT))
    with api.client("admin") as c:
        seen = [r["id"] for r in walk(c, "/v1/reverification-runs", {"kind": "gate"})]
        assert Counter(i for i in seen if uuid.UUID(i) in ids) == Counter(str(i) for i in ids)
        assert len(seen) == len(set(seen))
        runs = walk(c, "/v1/reverification-runs", {})
        assert {str(i) for i in ids} <= {r["id"] for r in runs}
        policies = c.get("/v1/reverification-policies").json()
        assert set(policies) >= {"items", "next_cursor"}
