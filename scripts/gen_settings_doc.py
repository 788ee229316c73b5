"""Write docs/settings.md from the settings object: ``python -m scripts.gen_settings_doc``."""

from __future__ import annotations

from pathlib import Path

from ledger.settings import settings_markdown

OUT = Path(__file__).resolve().parent.parent / "docs" / "settings.md"

if __name__ == "__main__":
    OUT.write_text(settings_markdown(), encoding="utf-8")
    print(f"wrote {OUT}")
