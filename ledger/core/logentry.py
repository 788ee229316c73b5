"""Log entries: the bytes each transparency-log leaf commits to.

Every leaf of the log is a small canonical JSON object that names a stored DSSE envelope
by its SHA-256, so the log can be published (tiles, entry bundles) without publishing
prompts, and every entry fits the 65,535-byte limit of a tlog-tiles entry bundle:

    {"dsse_sha256":"<hex>","kind":"envelope","ref":"<request_id>"}

``kind`` is ``envelope``, ``verdict``, ``dispute_event``, ``admin_event`` (a key or
API-key change), ``erasure`` (data keys destroyed) or ``matrix_run`` (a replay matrix
report); ``ref`` names the record (a request ID, a verdict ID, a dispute event ID, an
admin event ID, an erasure ID, a matrix run ID). The leaf hash is
``SHA-256(0x00 || entry)`` (RFC 9162).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Literal

from ledger.core import jsonstrict
from ledger.core.canonical import canonical_json
from ledger.core.errors import FormatError, InclusionProofError
from ledger.core.merkle import leaf_hash, verify_inclusion

EntryKind = Literal["envelope", "verdict", "dispute_event", "admin_event", "erasure",
                    "matrix_run"]
KINDS: frozenset[str] = frozenset({"envelope", "verdict", "dispute_event", "admin_event",
                                   "erasure", "matrix_run"})


_SAFE_REF = re.compile(r"^[A-Za-z0-9._:@+=-]{1,200}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def log_entry_bytes(kind: str, ref: str, dsse_sha256: str) -> bytes:
    """The one function that makes a leaf's entry bytes (RFC 8785 canonical JSON).

    Request IDs and record IDs are restricted to characters JSON never escapes, so the
    common case is written directly (it is on the ingest hot path); anything else goes
    through the general canonicaliser, which gives the same bytes where both apply.
    """
    if kind not in KINDS:
        raise FormatError(f"unknown log entry kind {kind!r}")
    if _SAFE_REF.match(ref) and _HEX64.match(dsse_sha256):
        return f'{{"dsse_sha256":"{dsse_sha256}","kind":"{kind}","ref":"{ref}"}}'.encode()
    return canonical_json({"dsse_sha256": dsse_sha256, "kind": kind, "ref": ref})


def parse_log_entry(entry: bytes) -> tuple[str, str, str]:
    """(kind, ref, dsse_sha256) of an entry; raises FormatError if it is not canonical."""
    obj = jsonstrict.loads(entry, what="log entry", max_depth=2)
    if not isinstance(obj, dict) or set(obj) != {"dsse_sha256", "kind", "ref"}:
        raise FormatError("log entry must hold exactly dsse_sha256, kind and ref")
    kind, ref, digest = obj["kind"], obj["ref"], obj["dsse_sha256"]
    if not all(isinstance(v, str) for v in (kind, ref, digest)):
        raise FormatError("log entry fields must be strings")
    if log_entry_bytes(kind, ref, digest) != entry:
        raise FormatError("log entry is not in canonical form")
    return kind, ref, digest


def dsse_digest(dsse_bytes: bytes | memoryview) -> str:
    return hashlib.sha256(dsse_bytes).hexdigest()


def verify_record_included(kind: str, ref: str, dsse_bytes: bytes, log_index: int,
                           tree_size: int, root_hash: bytes, proof: Sequence[bytes], *,
                           served_entry: bytes | None = None) -> bytes:
    """Check that the record ``kind``/``ref`` with these DSSE bytes is leaf ``log_index``
    of the tree of ``tree_size`` with ``root_hash``: the entry is rebuilt from the record
    (never taken from whoever served it), then its inclusion proof is checked (RFC 9162
    2.1.3.2). ``served_entry``, when given, is the entry a log served for this index; it
    must be the rebuilt one. Returns the entry bytes or raises :class:`FormatError` /
    :class:`InclusionProofError`. The bundle verifier and the replay worker both call it.
    """
    entry = log_entry_bytes(kind, ref, dsse_digest(dsse_bytes))
    if served_entry is not None and served_entry != entry:
        raise InclusionProofError("the log entry does not commit to this record")
    verify_inclusion(leaf_hash(entry), log_index, tree_size, proof, root_hash)
    return entry
