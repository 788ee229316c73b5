"""POST /v1/matrix-runs end to end with real processes: `ledger serve`, `ledger beat` and a
`ledger worker` (Celery on a private redis-server), PostgreSQL. The run is routed to the
worker's replay queue by fingerprint; the worker checks the sampled records, replays them
under each cell, signs the report and appends it; GET serves it after checking it against
its leaf, and the console renders it with SVG plots."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ledger.artifacts import model_sha256
from tests.replay.conftest import record
from tests.replay.stack import Stack, replay_stack
from tests.replay.test_replay_workers import fingerprints, ingest

pytestmark = pytest.mark.slow
CELLS = ["alone", "batch:4", "kernels:default+chunk:16"]


@pytest.fixture
def stack(db_url: str, tmp_path: Path) -> Any:
    with replay_stack(db_url, tmp_path) as s:
        yield s


def _console(stack: Stack, role: str) -> httpx.Client:
    c = httpx.Client(base_url=stack.api_url, timeout=60, follow_redirects=False)
    form = c.get("/console/sign-in")
    token = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
    assert token is not None, form.text
    r = c.post("/console/sign-in", data={"api_key": stack.keys[role],
                                         "csrf_token": token.group(1)})
    assert r.status_code == 303, r.text
    return c


def test_matrix_run_over_the_api_on_a_celery_worker(stack: Stack, tiny_engine: Any) -> None:
    from workers.engine.reference import TINY_DEMO_DIR

    recs = record(tiny_engine, stack.producer, 5, seed=21, prefix="mxapi")
    ingest(stack, [r.envelope for r in recs])
    digest = model_sha256(TINY_DEMO_DIR)
    body = {"model_sha256": digest, "sample": 5, "cells": CELLS}
    with stack.client("reviewer") as c:
        # bad input: problem+json 4xx, nothing queued
        for bad, status in (({**body, "cells": ["batch:zero"]}, 400),
                            ({**body, "sample": 0}, 422),
                            ({**body, "model_sha256": "0" * 64}, 404),
                            ({**body, "extra": 1}, 422)):
            r = c.post("/v1/matrix-runs", json=bad)
            assert r.status_code == status, (bad, r.text)
            assert r.headers["content-type"].startswith("application/problem+json")
        first = c.post("/v1/matrix-runs", json=body, headers={"Idempotency-Key": "mx-1"})
        assert first.status_code == 202, first.text
        again = c.post("/v1/matrix-runs", json=body, headers={"Idempotency-Key": "mx-1"})
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    with stack.client("ingester") as c:
        assert c.post("/v1/matrix-runs", json=body).status_code == 403
    run = first.json()
    assert run["records"] == 5 and run["report"] is None
    stack.worker("worker-a.pem")           # no task_always_eager: a real Celery worker
    stack.wait_for(lambda: any(f["has_live_worker"] for f in fingerprints(stack)["items"]),
                   90, "worker A to register")

    def done() -> dict[str, Any] | None:
        with stack.client("auditor") as c:
            got = c.get(f"/v1/matrix-runs/{run['id']}").json()
        return got if got["report"] is not None and got["signed"]["checkpoint"] else None

    got = stack.wait_for(done, 240, "the signed matrix report")
    assert got["state"] == "done" and got["fingerprint_id"] == run["fingerprint_id"]
    rep = got["report"]
    by_cell = {c["cell"]: c for c in rep["cells"]}
    assert list(by_cell) == CELLS
    for name in CELLS[:2]:
        assert by_cell[name]["bitwise"] == 5, by_cell[name]
    assert rep["unverified"] == [] and rep["verification"] == "trust policy"
    assert set(rep["records"]) == {r.request_id for r in recs}
    # the default kernels: its reported divergences are the records it did not reproduce
    default = by_cell["kernels:default+chunk:16"]
    assert sum(default["first_divergence_histogram"].values()) == 5 - default[
        "token_identical"]
    # the console page: the table and the SVG plots
    c = _console(stack, "reviewer")
    try:
        page = c.get(got["links"]["page"])
        assert page.status_code == 200, page.text
        assert page.text.count("<svg") >= 1 and "token-identical share per cell" in page.text
        assert "kernels:default+chunk:16" in page.text
        assert c.get("/console/matrix-runs/0000-abcd").status_code == 404
    finally:
        c.close()
    t0 = time.monotonic()
    with stack.client("reviewer") as c:
        assert c.get(f"/v1/matrix-runs/{run['id']}").status_code == 200
        listed = c.get("/v1/matrix-runs").json()
    assert time.monotonic() - t0 < 10
    assert listed["next_cursor"] is None and [x["id"] for x in listed["items"]] == [run["id"]]
    assert listed["items"][0]["problem"] is None
    assert listed["items"][0]["cells"] == CELLS and listed["items"][0]["parts"] == [
        [run["fingerprint_id"], "done"]]
    with stack.client("ingester") as c:
        assert c.get("/v1/matrix-runs").status_code == 403
    # an insider rewrites who asked for the run: served as its signed request states it, or
    # refused (409 problem+json), and listed as not vouched for
    from tests.replay.test_matrix_checks import _superuser

    with _superuser(stack.db_url) as conn:
        conn.execute("UPDATE replay_jobs SET params = jsonb_set(params, '{requested_by}', "
                     "'\"mallory\"') WHERE id = %s", (run["id"],))
    with stack.client("auditor") as c:
        r = c.get(f"/v1/matrix-runs/{run['id']}")
        listed = c.get("/v1/matrix-runs").json()["items"]
        assert c.get("/v1/matrix-runs?cursor=abc").status_code == 400
    assert [x["id"] for x in listed] == [run["id"]], listed
    assert listed[0]["problem"] and listed[0]["requested_by"] is None, listed
    assert r.status_code == 409, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["code"] == "matrix_request_mismatch", r.json()
    c = _console(stack, "reviewer")
    try:
        listing = c.get("/console/matrix-runs")
        assert listing.status_code == 200 and "not vouched for" in listing.text
        assert "mallory" not in listing.text
    finally:
        c.close()


def test_idempotency_key_and_the_fingerprint_axis_over_two_workers(
        stack: Stack, tiny_engine: Any) -> None:
    """One run per Idempotency-Key even for concurrent first requests (a unique index),
    409 for the key reused with another body; ``"fingerprints": "all"`` fans the same
    records out to one matrix job per live fingerprint (fp32 and bf16 workers, each a real
    Celery process), and the run combines the reports each worker signed."""
    import threading

    import psycopg

    from workers.engine.reference import TINY_DEMO_DIR

    recs = record(tiny_engine, stack.producer, 4, seed=31, prefix="mxfp")
    ingest(stack, [r.envelope for r in recs])
    digest = model_sha256(TINY_DEMO_DIR)
    body = {"model_sha256": digest, "sample": 4, "cells": ["alone", "batch:4"]}
    barrier = threading.Barrier(6)
    answers: list[httpx.Response] = []

    def post() -> None:
        with stack.client("reviewer") as c:
            barrier.wait()
            answers.append(c.post("/v1/matrix-runs", json=body,
                                  headers={"Idempotency-Key": "mx-race"}))

    threads = [threading.Thread(target=post) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status_code for r in answers) == [200] * 5 + [202], \
        [(r.status_code, r.text[:200]) for r in answers]
    assert len({r.json()["id"] for r in answers}) == 1
    with psycopg.connect(stack.db_url.replace("+psycopg", "")) as conn:
        (n,) = conn.execute("SELECT count(*) FROM replay_jobs WHERE kind = 'matrix'"
                            ).fetchone()
    assert n == 1
    with stack.client("reviewer") as c:
        reused = c.post("/v1/matrix-runs", json={**body, "sample": 3},
                        headers={"Idempotency-Key": "mx-race"})
        assert reused.status_code == 409, reused.text
        assert reused.headers["content-type"].startswith("application/problem+json")
        assert reused.json()["code"] == "idempotency_key_reused"
        axis = {**body, "fingerprints": "all"}
        assert c.post("/v1/matrix-runs", json=axis).status_code == 404   # no live worker
        for bad, status in (({**axis, "fingerprints": "some"}, 422),
                            ({**axis, "fingerprint_id": "fp-" + "f" * 16}, 400)):
            r = c.post("/v1/matrix-runs", json=bad)
            assert r.status_code == status, (bad, r.text)
    stack.worker("worker-a.pem")
    stack.worker("worker-b.pem", dtype="bfloat16")

    def live_fingerprints() -> set[str]:
        with stack.client("reviewer") as c:
            return {w["fingerprint_id"] for w in c.get("/v1/workers").json() if w["live"]}

    stack.wait_for(lambda: len(live_fingerprints()) >= 2, 120, "both workers to register")
    with stack.client("reviewer") as c:
        first = c.post("/v1/matrix-runs", json=axis, headers={"Idempotency-Key": "mx-axis"})
    assert first.status_code == 202, first.text
    run = first.json()
    assert len(run["parts"]) == 2 and len({p["fingerprint_id"] for p in run["parts"]}) == 2

    def done() -> dict[str, Any] | None:
        with stack.client("auditor") as c:
            got = c.get(f"/v1/matrix-runs/{run['id']}").json()
        return got if all(p["report"] is not None and p["signed"]["checkpoint"]
                          for p in got["parts"]) else None

    got = stack.wait_for(done, 300, "both fingerprints' signed reports")
    assert got["state"] == "done"
    by_dtype = {p["report"]["runtime"]["dtype"]: p for p in got["parts"]}
    assert set(by_dtype) == {"float32", "bfloat16"}
    fp32, bf16 = by_dtype["float32"], by_dtype["bfloat16"]
    for part in (fp32, bf16):   # the same records on each fingerprint
        assert set(part["report"]["records"]) == {r.request_id for r in recs}
    # each part is signed by the worker that ran it: two workers, two keys
    assert fp32["signed"]["worker_id"] != bf16["signed"]["worker_id"]
    assert fp32["signed"]["signed_by"] != bf16["signed"]["signed_by"]
    rows = {(r["fingerprint_id"], r["cell"]): r for r in got["by_fingerprint"]}
    assert len(rows) == 4
    for cell in ("alone", "batch:4"):
        assert rows[(fp32["fingerprint_id"], cell)]["bitwise"] == 4      # recorded on fp32
        assert rows[(bf16["fingerprint_id"], cell)]["bitwise"] == 0      # bf16 numerics
        assert rows[(bf16["fingerprint_id"], cell)]["max_abs_logprob_diff"] > 0
    c = _console(stack, "reviewer")
    try:
        listing = c.get("/console/matrix-runs")
        assert listing.status_code == 200, listing.text
        assert 'href="/console/matrix-runs"' in listing.text          # the nav link
        assert f'href="/console/matrix-runs/{run["id"]}"' in listing.text
        page = c.get(f"/console/matrix-runs/{run['id']}")
        assert page.status_code == 200 and "Across fingerprints" in page.text
        assert fp32["fingerprint_id"] in page.text and bf16["fingerprint_id"] in page.text
        assert "bfloat16" in page.text
    finally:
        c.close()
    # the beat's gate for the new bf16 fingerprint is a matrix run on that worker, and the
    # gate is decided by the report it signed (the beat's and the worker's own logins)
    with stack.client("admin") as admin:
        [claimed] = admin.get("/v1/reverification-runs", params={"kind": "gate"}
                              ).json()["items"]

        def gate_done() -> dict[str, Any] | None:
            got = admin.get(f"/v1/reverification-runs/{claimed['id']}").json()
            return got if got["complete"] else None

        decided = stack.wait_for(gate_done, 240, "the gate's runs")["gate"]
    assert decided["new_fingerprint"] == bf16["fingerprint_id"]
    assert decided["decided_by"] == "signed matrix report", decided
    assert isinstance(decided["passed"], bool) and decided["reason"]
    with stack.client("auditor") as c:
        gate_run = c.get(f"/v1/matrix-runs/{decided['matrix_run']}").json()
    assert gate_run["gate_run_id"] == claimed["id"] and gate_run["report"]["tolerance"]
    assert gate_run["signed"]["worker_id"] == bf16["signed"]["worker_id"]
