"""The FastAPI application factory.

Errors become RFC 9457 problem+json in one place: every :class:`LedgerError` through
:func:`ledger.problems.problem_for`, request validation as 422, a lost database as 503
with ``Retry-After``. Bodies over the configured limit are refused with 413 before they
are read into memory. Every route refuses query parameters it does not declare (400,
:func:`ledger.api.deps.reject_unknown_query`). Prometheus metrics are served apart from
the API, on ``LEDGER_METRICS_HOST:LEDGER_METRICS_PORT`` (loopback by default).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import orjson
import psycopg
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from sqlalchemy import Engine
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as SATimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ledger import __version__, console, metrics
from ledger.api import schemas as api_schemas
from ledger.api.deps import UnknownQueryParameters, reject_unknown_query
from ledger.api.links import add_links
from ledger.api.routes import envelopes, health, keys, privacy
from ledger.api.routes import log as log_routes
from ledger.api.routes import matrix as matrix_routes
from ledger.api.routes import replay as replay_routes
from ledger.api.schemas import Problem
from ledger.core.collector import collecting_less
from ledger.core.errors import LedgerError
from ledger.db.session import make_engine, session_factory, session_scope
from ledger.errors import Unavailable
from ledger.log.integrator import IntegratorThread
from ledger.log.signer import LogSigner
from ledger.log.sink import sink_from_settings
from ledger.problems import MEDIA_TYPE, problem, problem_for, status_for
from ledger.replay.broker import CeleryPublisher, Publisher
from ledger.replay.records import Signer
from ledger.services.credentials import CredentialCache
from ledger.services.ingest import GroupCommit
from ledger.settings import Settings, get_settings

log = logging.getLogger("ledger.api")

#: Every router of the API, in inclusion order (the role-matrix test walks these).
ROUTERS = [envelopes.router, log_routes.router, replay_routes.router, keys.router,
           privacy.router, health.router, matrix_routes.router]


def _problem_response(body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=body["status"], media_type=MEDIA_TYPE,
                    headers=headers)


class BodyLimitAndMetrics:
    """Pure ASGI middleware: refuse oversized bodies early, shed load, time every request.

    Back-pressure: a process holds at most ``max_inflight`` requests and ``max_inflight_bytes``
    of declared request bodies at once; beyond that it answers 503 with ``Retry-After``
    before reading the body, so a burst far above capacity costs a short reply each, and
    memory stays bounded, instead of a queue that grows until the process falls over.
    Health and readiness are never shed.
    """

    UNSHED = (b"/healthz", b"/readyz")

    def __init__(self, app: ASGIApp, max_body: int, max_inflight: int = 64,
                 max_inflight_bytes: int = 256 * 1024 * 1024) -> None:
        self.app = app
        self.max_body = max_body
        self.max_inflight = max_inflight
        self.max_inflight_bytes = max_inflight_bytes
        self.inflight = 0
        self.inflight_bytes = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = dict(scope.get("headers") or [])
        declared_bytes = 0
        try:
            declared_bytes = max(0, int(headers.get(b"content-length", b"0")))
        except ValueError:
            declared_bytes = 0
        if b"content-length" not in headers and b"transfer-encoding" in headers:
            declared_bytes = self.max_body  # a chunked body may grow to the limit: reserve it
        path = scope.get("raw_path") or scope.get("path", "").encode()
        if path not in self.UNSHED and (
                self.inflight >= self.max_inflight
                or self.inflight_bytes + declared_bytes > self.max_inflight_bytes):
            metrics.SHED.inc()
            await _problem_response(
                problem(503, "overloaded", "the ledger is at capacity; retry after "
                        "Retry-After seconds"), {"Retry-After": "1"})(scope, receive, send)
            self._observe(scope, 503, start)
            return
        self.inflight += 1
        self.inflight_bytes += declared_bytes
        try:
            await self._handle(scope, receive, send, headers, start)
        finally:
            self.inflight -= 1
            self.inflight_bytes -= declared_bytes

    async def _handle(self, scope: Scope, receive: Receive, send: Send,
                      headers: dict[bytes, bytes], start: float) -> None:
        status_holder = {"status": 500}
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared > self.max_body or declared < 0:
                await _problem_response(self._too_large() if declared > 0 else problem(
                    400, "bad_content_length", "Content-Length is not a number"))(
                    scope, receive, send)
                self._observe(scope, 413, start)
                return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise _BodyTooLarge
            return message

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_holder["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, limited_receive, send_wrapper)
        except _BodyTooLarge:
            await _problem_response(self._too_large())(scope, receive, send)
            status_holder["status"] = 413
        self._observe(scope, status_holder["status"], start)

    def _too_large(self) -> dict[str, Any]:
        return problem(413, "too_large", f"request body exceeds the limit of {self.max_body} "
                       "bytes")

    @staticmethod
    def _observe(scope: Scope, status: int, start: float) -> None:
        route = scope.get("route")
        path = getattr(route, "path", None) or "unmatched"
        metrics.labelled(metrics.REQUEST_LATENCY, scope.get("method", ""), path,
                         str(status)).observe(time.perf_counter() - start)


class _BodyTooLarge(Exception):
    pass


UNKNOWN_QUERY_400 = ("Malformed request, or a query parameter this operation does not "
                     "declare (`unknown_query_parameter`; `parameters` names them)")


def _document_closed_query(schema: dict[str, Any]) -> None:
    """Every operation may answer 400 for an undeclared query parameter: say so."""
    content = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            resp = op["responses"].setdefault("400", {"content": content})
            resp["description"] = UNKNOWN_QUERY_400
            resp.setdefault("content", content)


class MetricsListener:
    """The Prometheus ``/metrics`` listener, on its own port so that the API's port (and
    its API keys) never serve it. Every server process tries to bind the port; the one
    that gets it serves the sum over all processes (prometheus-client's multiprocess mode,
    set up by ``ledger serve --workers N``), the others retry every few seconds, so one of
    them takes over when the holder exits."""

    def __init__(self, host: str, port: int, retry_s: float = 2.0,
                 extra: Any = None) -> None:
        self.host, self.port, self.retry_s = host, port, retry_s
        self.extra = extra  # a collector read at scrape time (the drift metrics)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ledger-metrics", daemon=True)
        self.serving = threading.Event()

    def start(self) -> MetricsListener:
        self._thread.start()
        return self

    def _run(self) -> None:
        from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
        from prometheus_client import multiprocess as prom_multiprocess

        registry: Any = REGISTRY
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # set by `ledger serve --workers N`
            registry = CollectorRegistry()
            prom_multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        if self.extra is not None:
            registry = _Combined(registry, self.extra)
        while not self._stop.is_set():
            try:
                server, _ = start_http_server(self.port, addr=self.host, registry=registry)
            except OSError:  # another server process holds it (or it is taken)
                self._stop.wait(self.retry_s)
                continue
            self.serving.set()
            self._stop.wait()
            server.shutdown()
            server.server_close()
            return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class _Combined:
    """The process's registry plus one more collector, for one HTTP listener."""

    def __init__(self, *collectors: Any) -> None:
        self.collectors = collectors

    def collect(self) -> Any:
        for collector in self.collectors:
            yield from collector.collect()


def start_integrator(settings: Settings, engine: Engine,
                     registrar: Signer | None = None) -> IntegratorThread | None:
    """Run the integrator in this API process when it holds the log key (processes take
    turns: one integrates at a time)."""
    signer = LogSigner.from_settings(settings)
    if signer is None or not settings.integrate_in_api:
        return None
    try:
        with session_scope(engine) as session:
            signer.ensure_registered(session, registrar)
    except Exception as exc:  # noqa: BLE001 - the database may be down at start-up
        log.warning("could not register the log key yet: %s", exc)
    thread = IntegratorThread(engine, signer, max_entries=settings.integrate_max_entries,
                              interval_ms=settings.integrate_interval_ms,
                              sink=sink_from_settings(settings.checkpoint_sink_dir),
                              settings=settings)
    thread.start()
    return thread


def _lifespan(settings: Settings, engine: Engine
              ) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Start-up (register the service key, warm the broker publisher, start the integrator
    and the metrics listener) and their shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if app.state.service_signer is not None:
            try:
                with session_scope(engine) as session:
                    app.state.service_signer.ensure_registered(session)
            except Exception as exc:  # noqa: BLE001 - the database may be down at start-up
                log.warning("could not register the service key yet: %s", exc)
        warm = getattr(app.state.publisher, "warm", None)
        if warm is not None:
            try:
                warm()
            except Exception as exc:  # noqa: BLE001 - the first publish then pays for it
                log.warning("could not prepare the broker publisher: %s", exc)
        app.state.integrator = start_integrator(settings, engine, app.state.service_signer)
        from ledger.replay.alerts import DriftCollector

        app.state.metrics_listener = MetricsListener(
            settings.metrics_host, settings.metrics_port,
            extra=DriftCollector(engine, settings)).start() if settings.metrics_port else None
        try:
            with collecting_less():
                yield
        finally:
            if app.state.integrator is not None:
                app.state.integrator.stop()
            if app.state.metrics_listener is not None:
                app.state.metrics_listener.stop()
            app.state.ingest_threads.shutdown(wait=True)
            app.state.ingest_threads = _ingest_threads()  # for a lifespan run again
            app.state.group_commit.close()
            app.state.ingest_reads.dispose()
            app.state.log_reads.dispose()

    return lifespan


# --- errors as problem+json, in one place -------------------------------------------------

async def _ledger_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, LedgerError)
    headers = None
    if isinstance(exc, Unavailable):
        headers = {"Retry-After": str(exc.retry_after)}
    elif status_for(exc) == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    body = problem_for(exc)
    if isinstance(exc, UnknownQueryParameters):
        body["parameters"] = exc.parameters
    return _problem_response(body, headers)


def _readable(error: Mapping[str, Any]) -> str:
    """pydantic's message, except a pattern the client cannot be expected to read."""
    from ledger.api.schemas import SAFE_TEXT

    if error.get("type") == "string_pattern_mismatch" and \
            (error.get("ctx") or {}).get("pattern") == SAFE_TEXT:
        return "must be one line of text: no newlines, tabs or other control characters"
    return str(error.get("msg"))


async def _validation_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = [{"loc": ".".join(str(p) for p in e.get("loc", ())), "msg": _readable(e),
               "type": e.get("type")} for e in exc.errors()[:20]]
    first = errors[0] if errors else {"loc": "", "msg": "invalid"}
    return _problem_response(problem(422, "invalid_request",
                                     f"{first['loc']}: {first['msg']}", errors=errors))


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return _problem_response(problem(exc.status_code, code, str(exc.detail)),
                             getattr(exc, "headers", None))


async def _data_error(_: Request, exc: Exception) -> Response:
    return _problem_response(problem(400, "invalid_input",
                                     "a value cannot be stored or compared: " +
                                     str(getattr(exc, "orig", exc)).splitlines()[0]))


async def _pool_exhausted(_: Request, exc: Exception) -> Response:
    return _problem_response(problem(503, "overloaded", "no database connection free; "
                                     "retry after Retry-After seconds"), {"Retry-After": "1"})


def _database_unavailable() -> Response:
    return _problem_response(problem(503, "database_unavailable",
                                     "the database is unavailable; retry later"),
                             {"Retry-After": "2"})


async def _database_error(_: Request, exc: Exception) -> Response:
    if isinstance(exc, DBAPIError) and not exc.connection_invalidated and not isinstance(
            exc, OperationalError):
        log.exception("database error")
        return _problem_response(problem(500, "internal_error", "database error"))
    log.warning("database unavailable: %s", type(exc).__name__)
    return _database_unavailable()


async def _driver_unavailable(_: Request, exc: Exception) -> Response:
    log.warning("database unavailable: %s", exc)
    return _database_unavailable()


async def _unexpected(_: Request, exc: Exception) -> Response:
    log.exception("unexpected error")
    return _problem_response(problem(500, "internal_error", "internal error"))


def _add_middleware(app: FastAPI, settings: Settings) -> None:
    """The fast paths (single-envelope ingest, the log's checkpoint and proof reads) inside
    the body limits, shedding and metrics (the last added is the outermost)."""
    app.add_middleware(envelopes.IngestFastPath)
    app.add_middleware(log_routes.LogReadFastPath)
    app.add_middleware(BodyLimitAndMetrics, max_body=settings.max_request_bytes,
                       max_inflight=settings.max_inflight_requests,
                       max_inflight_bytes=settings.max_inflight_bytes)


def add_exception_handlers(app: FastAPI) -> None:
    """Every error becomes RFC 9457 problem+json: ledger errors by their class and code,
    request validation as 422, a lost database as 503 with ``Retry-After``, anything else
    as a logged 500 that names nothing."""
    for exc_class, handler in ((LedgerError, _ledger_error),
                               (RequestValidationError, _validation_error),
                               (StarletteHTTPException, _http_error),
                               (DataError, _data_error),
                               (SATimeoutError, _pool_exhausted),
                               (OperationalError, _database_error),
                               (DBAPIError, _database_error),
                               (psycopg.OperationalError, _driver_unavailable),
                               (Exception, _unexpected)):
        app.add_exception_handler(exc_class, handler)


# --- the OpenAPI document -----------------------------------------------------------------

def _install_openapi(app: FastAPI) -> None:
    """The generated document, plus the problem schema, the envelope bodies the envelope
    routes read themselves, the closed query string and the links between operations."""
    original_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = original_openapi()
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        comps["Problem"] = Problem.model_json_schema()
        for name in ("DsseEnvelopeIn", "BatchIn", "DsseSignature"):
            if name not in comps:
                comps[name] = getattr(api_schemas, name).model_json_schema(
                    ref_template="#/components/schemas/{model}")
                comps.update(comps[name].pop("$defs", {}))
        _document_closed_query(schema)
        app.openapi_schema = add_links(schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


#: ``application_name`` of the ingest reads' connections (``pg_stat_activity``)
INGEST_READS_APPLICATION = "ledger-api-ingest-reads"
#: Threads that run ingest's work (as many as anyio's default thread pool, which it used)
INGEST_THREADS = 40
#: ... and of the log proof routes' reads
LOG_READS_APPLICATION = "ledger-api-log-reads"


def _log_proofs_state(app: FastAPI, settings: Settings, engine: Engine) -> None:
    """What the log's proof routes use: reads on an autocommit engine without pre-ping,
    as ingest's (:func:`ledger.api.auth.require_reads`), and the log's keys from outside
    the database (the log key file), against which they check the checkpoint they serve
    (once per note: :mod:`ledger.log.proofs`)."""
    app.state.log_reads = make_engine(
        settings, url=engine.url.render_as_string(hide_password=False), pre_ping=False,
        autocommit=True, application_name=LOG_READS_APPLICATION)
    log_signer = LogSigner.from_settings(settings)
    app.state.log_keys = (log_signer.verifier(),) if log_signer is not None else ()


def _ingest_threads() -> ThreadPoolExecutor:
    """The ingest routes' threads (no thread starts before the first request)."""
    return ThreadPoolExecutor(INGEST_THREADS, thread_name_prefix="ledger-ingest")


def _ingest_state(app: FastAPI, settings: Settings, engine: Engine) -> None:
    """What the ingest routes use besides the app's engine."""
    url = engine.url.render_as_string(hide_password=False)
    # the storing step, on a connection of its own (ledger.services.ingest.GroupCommit)
    # a leader hands the lead on to an ingest thread: looked up when it does (the
    # lifespan makes the threads again when it ends)
    app.state.group_commit = GroupCommit(
        make_engine(settings, url=url, pool_size=1), settings,
        spawn=lambda lead: app.state.ingest_threads.submit(lead))
    # the keys earlier requests were admitted with (ledger.services.credentials)
    app.state.credentials = CredentialCache()
    # the thread-pool hop (ledger.api.routes.envelopes.in_ingest_thread)
    app.state.ingest_threads = _ingest_threads()
    # the reads (the API key, the producer keys): autocommit, no pre-ping
    # (ledger.db.session.AutocommitReads retries a statement that met a dropped connection);
    # every request takes one, so at more than db_pool_size concurrent ingests the overflow
    # is kept, not reconnected per request (benchmarks/ingest_cpu.py: sessions opened)
    app.state.ingest_reads = make_engine(
        settings, url=url, pre_ping=False, autocommit=True,
        application_name=INGEST_READS_APPLICATION, keep_overflow=True)


def create_app(settings: Settings | None = None, engine: Engine | None = None,
               publisher: Publisher | None = None) -> FastAPI:
    settings = settings or get_settings()
    engine = engine or make_engine(settings)
    app = FastAPI(
        lifespan=_lifespan(settings, engine),
        title="inference-ledger",
        version=__version__,
        summary="Signed execution envelopes in a tamper-evident transparency log, "
                "with bitwise replay verification.",
        openapi_url="/openapi.json",
        docs_url=None, redoc_url=None,  # Swagger UI from local files: ledger.console.mount
        dependencies=[Depends(reject_unknown_query)],
        # off unless asked for (LEDGER_OTEL): on, FastAPI asks OpenTelemetry's global
        # providers on every request whether one is configured
        telemetry=None if settings.otel else {"tracing": False, "metrics": False,
                                              "logs": False},
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessionmaker = session_factory(engine)
    _ingest_state(app, settings, engine)
    _log_proofs_state(app, settings, engine)
    app.state.service_signer = Signer.from_file(settings.service_key_file, "ledger",
                                                "ledger-service")
    app.state.publisher = publisher if publisher is not None else CeleryPublisher(
        settings, timeout_s=settings.broker_publish_timeout_s)
    add_exception_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    console.mount(app)  # /console and /docs (the reviewer console, #15)
    _add_middleware(app, settings)
    _install_openapi(app)
    return app
