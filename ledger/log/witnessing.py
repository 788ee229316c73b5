"""The log's side of C2SP tlog-witness: submit checkpoints to witnesses, keep their
cosignatures, serve checkpoints with them, and audit them.

Each configured witness (``LEDGER_WITNESSES``: ``<url> <vkey>`` pairs) gets its own thread,
so a witness that is slow or down delays nobody: not the integrator, not the other
witnesses. A round of one witness's thread, in one transaction:

1. lock that witness's ``witness_status`` row (``FOR UPDATE SKIP LOCKED``: when several
   processes run submitters, one talks to a given witness at a time, the others skip);
2. take the newest checkpoint; stop if this witness already cosigned it;
3. ``POST <url>/add-checkpoint`` with ``old <size the witness last reported>`` and the
   consistency proof from that size (0 and no proof when nothing is known yet);
4. on 409 learn the witness's size from the ``text/x.tlog.size`` body and retry with a proof
   from there; on 200 verify every returned line against the witness's configured key
   (the answer is believed only as far as that signature goes) and store the cosignature;
   on anything else record the error.

Failures back off exponentially up to ``witness_max_backoff_s``. Nothing here is needed for
integration to make progress; the integrator only wakes the threads when it publishes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ledger.core.cosignature import (
    Cosignature,
    CosignatureError,
    append_signature_lines,
    parse_cosignature_line,
    split_note,
)
from ledger.core.errors import LedgerError
from ledger.core.tiles import consistency_proof_from_tiles
from ledger.core.trust import TrustPolicy, WitnessKey, parse_witness_key
from ledger.db.session import raw_cursor, session_scope
from ledger.errors import NotFound
from ledger.log.store import (
    PgTileReader,
    StoredCheckpoint,
    checkpoint_at,
    checkpoint_times,
    latest_checkpoint,
)
from ledger.settings import Settings, get_settings
from ledger.witness.protocol import (
    SIZE_CONTENT_TYPE,
    MalformedRequest,
    format_add_checkpoint,
    parse_cosignature_response,
    parse_size,
)

log = logging.getLogger("ledger.witnessing")

MAX_CONFLICT_RETRIES = 3


class WitnessConfigError(LedgerError):
    code = "bad_witness_setting"


@dataclass(frozen=True, slots=True)
class WitnessEndpoint:
    """A witness the log submits to: its submission prefix and cosignature key."""

    url: str
    key: WitnessKey

    @property
    def name(self) -> str:
        return self.key.name


def parse_witness_endpoint(entry: str) -> WitnessEndpoint:
    """``<url> <vkey>`` (one ``LEDGER_WITNESSES`` item)."""
    parts = entry.split()
    if len(parts) != 2 or not parts[0].startswith(("http://", "https://")):
        raise WitnessConfigError(f"a witness is '<http(s) url> <vkey>', not {entry[:80]!r}")
    try:
        key = parse_witness_key(parts[1])
    except LedgerError as exc:
        raise WitnessConfigError(exc.message) from exc
    return WitnessEndpoint(parts[0].rstrip("/"), key)


def witness_endpoints(settings: Settings) -> list[WitnessEndpoint]:
    endpoints = [parse_witness_endpoint(e) for e in settings.witnesses]
    if len({e.name for e in endpoints}) != len(endpoints):
        raise WitnessConfigError("LEDGER_WITNESSES names a witness twice")
    return endpoints


def _text(note: bytes) -> str:
    return split_note(note)[0]


@dataclass(frozen=True, slots=True)
class Round:
    """What one submission round did: ``outcome`` is ok, current, idle, busy or error."""

    witness: str
    outcome: str
    tree_size: int | None = None
    detail: str = ""

    def __str__(self) -> str:
        size = f" at {self.tree_size}" if self.tree_size is not None else ""
        return f"{self.witness}: {self.outcome}{size}{' - ' + self.detail if self.detail else ''}"

    @property
    def failed(self) -> bool:
        return self.outcome == "error"


class Submitter:
    """Submits checkpoints to one witness (one thread, its own HTTP client)."""

    def __init__(self, engine: Engine, endpoint: WitnessEndpoint, *, timeout_s: float,
                 interval_s: float, max_backoff_s: float) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self.interval_s = interval_s
        self.max_backoff_s = max_backoff_s
        self.http = httpx.Client(timeout=timeout_s,
                                 headers={"Content-Type": "text/plain; charset=utf-8"})
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"ledger-witness-{endpoint.name}")
        self._registered = False

    # --- one round ---------------------------------------------------------------------
    def _register(self) -> None:
        with session_scope(self.engine) as session, raw_cursor(session) as cur:
            cur.execute("INSERT INTO witness_status (witness_name, url) VALUES (%s, %s) "
                        "ON CONFLICT (witness_name) DO NOTHING",
                        (self.endpoint.name, self.endpoint.url))
        self._registered = True

    def run_round(self) -> Round:
        if not self._registered:
            self._register()
        name = self.endpoint.name
        with session_scope(self.engine) as session, raw_cursor(session) as cur:
            cur.execute("SELECT last_size, url FROM witness_status WHERE witness_name = %s "
                        "FOR UPDATE SKIP LOCKED", (name,))
            row = cur.fetchone()
            if row is None:
                return Round(name, "busy", detail="another process is submitting")
            known: int | None = row[0]
            if row[1] != self.endpoint.url:
                cur.execute("UPDATE witness_status SET url = %s WHERE witness_name = %s",
                            (self.endpoint.url, name))
            cp = latest_checkpoint(cur)
            if cp is None:
                return Round(name, "idle")
            cur.execute("SELECT 1 FROM checkpoint_cosignatures WHERE tree_size = %s AND "
                        "witness_name = %s", (cp.tree_size, name))
            if cur.fetchone() is not None:
                return Round(name, "current", cp.tree_size)
            result = self._submit(cur, cp, known or 0)
            if result.failed:
                cur.execute("UPDATE witness_status SET last_error = %s, last_attempt_at = now() "
                            "WHERE witness_name = %s", (result.detail[:2000], name))
            return result

    def _submit(self, cur: Any, cp: StoredCheckpoint, old: int) -> Round:
        name = self.endpoint.name
        for _ in range(MAX_CONFLICT_RETRIES):
            if old > cp.tree_size:
                return Round(name, "error", cp.tree_size,
                             f"the witness cosigned size {old}, beyond the newest checkpoint "
                             f"{cp.tree_size}")
            proof = (consistency_proof_from_tiles(old, cp.tree_size, PgTileReader(cur))
                     if 0 < old < cp.tree_size else [])
            body = format_add_checkpoint(old, proof, cp.note)
            try:
                resp = self.http.post(self.endpoint.url + "/add-checkpoint", content=body)
            except httpx.HTTPError as exc:
                return Round(name, "error", cp.tree_size,
                             f"{type(exc).__name__}: {exc or 'no answer'}")
            if resp.status_code == 409 and \
                    resp.headers.get("content-type", "").startswith(SIZE_CONTENT_TYPE):
                try:
                    size = parse_size(resp.text.removesuffix("\n"))
                except MalformedRequest:
                    return Round(name, "error", cp.tree_size, "409 with a malformed size")
                cur.execute("UPDATE witness_status SET last_size = %s WHERE witness_name = %s",
                            (size, name))
                if size == old:
                    return Round(name, "error", cp.tree_size,
                                 f"409: the witness holds a different root at size {size} "
                                 "(a fork?)")
                old = size
                continue
            if resp.status_code != 200:
                return Round(name, "error", cp.tree_size,
                             f"HTTP {resp.status_code}: {resp.text[:300].strip()}")
            return self._store(cur, cp, resp.content)
        return Round(name, "error", cp.tree_size, "the witness's size keeps changing")

    def _store(self, cur: Any, cp: StoredCheckpoint, answer: bytes) -> Round:
        name = self.endpoint.name
        try:
            lines = parse_cosignature_response(answer)
        except MalformedRequest as exc:
            return Round(name, "error", cp.tree_size, exc.message)
        text = _text(cp.note)
        good: Cosignature | None = None
        for line in lines:
            try:
                cosig = parse_cosignature_line(line)
                if (cosig.name, cosig.key_id) != (self.endpoint.key.name,
                                                  self.endpoint.key.key_id):
                    continue  # a key we were not told about: ignored, as the spec asks
                cosig.verify(text, self.endpoint.key)
            except CosignatureError as exc:
                return Round(name, "error", cp.tree_size, f"bad cosignature: {exc.message}")
            good = cosig
            break
        if good is None:
            return Round(name, "error", cp.tree_size,
                         "the answer has no cosignature by the configured key")
        cur.execute("INSERT INTO checkpoint_cosignatures (tree_size, witness_name, key_id, "
                    "timestamp, signature) VALUES (%s, %s, %s, %s, %s) "
                    "ON CONFLICT DO NOTHING",
                    (cp.tree_size, name, good.key_id, good.timestamp, good.line))
        cur.execute("UPDATE witness_status SET last_size = %s, last_ok_at = now(), "
                    "last_attempt_at = now(), last_error = NULL WHERE witness_name = %s",
                    (cp.tree_size, name))
        return Round(name, "ok", cp.tree_size)

    # --- the thread --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 10) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout)
        self.http.close()

    def _run(self) -> None:
        backoff = 0.0
        while not self._stop.is_set():
            try:
                failed = self.run_round().failed
            except Exception as exc:  # noqa: BLE001 - the database may be down; keep going
                log.warning("witness %s: %s", self.endpoint.name, exc)
                failed = True
            if failed:
                backoff = min(self.max_backoff_s, max(self.interval_s, backoff * 2 or 0.5))
                self._stop.wait(backoff)
            else:
                backoff = 0.0
                self._wake.wait(self.interval_s)
                self._wake.clear()


class WitnessLoop:
    """One :class:`Submitter` per configured witness."""

    def __init__(self, submitters: Sequence[Submitter]) -> None:
        self.submitters = list(submitters)

    @classmethod
    def from_settings(cls, settings: Settings, engine: Engine) -> WitnessLoop | None:
        """None when ``LEDGER_WITNESSES`` is empty."""
        endpoints = witness_endpoints(settings)
        if not endpoints:
            return None
        return cls([Submitter(engine, e, timeout_s=settings.witness_timeout_s,
                              interval_s=settings.witness_interval_ms / 1000,
                              max_backoff_s=settings.witness_max_backoff_s)
                    for e in endpoints])

    def start(self) -> None:
        for s in self.submitters:
            s.start()

    def wake(self) -> None:
        for s in self.submitters:
            s.wake()

    def stop(self) -> None:
        for s in self.submitters:
            s.stop()

    def run_once(self) -> list[Round]:
        """One round per witness, in this thread (``ledger witness submit --once``)."""
        return [s.run_round() for s in self.submitters]


# --- reading ------------------------------------------------------------------------------

def stored_cosignature_lines(session: Session, tree_size: int) -> list[str]:
    """The stored cosignature lines of one checkpoint that have the shape of one (a row
    that does not could not be served inside a note)."""
    with raw_cursor(session) as cur:
        cur.execute("SELECT signature FROM checkpoint_cosignatures WHERE tree_size = %s "
                    "ORDER BY witness_name", (tree_size,))
        lines = [r[0] for r in cur.fetchall()]
    out = []
    for line in lines:
        try:
            parse_cosignature_line(line)
        except CosignatureError:
            log.warning("stored cosignature of checkpoint %d does not parse", tree_size)
            continue
        out.append(line)
    return out


def cosigned_note(session: Session, tree_size: int) -> bytes:
    """The checkpoint note of ``tree_size`` with its stored cosignature lines appended:
    still one signed note (readers that know only the log key ignore the extra lines)."""
    with raw_cursor(session) as cur:
        cp = checkpoint_at(cur, tree_size)
    if cp is None:
        raise NotFound(f"no checkpoint of tree size {tree_size}", code="no_such_checkpoint")
    return append_signature_lines(cp.note, stored_cosignature_lines(session, tree_size))


def export_checkpoint(session: Session, witnesses: int) -> StoredCheckpoint | None:
    """The checkpoint an export should carry: the newest one cosigned by ``witnesses``
    distinct witnesses (every configured one), else the newest checkpoint; its note with
    the stored cosignature lines appended."""
    with raw_cursor(session) as cur:
        cp = None
        if witnesses > 0:
            cur.execute("SELECT tree_size FROM checkpoint_cosignatures GROUP BY tree_size "
                        "HAVING count(DISTINCT witness_name) >= %s "
                        "ORDER BY tree_size DESC LIMIT 1", (witnesses,))
            row = cur.fetchone()
            cp = checkpoint_at(cur, row[0]) if row else None
        cp = cp or latest_checkpoint(cur)
    if cp is None:
        return None
    note = append_signature_lines(cp.note, stored_cosignature_lines(session, cp.tree_size))
    return StoredCheckpoint(cp.tree_size, cp.root_hash, note)


@dataclass(frozen=True, slots=True)
class WitnessView:
    name: str
    url: str
    last_size: int | None
    last_ok_at: datetime | None
    last_error: str | None
    last_attempt_at: datetime | None
    cosigned_size: int | None
    """The largest checkpoint size with a stored cosignature by this witness."""


def witness_views(session: Session) -> list[WitnessView]:
    with raw_cursor(session) as cur:
        cur.execute("SELECT s.witness_name, s.url, s.last_size, s.last_ok_at, s.last_error, "
                    "s.last_attempt_at, (SELECT max(c.tree_size) FROM checkpoint_cosignatures c"
                    " WHERE c.witness_name = s.witness_name) FROM witness_status s "
                    "ORDER BY s.witness_name")
        return [WitnessView(*row) for row in cur.fetchall()]


# --- audit --------------------------------------------------------------------------------

def audit_cosignatures(session: Session, policy: TrustPolicy, *,
                       max_lag_s: float | None = None,
                       now: datetime | None = None) -> list[tuple[int | None, str]]:
    """Problems with the stored cosignatures, as (tree size or None, message), by size.

    - every stored cosignature must be by a witness the policy names and verify against
      the checkpoint stored at its size (a checkpoint rewritten after it was cosigned
      fails here), and its row must say what its signature line says;
    - with ``policy.quorum > 0``: some checkpoint must be cosigned by ``quorum`` distinct
      policy witnesses, and no newer checkpoint may have waited longer than ``max_lag_s``
      (default ``witness_max_lag_s``) for one.
    """
    max_lag = get_settings().witness_max_lag_s if max_lag_s is None else max_lag_s
    now = now or datetime.now(UTC)
    trusted = {w.name: w for w in policy.witnesses}
    problems: list[tuple[int | None, str]] = []
    witnessed: dict[int, set[str]] = {}
    with raw_cursor(session) as cur:
        cur.execute("SELECT c.tree_size, c.witness_name, c.key_id, c.timestamp, c.signature, "
                    "k.note FROM checkpoint_cosignatures c LEFT JOIN checkpoints k "
                    "ON k.tree_size = c.tree_size ORDER BY c.tree_size, c.witness_name")
        rows = cur.fetchall()
        checkpoints = checkpoint_times(cur)
    for size, name, key_id, timestamp, line, note in rows:
        who = f"the cosignature by {name} of checkpoint {size}"
        if note is None:
            problems.append((size, f"{who} is for a checkpoint that is not stored"))
            continue
        try:
            cosig = parse_cosignature_line(line)
        except CosignatureError as exc:
            problems.append((size, f"{who} does not parse: {exc.message}"))
            continue
        if (cosig.name, cosig.key_id, cosig.timestamp) != (name, key_id, timestamp):
            problems.append((size, f"{who}: the row disagrees with its signature line"))
            continue
        key = trusted.get(name)
        if key is None or key.key_id != cosig.key_id:
            problems.append((size, f"{who} is not by a witness key the trust policy names"))
            continue
        try:
            cosig.verify(_text(bytes(note)), key)
        except LedgerError as exc:
            problems.append((size, f"{who} does not verify against the stored checkpoint "
                                   f"(rewritten after it was cosigned?): {exc.message}"))
            continue
        witnessed.setdefault(size, set()).add(name)
    if policy.quorum > 0 and checkpoints:
        reached = [s for s, names in witnessed.items() if len(names) >= policy.quorum]
        newest = max(reached) if reached else None
        if newest is None:
            problems.append((None, f"no checkpoint is cosigned by {policy.quorum} of the "
                                   "trust policy's witnesses"))
        waiting = [(s, at) for s, at in checkpoints if newest is None or s > newest]
        if waiting:
            size, at = waiting[0]
            lag = (now - at).total_seconds()
            if lag > max_lag:
                problems.append((size, f"checkpoint {size} has waited {lag:.0f} s for a "
                                       f"checkpoint cosigned by {policy.quorum} witnesses "
                                       f"(at most {max_lag:.0f} s)"))
    problems.sort(key=lambda p: (p[0] is None, p[0] or 0))
    return problems
