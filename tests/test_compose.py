"""docker-compose.yml parses, has the services the architecture names, and every command
it runs exists in the `ledger` CLI (Docker itself does not run here)."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from tests.helpers import REPO


def test_compose_file_parses_and_its_commands_exist() -> None:
    doc = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = doc["services"]
    assert {"postgres", "redis", "migrate", "api", "worker", "beat"} <= set(services)
    assert "noeviction" in services["redis"]["command"]
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    assert any(v.endswith(":/models:ro") for v in services["worker"]["volumes"])
    checked = 0
    for name, svc in services.items():
        cmd = svc.get("command")
        if not cmd or cmd[0] != "ledger":
            continue
        # the subcommand path is every leading word that is not an option
        words = []
        for w in cmd[1:]:
            if w.startswith("-"):
                break
            words.append(w)
        proc = subprocess.run([sys.executable, "-m", "ledger.cli.main", *words, "--help"],
                              cwd=REPO, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "COLUMNS": "200"})
        assert proc.returncode == 0, (name, cmd, proc.stderr[-500:])
        options = [w.split("=")[0] for w in cmd[1:] if w.startswith("--")]
        for opt in options:
            assert opt in proc.stdout, (name, opt)
        checked += 1
    assert checked == 4
