"""Test helpers: envelopes built the way a gateway builds them, a live API server."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
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


def shared_broker_url(offset: int = 0) -> str:
    """A database of the shared Redis (127.0.0.1:6379) for tests whose jobs nobody consumes:
    one per pytest-xdist worker (15, 13, 11, ... for gw0, gw1, gw2; ``offset`` 1 gives the
    even neighbour), so one worker's ``flushdb`` never empties another's."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    return f"redis://127.0.0.1:6379/{15 - 2 * index - offset}"


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


# --- component logins ------------------------------------------------------------------
# `ledger serve`, `beat` and `worker` refuse to run as a superuser or the schema owner, so
# tests start them the way a deployment does: as a LOGIN user that is a member of one
# component role (migration 0008). Roles are cluster-wide: one login per component serves
# every test database (pg_hba here trusts 127.0.0.1, so no passwords).

TEST_PEPPER = "test-pepper-not-a-secret"  # LEDGER_API_KEY_PEPPER of every test server
TEST_LOGINS = {"api": "ledger_test_api", "beat": "ledger_test_beat",
               "worker": "ledger_test_worker", "auditor": "ledger_test_auditor"}
COMMAND_COMPONENT = {"serve": "api", "beat": "beat", "worker": "worker"}
_logins_made: set[str] = set()


def _driver_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def ensure_test_logins(db_url: str) -> None:
    """Create the test logins once per test session (idempotent, race-tolerant: other test
    sessions on the same server may create them at the same time)."""
    import psycopg
    from psycopg import errors, sql

    from ledger.db.grants import COMPONENT_ROLES

    server = db_url.split("@", 1)[-1].rsplit("/", 1)[0]
    if server in _logins_made:
        return
    with psycopg.connect(_driver_url(db_url), autocommit=True, connect_timeout=5) as conn:
        for component, login in TEST_LOGINS.items():
            group = COMPONENT_ROLES[component]
            member = conn.execute(
                "SELECT pg_has_role(%s, %s, 'MEMBER') FROM pg_roles WHERE rolname = %s",
                (login, group, login)).fetchone()
            if member and member[0]:
                continue
            try:
                if member is None:
                    conn.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                        sql.Identifier(login), sql.Identifier(group)))
                else:
                    conn.execute(sql.SQL("GRANT {} TO {}").format(
                        sql.Identifier(group), sql.Identifier(login)))
            except (errors.DuplicateObject, errors.UniqueViolation):
                pass  # another test session made it meanwhile
    _logins_made.add(server)


def login_url(db_url: str, component: str) -> str:
    """``db_url`` with the test login of ``component`` as its user (made if missing)."""
    from sqlalchemy import make_url

    with contextlib.suppress(Exception):  # an unreachable server: the URL is still right
        ensure_test_logins(db_url)
    return make_url(db_url).set(username=TEST_LOGINS[component], password=None) \
        .render_as_string(hide_password=False)


def component_env(args: list[str], env: dict[str, str] | None) -> dict[str, str]:
    """The environment a test gives ``ledger ARGS``: for serve/beat/worker, the component's
    login instead of the database URL's user, the test pepper, and no in-API integration
    where no log key is given (as before: without a key the API did not integrate)."""
    env = dict(env or {})
    component = COMMAND_COMPONENT.get(args[0]) if args else None
    if component is None or "--insecure-dev" in args:
        return env
    url = env.get("LEDGER_DATABASE_URL") or os.environ.get("LEDGER_DATABASE_URL")
    if url:
        env["LEDGER_DATABASE_URL"] = login_url(url, component)
    if component == "api":
        env.setdefault("LEDGER_API_KEY_PEPPER", TEST_PEPPER)
        if "LEDGER_LOG_KEY_FILE" not in env:
            env.setdefault("LEDGER_INTEGRATE_IN_API", "false")
    return env


@contextmanager
def run_ledger(args: list[str], *, port: int, health_path: str, log_path: Path,
               env: dict[str, str] | None = None, timeout: float = 60.0,
               cwd: Path = REPO) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start ``python -m ledger.cli.main ARGS``, wait until ``GET health_path`` answers 200,
    yield (base URL, process); stop it (terminate, then kill) on the way out. serve, beat
    and worker run as their component's test login (:func:`component_env`). ``cwd``: the
    tree whose ``ledger`` it runs (``python -m`` puts it first on ``sys.path``)."""
    log = log_path.open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "ledger.cli.main", *args],
                            env={**os.environ, **component_env(args, env)}, stdout=log,
                            stderr=subprocess.STDOUT, cwd=cwd)
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
               log_dir: Path | None = None, cwd: Path = REPO) -> Iterator[ApiServer]:
    """`ledger serve` on a free port against ``db_url`` (from the tree ``cwd``)."""
    port = free_port()
    log_path = (log_dir or Path("/tmp")) / f"ledger-serve-{port}.log"
    with run_ledger(["serve", "--port", str(port), "--workers", str(workers)], port=port,
                    health_path="/healthz", log_path=log_path,
                    env={"LEDGER_DATABASE_URL": db_url, **(extra_env or {})},
                    cwd=cwd) as (base, proc):
        yield ApiServer(base, proc, log_path=log_path)


def record_passed_on(app: Any, middleware: type, seen: Callable[[Any], None]) -> Any:
    """The ``middleware`` instance in ``app``'s (started) middleware stack, with what it
    hands on to the app behind it reported to ``seen`` (the HTTP scope) first: a fast
    path's tests tell the requests it answered from those it passed on."""
    node: Any = app.middleware_stack
    while not isinstance(node, middleware):
        node = node.app
    inner = node.app

    async def recording(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen(scope)
        await inner(scope, receive, send)

    node.app = recording
    return node
