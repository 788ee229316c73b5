"""Offline-verifiable export bundles (format ``inference-ledger-bundle/v3``; v2 bundles
are still verified).

A bundle is JSON Lines, every byte of it covered by a signature or a digest the verifier
checks (docs/transparency-log.md, "Export bundles", is the full specification).

Line 1, the header, is exactly the bytes :func:`header_bytes` makes::

    {"format":"inference-ledger-bundle/v3","manifest":<DSSE>,"records":N}

``manifest`` is a DSSE envelope (canonical form) of an in-toto statement
``urn:inference-ledger:bundle:v1`` signed by the ledger's service key; its subject is the
records digest (:func:`records_digest`: in v3 the SHA-256 of every record line's
:func:`line_digest`, in v2 of every record line with its newline) and its predicate holds
``origin``, ``checkpoint`` (the signed note), ``log_keys``, ``service_keys``, ``keys``
(the database's key table, believed only without a trust policy), ``selection``,
``created_at`` and ``records``. Then one line per record, in canonical form (v3)::

    {"log_index":7,"kind":"envelope","ref":"<request_id>","dsse":{<DSSE>},
     "inclusion_proof":["<base64 hash>", ...]}

``admin_event`` records (the key registry) come first. With a trust policy the verifier
believes only the policy's log keys (for the checkpoint) and service keys (for the
manifest and the admin events), and a producer, worker or ledger key only when an
admin_event record of the bundle registers it. For every record it checks the DSSE
signatures, rebuilds the log entry from the DSSE bytes and checks its inclusion proof
against the checkpoint's root. Any failure raises :class:`BundleError` naming the line,
the log index and what is wrong.

Verification is one pass (:func:`verify_stream`; :func:`verify_file` for ``ledger
verify``): the header first, then each line verified on its own and dropped, in chunks
that worker processes may share, each line's digest taken in bundle order; memory does
not grow with the bundle. A v3 line's digest binds its DSSE envelope through the SHA-256
the leaf needs anyway, so it is computed where the line is verified, in parallel; v2's
one SHA-256 over all the lines was the serial part of parallel verification. A v3 bundle
file is mapped, and the workers find and read their lines in ranges of the mapping: the
main process only cuts the file at a newline every few megabytes (:func:`verify_file`).
"""
from __future__ import annotations

import base64
import binascii
import gc
import hashlib
import io
import mmap
import os
import re
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import pybase64

from ledger.core import dsse, jsonstrict
from ledger.core.envelope import STATEMENT_TYPE
from ledger.core.erasure import Tombstone, erasure_predicate, erasure_record
from ledger.core.errors import LedgerError, VerificationError
from ledger.core.keys import key_id
from ledger.core.logentry import dsse_digest, log_entry_bytes
from ledger.core.merkle import HASH_SIZE, NODE_PREFIX, leaf_hash, verify_inclusion
from ledger.core.note import Checkpoint, NoteVerifier, open_checkpoint, parse_verifier_key
from ledger.core.registry import RegisteredKey, Registry, RegistryError, open_admin_event
from ledger.core.statements import BUNDLE_PREDICATE_TYPE, matrix_run_digest
from ledger.core.trust import TrustPolicy

_sha256 = hashlib.sha256

FORMAT = "inference-ledger-bundle/v3"
#: The format before v3, still verified: its manifest digests the record lines' bytes in
#: one SHA-256 stream (see :func:`records_digest`), which only one process can compute.
FORMAT_V2 = "inference-ledger-bundle/v2"
FORMATS = frozenset({FORMAT, FORMAT_V2})
#: Which key purposes may sign each record kind. Dispute events are signed by whoever
#: caused them: the ledger (reviewer actions, routing) or a worker (replaying, verdict).
#: Admin events are checked against the service keys (the policy's, or the manifest's).
PURPOSES_BY_KIND = {"envelope": {"producer"}, "verdict": {"worker"},
                    "dispute_event": {"ledger", "worker"}, "admin_event": {"ledger"},
                    "erasure": {"ledger"}, "matrix_run": {"worker"}}
#: Kinds verified in order before every other record, in this process: the key registry
#: (admin events) and the erasure leaves, whose tombstones the erased envelopes need.
FIRST_KINDS = frozenset({"admin_event", "erasure"})
PREDICATE_FIELDS = frozenset({"format", "origin", "checkpoint", "log_keys", "service_keys",
                              "keys", "selection", "created_at", "records"})
RECORD_FIELDS = frozenset({"log_index", "kind", "ref", "dsse", "inclusion_proof"})
#: An erased envelope: its signed bytes are gone; ``tombstone`` is what an erasure record
#: of the bundle states of it (``ledger.core.erasure.Tombstone.served``).
TOMBSTONE_RECORD_FIELDS = frozenset({"log_index", "kind", "ref", "tombstone",
                                     "inclusion_proof"})


class BundleError(VerificationError):
    code = "bad_bundle"


@dataclass(frozen=True, slots=True)
class BundleKey:
    """A key a record may be signed by, and the log-index window it is valid in."""

    public_key: bytes
    purpose: str
    registered_index: int = -1
    revoked_index: int | None = None

    def check_index(self, keyid: str, log_index: int) -> None:
        """A record sequenced after its key's revocation leaf is refused (see
        :meth:`ledger.core.registry.RegisteredKey.valid_at_index`)."""
        if self.revoked_index is not None and log_index > self.revoked_index:
            raise BundleError(f"key {keyid} was revoked at log index {self.revoked_index}, "
                              "before this record")


@dataclass(slots=True)
class BundleHeader:
    origin: str
    checkpoint: Checkpoint
    checkpoint_note: bytes
    keys: dict[str, BundleKey]
    records: int
    manifest: Mapping[str, Any]
    log_key_source: str  # "trust", "pinned" or "bundle"
    records_sha256: str
    service_keys: dict[str, bytes]
    witnesses: list[str] = field(default_factory=list)
    registry: Registry = field(default_factory=Registry)
    tombstones: dict[int, Tombstone] = field(default_factory=dict)
    format: str = FORMAT


@dataclass
class BundleSummary:
    records: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    tree_size: int = 0
    origin: str = ""
    log_key_source: str = ""
    revoked_signers: set[str] = field(default_factory=set)
    witnesses: list[str] = field(default_factory=list)
    selection: Mapping[str, Any] = field(default_factory=dict)
    created_at: str = ""
    root_hash: str = ""
    #: keyid -> purpose of every key a record signature was checked against (the keys the
    #: bundle vouches for, and the service keys of its registry leaves and manifest)
    keys: dict[str, str] = field(default_factory=dict)


def header_bytes(records: int, manifest: dsse.Envelope, format: str = FORMAT) -> bytes:
    """The one function that makes a bundle's first line (without its newline)."""
    return b'{"format":"%s","manifest":%s,"records":%d}' % (
        format.encode(), manifest.canonical_bytes(), records)


def record_prefix(index: int, kind: str, ref: str, member: bytes = b"dsse") -> bytes:
    """A record line up to its signed member's value: ``{"log_index":7,"kind":"envelope",
    "ref":"<id>","dsse":`` (``member`` ``tombstone`` for an erased envelope)."""
    return record_prefix_format(kind, member) % (index, orjson.dumps(ref))


def record_prefix_format(kind: str, member: bytes = b"dsse") -> bytes:
    """:func:`record_prefix` of one kind and member as a format of the log index and the
    ref's JSON, ``% (index, orjson.dumps(ref))`` (for writers of many records)."""
    return b'{"log_index":%%d,"kind":"%s","ref":%%s,"%s":' % (kind.encode(), member)


def record_suffix(proof_json: bytes) -> bytes:
    """A record line after its signed member's value (without the newline)."""
    return b',"inclusion_proof":%s}' % proof_json


def dsse_line_digest(prefix: bytes, dsse_sha256: str, suffix: bytes) -> bytes:
    """The v3 digest of a record line with a ``dsse`` member: SHA-256 of the line with
    the DSSE envelope replaced by the JSON string of its hex SHA-256 (the ``dsse_sha256``
    of the record's log entry, which the verifier computes anyway). The envelope's bytes
    are bound through their digest, so a line is hashed in about a kilobyte, not its
    whole length; the line must be in canonical form (:func:`record_prefix`, the canonical
    DSSE bytes, :func:`record_suffix`), so nothing else could spell it."""
    return _sha256(b'%s"%s"%s' % (prefix, dsse_sha256.encode(), suffix)).digest()


def line_digest(line: bytes) -> bytes:
    """The v3 digest of a record line (:func:`dsse_line_digest`; of a tombstone line, the
    SHA-256 of the line), computed without verifying anything: for writers of bundles
    that have only the lines, and for tests."""
    rec = orjson.loads(line)
    if "dsse" not in rec:
        return _sha256(line).digest()
    cb = dsse.envelope_from_obj(rec["dsse"]).canonical_bytes()
    return dsse_line_digest(record_prefix(rec["log_index"], rec["kind"], rec["ref"]),
                            dsse_digest(cb), record_suffix(orjson.dumps(
                                rec["inclusion_proof"])))


def records_digest(record_lines: Iterable[bytes], format: str = FORMAT) -> str:
    """What the manifest's subject names, hex. v3: SHA-256 over the 32-byte
    :func:`line_digest` of every record line in order, which worker processes compute
    for the lines they verify; v2: SHA-256 over every record line, each followed by its
    newline."""
    h = hashlib.sha256()
    for line in record_lines:
        if format == FORMAT:
            h.update(line_digest(line))
        else:
            h.update(line)
            h.update(b"\n")
    return h.hexdigest()


def _b64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise BundleError(f"{what} must be a base64 string")
    try:
        # binascii's strict mode refuses what ``b64decode(validate=True)`` refuses
        # (anything outside the alphabet, padding other than at the end), at a third
        # of the cost: this runs for every hash of every inclusion proof.
        return binascii.a2b_base64(value.encode("ascii"), strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise BundleError(f"{what} is not base64") from exc


def _canonical_b64(env: dsse.Envelope, what: str) -> None:
    """Base64 has spellings that decode alike (unused trailing bits): only one counts."""
    if base64.b64encode(env.payload).decode() != env.payload_b64 or any(
            base64.b64encode(s.sig).decode() != s.sig_b64 for s in env.signatures):
        raise BundleError(f"{what}: base64 is not in canonical form")


def _key_table(entries: Any) -> dict[str, BundleKey]:
    keys: dict[str, BundleKey] = {}
    if not isinstance(entries, list):
        raise BundleError("manifest keys must be a list")
    for i, k in enumerate(entries):
        if not isinstance(k, dict):
            raise BundleError(f"manifest keys[{i}] is not an object")
        pub = _b64(k.get("public_key"), f"manifest keys[{i}].public_key")
        try:
            kid = key_id(pub)
        except LedgerError as exc:
            raise BundleError(f"manifest keys[{i}]: {exc.message}") from exc
        if k.get("keyid") != kid:
            raise BundleError(f"manifest keys[{i}].keyid does not match its public key")
        keys[kid] = BundleKey(pub, str(k.get("purpose")))
    return keys


def read_header(line: bytes, pinned_log_keys: Sequence[NoteVerifier] | None = None, *,
                trust: TrustPolicy | None = None) -> BundleHeader:
    """Parse and verify the header line: its exact bytes, the manifest's signature (by a
    trust-policy service key, or without a policy the one the manifest names), the
    checkpoint's signature and, where the policy asks, its witness quorum."""
    try:
        head = jsonstrict.loads(line, what="bundle header", max_depth=8)
    except LedgerError as exc:
        raise BundleError(f"line 1: {exc.message}") from exc
    if not isinstance(head, dict) or head.get("format") not in FORMATS:
        raise BundleError(f"line 1: not an {FORMAT} header")
    fmt = head["format"]
    if set(head) != {"format", "manifest", "records"}:
        raise BundleError("line 1: a header holds exactly format, manifest and records")
    records = head["records"]
    if not isinstance(records, int) or isinstance(records, bool) or records < 0:
        raise BundleError("line 1: records must be a count")
    try:
        env = dsse.envelope_from_obj(head["manifest"])
    except LedgerError as exc:
        raise BundleError(f"line 1: manifest: {exc.message}") from exc
    _canonical_b64(env, "line 1: manifest")
    if header_bytes(records, env, fmt) != line:
        raise BundleError("line 1: the header is not in canonical form")
    try:
        statement = orjson.loads(env.payload)
    except orjson.JSONDecodeError as exc:
        raise BundleError("line 1: the manifest payload is not JSON") from exc
    pred = statement.get("predicate") if isinstance(statement, dict) else None
    if not isinstance(pred, dict) or statement.get("_type") != STATEMENT_TYPE \
            or statement.get("predicateType") != BUNDLE_PREDICATE_TYPE:
        raise BundleError(f"line 1: the manifest is not an {BUNDLE_PREDICATE_TYPE} statement")
    if trust is not None:
        service_keys = {key_id(k): bytes(k) for k in trust.service_keys}
    else:  # self-asserted: proves integrity, not origin
        service_keys = {}
        for s in pred.get("service_keys") or []:
            raw = _b64(s, "manifest service key")
            try:
                service_keys[key_id(raw)] = raw
            except LedgerError as exc:
                raise BundleError(f"line 1: manifest service key: {exc.message}") from exc

    def service_key(kid: str) -> bytes:
        found = service_keys.get(kid)
        if found is None:
            raise BundleError(f"the manifest is signed by {kid}, not a trusted service key")
        return found

    try:
        dsse.verify_envelope(env, service_key)
    except LedgerError as exc:
        raise BundleError(f"line 1: manifest signature: {exc.message}") from exc
    if set(pred) != PREDICATE_FIELDS or pred["format"] != fmt:
        raise BundleError("line 1: the manifest predicate is not a bundle manifest")
    subject = statement.get("subject")
    try:
        records_sha256 = subject[0]["digest"]["sha256"]
        assert len(subject) == 1 and subject[0]["name"] == "records"
    except (TypeError, KeyError, IndexError, AssertionError) as exc:
        raise BundleError("line 1: the manifest's subject is not the records digest") from exc
    if pred["records"] != records:
        raise BundleError("line 1: the header's record count is not the manifest's")
    origin, note = pred["origin"], pred["checkpoint"]
    if not isinstance(origin, str) or not isinstance(note, str):
        raise BundleError("line 1: the manifest lacks origin or checkpoint")
    if trust is not None:
        if origin != trust.origin:
            raise BundleError(f"the bundle is from log {origin!r}, the trust policy trusts "
                              f"{trust.origin!r}")
        verifiers, source = trust.log_verifiers(), "trust"
    elif pinned_log_keys:
        verifiers, source = list(pinned_log_keys), "pinned"
    else:
        try:
            verifiers = [parse_verifier_key(k) for k in pred["log_keys"] or []]
        except (LedgerError, TypeError) as exc:
            raise BundleError(f"line 1: log key: {exc}") from exc
        source = "bundle"
    note_bytes = note.encode()
    try:
        cp = open_checkpoint(note_bytes, verifiers, origin=origin)
    except LedgerError as exc:
        raise BundleError(f"checkpoint: {exc.message}") from exc
    witnesses: list[str] = []
    if trust is not None and trust.quorum > 0:
        from ledger.core.cosignature import check_quorum

        try:
            witnesses = check_quorum(note_bytes, trust)
        except LedgerError as exc:
            raise BundleError(f"checkpoint: {exc.message}") from exc
    keys = {} if trust is not None else _key_table(pred["keys"])
    return BundleHeader(origin, cp, note_bytes, keys, records, pred, source, records_sha256,
                        service_keys, witnesses, format=fmt)


def _verify(line: bytes, line_no: int, header: BundleHeader
            ) -> tuple[int, str, Any, bytes | None]:
    """(log index, kind, what an admin or erasure record states, the line's v3 digest or
    None in a v2 bundle). The hot path of offline verification: messages are formatted
    only when they are raised.

    A v3 line in canonical form with one signature (every line ``ledger export``
    writes) is read by :func:`_canonical_record`, which recognises exactly that form and
    gives what parsing it would; anything else is parsed whole. The checks after that are
    the same either way, in the same order."""
    fast = _canonical_record(line) if header.format == FORMAT and type(line) is bytes \
        else None
    if fast is None:
        # orjson rather than the strict reader: nothing on a record line is trusted until
        # it verifies cryptographically (signature, inclusion, the manifest's digest), and
        # this line is the hot path of offline verification.
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise BundleError(f"line {line_no}: not valid JSON: {exc}") from exc
        if not isinstance(rec, dict) or rec.keys() != RECORD_FIELDS:
            if isinstance(rec, dict) and rec.keys() == TOMBSTONE_RECORD_FIELDS:
                return _verify_tombstone(line, rec, f"line {line_no}", header)
            raise BundleError(f"line {line_no}: not a bundle record")
        index, kind, ref = rec["log_index"], rec["kind"], rec["ref"]
        if not isinstance(index, int) or isinstance(index, bool) or not isinstance(ref, str):
            raise BundleError(f"line {line_no}: log_index must be an integer and ref a "
                              "string")
        purposes = PURPOSES_BY_KIND.get(kind) if isinstance(kind, str) else None
        if purposes is None:
            raise BundleError(f"line {line_no} (log index {index}, {kind} {ref}): unknown "
                              "record kind")
    else:
        index, kind, ref, payload, keyid, sig, items, dsse_at, dsse_end = fast
        purposes = PURPOSES_BY_KIND[kind]

    def key_for(keyid: str) -> bytes:
        return _signing_key(header, kind, purposes, index, keyid)

    try:
        if fast is None:
            env = dsse.envelope_from_obj(rec["dsse"])
            dsse.verify_envelope(env, key_for)
            payload = env.payload
        else:  # verify_envelope of its one signature
            dsse.verify_signature(dsse.PAYLOAD_TYPE_INTOTO, payload, sig,
                                  _signing_key(header, kind, purposes, index, keyid))
        statement = orjson.loads(payload)
        payload_ref = _payload_ref(kind, statement)
        if payload_ref != ref:
            raise BundleError(f"the signed payload names {payload_ref!r}, the record {ref!r}")
        if fast is None:
            items = rec["inclusion_proof"]
            if not isinstance(items, list):
                raise BundleError("inclusion_proof must be a list")
            canonical = env.canonical_bytes()
            hex_digest = dsse_digest(canonical)
        else:  # the canonical DSSE bytes are the line's, from dsse_at to dsse_end
            hex_digest = dsse_digest(memoryview(line)[dsse_at:dsse_end])
        checkpoint = header.checkpoint
        proven_nodes(checkpoint.size, checkpoint.root_hash).check(
            leaf_hash(log_entry_bytes(kind, ref, hex_digest)), index, items)
        if fast is not None:  # the line is record_prefix + DSSE + record_suffix
            digest: bytes | None = dsse_line_digest(line[:dsse_at], hex_digest,
                                                    line[dsse_end:])
        else:
            digest = None if header.format == FORMAT_V2 else _canonical_line_digest(
                line, record_prefix(index, kind, ref), canonical,
                record_suffix(orjson.dumps(items)), hex_digest)
        if kind == "envelope":
            return index, kind, None, digest
        if kind == "admin_event":
            if fast is not None:
                env = _canonical_envelope(line, fast)
            event = open_admin_event(env, key_for)
            return index, kind, event.predicate, digest
        if kind == "erasure":
            return (index, kind, erasure_record(erasure_predicate(payload), (), index),
                    digest)
        if kind == "matrix_run":
            matrix_run_digest(statement)   # the report hashes to the digest it signs
    except BundleError as exc:
        raise BundleError(f"line {line_no} (log index {index}, {kind} {ref}): "
                          f"{exc.message}") from exc
    except (LedgerError, ValueError, TypeError, KeyError, orjson.JSONDecodeError) as exc:
        message = exc.message if isinstance(exc, LedgerError) else str(exc)
        raise BundleError(f"line {line_no} (log index {index}, {kind} {ref}): "
                          f"{message}") from exc
    return index, kind, None, digest


def _signing_key(header: BundleHeader, kind: str, purposes: set[str], index: int,
                 keyid: str) -> bytes:
    """The public key ``keyid`` names for a ``kind`` record at ``index``, or a refusal:
    a service key for the records verified first, else a key the bundle vouches for,
    of a purpose the kind allows, not revoked before the record."""
    if kind in FIRST_KINDS:
        service = header.service_keys.get(keyid)
        if service is None:
            raise BundleError(f"admin event signed by {keyid}, not a trusted service key")
        return service
    found = header.keys.get(keyid)
    if found is None:
        raise BundleError(f"signing key {keyid} is not vouched for in the bundle")
    if found.purpose not in purposes:
        raise BundleError(f"key {keyid} is a {found.purpose} key; a {kind} needs a "
                          f"{' or '.join(sorted(purposes))} key")
    found.check_index(keyid, index)
    return found.public_key


_LINE_HEAD = b'{"log_index":'
_KIND_MARK = b',"kind":"'
_REF_MARK = b'","ref":'
_DSSE_MARK = b',"dsse":'
_PAYLOAD_MARK = b'{"payload":"'
_TYPE_MARK = b'","payloadType":"%s","signatures":[{"keyid":"' % (
    dsse.PAYLOAD_TYPE_INTOTO.encode())
_SIG_MARK = b'","sig":"'
_DSSE_TAIL = b'"}]}'
_PROOF_MARK = b',"inclusion_proof":'
_DSSE_AT_MARK = _DSSE_MARK + _PAYLOAD_MARK
_END_MARK = _DSSE_TAIL + _PROOF_MARK
_SIG_B64 = 88  # characters of padded base64 of a 64-byte signature
_KINDS_BY_BYTES = {k.encode(): k for k in PURPOSES_BY_KIND}
_HEX64 = re.compile(rb"[0-9a-f]{64}")

#: What :func:`_canonical_record` reads of a line: (index, kind, ref, payload, key ID,
#: signature, proof items, where the DSSE bytes start and end in the line).
CanonicalRecord = tuple[int, str, str, bytes, str, bytes, list[Any], int, int]


def _canonical_record(line: bytes) -> CanonicalRecord | None:
    """A v3 record line in exactly its canonical form with one DSSE signature,
    ``record_prefix(index, kind, ref)`` + the canonical DSSE bytes + ``record_suffix(
    orjson.dumps(items))``, read without parsing it whole: (index, kind, ref, the
    payload, the key ID and signature, items, where the DSSE bytes start and end in the
    line) as :func:`_verify`'s general path gets them from ``orjson.loads(line)`` and
    :func:`ledger.core.dsse.envelope_from_obj` (:func:`_canonical_envelope` gives that
    envelope), for a line that path accepts up to the signature check. None for any
    other line (then that path reads it).

    Every byte of the line is accounted for: the fixed JSON between the values; the
    index as JSON writes an integer (digits, no leading zero, at most 11 of them: the
    kind must follow within 20 bytes); a known kind; the ref and the proof items as
    exactly what ``orjson.dumps`` writes of what ``orjson.loads`` reads from them (a JSON
    string; a list); the payload type
    ``dsse.PAYLOAD_TYPE_INTOTO``; a key ID of 64 lowercase hex digits; the payload and
    signature as padded base64 that pybase64 decodes with ``validate`` (nothing outside
    the alphabet: no quote, no escape), a 64-byte signature. So the line is valid JSON
    with these five members and no others, and every value read here is the one parsing
    it would give.

    The DSSE bytes end at the last ``"}]},"inclusion_proof":`` of the line, and what
    lies between the payload and there has a fixed length (the payload type, a key ID,
    a signature's 88 base64 characters), so the payload's end is found without reading
    the payload (a third of the cost of this reading on an 18 KB line). Where that mark
    also occurs inside the proof items, the fixed marks or the base64 before it do not
    hold there (a quote is not base64), and the line is declined."""
    if not line.startswith(_LINE_HEAD) or not line.endswith(b"}"):
        return None
    at = len(_LINE_HEAD)
    mark = line.find(_KIND_MARK, at, at + 20)
    digits = line[at:mark]
    if mark < 0 or not digits.isdigit() or (digits[0] == 48 and len(digits) > 1):
        return None
    at = mark + len(_KIND_MARK)
    mark = line.find(_REF_MARK, at, at + 32)
    kind = _KINDS_BY_BYTES.get(line[at:mark]) if mark >= 0 else None
    if kind is None:
        return None
    at = mark + len(_REF_MARK)
    dsse_at = line.find(_DSSE_AT_MARK, at) + len(_DSSE_MARK)
    if dsse_at < len(_DSSE_MARK):
        return None
    ref_json = line[at:dsse_at - len(_DSSE_MARK)]
    try:
        ref = orjson.loads(ref_json)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(ref, str) or orjson.dumps(ref) != ref_json:
        return None
    dsse_end = line.rfind(_END_MARK, dsse_at) + len(_DSSE_TAIL)
    sig_at = dsse_end - len(_DSSE_TAIL) - _SIG_B64
    keyid_at = sig_at - len(_SIG_MARK) - 64
    payload_at, payload_end = dsse_at + len(_PAYLOAD_MARK), keyid_at - len(_TYPE_MARK)
    if (payload_end < payload_at or (payload_end - payload_at) % 4
            or not line.startswith(_TYPE_MARK, payload_end)
            or not _HEX64.fullmatch(line, keyid_at, keyid_at + 64)
            or not line.startswith(_SIG_MARK, keyid_at + 64)):
        return None
    items_json = line[dsse_end + len(_PROOF_MARK):-1]
    view = memoryview(line)
    try:
        payload = pybase64.b64decode(view[payload_at:payload_end], validate=True)
        sig = pybase64.b64decode(view[sig_at:dsse_end - len(_DSSE_TAIL)], validate=True)
        items = orjson.loads(items_json)
        if len(sig) != 64 or not isinstance(items, list) or orjson.dumps(items) != items_json:
            return None
    except (binascii.Error, ValueError, TypeError):
        # (orjson.JSONDecodeError is a ValueError; orjson.dumps refuses nesting past 254
        # levels, which loads reads, with a TypeError: the general path judges those)
        return None
    return (int(digits), kind, ref, payload, line[keyid_at:keyid_at + 64].decode("ascii"),
            sig, items, dsse_at, dsse_end)


def _canonical_envelope(line: bytes, record: CanonicalRecord) -> dsse.Envelope:
    """The envelope of a line :func:`_canonical_record` read (as
    :func:`ledger.core.dsse.envelope_from_obj` makes it from the parsed line)."""
    _, _, _, payload, keyid, sig, _, dsse_at, dsse_end = record
    sig_at = dsse_end - len(_DSSE_TAIL) - _SIG_B64
    payload_end = sig_at - len(_SIG_MARK) - 64 - len(_TYPE_MARK)
    return dsse.Envelope(dsse.PAYLOAD_TYPE_INTOTO,
                         line[dsse_at + len(_PAYLOAD_MARK):payload_end].decode("ascii"),
                         payload, (dsse.Signature(keyid, sig, line[sig_at:dsse_end - len(
                             _DSSE_TAIL)].decode("ascii")),))


def _canonical_line_digest(line: bytes, prefix: bytes, canonical: bytes, suffix: bytes,
                           hex_digest: str) -> bytes:
    """:func:`dsse_line_digest` of ``line``, which must be exactly ``prefix``, the
    canonical DSSE bytes and ``suffix``. (``line`` may be a memoryview of a slot: copied
    to bytes first, since a memoryview compares byte by byte in Python, 30 times slower
    than the copy.)"""
    data = line if isinstance(line, bytes) else bytes(line)
    n, m = len(prefix), len(canonical)
    if (len(data) != n + m + len(suffix) or not data.startswith(prefix)
            or not data.startswith(canonical, n) or not data.endswith(suffix)):
        raise BundleError("the record line is not in canonical form (a v3 bundle binds "
                          "each line's exact bytes)")
    return dsse_line_digest(prefix, hex_digest, suffix)


def verify_record(line: bytes, line_no: int, header: BundleHeader
                  ) -> tuple[int, str, bytes | None]:
    """Verify one record line (not an admin event: see :func:`add_admin_event`); returns
    (log_index, kind, the line's v3 digest or None in a v2 bundle)."""
    index, kind, _, digest = _verify(line, line_no, header)
    if kind in FIRST_KINDS:
        raise BundleError(f"line {line_no}: {kind} records must come first")
    return index, kind, digest


def _verify_tombstone(line: bytes, rec: dict[str, Any], where: str, header: BundleHeader
                      ) -> tuple[int, str, Any, bytes | None]:
    """An erased envelope: an erasure record of the bundle (verified before, signed by a
    service key) must state this tombstone; the leaf is rebuilt from it (request ID and
    digest) and its inclusion proof checked, so the proofs of erased records still hold."""
    index, ref, tomb = rec["log_index"], rec["ref"], rec["tombstone"]
    if not isinstance(index, int) or isinstance(index, bool) or not isinstance(ref, str) \
            or rec["kind"] != "envelope" or not isinstance(tomb, dict):
        raise BundleError(f"{where}: not a tombstone record")
    where = f"{where} (log index {index}, erased envelope {ref})"
    signed = header.tombstones.get(index)
    if signed is None:
        raise BundleError(f"{where}: no erasure record of the bundle states this tombstone")
    if tomb != signed.served() or signed.request_id != ref:
        raise BundleError(f"{where}: the tombstone differs from what erasure "
                          f"{signed.erasure_id} signed")
    try:
        proof = [_b64(h, "inclusion_proof item") for h in rec["inclusion_proof"]]
        entry = log_entry_bytes("envelope", ref, signed.dsse_sha256)
        verify_inclusion(leaf_hash(entry), index, header.checkpoint.size, proof,
                         header.checkpoint.root_hash)
    except (LedgerError, TypeError) as exc:
        message = exc.message if isinstance(exc, LedgerError) else str(exc)
        raise BundleError(f"{where}: {message}") from exc
    # v3: a tombstone line is small and has no DSSE to stand for it: hashed whole
    return (index, "erased_envelope", None,
            None if header.format == FORMAT_V2 else _sha256(line).digest())


def is_admin_event(line: bytes) -> bool:
    """Whether a record line claims to be an admin event (checked when it is verified)."""
    try:
        rec = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    return isinstance(rec, dict) and rec.get("kind") in FIRST_KINDS


def add_admin_event(line: bytes, line_no: int, header: BundleHeader
                    ) -> tuple[int, str, bytes | None]:
    """Verify an admin_event record and fold it into the header's key registry: the keys
    it registers sign the records after it (with a trust policy, only those). Returns
    (log_index, kind, the line's v3 digest or None in a v2 bundle)."""
    index, kind, pred, digest = _verify(line, line_no, header)
    if kind == "erasure":
        for t_index, tomb in pred.tombstones.items():
            header.tombstones.setdefault(t_index, tomb)
        return index, kind, digest
    if kind != "admin_event":
        raise BundleError(f"line {line_no}: not an admin_event record")
    try:
        header.registry.apply(index, pred)
    except RegistryError as exc:
        raise BundleError(f"line {line_no} (log index {index}): {exc.message}") from exc
    registered: RegisteredKey | None = header.registry.keys.get(str(pred.get("target")))
    if registered is not None:
        header.keys[registered.keyid] = BundleKey(
            registered.public_key, registered.purpose, registered.registered_index,
            registered.revoked_index)
    return index, kind, digest


#: The predicate field holding the record ID, by kind.
_REF_FIELD = {"envelope": "request_id", "verdict": "verdict_id", "dispute_event": "event_id",
              "admin_event": "event_id", "erasure": "erasure_id", "matrix_run": "run_id"}


def _payload_ref(kind: str, payload: Any) -> str | None:
    """The record ID a signed payload carries (what the log entry's ``ref`` must equal)."""
    pred = payload.get("predicate") if isinstance(payload, dict) else None
    if not isinstance(pred, dict):
        return None
    value = pred.get(_REF_FIELD[kind])
    return value if isinstance(value, str) else None


class ProvenNodes:
    """Inclusion proofs of many records against one (size, root), checked with what the
    earlier ones proved: the subtree hashes computed on a verified path, each with the
    proof items (base64, as the bundle spells them) that led from it to the root.

    A bundle's records are in index order, so neighbours share all but the lowest few
    hashes of their paths. A record's path is hashed from its leaf up only until it meets
    a subtree hash already proven to lead to the root; the rest of its items must be the
    ones that proved it (compared as strings, not decoded). Anything else (a different
    hash there, an unfamiliar item, a wrong length, an index outside the tree) falls back
    to :func:`verify_inclusion` on the whole decoded proof, so what is accepted and the
    errors raised are exactly those of checking every proof on its own."""

    LIMIT = 4096  # remembered subtree hashes (a few paths suffice in index order); then afresh

    def __init__(self, size: int, root: bytes) -> None:
        self.size, self.root = size, root
        #: the root's level: the tree's leaves span 2**top >= size
        self.top = (size - 1).bit_length() if size > 0 else 0
        #: by level j, the node over leaves (i << j) .. min((i + 1) << j, size) - 1, by i:
        #: its hash and the proof items from it to the root
        self.levels: list[dict[int, tuple[bytes, list[Any]]]] = [
            {} for _ in range(self.top + 1)]
        self.count = 0

    def check(self, leaf: bytes, index: int, items: list[Any]) -> None:
        if (isinstance(index, int) and not isinstance(index, bool) and 0 <= index < self.size
                and self._walk(leaf, index, items)):
            return
        proof = [_b64(h, "inclusion_proof item") for h in items]
        verify_inclusion(leaf, index, self.size, proof, self.root)
        self._walk(leaf, index, items, proof)  # remember the path it proved

    def _walk(self, leaf: bytes, index: int, items: list[Any],
              proof: list[bytes] | None = None) -> bool:
        """Hash up from ``leaf`` (RFC 9162's tree, bottom up: a node with no right
        neighbour inside the tree is carried up unchanged) until a proven node or the
        root; True, remembering the new nodes, when that proves the record. With
        ``proof`` (already verified) it only remembers."""
        size, levels = self.size, self.levels
        new: list[tuple[int, bytes, int]] = []  # (level, hash, items used) of each node made
        h, k, j = leaf, 0, 0
        while j < self.top:
            i = index >> j
            if k:
                known = levels[j].get(i)
                if known is not None:
                    if proof is None and (known[0] != h or items[k:] != known[1]):
                        return False
                    break
            if i & 1 or (i + 1) << j < size:  # a sibling on the left, or on the right
                if k >= len(items):
                    return False
                if proof is not None:
                    sibling = proof[k]
                else:
                    item = items[k]
                    if not isinstance(item, str) or len(item) != 44:
                        return False
                    try:
                        sibling = binascii.a2b_base64(item.encode("ascii"), strict_mode=True)
                    except (binascii.Error, ValueError):
                        return False
                    if len(sibling) != HASH_SIZE:
                        return False
                if i & 1:
                    h = _sha256(NODE_PREFIX + sibling + h).digest()
                else:
                    h = _sha256(NODE_PREFIX + h + sibling).digest()
                k += 1
                new.append((j + 1, h, k))
            j += 1
        else:  # at the root
            if proof is None and (h != self.root or k != len(items)):
                return False
        self.count += len(new)
        if self.count > self.LIMIT:
            for level in levels:
                level.clear()
            self.count = len(new)
        for up, node, at in new:
            levels[up][index >> up] = (node, items[at:])
        return True


_PROVEN: dict[tuple[int, bytes], ProvenNodes] = {}


def proven_nodes(size: int, root: bytes) -> ProvenNodes:
    """This process's :class:`ProvenNodes` for the tree (size, root)."""
    found = _PROVEN.get((size, root))
    if found is None:
        _PROVEN.clear()
        found = _PROVEN[(size, root)] = ProvenNodes(size, root)
    return found


#: What a chunk of record lines gives, in bundle order: (log index, kind, line number, v3
#: digest or None in v2) of each line verified, and the refusal of the line after them
#: if one was refused (its chunk stops there): taken in order, the lines before a refused
#: one are counted (a repeated index among them is the first fault) before it is raised.
ChunkResult = tuple[list[tuple[int, str, int, bytes | None]], BundleError | None]
#: Record lines per unit of parallel work, and the most bytes one unit holds (a mapped
#: file is cut by bytes only: a range of it holds at least CHUNK_BYTES, to a newline).
CHUNK_LINES = 2_000
CHUNK_BYTES = 4 * 1024 * 1024
#: Units of work in flight per worker process (what bounds memory with --processes N).
IN_FLIGHT_PER_PROCESS = 2
#: The most bytes one line may hold: a longer one is refused, not buffered (a record is
#: an envelope of at most ``max_envelope_bytes``, 4 MB by default, and its proof).
MAX_LINE_BYTES = 1024 * 1024 * 1024
#: A slot holds a chunk of up to CHUNK_BYTES and the line that crossed it (up to this
#: many bytes more; a larger chunk is pickled to its worker instead).
SLOT_SLACK = 1024 * 1024
#: What ``bytes.isspace`` counts as space (a line of nothing else is an empty line).
_SPACE = frozenset(b" \t\n\r\x0b\x0c")


def verify_chunk(args: tuple[BundleHeader, Iterable[tuple[int, bytes]]]) -> ChunkResult:
    """Verify record lines against an opened header (a unit of parallel work), up to the
    first one refused (see :data:`ChunkResult`)."""
    header, lines = args
    out: list[tuple[int, str, int, bytes | None]] = []
    try:
        for n, line in lines:
            index, kind, digest = verify_record(line, n, header)
            out.append((index, kind, n, digest))
    except BundleError as exc:
        return out, exc
    return out, None


_WORKER_HEADER: BundleHeader | None = None


def _init_worker(header: BundleHeader, slots: Slots | None = None,
                 mapping: mmap.mmap | None = None) -> None:
    """Process-pool initializer: the opened header travels once per worker, not per chunk."""
    global _WORKER_HEADER, _WORKER_SLOTS, _WORKER_MAPPING
    _WORKER_HEADER = header
    _WORKER_SLOTS = slots
    _WORKER_MAPPING = mapping


def _verify_in_worker(lines: list[tuple[int, bytes]]) -> ChunkResult:
    assert _WORKER_HEADER is not None, "worker not initialised"
    return verify_chunk((_WORKER_HEADER, lines))


class Slots:
    """Chunks of record lines handed to forked worker processes through memory they share
    (an anonymous shared mapping made before the fork), not pickled through a pipe: the
    main process copies each line once into a slot and sends its offsets; a worker reads
    the lines in place. One slot per chunk in flight: a slot is written again only after
    the result of the chunk it held was taken, so a worker never reads a slot being
    overwritten. A chunk larger than a slot travels pickled, as without slots. (A v3
    bundle file needs none of this: see :func:`verify_file`.)"""

    def __init__(self, count: int, size: int) -> None:
        self.count, self.size = count, size
        self.memory = mmap.mmap(-1, count * size)
        self.next = 0

    def put(self, lines: list[tuple[int, bytes]]) -> tuple[int, int, bytes] | None:
        """Copy ``lines`` (consecutive line numbers) into the next slot; (slot, first line
        number, the end offset of every line) or None when they do not fit."""
        total = sum(len(line) for _, line in lines)
        if total > self.size:
            return None
        slot, self.next = self.next, (self.next + 1) % self.count
        base = pos = slot * self.size
        memory, ends = self.memory, array("Q")
        for _, line in lines:
            end = pos + len(line)
            memory[pos:end] = line
            ends.append(end - base)
            pos = end
        return slot, lines[0][0], ends.tobytes()

    def close(self) -> None:
        self.memory.close()


_WORKER_SLOTS: Slots | None = None
_WORKER_MAPPING: mmap.mmap | None = None


def _verify_slot(slot: int, first: int, ends: bytes) -> ChunkResult:
    """A chunk put in a slot by :meth:`Slots.put`, verified where it lies."""
    assert _WORKER_HEADER is not None and _WORKER_SLOTS is not None, "worker not initialised"
    view = memoryview(_WORKER_SLOTS.memory)[slot * _WORKER_SLOTS.size:
                                            (slot + 1) * _WORKER_SLOTS.size]
    try:
        lines: list[tuple[int, Any]] = []
        start = 0
        for i, end in enumerate(array("Q", ends)):
            lines.append((first + i, view[start:end]))
            start = end
        return verify_chunk((_WORKER_HEADER, lines))
    finally:
        lines.clear()
        view.release()


#: What a range of a mapped bundle file gives (:func:`verify_range`): the number of record
#: lines verified, their log indices (``array("q")`` bytes: an index that verifies is
#: inside a tree of at most 2**63 - 1 leaves), the count of each kind among them, their
#: v3 digests (32 bytes each, in order) and, if the range stopped at a line it refused,
#: why ("long", "empty" or "record") and where that line lies (start, end offsets).
RangeResult = tuple[int, bytes, dict[str, int], bytes, tuple[str, int, int] | None]


def verify_range(header: BundleHeader, mapping: mmap.mmap, start: int, stop: int
                 ) -> RangeResult:
    """Verify the record lines of a mapped v3 bundle file from offset ``start`` (a line's
    start) to ``stop`` (just after a newline, or the end of the file), finding where each
    ends here: the checks the main process made of every line before verifying it (the
    length limit, an empty line) and :func:`verify_record`, up to the first line refused.
    Their line numbers are not known here (they depend on the ranges before); the main
    process numbers the lines as it takes the results in order, and names a refused line
    by verifying it again with its number (:meth:`_InOrder.take_range`), so the message
    is the one the line gives wherever it is verified. Each line is copied out of the
    mapping once: every check of a line reads the same bytes."""
    find = mapping.find
    indices, digests = array("q"), bytearray()
    kinds: dict[str, int] = {}
    pos, limit = start, MAX_LINE_BYTES + 1
    while pos < stop:
        end = find(b"\n", pos, min(pos + limit, stop))
        if end < 0:
            return len(indices), indices.tobytes(), kinds, bytes(digests), ("long", pos, stop)
        if end == pos or (mapping[pos] in _SPACE and mapping[pos:end].isspace()):
            return len(indices), indices.tobytes(), kinds, bytes(digests), ("empty", pos, end)
        try:
            index, kind, digest = verify_record(mapping[pos:end], 0, header)
        except BundleError:
            return len(indices), indices.tobytes(), kinds, bytes(digests), ("record", pos,
                                                                            end)
        assert digest is not None, "a mapped bundle is v3"
        indices.append(index)
        kinds[kind] = kinds.get(kind, 0) + 1
        digests += digest
        pos = end + 1
    return len(indices), indices.tobytes(), kinds, bytes(digests), None


def _verify_range_in_worker(start: int, stop: int) -> RangeResult:
    """In a worker: :func:`verify_range` of the bundle file the main process mapped before
    the fork, read from the mapping (the page cache) where it lies; then this process's
    mapping of those pages is let go, so that its RSS does not grow with the file."""
    assert _WORKER_HEADER is not None and _WORKER_MAPPING is not None, \
        "worker not initialised"
    try:
        return verify_range(_WORKER_HEADER, _WORKER_MAPPING, start, stop)
    finally:
        _release_pages(_WORKER_MAPPING, start, stop - 1, FAULT_AROUND)


#: How far around a faulting page Linux maps neighbouring cached pages of a file
#: (``fault_around_bytes``, 64 KiB by default): a worker's chunk maps pages of the chunks
#: beside it, which other workers verify, so a worker releases that far beyond its own.
FAULT_AROUND = 64 * 1024


def _release_pages(mapping: mmap.mmap, start: int, end: int, margin: int = 0) -> None:
    """Unmap from this process the file's pages from the one holding ``start - margin``
    to the one holding ``end + margin`` (``MADV_DONTNEED``: the kernel keeps them in its
    page cache, and a later read maps them again; another process's mapping of them is
    its own). Mapped file pages count in a process's RSS: without this, verifying a 28 GB
    bundle would show 28 GB resident."""
    start, end = max(start - margin, 0), min(end + margin, len(mapping) - 1)
    lo = start - start % mmap.PAGESIZE
    if end >= lo:
        mapping.madvise(mmap.MADV_DONTNEED, lo, end + 1 - lo)


class IndexSet:
    """The log indices seen so far, as a bitmap in pages of :attr:`PAGE` indices made as
    they are first touched: an export (its indices are dense, ascending within each kind)
    costs at most tree size / 8 bytes here, 125 KB for a million-entry log, not a Python
    int per record; a sparse selection costs one 512-byte page per 4,096 indices it
    touches. A negative index (refused by its inclusion proof before it gets here) falls
    back to a set."""

    PAGE = 4096

    def __init__(self) -> None:
        self.pages: dict[int, bytearray] = {}
        self.other: set[int] = set()

    def __contains__(self, index: object) -> bool:
        if isinstance(index, int) and index >= 0:
            page = self.pages.get(index // self.PAGE)
            bit = index % self.PAGE
            return page is not None and bool(page[bit >> 3] & (1 << (bit & 7)))
        return index in self.other

    def add(self, index: int) -> None:
        if index < 0:
            self.other.add(index)
            return
        page = self.pages.get(index // self.PAGE)
        if page is None:
            page = self.pages[index // self.PAGE] = bytearray(self.PAGE // 8)
        bit = index % self.PAGE
        page[bit >> 3] |= 1 << (bit & 7)

    def add_new(self, index: int) -> bool:
        """:meth:`add`; False (and nothing changed) when ``index`` was there already: the
        test and the insertion of :func:`add_record` in one lookup."""
        if index < 0:
            if index in self.other:
                return False
            self.other.add(index)
            return True
        page = self.pages.get(index // self.PAGE)
        if page is None:
            page = self.pages[index // self.PAGE] = bytearray(self.PAGE // 8)
        bit = index % self.PAGE
        mask, at = 1 << (bit & 7), bit >> 3
        if page[at] & mask:
            return False
        page[at] |= mask
        return True


class _InOrder:
    """The record lines after the header, verified in chunks (in this process with
    ``processes`` 1, else in a pool of worker processes with at most
    :data:`IN_FLIGHT_PER_PROCESS` chunks per worker queued) and taken in bundle order:
    each record counted, its index checked for repeats and its v3 digest folded into the
    manifest's. Taking results in order is what makes the first bad line reported the
    same whatever ``processes`` and the chunk size are."""

    def __init__(self, header: BundleHeader, on_records: Callable[[int], None] | None,
                 processes: int, chunk_bytes: int, mapping: mmap.mmap | None = None) -> None:
        self.header, self.on_records = header, on_records
        self.processes, self.chunk_bytes, self.mapping = processes, chunk_bytes, mapping
        self.summary = start_summary(header)
        self.seen = IndexSet()
        self.digest = hashlib.sha256()
        self.pool: Any = None
        self.slots: Slots | None = None
        self.in_flight: deque[tuple[Any, Callable[[Any], None]]] = deque()
        self.next_line = 2  # the number of the next line a range result starts at
        self.in_order = False  # set while a queued chunk's result is taken
        self.frozen = False

    def take(self, res: ChunkResult) -> None:
        """:func:`add_record` of each result in order, and its digest folded in (written
        out here: this process does it for every record while the workers verify); then
        the chunk's refusal, if it has one."""
        done, refused = res
        summary, add_new, digest = self.summary, self.seen.add_new, self.digest
        by_kind = summary.by_kind
        for index, kind, n, line_digest in done:
            if not add_new(index):
                raise BundleError(f"line {n}: log index {index} appears twice")
            summary.records += 1
            by_kind[kind] = by_kind.get(kind, 0) + 1
            if line_digest is not None:
                digest.update(line_digest)
        if self.on_records is not None:
            self.on_records(len(done))
        if refused is not None:
            raise refused

    def take_range(self, res: RangeResult) -> None:
        """:meth:`take` of a range of the mapped file (:func:`verify_range`): its lines
        are numbered from :attr:`next_line` here; a refused line is verified again here
        with its number, for the message it gives (the same check of the same bytes,
        against the same header: it fails the same way)."""
        count, indices, kinds, digests, refused = res
        first, add_new = self.next_line, self.seen.add_new
        for i, index in enumerate(array("q", indices)):
            if not add_new(index):
                raise BundleError(f"line {first + i}: log index {index} appears twice")
        summary = self.summary
        summary.records += count
        for kind, k in kinds.items():
            summary.by_kind[kind] = summary.by_kind.get(kind, 0) + k
        self.digest.update(digests)
        self.next_line = n = first + count
        if self.on_records is not None:
            self.on_records(count)
        if refused is None:
            return
        why, start, end = refused
        if why == "long":
            raise BundleError(f"a line of the bundle is longer than {MAX_LINE_BYTES} bytes")
        if why == "empty":
            raise BundleError(f"line {n}: empty line")
        assert self.mapping is not None, "a range of a mapped file"
        verify_record(self.mapping[start:end], n, self.header)
        # it verified this time: the file changed under the verifier (it must not)
        raise BundleError(f"line {n}: the bundle file changed while it was verified")

    def admin(self, line: bytes, line_no: int) -> None:
        """An admin_event or erasure record, verified here and folded into the header
        (the keys and tombstones of the records after it) before any worker starts."""
        index, kind, line_digest = add_admin_event(line, line_no, self.header)
        add_record(self.summary, self.seen, index, kind, line_no)
        if line_digest is not None:
            self.digest.update(line_digest)

    def take_next(self) -> None:
        self.in_order = True
        future, take = self.in_flight.popleft()
        take(future.result())
        self.in_order = False

    def room(self) -> None:
        """Start the pool if need be, and wait until another chunk may be queued (a slot
        is written again only once the chunk it held was taken)."""
        if self.pool is None:
            # what exists now is never garbage while the workers run: out of the
            # collector's sight, it is not walked by this process's collections nor, after
            # the fork, written to (copied) by the workers'
            gc.freeze()
            self.frozen = True
            self.pool, self.slots = _make_pool(self.processes, self.header,
                                               self.chunk_bytes, self.mapping)
        while len(self.in_flight) >= self.processes * IN_FLIGHT_PER_PROCESS:
            self.take_next()

    def queue(self, fn: Callable[..., ChunkResult], *args: Any) -> None:
        self.in_flight.append((self.pool.submit(fn, *args), self.take))

    def queue_range(self, start: int, stop: int) -> None:
        self.in_flight.append((self.pool.submit(_verify_range_in_worker, start, stop),
                               self.take_range))

    def drain(self) -> None:
        while self.in_flight:
            self.take_next()

    def close(self) -> None:
        if self.pool is not None:
            for fut, _ in self.in_flight:
                fut.cancel()
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.slots is not None:
            self.slots.close()
        if self.frozen:
            gc.unfreeze()

    def result(self) -> BundleSummary:
        finish(self.summary, self.header)
        if self.digest.hexdigest() != self.header.records_sha256:
            raise BundleError("the records are not those the manifest signs (digest "
                              "mismatch)")
        return self.summary


def verify_stream(lines: Iterable[bytes], *, trust: TrustPolicy | None = None,
                  pinned_log_keys: Sequence[NoteVerifier] | None = None,
                  on_records: Callable[[int], None] | None = None,
                  processes: int = 1, chunk: int = CHUNK_LINES,
                  chunk_bytes: int = CHUNK_BYTES) -> BundleSummary:
    """Verify a bundle given its lines (without newlines) one at a time, in memory bounded
    by the chunk sizes and the number of processes, not by the bundle's length.

    The header is opened first; the admin_event records (the key registry) are verified
    in order in this process, since each may change which keys sign the rest; every other
    record line is verified in chunks, in this process (``processes`` 1) or in a pool of
    ``processes`` worker processes with at most :data:`IN_FLIGHT_PER_PROCESS` chunks per
    worker queued. Results are taken in bundle order, so the first bad line reported is
    the same whatever ``processes`` is, and each line's v3 digest (computed where the line
    is verified) goes into the manifest's digest in that order; a v2 bundle's lines are
    hashed whole here as they are read. Each
    record carries its own inclusion proof against the header's checkpoint, so nothing
    about one record needs another."""
    it = iter(lines)
    first_line = next(it, None)
    if first_line is None:
        raise BundleError("the bundle is empty")
    header = read_header(first_line, pinned_log_keys, trust=trust)
    return _verify_lines(header, it, on_records=on_records, processes=processes,
                         chunk=chunk, chunk_bytes=chunk_bytes)


def _verify_lines(header: BundleHeader, it: Iterator[bytes], *,
                  on_records: Callable[[int], None] | None, processes: int, chunk: int,
                  chunk_bytes: int) -> BundleSummary:
    """:func:`verify_stream` after the header: ``it`` yields the record lines."""
    records = _InOrder(header, on_records, processes, chunk_bytes)
    batch: list[tuple[int, bytes]] = []
    batch_bytes = 0
    whole_lines = header.format == FORMAT_V2  # v2: this process hashes every line

    def flush() -> None:
        nonlocal batch, batch_bytes
        if not batch:
            return
        todo, batch, batch_bytes = batch, [], 0
        if processes <= 1:
            records.take(verify_chunk((header, todo)))
            return
        records.room()
        placed = records.slots.put(todo) if records.slots is not None else None
        if placed is not None:
            records.queue(_verify_slot, *placed)
        else:
            records.queue(_verify_in_worker, todo)

    admin_phase, admins = True, 0
    try:
        for n, line in enumerate(it, start=2):
            if not line or line.isspace():  # what ``not line.strip()`` says, without a copy
                raise BundleError(f"line {n}: empty line")
            if whole_lines:
                records.digest.update(line)
                records.digest.update(b"\n")
            if admin_phase:
                if is_admin_event(line):
                    records.admin(line, n)
                    admins += 1
                    continue
                admin_phase = False
                if on_records is not None and admins:
                    on_records(admins)
            batch.append((n, line))
            batch_bytes += len(line)
            if len(batch) >= chunk or batch_bytes >= chunk_bytes:
                flush()
        if admin_phase and on_records is not None and admins:
            on_records(admins)
        flush()
        records.drain()
    except BundleError:
        # A line this process refused (while reading) comes after every line queued or
        # batched before it: their failures are reported first, so the first fault in
        # bundle order is the one named, whatever the processes and the chunk size.
        if not records.in_order:
            records.drain()
            records.take(verify_chunk((header, batch)))
        raise
    finally:
        records.close()
    return records.result()


def _verify_mapping(header: BundleHeader, mapping: mmap.mmap, pos: int, *,
                    on_records: Callable[[int], None] | None, processes: int,
                    chunk_bytes: int) -> BundleSummary:
    """:func:`_verify_lines` for a v3 bundle file mapped into memory, its record lines
    from offset ``pos``: the same checks, order and messages. This process verifies the
    admin events (line by line, as they come first) and then only cuts the rest into
    ranges of at least ``chunk_bytes`` ending at a newline; whoever verifies a range
    finds its lines (:func:`verify_range`), and a worker reads them from the mapping it
    inherited. This process reads only the bytes around each cut: finding every line's
    end here (touching every page of the file) was most of its work, which on two cores
    the workers lacked. Each process lets go of the pages behind it
    (:func:`_release_pages`)."""
    records = _InOrder(header, on_records, processes, chunk_bytes, mapping)
    size, find = len(mapping), mapping.find
    n, admins = 2, 0
    released = 0  # this process's pages before this offset were let go
    try:
        while pos < size:  # the admin events and erasures, before any other record
            end = find(b"\n", pos, pos + MAX_LINE_BYTES + 1)
            if end < 0:
                raise BundleError(f"a line of the bundle is longer than {MAX_LINE_BYTES} "
                                  "bytes")
            if end == pos or (mapping[pos] in _SPACE and mapping[pos:end].isspace()):
                raise BundleError(f"line {n}: empty line")
            line = mapping[pos:end]
            if not is_admin_event(line):
                break
            records.admin(line, n)
            admins += 1
            pos, n = end + 1, n + 1
        if on_records is not None and admins:
            on_records(admins)
        records.next_line = n
        while pos < size:
            # the first newline at least chunk_bytes on; none within MAX_LINE_BYTES of
            # there: the line across it is too long, which verify_range reports in order
            cut = pos + chunk_bytes - 1
            stop = find(b"\n", cut, cut + MAX_LINE_BYTES + 1) + 1 or size
            if processes <= 1:
                records.take_range(verify_range(header, mapping, pos, stop))
            else:
                records.room()
                records.queue_range(pos, stop)
            pos = stop
            if pos - released >= chunk_bytes:
                _release_pages(mapping, released, pos - 1)
                released = pos - pos % mmap.PAGESIZE
        records.drain()
    finally:
        records.close()
    return records.result()


def _make_pool(processes: int, header: BundleHeader, chunk_bytes: int,
               mapping: mmap.mmap | None = None) -> tuple[Any, Slots | None]:
    """The worker pool, and where fork is available the shared slots its workers inherit
    (one per chunk in flight; a chunk holds up to ``chunk_bytes`` and one more line), or
    the bundle file's ``mapping`` they inherit instead."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    if "fork" not in mp.get_all_start_methods():
        return ProcessPoolExecutor(processes, mp_context=mp.get_context("spawn"),
                                   initializer=_init_worker, initargs=(header,)), None
    slots = None if mapping is not None else Slots(processes * IN_FLIGHT_PER_PROCESS,
                                                   chunk_bytes + SLOT_SLACK)
    # forked, the workers get the initializer's arguments as they are in memory (not
    # pickled): the shared mappings themselves
    return ProcessPoolExecutor(processes, mp_context=mp.get_context("fork"),
                               initializer=_init_worker,
                               initargs=(header, slots, mapping)), slots


def verify_lines(lines: Sequence[bytes], *, trust: TrustPolicy | None = None,
                 pinned_log_keys: Sequence[NoteVerifier] | None = None,
                 on_records: Callable[[int], None] | None = None,
                 processes: int = 1, chunk: int = CHUNK_LINES) -> BundleSummary:
    """Verify a whole bundle given its lines (without newlines); see
    :func:`verify_stream`."""
    return verify_stream(lines, trust=trust, pinned_log_keys=pinned_log_keys,
                         on_records=on_records, processes=processes, chunk=chunk)


def verify_bundle(data: bytes, **kwargs: Any) -> BundleSummary:
    """Verify a bundle's bytes held in memory; see :func:`verify_stream` (``ledger
    verify`` reads the file with :func:`verify_file` instead)."""
    if not data:
        raise BundleError("the bundle is empty")
    if not data.endswith(b"\n"):
        raise BundleError("the bundle does not end with a newline (truncated?)")
    lines = data.split(b"\n")
    lines.pop()
    return verify_lines(lines, **kwargs)


def iter_lines(fh: io.BufferedIOBase, block: int = 1024 * 1024) -> Iterator[bytes]:
    """The lines of a bundle file without their newlines, read in blocks into one buffer
    (no allocation per block, and the unfinished line at a block's end moved to the
    front, not the whole block copied: reading was most of the main process's work in
    parallel verification); the file must end with a newline (checked as the last line
    is reached: see :func:`verify_file`). A line longer than the buffer grows it, up to
    :data:`MAX_LINE_BYTES`."""
    buf = bytearray(block)
    view = memoryview(buf)
    have = 0  # bytes of an unfinished line at the front of the buffer (no newline in them)
    try:
        while True:
            if have == len(buf):
                if have > MAX_LINE_BYTES:
                    raise BundleError(f"a line of the bundle is longer than {MAX_LINE_BYTES} "
                                      "bytes")
                view.release()
                buf.extend(bytes(len(buf)))
                view = memoryview(buf)
            got = fh.readinto(view[have:])
            if not got:
                break
            end = have + got
            start, find = 0, buf.find
            pos = find(b"\n", have, end)
            while pos >= 0:
                yield bytes(view[start:pos])
                start = pos + 1
                pos = find(b"\n", start, end)
            have = end - start
            if start and have:
                view[:have] = view[start:end]  # memmove: the ranges may overlap
            if have > MAX_LINE_BYTES:
                raise BundleError(f"a line of the bundle is longer than {MAX_LINE_BYTES} bytes")
    finally:
        view.release()
    if have:
        raise BundleError("the bundle does not end with a newline (truncated?)")


def verify_file(path: str | os.PathLike[str], **kwargs: Any) -> BundleSummary:
    """Verify a bundle file in constant memory (what ``ledger verify`` does): the same
    checks and messages as :func:`verify_bundle` on the file's bytes. The newline at the
    end is checked before anything else, as :func:`verify_bundle` does.

    Where the file can be mapped and worker processes forked (Linux), a v3 bundle is
    verified from the mapping (:func:`_verify_mapping`: the workers find and read their
    lines in the page cache, nothing is copied through this process, which reads only
    where it cuts the file into ranges; ``chunk`` does not apply); a v2 bundle, whose
    lines this process hashes anyway, and anything else are read as a stream of lines
    (:func:`iter_lines`). A bundle file must not be truncated while it is verified: read
    through a mapping, that kills the verifier (SIGBUS), which fails, never passes."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise BundleError("the bundle is empty")
        fh.seek(size - 1)
        if fh.read(1) != b"\n":
            raise BundleError("the bundle does not end with a newline (truncated?)")
        fh.seek(0)
        mapping = _map(fh)
        if mapping is None:
            return verify_stream(iter_lines(fh), **kwargs)
        with mapping:
            return _verify_mapped_file(fh, mapping, **kwargs)


def _map(fh: io.BufferedReader) -> mmap.mmap | None:
    """The file mapped for reading (sequential access advised), or None where it cannot
    be, or where workers could not inherit the mapping (no fork)."""
    import multiprocessing as mp

    if "fork" not in mp.get_all_start_methods():
        return None
    try:
        mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):  # not a regular file (a pipe, a device)
        return None
    mapping.madvise(mmap.MADV_SEQUENTIAL)
    return mapping


def _verify_mapped_file(fh: io.BufferedReader, mapping: mmap.mmap, *,
                        trust: TrustPolicy | None = None,
                        pinned_log_keys: Sequence[NoteVerifier] | None = None,
                        on_records: Callable[[int], None] | None = None,
                        processes: int = 1, chunk: int = CHUNK_LINES,
                        chunk_bytes: int = CHUNK_BYTES) -> BundleSummary:
    end = mapping.find(b"\n", 0, MAX_LINE_BYTES + 1)
    if end < 0:
        raise BundleError(f"a line of the bundle is longer than {MAX_LINE_BYTES} bytes")
    header = read_header(mapping[:end], pinned_log_keys, trust=trust)
    if header.format != FORMAT:  # v2: every line is hashed here, read as before
        fh.seek(end + 1)
        return _verify_lines(header, iter_lines(fh), on_records=on_records,
                             processes=processes, chunk=chunk, chunk_bytes=chunk_bytes)
    return _verify_mapping(header, mapping, end + 1, on_records=on_records,
                           processes=processes, chunk_bytes=chunk_bytes)


def start_summary(header: BundleHeader) -> BundleSummary:
    return BundleSummary(tree_size=header.checkpoint.size, origin=header.origin,
                         root_hash=header.checkpoint.root_hash.hex(),
                         log_key_source=header.log_key_source, witnesses=header.witnesses,
                         selection=header.manifest.get("selection") or {},
                         created_at=str(header.manifest.get("created_at")))


def add_record(summary: BundleSummary, seen: set[int] | IndexSet, index: int, kind: str,
               line_no: int) -> None:
    if index in seen:
        raise BundleError(f"line {line_no}: log index {index} appears twice")
    seen.add(index)
    summary.records += 1
    summary.by_kind[kind] = summary.by_kind.get(kind, 0) + 1


def finish(summary: BundleSummary, header: BundleHeader) -> None:
    summary.keys = {**{kid: k.purpose for kid, k in header.keys.items()},
                    **{kid: "ledger" for kid in header.service_keys}}
    if summary.records != header.records:
        raise BundleError(f"the header announces {header.records} records, the bundle holds "
                          f"{summary.records}")
