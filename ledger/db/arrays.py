"""Array parameters of one fixed PostgreSQL type, sent in binary.

psycopg adapts a plain ``list`` by looking at its elements at every ``execute`` (their
Python types, the largest integer) to choose the array type, and in text format quotes
every element that needs it (a JSON text: each double quote escaped by a regular
expression, ~0.1 ms for a runtime). The sequencing statement sends some twenty lists, so
that was a fifth of a millisecond per statement on the ingest hot path. The lists here
name their type once: psycopg sends them as binary arrays of it and looks at nothing.

Only for values that cannot fail differently in binary: the elements must already be of
the type (``str`` for text, ``bytes`` for bytea, aware ``datetime`` for timestamptz),
and text must hold no NUL character (text format refuses one in psycopg, binary in the
server: other errors). Lists of integers stay plain lists (their range is PostgreSQL's to
refuse, as before: the envelope's validation keeps them in range), and so does the model
name (text from the payload; its validation refuses a NUL).
"""

from __future__ import annotations

import struct
from datetime import datetime
from typing import Any

import psycopg
from psycopg.abc import Buffer
from psycopg.types.array import ListBinaryDumper

_TEXT, _TEXT_ARRAY = 25, 1009
_BYTEA, _BYTEA_ARRAY = 17, 1001
_TIMESTAMPTZ, _TIMESTAMPTZ_ARRAY = 1184, 1185


class TextArray(list[str]):
    """``text[]``: strings without NUL (hex digests, checked identifiers, our own JSON)."""


class ByteaArray(list[bytes]):
    """``bytea[]``."""


class TimestamptzArray(list[datetime]):
    """``timestamptz[]`` of timezone-aware datetimes."""


_HEAD = struct.Struct("!IIIII")  # ndims, has nulls, element oid; length, lower bound
_LEN = struct.Struct("!i").pack


class _FixedArrayDumper(ListBinaryDumper):
    """A one-dimensional array of non-null elements of ``element_oid``: psycopg's
    ``get_key`` and ``upgrade`` return at once for a dumper with an ``oid``, and
    :meth:`dump` writes PostgreSQL's binary array format (``array_send``) directly."""

    def dump(self, obj: list[Any]) -> Buffer | None:
        element = self.sub_dumper.dump  # type: ignore[union-attr]
        parts: list[Buffer] = [_HEAD.pack(1, 0, self.element_oid, len(obj), 1)]
        for item in obj:
            data = element(item)
            assert data is not None, "no NULLs in a fixed array"
            parts += (_LEN(len(data)), data)
        return b"".join(parts)


def _dumper(name: str, element_oid: int, array_oid: int) -> type[Any]:
    return type(name, (_FixedArrayDumper,), {"oid": array_oid, "element_oid": element_oid})


for _cls, _element, _array in ((TextArray, _TEXT, _TEXT_ARRAY),
                               (ByteaArray, _BYTEA, _BYTEA_ARRAY),
                               (TimestamptzArray, _TIMESTAMPTZ, _TIMESTAMPTZ_ARRAY)):
    psycopg.adapters.register_dumper(_cls, _dumper(f"{_cls.__name__}Dumper", _element,
                                                   _array))
