"""The SDK and proxy name the data subject (issue 18): from the ``X-Ledger-Data-Subject``
request header (never forwarded upstream) or a recorder callback; the envelope the ledger
stores carries it as ``predicate.data_subject``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from ledger.capture import Recorder
from ledger.capture.transport import DATA_SUBJECT_HEADER, _Capture
from tests.capture.conftest import wait_for_envelope
from tests.capture.test_spool import CONFIG, captured
from tests.helpers import ApiServer


def test_header_is_recorded_and_not_forwarded(api: ApiServer, tmp_path: Path) -> None:
    rec = Recorder(CONFIG, api.producer, spool_dir=tmp_path / "spool",  # type: ignore[attr-defined]
                   ledger_url=api.base_url, api_key=api.keys["ingester"], ship=False)
    try:
        body = json.dumps({"model": "tiny-demo", "prompt": [1, 2, 3], "max_tokens": 4,
                           "temperature": 0}).encode()
        request = httpx.Request("POST", "http://upstream/v1/completions", content=body,
                                headers={"content-type": "application/json",
                                         "X-Ledger-Data-Subject": "subj-h1"})
        planned = _Capture(rec, None, strict=True).plan(request, body)
        assert planned is not None
        forwarded, plan = planned
        assert plan.data_subject == "subj-h1"
        assert DATA_SUBJECT_HEADER not in forwarded.headers
    finally:
        rec.close()


def test_header_and_callback_reach_the_ledger(api: ApiServer, tmp_path: Path) -> None:
    rid = f"subject-{time.time_ns()}"
    with Recorder(CONFIG, api.producer, spool_dir=tmp_path / "spool",  # type: ignore[attr-defined]
                  ledger_url=api.base_url, api_key=api.keys["ingester"], min_backoff=0.05,
                  data_subject=lambda c: f"cb-{c.request_id[-4:]}") as rec:
        from_header = captured(rid + "-h")
        from_header.data_subject = "subj-header"
        rec.record(from_header)
        rec.record(captured(rid + "-c"))
        assert rec.wait_delivered(20)
    assert wait_for_envelope(api, rid + "-h")["predicate"]["data_subject"] == "subj-header"
    assert wait_for_envelope(api, rid + "-c")["predicate"]["data_subject"] == \
        f"cb-{(rid + '-c')[-4:]}"
