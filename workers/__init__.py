"""Replay side of inference-ledger: the engines (torch) and, later, the Celery workers.

Nothing in ``ledger`` imports this package at module import time; the CLI loads it
lazily inside the commands that need it.
"""
