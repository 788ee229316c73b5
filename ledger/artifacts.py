"""Model artifact hashes: the one rule producers and replay workers use for a model directory.

``model_sha256`` of a directory is the SHA-256 of a manifest with one line per regular
file under it (recursively; symlinks followed; any path component starting with ``.``
skipped), sorted by the relative POSIX path's UTF-8 bytes, each line
``"<sha256 hex of the file>  <relative path>\\n"`` -- exactly ``sha256sum``'s output, so::

    cd DIR && find -L . -type f ! -path '*/.*' -printf '%P\\n' | LC_ALL=C sort \\
        | xargs -d '\\n' sha256sum | sha256sum

prints the same digest (``-L`` follows symlinks, as in Hugging Face cache snapshots).
``tokenizer_sha256`` is the SHA-256 of ``tokenizer.json``'s bytes; ``chat_template_sha256``
the SHA-256 of the chat template's UTF-8 text, from ``chat_template.jinja`` or else from
``tokenizer_config.json``'s ``chat_template``; each ``None`` when absent.

No torch here: the ledger and API use this module too. Files are read in 1 MiB chunks.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHUNK_BYTES = 1 << 20

#: Called with the number of bytes just hashed (for progress bars).
Progress = Callable[[int], None]


def model_files(root: str | Path) -> list[tuple[str, Path]]:
    """(relative POSIX path, path) of every file the rule hashes, in manifest order."""
    root = Path(root)
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath) / name
            if name.startswith(".") or not path.is_file():
                continue
            found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0].encode("utf-8"))
    return found


def file_sha256(path: str | Path, progress: Progress | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return digest.hexdigest()


def manifest(root: str | Path, progress: Progress | None = None) -> str:
    """The manifest text whose SHA-256 is ``model_sha256``."""
    return "".join(
        f"{file_sha256(path, progress)}  {rel}\n" for rel, path in model_files(root)
    )


def model_sha256(root: str | Path, progress: Progress | None = None) -> str:
    return hashlib.sha256(manifest(root, progress).encode("utf-8")).hexdigest()


def total_bytes(root: str | Path) -> int:
    """Bytes ``model_sha256`` will read (for a progress bar's total)."""
    return sum(path.stat().st_size for _, path in model_files(root))


def tokenizer_sha256(root: str | Path) -> str | None:
    path = Path(root) / "tokenizer.json"
    return file_sha256(path) if path.is_file() else None


def chat_template(root: str | Path) -> str | None:
    """The chat template text: ``chat_template.jinja``, else tokenizer_config.json's."""
    root = Path(root)
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_bytes().decode("utf-8")
    config = root / "tokenizer_config.json"
    if not config.is_file():
        return None
    template: Any = json.loads(config.read_text("utf-8")).get("chat_template")
    if isinstance(template, list):   # [{"name": ..., "template": ...}]: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def chat_template_sha256(root: str | Path) -> str | None:
    template = chat_template(root)
    return None if template is None else hashlib.sha256(template.encode("utf-8")).hexdigest()


def artifact_hashes(
    root: str | Path, *, model_name: str | None = None, progress: Progress | None = None
) -> dict[str, str | None]:
    """The envelope's ``artifacts`` object for a model directory."""
    root = Path(root)
    return {
        "model_sha256": model_sha256(root, progress),
        "tokenizer_sha256": tokenizer_sha256(root),
        "chat_template_sha256": chat_template_sha256(root),
        "model_name": model_name or root.resolve().name,
    }
