"""The subject digest of an envelope's output tokens: SHA-256 of the list written as
``[1,2,3]``, the same bytes whichever way :func:`output_digest` writes them."""

from __future__ import annotations

import hashlib
import random

import pytest

from ledger.core.envelope import output_digest


def _joined(ids: list[int]) -> str:
    return hashlib.sha256(("[" + ",".join(map(str, ids)) + "]").encode()).hexdigest()


class _Id(int):
    def __str__(self) -> str:
        return f"id{int(self)}"


@pytest.mark.parametrize("ids", [
    [], [0], list(range(128)), [random.Random(7).randrange(10**9) for _ in range(2000)],
    [2**63 - 1, 2**63, 2**64 - 1], [2**64, 2**70], [-1, -(2**63), -(2**63) - 1],
    [True, 1, False], [_Id(5), 6],
])
def test_the_digest_is_of_the_list_written_without_spaces(ids: list[int]) -> None:
    assert output_digest(ids) == _joined(ids)


def test_known_value() -> None:
    assert output_digest([1, 2, 3]) == hashlib.sha256(b"[1,2,3]").hexdigest()
