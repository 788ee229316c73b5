"""A whole replay stack in real processes: PostgreSQL, a private redis-server, `ledger
serve` (with the integrator), `ledger beat` and `ledger worker` processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from ledger.core.keys import generate_private_key, private_pem, public_raw
from ledger.core.trust import format_trust_policy
from ledger.db.session import make_engine, session_scope
from ledger.replay.records import Signer
from ledger.services.keys import register_key
from tests.helpers import REPO, component_env, free_port

FAST = {  # timings scaled down for tests; production defaults are in ledger/settings.py
    "LEDGER_INTEGRATE_INTERVAL_MS": "50",
    "LEDGER_WORKER_HEARTBEAT_S": "0.5",
    "LEDGER_WORKER_DEAD_AFTER_S": "3",
    "LEDGER_REPUBLISH_AFTER_S": "4",
    "LEDGER_REPLAY_VISIBILITY_TIMEOUT_S": "20",
    "LEDGER_LOG_NAME": "ledger.test/replay",
}


class RedisServer:
    """A private redis-server (no persistence) that tests may stop and restart."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.dir = directory
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), "--maxmemory-policy", "noeviction"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def queue_length(self, name: str) -> int:
        return int(redis.Redis.from_url(self.url).llen(name))


@dataclass
class Stack:
    db_url: str
    tmp: Path
    redis: RedisServer
    env: dict[str, str]
    keys: dict[str, str] = field(default_factory=dict)
    api_url: str = ""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    producer: Any = None

    def spawn(self, *args: str, env: dict[str, str] | None = None,
              name: str = "proc") -> subprocess.Popen[bytes]:
        log = (self.tmp / f"{name}-{len(self.procs)}.log").open("wb")
        run_env = component_env(list(args), {**self.env, **(env or {})})  # its own login
        proc = subprocess.Popen([sys.executable, "-m", "ledger.cli.main", *args], cwd=REPO,
                                env={**os.environ, **run_env}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def worker(self, key: str, dtype: str = "float32",
               env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return self.spawn("worker", "--models", "tiny-demo", "--dtype", dtype, "--key",
                          str(self.tmp / key), "--loglevel", "WARNING", env=env, name=key)

    def client(self, role: str) -> httpx.Client:
        return httpx.Client(base_url=self.api_url, timeout=30,
                            headers={"Authorization": f"Bearer {self.keys[role]}"})

    def wait_for(self, predicate: Any, timeout: float = 60, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.2)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}"
                         for p in sorted(self.tmp.glob("*.log")))
        raise AssertionError(f"timed out waiting for {what}\n{logs}")

    def dispute(self, request_id: str) -> dict[str, Any]:
        with self.client("reviewer") as c:
            r = c.post("/v1/disputes", json={"request_id": request_id,
                                             "reason": "customer disputes this answer"})
        assert r.status_code == 201, r.text
        return dict(r.json())

    def get_dispute(self, dispute_id: str) -> dict[str, Any]:
        with self.client("reviewer") as c:
            return dict(c.get(f"/v1/disputes/{dispute_id}").json())

    def until_verdict(self, dispute_id: str, timeout: float = 90) -> dict[str, Any]:
        return dict(self.wait_for(
            lambda: (d := self.get_dispute(dispute_id))["state"] == "verdict" and d,
            timeout, f"a verdict on dispute {dispute_id}"))


def kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@contextmanager
def replay_stack(db_url: str, tmp: Path) -> Iterator[Stack]:
    from tests.conftest import provision

    api_keys, _ = provision(db_url)
    keyfiles = {}
    for name in ("log", "service", "worker-a", "worker-a2", "worker-b", "worker-c"):
        key = generate_private_key()
        (tmp / f"{name}.pem").write_bytes(private_pem(key))
        keyfiles[name] = key
    # Keys are registry leaves signed by the service key, and the workers trust only the
    # policy file (log and service key), as in production.
    service = Signer(keyfiles["service"], "ledger", "ledger-service")
    producer = generate_private_key()
    (tmp / "trust.toml").write_text(format_trust_policy(
        FAST["LEDGER_LOG_NAME"], [public_raw(keyfiles["log"])], [public_raw(service.key)]))
    db = make_engine(url=db_url, pool_size=1)
    with session_scope(db) as s:
        service.ensure_registered(s)
        for name in ("worker-a", "worker-a2", "worker-b", "worker-c"):
            register_key(s, public_key=public_raw(keyfiles[name]), purpose="worker", name=name,
                         signer=service)
        register_key(s, public_key=public_raw(producer), purpose="producer",
                     name="stack-gateway", signer=service)
        # the beat may not register keys (only the API's admin paths may): an admin does
        register_key(s, public_key=public_raw(keyfiles["log"]), purpose="log",
                     name=FAST["LEDGER_LOG_NAME"], signer=service)
    db.dispose()
    redis_server = RedisServer(tmp)
    redis_server.start()
    env = {**FAST, "LEDGER_DATABASE_URL": db_url, "LEDGER_BROKER_URL": redis_server.url,
           "LEDGER_LOG_KEY_FILE": str(tmp / "log.pem"),
           "LEDGER_SERVICE_KEY_FILE": str(tmp / "service.pem"),
           "LEDGER_TRUST_POLICY_FILE": str(tmp / "trust.toml")}
    stack = Stack(db_url, tmp, redis_server, env, api_keys, producer=producer)
    port = free_port()
    api = stack.spawn("serve", "--port", str(port), name="api")
    stack.api_url = f"http://127.0.0.1:{port}"
    stack.spawn("beat", "--interval", "0.3", name="beat")
    try:
        stack.wait_for(lambda: _up(stack.api_url), 60, "the API")
        yield stack
    finally:
        for p in stack.procs:
            kill(p)
        redis_server.stop()
        del api


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
