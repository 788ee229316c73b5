"""`ledger check`: is a component's configuration complete and consistent?

One function per concern, each returning :class:`Problem` lines that name the setting to
fix. ``serve``, ``beat`` and ``worker`` run :func:`check` at start-up
(:func:`ledger.db.privileges.enforce`) and refuse to start on any problem that is their
own configuration. Problems with *other* services at this moment (the database or the
broker unreachable, migrations pending) are reported by ``ledger check`` and ``/readyz``
but do not stop a start-up: those processes retry outages on their own.

A worker also runs :func:`worker_job_problems` before it claims a job, so that a job is
never given a verdict caused by the worker's own configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.exc import DBAPIError, OperationalError

from ledger.settings import Settings, env_name

COMPONENTS = ("serve", "beat", "worker", "proxy")
EXAMPLE_LOG_NAME = Settings.model_fields["log_name"].default
PURPOSES = {"log_key_file": "log", "service_key_file": "ledger", "worker_key_file": "worker"}


@dataclass(frozen=True)
class Problem:
    setting: str
    message: str
    #: "config": a start-up refuses; "insecure": refuses unless LEDGER_INSECURE_DEV /
    #: --insecure-dev; "transient": another service's state now (unreachable, not
    #: migrated): reported, a start-up goes on and retries; "advice": reported by
    #: `ledger check` (and its exit status), a warning at start-up
    kind: str = "config"

    def line(self) -> str:
        return f"{self.setting}: {self.message}"

    def counts(self, insecure_dev: bool) -> bool:
        """Whether this problem fails ``ledger check`` (and /readyz unless advice)."""
        return not (insecure_dev and self.kind == "insecure")


def _p(field: str, message: str, **kw: Any) -> Problem:
    return Problem(env_name(field), message, **kw)


# --- settings alone (no I/O beyond reading files) ------------------------------------

def _key_files(component: str, settings: Settings, worker_key: Path | None) -> dict[str, Path]:
    """The private keys ``component`` signs with: setting name -> file."""
    files: dict[str, Path | None] = {}
    if component == "serve":
        if settings.integrate_in_api:
            files["log_key_file"] = settings.log_key_file
        files["service_key_file"] = settings.service_key_file
    elif component == "beat":
        files["log_key_file"] = settings.log_key_file
        files["service_key_file"] = settings.service_key_file
    elif component == "worker":
        files["worker_key_file"] = worker_key or settings.worker_key_file
    return {k: v for k, v in files.items() if v is not None}


def settings_problems(settings: Settings, component: str, *,
                      worker_key: Path | None = None) -> list[Problem]:
    problems: list[Problem] = []
    if component == "serve":
        if not settings.api_key_pepper.get_secret_value():
            problems.append(_p("api_key_pepper", "is not set: set it to a long random secret "
                               "(API keys are stored as HMAC-SHA256 with it)", kind="insecure"))
        if settings.integrate_in_api and settings.log_key_file is None:
            problems.append(_p("log_key_file", "is not set: set it to the log's private key, "
                               "or LEDGER_INTEGRATE_IN_API=false where `ledger beat` "
                               "integrates (otherwise envelopes are never integrated)",
                               kind="insecure"))
        if settings.service_key_file is None:
            problems.append(_p("service_key_file", "is not set: disputes cannot be opened "
                               "(their events are signed with it)", kind="advice"))
    elif component == "beat":
        if settings.log_key_file is None:
            problems.append(_p("log_key_file", "is not set: set it to the log's private key "
                               "(the beat runs the integrator)", kind="insecure"))
        if settings.service_key_file is None:
            problems.append(_p("service_key_file", "is not set: re-verification windows "
                               "are not claimed (each claim is signed with it)",
                               kind="advice"))
    elif component == "worker":
        if worker_key is None and settings.worker_key_file is None:
            problems.append(_p("worker_key_file", "is not set: set it (or pass --key) to this "
                               "worker's private key", kind="insecure"))
        if settings.trust_policy_file is None:
            problems.append(_p("trust_policy_file", "is not set: a worker believes only its "
                               "trust policy (`ledger trust init` writes one; "
                               "--insecure-dev trusts the database's own keys)",
                               kind="insecure"))
    elif component == "proxy" and settings.api_key is None:
        problems.append(_p("api_key", "is not set: the proxy delivers envelopes with an "
                           "ingester API key"))
    if component in ("serve", "beat", "worker") and "log_name" not in settings.model_fields_set:
        problems.append(_p("log_name", f"is not set (the example {EXAMPLE_LOG_NAME!r} is "
                           "used): set it to your log's origin, the first line of its "
                           "checkpoints", kind="advice"))
    for field, path in _key_files(component, settings, worker_key).items():
        problems += _key_file_problems(field, path)
    problems += trust_problems(settings, component)
    problems += kek_problems(settings, component)
    return problems


KEK_COMPONENTS = ("serve", "beat", "worker")


def kek_problems(settings: Settings, component: str) -> list[Problem]:
    """``LEDGER_KEK_FILE`` (docs/privacy.md) must hold a 256-bit key where it is set."""
    if settings.kek_file is None or component not in KEK_COMPONENTS:
        return []
    from ledger.privacy.keys import kek_from_settings

    try:
        kek_from_settings(settings)
    except OSError as exc:
        return [_p("kek_file", f"{settings.kek_file}: cannot be read ({exc.strerror})")]
    except ValueError as exc:
        return [_p("kek_file", f"{settings.kek_file}: {exc}")]
    return []


def _kek_database_problems(settings: Settings, engine: Engine) -> list[Problem]:
    """Data keys in the database need this KEK: present, and the one that wrapped them."""
    from sqlalchemy import text

    from ledger.privacy.keys import kek_from_settings

    with engine.connect() as conn:
        ids = [r[0] for r in conn.execute(text(
            "SELECT DISTINCT kek_id FROM data_keys LIMIT 5")).all()]
    if not ids:
        return []
    try:
        kek = kek_from_settings(settings)
    except (OSError, ValueError):
        return []  # reported by kek_problems
    if kek is None:
        return [_p("kek_file", "is not set, but the database holds envelopes encrypted at "
                   "rest: set it to the key-encryption key (docs/privacy.md)")]
    if kek.kek_id not in ids:
        return [_p("kek_file", f"this KEK (id {kek.kek_id}) did not wrap the database's data "
                   f"keys (KEK ids {', '.join(sorted(ids))}): wrong key file?")]
    return []


def _key_file_problems(field: str, path: Path) -> list[Problem]:
    from ledger.core.keys import load_private_pem

    try:
        load_private_pem(path.read_bytes())
    except OSError as exc:
        return [_p(field, f"cannot read {path}: {exc.strerror or exc}")]
    except Exception as exc:  # noqa: BLE001 - whatever the PEM parser raises
        return [_p(field, f"{path} is not an Ed25519 private key (PEM): {exc}")]
    return []


def trust_problems(settings: Settings, component: str) -> list[Problem]:
    if settings.trust_policy_file is None or component not in ("worker", "beat", "serve"):
        return []
    from ledger.core.errors import LedgerError
    from ledger.core.trust import load_trust_policy

    try:
        policy = load_trust_policy(settings.trust_policy_file)
    except (LedgerError, OSError) as exc:
        message = exc.message if isinstance(exc, LedgerError) else str(exc)
        return [_p("trust_policy_file", f"{settings.trust_policy_file}: {message}")]
    if policy.origin != settings.log_name:
        return [_p("log_name", f"is {settings.log_name!r}, but the trust policy "
                   f"{settings.trust_policy_file} trusts the log {policy.origin!r}")]
    return []


# --- the database --------------------------------------------------------------------

def database_problems(settings: Settings, engine: Engine, component: str, *,
                      worker_key: Path | None = None,
                      register_key: bool = False) -> list[Problem]:
    from ledger.db.session import current_revision, head_revision

    try:
        current = current_revision(engine)
    except (OperationalError, DBAPIError) as exc:
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0][:200]
        return [_p("database_url", f"the database is unreachable ({reason})", kind="transient")]
    problems: list[Problem] = []
    head = head_revision(str(engine.url))
    if current != head:
        problems.append(_p("database_url", f"the database is at revision {current}, the code "
                           f"expects {head}: run `ledger db upgrade`", kind="transient"))
        return problems
    if component in ("serve", "beat", "worker"):
        from ledger.db.privileges import check_runtime_role

        role = "api" if component == "serve" else component
        problems += [Problem("LEDGER_DATABASE_URL", line.removeprefix("LEDGER_DATABASE_URL "),
                             kind="insecure")
                     for line in check_runtime_role(engine, role)]
        if problems and not settings.insecure_dev:  # this login is not the real one
            return problems
    problems += _registered_problems(settings, engine, component, worker_key, register_key)
    problems += _log_name_problems(settings, engine)
    if component in KEK_COMPONENTS:
        problems += _kek_database_problems(settings, engine)
    if component == "worker" and not problems:
        problems += _trusted_checkpoint_problems(settings, engine)
    return problems


def _registered_problems(settings: Settings, engine: Engine, component: str,
                         worker_key: Path | None, register_key: bool) -> list[Problem]:
    from ledger.core.keys import key_id, load_private_pem, public_raw
    from ledger.db.models import SigningKey

    problems = []
    for field, path in _key_files(component, settings, worker_key).items():
        try:
            keyid = key_id(public_raw(load_private_pem(path.read_bytes())))
        except Exception:  # noqa: BLE001,S112 - reported by _key_file_problems
            continue
        purpose = PURPOSES[field]
        with engine.connect() as conn:
            row = conn.execute(select(SigningKey.purpose, SigningKey.status).where(
                SigningKey.keyid == keyid)).first()
        if row is None:
            # serve registers its own keys; the beat does where its login may (development)
            if component == "serve" or (component == "worker" and register_key):
                continue
            problems.append(_p(field, f"the key {keyid[:16]}... in {path} is not registered: "
                               f"an admin runs `ledger keys register {path}.pub --purpose "
                               f"{purpose} --name NAME`",
                               kind="insecure" if component == "beat" else "config"))
        elif row.purpose != purpose or row.status != "active":
            problems.append(_p(field, f"the key {keyid[:16]}... in {path} is registered as "
                               f"{row.status} {row.purpose} key, not an active {purpose} key"))
    return problems


def latest_checkpoint_note(engine: Engine) -> bytes | None:
    from ledger.db.models import CheckpointRow

    with engine.connect() as conn:
        note = conn.execute(select(CheckpointRow.note).order_by(
            CheckpointRow.tree_size.desc()).limit(1)).scalar()
    return bytes(note) if note is not None else None


def _log_name_problems(settings: Settings, engine: Engine) -> list[Problem]:
    note = latest_checkpoint_note(engine)
    if note is None:
        return []
    origin = note.split(b"\n", 1)[0].decode("utf-8", "replace")
    if origin != settings.log_name:
        return [_p("log_name", f"is {settings.log_name!r}, but the log's checkpoints are "
                   f"signed for {origin!r}: set LEDGER_LOG_NAME={origin}")]
    return []


def worker_job_problems(settings: Settings, engine: Engine) -> list[Problem]:
    """What a worker re-checks before it claims a job: a failure here is the worker's
    configuration, not the record's, so the job is handed back instead of judged.

    Only the log name: a checkpoint that does not verify under the trust policy's keys
    looks the same to a worker whether its policy is wrong or an insider re-signed the
    log, so at job time it is a verdict (``unverifiable``, with the reason); at start-up
    ``ledger check worker`` refuses on it."""
    return _log_name_problems(settings, engine)


def _trusted_checkpoint_problems(settings: Settings, engine: Engine) -> list[Problem]:
    note = latest_checkpoint_note(engine)
    if note is None or settings.trust_policy_file is None:
        return []
    from ledger.core.errors import LedgerError
    from ledger.core.note import open_checkpoint
    from ledger.core.trust import load_trust_policy
    from ledger.log.signer import trusted_log_verifiers

    try:
        trust = load_trust_policy(settings.trust_policy_file)
        open_checkpoint(note, trusted_log_verifiers(trust, settings.log_name),
                        origin=settings.log_name)
    except (LedgerError, OSError) as exc:
        message = exc.message if isinstance(exc, LedgerError) else str(exc)
        return [_p("trust_policy_file", f"the log's latest checkpoint does not verify under "
                   f"the trust policy's log keys ({message}): check the policy (or the log: "
                   "`ledger audit --trust`)")]
    return []


# --- brokers and neighbours ------------------------------------------------------------

def broker_problems(settings: Settings) -> list[Problem]:
    import redis

    try:
        client = redis.Redis.from_url(settings.broker_url, socket_timeout=2,
                                      socket_connect_timeout=2)
        client.ping()
        client.close()
    except (redis.RedisError, OSError, ValueError) as exc:
        return [_p("broker_url", f"the broker is unreachable ({exc})", kind="transient")]
    return []


def api_problems(settings: Settings) -> list[Problem]:
    import httpx

    try:
        httpx.get(settings.api_url.rstrip("/") + "/healthz", timeout=3).raise_for_status()
    except httpx.HTTPError as exc:
        return [_p("api_url", f"the ledger API at {settings.api_url} does not answer ({exc})",
                   kind="transient")]
    return []


def check(settings: Settings, component: str, *, engine: Engine | None = None,
          worker_key: Path | None = None, register_key: bool = False,
          broker: bool = True) -> list[Problem]:
    """Every problem with ``component``'s configuration, settings first."""
    if component not in COMPONENTS:
        raise ValueError(f"component must be one of {', '.join(COMPONENTS)}")
    problems = settings_problems(settings, component, worker_key=worker_key)
    if component == "proxy":
        return problems + api_problems(settings)
    own = engine is None
    if engine is None:
        from ledger.db.session import make_engine

        engine = make_engine(settings, pool_size=1)
    try:
        problems += database_problems(settings, engine, component, worker_key=worker_key,
                                      register_key=register_key)
    finally:
        if own:
            engine.dispose()
    if broker and component in ("beat", "worker"):
        problems += broker_problems(settings)
    return problems


def refusals(problems: list[Problem], *, insecure_dev: bool) -> list[Problem]:
    """The problems a start-up refuses on."""
    return [p for p in problems
            if p.kind == "config" or (p.kind == "insecure" and not insecure_dev)]


@dataclass(frozen=True)
class Readiness:
    failing: list[Problem]
    warnings: list[Problem]
    code: str | None  # of the first failing check, for /readyz's problem+json

    def as_json(self, problems: list[Problem]) -> list[dict[str, str]]:
        return [{"setting": p.setting, "problem": p.message, "kind": p.kind} for p in problems]


def readiness(settings: Settings, engine: Engine) -> Readiness:
    """What ``/readyz`` reports: every failing ``ledger check serve`` check (the broker
    is left out: a dispute is accepted while it is down and delivered later)."""
    problems = check(settings, "serve", engine=engine, broker=False)
    failing = [p for p in problems if p.kind != "advice" and p.counts(settings.insecure_dev)]
    warnings = [p for p in problems if p not in failing]
    code = None
    if failing:
        first = failing[0].message
        code = ("database_unreachable" if "unreachable" in first and
                failing[0].setting == "LEDGER_DATABASE_URL" else
                "migrations_pending" if "ledger db upgrade" in first else "misconfigured")
    return Readiness(failing, warnings, code)
