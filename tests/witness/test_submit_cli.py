"""`ledger witness submit --once`: the log's side of the protocol outside the API (for
deployments that integrate with `ledger integrate`), against a real witness process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
from sqlalchemy import Engine

from ledger.core.keys import generate_private_key, public_raw
from ledger.core.note import format_verifier_key
from ledger.db.session import session_scope
from ledger.log.integrator import integrate_all
from ledger.log.signer import LogSigner
from ledger.services import ingest
from ledger.settings import Settings
from tests.conftest import provision
from tests.helpers import REPO, signed, statement
from tests.witness import spec_cosig
from tests.witness.helpers import make_witness_key, run_witness

ORIGIN = "ledger.test/submit-cli"


def _submit(db_url: str, witnesses: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ledger.cli.main", "witness", "submit",
                           "--once"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LEDGER_DATABASE_URL": db_url,
                               "LEDGER_WITNESSES": witnesses, "LEDGER_LOG_NAME": ORIGIN})


def test_submit_once_stores_a_verified_cosignature(db_url: str, engine: Engine,
                                                   tmp_path: Path) -> None:
    _, producer = provision(db_url)
    signer = LogSigner(ORIGIN, generate_private_key())
    with session_scope(engine) as s:
        res = ingest.ingest(s, [signed(statement(), producer) for _ in range(5)],
                            Settings(database_url=db_url))
        assert all(r.status == 201 for r in res)
    assert integrate_all(engine, signer)[-1].tree_size == 5
    key_file, vkey = make_witness_key(tmp_path, "witness.test/cli")
    with run_witness(tmp_path, key_file, vkey,
                     [format_verifier_key(ORIGIN, public_raw(signer.key))]) as w:
        proc = _submit(db_url, f"{w.base_url} {vkey}")
        assert proc.returncode == 0, proc.stderr
        assert "witness.test/cli: ok at 5" in proc.stdout
        again = _submit(db_url, f"{w.base_url} {vkey}")
        assert "witness.test/cli: current at 5" in again.stdout
    with psycopg.connect(db_url.replace("postgresql+psycopg", "postgresql")) as conn:
        line, note = conn.execute(
            "SELECT c.signature, k.note FROM checkpoint_cosignatures c JOIN checkpoints k "
            "USING (tree_size) WHERE c.witness_name = 'witness.test/cli'").fetchone()
    assert spec_cosig.verify(bytes(note) + line.encode() + b"\n", w.name, w.public_key) > 0
    # the witness is gone now and there is a newer checkpoint: the round fails, says why,
    # and the status row keeps the error
    with session_scope(engine) as s:
        ingest.ingest(s, [signed(statement(), producer)], Settings(database_url=db_url))
    assert integrate_all(engine, signer)[-1].tree_size == 6
    down = _submit(db_url, f"{w.base_url} {vkey}")
    assert down.returncode == 1, down.stderr
    assert "witness.test/cli: error at 6 - ConnectError" in down.stdout, down.stdout
    with psycopg.connect(db_url.replace("postgresql+psycopg", "postgresql")) as conn:
        last_size, last_error = conn.execute(
            "SELECT last_size, last_error FROM witness_status").fetchone()
    assert last_size == 5 and "ConnectError" in last_error
