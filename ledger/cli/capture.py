"""Capture commands: ``ledger proxy`` and ``ledger engine serve``.

``proxy`` runs on gateways without torch; ``engine serve`` imports the engine (and torch)
inside the command only, so ``ledger --help`` stays light.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import typer

from ledger.cli.common import console
from ledger.settings import get_settings

TINY_DEMO = "tiny-demo"


def _fail(message: str, hint: str = "check the arguments (`--help`) and docs/capture.md"
          ) -> typer.Exit:
    from ledger.cli.common import fail

    return fail(message, hint)


def proxy_command(
    upstream: str = typer.Option(..., "--upstream",
                                 help="Base URL of the OpenAI-compatible server, e.g. "
                                      "http://127.0.0.1:8000 (vLLM) - without /v1."),
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(8300, help="TCP port."),
    key: Optional[Path] = typer.Option(  # noqa: UP045 - typer
        None, "--key", help="Producer private key (PEM, from `ledger keys generate`)."),
    fingerprint: Optional[Path] = typer.Option(  # noqa: UP045
        None, "--fingerprint", help="Runtime of the GPU node: the JSON `ledger fingerprint` "
                                    "prints there."),
    artifacts: Optional[Path] = typer.Option(  # noqa: UP045
        None, "--artifacts", help="The JSON `ledger artifact hash MODEL_DIR` prints."),
    sampling_defaults: Optional[Path] = typer.Option(  # noqa: UP045
        None, "--sampling-defaults",
        help="JSON of the upstream's defaults for absent sampling values (mirror the "
             "model's generation_config.json); default: vLLM's fallbacks."),
    spool: Optional[Path] = typer.Option(  # noqa: UP045
        None, "--spool", help="Spool directory (default: LEDGER_DATA_DIR/spool)."),
    spool_max_bytes: int = typer.Option(1 << 30, "--spool-max-bytes", min=1,
                                        help="Quota of the spool (envelope bytes)."),
    when_full: str = typer.Option("fail", "--when-full",
                                  help="fail: answer 503 while the spool is full; "
                                       "drop: serve and drop envelopes (counted, logged)."),
    ledger_url: Optional[str] = typer.Option(  # noqa: UP045
        None, "--ledger-url", help="Ledger API base URL (default: LEDGER_API_URL)."),
    channel: Optional[str] = typer.Option(  # noqa: UP045
        None, help="deterministic | performance (default: from runtime.batch_invariant)."),
    tier: Optional[str] = typer.Option(None, help="bitwise | token."),  # noqa: UP045
    vendor: Optional[str] = typer.Option(  # noqa: UP045
        None, "--vendor", help="The upstream is a hosted vendor API with this routing name: "
        "record vendor envelopes (v2, tier semantic), nothing asked of it that the client "
        "did not ask; --fingerprint and --artifacts are not used."),
    assertions: Optional[Path] = typer.Option(  # noqa: UP045
        None, "--assertions", help="With --vendor: an assertion set (JSON, "
        "docs/semantic.md) signed into every envelope for semantic verification."),
    strict: bool = typer.Option(False, help="Refuse (400) requests no envelope can "
                                            "describe instead of forwarding them unrecorded."),
    no_record: bool = typer.Option(False, "--no-record",
                                   help="Forward only (a baseline for benchmarks)."),
    max_backoff: float = typer.Option(30.0, help="Longest wait between delivery retries (s)."),
    log_level: str = typer.Option("warning", help="Log level."),
) -> None:
    """Run the recording reverse proxy in front of an OpenAI-compatible server.

    The ledger API key (ingester role) comes from LEDGER_API_KEY.
    """
    import uvicorn

    from ledger.capture import CaptureConfigError, CaptureProxy, Recorder

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    settings = get_settings()
    recorder = None
    if not no_record:
        common: dict[str, Any] = {"spool_dir": spool or settings.data_dir / "spool",
                  "ledger_url": ledger_url or settings.api_url,
                  "api_key": settings.api_key.get_secret_value() if settings.api_key else None,
                  "max_bytes": spool_max_bytes, "when_full": when_full,
                  "max_backoff": max_backoff}
        if vendor is not None:
            if key is None:
                raise _fail("--key is required (or --no-record)")
            if channel is not None or tier is not None:
                raise _fail("--channel and --tier do not apply to a vendor (its records "
                            "are channel vendor, tier semantic)")
            try:
                assertion_set = None if assertions is None else json.loads(
                    assertions.read_text("utf-8"))
                recorder = Recorder.for_vendor(key=key, name=vendor, base_url=upstream,
                                               assertions=assertion_set, **common)
            except (CaptureConfigError, OSError, ValueError) as exc:
                raise _fail(str(exc)) from exc
        else:
            if key is None or fingerprint is None or artifacts is None:
                raise _fail("--key, --fingerprint and --artifacts are required "
                            "(or --vendor NAME, or --no-record)")
            if assertions is not None:
                raise _fail("--assertions needs --vendor")
            try:
                recorder = Recorder.from_files(
                    key=key, artifacts=artifacts, fingerprint=fingerprint,
                    sampling_defaults=sampling_defaults, channel=channel, tier=tier,
                    **common)
            except (CaptureConfigError, ValueError) as exc:
                raise _fail(str(exc)) from exc
        console.print(f"recording to {recorder.spool.directory} -> "
                      f"{ledger_url or settings.api_url} "
                      f"(fingerprint {recorder.config.fingerprint_id}, "
                      f"{recorder.config.effective_channel})")
    app = CaptureProxy(upstream, recorder, strict=strict)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False,
                    server_header=False, date_header=False, lifespan="on",
                    timeout_graceful_shutdown=10)
    finally:
        if recorder is not None:
            recorder.close()


def engine_serve_command(
    model: str = typer.Option(TINY_DEMO, "--model", help="Model directory, or tiny-demo."),
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(8100, help="TCP port."),
    served_model_name: Optional[str] = typer.Option(  # noqa: UP045
        None, "--served-model-name", help="The model name clients use (default: the "
                                          "model's name)."),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
    max_batch: int = typer.Option(8, "--max-batch", min=1,
                                  help="Requests running at once (continuous batching)."),
    batch_wait_ms: float = typer.Option(2.0, "--batch-wait-ms", min=0.0,
                                        help="How long a static batch waits for co-tenants "
                                             "(engines without continuous batching)."),
    prefill_chunk: Optional[int] = typer.Option(  # noqa: UP045
        None, "--prefill-chunk", min=1, help="Prompt tokens prefilled per step and request "
                                             "(default: whole prompts)."),
    prefix_cache_blocks: int = typer.Option(
        0, "--prefix-cache-blocks", min=0, help="Pages of 16 tokens kept for prompt-prefix "
                                                "reuse (0: no prefix cache)."),
    warm_up_len: Optional[int] = typer.Option(  # noqa: UP045
        None, "--warm-up-len", min=0, help="Before serving, size the KV cache for "
        "--max-batch requests of this many positions and capture the CUDA graphs, so that "
        "no early request waits for a capture (default: 2048 on CUDA, 0 on CPU; 0: none)."),
    no_batch_invariant: bool = typer.Option(False, "--no-batch-invariant",
                                            help="Fast kernels (the performance channel)."),
    threads: Optional[int] = typer.Option(  # noqa: UP045
        None, "--threads", min=1, help="torch intra-op threads on CPU (part of the "
                                       "fingerprint; default 1, as `ledger fingerprint`)."),
    write_fingerprint: Optional[Path] = typer.Option(  # noqa: UP045
        None, "--write-fingerprint", help="Write this server's fingerprint JSON here (what "
                                          "`ledger proxy --fingerprint` reads)."),
    log_level: str = typer.Option("warning", help="uvicorn log level."),
) -> None:
    """Serve the reference engine behind an OpenAI-compatible API (vLLM's token-ID fields)."""
    import uvicorn

    try:
        import torch

        from workers.engine import DEFAULT_CPU_THREADS, load_engine
        from workers.serve.app import create_app
        from workers.serve.tokenizer import ByteTokenizer
    except ImportError as exc:
        raise _fail(f"the reference engine needs torch: {exc}") from exc
    del torch  # imported to fail early without it; load_engine sets the threads
    with console.status("loading model"):
        try:
            engine = load_engine(model, device=device, dtype=dtype,
                                 batch_invariant=not no_batch_invariant,
                                 threads=threads or DEFAULT_CPU_THREADS)
        except (OSError, ValueError) as exc:
            raise _fail(str(exc)) from exc
    if prefix_cache_blocks:
        from workers.engine.prefix_cache import PrefixCache

        engine.prefix_cache = PrefixCache(pages=prefix_cache_blocks)
    tokenizer = ByteTokenizer() if engine.config.vocab_size == ByteTokenizer.vocab_size \
        and model == TINY_DEMO else None
    name = served_model_name or (TINY_DEMO if model == TINY_DEMO else Path(model).name)
    if warm_up_len is None:
        warm_up_len = 2048 if device == "cuda" else 0
    with console.status("warming up (KV cache, CUDA graphs)" if warm_up_len else "starting"):
        try:
            app = create_app(engine, served_model_name=name, tokenizer=tokenizer,
                             max_batch=max_batch, batch_wait_s=batch_wait_ms / 1000,
                             prefill_chunk=prefill_chunk, warm_up_len=warm_up_len)
        except RuntimeError as exc:       # torch.OutOfMemoryError, or the CPU allocator's
            text = str(exc)
            if "memory" not in text.lower():
                raise
            first = (text.splitlines() or [""])[0]       # (the CPU allocator's, without
            detail = first.rsplit("] ", 1)[-1].removeprefix("err == 0. ")  # its source line)
            raise _fail(f"the KV cache for --max-batch {max_batch} x --warm-up-len "
                        f"{warm_up_len} positions does not fit in memory ({detail[:200]})",
                        hint="lower --max-batch or --warm-up-len") from exc
    fp = app.state.fingerprint
    if write_fingerprint is not None:
        write_fingerprint.write_text(json.dumps(fp, indent=2) + "\n", encoding="utf-8")
    console.print(f"serving {name} on http://{host}:{port}/v1 "
                  f"(fingerprint {fp['fingerprint_id']}, batch_invariant="
                  f"{fp['runtime']['batch_invariant']}, text: "
                  f"{'byte tokenizer' if tokenizer else 'token-ID prompts only'})")
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)


def register(app: typer.Typer) -> None:
    """Add ``proxy`` to the root app and ``serve`` to the existing ``engine`` group.

    Call after ``ledger.cli.engine.register(app)``, which creates the ``engine`` group.
    """
    app.command("proxy")(proxy_command)
    for group in app.registered_groups:
        if group.name == "engine" and group.typer_instance is not None:
            group.typer_instance.command("serve")(engine_serve_command)
            return
    raise RuntimeError("register the engine commands before the capture commands")
