"""docs/settings.md is generated from the one settings object and kept current."""

from __future__ import annotations

from pathlib import Path

from ledger.settings import USED_BY, Settings, settings_markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "settings.md"


def test_every_setting_explains_itself() -> None:
    for name, info in Settings.model_fields.items():
        assert info.description, f"LEDGER_{name.upper()} has no description"
        assert USED_BY.get(name), f"LEDGER_{name.upper()}: say which commands read it"
    assert set(USED_BY) == set(Settings.model_fields)


def test_settings_doc_is_current() -> None:
    assert DOC.read_text() == settings_markdown(), "run python -m scripts.gen_settings_doc"
    for name in Settings.model_fields:
        assert f"`LEDGER_{name.upper()}`" in DOC.read_text()
