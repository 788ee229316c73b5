"""The token lists and logits digests of an envelope are held to the same rules as their
published JSON Schema items (token IDs at least 0 and at most the limit; digests 64
lowercase hex characters), checked a list at a time: every bad item refused, with the
list named, and the schema as published."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ledger.core.envelope import envelope_json_schema, validate_statement
from ledger.core.errors import ValidationFailed
from tests.helpers import statement

BAD = [
    (("prompt_token_ids", 5), -1, "prompt_token_ids holds token ID -1"),
    (("prompt_token_ids", 0), -(2**70), "prompt_token_ids holds token ID"),
    (("output", "token_ids", 3), -2, "output.token_ids holds token ID -2"),
    (("sampling", "stop_token_ids", 0), -7, "sampling.stop_token_ids holds token ID -7"),
    (("output", "logits_sha256", 7), "A" * 64, "output.logits_sha256[7] is not"),
    (("output", "logits_sha256", 0), "a" * 63, "output.logits_sha256[0] is not"),
    (("output", "logits_sha256", 1), "a" * 65, "output.logits_sha256[1] is not"),
    (("output", "logits_sha256", 2), "g" * 64, "output.logits_sha256[2] is not"),
    (("output", "logits_sha256", 3), "a" * 63 + "\n", "output.logits_sha256[3] is not"),
    (("output", "logits_sha256", 4), "\u00e9" * 32, "output.logits_sha256[4] is not"),
    (("output", "logits_sha256", 5), "", "output.logits_sha256[5] is not"),
]


def _with(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    st = statement(prompt_len=32, output_len=8)
    st["predicate"]["sampling"]["stop_token_ids"] = [1, 2]
    obj = copy.deepcopy(st)
    where = obj["predicate"]
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    return obj


@pytest.mark.parametrize("path,value,says", BAD)
def test_a_bad_item_is_refused_naming_its_list(path: tuple[Any, ...], value: Any,
                                               says: str) -> None:
    with pytest.raises(ValidationFailed) as err:
        validate_statement(_with(path, value))
    assert err.value.code == "invalid_envelope"
    assert says in err.value.message


def test_good_lists_pass() -> None:
    validate_statement(_with(("output", "logits_sha256", 0), "0123456789abcdef" * 4))
    validate_statement(_with(("prompt_token_ids", 0), 0))


def test_the_items_are_published_with_their_bounds_and_pattern() -> None:
    defs = envelope_json_schema()["$defs"]
    token = {"description": "a token ID; at most the ledger's max_token_id", "minimum": 0,
             "type": "integer"}
    assert defs["EnvelopePredicate"]["properties"]["prompt_token_ids"]["items"] == token
    assert defs["Output"]["properties"]["token_ids"]["items"] == token
    assert defs["Sampling"]["properties"]["stop_token_ids"]["items"] == token
    digests = defs["Output"]["properties"]["logits_sha256"]["anyOf"][0]["items"]
    assert digests == {"description": "lowercase hex SHA-256", "pattern": "^[0-9a-f]{64}$",
                       "type": "string"}
