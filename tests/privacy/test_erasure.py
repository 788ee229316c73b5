"""Issue 18, acceptance 1 and 3 on a real PostgreSQL: three subjects, one erased; its
content is gone from the database (pg_dump), the others read back byte-identical, audit
and verify pass, the erased records' proofs still verify, a replay ends
``unverifiable: erased``, reading or restoring the content fails; a retention policy
erases what is older than its window once under concurrent beats."""

from __future__ import annotations

import base64
import json
import subprocess
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import func, select, text

from ledger.core import sealing
from ledger.core.bundle import verify_bundle
from ledger.core.erasure import ERASED
from ledger.core.keys import generate_private_key, public_raw
from ledger.core.logentry import log_entry_bytes
from ledger.core.merkle import leaf_hash, verify_inclusion
from ledger.db.models import Envelope, ReplayJobItem
from ledger.db.session import session_scope
from ledger.errors import Gone
from ledger.log import proofs
from ledger.log.audit import audit
from ledger.log.export import Selection, bundle_lines
from ledger.privacy import erasure
from ledger.services import envelopes as envelope_service
from ledger.services.keys import register_key
from tests.conftest import ADMIN_PG
from tests.helpers import signed, statement
from tests.privacy.conftest import ORIGIN, SUBJECTS, Log


def _dump(db_url: str) -> bytes:
    dbname = db_url.rsplit("/", 1)[1]
    return subprocess.run(["pg_dump", "--data-only", "-d",
                           ADMIN_PG.rsplit("/", 1)[0] + "/" + dbname],
                          check=True, capture_output=True).stdout


def _needles(env: dict[str, Any], prompt: list[int]) -> list[bytes]:
    """What plaintext content looks like in a dump: the token IDs as JSON text, and their
    base64 in each of the three alignments of the payload (as the DSSE bytes hold it);
    each also hex-encoded (pg_dump writes bytea so)."""
    payload = base64.b64decode(env["payload"])
    tokens = json.dumps(prompt, separators=(",", ":")).encode()
    out = [tokens, ",".join(map(str, prompt[:4])).encode()]
    at = payload.index(tokens)
    for shift in range(3):
        start = (at // 3) * 3 + 3 * shift
        out.append(base64.b64encode(payload[start:start + 30])[:36])
    return [form for n in out for form in (n, n.hex().encode())]


def _erase(log: Log, subject: str) -> erasure.ErasureResult:
    with session_scope(log.engine) as s:
        return erasure.erase_subject(s, log.service, log.kek, subject, actor="admin",
                                     reason="subject's request", legal_basis="GDPR Art. 17")


def _audit_ok(log: Log) -> Any:
    report = audit(log.engine, ORIGIN, signatures=True, kek=log.kek)
    assert report.ok, report.problems
    return report


def test_encrypted_at_rest_from_ingest(log: Log) -> None:
    """Nothing of any subject's content is in the dump, though every record reads back;
    the control (an envelope stored without a KEK) is found by the same grep."""
    plain = statement(prompt_token_ids=[8_765_432 + i for i in range(12)])
    plain_env = signed(plain, log.producer)
    log.ingest([plain_env], encrypted=False)
    dump = _dump(log.db_url)
    control = _needles(plain_env, plain["predicate"]["prompt_token_ids"])
    assert any(n in dump for n in control), "the grep must find content stored in plain"
    for subject in SUBJECTS:
        for _, _, env, prompt in log.records[subject]:
            for needle in _needles(env, prompt):
                assert needle not in dump, (subject, needle)
    with psycopg.connect(ADMIN_PG.rsplit("/", 1)[0] + "/" + log.db_url.rsplit("/", 1)[1]) \
            as conn:
        rows = conn.execute("SELECT dsse FROM envelopes ORDER BY log_index").fetchall()
    assert sum(sealing.is_sealed(bytes(r[0])) for r in rows) == 6


def test_erase_one_subject(log: Log) -> None:
    gone, *kept = SUBJECTS
    with session_scope(log.engine) as s:
        before = {subj: [envelope_service.envelope_view(s, rid, log.kek).dsse
                         for rid, *_ in log.records[subj]] for subj in SUBJECTS}
    with psycopg.connect(ADMIN_PG.rsplit("/", 1)[0] + "/" + log.db_url.rsplit("/", 1)[1]) \
            as conn:
        wrapped = [bytes(r[0]) for r in conn.execute(
            "SELECT wrapped FROM data_keys WHERE data_subject = %s", (gone,)).fetchall()]
    assert len(wrapped) == 1 and wrapped[0].hex().encode() in _dump(log.db_url)
    result = _erase(log, gone)
    assert (result.keys, result.records, result.created) == (1, 2, True)
    log.integrate()

    # gone from the database: no plaintext in the dump (rows, WAL-visible tables)
    dump = _dump(log.db_url)
    for _, _, env, prompt in log.records[gone]:
        for needle in _needles(env, prompt):
            assert needle not in dump
    assert wrapped[0].hex().encode() not in dump  # nor the wrapped key
    # the others read back byte-identical (the stored DSSE bytes, as signed)
    with session_scope(log.engine) as s:
        for subj in kept:
            now = [envelope_service.envelope_view(s, rid, log.kek).dsse
                   for rid, *_ in log.records[subj]]
            assert now == before[subj]
            for (_, _, env, _), dsse_bytes in zip(log.records[subj], now, strict=True):
                assert json.loads(dsse_bytes)["payload"] == env["payload"]
        # reading the erased content fails, with the tombstone (digest, index, erasure)
        for rid, idx, _, _ in log.records[gone]:
            with pytest.raises(Gone) as info:
                envelope_service.envelope_view(s, rid, log.kek)
            tomb = info.value.extra["tombstone"]
            assert tomb["log_index"] == idx and tomb["erasure"]["log_index"] == \
                result.log_index
            digest = bytes.fromhex(tomb["dsse_sha256"])
            row = s.get(Envelope, idx)
            assert row is not None and bytes(row.dsse_sha256) == digest
            # the proof of the erased record still verifies (the leaf is unchanged)
            receipt = proofs.inclusion(s, idx)
            entry = log_entry_bytes("envelope", rid, tomb["dsse_sha256"])
            assert entry == receipt.entry
            verify_inclusion(leaf_hash(entry), idx, receipt.tree_size, receipt.proof,
                             receipt.checkpoint.root_hash)

    # audit passes, with the erased records checked against their tombstones
    report = _audit_ok(log)
    assert report.erased_records == 2 and report.records_checked["erasure"] == 1
    # an export carries tombstones, and `ledger verify`'s verifier accepts it
    data = b"".join(bundle_lines(log.engine, Selection(), log.service, kek=log.kek))
    summary = verify_bundle(data)
    assert summary.by_kind.get("erased_envelope") == 2
    assert summary.by_kind.get("envelope") == 4 and summary.by_kind.get("erasure") == 1

    # a replay of an erased record ends unverifiable: erased
    from workers.replay import ReplayWorker, Unverifiable

    rid, idx, _, _ = log.records[gone][0]
    with session_scope(log.engine) as s, pytest.raises(Unverifiable) as unv:
        ReplayWorker._signed_envelope(s, ReplayJobItem(envelope_index=idx, request_id=rid),
                                      {}, log.kek)
    assert str(unv.value).startswith(f"{ERASED}: by erasure {result.erasure_id}")

    # restoring fails: a key row put back under the destroyed key's ID (any key, the old
    # one is gone) does not open the blob; the database refuses to delete keys by hand
    with session_scope(log.engine) as s:
        row = s.get(Envelope, idx)
        assert row is not None
        kid = sealing.sealed_key_id(bytes(row.dsse))
        s.execute(text("INSERT INTO data_keys (id, data_subject, channel, model_sha256, day, "
                       "wrapped, kek_id) VALUES (:id, 'restored', 'deterministic', 'x', "
                       "current_date, :w, :k)"),
                  {"id": kid, "w": log.kek.wrap(kid, sealing.new_data_key()),
                   "k": log.kek.kek_id})
        with pytest.raises(sealing.SealError):
            envelope_service.envelope_view(s, rid, log.kek)
        s.rollback()
    with psycopg.connect(ADMIN_PG.rsplit("/", 1)[0] + "/" + log.db_url.rsplit("/", 1)[1]) \
            as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("DELETE FROM data_keys")
    # a repeated erasure request answers with the same erasure, destroys nothing more
    again = _erase(log, gone)
    assert (again.erasure_id, again.created) == (result.erasure_id, False)
    _audit_ok(log)


def _old_records(log: Log) -> list[int]:
    """Three envelopes recorded 40 days ago (by a gateway key valid since then)."""
    old_at = datetime.now(UTC) - timedelta(days=40)
    backfill = generate_private_key()
    with session_scope(log.engine) as s:
        register_key(s, public_key=public_raw(backfill), purpose="producer", name="backfill",
                     not_before=old_at - timedelta(days=1), signer=log.service)
    old = [signed(statement(recorded_at=old_at.isoformat(), data_subject=f"old-{i}",
                            prompt_token_ids=[7_000_000 + i * 13 + j for j in range(8)]),
                  backfill) for i in range(3)]
    return log.ingest(old)


def test_a_retention_policy_planted_or_edited_in_the_database_erases_nothing(
        log: Log) -> None:
    """Erasure cannot be undone, so the beat checks each policy against its signed
    ``retention.created`` leaf before it erases: a policy row inserted, or a window
    shortened, by the database superuser erases nothing, and the audit names both."""
    import uuid

    from ledger.core.trust import TrustPolicy
    from ledger.db.models import AdminEvent, DataKey

    _old_records(log)
    with session_scope(log.engine) as s:
        honest = erasure.create_policy(s, log.service, name="90d", erase_after_days=90,
                                       channel=None, model_sha256=None, created_by="admin")
        keys_before = s.scalar(select(func.count()).select_from(DataKey))
        leaf = s.scalar(select(AdminEvent.log_index).where(
            AdminEvent.target == str(honest.id)))
    planted = uuid.uuid4()
    with psycopg.connect(log.db_url.replace("postgresql+psycopg://", "postgresql://")) as c:
        c.execute("SET session_replication_role = replica")
        c.execute("UPDATE retention_policies SET erase_after_days = 1 WHERE id = %s",
                  (honest.id,))
        c.execute("INSERT INTO retention_policies (id, name, erase_after_days, created_by) "
                  "VALUES (%s, 'planted', 1, 'mallory')", (planted,))
    with session_scope(log.engine) as s:
        assert erasure.run_retention(s, log.service, log.kek) == []  # refused, both
        assert s.scalar(select(func.count()).select_from(DataKey)) == keys_before
    log.integrate()
    trust = TrustPolicy(ORIGIN, (log.log_signer.verifier(),), (public_raw(log.service.key),))
    report = audit(log.engine, ORIGIN, signatures=True, trust=trust, kek=log.kek)
    text_ = "\n".join(report.problems)
    assert f"retention policy {planted} ('planted') has no creation leaf" in text_, text_
    assert (f"retention policy {honest.id} ('90d'): erase_after_days is 1 in the table, 90 "
            f"in the leaf at log index {leaf}") in text_, text_


def test_retention_erases_once_under_concurrent_beats(log: Log) -> None:
    """Envelopes recorded 40 days ago fall under a 30-day policy; the recent ones stay.
    Four beats run the policy at once: one erasure leaf, every old record erased once."""
    old_idx = _old_records(log)
    with session_scope(log.engine) as s:
        erasure.create_policy(s, log.service, name="30d", erase_after_days=30, channel=None,
                              model_sha256=None, created_by="admin")
    results: list[list[erasure.ErasureResult]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def beat() -> None:
        try:
            barrier.wait()
            with session_scope(log.engine) as s:
                results.append(erasure.run_retention(s, log.service, log.kek))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=beat) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    done = [r for rs in results for r in rs]
    assert len(done) == 1 and done[0].records == 3 and done[0].keys == 3, done
    with session_scope(log.engine) as s:
        for idx in old_idx:
            row = s.get(Envelope, idx)
            assert row is not None
            with pytest.raises(Gone):
                envelope_service.open_stored(s, bytes(row.dsse), {
                    "dsse_sha256": bytes(row.dsse_sha256).hex(), "log_index": idx,
                    "request_id": row.request_id, "ingested_at": row.ingested_at}, log.kek)
        recent = s.scalars(select(Envelope.log_index).where(
            Envelope.log_index.not_in(old_idx))).all()
        assert len(recent) == 6
        for subj in SUBJECTS:
            for rid, *_ in log.records[subj]:
                envelope_service.envelope_view(s, rid, log.kek)  # still readable
    # a later beat finds nothing more to erase
    with session_scope(log.engine) as s:
        assert erasure.run_retention(s, log.service, log.kek) == []
    log.integrate()
    _audit_ok(log)
