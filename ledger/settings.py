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
    db_pool_size: int = 10
    broker_url: str = "redis://127.0.0.1:6379/0"
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
        "(dispute events). Disputes need it.",
    )
    worker_key_file: Path | None = Field(
        default=None, description="Ed25519 private key (PEM) a replay worker signs verdicts "
        "with (registered with purpose worker).")
    worker_heartbeat_s: float = Field(default=5.0, gt=0)
    vllm_engine_args: dict[str, Any] = Field(
        default_factory=dict, description="JSON object of extra `vllm.LLM` arguments for a "
        "worker with `--engine vllm` that share its GPU with other processes; only arguments "
        "that change memory, never numerics or batching: gpu_memory_utilization, "
        "kv_cache_memory_bytes, max_model_len.")
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
    max_envelope_bytes: int = 4 * 1024 * 1024        # one DSSE envelope (JSON), as received
    max_request_bytes: int = 64 * 1024 * 1024        # one HTTP body (batch ingest)
    max_batch_items: int = 1000
    max_prompt_tokens: int = 262_144
    max_output_tokens: int = 65_536
    max_token_id: int = 16_777_215                   # 2**24 - 1: larger than any real vocab
    max_top_logprobs: int = 20

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

    # --- least privilege (docs/deployment.md, "Database roles") -------------------------
    database_password_file: Path | None = Field(
        default=None, description="A file holding the database password (a mounted secret); "
        "it replaces any password in LEDGER_DATABASE_URL, so the URL itself carries none.")
    insecure_dev: bool = Field(
        default=False, description="Development only: let `ledger serve`, `beat` and "
        "`worker` start as a superuser or the schema owner, or without the pepper or "
        "private key they need (they refuse to otherwise). `ledger demo` turns it on.")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
