"""Least privilege: which database role may do what, in one table.

One NOLOGIN group role per component; each process logs in as its own LOGIN user that is
a member of exactly one of them (``ledger db create-login``). Migration
``0008_component_roles`` creates the roles and applies :data:`GRANTS`; the role test
(``tests/test_db_roles.py``) checks every cell both ways over real connections.

The grants follow what each component's code does:

- ``ledger_api`` (``ledger serve``): ingest (sequencer: ``log_state``/``log_entries``,
  ``envelopes``, ``fingerprints``), reads, disputes (open, comment, resolve, each a signed
  ``dispute_events`` leaf), the job outbox sweep after a dispute is opened, admin paths
  (``signing_keys``, ``api_keys``, ``reverification_policies``, ``audit_events``), and the
  integrator where ``LEDGER_INTEGRATE_IN_API`` is on (``tiles``, ``tile_nodes``, ``log_tree``,
  ``checkpoints``).
- ``ledger_beat`` (``ledger beat``, which runs the integrator too): the outbox sweeper
  (jobs, attempts of lost workers, routing events on disputes), re-verification windows
  and fingerprint gates (``reverification_runs``, new jobs), the integrator.
- ``ledger_worker`` (``ledger worker``): reads envelopes, keys, tiles and checkpoints;
  registers itself in ``workers`` and heartbeats; claims and finishes jobs; appends
  verdicts and worker-signed dispute events through the sequencer.
- erasure (0015, docs/privacy.md): the API seals envelopes under ``data_keys`` it creates
  and, on its admin erasure path, destroys them (``erasures``/``erased_keys`` leaves and
  records); the beat destroys them for retention policies; workers read them to open
  sealed envelopes. A trigger refuses a ``DELETE`` of a data key that no ``erased_keys``
  row names and every ``UPDATE`` (``UPDATE (kek_id)`` is granted only for row locks).
- ``ledger_auditor``: read-only (``api_keys`` too: the audit checks its rows against the
  registry leaves).

Partly mutable tables get column-level ``UPDATE`` only: only the API's admin paths may
change an API key's role (a registry leaf records each change), nobody may change a key's
public bytes, or a dispute's resolution outside the API's resolve path.
Triggers in the migration add what grants cannot say: revocation is final, a resolution
is final, and a checkpoint can only be inserted for the tree the integrator just built.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

API = "ledger_api"
BEAT = "ledger_beat"
WORKER = "ledger_worker"
AUDITOR = "ledger_auditor"

#: ``ledger db create-login --component X`` -> group role
COMPONENT_ROLES: dict[str, str] = {"api": API, "beat": BEAT, "worker": WORKER,
                                   "auditor": AUDITOR}
ROLES = tuple(COMPONENT_ROLES.values())

#: Tables made by sibling migrations (0006 registry leaves, 0007 witnesses): granted only
#: where they exist, so 0008 runs before and after they are filled in.
OPTIONAL_TABLES = frozenset({"admin_events", "checkpoint_cosignatures", "witness_status",
                             "alerts",  # 0009: webhook alerts
                             "tokenizers", "console_sessions",  # 0011: the console
                             "tile_nodes",  # 0014: stored subtree hashes of full tiles
                             "data_keys", "erasures", "erased_keys",  # 0015: erasure
                             "retention_policies",
                             "matrix_runs"})  # 0016: replay matrix reports

_SEQUENCER = ("SELECT", "UPDATE (size)")                # log_state: lock and advance
_INTEGRATOR = {
    "log_tree": ("SELECT", "UPDATE (size, root_hash, updated_at)"),
    "tiles": ("SELECT", "INSERT", "UPDATE (data)"),      # upsert; a tile only grows
    "tile_nodes": ("SELECT", "INSERT"),                  # a full tile's nodes never change
    "checkpoints": ("SELECT", "INSERT"),
    "checkpoint_cosignatures": ("SELECT", "INSERT"),
    "witness_status": ("SELECT", "INSERT", "UPDATE"),
}
#: 0015: erasure leaves and their key records (append-only; each erasure appends one leaf)
_SEALING = {
    "erasures": ("SELECT", "INSERT"),
    "erased_keys": ("SELECT", "INSERT"),
}
_SWEEPER = {
    "workers": ("SELECT",),
    "replay_jobs": ("SELECT", "INSERT",
                    "UPDATE (state, state_reason, worker_id, published_at)"),
    "replay_job_items": ("SELECT", "INSERT"),
    "job_attempts": ("SELECT", "UPDATE (finished_at, outcome, detail)"),
}

GRANTS: dict[str, dict[str, tuple[str, ...]]] = {
    API: {
        "alembic_version": ("SELECT",),
        "log_state": _SEQUENCER,
        "log_entries": ("SELECT", "INSERT"),
        "envelopes": ("SELECT", "INSERT"),
        "fingerprints": ("SELECT", "INSERT"),
        "signing_keys": ("SELECT", "INSERT", "UPDATE (status, revoked_at, revoked_reason)"),
        "api_keys": ("SELECT", "INSERT", "UPDATE (revoked_at, role)"),  # each a registry leaf
        "audit_events": ("SELECT", "INSERT"),
        "admin_events": ("SELECT", "INSERT"),
        **_INTEGRATOR,
        **_SWEEPER,
        "disputes": ("SELECT", "INSERT",
                     "UPDATE (state, state_reason, updated_at, job_id, resolution, "
                     "resolution_note, resolved_by, resolved_at)"),
        "dispute_events": ("SELECT", "INSERT"),
        "verdicts": ("SELECT",),
        # pause/resume (enabled) and delete (its runs keep their reports, detached)
        "reverification_policies": ("SELECT", "INSERT", "UPDATE (enabled)", "DELETE"),
        "reverification_runs": ("SELECT", "UPDATE (policy_id)"),
        "alerts": ("SELECT",),
        "tokenizers": ("SELECT", "INSERT"),                          # 0011: the console
        "console_sessions": ("SELECT", "INSERT", "DELETE"),
        **_SEALING,
        # 0015: the admin erasure path destroys data keys (a trigger allows a delete only
        # for a key an erased_keys row of a signed erasure leaf names)
        # UPDATE (kek_id) only for the row locks ingest (FOR SHARE) and erasure (FOR UPDATE)
        # take; a trigger refuses every UPDATE of a data key
        "data_keys": ("SELECT", "INSERT", "UPDATE (kek_id)", "DELETE"),
        "retention_policies": ("SELECT", "INSERT", "UPDATE (enabled)", "DELETE"),
        "matrix_runs": ("SELECT",),   # 0016: served after checking against its leaf
    },
    BEAT: {
        "alembic_version": ("SELECT",),
        "log_state": _SEQUENCER,
        "log_entries": ("SELECT", "INSERT"),
        "envelopes": ("SELECT",),
        "fingerprints": ("SELECT",),
        "signing_keys": ("SELECT",),
        "admin_events": ("SELECT", "INSERT"),
        **_INTEGRATOR,
        **_SWEEPER,
        "disputes": ("SELECT", "UPDATE (state, state_reason, updated_at)"),
        "dispute_events": ("SELECT", "INSERT"),
        "verdicts": ("SELECT",),
        "reverification_policies": ("SELECT",),
        "reverification_runs": ("SELECT", "INSERT", "UPDATE (sampled)"),
        "alerts": ("SELECT", "INSERT",
                   "UPDATE (attempts, next_attempt_at, delivered_at, last_error)"),
        # 0015: retention (erase what is older than a policy's window) runs from beat
        **_SEALING,
        "data_keys": ("SELECT", "UPDATE (kek_id)", "DELETE"),  # row locks, as for the API
        "retention_policies": ("SELECT",),
        "matrix_runs": ("SELECT",),
    },
    WORKER: {
        "alembic_version": ("SELECT",),
        "log_state": _SEQUENCER,
        "log_entries": ("SELECT", "INSERT"),
        "envelopes": ("SELECT",),
        "signing_keys": ("SELECT",),
        "admin_events": ("SELECT",),  # the registry leaves that vouch for producer keys
        "tiles": ("SELECT",),
        "tile_nodes": ("SELECT",),
        "checkpoints": ("SELECT",),
        "checkpoint_cosignatures": ("SELECT",),
        "workers": ("SELECT", "INSERT", "UPDATE (last_heartbeat, stopped_at)"),
        "replay_jobs": ("SELECT", "UPDATE (state, state_reason, attempts, worker_id, "
                        "started_at, finished_at, last_error, published_at)"),
        "replay_job_items": ("SELECT",),
        "job_attempts": ("SELECT", "INSERT", "UPDATE (finished_at, outcome, detail)"),
        "disputes": ("SELECT", "UPDATE (state, state_reason, updated_at, verdict_id)"),
        "dispute_events": ("SELECT", "INSERT"),
        "verdicts": ("SELECT", "INSERT"),
        # 0015: a worker opens sealed envelopes (and sees which were erased)
        "data_keys": ("SELECT",),
        "erasures": ("SELECT",),
        "erased_keys": ("SELECT",),
        # 0016: a worker appends the signed report of a matrix job it ran
        "matrix_runs": ("SELECT", "INSERT"),
    },
    AUDITOR: {t: ("SELECT",) for t in (
        "alembic_version", "log_state", "log_entries", "envelopes", "fingerprints",
        "signing_keys", "api_keys", "audit_events", "admin_events", "log_tree", "tiles",
        "tile_nodes", "checkpoints", "checkpoint_cosignatures", "witness_status", "workers",
        "replay_jobs", "replay_job_items", "job_attempts", "disputes", "dispute_events",
        "verdicts",
        "reverification_policies", "reverification_runs", "alerts", "tokenizers",
        "console_sessions", "data_keys", "erasures", "erased_keys", "retention_policies",
        "matrix_runs")},
}

def grant_statements(grants: Mapping[str, Mapping[str, tuple[str, ...]]] = GRANTS,
                     ) -> Iterator[tuple[str, str]]:
    """(table, SQL) for every grant: ``GRANT SELECT, UPDATE (a, b) ON t TO role``. A role
    that inserts into a table also gets its serial/identity sequences (``serial_grant``)."""
    for role, tables in grants.items():
        for table, privileges in tables.items():
            yield table, f"GRANT {', '.join(privileges)} ON {table} TO {role}"
            if "INSERT" in privileges:
                yield table, serial_grant(table, f"GRANT USAGE, SELECT ON SEQUENCE %s TO {role}")


def serial_grant(table: str, template: str) -> str:
    """A block that runs ``template % sequence`` for each sequence behind ``table``'s
    serial or identity columns (none for tables keyed by log index)."""
    return f"""DO $$ DECLARE s text; BEGIN
      FOR s IN SELECT pg_get_serial_sequence('public.{table}', attname) FROM pg_attribute
               WHERE attrelid = 'public.{table}'::regclass AND attnum > 0
                 AND NOT attisdropped LOOP
        IF s IS NOT NULL THEN EXECUTE format('{template}', s); END IF;
      END LOOP;
    END $$"""  # noqa: S608 - table names come from the map above, not from input


def tables() -> frozenset[str]:
    """Every table named in the map (the migration revokes from these first)."""
    return frozenset(t for g in GRANTS.values() for t in g)
