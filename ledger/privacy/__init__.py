"""Encryption at rest, crypto-shredding erasure and retention (issue 18, docs/privacy.md)."""
