"""OpenAPI links between operations (what a client, or a stateful test, may call next with
values from a response). Applied to the generated schema in ``create_app``."""

from __future__ import annotations

from typing import Any


def add_links(schema: dict[str, Any]) -> dict[str, Any]:
    return schema
