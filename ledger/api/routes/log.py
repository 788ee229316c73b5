"""The transparency log over HTTP.

- ``/log/checkpoint`` and ``/log/tile/...``: the C2SP tlog-tiles read paths (public), so
  tooling written for Tessera and the Go checksum database reads this log as it is.
- ``/v1/log/checkpoint``, ``/v1/log/consistency`` (public), ``/v1/log/proof`` and
  ``/v1/envelopes/{request_id}/proof`` (a reading role: they name request and dispute
  IDs): the same data as JSON.

Entries are small reference records (kind, ref, DSSE digest), never prompts, so the log
itself can be public; envelopes stay behind the API's roles.
"""

from __future__ import annotations

import base64
import itertools
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from types import SimpleNamespace
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Connection
from sqlalchemy.orm import Session

from ledger.api.auth import authorize_reads, bearer_key, require, require_reads
from ledger.api.deps import get_session
from ledger.api.fast import error_response
from ledger.api.params import (
    AfterQuery,
    BeforeQuery,
    FingerprintQuery,
    RequestIdPath,
    Sha256Query,
)
from ledger.api.schemas import COMMON_RESPONSES
from ledger.core.envelope import REQUEST_ID_MAX_LENGTH, REQUEST_ID_PATTERN
from ledger.core.errors import ValidationFailed
from ledger.core.note import format_verifier_key
from ledger.core.tiles import EntryBundle, Tile, encode_entry_bundle, parse_tile_path, tile_width
from ledger.db.session import AutocommitReads, raw_cursor
from ledger.errors import NotFound
from ledger.log import proofs, witnessing
from ledger.log.export import Selection, bundle_chunks
from ledger.log.signer import log_verifiers
from ledger.log.store import PgTileReader, entries, integrated_size, latest_checkpoint
from ledger.replay.records import require_signer
from ledger.services import audit
from ledger.services import envelopes as envelope_service
from ledger.services.apikeys import Principal

router = APIRouter(responses=COMMON_RESPONSES)

_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)
IMMUTABLE = {"Cache-Control": "public, max-age=31536000, immutable"}
NO_CACHE = {"Cache-Control": "no-cache"}


@router.get("/log/checkpoint", tags=["tlog-tiles"], response_class=Response,
            summary="The latest signed checkpoint (C2SP tlog-checkpoint signed note)",
            responses={200: {"content": {"text/plain; charset=utf-8": {}}}})
def tlog_checkpoint(session: Session = Depends(get_session)) -> Response:
    """The log's signature first, then the witnesses' cosignatures (C2SP tlog-cosignature)
    stored for this checkpoint: readers that know only the log key ignore them."""
    with raw_cursor(session) as cur:
        cp = latest_checkpoint(cur)
    if cp is None:
        raise proofs.NotYetIntegrated("the log has no checkpoint yet")
    note = witnessing.cosigned_note(session, cp.tree_size)
    return Response(note, media_type="text/plain; charset=utf-8", headers=NO_CACHE)


class WitnessOut(BaseModel):
    name: str = Field(description="The witness's key name")
    url: str = Field(description="Its submission prefix (POST <url>/add-checkpoint)")
    verifier_key: str | None = Field(
        description="Its cosignature/v1 verifier key, when this process is configured with it")
    last_size: int | None = Field(description="The size it last said it had cosigned")
    cosigned_size: int | None = Field(
        description="The largest checkpoint with a stored cosignature by it")
    last_ok_at: datetime | None
    last_attempt_at: datetime | None
    last_error: str | None = Field(description="Why the last attempt failed (null after a "
                                               "success)")



class CheckpointOut(BaseModel):
    tree_size: int = Field(description="Entries in the tree the checkpoint signs")
    root_hash: str = Field(description="Base64 of the RFC 9162 root hash")
    checkpoint: str = Field(description="The C2SP signed note, as /log/checkpoint serves "
                            "it without the cosignatures")
    origin: str = Field(description="The log's name, the note's first line")
    verifier_keys: list[str] = Field(description="Log keys registered in this database "
                                     "(informational: verifiers pin theirs in a trust "
                                     "policy)")


class InclusionProofOut(BaseModel):
    log_index: int
    tree_size: int = Field(description="Size of the checkpoint the proof is against")
    entry: str = Field(description="Base64 of the entry bytes (canonical JSON naming the "
                       "record: docs/transparency-log.md)")
    leaf_hash: str = Field(description="Base64 of SHA-256(0x00 || entry)")
    inclusion_proof: list[str] = Field(description="Base64 hashes, RFC 9162 2.1.3 order")
    root_hash: str = Field(description="Base64 of the checkpoint's root hash")
    checkpoint: str = Field(description="The signed note the proof verifies against")


class EnvelopeInclusionProofOut(InclusionProofOut):
    request_id: str


class ConsistencyProofOut(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    from_size: int = Field(alias="from", description="The older tree size")
    to_size: int = Field(alias="to", description="The newer (checkpointed) tree size")
    proof: list[str] = Field(description="Base64 hashes, RFC 9162 2.1.4 order")
    old_root_hash: str | None = Field(description="Base64 root at `from` when a checkpoint "
                                      "of that size exists")
    new_root_hash: str
    old_checkpoint: str | None
    new_checkpoint: str

class WitnessesOut(BaseModel):
    tree_size: int | None = Field(description="The newest checkpoint's size")
    witnesses: list[WitnessOut]


@router.get("/v1/log/witnesses", tags=["log"], response_model=WitnessesOut,
            summary="The witnesses this log submits checkpoints to, and how each is doing")
def log_witnesses(request: Request, session: Session = Depends(get_session),
                  _: Principal = Depends(require("log:read")),  # errors may name hosts
                  ) -> WitnessesOut:
    with raw_cursor(session) as cur:
        cp = latest_checkpoint(cur)
    keys = {e.name: e.key.verifier_key
            for e in witnessing.witness_endpoints(request.app.state.settings)}
    return WitnessesOut(tree_size=cp.tree_size if cp else None, witnesses=[
        WitnessOut(name=v.name, url=v.url, verifier_key=keys.get(v.name),
                   last_size=v.last_size, cosigned_size=v.cosigned_size,
                   last_ok_at=v.last_ok_at, last_attempt_at=v.last_attempt_at,
                   last_error=v.last_error)
        for v in witnessing.witness_views(session)])


@router.get("/log/tile/{path:path}", tags=["tlog-tiles"], response_class=Response,
            summary="A hash tile or an entry bundle (C2SP tlog-tiles)",
            responses={200: {"content": {"application/octet-stream": {}}}})
def tlog_tile(path: Annotated[str, Path(max_length=200)],
              session: Session = Depends(get_session)) -> Response:
    tile = parse_tile_path("tile/" + path)
    with raw_cursor(session) as cur:
        size = integrated_size(cur)
        level = tile.level if isinstance(tile, Tile) else 0
        available = tile_width(level, tile.index, size)
        if tile.width > available or (tile.width == 256 and available < 256):
            raise NotFound(f"{tile.path} is not in the tree of size {size}",
                           code="no_such_tile")
        if isinstance(tile, EntryBundle):
            start = tile.index * 256
            data = encode_entry_bundle(entries(cur, start, start + tile.width))
        else:
            data = PgTileReader(cur).read_tiles([tile])[0]
    headers = IMMUTABLE if tile.width == 256 or not tile.is_partial else NO_CACHE
    return Response(data, media_type="application/octet-stream", headers=headers)


def checkpoint_body(app: Any) -> bytes:
    """``GET /v1/log/checkpoint``'s body: the latest checkpoint, its size and root read
    from its note's signed text (:func:`ledger.log.proofs.signed_checkpoint`: with the
    API's log key the signature is checked too), and the log keys the database names."""
    def read(conn: Connection) -> bytes:
        with raw_cursor(conn) as cur:
            stored = latest_checkpoint(cur)
        if stored is None:
            raise proofs.NotYetIntegrated("the log has no checkpoint yet")
        cp = proofs.signed_checkpoint(stored, app.state.log_keys)
        note = cp.note.decode()
        origin = note.split("\n", 1)[0]
        keys = [format_verifier_key(v.name, v.public_key) for v in log_verifiers(conn, origin)]
        return orjson.dumps({"tree_size": cp.tree_size,
                             "root_hash": base64.b64encode(cp.root_hash).decode(),
                             "checkpoint": note, "origin": origin, "verifier_keys": keys})

    with AutocommitReads(app.state.log_reads) as reads:
        return reads.run(read)


def consistency_body(app: Any, from_size: int, to_size: int | None) -> bytes:
    """``GET /v1/log/consistency``'s body (one round trip as a rule)."""
    with AutocommitReads(app.state.log_reads) as reads:
        return orjson.dumps(reads.run(lambda conn: proofs.consistency(
            conn, from_size, to_size, log_keys=app.state.log_keys)))


def inclusion_body(app: Any, reads: AutocommitReads, index: int,
                   tree_size: int | None) -> bytes:
    """``GET /v1/log/proof``'s body, on the connection its caller's key was checked on."""
    receipt = reads.run(lambda conn: proofs.inclusion(
        conn, index, tree_size, log_keys=app.state.log_keys))
    return orjson.dumps(receipt.to_json())


@router.get("/v1/log/checkpoint", tags=["log"], response_model=CheckpointOut,
            summary="The latest checkpoint as JSON, with the log's verifier keys")
async def checkpoint_json(request: Request) -> Response:
    # async, one thread-pool hop on the autocommit read engine (as the proof routes)
    return Response(await run_in_threadpool(checkpoint_body, request.app),
                    media_type="application/json")


def _json(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


@router.get("/v1/log/consistency", tags=["log"], response_model=ConsistencyProofOut,
            summary="Consistency proof between two tree sizes (RFC 9162 2.1.4)")
async def log_consistency(
    request: Request,
    from_size: int = Query(..., alias="from", ge=0, le=2**62),
    to_size: int | None = Query(None, alias="to", ge=0, le=2**62,
                                description="a checkpointed size; default the latest"),
) -> Response:
    # One thread-pool hop for the database work, which is one round trip as a rule, on
    # the autocommit read engine (no BEGIN, ROLLBACK or ping); orjson bytes out.
    return Response(await run_in_threadpool(consistency_body, request.app, from_size, to_size),
                    media_type="application/json")


@router.get("/v1/log/proof", tags=["log"], response_model=InclusionProofOut,
            summary="Inclusion proof of any log entry (envelope, verdict or dispute event)")
async def entry_proof(
    request: Request,
    index: int = Query(..., ge=0, le=2**62),
    tree_size: int | None = Query(None, ge=1, le=2**62,
                                  description="a checkpointed size; default the latest"),
    # the entry names a request or dispute: a reading role, checked on the connection
    # the proof is then read on
    reads: AutocommitReads = Depends(require_reads("log:read")),
) -> Response:
    return Response(await run_in_threadpool(inclusion_body, request.app, reads, index,
                                            tree_size), media_type="application/json")


@router.get("/v1/envelopes/{request_id}/proof", tags=["envelopes"],
            response_model=EnvelopeInclusionProofOut,
            summary="Inclusion proof of an envelope against a signed checkpoint")
def envelope_proof(
    request: Request,
    request_id: RequestIdPath,
    tree_size: int | None = Query(None, ge=1, le=2**62,
                                  description="a checkpointed size; default the latest"),
    _: Principal = Depends(require("envelopes:read")),
    session: Session = Depends(get_session),
) -> Response:
    _stored, fields = envelope_service.get_envelope(session, request_id)
    receipt = proofs.inclusion(session, fields["log_index"], tree_size,
                               log_keys=request.app.state.log_keys)
    return _json({"request_id": request_id, **receipt.to_json()})


@router.get("/v1/export", tags=["export"], response_class=StreamingResponse,
            summary="Export a bundle that `ledger verify` checks offline (JSON Lines)",
            responses={200: {"content": {"application/x-ndjson": {}}}})
def export_bundle(
    request: Request,
    recorded_after: AfterQuery = None,
    recorded_before: BeforeQuery = None,
    model_sha256: Sha256Query = None,
    fingerprint_id: FingerprintQuery = None,
    request_id: Annotated[list[str] | None, Query(
        max_length=1000, description="repeatable")] = None,
    limit: int | None = Query(None, ge=1, le=1_000_000),
    principal: Principal = Depends(require("export")),
    session: Session = Depends(get_session),
) -> StreamingResponse:
    for rid in request_id or []:
        if len(rid) > REQUEST_ID_MAX_LENGTH or not _REQUEST_ID.fullmatch(rid):
            raise ValidationFailed(f"request_id {rid[:50]!r} is not a valid request ID",
                                   code="invalid_request")
    selection = Selection(recorded_after, recorded_before, model_sha256, fingerprint_id,
                          tuple(request_id or ()), limit)
    audit.record(session, principal, "export", None, selection=selection.to_json())
    chunks = bundle_chunks(request.app.state.engine, selection,
                           require_signer(request.app.state.service_signer,
                                          "an export (its manifest is signed)"))
    first = next(chunks)  # errors (no checkpoint yet) surface as problems, not broken streams
    session.commit()
    return StreamingResponse(itertools.chain([first], chunks), media_type="application/x-ndjson",
                             headers={"Content-Disposition":
                                      'attachment; filename="ledger-bundle.jsonl"'})


_PLAIN_NUMBER = re.compile(rb"0|[1-9][0-9]{0,18}")


@dataclass(frozen=True, slots=True)
class _FastRead:
    """One GET the fast path answers: its declared query parameters (name: (argument,
    least, most)), those that are required, and the route's steps."""

    route: SimpleNamespace                                   # the latency metric's label
    params: dict[bytes, tuple[str, int, int]]
    required: frozenset[str]
    answer: Callable[[Request, dict[str, int]], Awaitable[bytes]]


async def _fast_checkpoint(request: Request, _: dict[str, int]) -> bytes:
    return await run_in_threadpool(checkpoint_body, request.app)


async def _fast_consistency(request: Request, args: dict[str, int]) -> bytes:
    return await run_in_threadpool(consistency_body, request.app, args["from"],
                                   args.get("to"))


async def _fast_inclusion(request: Request, args: dict[str, int]) -> bytes:
    key = await bearer_key(request)  # 401 without one, as require_reads' Depends(_bearer)
    app = request.app

    def work() -> bytes:  # the key check and the proof in one hop, on one connection
        with AutocommitReads(app.state.log_reads) as reads:
            authorize_reads(reads, app.state.settings, key, "log:read")
            return inclusion_body(app, reads, args["index"], args.get("tree_size"))

    return await run_in_threadpool(work)


_RANGE = 2**62
_FAST_READS = {
    "/v1/log/checkpoint": _FastRead(SimpleNamespace(path="/v1/log/checkpoint"), {},
                                    frozenset(), _fast_checkpoint),
    "/v1/log/proof": _FastRead(SimpleNamespace(path="/v1/log/proof"),
                               {b"index": ("index", 0, _RANGE),
                                b"tree_size": ("tree_size", 1, _RANGE)},
                               frozenset({"index"}), _fast_inclusion),
    "/v1/log/consistency": _FastRead(SimpleNamespace(path="/v1/log/consistency"),
                                     {b"from": ("from", 0, _RANGE), b"to": ("to", 0, _RANGE)},
                                     frozenset({"from"}), _fast_consistency),
}


def _plain_query(raw: bytes, read: _FastRead) -> dict[str, int] | None:
    """The arguments of a query string in which every parameter is declared, given once,
    unencoded, a number in its range, and the required ones are there; None for any
    other (FastAPI then answers it: 400 or 422, as the route's declaration says)."""
    args: dict[str, int] = {}
    for part in raw.split(b"&") if raw else ():
        name, eq, value = part.partition(b"=")
        spec = read.params.get(name)
        if spec is None or not eq or not _PLAIN_NUMBER.fullmatch(value):
            return None
        argument, least, most = spec
        number = int(value)
        if argument in args or not least <= number <= most:
            return None
        args[argument] = number
    return args if read.required <= args.keys() else None


class LogReadFastPath:
    """Pure ASGI: ``GET /v1/log/checkpoint``, ``/v1/log/proof`` and ``/v1/log/consistency``
    with a plain query string (:func:`_plain_query`) go straight to the routes' own steps
    (:func:`checkpoint_body`, :func:`inclusion_body` after the same key and role check,
    :func:`consistency_body`), past FastAPI's routing, dependency solving and parameter
    validation, which cost most of the server's time on these small reads. Errors take the
    app's own handlers (:func:`ledger.api.fast.error_response`), so a request gets the
    same bytes either way; any other request (a bad or unknown parameter, HEAD) goes to
    FastAPI, whose routes stay the ones the OpenAPI document shows
    (``tests/api/test_log_fast_path.py`` sends every kind through both)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.reads = _FAST_READS

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        read = self.reads.get(scope["path"]) if scope["type"] == "http" and \
            scope["method"] == "GET" else None
        args = _plain_query(scope.get("query_string", b""), read) if read else None
        if read is None or args is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        scope["route"] = read.route
        try:
            response = Response(await read.answer(request, args), media_type="application/json")
        except Exception as exc:  # noqa: BLE001 - answered as the app answers it
            response = await error_response(request, exc)
        await response(scope, receive, send)
