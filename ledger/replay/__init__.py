"""Replay orchestration on the ledger side (no torch): disputes and their events, replay
jobs and their routing by fingerprint, verdict storage, re-verification sampling."""
