"""A small log with envelopes of three data subjects, encrypted at rest (issue 18)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Engine

from ledger.core.keys import generate_private_key
from ledger.core.sealing import LocalKek
from ledger.db.session import make_engine, session_scope
from ledger.log.integrator import integrate_all
from ledger.log.signer import LogSigner
from ledger.replay.records import Signer
from ledger.services import ingest
from ledger.settings import Settings
from tests.conftest import provision
from tests.helpers import signed, statement

ORIGIN = "ledger.test/privacy"
SUBJECTS = ("subj-alice", "subj-bob", "subj-carol")


def distinctive_prompt(subject_no: int, record_no: int) -> list[int]:
    """Token IDs no other record holds (what the pg_dump grep looks for)."""
    return [9_000_000 + subject_no * 100_000 + record_no * 1_000 + i * 7 for i in range(12)]


@dataclass
class Log:
    db_url: str
    engine: Engine
    kek: LocalKek
    kek_file: Path
    settings: Settings
    producer: Ed25519PrivateKey
    service: Signer
    log_signer: LogSigner
    api_keys: dict[str, str]  # role -> API key
    #: subject -> [(request_id, log index, signed envelope JSON, prompt)]
    records: dict[str, list[tuple[str, int, dict[str, Any], list[int]]]] = \
        field(default_factory=dict)

    def ingest(self, envs: list[dict[str, Any]], *, encrypted: bool = True) -> list[int]:
        settings = self.settings if encrypted else Settings(database_url=self.db_url)
        with session_scope(self.engine) as s:
            res = ingest.ingest(s, envs, settings)
        assert all(r.status == 201 for r in res), [r.error for r in res]
        return [r.log_index for r in res if r.log_index is not None]

    def integrate(self) -> None:
        integrate_all(self.engine, self.log_signer)


@pytest.fixture
def log(db_url: str, tmp_path: Path) -> Iterator[Log]:
    kek_file = tmp_path / "kek"
    kek_file.write_bytes(os.urandom(32).hex().encode() + b"\n")
    service = Signer(generate_private_key(), "ledger", "ledger-service")
    api_keys, producer = provision(db_url, signer=service)
    engine = make_engine(url=db_url, pool_size=4)
    log_signer = LogSigner(ORIGIN, generate_private_key())
    with session_scope(engine) as s:
        service.ensure_registered(s)
        log_signer.ensure_registered(s, service)
    settings = Settings(database_url=db_url, kek_file=kek_file, log_name=ORIGIN)
    out = Log(db_url, engine, LocalKek.from_file_bytes(kek_file.read_bytes()), kek_file,
              settings, producer, service, log_signer, api_keys)
    for n, subject in enumerate(SUBJECTS):
        envs, prompts = [], []
        for r in range(2):
            prompt = distinctive_prompt(n, r)
            st = statement(prompt_token_ids=prompt, data_subject=subject)
            envs.append(signed(st, producer))
            prompts.append(prompt)
        idx = out.ingest(envs)
        out.records[subject] = [(_rid(e), i, e, p)
                                for e, i, p in zip(envs, idx, prompts, strict=True)]
    out.integrate()
    yield out
    engine.dispose()


def _rid(env: dict[str, Any]) -> str:
    import base64
    import json

    return str(json.loads(base64.b64decode(env["payload"]))["predicate"]["request_id"])
