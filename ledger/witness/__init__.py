"""A small C2SP tlog-witness (``ledger witness serve``) and the request format both sides
of the protocol share.

- :mod:`ledger.witness.protocol`: the ``add-checkpoint`` request and response bodies (pure);
- :mod:`ledger.witness.state`: the witness's own durable state, one fsynced JSON file;
- :mod:`ledger.witness.service`: the checks the spec asks for, as typed outcomes;
- :mod:`ledger.witness.app`: the HTTP shell (FastAPI).
"""
