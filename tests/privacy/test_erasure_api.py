"""The erasure API over real HTTP (`ledger serve` with a KEK and the service key):
POST /v1/data-subjects/{id}/erasure is admin-only, 201 then 200, 404 for an unknown
subject, 422 for a bad body; GET of an erased envelope is 410 with its tombstone."""

from __future__ import annotations

import httpx

from ledger.core.keys import private_pem
from tests.helpers import TEST_PEPPER, run_server, signed, statement
from tests.privacy.conftest import ORIGIN, SUBJECTS, Log


def test_erasure_over_http(log: Log, tmp_path) -> None:  # type: ignore[no-untyped-def]
    keys = log.api_keys
    service_pem = tmp_path / "service.pem"
    service_pem.write_bytes(private_pem(log.service.key))
    env = {"LEDGER_KEK_FILE": str(log.kek_file), "LEDGER_SERVICE_KEY_FILE": str(service_pem),
           "LEDGER_INTEGRATE_IN_API": "false", "LEDGER_INSECURE_DEV": "true",
           "LEDGER_LOG_NAME": ORIGIN,
           "LEDGER_API_KEY_PEPPER": TEST_PEPPER}
    with run_server(log.db_url, extra_env=env, log_dir=tmp_path) as server:
        def client(role: str) -> httpx.Client:
            return httpx.Client(base_url=server.base_url, timeout=30,
                                headers={"Authorization": f"Bearer {keys[role]}"})

        subject = SUBJECTS[1]
        url = f"/v1/data-subjects/{subject}/erasure"
        body = {"reason": "the subject asked", "legal_basis": "GDPR Art. 17(1)(a)"}
        with client("reviewer") as c:
            assert c.post(url, json=body).status_code == 403
        with client("admin") as c:
            bad = c.post(url, json={"reason": "x"})
            assert bad.status_code == 422 and bad.headers["content-type"].startswith(
                "application/problem+json")
            assert c.post("/v1/data-subjects/nobody/erasure", json=body).status_code == 404
            first = c.post(url, json=body)
            assert first.status_code == 201, first.text
            assert first.json()["records_erased"] == 2
            again = c.post(url, json=body)
            assert again.status_code == 200
            assert again.json()["erasure_id"] == first.json()["erasure_id"]
            policy = {"name": "perf-90d", "erase_after_days": 90, "channel": "performance"}
            assert c.post("/v1/retention-policies", json=policy).status_code == 201
            assert c.post("/v1/retention-policies", json=policy).status_code == 409
            assert [p["name"] for p in c.get("/v1/retention-policies").json()] == ["perf-90d"]
            assert c.post("/v1/retention-policies", json={**policy, "name": "x",
                                                          "erase_after_days": 0}
                          ).status_code == 422
        # new envelopes of an erased subject get a new data key and are readable
        st = statement(data_subject=subject)
        with client("ingester") as c:
            assert c.post("/v1/envelopes", json=signed(st, log.producer)).status_code == 201
        with client("reviewer") as c:
            rid, idx, _, _ = log.records[subject][0]
            gone = c.get(f"/v1/envelopes/{rid}")
            assert gone.status_code == 410, gone.text
            problem = gone.json()
            assert problem["code"] == "erased"
            assert problem["tombstone"]["log_index"] == idx
            assert problem["tombstone"]["erasure"]["erasure_id"] == first.json()["erasure_id"]
            fresh = c.get(f"/v1/envelopes/{st['predicate']['request_id']}")
            assert fresh.status_code == 200, fresh.text
            kept_rid = log.records[SUBJECTS[0]][0][0]
            kept = c.get(f"/v1/envelopes/{kept_rid}")
            assert kept.status_code == 200
            assert kept.json()["dsse"]["payload"] == log.records[SUBJECTS[0]][0][2]["payload"]
