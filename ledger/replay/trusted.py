"""Checking a stored record before anything is replayed from it (no torch).

A record is believed only when (1) its DSSE signature verifies under a producer key the
checker believes, valid at the record's log index, and (2) it is the leaf it claims to be
in a checkpoint signed by a log key the checker believes (its entry rebuilt from the
record, the inclusion proof checked). What is believed comes from a trust policy (the
policy's log keys; producer keys vouched for by registry leaves a policy service key
signed), or, without one (development, ``--insecure-dev``), from the database's own key
rows. The replay worker (``workers.replay``) and the replay matrix (``ledger matrix run``
and matrix jobs) both call :class:`RecordChecker`; a failure is :class:`Unverifiable` with
the reason, and the record is reported, never replayed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from ledger.core import dsse
from ledger.core.errors import KeyError_, LedgerError
from ledger.core.logentry import verify_record_included
from ledger.core.note import NoteVerifier, open_checkpoint
from ledger.core.registry import RegisteredKey
from ledger.core.sealing import KeyEncryptionKey
from ledger.core.trust import TrustPolicy
from ledger.db.models import Envelope, SigningKey
from ledger.db.session import raw_cursor
from ledger.errors import NotFound
from ledger.log import proofs
from ledger.log.registry import registry_from_leaves, trusted_signers
from ledger.log.signer import log_verifiers, trusted_log_verifiers
from ledger.privacy.keys import ErasedContent, Opener


class Unverifiable(Exception):
    """A record fails a check before replay: it is reported with this reason and not
    replayed (a job item gets an ``unverifiable`` verdict)."""


@dataclass(frozen=True)
class CheckedRecord:
    """A record that passed: its signed envelope and the checkpoint it is included in."""

    log_index: int
    request_id: str
    envelope: dsse.Envelope
    checkpoint: dict[str, Any]


class RecordChecker:
    """Signature and log-inclusion checks of stored envelopes, against ``trust``."""

    def __init__(self, log_name: str, trust: TrustPolicy | None, *,
                 kek: KeyEncryptionKey | None = None, wait_s: float = 30) -> None:
        self.log_name = trust.origin if trust is not None else log_name
        self.trust = trust
        self.kek = kek
        self.wait_s = wait_s

    def producer_keys(self, session: Any) -> dict[str, RegisteredKey]:
        """Producer keys believed (:meth:`keys`)."""
        return self.keys(session, "producer")

    def keys(self, session: Any, purpose: str) -> dict[str, RegisteredKey]:
        """Keys of ``purpose`` believed: vouched for by registry leaves signed by a policy
        service key (or, without a policy, every such row of the database)."""
        if self.trust is not None:
            # the leaves alone (not the key tables); a leaf that does not verify vouches
            # for nothing
            registry, _ = registry_from_leaves(session, self.trust)
            return {kid: k for kid, k in registry.keys.items() if k.purpose == purpose}
        return {k.keyid: RegisteredKey(bytes(k.public_key), k.purpose, k.name, k.not_before,
                                       k.not_after, k.revoked_at, k.keyid,
                                       vouched_by="database")
                for k in session.scalars(select(SigningKey).where(
                    SigningKey.purpose == purpose))}

    def service_keys(self, session: Any) -> dict[str, bytes]:
        """Service keys believed (keyid -> public key): the policy's, or without one the
        database's ``ledger`` keys."""
        return trusted_signers(session, self.trust)[0]

    def log_verifiers(self, session: Any) -> list[NoteVerifier]:
        if self.trust is not None:
            return trusted_log_verifiers(self.trust, self.log_name)
        return log_verifiers(session, self.log_name)

    @staticmethod
    def signed_envelope(session: Any, log_index: int, producers: dict[str, RegisteredKey],
                        kek: KeyEncryptionKey | None = None) -> dsse.Envelope:
        """The stored envelope (opened with the KEK where it is encrypted at rest), its
        signature checked against a believed producer key valid at ``log_index``. An
        erased envelope is ``Unverifiable: erased``."""
        env = session.get(Envelope, log_index)
        if env is None:
            raise Unverifiable("the envelope record is missing")
        try:
            with raw_cursor(session) as cur:
                dsse_bytes = Opener(cur, kek).open(bytes(env.dsse), bytes(env.dsse_sha256),
                                                   log_index)
        except ErasedContent as erased:
            raise Unverifiable(erased.reason) from None
        except LedgerError as exc:
            raise Unverifiable(f"encrypted at rest: {exc.message}") from exc

        def producer_key(kid: str) -> bytes:
            key = producers.get(kid)
            if key is None:
                raise KeyError_(f"producer key {kid} is not vouched for by a registry "
                                "leaf signed by a trusted service key")
            why = key.valid_at_index(log_index)
            if why is not None:
                raise KeyError_(why)
            return key.public_key

        try:
            envelope = dsse.envelope_from_json(dsse_bytes)
            dsse.verify_envelope(envelope, producer_key)
        except LedgerError as exc:
            raise Unverifiable(f"bad signature: {exc.message}") from exc
        return envelope

    def receipt(self, session: Any, index: int) -> proofs.InclusionReceipt:
        """The entry's inclusion proof, waiting up to ``wait_s`` for a checkpoint to
        cover it."""
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return proofs.inclusion(session, index)
            except proofs.NotYetIntegrated:
                session.rollback()
                if time.monotonic() >= deadline:
                    raise Unverifiable("the envelope is not in a signed checkpoint yet") \
                        from None
                time.sleep(0.2)
            except NotFound as exc:     # no checkpoint or no such entry
                raise Unverifiable(f"not in the log: {exc.message}") from exc

    def check_in_log(self, session: Any, log_index: int, request_id: str,
                     envelope: dsse.Envelope) -> dict[str, Any]:
        """Check the envelope is leaf ``log_index`` of a checkpoint signed by a believed
        log key; the checkpoint's size and root (hex)."""
        receipt = self.receipt(session, log_index)
        try:
            checkpoint = open_checkpoint(receipt.checkpoint.note, self.log_verifiers(session),
                                         origin=self.log_name)
            verify_record_included("envelope", request_id, envelope.canonical_bytes(),
                                   log_index, checkpoint.size, checkpoint.root_hash,
                                   receipt.proof, served_entry=receipt.entry)
        except LedgerError as exc:
            raise Unverifiable(f"not verifiably in the log: {exc.message}") from exc
        return {"tree_size": checkpoint.size, "root_hash": checkpoint.root_hash.hex()}

    def check(self, session: Any, log_index: int, request_id: str,
              producers: dict[str, RegisteredKey]) -> CheckedRecord:
        """Both checks; raises :class:`Unverifiable`."""
        envelope = self.signed_envelope(session, log_index, producers, self.kek)
        checkpoint = self.check_in_log(session, log_index, request_id, envelope)
        return CheckedRecord(log_index, request_id, envelope, checkpoint)
