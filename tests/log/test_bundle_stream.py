"""`ledger verify` reads a bundle as a stream (issue 17): a record line is read, verified,
its digest taken into the manifest's and dropped, in chunks spread over worker processes. These
tests pin that a bundle refused before is refused now with the same message, in one
process or two, wherever in the stream the fault is, and that the result does not depend
on the number of processes or the chunk size.

Real PostgreSQL and a real `ledger export` (the fixture of test_bundle_whole); chunks of
two records (a mapped file: ranges of one line, ``chunk_bytes=1``) so that a fault sits in
the middle of the stream, behind queued chunks."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from ledger.core.bundle import (
    CHUNK_BYTES,
    BundleError,
    BundleSummary,
    iter_lines,
    verify_bundle,
    verify_file,
    verify_stream,
)
from tests.log.test_bundle_whole import Exported, N, ledger, populate

RECORDS = 3 + N  # three admin events (service key, log key, producer key), then envelopes
NO_DB = {"LEDGER_DATABASE_URL": "postgresql+psycopg://x@127.0.0.1:1/x"}


@pytest.fixture
def bundle(db_url: str, tmp_path: Path) -> Iterator[Exported]:
    from ledger.core.trust import load_trust_policy

    env, producer, log = populate(db_url, tmp_path)
    policy_file = tmp_path / "trust.toml"
    assert ledger("trust", "init", "--out", str(policy_file), env=env).returncode == 0
    out = tmp_path / "bundle.jsonl"
    r = ledger("export", "--out", str(out), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    yield Exported(db_url, tmp_path, env, out, policy_file, load_trust_policy(policy_file),
                   producer, log)


def refusals(path: Path, exported: Exported) -> list[str]:
    """The message of every way of verifying ``path``: in memory, and streamed from the
    file in one process and in two, in chunks of two records (of a mapped file, ranges
    of one line, and of 1,000 bytes, cut mid-line) and of the default size."""
    messages = []
    policy = exported.policy
    for run in (lambda: verify_bundle(path.read_bytes(), trust=policy),
                lambda: verify_file(path, trust=policy, processes=1, chunk=2, chunk_bytes=1),
                lambda: verify_file(path, trust=policy, processes=2, chunk=2, chunk_bytes=1),
                lambda: verify_file(path, trust=policy, processes=2, chunk_bytes=1000),
                lambda: verify_file(path, trust=policy, processes=1),
                lambda: verify_file(path, trust=policy, processes=2)):
        with pytest.raises(BundleError) as info:
            run()
        messages.append(info.value.message)
    return messages


def write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def test_processes_and_chunks_give_the_same_summary(bundle: Exported) -> None:
    summaries: list[BundleSummary] = [
        verify_bundle(bundle.bundle.read_bytes(), trust=bundle.policy),
        *(verify_file(bundle.bundle, trust=bundle.policy, processes=p, chunk=c,
                      chunk_bytes=b)
          for p in (1, 2) for c, b in ((1, 1), (2, 1000), (2000, CHUNK_BYTES)))]
    first = dataclasses.asdict(summaries[0])
    assert first["records"] == RECORDS
    assert first["by_kind"] == {"admin_event": 3, "envelope": N}
    assert all(dataclasses.asdict(s) == first for s in summaries[1:])
    # and the command: --processes 1 and 2 print the same table but for the time row
    outputs = []
    for p in ("1", "2"):
        r = ledger("verify", str(bundle.bundle), "--trust", str(bundle.policy_file),
                   "--processes", p, env=NO_DB)
        assert r.returncode == 0, r.stdout + r.stderr
        outputs.append([line for line in r.stdout.splitlines() if "│ time " not in line
                        and not re.search(r"\btime\b.*/s\)", line)])
    assert outputs[0] == outputs[1]
    assert any(re.search(rf"envelope records verified\s*│\s*{N}\s", x) for x in outputs[0])


def test_a_tampered_record_in_the_middle_is_refused_the_same_way(bundle: Exported) -> None:
    lines = bundle.bundle.read_bytes().split(b"\n")[:-1]
    middle = 1 + 3 + N // 2  # an envelope line, chunks before and after it
    rec = orjson.loads(lines[middle])
    payload = rec["dsse"]["payload"]
    rec["dsse"]["payload"] = ("B" if payload[0] != "B" else "C") + payload[1:]
    tampered = write(bundle.tmp / "tampered.jsonl",
                     [*lines[:middle], orjson.dumps(rec), *lines[middle + 1:]])
    messages = refusals(tampered, bundle)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith(f"line {middle + 1} (log index {rec['log_index']}, "
                                  f"envelope {rec['ref']}): "), messages[0]
    assert "signature does not verify" in messages[0], messages[0]
    # a second fault further on, one found while reading (an empty line): the first
    # fault in bundle order is reported, whatever the chunks queued or batched. (The
    # in-memory verifier before issue 17 looked for empty lines before anything else and
    # named line 16 here; each fault alone gets the message it gave.)
    both = write(bundle.tmp / "both.jsonl",
                 [*lines[:middle], orjson.dumps(rec), *lines[middle + 1:-1], b"", lines[-1]])
    assert refusals(both, bundle) == messages
    # the same record spelled otherwise (whitespace, another key order) verifies on its
    # own but is not the bytes the manifest binds: a v3 line must be canonical
    rec = orjson.loads(lines[middle])
    for respelling in (orjson.dumps(rec, option=orjson.OPT_INDENT_2).replace(b"\n", b""),
                       orjson.dumps(dict(reversed(list(rec.items())))),
                       lines[middle].replace(b',"inclusion_proof":[',
                                             b',"inclusion_proof":[ ')):
        respelled = write(bundle.tmp / "respelled.jsonl",
                          [*lines[:middle], respelling, *lines[middle + 1:]])
        assert set(refusals(respelled, bundle)) == {
            f"line {middle + 1} (log index {rec['log_index']}, envelope {rec['ref']}): the "
            "record line is not in canonical form (a v3 bundle binds each line's exact "
            "bytes)"}


def test_the_records_digest_is_of_the_line_digests_and_v2_bundles_still_verify(
        bundle: Exported) -> None:
    """v3's manifest names SHA-256 over each record line's digest (its DSSE replaced by
    the DSSE's SHA-256), computed where each line is verified; a v2 bundle (one SHA-256
    over the lines' bytes) of the same records, signed by the same service key, verifies
    the same way in one process or two, and a change to a line's bytes fails it too."""
    import hashlib

    from ledger.core import bundle as b
    from ledger.core.dsse import envelope_from_obj
    from ledger.producer import sign_statement
    from ledger.replay.records import Signer

    lines = bundle.bundle.read_bytes().split(b"\n")[:-1]
    head = orjson.loads(lines[0])
    assert head["format"] == b.FORMAT == "inference-ledger-bundle/v3"
    statement = orjson.loads(envelope_from_obj(head["manifest"]).payload)
    named = statement["subject"][0]["digest"]["sha256"]
    assert named == b.records_digest(lines[1:])
    assert named == hashlib.sha256(b"".join(b.line_digest(x) for x in lines[1:])).hexdigest()
    rec = orjson.loads(lines[5])
    dsse_hex = hashlib.sha256(orjson.dumps(rec["dsse"])).hexdigest()
    assert b.line_digest(lines[5]) == hashlib.sha256(
        lines[5].replace(orjson.dumps(rec["dsse"]), b'"%s"' % dsse_hex.encode())).digest()

    service = Signer.from_file(bundle.tmp / "service.pem", "ledger", "x")
    assert service is not None

    def v2(record_lines: list[bytes]) -> bytes:
        pred = {**statement["predicate"], "format": b.FORMAT_V2}
        st = {**statement, "predicate": pred,
              "subject": [{"name": "records", "digest": {
                  "sha256": b.records_digest(record_lines, b.FORMAT_V2)}}]}
        return b.header_bytes(len(record_lines), sign_statement(st, service.key),
                              b.FORMAT_V2)

    old = write(bundle.tmp / "v2.jsonl", [v2(lines[1:]), *lines[1:]])
    first = dataclasses.asdict(verify_file(bundle.bundle, trust=bundle.policy))
    for p in (1, 2):
        assert dataclasses.asdict(verify_file(old, trust=bundle.policy, processes=p,
                                              chunk=2)) == first
    # v2 binds the bytes of the lines whole: a respelled line fails the digest there
    respelled = orjson.dumps(orjson.loads(lines[5]), option=orjson.OPT_INDENT_2)
    old_respelled = write(bundle.tmp / "v2-respelled.jsonl",
                          [v2(lines[1:]), *lines[1:5], respelled.replace(b"\n", b""),
                           *lines[6:]])
    assert set(refusals(old_respelled, bundle)) == {
        "the records are not those the manifest signs (digest mismatch)"}
    # a v2 header over v3 digests, or the reverse, names the wrong digest
    mixed = write(bundle.tmp / "v2-header-v3-digest.jsonl", [
        b.header_bytes(len(lines) - 1, sign_statement(
            {**statement, "predicate": {**statement["predicate"], "format": b.FORMAT_V2}},
            service.key), b.FORMAT_V2), *lines[1:]])
    assert set(refusals(mixed, bundle)) == {
        "the records are not those the manifest signs (digest mismatch)"}


def test_a_truncated_bundle_is_refused_the_same_way(bundle: Exported) -> None:
    data = bundle.bundle.read_bytes()
    cut = bundle.tmp / "cut.jsonl"
    cut.write_bytes(data[:len(data) // 2])  # mid-line
    assert set(refusals(cut, bundle)) == {
        "the bundle does not end with a newline (truncated?)"}
    lines = data.split(b"\n")[:-1]
    short = write(bundle.tmp / "short.jsonl", lines[:-3])  # at a line boundary
    assert set(refusals(short, bundle)) == {
        f"the header announces {RECORDS} records, the bundle holds {RECORDS - 3}"}
    empty = bundle.tmp / "empty.jsonl"
    empty.write_bytes(b"")
    assert set(refusals(empty, bundle)) == {"the bundle is empty"}
    blank = write(bundle.tmp / "blank.jsonl", [*lines[:8], b"", *lines[8:]])
    assert set(refusals(blank, bundle)) == {"line 9: empty line"}


def test_a_reordered_bundle_is_refused_the_same_way(bundle: Exported) -> None:
    lines = bundle.bundle.read_bytes().split(b"\n")[:-1]
    a, b = 5, 5 + N // 2  # two envelope lines in different chunks
    swapped = write(bundle.tmp / "swapped.jsonl",
                    [*lines[:a], lines[b], *lines[a + 1:b], lines[a], *lines[b + 1:]])
    assert set(refusals(swapped, bundle)) == {
        "the records are not those the manifest signs (digest mismatch)"}
    # an admin event moved behind the envelopes: the producer key it registers is then
    # not vouched for when the first envelope is checked
    moved = write(bundle.tmp / "moved.jsonl", [lines[0], lines[1], lines[2], *lines[4:],
                                               lines[3]])
    messages = refusals(moved, bundle)
    assert len(set(messages)) == 1, messages
    assert re.fullmatch(r"line 4 \(log index \d+, envelope [^)]+\): signing key \S+ is not "
                        r"vouched for in the bundle", messages[0]), messages[0]
    duplicated = write(bundle.tmp / "twice.jsonl", [*lines[:7], lines[6], *lines[7:]])
    messages = refusals(duplicated, bundle)
    index = orjson.loads(lines[6])["log_index"]
    assert set(messages) == {f"line 8: log index {index} appears twice"}, messages


def test_the_first_fault_in_bundle_order_is_named_within_a_chunk(bundle: Exported) -> None:
    """A repeated index, then a line refused further on in the same chunk (or range):
    the repeat is named, as when the two are in different chunks. (A chunk used to be
    refused whole by its first bad line, before the indices of the lines ahead of it
    were checked: which fault was named depended on the chunk size.)"""
    lines = bundle.bundle.read_bytes().split(b"\n")[:-1]
    rec = orjson.loads(lines[-2])
    rec["ref"] = rec["ref"] + "x"
    faults = write(bundle.tmp / "twice-then-bad.jsonl",
                   [*lines[:7], lines[6], *lines[7:-2], orjson.dumps(rec), lines[-1]])
    index = orjson.loads(lines[6])["log_index"]
    assert set(refusals(faults, bundle)) == {f"line 8: log index {index} appears twice"}
    # and a refused line deep in a range is named by its own number
    bad = write(bundle.tmp / "bad-late.jsonl", [*lines[:-2], orjson.dumps(rec), lines[-1]])
    messages = refusals(bad, bundle)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith(f"line {len(lines) - 1} (log index {rec['log_index']}, "
                                  "envelope "), messages[0]


def test_a_bundle_whose_manifest_does_not_match_is_refused_the_same_way(
        bundle: Exported) -> None:
    lines = bundle.bundle.read_bytes().split(b"\n")[:-1]
    # the header of another export of the same log (one request, signed by the same
    # service key) over these records
    rid = orjson.loads(lines[-1])["ref"]
    other = bundle.tmp / "one.jsonl"
    r = ledger("export", "--out", str(other), "--request-id", rid, env=bundle.env)
    assert r.returncode == 0, r.stdout + r.stderr
    other_lines = other.read_bytes().split(b"\n")[:-1]
    mixed = write(bundle.tmp / "mixed.jsonl", [other_lines[0], *lines[1:]])
    assert set(refusals(mixed, bundle)) == {
        f"the header announces {len(other_lines) - 1} records, the bundle holds {RECORDS}"}
    # same count, other records: one envelope of this bundle replaced by the other
    # export's copy of another envelope is caught by the digest only
    replaced = write(bundle.tmp / "replaced.jsonl",
                     [other_lines[0], *other_lines[1:-1], lines[5]])
    assert set(refusals(replaced, bundle)) == {
        "the records are not those the manifest signs (digest mismatch)"}


def test_mapped_chunks_shared_slots_and_pickled_chunks_agree(
        bundle: Exported, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three ways chunks reach the workers: a v3 bundle file is mapped and the workers
    read their lines from the mapping (``verify_file``); lines given one at a time go
    through shared memory (``Slots``); a chunk too large for a slot is pickled. All give
    the same summary and the same refusal, and each path is really taken."""
    from ledger.core import bundle as bundle_module

    placed: list[bool] = []
    put = bundle_module.Slots.put

    def counting_put(self: bundle_module.Slots, lines: list[tuple[int, bytes]]) -> object:
        got = put(self, lines)
        placed.append(got is not None)
        return got

    mapped: list[int] = []
    verify_mapping = bundle_module._verify_mapping

    def counting_mapping(*args: object, **kwargs: object) -> object:
        mapped.append(1)
        return verify_mapping(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(bundle_module.Slots, "put", counting_put)
    monkeypatch.setattr(bundle_module, "_verify_mapping", counting_mapping)
    lines = bundle.bundle.read_bytes().split(b"\n")[:-1]
    middle = 1 + 3 + N // 2
    rec = orjson.loads(lines[middle])
    rec["ref"] = rec["ref"] + "x"
    tampered = write(bundle.tmp / "tampered-ref.jsonl",
                     [*lines[:middle], orjson.dumps(rec), *lines[middle + 1:]])

    def both(verify: Callable[..., BundleSummary]) -> tuple[dict[str, object], str]:
        summary = verify(bundle.bundle, trust=bundle.policy, processes=2, chunk=2,
                         chunk_bytes=1 << 20)
        with pytest.raises(BundleError) as info:
            verify(tampered, trust=bundle.policy, processes=2, chunk=2, chunk_bytes=1 << 20)
        return dataclasses.asdict(summary), info.value.message

    def streamed(path: Path, **kwargs: Any) -> BundleSummary:
        with path.open("rb") as fh:
            return verify_stream(iter_lines(fh), **kwargs)

    via_mapping = both(verify_file)
    assert len(mapped) == 2 and not placed
    via_slots = both(streamed)
    assert placed and all(placed) and len(mapped) == 2
    placed.clear()
    monkeypatch.setattr(bundle_module, "SLOT_SLACK", 1 - (1 << 20))  # slots of 1 byte
    pickled = both(streamed)
    assert placed and not any(placed)
    assert via_mapping == via_slots == pickled
    assert via_slots[0]["records"] == RECORDS
    assert via_slots[1].startswith(f"line {middle + 1} "), via_slots[1]
    assert "the signed payload names" in via_slots[1], via_slots[1]


def test_a_mapped_bundle_refuses_a_line_past_the_limit_after_the_faults_before_it(
        bundle: Exported, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from its mapping, a bundle file's line longer than ``MAX_LINE_BYTES`` is
    refused as it is found (nothing is buffered), and a fault in a line before it, queued
    or batched, is the one named; a line of spaces is an empty line, as in the stream."""
    from ledger.core import bundle as bundle_module

    lines = bundle.bundle.read_bytes().split(b"\n")[:-1]
    limit = max(len(line) for line in lines)
    monkeypatch.setattr(bundle_module, "MAX_LINE_BYTES", limit)
    middle = 1 + 3 + N // 2
    long = write(bundle.tmp / "long.jsonl",
                 [*lines[:middle], b" " * (limit + 1), *lines[middle:]])
    for p, c in ((1, 2), (1, 2000), (2, 2), (2, 2000)):
        with pytest.raises(BundleError, match=f"^a line of the bundle is longer than "
                                              f"{limit} bytes$"):
            verify_file(long, trust=bundle.policy, processes=p, chunk=c,
                        chunk_bytes=1 if c == 2 else CHUNK_BYTES)
    rec = orjson.loads(lines[middle - 2])
    rec["ref"] = rec["ref"] + "x"
    both = write(bundle.tmp / "long-after-fault.jsonl",
                 [*lines[:middle - 2], orjson.dumps(rec), *lines[middle - 1:middle],
                  b" " * (limit + 1), *lines[middle:]])
    for p, c in ((1, 2), (1, 2000), (2, 2), (2, 2000)):
        with pytest.raises(BundleError, match=f"^line {middle - 1} .*the signed payload "
                                              "names"):
            verify_file(both, trust=bundle.policy, processes=p, chunk=c,
                        chunk_bytes=1 if c == 2 else CHUNK_BYTES)
    spaces = write(bundle.tmp / "spaces.jsonl", [*lines[:8], b" \t ", *lines[8:]])
    assert set(refusals(spaces, bundle)) == {"line 9: empty line"}


def test_an_export_into_a_file_and_through_a_pipe_holds_the_same_records(
        bundle: Exported) -> None:
    """Into a regular file ``write_bundle`` counts the records first and writes them once,
    after a gap the header fills at the end; into anything else (a pipe here) through a
    spool. Both give the same record lines, a header of the length the gap left, and
    bundles that verify."""
    import os
    import threading

    from ledger.db.session import make_engine
    from ledger.log.export import Selection, write_bundle
    from ledger.replay.records import Signer
    from ledger.settings import Settings

    service = Signer.from_file(bundle.tmp / "service.pem", "ledger", "ledger-service")
    engine = make_engine(Settings(database_url=bundle.db_url), pool_size=1)
    try:
        direct = bundle.tmp / "direct.jsonl"
        with direct.open("wb") as fh:
            assert write_bundle(engine, Selection(), fh, service) == RECORDS
        r, w = os.pipe()
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(os.fdopen(r, "rb").read()))
        reader.start()
        with os.fdopen(w, "wb") as pipe:
            assert write_bundle(engine, Selection(), pipe, service) == RECORDS
        reader.join(30)
    finally:
        engine.dispose()
    piped = write(bundle.tmp / "piped.jsonl", got[0].split(b"\n")[:-1])
    a, b = direct.read_bytes().split(b"\n"), piped.read_bytes().split(b"\n")
    assert a[1:] == b[1:] and len(a) == RECORDS + 2
    assert orjson.loads(a[0])["records"] == RECORDS and a[0].startswith(b'{"format":')
    for path in (direct, piped):
        assert verify_file(path, trust=bundle.policy).records == RECORDS
