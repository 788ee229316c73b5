"""``GET /v1/log/checkpoint``, ``/v1/log/proof`` and ``/v1/log/consistency`` with a plain
query string are answered by ``LogReadFastPath`` (past FastAPI's routing); anything else
by the FastAPI routes. Every kind of request goes through both (the fast path switched
off for the second) and must get the same status, headers and body bytes, on the real
log of ``tests/tamper/test_tile_nodes.py`` (600 signed envelopes, a checkpoint every 150
entries), through good answers, bad parameters, every role, missing, bad and revoked
keys, sizes with no checkpoint, entries not yet integrated, edited tiles, a forged note
and a log with no checkpoint at all."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from ledger.api.app import create_app
from ledger.api.routes.log import LogReadFastPath
from ledger.core.keys import private_pem
from ledger.db.session import make_engine
from ledger.log.store import SUBTREES
from ledger.settings import Settings
from tests.helpers import TEST_PEPPER, record_passed_on
from tests.tamper.test_tile_nodes import (  # noqa: F401 - fixture
    ORIGIN,
    Log,
    flip_node,
    forge_latest_note,
    log,
    superuser,
)


@dataclass
class Paths:
    client: TestClient
    node: LogReadFastPath
    keys: dict[str, str]
    passed_on: list[str] = field(default_factory=list)

    def both(self, target: str, role: str | None = "reviewer",
             headers: dict[str, str] | None = None) -> tuple[int, bool]:
        """``target`` through the fast path and through the route: the same bytes; the
        status, and whether the fast path answered it."""
        sent = dict(headers or {})
        if role is not None:
            sent["Authorization"] = f"Bearer {self.keys[role]}"
        self.passed_on.clear()
        fast = self.client.get(target, headers=sent)
        answered = not self.passed_on
        reads, self.node.reads = self.node.reads, {}
        try:
            routed = self.client.get(target, headers=sent)
        finally:
            self.node.reads = reads
        assert self.passed_on, target  # the second went to FastAPI
        assert (fast.status_code, fast.headers.raw, fast.content) == \
            (routed.status_code, routed.headers.raw, routed.content), target
        return fast.status_code, answered

    def code(self, target: str, role: str | None = "reviewer") -> str | None:
        r = self.client.get(target, headers={"Authorization": f"Bearer {self.keys[role]}"}
                            if role else {})
        return r.json().get("code") if r.status_code >= 400 else None


@pytest.fixture
def paths(log: Log, tmp_path: Path) -> Iterator[Paths]:  # noqa: F811 - the fixture
    key_file = tmp_path / "log.pem"  # the API holds the log key: notes are checked
    key_file.write_bytes(private_pem(log.signer.key))
    settings = Settings(database_url=log.url, api_key_pepper=TEST_PEPPER, metrics_port=0,
                        log_name=ORIGIN, log_key_file=key_file, integrate_in_api=False)
    engine = make_engine(settings, pool_size=2)
    app = create_app(settings, engine)
    try:
        with TestClient(app) as client:
            passed_on: list[str] = []
            node = record_passed_on(app, LogReadFastPath,
                                    lambda scope: passed_on.append(scope["path"]))
            yield Paths(client, node, log.keys, passed_on)
    finally:
        engine.dispose()


def _sizes(of: Log) -> list[int]:
    with psycopg.connect(of.pg) as conn:
        return [r[0] for r in conn.execute(
            "SELECT tree_size FROM checkpoints ORDER BY tree_size").fetchall()]


def _served(route: str, status: str) -> float:
    return REGISTRY.get_sample_value("ledger_http_request_duration_seconds_count",
                                     {"method": "GET", "route": route, "status": status}) or 0


def test_every_kind_of_read_gets_the_same_bytes_either_way(paths: Paths, log: Log) -> None:  # noqa: F811
    size, sizes = log.size, _sizes(log)
    old = sizes[0]
    assert old < size and size == sizes[-1]
    big = 2**62
    # (target, role, expected status, answered by the fast path)
    cases: list[tuple[str, str | None, int, bool]] = [
        ("/v1/log/checkpoint", None, 200, True),
        ("/v1/log/checkpoint", "ingester", 200, True),  # public: a key changes nothing
        ("/v1/log/checkpoint?x=1", None, 400, False),
        ("/v1/log/checkpoint?", None, 200, True),
        ("/v1/log/proof?index=0", "reviewer", 200, True),
        ("/v1/log/proof?index=300", "auditor", 200, True),
        (f"/v1/log/proof?index={size - 1}", "admin", 200, True),
        (f"/v1/log/proof?index=5&tree_size={old}", "reviewer", 200, True),
        (f"/v1/log/proof?tree_size={old}&index={old - 1}", "reviewer", 200, True),
        (f"/v1/log/proof?index={old}&tree_size={old}", "reviewer", 404, True),
        ("/v1/log/proof?index=5&tree_size=7", "reviewer", 404, True),
        (f"/v1/log/proof?index={size}", "reviewer", 404, True),
        (f"/v1/log/proof?index={big}", "reviewer", 404, True),
        (f"/v1/log/proof?index={big + 1}", "reviewer", 422, False),
        ("/v1/log/proof?index=5&tree_size=0", "reviewer", 422, False),
        ("/v1/log/proof?index=-1", "reviewer", 422, False),
        ("/v1/log/proof?index=abc", "reviewer", 422, False),
        ("/v1/log/proof?index=", "reviewer", 422, False),
        ("/v1/log/proof", "reviewer", 422, False),
        ("/v1/log/proof?tree_size=5", "reviewer", 422, False),
        ("/v1/log/proof?index=05", "reviewer", 200, False),
        ("/v1/log/proof?index=%35", "reviewer", 200, False),
        ("/v1/log/proof?index=1&index=2", "reviewer", 200, False),
        ("/v1/log/proof?index=5&", "reviewer", 200, False),
        ("/v1/log/proof?index=5&foo=1", "reviewer", 400, False),
        ("/v1/log/proof?index=5", "ingester", 403, True),
        ("/v1/log/proof?index=5", "worker", 403, True),
        ("/v1/log/proof?index=5", None, 401, True),
        ("/v1/log/proof?index=-1", None, 401, False),  # the key is checked first
        ("/v1/log/proof?index=5&foo=1", None, 400, False),  # the closed query before it
        ("/v1/log/consistency?from=0", None, 200, True),
        ("/v1/log/consistency?from=300", None, 200, True),
        (f"/v1/log/consistency?from={size}", None, 200, True),
        (f"/v1/log/consistency?from={old}", "reviewer", 200, True),
        (f"/v1/log/consistency?from={old}&to={sizes[1]}", None, 200, True),
        (f"/v1/log/consistency?to={sizes[1]}&from=7", None, 200, True),
        ("/v1/log/consistency?from=7&to=8", None, 404, True),
        (f"/v1/log/consistency?from={size + 1}", None, 422, True),
        (f"/v1/log/consistency?from={sizes[1]}&to={old}", None, 422, True),
        ("/v1/log/consistency?from=-1", None, 422, False),
        ("/v1/log/consistency", None, 422, False),
        (f"/v1/log/consistency?from=1&to={big + 1}", None, 422, False),
        ("/v1/log/consistency?from=1&foo=2", None, 400, False),
    ]
    for target, role, status, fast in cases:
        assert paths.both(target, role) == (status, fast), target
    for route, query in (("/v1/log/checkpoint", ""), ("/v1/log/proof", "?index=3"),
                         ("/v1/log/consistency", "?from=3")):
        before = _served(route, "200")  # the latency metric labels a fast answer by route
        paths.passed_on.clear()
        assert paths.client.get(route + query, headers={
            "Authorization": f"Bearer {paths.keys['reviewer']}"}).status_code == 200
        assert not paths.passed_on and _served(route, "200") == before + 1, route
    for headers in ({"Authorization": "Basic eDp5"}, {"Authorization": "Bearer lk_nope"},
                    {"Authorization": "Bearer not-a-key"}, {"Authorization": "Bearer"}):
        assert paths.both("/v1/log/proof?index=5", None, headers) == (401, True), headers
        assert paths.both("/v1/log/consistency?from=5", None, headers) == (200, True)
    assert paths.code(f"/v1/log/proof?index={size}") == "not_yet_integrated"
    assert paths.code("/v1/log/proof?index=5&tree_size=7") == "no_such_checkpoint"

    superuser(log, "UPDATE api_keys SET revoked_at = now() WHERE name = 'test-admin'")
    assert paths.both("/v1/log/proof?index=5", "admin") == (401, True)
    assert paths.code("/v1/log/proof?index=5", "admin") == "revoked_api_key"


def test_refusals_get_the_same_bytes_either_way(paths: Paths, log: Log) -> None:  # noqa: F811
    """An edited stored hash, a forged note, and a log without a checkpoint."""
    assert paths.both("/v1/log/proof?index=300") == (200, True)
    flip_node(log, 0, 0)  # the hash of leaves 0 and 1: in the proofs of 2 and 3
    SUBTREES.forget_all()  # as a process that had not read tile 0 yet
    assert paths.both("/v1/log/proof?index=2") == (500, True)
    assert paths.code("/v1/log/proof?index=2") == "log_integrity"
    assert paths.both("/v1/log/proof?index=300") == (200, True)

    forge_latest_note(log)  # the columns agree with its text; the signature is not the log's
    for target in ("/v1/log/checkpoint", "/v1/log/proof?index=300",
                   "/v1/log/consistency?from=300"):
        assert paths.both(target) == (500, True), target
        assert paths.code(target) == "log_integrity", target

    superuser(log, "DELETE FROM checkpoints")
    for target in ("/v1/log/checkpoint", "/v1/log/proof?index=3",
                   "/v1/log/consistency?from=3"):
        assert paths.both(target) == (404, True), target
        assert paths.code(target) == "not_yet_integrated", target


def test_the_checkpoint_served_is_its_signed_text(paths: Paths, log: Log) -> None:  # noqa: F811
    """Size and root come from the note the log signed, not from the columns next to
    it: a root column edited to match nothing is a refusal, not a served root."""
    body = paths.client.get("/v1/log/checkpoint").json()
    assert body["tree_size"] == log.size and body["origin"] == ORIGIN
    superuser(log, "UPDATE checkpoints SET root_hash = sha256('x'::bytea) "
              "WHERE tree_size = %s", (log.size,))
    assert paths.both("/v1/log/checkpoint") == (500, True)
    assert paths.code("/v1/log/checkpoint") == "log_integrity"
