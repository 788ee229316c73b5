"""The one settings object: the only reader of ``LEDGER_*`` environment variables.

(Two environment reads are not settings: ``PROMETHEUS_MULTIPROC_DIR``, prometheus-client's
multiprocess switch, which ``ledger serve --workers N`` sets and ``ledger.api.app`` reads;
and ``ledger serve`` handing its ``--database-url`` to its worker processes.)

Every field is read from an environment variable named ``LEDGER_<FIELD>`` (upper case),
e.g. ``LEDGER_DATABASE_URL``, ``LEDGER_BROKER_URL``.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LEDGER_", extra="ignore")

    # --- connections -------------------------------------------------------------------
    database_url: str = Field(
        default="postgresql+psycopg://postgres@127.0.0.1:5432/ledger",
        description="SQLAlchemy URL of the ledger database (psycopg 3 driver).",
    )
    database_role: str | None = Field(
        default=None,
        description="If set, every connection runs SET ROLE to this role (e.g. ledger_app), "
        "so the API works with only the grants that role has.",
    )
    db_pool_size: int = Field(default=10, ge=1, description="Database connections per "
                              "process pool, and as many again as overflow. An API process "
                              "has three pools (requests; ingest's key reads; the log's "
                              "proof reads) and the group commit's one connection: up to 6 x "
                              "this + 1 per `ledger serve` worker process, which PostgreSQL's "
                              "`max_connections` must allow.")
    broker_url: str = Field(default="redis://127.0.0.1:6379/0",
                            description="Celery broker (Redis, `noeviction`) that carries "
                            "replay jobs to the queues `replay.<fingerprint_id>`.")
    api_url: str = Field(default="http://127.0.0.1:8000",
                         description="Where CLI commands that talk to the API find it.")
    api_key: SecretStr | None = Field(default=None, description="API key for CLI commands.")

    # --- service -----------------------------------------------------------------------
    log_name: str = Field(
        default="inference-ledger.example/log",
        description="Origin line of every checkpoint (C2SP tlog-checkpoint).",
    )
    log_key_file: Path | None = Field(
        default=None,
        description="Ed25519 private key (PEM) that signs checkpoints. Without it the log "
        "is not integrated by this process.",
    )
    service_key_file: Path | None = Field(
        default=None,
        description="Ed25519 private key (PEM) with which the ledger signs its own records "
        "(dispute events, key and policy changes, re-verification claims). Disputes, admin "
        "changes and the beat's re-verification need it.",
    )
    worker_key_file: Path | None = Field(
        default=None, description="Ed25519 private key (PEM) a replay worker signs verdicts "
        "with (registered with purpose worker).")
    worker_heartbeat_s: float = Field(default=5.0, gt=0,
                                      description="How often a worker stamps its heartbeat.")
    vllm_engine_args: dict[str, Any] = Field(
        default_factory=dict, description="JSON object of extra `vllm.LLM` arguments for a "
        "worker with `--engine vllm` that share its GPU with other processes; only arguments "
        "that change memory, never numerics or batching: gpu_memory_utilization, "
        "kv_cache_memory_bytes, max_model_len.")
    vendor_name: str | None = Field(
        default=None, description="A vendor worker (`ledger worker --vendor`): the routing "
        "name of the hosted API whose records it re-verifies (the capture's --vendor).")
    vendor_base_url: str | None = Field(
        default=None, description="A vendor worker: the vendor's API base URL, e.g. "
        "https://api.example.com/v1; requests go to <base>/chat/completions or "
        "<base>/completions. The worker's own setting: the URL in a record is not used.")
    vendor_api_key_file: Path | None = Field(
        default=None, description="A vendor worker: a file holding the vendor API key "
        "(sent as a Bearer token). Held by the worker only, never stored in the database.")
    vendor_timeout_s: float = Field(default=120.0, gt=0, le=3600,
                                    description="A vendor worker: timeout per request.")
    semantic_samples: int = Field(default=20, ge=1, le=1000,
                                  description="Semantic verification: how many times a "
                                  "recorded vendor request is re-sent.")
    semantic_confidence: float = Field(default=0.95, gt=0, lt=1,
                                       description="Semantic verification: confidence of "
                                       "the Wilson intervals a verdict reports.")
    semantic_min_pass_rate: float = Field(default=1.0, ge=0, le=1,
                                          description="Semantic verification: a verdict is "
                                          "reproduced when at least this share of samples "
                                          "pass every assertion, else diverged.")
    worker_dead_after_s: float = Field(default=30.0, gt=0,
                                       description="No heartbeat for this long: not live.")
    replay_max_attempts: int = Field(default=3, ge=1, le=100,
                                     description="Deliveries before a job is poisoned.")
    replay_visibility_timeout_s: int = Field(
        default=3600, ge=1, description="Redis redelivers an unacknowledged job after this; "
        "keep it above the longest replay.")
    replay_expires_s: int = Field(default=86_400, ge=1,
                                  description="A published job message expires after this.")
    republish_after_s: float = Field(default=60.0, gt=0,
                                     description="Re-publish a queued job nobody started.")
    fault_crash_on_request_id: str | None = Field(
        default=None, description="FAULT INJECTION for tests: a worker process exits abruptly "
        "when it replays this request ID. Never set in production.")
    integrate_in_api: bool = Field(
        default=True, description="Run the integrator in API processes (one at a time).")
    integrate_max_entries: int = Field(default=20_000, ge=1, le=1_000_000,
                                       description="Most entries folded into one checkpoint.")
    integrate_interval_ms: int = Field(default=200, ge=1,
                                       description="Longest wait before pending entries "
                                       "are integrated.")
    kek_file: Path | None = Field(
        default=None, description="Key-encryption key (32 raw bytes or 64 hex characters; "
        "`ledger keys generate-kek` writes one), kept outside the database. With it, "
        "ingest stores envelope content encrypted under per-subject data keys that this "
        "key wraps (docs/privacy.md), and every reader of sealed content (API, worker, "
        "audit, export) needs it. Erasure destroys a subject's data keys.")
    trust_policy_file: Path | None = Field(
        default=None, description="Trust policy (TOML, see ledger.core.trust): the log, "
        "service and witness keys that audit, verify and workers believe. Kept outside the "
        "database on purpose.")
    # --- witnesses (C2SP tlog-witness; see docs/transparency-log.md, "Witnesses") ------
    witnesses: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Witnesses the integrator submits checkpoints to, each as '<url> "
        "<witness vkey>' (the URL is the witness's submission prefix, the vkey its "
        "cosignature/v1 key). In the environment: pairs separated by commas or newlines, "
        "or a JSON list of strings.")
    witness_timeout_s: float = Field(default=5.0, gt=0, le=300,
                                     description="Connect and read timeout per request.")
    witness_interval_ms: int = Field(default=500, ge=10,
                                     description="How often each witness's submitter looks "
                                     "for a newer checkpoint.")
    witness_max_backoff_s: float = Field(default=60.0, gt=0,
                                         description="Longest wait between retries to a "
                                         "witness that keeps failing.")
    witness_max_lag_s: float = Field(
        default=3600.0, gt=0, description="`ledger audit --trust` with a witness quorum: "
        "no checkpoint may wait longer than this for a newer one that reaches quorum.")

    @field_validator("witnesses", mode="before")
    @classmethod
    def _split_witnesses(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [p.strip() for p in re.split(r"[,\n]", text) if p.strip()]
        return value

    checkpoint_sink_dir: Path | None = Field(
        default=None, description="Directory that receives a write-once copy of every "
        "checkpoint (outside the database).")
    data_dir: Path = Field(default=Path(".ledger"), description="Local state: keys, spool.")
    api_key_pepper: SecretStr = Field(
        default=SecretStr(""),
        description="Server secret mixed into API-key hashes (HMAC-SHA256). Set it in production.",
    )

    max_inflight_requests: int = Field(default=64, ge=1,
                                       description="Per API process; beyond it: 503.")
    max_inflight_bytes: int = Field(default=256 * 1024 * 1024, ge=1,
                                    description="Declared request bytes held at once per "
                                    "API process; beyond it: 503 (bounded memory).")
    db_pool_timeout_s: float = Field(default=10.0, gt=0,
                                     description="Wait for a pooled connection, then 503.")

    # --- input limits ------------------------------------------------------------------
    max_envelope_bytes: int = Field(default=4 * 1024 * 1024, ge=1,
                                    description="Largest DSSE envelope (JSON) accepted, as "
                                    "received.")
    max_request_bytes: int = Field(default=64 * 1024 * 1024, ge=1,
                                   description="Largest HTTP body (batch ingest).")
    max_batch_items: int = Field(default=1000, ge=1,
                                 description="Most envelopes in one batch ingest.")
    max_prompt_tokens: int = Field(default=262_144, ge=1,
                                   description="Most prompt tokens in one envelope.")
    max_output_tokens: int = Field(default=65_536, ge=1,
                                   description="Most output tokens in one envelope.")
    max_token_id: int = Field(default=16_777_215, ge=1,  # 2**24 - 1: above any real vocab
                              description="Largest token ID accepted.")
    max_top_logprobs: int = Field(default=20, ge=0,
                                  description="Most top-k logprobs per output step.")

    # --- broker timeouts and the metrics listener ----------------------------------------
    broker_publish_timeout_s: float = Field(
        default=0.1, gt=0, le=30, description="Connect + send limit of the API's publish of "
        "a dispute's job after commit; a job that misses it stays in the outbox and "
        "`ledger beat`'s sweeper delivers it (a request never waits on a broker that is "
        "down).")
    metrics_port: int = Field(
        default=9464, ge=0, le=65535, description="Port of the Prometheus `/metrics` "
        "listener of `ledger serve`, apart from the API (0: none). With several server "
        "processes one of them holds it and reports the sum over all.")
    metrics_host: str = Field(
        default="127.0.0.1", description="Interface of the metrics listener; loopback by "
        "default, so only a scraper on the host (or a sidecar) reads it.")
    otel: bool = Field(
        default=False, description="FastAPI's native OpenTelemetry (traces, metrics and "
        "logs to the global OpenTelemetry providers your deployment configures). Off by "
        "default: when on, every request first asks the global providers whether one is "
        "configured.")

    # --- least privilege (docs/deployment.md, "Database roles") -------------------------
    database_password_file: Path | None = Field(
        default=None, description="A file holding the database password (a mounted secret); "
        "it replaces any password in LEDGER_DATABASE_URL, so the URL itself carries none.")
    insecure_dev: bool = Field(
        default=False, description="Development only: let `ledger serve`, `beat` and "
        "`worker` start as a superuser or the schema owner, or without the pepper or "
        "private key they need (they refuse to otherwise). `ledger demo` turns it on.")

    # --- alerts (docs/replay.md, "Alerts") ---------------------------------------------
    webhook_url: str | None = Field(
        default=None, description="If set, `ledger beat` POSTs a signed JSON alert here "
        "when a re-verification run's drift rate exceeds its policy's threshold and when a "
        "fingerprint gate fails.")
    webhook_secret: SecretStr | None = Field(
        default=None, description="HMAC-SHA256 key of the alert webhook: the body's MAC is "
        "sent as `X-Ledger-Signature: sha256=<hex>`. Without it alerts are signed with the "
        "service key (Ed25519, `X-Ledger-Signature: ed25519=<base64>`).")
    webhook_retries: int = Field(default=5, ge=0, le=50,
                                 description="Retries of an alert that fails (exponential "
                                 "back-off from 0.5 s).")
    webhook_timeout_s: float = Field(default=5.0, gt=0, le=120,
                                     description="Connect and read timeout per alert POST.")


#: Which commands read each setting ("all": every command that opens the database).
#: docs/settings.md is generated from this and the field descriptions
#: (``python -m scripts.gen_settings_doc``); a test keeps it current.
USED_BY: dict[str, tuple[str, ...]] = {
    "database_url": ("serve", "beat", "worker", "check", "db", "keys", "apikey", "audit",
                     "export", "integrate"),
    "database_role": ("serve", "beat", "worker"),
    "db_pool_size": ("serve",),
    "broker_url": ("serve", "beat", "worker", "check"),
    "api_url": ("keys register --api", "proxy"),
    "api_key": ("keys register --api", "proxy"),
    "log_name": ("serve", "beat", "worker", "audit", "integrate", "check"),
    "log_key_file": ("serve", "beat", "integrate", "check"),
    "service_key_file": ("serve", "beat", "worker --register-key", "keys", "apikey",
                         "integrate", "check"),
    "worker_key_file": ("worker", "check worker"),
    "worker_heartbeat_s": ("worker",),
    "vllm_engine_args": ("worker --engine vllm",),
    "vendor_name": ("worker --vendor",),
    "vendor_base_url": ("worker --vendor",),
    "vendor_api_key_file": ("worker --vendor",),
    "vendor_timeout_s": ("worker --vendor",),
    "semantic_samples": ("worker --vendor",),
    "semantic_confidence": ("worker --vendor",),
    "semantic_min_pass_rate": ("worker --vendor",),
    "worker_dead_after_s": ("serve", "beat"),
    "replay_max_attempts": ("serve", "beat"),
    "replay_visibility_timeout_s": ("serve", "beat", "worker"),
    "replay_expires_s": ("serve", "beat"),
    "republish_after_s": ("beat",),
    "fault_crash_on_request_id": ("worker",),
    "integrate_in_api": ("serve", "check serve"),
    "integrate_max_entries": ("serve", "beat", "integrate"),
    "integrate_interval_ms": ("serve", "beat", "integrate"),
    "kek_file": ("serve", "beat", "worker", "audit", "export", "check"),
    "trust_policy_file": ("worker", "audit", "verify", "check"),
    "witnesses": ("serve", "beat", "integrate"),
    "witness_timeout_s": ("serve", "beat", "integrate"),
    "witness_interval_ms": ("serve", "beat", "integrate"),
    "witness_max_backoff_s": ("serve", "beat", "integrate"),
    "witness_max_lag_s": ("audit",),
    "checkpoint_sink_dir": ("serve", "beat", "integrate"),
    "data_dir": ("proxy",),
    "api_key_pepper": ("serve", "apikey", "check serve"),
    "max_inflight_requests": ("serve",),
    "max_inflight_bytes": ("serve",),
    "db_pool_timeout_s": ("serve",),
    "max_envelope_bytes": ("serve",),
    "max_request_bytes": ("serve",),
    "max_batch_items": ("serve",),
    "max_prompt_tokens": ("serve",),
    "max_output_tokens": ("serve",),
    "max_token_id": ("serve",),
    "max_top_logprobs": ("serve",),
    "broker_publish_timeout_s": ("serve",),
    "metrics_port": ("serve",),
    "metrics_host": ("serve",),
    "otel": ("serve",),
    "database_password_file": ("serve", "beat", "worker", "db"),
    "insecure_dev": ("serve", "beat", "worker", "check"),
    "webhook_url": ("beat",),
    "webhook_secret": ("beat",),
    "webhook_retries": ("beat",),
    "webhook_timeout_s": ("beat",),
}


def env_name(field: str) -> str:
    return f"LEDGER_{field.upper()}"


def _default_text(name: str) -> str:
    info = Settings.model_fields[name]
    if info.default_factory is not None:
        value: object = info.default_factory()  # type: ignore[call-arg]
    else:
        value = info.default
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if value is None or value == "" or value == []:
        return "(unset)"
    return f"`{value}`"


def settings_markdown() -> str:
    """docs/settings.md: every LEDGER_* variable, its meaning, default and readers."""
    lines = [
        "# Settings",
        "",
        "Generated from `ledger/settings.py` (the one settings object) by "
        "`python -m scripts.gen_settings_doc`; `tests/test_settings_doc.py` fails when it is "
        "stale. Every setting is an environment variable. `ledger check serve|beat|worker|"
        "proxy` validates the ones a component needs and names each one that is wrong.",
        "",
        "| variable | default | used by | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for name, info in Settings.model_fields.items():
        desc = " ".join((info.description or "").split()).replace("|", "\\|")
        used = ", ".join(f"`{c}`" for c in USED_BY[name])
        lines.append(f"| `{env_name(name)}` | {_default_text(name)} | {used} | {desc} |")
    return "\n".join(lines) + "\n"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
