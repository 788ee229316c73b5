"""The witness over HTTP: ``POST /add-checkpoint`` (C2SP tlog-witness), ``GET /healthz``
and ``GET /`` (what it is: its name, verifier key, the logs it follows and their state)."""

from __future__ import annotations

import base64

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from ledger import __version__
from ledger.witness.protocol import MAX_REQUEST_BYTES, SIZE_CONTENT_TYPE
from ledger.witness.service import Refused, SizeConflict, Witness


class LogView(BaseModel):
    origin: str
    log_keys: list[str]
    size: int
    root_hash: str


class WitnessInfo(BaseModel):
    name: str
    verifier_key: str
    logs: list[LogView]


def create_witness_app(witness: Witness) -> FastAPI:
    app = FastAPI(title="inference-ledger witness", version=__version__,
                  summary="A C2SP tlog-witness: cosigns checkpoints consistent with what it "
                          "cosigned before.")
    app.state.witness = witness

    @app.exception_handler(Refused)
    async def refused(_: Request, exc: Refused) -> Response:
        if isinstance(exc, SizeConflict):
            return Response(f"{exc.size}\n", status_code=409, media_type=SIZE_CONTENT_TYPE)
        return PlainTextResponse(exc.message + "\n", status_code=exc.status)

    @app.post("/add-checkpoint", response_class=PlainTextResponse,
              summary="Cosign a checkpoint consistent with the last one cosigned",
              responses={200: {"content": {"text/plain; charset=utf-8": {}}},
                         409: {"content": {SIZE_CONTENT_TYPE: {}}}})
    async def add_checkpoint(request: Request) -> Response:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
            return PlainTextResponse("request too large\n", status_code=413)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_REQUEST_BYTES:
                return PlainTextResponse("request too large\n", status_code=413)
        # the state lock and fsync block: off the event loop
        lines = await run_in_threadpool(witness.add_checkpoint, bytes(body))
        return PlainTextResponse("".join(line + "\n" for line in lines))

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/", response_model=WitnessInfo, summary="This witness and its view of each log")
    def info() -> WitnessInfo:
        states = witness.state.all()
        logs = []
        for origin, keys in sorted(witness.config.logs.items()):
            st = states.get(origin)
            logs.append(LogView(origin=origin, log_keys=[k.verifier_key for k in keys],
                                size=st.size if st else 0,
                                root_hash=base64.b64encode(st.root_hash).decode() if st
                                else ""))
        signer = witness.config.signer
        return WitnessInfo(name=signer.name, verifier_key=signer.key.verifier_key, logs=logs)

    return app
