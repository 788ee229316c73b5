"""The tamper suite's log: every leaf kind, built once the way the ledger builds it, then
copied (``CREATE DATABASE ... TEMPLATE``) for each case so every case starts clean.

The log holds envelopes recorded by the reference engine on tiny-demo, three disputes
(one resolved ``rejected`` after a bitwise reproduction, one resolved ``upheld`` after a
divergence, one left at its verdict with a comment), a re-verification job with no
dispute (one reproduced, one diverged verdict), and a tail of envelopes after them. It is
integrated one entry at a time, so there is a checkpoint at every size, each copied to a
sink directory outside the database.

At the end of the session the table of cases x detecting mode is printed (terminal
summary, whatever ``-s`` says) and written to ``<pytest tmp dir>/tamper-table.txt``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select

from ledger.core.cosignature import parse_cosignature_line, sign_cosignature, split_note
from ledger.core.keys import generate_private_key, private_pem, public_raw
from ledger.core.trust import TrustPolicy, WitnessKey, format_trust_policy, parse_trust_policy
from ledger.db.models import AdminEvent, Dispute, DisputeEvent, Envelope, Verdict
from ledger.db.session import make_engine, session_scope
from ledger.log.integrator import integrate_all
from ledger.log.signer import LogSigner
from ledger.log.sink import DirectorySink
from ledger.replay import disputes as dispute_service
from ledger.replay import jobs as job_service
from ledger.replay.records import Signer
from ledger.services import ingest
from ledger.settings import Settings
from tests.conftest import _admin, _drop, _sa_url, provision

ORIGIN = "ledger.test/tamper"
MODES = ("plain", "signatures", "trust", "against", "witness")
WITNESS = "witness.tamper.test"
RESULTS: list[dict[str, Any]] = []
TABLE_FILE: list[Path] = []


@dataclass
class Built:
    """The clean log (a template database) and everything an auditor holds outside it."""

    template: str
    tmp: Path
    sink: Path
    producer: Ed25519PrivateKey
    log_signer: LogSigner
    service: Signer
    worker: Signer
    trust: TrustPolicy
    trust_file: Path
    entries: list[tuple[int, str, str]]  # (idx, kind, ref)
    env_index: dict[str, int]  # request_id -> log index
    verdicts: dict[str, dict[str, Any]]  # name -> {"idx", "verdict_id", "outcome"}
    disputes: dict[str, dict[str, Any]]  # name -> {"id", "events": [(idx, kind)]}
    tail: list[int] = field(default_factory=list)  # indices of the envelopes at the end
    api_keys: dict[str, str] = field(default_factory=dict)  # role -> API key
    #: registration leaves (admin_events) by the purpose of the key they register
    admin: dict[str, int] = field(default_factory=dict)
    #: (witness, size, root) the witness last cosigned (`ledger audit --witness URL`)
    witness_view: tuple[str, int, bytes] = ("", 0, b"")

    def saved(self) -> list[tuple[str, bytes]]:
        return [(str(p), p.read_bytes()) for p in sorted(self.sink.glob("checkpoint.*"))]

    def event(self, dispute: str, kind: str) -> int:
        return next(i for i, k in self.disputes[dispute]["events"] if k == kind)


def pg(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def _open(s: Any, request_id: str, service: Signer, settings: Settings) -> tuple[str, str]:
    d, created = dispute_service.open_dispute(
        s, request_id=request_id, reason="the customer says the answer changed",
        priority="normal", actor="alice (reviewer)", signer=service)
    assert created
    job = job_service.create_job(s, fingerprint_id=d.fingerprint_id, kind="dispute",
                                 items=[(d.envelope_index, d.request_id, d.id)],
                                 settings=settings)
    d.job_id = job.id
    dispute_service.emit(s, d, job.state, "ledger", service, {"job_id": str(job.id)},
                         state=job.state, state_reason=job.state_reason)
    return str(d.id), str(job.id)


def build(db_url: str, tiny_engine: Any, tmp: Path) -> dict[str, Any]:
    from tests.replay.conftest import record, tamper
    from workers.replay import ReplayWorker

    settings = Settings(database_url=db_url, log_name=ORIGIN, worker_dead_after_s=300)
    db = make_engine(settings, pool_size=2)
    log_signer = LogSigner(ORIGIN, generate_private_key())
    service = Signer(generate_private_key(), "ledger", "ledger-service")
    worker_signer = Signer(generate_private_key(), "worker", "tamper-worker")
    sink = DirectorySink(tmp / "sink")
    # every key and API key registered as production does: each a registry leaf signed by
    # the service key (the service key's own registration signed by itself)
    with session_scope(db) as s:
        service.ensure_registered(s)
        log_signer.ensure_registered(s, service)
        worker_signer.ensure_registered(s, service)
    api_keys, producer = provision(db_url, signer=service)
    trust = parse_trust_policy(format_trust_policy(ORIGIN, [log_signer.public_key],
                                                   [public_raw(service.key)]))
    recs = record(tiny_engine, producer, 8, seed=7, prefix="tamper", max_tokens=8)
    forged = [tamper(recs[2], producer, k=2, new_request_id="forged-2"),
              tamper(recs[5], producer, k=1, new_request_id="forged-5")]
    with session_scope(db) as s:
        res = ingest.ingest(s, [r.envelope for r in recs + forged], settings)
    assert all(r.status == 201 for r in res), [r.error for r in res if r.error]
    integrate_all(db, log_signer, max_entries=1, sink=sink)

    worker = ReplayWorker(settings, db, models=["tiny-demo"], signer=worker_signer,
                          trust=trust)
    worker.register()
    ids: dict[str, str] = {}
    for name, rid in (("rejected", recs[0].request_id), ("upheld", "forged-2"),
                      ("open", recs[1].request_id)):
        with session_scope(db) as s:
            ids[name], job_id = _open(s, rid, service, settings)
        assert worker.run_job(job_id) == "done"
    with session_scope(db) as s:
        dispute_service.comment(s, ids["open"], text="looking at it", actor="bob (reviewer)",
                                signer=service)
        dispute_service.resolve(s, ids["rejected"], resolution="rejected",
                                note="reproduced bit for bit", actor="carol (reviewer)",
                                signer=service)
        dispute_service.resolve(s, ids["upheld"], resolution="upheld",
                                note="the record diverges at token 2", actor="carol (reviewer)",
                                signer=service)
        envs = {e.request_id: e for e in s.scalars(select(Envelope))}
        fp = envs["forged-5"].fingerprint_id
        job = job_service.create_job(
            s, fingerprint_id=fp, kind="reverification",
            items=[(envs[r].log_index, r, None) for r in (recs[3].request_id, "forged-5")],
            settings=settings)
        reverify = str(job.id)
    assert worker.run_job(reverify) == "done"
    tail = record(tiny_engine, producer, 4, seed=8, prefix="tail", max_tokens=4)
    with session_scope(db) as s:
        res = ingest.ingest(s, [r.envelope for r in tail], settings)
    assert all(r.status == 201 for r in res)
    integrate_all(db, log_signer, max_entries=1, sink=sink)

    # A witness cosigned every checkpoint as it was published (what the integrator's
    # submitter stores after `ledger witness serve` answers); it remembers the newest.
    witness_key = generate_private_key()
    with session_scope(db) as s:
        conn = s.connection().connection.driver_connection
        rows = conn.execute("SELECT tree_size, root_hash, note FROM checkpoints "
                            "ORDER BY tree_size").fetchall()
        for size, _, note in rows:
            line = sign_cosignature(split_note(bytes(note))[0], WITNESS, witness_key,
                                    1_700_000_000 + size)
            c = parse_cosignature_line(line)
            conn.execute("INSERT INTO checkpoint_cosignatures (tree_size, witness_name, key_id, "
                         "timestamp, signature) VALUES (%s, %s, %s, %s, %s)",
                         (size, WITNESS, c.key_id, c.timestamp, line))
    witness_view = (WITNESS, rows[-1][0], bytes(rows[-1][1]))

    layout: dict[str, Any] = {"verdicts": {}, "disputes": {}}
    with session_scope(db) as s:
        conn = s.connection().connection.driver_connection
        layout["entries"] = [tuple(r) for r in conn.execute(
            "SELECT idx, kind, ref FROM log_entries ORDER BY idx").fetchall()]
        layout["env_index"] = {e.request_id: e.log_index for e in s.scalars(select(Envelope))}
        layout["admin"] = {a.body["key"]["purpose"]: a.log_index
                           for a in s.scalars(select(AdminEvent))
                           if a.kind == "signing_key.registered"}
        for name, did in ids.items():
            d = s.get(Dispute, uuid.UUID(did))
            assert d is not None and d.verdict_id
            v = s.scalar(select(Verdict).where(Verdict.verdict_id == d.verdict_id))
            assert v is not None
            layout["verdicts"][name] = {"idx": v.log_index, "verdict_id": v.verdict_id,
                                        "outcome": v.outcome}
            events = s.scalars(select(DisputeEvent).where(DisputeEvent.dispute_id == d.id)
                               .order_by(DisputeEvent.seq)).all()
            layout["disputes"][name] = {"id": did, "state": d.state,
                                        "events": [(e.log_index, e.kind) for e in events]}
        for v in s.scalars(select(Verdict).where(Verdict.job_id == uuid.UUID(reverify))):
            layout["verdicts"][f"reverify-{v.outcome}"] = {
                "idx": v.log_index, "verdict_id": v.verdict_id, "outcome": v.outcome}
    assert layout["verdicts"]["upheld"]["outcome"] == "diverged"
    assert layout["verdicts"]["rejected"]["outcome"] == "reproduced"
    assert {"reverify-diverged", "reverify-reproduced"} <= set(layout["verdicts"])
    assert layout["disputes"]["upheld"]["state"] == "resolved"
    layout["tail"] = [layout["env_index"][r.request_id] for r in tail]
    db.dispose()
    return {"api_keys": api_keys, "producer": producer, "log_signer": log_signer,
            "witness_view": witness_view,
            "witness": WitnessKey.from_public_key(WITNESS, public_raw(witness_key)),
            "service": service, "worker": worker_signer, "sink": sink.dir, **layout}


@pytest.fixture(scope="session")
def built(template_db: str, tiny_engine: Any,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    name = f"ledger_tamper_{uuid.uuid4().hex[:10]}"
    _admin(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    tmp = tmp_path_factory.mktemp("tamper")
    try:
        parts = build(_sa_url(name), tiny_engine, tmp)
        trust_text = format_trust_policy(ORIGIN, [parts["log_signer"].public_key],
                                         [public_raw(parts["service"].key)],
                                         [parts.pop("witness")], quorum=1)
        trust_file = tmp / "trust.toml"
        trust_file.write_text(trust_text)
        (tmp / "log.pem").write_bytes(private_pem(parts["log_signer"].key))
        yield Built(template=name, tmp=tmp, trust=parse_trust_policy(trust_text),
                    trust_file=trust_file, **parts)
    finally:
        _drop(name)


@pytest.fixture
def copy_url(built: Built) -> Iterator[str]:
    """A fresh copy of the clean log for one case."""
    name = f"ledger_tc_{uuid.uuid4().hex[:10]}"
    _admin(f'CREATE DATABASE "{name}" TEMPLATE "{built.template}"')
    try:
        yield _sa_url(name)
    finally:
        _drop(name)


def superuser(url: str, *sql: tuple[str, tuple[object, ...]]) -> None:
    """Run statements as the database superuser with the append-only triggers (and the
    foreign-key triggers) switched off, the way an insider would."""
    with psycopg.connect(pg(url)) as conn:
        conn.execute("SET session_replication_role = replica")
        for statement, params in sql:
            conn.execute(statement, params)


@pytest.fixture(scope="session", autouse=True)
def tamper_table(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    yield RESULTS
    if RESULTS:
        path = tmp_path_factory.getbasetemp() / "tamper-table.txt"
        path.write_text(format_table(RESULTS))
        TABLE_FILE.append(path)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ["case", "attack", "asserted mode", *MODES]
    body = [[r["case"], r["attack"], r["mode"], *[r["modes"].get(m, "-") for m in MODES]]
            for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))
    out = [line, "-" * len(line)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True))
            for row in body]
    return ("cells: FAIL@i = that audit mode fails naming first bad index i (FAIL: it "
            "names the dispute, a disputes row being no leaf); pass = it does not notice\n"
            + "\n".join(out) + "\n")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RESULTS:
        return
    terminalreporter.write_sep("=", "tamper cases x detecting audit mode")
    terminalreporter.write(format_table(RESULTS))
    if TABLE_FILE:
        terminalreporter.write_line(f"(also written to {TABLE_FILE[0]})")
