"""The artifact hash rule, the shipped tiny-demo model and its published hash."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ledger.artifacts import artifact_hashes, chat_template_sha256, manifest, model_sha256

#: Published in docs/engine.md (and the README): the tiny-demo model's model_sha256.
TINY_DEMO_SHA256 = "35acb08d7d929f142390e2797fa8b477a665e043113f7b485d0b42ba266caf26"
TINY_DEMO_DIR = Path(__file__).resolve().parents[2] / "workers" / "engine" / "tiny_demo"


def make_tree(root: Path) -> Path:
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / ".hidden_dir").mkdir()
    (root / "config.json").write_text("{}")
    (root / "sub" / "b.bin").write_bytes(bytes(range(256)) * 10)
    (root / "sub" / "deeper" / "Ä.txt").write_text("unicode name")
    (root / "sub" / "B.txt").write_text("upper case sorts first")
    (root / ".gitattributes").write_text("skipped")
    (root / ".hidden_dir" / "x").write_text("skipped")
    (root / "sub" / ".cache").write_text("skipped")
    outside = root.parent / f"{root.name}-blob"
    outside.write_text("reached through a symlink")
    (root / "linked.safetensors").symlink_to(outside)
    return root


def test_manifest_format_and_order(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "m")
    lines = manifest(root).splitlines(keepends=True)
    paths = [line.split("  ", 1)[1].rstrip("\n") for line in lines]
    assert paths == ["config.json", "linked.safetensors", "sub/B.txt", "sub/b.bin",
                     "sub/deeper/Ä.txt"]
    assert lines[0] == hashlib.sha256(b"{}").hexdigest() + "  config.json\n"
    assert model_sha256(root) == hashlib.sha256("".join(lines).encode()).hexdigest()


@pytest.mark.skipif(not (shutil.which("find") and shutil.which("sha256sum")),
                    reason="needs GNU find and sha256sum")
def test_matches_the_documented_shell_pipeline(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "m")
    shell = ("find -L . -type f ! -path '*/.*' -printf '%P\\n' | LC_ALL=C sort "
             "| xargs -d '\\n' sha256sum | sha256sum")
    out = subprocess.run(["bash", "-c", shell], cwd=root, check=True, capture_output=True,
                         text=True).stdout
    assert out.split()[0] == model_sha256(root)


def test_tokenizer_and_chat_template(tmp_path: Path) -> None:
    assert artifact_hashes(tmp_path)["tokenizer_sha256"] is None
    (tmp_path / "tokenizer.json").write_bytes(b'{"model": {}}')
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    hashes = artifact_hashes(tmp_path, model_name="m")
    assert hashes["tokenizer_sha256"] == hashlib.sha256(b'{"model": {}}').hexdigest()
    assert hashes["chat_template_sha256"] == hashlib.sha256(b"{{ x }}").hexdigest()
    assert hashes["model_name"] == "m"
    (tmp_path / "chat_template.jinja").write_text("{{ y }}é", encoding="utf-8")
    assert chat_template_sha256(tmp_path) == hashlib.sha256("{{ y }}é".encode()).hexdigest()


def test_named_chat_templates(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert chat_template_sha256(tmp_path) == hashlib.sha256(b"D").hexdigest()


def test_tiny_demo_hash_is_published_and_small() -> None:
    assert model_sha256(TINY_DEMO_DIR) == TINY_DEMO_SHA256
    size = sum(p.stat().st_size for p in TINY_DEMO_DIR.iterdir())
    assert size < 2_000_000


def test_tiny_demo_script_reproduces_the_shipped_files(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[2] / "scripts" / "make_tiny_demo.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    assert model_sha256(tmp_path) == TINY_DEMO_SHA256


def test_artifacts_module_does_not_import_torch() -> None:
    code = "import sys, ledger.artifacts; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
