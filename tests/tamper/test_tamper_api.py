"""The API serves what the signed bytes say, not what the columns say.

On a copy of the tamper suite's log, the insider flips a verdict's outcome, a dispute's
resolution and state, a dispute event's body and an envelope's index columns (plain
``UPDATE`` as superuser). A real ``ledger serve`` must serve the signed values and flag
every column that disagrees in ``integrity``; on the untouched rows ``integrity.ok``.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers import run_server
from tests.tamper.conftest import ORIGIN, Built, superuser
from tests.tamper.test_tamper import ENVELOPE


def test_served_values_come_from_signed_bytes(built: Built, copy_url: str,
                                              tmp_path: Path) -> None:
    upheld = built.disputes["upheld"]["id"]
    verdict = built.verdicts["upheld"]
    resolved = built.event("upheld", "resolved")
    superuser(copy_url,
              ("UPDATE verdicts SET outcome = 'reproduced', tier = 'bitwise', "
               "details = details || '{\"outcome\": \"reproduced\"}'::jsonb "
               "WHERE log_index = %s", (verdict["idx"],)),
              ("UPDATE disputes SET resolution = 'rejected', resolution_note = 'fine', "
               "resolved_by = 'mallory (admin)' WHERE id = %s", (upheld,)),
              ("UPDATE dispute_events SET body = jsonb_set(body, '{resolution}', "
               "'\"rejected\"'), actor = 'mallory (admin)' WHERE log_index = %s", (resolved,)),
              ("UPDATE envelopes SET model_name = 'other-model', prompt_tokens = 1 "
               "WHERE request_id = %s", (ENVELOPE,)))
    with run_server(copy_url, extra_env={"LEDGER_LOG_NAME": ORIGIN}, log_dir=tmp_path) as srv:
        srv.keys = built.api_keys
        with srv.client("reviewer") as c:
            v = c.get(f"/v1/verdicts/{verdict['verdict_id']}").json()
            d = c.get(f"/v1/disputes/{upheld}").json()
            listed = c.get("/v1/disputes", params={"state": "resolved"}).json()["items"]
            clean = c.get(f"/v1/disputes/{built.disputes['rejected']['id']}").json()
        with srv.client("auditor") as c:
            e = c.get(f"/v1/envelopes/{ENVELOPE}").json()
            clean_e = c.get("/v1/envelopes/tamper-7-6").json()

    assert (v["outcome"], v["details"]["outcome"]) == ("diverged", "diverged")
    assert v["tier"] != "bitwise" and v["details"]["first_divergence"]["index"] == 2
    assert not v["integrity"]["ok"]
    assert {m["field"] for m in v["integrity"]["mismatches"]} == {"outcome", "tier", "details"}

    assert (d["state"], d["resolution"]) == ("resolved", "upheld")
    assert d["resolved_by"] == "carol (reviewer)"
    assert d["resolution_note"] == "the record diverges at token 2"
    assert {m["field"] for m in d["integrity"]["mismatches"]} == {
        "resolution", "resolution_note", "resolved_by"}
    assert d["verdict"]["outcome"] == "diverged" and not d["verdict"]["integrity"]["ok"]
    event = next(ev for ev in d["events"] if ev["kind"] == "resolved")
    assert event["body"]["resolution"] == "upheld" and event["actor"] == "carol (reviewer)"
    assert {m["field"] for m in event["integrity"]["mismatches"]} == {"body", "actor"}
    assert next(x for x in listed if x["id"] == upheld)["resolution"] == "upheld"

    assert clean["integrity"]["ok"] and clean["resolution"] == "rejected"
    assert all(ev["integrity"]["ok"] for ev in clean["events"])
    assert clean["verdict"]["integrity"]["ok"]

    assert not e["integrity"]["ok"]
    assert {m["field"] for m in e["integrity"]["mismatches"]} == {"model_name",
                                                                  "prompt_tokens"}
    assert e["dsse"]["payload"]  # the stored bytes are still served verbatim
    assert clean_e["integrity"] == {"source": "signed", "ok": True, "mismatches": []}
