"""The console's pages under ``/console``: server-rendered Jinja2, local assets only.

Each page needs the permission its REST twin needs (:data:`ledger.api.auth.PERMISSIONS`);
every POST carries the session's CSRF token. Errors render as HTML pages with the status
the API would give (401 sends the browser to the sign-in form).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.templating import Jinja2Templates
from sqlalchemy.orm import Session

from ledger.api.auth import PERMISSIONS
from ledger.api.deps import get_session, get_settings_dep
from ledger.console import actions, charts, queries, tokenizers
from ledger.console import session as sessions
from ledger.core.errors import LedgerError
from ledger.errors import Forbidden, NotFound, Unauthorized
from ledger.problems import status_for
from ledger.services import audit
from ledger.settings import Settings

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=str(HERE / "templates"))
templates.env.globals["quote"] = lambda s: quote(str(s), safe="")


def _show(value: Any) -> str:
    """A signed JSON value as JSON writes it (null, true, {...}), not as Python does."""
    import json

    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


templates.env.filters["show"] = _show

#: Served with every console page: nothing but our own origin may run or frame anything,
#: so even markup that slipped past escaping could not execute.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}

RequestIdPath = Annotated[str, PathParam(max_length=200, pattern=r"^[A-Za-z0-9._:@+=-]+$")]
UuidPath = Annotated[str, PathParam(max_length=64, pattern=r"^[0-9a-fA-F-]{1,64}$")]
SafeText = r"^[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f]*$"


def _render_error(request: Request, status: int, title: str, detail: str) -> Response:
    user = getattr(request.state, "console_user", None)
    resp = templates.TemplateResponse(request, "error.html", {
        **_context(user), "title": title, "detail": detail, "status": status},
        status_code=status)
    resp.headers.update(SECURITY_HEADERS)
    return resp


def _context(user: sessions.ConsoleUser | None) -> dict[str, Any]:
    return {"user": user, "csrf": user.csrf_token if user else None,
            "can": (lambda perm: user is not None and user.role in PERMISSIONS[perm])}


class ConsoleRoute(APIRoute):
    """Errors as HTML pages; no session: off to the sign-in form; security headers."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        inner = super().get_route_handler()

        async def handler(request: Request) -> Response:
            try:
                response = await inner(request)
            except sessions.NotSignedIn:
                target = request.url.path + (f"?{request.url.query}" if request.url.query
                                             else "")
                return RedirectResponse("/console/sign-in?" + urlencode({"next": target}), 303)
            except LedgerError as exc:
                return _render_error(request, status_for(exc), exc.code, str(exc))
            except RequestValidationError as exc:
                first = exc.errors()[0] if exc.errors() else {}
                where = ".".join(str(p) for p in first.get("loc", ()))
                return _render_error(request, 422, "invalid input",
                                     f"{where}: {first.get('msg', 'invalid')}")
            for k, v in SECURITY_HEADERS.items():
                response.headers.setdefault(k, v)
            return response

        return handler


router = APIRouter(prefix="/console", route_class=ConsoleRoute, include_in_schema=False)


# --- who is asking -----------------------------------------------------------------------------

def signed_in(permission: str) -> Callable[..., sessions.ConsoleUser]:
    roles = PERMISSIONS[permission]

    def dependency(request: Request, session: Session = Depends(get_session),
                   settings: Settings = Depends(get_settings_dep)) -> sessions.ConsoleUser:
        user = sessions.current_user(session, request.cookies.get(sessions.COOKIE),
                                     settings.api_key_pepper.get_secret_value())
        request.state.console_user = user
        if user.role not in roles:
            raise Forbidden(f"role {user.role!r} may not {permission}; allowed: "
                            f"{', '.join(sorted(roles))}", code="forbidden_role")
        return user

    return dependency


def posted(permission: str) -> Callable[..., sessions.ConsoleUser]:
    """A signed-in user whose form carries the session's CSRF token."""
    inner = signed_in(permission)

    def dependency(csrf_token: Annotated[str | None, Form(max_length=200)] = None,
                   user: sessions.ConsoleUser = Depends(inner)) -> sessions.ConsoleUser:
        if not sessions.csrf_ok(user.csrf_token, csrf_token):
            raise Forbidden("the form's CSRF token is missing or wrong: reload the page and "
                            "try again", code="csrf_failed")
        return user

    return dependency


def page(request: Request, name: str, user: sessions.ConsoleUser | None,
         status: int = 200, **context: Any) -> Response:
    return templates.TemplateResponse(request, name, {**_context(user), **context},
                                      status_code=status)


def back(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=303)


# --- sign-in -----------------------------------------------------------------------------------

def _safe_next(target: str | None) -> str:
    if target and target.startswith("/console/") and not target.startswith("//") \
            and "\\" not in target:
        return target
    return "/console/search"


@router.get("")
@router.get("/")
def home() -> Response:
    return back("/console/search")


@router.get("/sign-in")
def sign_in_form(request: Request,
                 next_: Annotated[str | None, Query(alias="next", max_length=2000)] = None
                 ) -> Response:
    import secrets

    token = secrets.token_urlsafe(24)
    resp = page(request, "sign_in.html", None, login_csrf=token, next=_safe_next(next_))
    resp.set_cookie(sessions.LOGIN_COOKIE, token, max_age=1800, httponly=True,
                    samesite="strict", secure=request.url.scheme == "https", path="/console")
    return resp


@router.post("/sign-in")
def sign_in(request: Request,
            api_key: Annotated[str, Form(max_length=300)],
            csrf_token: Annotated[str | None, Form(max_length=200)] = None,
            next_: Annotated[str | None, Form(alias="next", max_length=2000)] = None,
            session: Session = Depends(get_session),
            settings: Settings = Depends(get_settings_dep)) -> Response:
    if not sessions.csrf_ok(request.cookies.get(sessions.LOGIN_COOKIE), csrf_token):
        raise Forbidden("the sign-in form's CSRF token is missing or wrong: reload the page",
                        code="csrf_failed")
    try:
        token, user = sessions.sign_in(session, api_key,
                                       settings.api_key_pepper.get_secret_value())
    except (Unauthorized, Forbidden) as exc:
        session.rollback()
        return page(request, "sign_in.html", None, status=status_for(exc), error=str(exc),
                    login_csrf=csrf_token, next=_safe_next(next_))
    audit.record(session, user.principal, "console.sign_in", user.principal.key_id)
    session.commit()
    resp = back(_safe_next(next_))
    resp.set_cookie(sessions.COOKIE, token, max_age=sessions.SESSION_HOURS * 3600,
                    httponly=True, samesite="strict", secure=request.url.scheme == "https",
                    path="/console")
    resp.delete_cookie(sessions.LOGIN_COOKIE, path="/console")
    return resp


@router.post("/sign-out")
def sign_out(request: Request, _: sessions.ConsoleUser = Depends(posted("envelopes:read")),
             session: Session = Depends(get_session),
             settings: Settings = Depends(get_settings_dep)) -> Response:
    sessions.sign_out(session, request.cookies.get(sessions.COOKIE),
                      settings.api_key_pepper.get_secret_value())
    session.commit()
    resp = back("/console/sign-in")
    resp.delete_cookie(sessions.COOKIE, path="/console")
    return resp


# --- search ------------------------------------------------------------------------------------

def _time(value: str | None, name: str) -> datetime | None:
    """An HTML datetime-local value (no offset: taken as UTC) or RFC 3339."""
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        from ledger.core.errors import ValidationFailed

        raise ValidationFailed(f"{name}: not a time: {value[:40]!r}", code="bad_time") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@router.get("/search")
def search(
    request: Request,
    q: Annotated[str | None, Query(max_length=200, pattern=r"^[A-Za-z0-9._:@+=-]*$")] = None,
    client_request_id: Annotated[str | None, Query(max_length=200,
                                                   pattern=r"^[A-Za-z0-9._:@+=-]*$")] = None,
    model: Annotated[str | None, Query(max_length=200, pattern=SafeText)] = None,
    channel: Literal["", "deterministic", "performance"] = "",
    fingerprint: Annotated[str | None, Query(pattern=r"^(fp-[0-9a-f]{16})?$")] = None,
    dispute: Literal["", "any", "none", *queries.DISPUTE_STATES] = "",  # type: ignore[valid-type]
    after: Annotated[str | None, Query(max_length=40)] = None,
    before: Annotated[str | None, Query(max_length=40)] = None,
    cursor: Annotated[str | None, Query(max_length=400, pattern=r"^[A-Za-z0-9_-]*$")] = None,
    user: sessions.ConsoleUser = Depends(signed_in("envelopes:read")),
    session: Session = Depends(get_session),
) -> Response:
    query = queries.SearchQuery(q or None, client_request_id or None, model or None,
                                channel or None, fingerprint or None, dispute or None,
                                _time(after, "after"), _time(before, "before"))
    rows, nxt = queries.search(session, query, cursor=cursor or None)
    form = {"q": q or "", "client_request_id": client_request_id or "", "model": model or "",
            "channel": channel, "fingerprint": fingerprint or "", "dispute": dispute,
            "after": after or "", "before": before or ""}
    next_url = None
    if nxt:
        next_url = "/console/search?" + urlencode({**{k: v for k, v in form.items() if v},
                                                   "cursor": nxt})
    return page(request, "search.html", user, rows=rows, form=form, next_url=next_url,
                states=queries.DISPUTE_STATES)


# --- one request -------------------------------------------------------------------------------

def _readable(session: Session, predicate: dict[str, Any]) -> dict[str, Any]:
    digest = (predicate.get("artifacts") or {}).get("tokenizer_sha256")
    prompt = tokenizers.decoded(session, digest, list(predicate.get("prompt_token_ids") or []))
    output = tokenizers.decoded(session, digest,
                                list((predicate.get("output") or {}).get("token_ids") or []))
    return {"prompt": prompt, "output": output, "tokenizer_sha256": digest,
            "reason": prompt.reason}


@router.get("/requests/{request_id}")
def request_page(request: Request, request_id: RequestIdPath,
                 ids: Annotated[bool, Query(description="show token IDs")] = False,
                 user: sessions.ConsoleUser = Depends(signed_in("envelopes:read")),
                 session: Session = Depends(get_session),
                 settings: Settings = Depends(get_settings_dep)) -> Response:
    view = queries.request_view(session, settings, request_id)
    readable = _readable(session, view.predicate)
    return page(request, "request.html", user, view=view, readable=readable, show_ids=ids,
                p=view.predicate)


@router.post("/requests/{request_id}/dispute")
def open_dispute(request: Request, request_id: RequestIdPath,
                 reason: Annotated[str, Form(min_length=1, max_length=4000, pattern=SafeText)],
                 priority: Annotated[Literal["low", "normal", "high"], Form()] = "normal",
                 user: sessions.ConsoleUser = Depends(posted("disputes:write")),
                 session: Session = Depends(get_session),
                 settings: Settings = Depends(get_settings_dep)) -> Response:
    state = request.app.state
    dispute, _ = actions.open_dispute(session, state.engine, state.publisher,
                                      state.service_signer, settings, user.principal,
                                      request_id=request_id, reason=reason, priority=priority)
    return back(f"/console/disputes/{dispute.id}")


# --- disputes ----------------------------------------------------------------------------------

@router.get("/disputes")
def dispute_queue(request: Request,
                  state: Literal["", "open", *queries.DISPUTE_STATES] = "open",  # type: ignore[valid-type]
                  user: sessions.ConsoleUser = Depends(signed_in("disputes:read")),
                  session: Session = Depends(get_session)) -> Response:
    return page(request, "disputes.html", user, rows=queries.dispute_queue(session, state or None),
                state=state, states=queries.DISPUTE_STATES)


@router.get("/disputes/{dispute_id}")
def dispute_page(request: Request, dispute_id: UuidPath,
                 user: sessions.ConsoleUser = Depends(signed_in("disputes:read")),
                 session: Session = Depends(get_session)) -> Response:
    d = queries.dispute_view(session, dispute_id)
    return page(request, "dispute.html", user, d=d, v=d["verdict"])


@router.post("/disputes/{dispute_id}/comment")
def comment(dispute_id: UuidPath,
            text: Annotated[str, Form(min_length=1, max_length=10_000, pattern=SafeText)],
            request: Request,
            user: sessions.ConsoleUser = Depends(posted("disputes:write")),
            session: Session = Depends(get_session)) -> Response:
    actions.comment(session, request.app.state.service_signer, user.principal, dispute_id, text)
    return back(f"/console/disputes/{dispute_id}#timeline")


@router.post("/disputes/{dispute_id}/resolve")
def resolve(dispute_id: UuidPath, request: Request,
            resolution: Annotated[Literal["upheld", "rejected"], Form()],
            note: Annotated[str, Form(min_length=1, max_length=10_000, pattern=SafeText)],
            user: sessions.ConsoleUser = Depends(posted("disputes:write")),
            session: Session = Depends(get_session)) -> Response:
    actions.resolve(session, request.app.state.service_signer, user.principal, dispute_id,
                    resolution, note)
    return back(f"/console/disputes/{dispute_id}")


# --- the verdict diff --------------------------------------------------------------------------

def _label(pieces: dict[int, str] | None, token: int | None) -> str:
    if token is None:
        return "(ended)"
    if pieces is not None and token in pieces:
        text = pieces[token]
        shown = text if text.startswith("<") and text.endswith(">") else repr(text)
        return f"{shown} #{token}"
    return f"#{token}"


@router.get("/verdicts/{verdict_id}")
def verdict_page(request: Request,
                 verdict_id: Annotated[str, PathParam(max_length=200,
                                                      pattern=r"^[A-Za-z0-9._:@+=-]+$")],
                 user: sessions.ConsoleUser = Depends(signed_in("disputes:read")),
                 session: Session = Depends(get_session),
                 settings: Settings = Depends(get_settings_dep)) -> Response:
    v = queries.verdict_view(session, verdict_id)
    if v is None:
        raise NotFound(f"no verdict {verdict_id}")
    view = queries.request_view(session, settings, v["request_id"])
    details = v["details"] or {}
    expected = view.predicate.get("output") or {}
    replayed = details.get("replayed") or {}
    has_replay = "token_ids" in replayed
    steps = queries.diff_steps(expected, replayed if has_replay else {})
    div = details.get("first_divergence") or None
    k = div.get("index") if div else None
    digest = (view.predicate.get("artifacts") or {}).get("tokenizer_sha256")
    tok, reason = tokenizers.tokenizer_for(session, digest)
    texts: dict[int, str] | None = None
    if tok is not None:
        vocab_ids = {s.expected for s in steps} | {s.replayed for s in steps}
        for tops in ((div or {}).get("expected_top_logprobs") or {},
                     (div or {}).get("replayed_top_logprobs") or {}):
            for step in tops.values():
                vocab_ids |= {int(t) for t, _ in step or []}
        texts = {t: tokenizers.token_text(tok, t) for t in vocab_ids if t is not None}
    topk = []
    if div is not None and k is not None:
        # the top-k both sides signed into the verdict at k-1 and k (every verdict has them)
        recorded_tokens = expected.get("token_ids") or []
        for key, at in (("k-1", k - 1), ("k", k)):
            if at < 0:
                continue
            before = recorded_tokens[at] if at < len(recorded_tokens) else None
            row = []
            for name, tops, chosen in (
                    ("recorded", (div.get("expected_top_logprobs") or {}).get(key),
                     div.get("expected_token") if key == "k" else before),
                    ("replayed", (div.get("replayed_top_logprobs") or {}).get(key),
                     div.get("replayed_token") if key == "k" else before)):
                entries = [(_label(texts, int(t)), float(lp), int(t) == chosen)
                           for t, lp in tops or []]
                row.append(charts.topk_bars(entries, title=f"{name} at step {at} ({key})"))
            topk.append((at, row))
    diffs = [s.logprob_diff for s in steps[: (k if k is not None else len(steps))]]
    diff_chart = charts.step_diffs(
        diffs, what=" before k" if k is not None else "") if any(
        d is not None for d in diffs) else None
    return page(request, "verdict.html", user, v=v, details=details, steps=steps, k=k,
                texts=texts, tokenizer_reason=reason, has_replay=has_replay, topk=topk,
                diff_chart=diff_chart, label=_label, view=view,
                max_abs=details.get("max_abs_logprob_diff"))


# --- re-verification ---------------------------------------------------------------------------

@router.get("/reverification")
def runs_page(request: Request, kind: Literal["", "policy", "gate"] = "",
              user: sessions.ConsoleUser = Depends(signed_in("policies:read")),
              session: Session = Depends(get_session)) -> Response:
    runs = queries.runs_with_drift(session, kind or None)
    points = [(r["window_end"] or r["created_at"], r["drift_rate"]) for r in runs
              if r["drift_rate"] is not None and not math.isnan(r["drift_rate"])]
    return page(request, "runs.html", user, runs=runs, kind=kind,
                chart=charts.drift_over_time(points))


# --- replay matrix -----------------------------------------------------------------------------

@router.get("/matrix-runs")
def matrix_list_page(request: Request,
                     user: sessions.ConsoleUser = Depends(signed_in("matrix:read")),
                     session: Session = Depends(get_session),
                     settings: Settings = Depends(get_settings_dep)) -> Response:
    """Matrix runs, newest first (requested ones and fingerprint gates), each checked
    against its signed request (one that is not vouched for says why, in place of its
    fields) and linked to its page, where its signed reports are checked before they are
    shown."""
    from ledger.replay import matrix_runs

    return page(request, "matrix_runs.html", user, runs=matrix_runs.list_matrix_runs(
        session, matrix_runs.checker_for(settings)).items)


@router.get("/matrix-runs/{run_id}")
def matrix_page(request: Request, run_id: UuidPath,
                user: sessions.ConsoleUser = Depends(signed_in("matrix:read")),
                session: Session = Depends(get_session),
                settings: Settings = Depends(get_settings_dep)) -> Response:
    """A matrix run and its report, checked against its signed leaf before it is shown."""
    from ledger.replay import matrix_runs
    from ledger.replay.matrix import fingerprint_rows, table_rows

    try:
        job_id = uuid.UUID(run_id)
    except ValueError:
        raise NotFound(f"no matrix run {run_id}") from None
    run = matrix_runs.matrix_run_state(session, job_id, matrix_runs.checker_for(settings))
    rep = run["report"]
    cells = rep["cells"] if rep else []
    histograms = [(c["cell"], charts.divergence_histogram(
        c["first_divergence_histogram"], what=f" ({c['cell']})")) for c in cells
        if c["first_divergence_histogram"]]
    parts = [{**p, "rows": table_rows(p["report"]) if p["report"] else [[]]}
             for p in run["parts"][1:]]
    return page(request, "matrix.html", user, run=run, share=charts.share_bars(cells),
                rows=table_rows(rep) if rep else [[]], histograms=histograms, parts=parts,
                fingerprint_rows=fingerprint_rows(run["parts"]))


# --- export ------------------------------------------------------------------------------------

@router.get("/export")
def export_form(request: Request,
                request_id: Annotated[list[str] | None, Query(max_length=1000)] = None,
                user: sessions.ConsoleUser = Depends(signed_in("export")),
                session: Session = Depends(get_session)) -> Response:
    return page(request, "export.html", user, request_ids="\n".join(request_id or []))


@router.post("/export")
def export(request: Request,
           request_ids: Annotated[str, Form(max_length=200_000)] = "",
           limit: Annotated[int | None, Form(ge=1, le=1_000_000)] = None,
           user: sessions.ConsoleUser = Depends(posted("export")),
           session: Session = Depends(get_session)) -> Response:
    import re

    ids = [x for x in re.split(r"[\s,]+", request_ids) if x]
    bad = [x for x in ids if not re.fullmatch(r"[A-Za-z0-9._:@+=-]{1,200}", x)]
    if bad:
        from ledger.core.errors import ValidationFailed

        raise ValidationFailed(f"not a request ID: {bad[0][:50]!r}", code="invalid_request")
    body = actions.export(session, request.app.state.engine, request.app.state.service_signer,
                          user.principal, ids, limit)
    return StreamingResponse(body, media_type="application/x-ndjson", headers={
        "Content-Disposition": 'attachment; filename="ledger-bundle.jsonl"'})


# --- tokenizers (admin) ------------------------------------------------------------------------

@router.get("/tokenizers")
def tokenizers_page(request: Request,
                    user: sessions.ConsoleUser = Depends(signed_in("envelopes:read")),
                    session: Session = Depends(get_session)) -> Response:
    return page(request, "tokenizers.html", user, rows=tokenizers.list_tokenizers(session))


@router.post("/tokenizers")
async def register_tokenizer(
        request: Request,
        file: Annotated[UploadFile, File(description="tokenizer.json")],
        expected_sha256: Annotated[str, Form(pattern=r"^([0-9a-f]{64})?$")] = "",
        name: Annotated[str, Form(max_length=200, pattern=SafeText)] = "",
        user: sessions.ConsoleUser = Depends(posted("keys:write")),
        session: Session = Depends(get_session)) -> Response:
    import hashlib

    from fastapi.concurrency import run_in_threadpool

    content = await file.read(tokenizers.MAX_TOKENIZER_BYTES + 1)
    digest = hashlib.sha256(content).hexdigest()
    if expected_sha256 and digest != expected_sha256:
        from ledger.core.errors import ValidationFailed

        raise ValidationFailed(f"the file hashes to {digest}, not the expected "
                               f"{expected_sha256} (the envelope's tokenizer_sha256)",
                               code="tokenizer_hash_mismatch")

    def store() -> None:
        tokenizers.register(session, content, name=name or (file.filename or ""),
                            principal=user.principal)
        session.commit()

    await run_in_threadpool(store)
    return back("/console/tokenizers")
