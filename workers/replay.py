"""The replay worker: re-runs recorded requests on a matching runtime and signs verdicts.

Before it consumes anything a worker knows its runtime fingerprint, has hashed the models
it holds (by the documented artifact rule), and has passed a batch-invariance self-check on
its own engine. Each delivered job is re-checked here: its fingerprint must be this
worker's (a foreign job is refused, not replayed, and leaves no trace in the database),
every envelope's signature and its inclusion in the log are verified against the latest
signed checkpoint, the model is found by artifact hash, and only then is the request
replayed and compared.

What the worker believes comes from its trust policy (``LEDGER_TRUST_POLICY_FILE``), not
from the database it reads jobs from: a checkpoint counts only when a policy log key
signed it, and a producer key only when a registry leaf signed by a policy service key
vouches for it (:func:`ledger.log.registry.registry_from_leaves`). An envelope that fails either
is ``unverifiable`` with the reason, never a verdict on the model. Without a policy the
worker refuses to start unless ``insecure_dev`` is set.

Runs inside ``ledger worker`` (Celery, one process per GPU set, solo pool, prefetch 1), or
in-process for ``ledger demo``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ledger import __version__
from ledger.artifacts import model_sha256
from ledger.core import dsse
from ledger.core.compare import Side, compare
from ledger.core.envelope import EnvelopeStatement, Limits, index_fields, parse_statement
from ledger.core.errors import LedgerError
from ledger.core.fingerprint import fingerprint_id as compute_fingerprint_id
from ledger.core.note import NoteVerifier
from ledger.core.registry import RegisteredKey
from ledger.core.sealing import KeyEncryptionKey
from ledger.core.states import DISPUTE_DECIDED, DisputeState, JobState
from ledger.core.trust import TrustPolicy, load_trust_policy
from ledger.db.models import (
    JobAttempt,
    ReplayJob,
    ReplayJobItem,
    SigningKey,
    Worker,
)
from ledger.db.session import session_scope
from ledger.privacy.keys import kek_from_settings
from ledger.replay import disputes
from ledger.replay import jobs as job_service
from ledger.replay.records import Signer
from ledger.replay.trusted import RecordChecker, Unverifiable
from ledger.replay.verdicts import store_verdict
from ledger.settings import Settings
from workers.engine.api import GenerationRequest, GenerationResult, SamplingParams
from workers.engine.selfcheck import SelfCheckFailed, self_check_engine  # noqa: F401 - re-export

log = logging.getLogger("ledger.worker")

#: Generous limits for reading envelopes back: the ledger already enforced its own.
READ_LIMITS = Limits(max_prompt_tokens=10**7, max_output_tokens=10**7, max_token_id=2**31,
                     max_top_logprobs=10**4)


class NoTrustPolicy(RuntimeError):
    """A worker without a trust policy (and without ``insecure_dev``) does not start."""


NO_TRUST_POLICY = ("the replay worker needs a trust policy: set LEDGER_TRUST_POLICY_FILE "
                   "(`ledger trust init` writes one), or pass --insecure-dev to trust the "
                   "database's own keys (development only)")


def worker_trust(settings: Settings, trust: TrustPolicy | None = None, *,
                 insecure_dev: bool = False) -> TrustPolicy | None:
    """The policy a worker checks against; raises :class:`NoTrustPolicy` without one."""
    if trust is None and settings.trust_policy_file is not None:
        trust = load_trust_policy(settings.trust_policy_file)
    if trust is None and not insecure_dev:
        raise NoTrustPolicy(NO_TRUST_POLICY)
    return trust


@dataclass
class HeldModel:
    model_sha256: str
    name: str
    path: str


@dataclass
class Prepared:
    """One job item after every check; ``problem`` set means unverifiable, no replay."""

    item: ReplayJobItem
    problem: str | None = None
    model_sha256: str | None = None
    request: GenerationRequest | None = None
    recorded: Side | None = None
    tier: str = "bitwise"
    tolerance: float | None = None
    checkpoint: dict[str, Any] = field(default_factory=dict)
    statement: Any = None       # the parsed signed statement (the vendor worker reads it)


def hold_models(models: Sequence[str | Path],
                progress: Any = None) -> dict[str, HeldModel]:
    """Hash every model the worker holds: a directory of model directories, model
    directories, or the name ``tiny-demo``. ``progress(name, total_bytes)`` returns a
    callback advanced by the bytes hashed (a progress bar), or None."""
    from workers.engine.reference import TINY_DEMO_NAME, resolve_model_dir

    held: dict[str, HeldModel] = {}
    for spec in models:
        paths: list[tuple[str, Path]]
        if str(spec) == TINY_DEMO_NAME:
            paths = [(TINY_DEMO_NAME, resolve_model_dir(TINY_DEMO_NAME))]
        elif (Path(spec) / "config.json").is_file():
            paths = [(Path(spec).name, Path(spec))]
        else:
            paths = [(p.name, p) for p in sorted(Path(spec).iterdir())
                     if (p / "config.json").is_file()]
        for name, path in paths:
            if progress is not None:
                from ledger.artifacts import total_bytes

                digest = model_sha256(path, progress(name, total_bytes(path)))
            else:
                digest = model_sha256(path)
            held[digest] = HeldModel(digest, name, str(path))
    return held


class ReplayWorker:
    def __init__(self, settings: Settings, db: Engine, *, models: Sequence[str | Path],
                 engine_name: str = "reference", device: str = "cpu", dtype: str = "float32",
                 max_batch: int = 32, signer: Signer, trust: TrustPolicy | None = None,
                 insecure_dev: bool = False, threads: int | None = 1,
                 hashing_progress: Any = None) -> None:
        # first, before any model is loaded: no trust policy, no worker
        self.trust = worker_trust(settings, trust, insecure_dev=insecure_dev)
        if self.trust is None:
            log.warning("INSECURE: no trust policy; log and producer keys are taken from the "
                        "database this worker reads (--insecure-dev)")
        self.settings = settings
        self.db = db
        self.engine_name = engine_name
        self.device = device
        self.dtype = dtype
        self.max_batch = max_batch
        self.threads = threads
        self.signer = signer
        self.models = hold_models(models, hashing_progress)
        if not self.models:
            raise ValueError(f"no model directories found in {list(models)}")
        self._engines: dict[str, Any] = {}
        first = next(iter(self.models))
        self.runtime = self.engine_for(first).runtime()
        self.fingerprint_id = compute_fingerprint_id(self.runtime)
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # --------------------------------------------------------------------- engines
    def engine_for(self, digest: str) -> Any:
        if digest not in self._engines:
            held = self.models[digest]
            if self.engine_name == "vllm":
                from workers.engine.vllm_adapter import (
                    MAX_SERVE_SEQS,
                    VLLMEngine,
                    memory_engine_args,
                )

                self._engines[digest] = VLLMEngine(
                    held.path, dtype=self.dtype, max_batch=min(self.max_batch, MAX_SERVE_SEQS),
                    extra_engine_args=memory_engine_args(self.settings.vllm_engine_args))
            else:
                from workers.engine import load_engine

                self._engines[digest] = load_engine(held.path, device=self.device,
                                                    dtype=self.dtype, threads=self.threads)
        return self._engines[digest]

    def self_check(self, n: int = 6) -> None:
        """Each request alone vs among co-tenants, greedy, top_k, top_p and both, at batch
        sizes on both sides of every threshold the engine declares
        (``engine.batch_thresholds``: vLLM's sampler switches path at 8 rows; ~44 reported),
        up to the worker's ``max_batch``: must be bit-identical (:func:`self_check_engine`)."""
        for digest in self.models:
            engine = self.engine_for(digest)
            self_check_engine(engine, name=self.models[digest].name,
                              max_batch=min(self.max_batch, getattr(engine, "max_batch",
                                                                    self.max_batch)),
                              minimum=n)

    # ------------------------------------------------------------------ registration
    def register(self) -> None:
        with session_scope(self.db) as session:
            key = session.get(SigningKey, self.signer.keyid)
            if key is None or key.purpose != "worker" or key.status != "active":
                raise RuntimeError(
                    f"the worker key {self.signer.keyid} is not an active registered worker "
                    "key: register it with `ledger keys register KEY.pub --purpose worker`")
            now = datetime.now(UTC)
            row = {"worker_id": self.worker_id, "fingerprint_id": self.fingerprint_id,
                   "runtime": self.runtime,
                   "models": [{"model_sha256": m.model_sha256, "name": m.name}
                              for m in self.models.values()],
                   "engine": self.engine_name, "version": __version__,
                   "keyid": self.signer.keyid, "hostname": socket.gethostname(),
                   "pid": os.getpid(), "started_at": now, "last_heartbeat": now}
            session.execute(pg_insert(Worker).values(**row).on_conflict_do_update(
                index_elements=["worker_id"], set_={"last_heartbeat": now, "stopped_at": None}))
            # the beat routes what waits for this fingerprint now, not at its next tick
            session.execute(text("SELECT pg_notify(:channel, :fp)"),
                            {"channel": job_service.WORKER_CHANNEL, "fp": self.fingerprint_id})

    def heartbeat_once(self) -> None:
        with session_scope(self.db) as session:
            session.execute(update(Worker).where(
                Worker.worker_id == self.worker_id).values(last_heartbeat=datetime.now(UTC)))

    def start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(self.settings.worker_heartbeat_s):
                try:
                    self.heartbeat_once()
                except Exception as exc:  # noqa: BLE001 - database blips must not kill us
                    log.warning("heartbeat failed: %s", exc)

        self._heartbeat = threading.Thread(target=beat, name="ledger-heartbeat", daemon=True)
        self._heartbeat.start()

    def stop(self) -> None:
        self._stop.set()
        try:
            with session_scope(self.db) as session:
                session.execute(update(Worker).where(
                    Worker.worker_id == self.worker_id).values(stopped_at=datetime.now(UTC)))
        except Exception as exc:  # noqa: BLE001
            log.warning("could not mark the worker stopped: %s", exc)

    # ------------------------------------------------------------------------ jobs
    def run_job(self, job_id: str) -> str:
        """Handle one delivery of a job; returns what was done (for logs and tests)."""
        try:
            jid = uuid.UUID(job_id)
        except ValueError:
            log.warning("a message that names no job (%r): ignored", job_id[:80])
            return "skip"
        # Anyone who can write to the broker can send us messages: one for a job that is
        # not ours is refused before anything is written (read-only look-up).
        with self.db.connect() as conn:
            fingerprint = conn.execute(select(ReplayJob.fingerprint_id).where(
                ReplayJob.id == jid)).scalar()
            conn.rollback()
        if fingerprint is None:
            log.warning("job %s: no such job; ignored", job_id)
            return "skip"
        if fingerprint != self.fingerprint_id:
            log.warning("job %s is for fingerprint %s, this worker is %s: refused, not "
                        "replayed", job_id, fingerprint, self.fingerprint_id)
            return "refuse"
        problems = self.configuration_problems()
        if problems:
            self._hand_back(jid, problems)
            return "misconfigured"
        with session_scope(self.db) as session:
            job, claim = job_service.claim(session, job_id, worker_id=self.worker_id,
                                           fingerprint_id=self.fingerprint_id,
                                           settings=self.settings)
            if claim.action == "poison" and job is not None:
                self._conclude(session, job, [], outcome_all=("error", claim.reason),
                               state=JobState.POISONED)
            if claim.action == "run" and job is not None:
                for d in job_service.job_disputes(session, job.id):
                    if d.state not in DISPUTE_DECIDED:
                        disputes.emit(session, d, "replaying", self.worker_id, self.signer,
                                      {"job_id": job_id, "attempt": claim.attempt},
                                      state=DisputeState.REPLAYING)
        if claim.action != "run":
            log.info("job %s: %s (%s)", job_id, claim.action, claim.reason)
            return claim.action
        started = time.perf_counter()
        try:
            prepared = self._prepare(job_id)
            if self._kind(job_id) == "matrix":
                return self._run_matrix(job_id, prepared)
            results = self._replay(prepared)
        except Exception as exc:
            log.exception("job %s failed", job_id)
            self._failed(job_id, f"{type(exc).__name__}: {exc}")
            return JobState.FAILED
        duration_ms = (time.perf_counter() - started) * 1000
        with session_scope(self.db) as session:
            job = session.get(ReplayJob, uuid.UUID(job_id), with_for_update=True)
            assert job is not None
            if job.state != JobState.RUNNING or job.worker_id != self.worker_id:
                return "skip"  # the sweeper gave it to another worker meanwhile
            self._conclude(session, job, list(zip(prepared, results, strict=True)),
                           duration_ms=duration_ms)
        return JobState.DONE

    def configuration_problems(self) -> list[str]:
        """What would make this worker's verdicts a statement about its own settings (a
        log name or trust policy that does not match the log, a key that is not an active
        worker key), one line per problem naming the setting."""
        from ledger.services.checks import worker_job_problems

        lines = [p.line() for p in worker_job_problems(self.settings, self.db)]
        with self.db.connect() as conn:
            key = conn.execute(select(SigningKey.purpose, SigningKey.status).where(
                SigningKey.keyid == self.signer.keyid)).first()
            conn.rollback()
        if key is None or key.purpose != "worker" or key.status != "active":
            lines.append(f"LEDGER_WORKER_KEY_FILE: the key {self.signer.keyid[:16]}... is not "
                         "an active registered worker key")
        return lines

    def _hand_back(self, job_id: uuid.UUID, problems: list[str]) -> None:
        """A job this worker must not judge: it stays queued (no attempt is spent, no
        verdict is signed) with an ``error`` attempt saying why, and the sweeper delivers it
        again later, to this worker once fixed or to another."""
        detail = "worker configuration: " + "; ".join(problems)
        log.error("job %s handed back: %s", job_id, detail)
        with session_scope(self.db) as session:
            job = session.get(ReplayJob, job_id, with_for_update=True)
            if job is None or job.state not in ("queued", "awaiting_worker"):
                return
            now = datetime.now(UTC)
            session.add(JobAttempt(job_id=job.id, attempt=job.attempts, worker_id=self.worker_id,
                                   fingerprint_id=self.fingerprint_id, started_at=now,
                                   finished_at=now, outcome="error", detail=detail))
            job.state_reason = f"worker {self.worker_id} handed it back: {detail}"

    def _prepare(self, job_id: str) -> list[Prepared]:
        with session_scope(self.db) as session:
            kind = session.scalar(select(ReplayJob.kind).where(
                ReplayJob.id == uuid.UUID(job_id)))
            items = list(session.scalars(select(ReplayJobItem).where(
                ReplayJobItem.job_id == uuid.UUID(job_id)).order_by(ReplayJobItem.position)))
            session.expunge_all()
            producers = self._producer_keys(session)
        # A gate job replays envelopes of an *earlier* fingerprint on this new runtime on
        # purpose; every other job must match this worker's fingerprint exactly.
        # A matrix job replays a sample on whatever runtime it was routed to: its report
        # states that runtime (the fingerprint axis is a run per worker fingerprint).
        return [self._check_item(item, producers, foreign_ok=kind in ("gate", "matrix"))
                for item in items]

    def _checker(self) -> RecordChecker:
        return RecordChecker(self.settings.log_name, self.trust,
                             kek=kek_from_settings(self.settings))

    def _producer_keys(self, session: Any) -> dict[str, RegisteredKey]:
        """Producer keys this worker believes (:meth:`RecordChecker.producer_keys`)."""
        return self._checker().producer_keys(session)

    def _log_verifiers(self, session: Any) -> list[NoteVerifier]:
        return self._checker().log_verifiers(session)

    def _check_item(self, item: ReplayJobItem, producers: dict[str, RegisteredKey], *,
                    foreign_ok: bool = False) -> Prepared:
        """Signature, inclusion, fingerprint, artifacts, sampling: anything that fails makes
        the item unverifiable with the reason."""
        self._maybe_crash(item)
        prep = Prepared(item)
        try:
            with session_scope(self.db) as session:
                envelope = self._signed_envelope(session, item, producers,
                                                 kek_from_settings(self.settings))
                prep.checkpoint = self._check_in_log(session, item, envelope)
            self._read_request(prep, envelope, foreign_ok=foreign_ok)
        except Unverifiable as exc:
            prep.problem = str(exc)
        return prep

    def _maybe_crash(self, item: ReplayJobItem) -> None:
        """Fault injection (tests of poisoned jobs): die abruptly on one request ID."""
        fault = self.settings.fault_crash_on_request_id
        if fault and item.request_id == fault:
            log.error("fault injection: exiting abruptly while replaying %s", fault)
            os._exit(137)

    @staticmethod
    def _signed_envelope(session: Any, item: ReplayJobItem,
                         producers: dict[str, RegisteredKey],
                         kek: KeyEncryptionKey | None = None) -> dsse.Envelope:
        """The stored envelope, its signature checked against a producer key this worker
        believes (:meth:`RecordChecker.signed_envelope`)."""
        return RecordChecker.signed_envelope(session, item.envelope_index, producers, kek)

    def _check_in_log(self, session: Any, item: ReplayJobItem,
                      envelope: dsse.Envelope) -> dict[str, Any]:
        """The envelope is in a checkpoint signed by a log key this worker trusts
        (:meth:`RecordChecker.check_in_log`)."""
        return self._checker().check_in_log(session, item.envelope_index, item.request_id,
                                            envelope)

    def _read_request(self, prep: Prepared, envelope: dsse.Envelope, *,
                      foreign_ok: bool) -> None:
        """Parse the signed statement into the request to replay and the recorded side."""
        try:
            statement = parse_statement(envelope.payload, READ_LIMITS)
        except LedgerError as exc:
            raise Unverifiable(f"the envelope does not parse: {exc.message}") from exc
        if not isinstance(statement, EnvelopeStatement):
            raise Unverifiable("a vendor record (tier semantic): only a vendor worker "
                               "(`ledger worker --vendor`) re-verifies it")
        p = statement.predicate
        recorded_fp = index_fields(statement).fingerprint_id
        if not foreign_ok and recorded_fp != self.fingerprint_id:
            raise Unverifiable(f"the envelope's fingerprint {recorded_fp} is not this "
                               f"worker's {self.fingerprint_id}")
        if p.artifacts.model_sha256 not in self.models:
            raise Unverifiable(f"model {p.artifacts.model_sha256} ({p.artifacts.model_name}) "
                               "is not on this worker")
        try:
            params = SamplingParams.from_mapping(p.sampling.model_dump())
            from workers.engine.sampling import validate

            validate(params)
        except (ValueError, TypeError) as exc:
            raise Unverifiable(f"unsupported sampling contract: {exc}") from exc
        prep.model_sha256 = p.artifacts.model_sha256
        prep.request = GenerationRequest(id=prep.item.request_id,
                                         prompt_token_ids=tuple(p.prompt_token_ids),
                                         sampling=params)
        out = p.output
        prep.recorded = Side(
            token_ids=out.token_ids, finish_reason=out.finish_reason, logprobs=out.logprobs,
            top_logprobs=[[(e.token_id, e.logprob) for e in step] for step in out.top_logprobs]
            if out.top_logprobs is not None else None,
            logits_sha256=out.logits_sha256)
        prep.tier = p.tier
        prep.tolerance = p.tolerance.max_abs_logprob_diff if p.tolerance else None

    def _kind(self, job_id: str) -> str | None:
        with self.db.connect() as conn:
            kind = conn.execute(select(ReplayJob.kind).where(
                ReplayJob.id == uuid.UUID(job_id))).scalar()
            conn.rollback()
        return kind

    def _run_matrix(self, job_id: str, prepared: list[Prepared]) -> str:
        """A matrix job: replay its checked records under each of its cells
        (``workers.engine.matrix``), sign the report with this worker's key and append it
        (``matrix_run`` leaf and row) as the job finishes. Items that failed a check are
        listed in the report, not replayed."""
        from ledger.replay.matrix import DEFAULT_CELLS
        from ledger.replay.matrix import report as matrix_report
        from ledger.replay.matrix_runs import run_id_for_job, store_matrix_run
        from workers.engine.matrix import Record, run_matrix

        with session_scope(self.db) as session:
            job = session.get(ReplayJob, uuid.UUID(job_id))
            assert job is not None
            params = dict(job.params or {})
        cells = list(params.get("cells") or DEFAULT_CELLS)
        unverified = [{"request_id": p.item.request_id, "log_index": p.item.envelope_index,
                       "reason": p.problem} for p in prepared if p.problem is not None]
        ok = [p for p in prepared if p.problem is None and p.request is not None
              and p.recorded is not None]
        records = [Record(p.item.request_id, p.request.prompt_token_ids, p.request.sampling,
                          {"token_ids": list(p.recorded.token_ids),
                           "logprobs": p.recorded.logprobs,
                           "logits_sha256": p.recorded.logits_sha256,
                           "top_logprobs": p.recorded.top_logprobs})
                   for p in ok if p.request is not None and p.recorded is not None]
        results = []
        if records:
            digests = {p.model_sha256 for p in ok if p.model_sha256 is not None}
            if len(digests) != 1:
                raise ValueError("a matrix job samples one model")
            engine = self.engine_for(next(iter(digests)))
            if not hasattr(engine, "batcher"):
                raise ValueError(f"the {self.engine_name} engine cannot vary the matrix axes "
                                 "(the reference engine can)")
            results = run_matrix(engine, records, cells)
        rep = matrix_report(
            results, runtime=self.runtime, records=[r.request_id for r in records],
            source=f"replay job {job_id} ({params.get('requested_by', 'unknown')})",
            unverified=unverified,
            verification="trust policy" if self.trust is not None
            else "INSECURE: keys from the database itself",
            tolerance=params.get("tolerance"))
        with session_scope(self.db) as session:
            job = session.get(ReplayJob, uuid.UUID(job_id), with_for_update=True)
            assert job is not None
            if job.state != JobState.RUNNING or job.worker_id != self.worker_id:
                return "skip"
            store_matrix_run(session, run_id=run_id_for_job(job.id), report=rep,
                             worker_id=self.worker_id, fingerprint_id=self.fingerprint_id,
                             runtime=self.runtime, signer=self.signer, job_id=job.id)
            job_service.finish(session, job, state=JobState.DONE, worker_id=self.worker_id)
        return JobState.DONE

    def _replay(self, prepared: list[Prepared]) -> list[GenerationResult | None]:
        """Run every replayable item, one batch per model, in job order."""
        results: list[GenerationResult | None] = [None] * len(prepared)
        by_model: dict[str, list[int]] = {}
        for i, prep in enumerate(prepared):
            if prep.problem is None and prep.model_sha256 is not None:
                by_model.setdefault(prep.model_sha256, []).append(i)
        for digest, positions in by_model.items():
            engine = self.engine_for(digest)
            reqs = [prepared[i].request for i in positions]
            outs = engine.generate([r for r in reqs if r is not None], max_batch=self.max_batch)
            for i, res in zip(positions, outs, strict=True):
                results[i] = res
        return results

    def _verdict_details(self, prep: Prepared, result: GenerationResult | None,
                         duration_ms: float, job: ReplayJob) -> tuple[str, dict[str, Any]]:
        base = {"job_id": str(job.id), "replay_duration_ms": round(duration_ms, 3),
                "replayed_at": datetime.now(UTC).isoformat(),
                "checkpoint": prep.checkpoint,
                "worker": {"worker_id": self.worker_id, "fingerprint_id": self.fingerprint_id,
                           "runtime": self.runtime}}
        if prep.problem is not None or result is None or prep.recorded is None:
            return "unverifiable", {**base, "tier": None, "reason": prep.problem}
        tolerance = prep.tolerance if prep.tolerance is not None else job.tolerance
        requested = prep.tier if job.tolerance is None else "tolerance"
        cmp = compare(prep.recorded, Side(result.token_ids, result.finish_reason,
                                          result.logprobs, result.top_logprobs,
                                          result.logits_sha256),
                      requested_tier=requested, tolerance=tolerance)
        details = {**base, **cmp.to_json(),
                   "replayed": {"tokens": len(result.token_ids),
                                "finish_reason": result.finish_reason,
                                "token_ids_sha256": hashlib.sha256(
                                    ("[" + ",".join(map(str, result.token_ids)) + "]").encode()
                                ).hexdigest(),
                                # the replay itself, so a reviewer sees the exact token diff
                                # (verdicts before this field have only the digest above)
                                "token_ids": list(result.token_ids),
                                "logprobs": None if result.logprobs is None
                                else list(result.logprobs),
                                "top_logprobs": None if result.top_logprobs is None else [
                                    [[int(t), float(lp)] for t, lp in step]
                                    for step in result.top_logprobs]},
                   "reason": None}
        details["first_divergence"] = details.pop("divergence")
        return cmp.outcome, details

    def _conclude(self, session: Any, job: ReplayJob,
                  pairs: list[tuple[Prepared, GenerationResult | None]], *,
                  duration_ms: float = 0.0, outcome_all: tuple[str, str] | None = None,
                  state: str = JobState.DONE) -> None:
        """Sign and store every verdict, finish the job: one transaction."""
        if outcome_all is not None and job.kind == "matrix":
            # a matrix job that cannot finish signs no verdicts on the records it sampled
            job_service.finish(session, job, state=state, worker_id=self.worker_id,
                               detail=outcome_all[1])
            return
        if outcome_all is not None:
            items = list(session.scalars(select(ReplayJobItem).where(
                ReplayJobItem.job_id == job.id).order_by(ReplayJobItem.position)))
            outcome, reason = outcome_all
            for item in items:
                details = {"job_id": str(job.id), "tier": None, "reason": reason,
                           "replayed_at": datetime.now(UTC).isoformat(),
                           "worker": {"worker_id": self.worker_id,
                                      "fingerprint_id": self.fingerprint_id}}
                store_verdict(session, job=job, item=item, outcome=outcome, details=details,
                              worker_id=self.worker_id, fingerprint_id=self.fingerprint_id,
                              signer=self.signer)
            job_service.finish(session, job, state=state, worker_id=self.worker_id,
                               detail=reason)
            return
        for prep, result in pairs:
            item = session.get(ReplayJobItem, (job.id, prep.item.position))
            outcome, details = self._verdict_details(prep, result, duration_ms, job)
            store_verdict(session, job=job, item=item, outcome=outcome, details=details,
                          worker_id=self.worker_id, fingerprint_id=self.fingerprint_id,
                          signer=self.signer)
        job_service.finish(session, job, state=state, worker_id=self.worker_id)

    def _failed(self, job_id: str, error: str) -> None:
        """An engine failure: retry through the sweeper, or an ``error`` verdict once the
        attempts are spent."""
        with session_scope(self.db) as session:
            job = session.get(ReplayJob, uuid.UUID(job_id), with_for_update=True)
            if job is None or job.state != JobState.RUNNING or job.worker_id != self.worker_id:
                return
            if job.attempts >= job.max_attempts:
                self._conclude(session, job, [], outcome_all=(
                    "error", f"engine failure after {job.attempts} attempts: {error}"),
                    state=JobState.FAILED)
                return
            job_service.finish(session, job, state=JobState.QUEUED, worker_id=self.worker_id,
                               detail=error, attempt_outcome="error")
            job.finished_at, job.worker_id, job.published_at = None, None, None
            job.state_reason = f"attempt {job.attempts} failed: {error}"
