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
    assert time.monotonic() - t0 < 10
