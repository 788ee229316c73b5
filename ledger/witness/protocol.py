"""The body of a C2SP tlog-witness ``add-checkpoint`` request, written and read.

Request body::

    old <size>\\n
    <base64 consistency proof hash>\\n      (0 to 63 lines)
    \\n
    <checkpoint note, with its signature lines>

A 409 answer carries ``<size>\\n`` with ``Content-Type: text/x.tlog.size``; a 200 answer is
one or more cosignature lines.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ledger.core.errors import FormatError
from ledger.core.merkle import HASH_SIZE, MAX_TREE_SIZE
from ledger.core.note import MAX_NOTE_SIZE

MAX_PROOF_LINES = 63
MAX_REQUEST_BYTES = MAX_NOTE_SIZE + 8 * 1024
SIZE_CONTENT_TYPE = "text/x.tlog.size"
_SIZE_RE = re.compile(r"0|[1-9][0-9]{0,18}")


class MalformedRequest(FormatError):
    code = "malformed_add_checkpoint"


@dataclass(frozen=True, slots=True)
class AddCheckpoint:
    old_size: int
    proof: tuple[bytes, ...]
    note: bytes


def parse_size(text: str) -> int:
    """A tree size in decimal without leading zeros."""
    if not _SIZE_RE.fullmatch(text) or int(text) > MAX_TREE_SIZE:
        raise MalformedRequest(f"{text[:30]!r} is not a tree size")
    return int(text)


def format_add_checkpoint(old_size: int, proof: Sequence[bytes], note: bytes) -> bytes:
    if len(proof) > MAX_PROOF_LINES:
        raise MalformedRequest(f"at most {MAX_PROOF_LINES} consistency proof lines")
    lines = [f"old {old_size}", *(base64.b64encode(h).decode() for h in proof), ""]
    return "".join(line + "\n" for line in lines).encode() + note


def parse_add_checkpoint(body: bytes) -> AddCheckpoint:
    if len(body) > MAX_REQUEST_BYTES:
        raise MalformedRequest("the request body is too large")
    head, sep, note = body.partition(b"\n\n")
    if not sep:
        raise MalformedRequest("the request needs a blank line before the checkpoint")
    try:
        lines = head.decode("ascii").split("\n")
    except UnicodeDecodeError as exc:
        raise MalformedRequest("the old size and proof lines are ASCII") from exc
    first, proof_lines = lines[0], lines[1:]
    if not first.startswith("old "):
        raise MalformedRequest("the first line is 'old <size>'")
    old_size = parse_size(first[4:])
    if len(proof_lines) > MAX_PROOF_LINES:
        raise MalformedRequest(f"at most {MAX_PROOF_LINES} consistency proof lines")
    proof = []
    for line in proof_lines:
        try:
            h = base64.b64decode(line, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MalformedRequest("a consistency proof line is not base64") from exc
        if len(h) != HASH_SIZE or base64.b64encode(h).decode() != line:
            raise MalformedRequest("a consistency proof line is the base64 of 32 bytes")
        proof.append(h)
    if not note:
        raise MalformedRequest("the request has no checkpoint")
    return AddCheckpoint(old_size, tuple(proof), note)


def parse_cosignature_response(body: bytes) -> list[str]:
    """The signature lines of a 200 answer (each without its newline)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedRequest("the witness answer is not UTF-8") from exc
    if not text.endswith("\n") or len(body) > 64 * 1024:
        raise MalformedRequest("the witness answer is signature lines ending in a newline")
    lines = text[:-1].split("\n")
    if not all(line.startswith("\u2014 ") for line in lines):
        raise MalformedRequest("the witness answer holds only signature lines")
    return lines
