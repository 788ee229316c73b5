"""`ledger audit --since CHECKPOINT`: the incremental audit, on the tamper suite's log.

The checkpoint is one the sink saved outside the database, at the index of the rejected
dispute's resolution (so a dispute trail straddles it). What it must catch: any change
after it (each record rebuilt from its signed bytes, as the full audit does), a change
before it that reached the stored tree (the tiles no longer fold to its root), any
stored tile edited, a rewrite re-signed with the log key (its root is not the saved one),
a checkpoint not signed by a trusted log key (refused), a truncated log. What it leaves
to the full audit, shown below: an old record edited together with its entry and leaf
hash but not the tiles (the old rows are not read).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from ledger.core.cosignature import append_signature_lines
from ledger.core.keys import generate_private_key
from ledger.core.merkle import leaf_hash
from ledger.core.tiles import MemoryTileStore, integrate, tiles_for_size
from ledger.db.session import make_engine, session_scope
from ledger.log.audit import (
    AuditReport,
    SinceCheckpointError,
    _check_stored_tree,
    _Checkpoint,
    audit,
)
from ledger.log.signer import LogSigner
from ledger.log.witnessing import stored_cosignature_lines
from tests.tamper.conftest import ORIGIN, Built, superuser
from tests.tamper.test_tamper import (
    _cli,
    _edited_envelope,
    _replace_record,
    _resign_log,
    truncate_tail,
)


def _since(b: Built) -> int:
    return b.event("rejected", "resolved")


def _note(b: Built, size: int) -> bytes:
    return (b.sink / f"checkpoint.{size:020d}").read_bytes()


def _audit(b: Built, url: str, note: bytes, mode: str = "trust") -> AuditReport:
    engine = make_engine(url=url, pool_size=1)
    try:
        if mode == "plain":
            return audit(engine, ORIGIN, since=note)
        return audit(engine, ORIGIN, since=note, signatures=True, trust=b.trust)
    finally:
        engine.dispose()


def _full(b: Built, url: str) -> AuditReport:
    engine = make_engine(url=url, pool_size=1)
    try:
        return audit(engine, ORIGIN, signatures=True, trust=b.trust)
    finally:
        engine.dispose()


@pytest.mark.parametrize("mode", ["plain", "trust"])
def test_clean_log_passes_from_a_saved_checkpoint(built: Built, copy_url: str,
                                                   mode: str) -> None:
    m = _since(built)
    assert built.event("rejected", "opened") < m  # a trail straddles the checkpoint
    report = _audit(built, copy_url, _note(built, m), mode)
    assert report.ok, report.problems
    assert report.since == m
    assert report.entries == len(built.entries) - m  # only the entries after it
    assert report.tree_size == len(built.entries)
    assert report.disputes_checked >= 1  # the straddling trail's row, folded whole
    if mode == "trust":
        assert report.signatures_checked == report.entries
    latest = _audit(built, copy_url, _note(built, len(built.entries)), mode)
    assert latest.ok and latest.entries == 0, latest.problems


def test_cosigned_note_and_saved_checkpoints(built: Built, copy_url: str) -> None:
    """The note as an export carries it (with the witness's cosignature line) is accepted,
    and --against checkpoints before the --since one are checked against the stored tree
    it verified."""
    m = _since(built)
    engine = make_engine(url=copy_url, pool_size=1)
    try:
        with session_scope(engine) as s:
            note = append_signature_lines(_note(built, m), stored_cosignature_lines(s, m))
        assert note != _note(built, m)
        report = audit(engine, ORIGIN, since=note, trust=built.trust, against=built.saved())
        # a saved checkpoint before m that the log does not reach with that root
        other = ("elsewhere", built.log_signer.sign(5, hashlib.sha256(b"other").digest()))
        bad = audit(engine, ORIGIN, since=note, trust=built.trust, against=[other])
    finally:
        engine.dispose()
    assert report.ok, report.problems
    assert report.saved_checkpoints >= len(built.saved())
    assert not bad.ok and any("saved checkpoint elsewhere (size 5) disagrees" in p
                              for p in bad.problems), bad.problems


def test_tamper_after_the_checkpoint_is_detected(built: Built, copy_url: str) -> None:
    i = built.tail[2]
    superuser(copy_url, ("UPDATE envelopes SET dsse = set_byte(dsse, 60, get_byte(dsse, 60) "
                         "# 1) WHERE log_index = %s", (i,)))
    report = _audit(built, copy_url, _note(built, _since(built)), "plain")
    assert not report.ok and report.first_bad_index == i
    assert any("does not match its record" in p for p in report.problems), report.problems


def test_column_edit_after_the_checkpoint_is_detected(built: Built, copy_url: str) -> None:
    v = built.verdicts["reverify-diverged"]
    assert v["idx"] > _since(built)
    superuser(copy_url, ("UPDATE verdicts SET outcome = 'reproduced' WHERE log_index = %s",
                         (v["idx"],)))
    report = _audit(built, copy_url, _note(built, _since(built)))
    assert report.first_bad_index == v["idx"], report.problems


def test_old_entry_rewritten_into_the_tree_is_detected(built: Built, copy_url: str) -> None:
    """An envelope before the checkpoint rewritten (re-signed by its producer), its entry,
    leaf and every tile rebuilt, every checkpoint re-signed with the real log key: the
    database agrees with itself, but the stored tree no longer has the saved root."""
    i = built.env_index["tamper-7-4"]
    m = _since(built)
    assert i < m
    new = _edited_envelope(copy_url, i, built.producer)
    _replace_record(copy_url, "envelopes", "envelope", i, "tamper-7-4", new,
                    dsse_sha256=hashlib.sha256(new).digest())
    _resign_log(copy_url, built.log_signer)
    report = _audit(built, copy_url, _note(built, m))
    assert not report.ok
    assert any(f"the stored tree at size {m} does not have the --since" in p
               for p in report.problems), report.problems


@pytest.mark.parametrize("where", ["leaf", "partial tile of the old tree"])
def test_stored_tree_hash_before_the_checkpoint_edited(built: Built, copy_url: str,
                                                       where: str) -> None:
    """One stored hash of the old tree changed (here the leaf hash of an old entry in the
    level-0 tile): the tiles do not fold to the saved root."""
    m = _since(built)
    k = built.env_index["tamper-7-4"] if where == "leaf" else m - 1
    superuser(copy_url, ("UPDATE tiles SET data = set_byte(data, %s, get_byte(data, %s) # 1) "
                         "WHERE level = 0 AND idx = 0", (k * 32, k * 32)))
    report = _audit(built, copy_url, _note(built, m))
    assert not report.ok
    assert any("does not have the --since checkpoint's root" in p
               for p in report.problems), report.problems


def test_full_tile_edited_below_the_checkpoint() -> None:
    """A full tile (which the root does not read directly) must hash to its entry in the
    tile above: 600 leaves, two full level-0 tiles, one of them edited."""
    leaves = [leaf_hash(b"entry %d" % i) for i in range(600)]
    store = MemoryTileStore()
    res = integrate(0, leaves, store)
    stored = {(t.level, t.index): d for t, d in res.tiles.items()}
    cp = _Checkpoint(600, res.root, b"", "since")
    clean = AuditReport()
    assert _check_stored_tree(clean, stored, cp) and clean.ok
    assert len([t for t in tiles_for_size(600) if not t.is_partial]) == 2
    data = bytearray(stored[(0, 1)])
    data[5] ^= 1
    stored[(0, 1)] = bytes(data)
    bad = AuditReport()
    assert not _check_stored_tree(bad, stored, cp)
    assert bad.first_bad_index == 256, bad.problems
    assert "tile/0/001 does not hash to its entry in the tile above" in bad.problems[0]


def test_old_record_edited_without_its_tree_is_left_to_the_full_audit(
        built: Built, copy_url: str) -> None:
    """What --since does not read: an old record and its entry and leaf hash edited,
    the tiles left alone. The tree still has the saved root, so --since passes; the full
    audit names the entry (and any inclusion proof for that record fails)."""
    i = built.env_index["tamper-7-4"]
    m = _since(built)
    new = _edited_envelope(copy_url, i, built.producer)
    _replace_record(copy_url, "envelopes", "envelope", i, "tamper-7-4", new,
                    dsse_sha256=hashlib.sha256(new).digest())
    assert _audit(built, copy_url, _note(built, m)).ok
    full = _full(built, copy_url)
    assert not full.ok and full.first_bad_index == i, full.problems


def test_checkpoint_not_signed_by_a_trusted_key_is_refused(built: Built, copy_url: str,
                                                           tmp_path: Path) -> None:
    m = _since(built)
    forged = LogSigner(ORIGIN, generate_private_key())
    engine = make_engine(url=copy_url, pool_size=1)
    try:
        with engine.connect() as c:
            root = bytes(c.exec_driver_sql("SELECT root_hash FROM checkpoints "
                                           f"WHERE tree_size = {m}").scalar_one())
    finally:
        engine.dispose()
    note = forged.sign(m, root)
    for mode in ("plain", "trust"):
        with pytest.raises(SinceCheckpointError, match="not signed by"):
            _audit(built, copy_url, note, mode)
    # the CLI: one line and a hint, exit 2; the saved checkpoint passes
    env = {"LEDGER_DATABASE_URL": copy_url, "LEDGER_LOG_NAME": ORIGIN}
    path = tmp_path / "checkpoint.forged"
    path.write_bytes(note)
    refused = _cli("--trust", str(built.trust_file), "--since", str(path), env=env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "--since checkpoint" in refused.stderr and "hint:" in refused.stderr
    assert "Traceback" not in refused.stderr
    saved = built.sink / f"checkpoint.{m:020d}"
    ok = _cli("--trust", str(built.trust_file), "--signatures", "--since", str(saved),
              env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"checkpoint {m:,}" in ok.stdout


def test_checkpoint_beyond_a_truncated_log_is_detected(built: Built, copy_url: str) -> None:
    latest = len(built.entries)
    cut, _ = truncate_tail(built, copy_url)
    report = _audit(built, copy_url, _note(built, latest))
    assert not report.ok
    assert any("truncated" in p for p in report.problems), report.problems
    assert report.first_bad_index is not None and report.first_bad_index <= cut
