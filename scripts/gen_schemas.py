"""Write the published JSON Schemas from the models (a test checks they are current)."""

from __future__ import annotations

import json
from pathlib import Path

from ledger.core.assertions import assertion_set_json_schema
from ledger.core.envelope import envelope_json_schema
from ledger.core.vendor import vendor_envelope_json_schema

OUT = Path(__file__).resolve().parent.parent / "ledger" / "schemas"


def render() -> dict[str, str]:
    return {"envelope-v1.schema.json": json.dumps(envelope_json_schema(), indent=2) + "\n",
            "envelope-v2.schema.json":
                json.dumps(vendor_envelope_json_schema(), indent=2) + "\n",
            "assertions-v1.schema.json":
                json.dumps(assertion_set_json_schema(), indent=2) + "\n"}


if __name__ == "__main__":
    for name, text in render().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")
