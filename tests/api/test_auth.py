"""The fast paths' API-key parsing (:func:`ledger.api.auth.bearer_key`) answers as the
routes' ``Depends(HTTPBearer)`` + ``_presented`` do, for every way a header can be odd."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from ledger.api.auth import _bearer, _presented, bearer_key
from ledger.errors import Unauthorized

HEADERS: list[list[bytes]] = [
    [],
    [b""],
    [b"Bearer"],
    [b"Bearer "],
    [b"Bearer    "],
    [b"Bearer lk_abc"],
    [b"bearer lk_abc"],
    [b"BEARER lk_abc"],
    [b"Bearer   lk_abc  "],
    [b"Bearer lk_a b"],
    [b"Bearer\tlk_abc"],
    [b" Bearer lk_abc"],
    [b"Basic lk_abc"],
    [b"Bearerlk_abc"],
    [b"Bearer lk_first", b"Bearer lk_second"],
    [b"Basic x", b"Bearer lk_second"],
    [b"Bearer lk_\xe9"],
]


def _request(values: list[bytes]) -> Request:
    headers = [(b"host", b"x")] + [(b"authorization", v) for v in values]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers,
                    "query_string": b""})


async def _answer(fn, request: Request) -> str:  # type: ignore[no-untyped-def]
    try:
        return await fn(request)  # type: ignore[no-any-return]
    except Unauthorized as exc:
        return f"401 {exc.code}: {exc.message}"


async def _routes_way(request: Request) -> str:
    return _presented(await _bearer(request))


@pytest.mark.parametrize("values", HEADERS, ids=[repr(h) for h in HEADERS])
def test_bearer_key_answers_as_the_dependency(values: list[bytes]) -> None:
    fast = asyncio.run(_answer(bearer_key, _request(values)))
    slow = asyncio.run(_answer(_routes_way, _request(values)))
    assert fast == slow


def test_a_key_is_found_and_a_missing_one_refused() -> None:
    assert asyncio.run(bearer_key(_request([b"Bearer  lk_abc "]))) == "lk_abc"
    with pytest.raises(Unauthorized) as info:
        asyncio.run(bearer_key(_request([b"Basic lk_abc"])))
    assert info.value.code == "missing_api_key"
