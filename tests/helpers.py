"""Test helpers: envelopes built the way a gateway builds them, a live API server."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ledger.producer import build_statement, envelope_to_json, sign_statement

REPO = Path(__file__).resolve().parent.parent
MODEL_SHA = "ab" * 32

RUNTIME = {
    "engine": "reference", "engine_version": "0.1.0", "device": "cpu", "dtype": "float32",
    "batch_invariant": True, "torch_version": "2.13.0", "cpu_isa": "AVX2", "cpu_threads": 2,
    "hostname": "test-node",
}


def statement(request_id: str | None = None, *, prompt_len: int = 8, output_len: int = 4,
              runtime: dict[str, Any] | None = None, model_sha256: str = MODEL_SHA,
              channel: str = "deterministic", **predicate_overrides: Any) -> dict[str, Any]:
    rid = request_id or f"req-{secrets.token_hex(8)}"
    out_ids = [(7 * i + 3) % 259 for i in range(output_len)]
    st = build_statement(
        request_id=rid,
        artifacts={"model_sha256": model_sha256, "tokenizer_sha256": None,
                   "chat_template_sha256": None, "model_name": "tiny-demo"},
        prompt_token_ids=[(5 * i + 1) % 259 for i in range(prompt_len)],
        sampling={"temperature": 0.0, "max_tokens": max(output_len, 1), "seed": 1234,
                  "logprobs": 0},
        runtime=runtime or RUNTIME,
        output={"token_ids": out_ids, "finish_reason": "length",
                "logprobs": [-0.5 - i / 1024 for i in range(output_len)],
                "logits_sha256": [secrets.token_hex(32) for _ in range(output_len)]},
        channel=channel,
    )
    st["predicate"].update(predicate_overrides)
    return st


def signed(st: dict[str, Any], key: Ed25519PrivateKey) -> dict[str, Any]:
    return envelope_to_json(sign_statement(st, key))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ApiServer:
    base_url: str
    process: subprocess.Popen[bytes]
    keys: dict[str, str] = field(default_factory=dict)     # role -> API key
    log_path: Path | None = None

    def client(self, role: str | None = None, **kw: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.keys[role]}"} if role else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=30, **kw)


@contextmanager
def run_ledger(args: list[str], *, port: int, health_path: str, log_path: Path,
               env: dict[str, str] | None = None,
               timeout: float = 60.0) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start ``python -m ledger.cli.main ARGS``, wait until ``GET health_path`` answers 200,
    yield (base URL, process); stop it (terminate, then kill) on the way out."""
    log = log_path.open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "ledger.cli.main", *args],
                            env={**os.environ, **(env or {})}, stdout=log,
                            stderr=subprocess.STDOUT, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{args[0]} exited: {log_path.read_text()[-3000:]}")
            try:
                if httpx.get(base + health_path, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{args[0]} did not start: {log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        yield base, proc
    finally:
        stop_process(proc)
        log.close()


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def run_server(db_url: str, *, workers: int = 1, extra_env: dict[str, str] | None = None,
               log_dir: Path | None = None) -> Iterator[ApiServer]:
    """`ledger serve` on a free port against ``db_url``."""
    port = free_port()
    log_path = (log_dir or Path("/tmp")) / f"ledger-serve-{port}.log"
    with run_ledger(["serve", "--port", str(port), "--workers", str(workers)], port=port,
                    health_path="/healthz", log_path=log_path,
                    env={"LEDGER_DATABASE_URL": db_url, **(extra_env or {})}) as (base, proc):
        yield ApiServer(base, proc, log_path=log_path)
