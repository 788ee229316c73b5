"""``ledger verify`` splits a bundle file into lines with :func:`ledger.core.bundle.iter_lines`:
one buffer read into in blocks, the unfinished line moved to its front, grown for a line
longer than it. Whatever the block size and the line lengths, the lines are exactly
``data.split(b"\\n")`` less the final empty piece, and a file that does not end in a
newline is refused (no line lost, none invented, none cut at a block's edge)."""

from __future__ import annotations

import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.core import bundle
from ledger.core.bundle import BundleError, iter_lines

LINES = st.lists(st.binary(max_size=80).map(lambda b: b.replace(b"\n", b"x")), max_size=30)


@settings(max_examples=400, deadline=None)
@given(lines=LINES, block=st.sampled_from([1, 2, 3, 7, 16, 64, 1024]),
       truncated=st.booleans())
def test_lines_are_the_split_of_the_file(lines: list[bytes], block: int,
                                         truncated: bool) -> None:
    data = b"".join(line + b"\n" for line in lines)
    if truncated and data[:-1] and not data[:-1].endswith(b"\n"):
        data = data[:-1]
        with pytest.raises(BundleError, match="does not end with a newline"):
            list(iter_lines(io.BytesIO(data), block))
        return
    assert list(iter_lines(io.BytesIO(data), block)) == data.split(b"\n")[:-1]


def test_an_unfinished_line_past_the_limit_is_refused_not_buffered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundle, "MAX_LINE_BYTES", 100)
    assert list(iter_lines(io.BytesIO(b"a" * 100 + b"\nb\n"), 16)) == [b"a" * 100, b"b"]
    for block in (16, 4096):  # grown to hold it, or read whole in one block
        with pytest.raises(BundleError, match="longer than 100 bytes"):
            list(iter_lines(io.BytesIO(b"a" * 5000), block))
