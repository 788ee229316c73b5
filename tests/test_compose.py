"""docker-compose.yml parses, has the services the architecture names, every command it
runs exists in the `ledger` CLI, each process logs in as its own component role, and no
service holds a private key it does not sign with (Docker itself does not run here)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from typing import Any

import yaml
from sqlalchemy import make_url

from tests.helpers import REPO

#: who signs with which private key: the beat integrates (log key) and signs routing
#: events on disputes (service key); the API signs dispute events and registry leaves
#: (service key); a worker signs verdicts (worker key).
#: The one-shot migrate signs the registry leaves of the keys it registers (service key).
SIGNS_WITH = {"api": {"service"}, "beat": {"log", "service"}, "worker": {"worker"},
              "migrate": {"service"}}
COMPONENT = {"api": "api", "beat": "beat", "worker": "worker"}


def _doc() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return doc


def _ledger_commands(svc: dict[str, Any]) -> list[list[str]]:
    """The `ledger ...` command lines a service runs (its command, or its sh script)."""
    cmd = svc.get("command")
    if not cmd:
        return []
    if svc.get("entrypoint", [None])[0] == "sh":
        return [shlex.split(line.replace("$$", "$")) for line in cmd[0].splitlines()
                if line.strip().startswith("ledger ")]
    return [cmd] if cmd[0] == "ledger" else []


def test_compose_file_parses_and_its_commands_exist() -> None:
    services = _doc()["services"]
    assert {"postgres", "redis", "migrate", "api", "worker", "beat"} <= set(services)
    assert "noeviction" in services["redis"]["command"]
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    assert any(v.endswith(":/models:ro") for v in services["worker"]["volumes"])
    checked = 0
    for name, svc in services.items():
        for cmd in _ledger_commands(svc):
            # the subcommand path is every leading word that is not an option or a path
            words = []
            for w in cmd[1:]:
                if w.startswith("-") or "/" in w:
                    break
                words.append(w)
            proc = subprocess.run([sys.executable, "-m", "ledger.cli.main", *words, "--help"],
                                  cwd=REPO, capture_output=True, text=True, timeout=60,
                                  env={**os.environ, "COLUMNS": "200"})
            assert proc.returncode == 0, (name, cmd, proc.stderr[-500:])
            for opt in (w.split("=")[0] for w in cmd[1:] if w.startswith("--")):
                assert opt in proc.stdout, (name, opt)
            checked += 1
    assert checked == 10  # serve, beat, worker; upgrade, 3 create-login, 3 keys register


def _env(svc: dict[str, Any]) -> dict[str, str]:
    env = dict(svc.get("environment") or {})
    env.pop("<<", None)
    return {k: str(v) for k, v in env.items()}


def _private_key_mounts(svc: dict[str, Any]) -> set[str]:
    """Names (log, service, worker) of private key files mounted into a service."""
    out = set()
    for volume in svc.get("volumes") or []:
        source = volume.split(":")[0]
        if source.startswith("./keys"):
            assert not source.rstrip("/").endswith("keys"), f"the whole keys folder: {volume}"
            if not source.endswith(".pub"):
                out.add(source.rsplit("/", 1)[1].removesuffix(".pem"))
    return out


def test_each_process_logs_in_as_its_own_component_role() -> None:
    services = _doc()["services"]
    owner = services["postgres"]["environment"]["POSTGRES_USER"]
    logins = {}
    for cmd in _ledger_commands(services["migrate"]):
        if cmd[1:3] == ["db", "create-login"]:
            logins[cmd[cmd.index("--name") + 1]] = cmd[cmd.index("--component") + 1]
    assert sorted(logins.values()) == ["api", "beat", "worker"]
    assert make_url(_env(services["migrate"])["LEDGER_DATABASE_URL"]).username == owner
    users = set()
    for name, component in COMPONENT.items():
        env = _env(services[name])
        user = make_url(env["LEDGER_DATABASE_URL"]).username
        assert user != owner and user != "postgres", name
        assert logins.get(user) == component, (name, user, logins)
        assert env.get("LEDGER_DATABASE_PASSWORD_FILE", "").startswith("/run/secrets/"), name
        assert "LEDGER_DATABASE_ROLE" not in env  # SET ROLE would not drop superuser
        assert "LEDGER_INSECURE_DEV" not in env
        secrets = set(services[name].get("secrets") or [])
        assert secrets == {f"{component}-db-password"}, (name, secrets)
        users.add(user)
    assert len(users) == 3


def test_no_service_mounts_a_key_it_does_not_sign_with() -> None:
    services = _doc()["services"]
    for name, svc in services.items():
        mounted = _private_key_mounts(svc)
        assert mounted <= SIGNS_WITH.get(name, set()), (name, mounted)
        env = _env(svc)
        for var, key in (("LEDGER_LOG_KEY_FILE", "log"), ("LEDGER_SERVICE_KEY_FILE", "service"),
                         ("LEDGER_WORKER_KEY_FILE", "worker")):
            if var in env:
                assert key in mounted, (name, var)
                assert any(v.split(":")[1] == env[var] for v in svc["volumes"]), (name, var)
    # exactly one integrator: the beat holds the log key, the API does not integrate
    assert "log" in _private_key_mounts(services["beat"])
    assert _env(services["api"])["LEDGER_INTEGRATE_IN_API"] == "false"
    assert "--key" in services["worker"]["command"]
    assert _private_key_mounts(services["migrate"]) == {"service"}  # registry leaves only
