"""The bundle verifier reads a v3 record line in canonical form without parsing it whole
(:func:`ledger.core.bundle._canonical_record`). Whatever the line, that reading either
declines (None: the line is parsed whole, as before) or gives exactly what the general
path gets from ``orjson.loads`` and ``dsse.envelope_from_obj`` for a line that passes its
canonical-form check: the same index, kind, ref, envelope and proof items, and the DSSE
bytes where the line holds them. Lines are mutated byte by byte and by splicing in the
marks the reading looks for; every unmutated canonical line takes the short way."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.core import dsse
from ledger.core.bundle import (
    PURPOSES_BY_KIND,
    RECORD_FIELDS,
    _canonical_envelope,
    _canonical_record,
    record_prefix,
    record_suffix,
)
from ledger.core.errors import LedgerError
from ledger.core.keys import generate_private_key

KEY = generate_private_key()
REFS = ["req-1", "r", 'a"b', "a\\b", "é€", "tab\there", "x" * 40, ""]
INDICES = [0, 7, 10, 123456, 10**10, 10**11, 10**12, -1]


def _line(index: int, kind: str, ref: str, n_items: int, payload: bytes | None = None,
          signatures: int = 1) -> bytes:
    body = payload if payload is not None else orjson.dumps(
        {"predicate": {"request_id": ref}, "n": index})
    env = dsse.sign_envelope(body, [KEY] + [generate_private_key()
                                            for _ in range(signatures - 1)])
    items = [base64.b64encode(hashlib.sha256(b"%d" % i).digest()).decode()
             for i in range(n_items)]
    return (record_prefix(index, kind, ref) + env.canonical_bytes()
            + record_suffix(orjson.dumps(items)))


def _short(line: bytes) -> tuple[Any, ...] | None:
    """What the short way reads from ``line``, in :func:`_general`'s terms (the envelope
    made by :func:`_canonical_envelope`)."""
    got = _canonical_record(line)
    if got is None:
        return None
    index, kind, ref, _, _, _, items, dsse_at, dsse_end = got
    return index, kind, ref, _canonical_envelope(line, got), items, dsse_at, dsse_end


def _general(line: bytes) -> tuple[Any, ...] | None:
    """What the general path reads from ``line``, if it gets past the canonical-form
    check (None where it refuses before that, or where the line is not canonical)."""
    try:
        rec = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(rec, dict) or rec.keys() != RECORD_FIELDS:
        return None
    index, kind, ref = rec["log_index"], rec["kind"], rec["ref"]
    if (not isinstance(index, int) or isinstance(index, bool) or not isinstance(ref, str)
            or not isinstance(kind, str) or kind not in PURPOSES_BY_KIND):
        return None
    try:
        env = dsse.envelope_from_obj(rec["dsse"])
    except LedgerError:
        return None
    items = rec["inclusion_proof"]
    if not isinstance(items, list):
        return None
    prefix, canonical = record_prefix(index, kind, ref), env.canonical_bytes()
    if line != prefix + canonical + record_suffix(orjson.dumps(items)):
        return None
    return index, kind, ref, env, items, len(prefix), len(prefix) + len(canonical)


LINES = [_line(i, k, r, n) for i in INDICES for k in ("envelope", "verdict")
         for r in REFS[:4] for n in (0, 1, 3)]
LINES += [_line(5, k, r, 2) for k in PURPOSES_BY_KIND for r in REFS]
LINES += [_line(3, "envelope", "q", 1, signatures=2),
          _line(3, "envelope", "q", 1, payload=b""),
          _line(3, "envelope", "q", 1, payload=b"\x00\xff" * 50)]
MARKS = [b'{"log_index":', b',"kind":"', b'","ref":', b',"dsse":{"payload":"',
         b'","payloadType":"', b'","signatures":[{"keyid":"', b'","sig":"', b'"}]}',
         b',"inclusion_proof":', b"}", b"]", b'"', b"\\", b"\\u0041", b"0", b"-", b"=",
         b"+", b"/", b" ", b"\n", b"\x00", b"\xc3\xa9", b"\xff", b"a" * 64, b"A", b"1e3",
         b"1.0", b"null", b"[]", b'["x"]', b"{}"]
#: where the reading's decisions are made: the start and end of every mark in a line
BOUNDARY_MARKS = [*MARKS[:9], b'"', b":", b","]
OPS = st.tuples(st.sampled_from(["replace", "insert", "delete"]),
                st.one_of(st.floats(0, 1, allow_nan=False),
                          st.tuples(st.integers(0, 200), st.integers(-2, 2))),
                st.sampled_from(MARKS))


def _boundaries(line: bytes) -> list[int]:
    out = set()
    for mark in BOUNDARY_MARKS:
        at = line.find(mark)
        while at >= 0:
            out.update((at, at + len(mark)))
            at = line.find(mark, at + 1)
    return sorted(out)


def _apply(line: bytes, ops: list[tuple[str, Any, bytes]]) -> bytes:
    for op, where, piece in ops:
        if isinstance(where, float):
            at = int(where * len(line))
        else:  # next to the n-th boundary
            bounds = _boundaries(line) or [0]
            at = min(max(bounds[where[0] % len(bounds)] + where[1], 0), len(line))
        if op == "replace":
            line = line[:at] + piece + line[at + len(piece):]
        elif op == "insert":
            line = line[:at] + piece + line[at:]
        else:
            line = line[:at] + line[at + len(piece):]
    return line


def test_every_canonical_line_with_one_signature_takes_the_short_way() -> None:
    for line in LINES:
        expected = _general(line)
        assert expected is not None
        short = _short(line)
        short_way = (expected[0] >= 0 and expected[0] < 10**11
                     and len(expected[3].signatures) == 1)
        assert (short is not None) == short_way, line[:200]
        if short is not None:
            assert short == expected


def test_the_dsse_end_mark_inside_the_proof_items_is_not_taken_for_the_dsse_end() -> None:
    """The short way finds the DSSE's end at the last ``"}]},"inclusion_proof":`` of the
    line and the payload's end at a fixed distance before it. Proof items that spell that
    mark (a list holding an object with an ``inclusion_proof`` key) or the whole DSSE tail
    are canonical lines the general path reads; the short way declines them (or, were it
    to read them, would have to read what parsing reads)."""
    line = _line(7, "envelope", "req-1", 2)
    head = line.split(b',"inclusion_proof":')[0]
    tail = line[len(head) - 92 - len(b'","sig":"') - 64:len(head)].decode()
    for items in ([{"k": {"a": [{"b": "c"}]}, "inclusion_proof": 1}],
                  [{"a": {"b": [{"c": "d"}]}, "inclusion_proof": {
                      "e": {"f": [{"g": "h"}]}, "inclusion_proof": 0}}],
                  [{"k": {"s": [{"t": "u" + tail[:-4]}]}, "inclusion_proof": []}],
                  ["AAAA", {"k": {"s": [{"r": "A" * 88}]}, "inclusion_proof": "A"}]):
        weird = head + record_suffix(orjson.dumps(items))
        expected = _general(weird)
        assert expected is not None and b'"}]},"inclusion_proof":' in weird[len(head) + 1:]
        short = _short(weird)
        assert short is None or short == expected


@settings(max_examples=4000, deadline=None)
@given(line=st.sampled_from(LINES), ops=st.lists(OPS, min_size=1, max_size=3))
def test_the_short_way_reads_what_parsing_reads_or_declines(
        line: bytes, ops: list[tuple[str, Any, bytes]]) -> None:
    mutated = _apply(line, ops)
    short = _short(mutated)
    if short is not None:
        assert short == _general(mutated)


def _respelled(line: bytes, old: bytes, new: bytes) -> bytes:
    assert old in line
    return line.replace(old, new, 1)


def test_lines_that_parse_alike_but_are_spelled_otherwise_are_declined() -> None:
    """Each parses to the same record as the canonical line (or is refused by parsing),
    so only the canonical-form check of the general path tells them apart."""
    line = _line(7, "envelope", "req-1", 2)
    head, tail = line.split(b',"dsse":', 1)
    variants = [
        _respelled(line, b'"ref":"req-1"', b'"ref":"req\\u002d1"'),    # an escape
        _respelled(line, b'"ref":"req-1"', b'"ref": "req-1"'),         # a space
        _respelled(line, b'"log_index":7', b'"log_index":07'),         # a leading zero
        _respelled(line, b'"log_index":7', b'"log_index":7.0'),
        _respelled(line, b'"inclusion_proof":["', b'"inclusion_proof":[ "'),
        _respelled(line, b'"inclusion_proof":["', b'"inclusion_proof":["\\u0041'),
        _respelled(line, b'=","', b'=", "'),
        line[:-1] + b' }',
        line[:-1] + b'x',
        line + b' ',
        line[:-1] + b',"extra":1}',
        head + b',"dsse": ' + tail,
        _respelled(line, b'"sig":"', b'"sig":"\\u0041'),
        _respelled(line, b'"payload":"', b'"payload":"\\/'),
        _respelled(line, b'"log_index":7', b'"log_index":%d' % (2**64 + 1)),  # past 64 bits
    ]
    # nested deeper than orjson writes (254 levels) but not than it reads: the general
    # path's error, not a TypeError out of the short way
    deep = line.split(b',"inclusion_proof":')[0] + b',"inclusion_proof":' + \
        b"[" * 300 + b"]" * 300 + b"}"
    assert _canonical_record(deep) is None
    for variant in variants:
        assert _general(variant) is None
        assert _canonical_record(variant) is None, variant[:120]
