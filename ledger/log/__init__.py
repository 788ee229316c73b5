"""The transparency log's storage side: tiles and checkpoints in Postgres, the integrator,
proofs, audit and export. The hashing and proofs themselves are in :mod:`ledger.core`."""
