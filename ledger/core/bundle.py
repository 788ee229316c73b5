"""Offline-verifiable export bundles (format ``inference-ledger-bundle/v1``).

A bundle is JSON Lines. Line 1 is the header::

    {"format": "inference-ledger-bundle/v1", "origin": ..., "checkpoint": "<signed note>",
     "log_keys": ["<note verifier key>", ...], "keys": [{"keyid", "public_key" (base64 raw),
     "purpose", "name", "status", "not_before", "not_after", "revoked_at"}, ...],
     "selection": {...}, "records": N, "created_at": ...}

then one line per record::

    {"log_index": 7, "kind": "envelope", "ref": "<request_id>", "dsse": {<DSSE>},
     "inclusion_proof": ["<base64 hash>", ...]}

Verification needs no database and no network: the checkpoint's signature (by a pinned log
key, or one listed in the header), and for every record its DSSE signatures (by keys of
the right purpose), the log entry recomputed from the DSSE bytes, and its inclusion proof
against the checkpoint's root. Any failure raises :class:`BundleError` naming the line, the
log index and what is wrong.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from ledger.core import dsse, jsonstrict
from ledger.core.errors import LedgerError, VerificationError
from ledger.core.logentry import dsse_digest, log_entry_bytes
from ledger.core.merkle import leaf_hash, verify_inclusion
from ledger.core.note import Checkpoint, NoteVerifier, open_checkpoint, parse_verifier_key

FORMAT = "inference-ledger-bundle/v1"
#: Which key purposes may sign each record kind. Dispute events are signed by whoever
#: caused them: the ledger (reviewer actions, routing) or a worker (replaying, verdict).
PURPOSES_BY_KIND = {"envelope": {"producer"}, "verdict": {"worker"},
                    "dispute_event": {"ledger", "worker"}}


class BundleError(VerificationError):
    code = "bad_bundle"


@dataclass(frozen=True, slots=True)
class BundleHeader:
    origin: str
    checkpoint: Checkpoint
    checkpoint_note: bytes
    keys: Mapping[str, tuple[bytes, str]]  # keyid -> (public key, purpose)
    records: int
    raw: Mapping[str, Any]
    log_key_source: str  # "pinned" or "bundle"


@dataclass
class BundleSummary:
    records: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    tree_size: int = 0
    origin: str = ""
    log_key_source: str = ""
    revoked_signers: set[str] = field(default_factory=set)


def _b64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise BundleError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BundleError(f"{what} is not base64") from exc


def read_header(line: bytes, pinned_log_keys: Sequence[NoteVerifier] | None = None
                ) -> BundleHeader:
    """Parse and verify the header line (the checkpoint signature above all)."""
    try:
        head = jsonstrict.loads(line, what="bundle header", max_depth=6)
    except LedgerError as exc:
        raise BundleError(f"line 1: {exc.message}") from exc
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise BundleError(f"line 1: not an {FORMAT} header")
    origin = head.get("origin")
    note = head.get("checkpoint")
    if not isinstance(origin, str) or not isinstance(note, str):
        raise BundleError("line 1: header lacks origin or checkpoint")
    if pinned_log_keys:
        verifiers, source = list(pinned_log_keys), "pinned"
    else:
        try:
            verifiers = [parse_verifier_key(k) for k in head.get("log_keys") or []]
        except LedgerError as exc:
            raise BundleError(f"line 1: log key: {exc.message}") from exc
        source = "bundle"
    note_bytes = note.encode()
    try:
        cp = open_checkpoint(note_bytes, verifiers, origin=origin)
    except LedgerError as exc:
        raise BundleError(f"checkpoint: {exc.message}") from exc
    keys: dict[str, tuple[bytes, str]] = {}
    for i, k in enumerate(head.get("keys") or []):
        if not isinstance(k, dict):
            raise BundleError(f"line 1: keys[{i}] is not an object")
        pub = _b64(k.get("public_key"), f"keys[{i}].public_key")
        from ledger.core.keys import key_id

        try:
            kid = key_id(pub)
        except LedgerError as exc:
            raise BundleError(f"line 1: keys[{i}]: {exc.message}") from exc
        if k.get("keyid") != kid:
            raise BundleError(f"line 1: keys[{i}].keyid does not match its public key")
        keys[kid] = (pub, str(k.get("purpose")))
    records = head.get("records")
    if not isinstance(records, int) or isinstance(records, bool) or records < 0:
        raise BundleError("line 1: records must be a count")
    return BundleHeader(origin, cp, note_bytes, keys, records, head, source)


def verify_record(line: bytes, line_no: int, header: BundleHeader) -> tuple[int, str]:
    """Verify one record line; returns (log_index, kind)."""
    where = f"line {line_no}"
    # orjson rather than the strict reader: nothing on a record line is trusted until it
    # verifies cryptographically (signature, inclusion), so a duplicate key cannot smuggle
    # anything in, and this line is the hot path of offline verification.
    try:
        rec = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise BundleError(f"{where}: not valid JSON: {exc}") from exc
    if not isinstance(rec, dict) or set(rec) != {"log_index", "kind", "ref", "dsse",
                                                 "inclusion_proof"}:
        raise BundleError(f"{where}: not a bundle record")
    index, kind, ref = rec["log_index"], rec["kind"], rec["ref"]
    if not isinstance(index, int) or isinstance(index, bool) or not isinstance(ref, str):
        raise BundleError(f"{where}: log_index must be an integer and ref a string")
    where = f"{where} (log index {index}, {kind} {ref})"
    purposes = PURPOSES_BY_KIND.get(kind) if isinstance(kind, str) else None
    if purposes is None:
        raise BundleError(f"{where}: unknown record kind")
    try:
        env = dsse.envelope_from_obj(rec["dsse"])

        def key_for(keyid: str) -> bytes:
            found = header.keys.get(keyid)
            if found is None:
                raise BundleError(f"signing key {keyid} is not in the bundle")
            if found[1] not in purposes:
                raise BundleError(f"key {keyid} is a {found[1]} key; a {kind} needs a "
                                  f"{' or '.join(sorted(purposes))} key")
            return found[0]

        dsse.verify_envelope(env, key_for)
        payload = orjson.loads(env.payload)
        payload_ref = _payload_ref(kind, payload)
        if payload_ref != ref:
            raise BundleError(f"the signed payload names {payload_ref!r}, the record {ref!r}")
        entry = log_entry_bytes(kind, ref, dsse_digest(env.canonical_bytes()))
        proof = [_b64(h, "inclusion_proof item") for h in rec["inclusion_proof"]] \
            if isinstance(rec["inclusion_proof"], list) else None
        if proof is None:
            raise BundleError("inclusion_proof must be a list")
        verify_inclusion(leaf_hash(entry), index, header.checkpoint.size, proof,
                         header.checkpoint.root_hash)
    except BundleError as exc:
        raise BundleError(f"{where}: {exc.message}") from exc
    except (LedgerError, ValueError, TypeError, KeyError, orjson.JSONDecodeError) as exc:
        message = exc.message if isinstance(exc, LedgerError) else str(exc)
        raise BundleError(f"{where}: {message}") from exc
    return index, kind


def _payload_ref(kind: str, payload: Any) -> str | None:
    """The record ID a signed payload carries (what the log entry's ``ref`` must equal)."""
    pred = payload.get("predicate") if isinstance(payload, dict) else None
    if not isinstance(pred, dict):
        return None
    key = {"envelope": "request_id", "verdict": "verdict_id", "dispute_event": "event_id"}[kind]
    value = pred.get(key)
    return value if isinstance(value, str) else None


def verify_lines(lines: Iterable[bytes], *, pinned_log_keys: Sequence[NoteVerifier] | None = None,
                 on_record: Any = None) -> BundleSummary:
    """Verify a whole bundle given its lines (single process; see the CLI for parallel)."""
    it = iter(lines)
    first = next(it, None)
    if first is None:
        raise BundleError("the bundle is empty")
    header = read_header(first, pinned_log_keys)
    summary = start_summary(header)
    seen: set[int] = set()
    for n, line in enumerate(it, start=2):
        if not line.strip():
            raise BundleError(f"line {n}: empty line")
        index, kind = verify_record(line, n, header)
        add_record(summary, seen, index, kind, n)
        if on_record is not None:
            on_record()
    finish(summary, header)
    return summary


def start_summary(header: BundleHeader) -> BundleSummary:
    return BundleSummary(tree_size=header.checkpoint.size, origin=header.origin,
                         log_key_source=header.log_key_source)


def add_record(summary: BundleSummary, seen: set[int], index: int, kind: str, line_no: int) -> None:
    if index in seen:
        raise BundleError(f"line {line_no}: log index {index} appears twice")
    seen.add(index)
    summary.records += 1
    summary.by_kind[kind] = summary.by_kind.get(kind, 0) + 1


def finish(summary: BundleSummary, header: BundleHeader) -> None:
    if summary.records != header.records:
        raise BundleError(f"the header announces {header.records} records, the bundle holds "
                          f"{summary.records}")
