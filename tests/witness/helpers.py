"""Start `ledger witness serve` as its own process, and submit to it over HTTP."""

from __future__ import annotations

import base64
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from ledger.core.cosignature import generate_witness_key
from tests.helpers import free_port, run_ledger


@dataclass
class WitnessProcess:
    base_url: str
    name: str
    vkey: str
    public_key: bytes
    state: Path

    def add(self, old: int, proof: Sequence[bytes], note: bytes) -> httpx.Response:
        body = "".join(f"{line}\n" for line in [f"old {old}",
                                               *(base64.b64encode(h).decode() for h in proof),
                                               ""]).encode() + note
        return httpx.post(self.base_url + "/add-checkpoint", content=body, timeout=30)


def make_witness_key(d: Path, name: str) -> tuple[Path, str]:
    skey, vkey = generate_witness_key(name)
    path = d / f"{name.replace('/', '_')}.key"
    path.write_text(skey + "\n")
    return path, vkey


@contextmanager
def run_witness(d: Path, key_file: Path, vkey: str, log_vkeys: Sequence[str], *,
                state: Path | None = None, port: int | None = None) -> Iterator[WitnessProcess]:
    port = port or free_port()
    state = state or d / "witness-state.json"
    args = ["witness", "serve", "--key-file", str(key_file), "--state", str(state),
            "--port", str(port)]
    for k in log_vkeys:
        args += ["--log-key", k]
    with run_ledger(args, port=port, health_path="/healthz",
                    log_path=d / f"witness-{port}.log") as (base, _):
        name, _, rest = vkey.partition("+")
        raw = base64.b64decode(rest.partition("+")[2])[1:]
        yield WitnessProcess(base, name, vkey, raw, state)
