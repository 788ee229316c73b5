"""Pure core: canonical bytes, hashing, DSSE, Merkle proofs, notes, fingerprints.

Nothing in this package does file, network or database I/O; the API, tasks and CLI are
thin callers around it. Every check returns ``None`` or raises a subclass of
:class:`ledger.core.errors.LedgerError`.
"""
