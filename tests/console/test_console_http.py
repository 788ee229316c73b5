"""The console over plain HTTP (no browser): sign-in, roles, CSRF, escaping, the actions
recorded as the API records them. The browser tests (test_console_browser.py) walk the
same pages in Chromium."""

from __future__ import annotations

import html
import re
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select

from ledger.db.models import AuditEvent, ConsoleSession, DisputeEvent
from ledger.db.session import session_scope
from tests.console.conftest import XSS_PROMPT, ConsoleStack


def _login_token(c: httpx.Client) -> str:
    r = c.get("/console/sign-in")
    assert r.status_code == 200
    return re.search(r'name="csrf_token" value="([^"]+)"', r.text).group(1)


def signed_in(stack: ConsoleStack, role: str) -> tuple[httpx.Client, str]:
    c = httpx.Client(base_url=stack.url, timeout=60, follow_redirects=False)
    r = c.post("/console/sign-in", data={"api_key": stack.keys[role],
                                         "csrf_token": _login_token(c)})
    assert r.status_code == 303, r.text
    page = c.get("/console/search")
    assert page.status_code == 200
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    return c, csrf


def shown_text(page: str, cls: str) -> str:
    """The text a reader sees in a token box (each token is its own <span>)."""
    box = re.search(rf'<div class="tokens {cls}">(.*?)</div>', page, re.S).group(1)
    return html.unescape(re.sub(r"</?span[^>]*>", "", box))


def test_cookie_flags_and_session_row(console_stack: ConsoleStack) -> None:
    c = httpx.Client(base_url=console_stack.url, timeout=30)
    r = c.post("/console/sign-in", data={"api_key": console_stack.keys["reviewer"],
                                         "csrf_token": _login_token(c)})
    cookie = next(v for k, v in r.headers.multi_items() if k == "set-cookie"
                  and v.startswith("ledger_console="))
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    assert "Path=/console" in cookie and "Secure" not in cookie  # plain HTTP here
    token = cookie.split(";")[0].split("=", 1)[1]
    with session_scope(console_stack.db) as s:
        stored = [bytes(t) for t in s.scalars(select(ConsoleSession.token_sha256))]
    from ledger.services.apikeys import hash_key
    from tests.helpers import TEST_PEPPER

    assert hash_key(token, TEST_PEPPER) in stored  # only its HMAC under the pepper is kept
    assert token.encode() not in b"".join(stored)


def test_ingester_and_worker_keys_get_no_console(console_stack: ConsoleStack) -> None:
    for role in ("ingester", "worker"):
        c = httpx.Client(base_url=console_stack.url, timeout=30)
        r = c.post("/console/sign-in", data={"api_key": console_stack.keys[role],
                                             "csrf_token": _login_token(c)})
        assert r.status_code == 403 and "has no console" in r.text
        assert "ledger_console=" not in r.headers.get("set-cookie", "")
        assert c.get("/console/search").status_code == 303  # still signed out


def test_unsigned_visitor_is_sent_to_sign_in(console_stack: ConsoleStack) -> None:
    r = httpx.get(console_stack.url + "/console/requests/x", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/console/sign-in?next=")


def test_post_without_csrf_token_fails_and_writes_nothing(console_stack: ConsoleStack) -> None:
    c, _ = signed_in(console_stack, "reviewer")
    with session_scope(console_stack.db) as s:
        before = len(s.scalars(select(DisputeEvent.event_id)).all())
    for data in ({"reason": "no token"}, {"reason": "wrong token", "csrf_token": "x" * 43}):
        r = c.post(f"/console/requests/{console_stack.honest}/dispute", data=data)
        assert r.status_code == 403 and "CSRF" in r.text
    with session_scope(console_stack.db) as s:
        assert len(s.scalars(select(DisputeEvent.event_id)).all()) == before
    r = c.post("/console/sign-in", data={"api_key": console_stack.keys["reviewer"]})
    assert r.status_code == 403  # the sign-in form too


def test_html_in_a_prompt_is_escaped_and_no_inline_script_may_run(
        console_stack: ConsoleStack) -> None:
    c, _ = signed_in(console_stack, "reviewer")
    r = c.get(f"/console/requests/{console_stack.xss}")
    assert r.status_code == 200
    # no element came from the prompt: the page itself has no <script>, <img> or <b>
    assert "<script" not in r.text and "<img" not in r.text and "<b>this" not in r.text
    # ... yet every character is shown, as text
    assert shown_text(r.text, "prompt") == "<bos>" + XSS_PROMPT
    assert "script-src 'self'" in r.headers["content-security-policy"]


def test_request_page_verifies_signature_and_inclusion(console_stack: ConsoleStack) -> None:
    c, _ = signed_in(console_stack, "reviewer")
    r = c.get(f"/console/requests/{console_stack.honest}")
    assert r.status_code == 200
    assert "Verified" in r.text and "Not verified" not in r.text
    assert "inclusion proof of leaf" in r.text and "trust policy" in r.text
    from ledger.demo import PROMPTS

    assert shown_text(r.text, "prompt") in {"<bos>" + p for p in PROMPTS}  # readable
    assert "is not registered" not in r.text


def test_search_filters(console_stack: ConsoleStack) -> None:
    c, _ = signed_in(console_stack, "auditor")
    r = c.get("/console/search", params={"q": "demo-console-alt"})
    assert "demo-console-altered" in r.text and console_stack.honest not in r.text
    r = c.get("/console/search", params={"model": "TINY-DEMO"})
    assert r.text.count('class="rid"') == 10
    r = c.get("/console/search", params={"model": "other"})
    assert 'class="rid"' not in r.text
    r = c.get("/console/search", params={"channel": "performance"})
    assert 'class="rid"' not in r.text
    assert c.get("/console/search", params={"nope": "1"}).status_code == 400


def test_dispute_to_verdict_comment_resolve_recorded_as_the_api_does(
        console_stack: ConsoleStack) -> None:
    c, csrf = signed_in(console_stack, "reviewer")
    r = c.post(f"/console/requests/{console_stack.altered}/dispute",
               data={"reason": "customer says the answer changed", "priority": "high",
                     "csrf_token": csrf})
    assert r.status_code == 303
    dispute_url = r.headers["location"]
    dispute_id = dispute_url.rsplit("/", 1)[1]
    console_stack.publisher.wait_idle(120)
    for _ in range(100):
        page = c.get(dispute_url).text
        if "see the token diff" in page:
            break
        time.sleep(0.1)
    assert "diverged" in page
    verdict_url = re.search(r'href="(/console/verdicts/[^"]+)"', page).group(1)
    diff = c.get(verdict_url).text
    assert f"k = {console_stack.k}" in diff and 'id="step-k"' in diff
    assert c.post(f"/console/disputes/{dispute_id}/comment",
                  data={"text": "looked at the diff", "csrf_token": csrf}).status_code == 303
    assert c.post(f"/console/disputes/{dispute_id}/resolve",
                  data={"resolution": "upheld", "note": "the record was altered",
                        "csrf_token": csrf}).status_code == 303
    api = httpx.get(f"{console_stack.url}/v1/disputes/{dispute_id}", headers={
        "Authorization": f"Bearer {console_stack.keys['reviewer']}"}).json()
    assert api["state"] == "resolved" and api["resolution"] == "upheld"
    kinds = [e["kind"] for e in api["events"]]
    assert "comment" in kinds and kinds[-1] == "resolved"
    mine = [e["kind"] for e in api["events"] if e["actor"] == "console-reviewer (reviewer)"]
    assert mine == ["opened", "comment", "resolved"], api["events"]
    with session_scope(console_stack.db) as s:
        actions = {a for a, in s.execute(select(AuditEvent.action).where(
            AuditEvent.target == dispute_id))}
    assert actions == {"dispute.open", "dispute.comment", "dispute.resolve"}


def test_auditor_exports_a_bundle_reviewer_may_not(console_stack: ConsoleStack) -> None:
    c, csrf = signed_in(console_stack, "auditor")
    r = c.post("/console/export", data={"request_ids": console_stack.honest,
                                        "csrf_token": csrf})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    assert console_stack.honest.encode() in r.content or len(r.content.splitlines()) > 1
    rc, rcsrf = signed_in(console_stack, "reviewer")
    assert rc.post("/console/export", data={"csrf_token": rcsrf}).status_code == 403


def test_docs_served_from_local_assets(console_stack: ConsoleStack) -> None:
    r = httpx.get(console_stack.url + "/docs")
    assert r.status_code == 200 and "cdn" not in r.text.lower()
    assert "/console/static/swagger-ui/swagger-ui-bundle.js" in r.text
    js = httpx.get(console_stack.url + "/console/static/swagger-ui/swagger-ui-bundle.js")
    assert js.status_code == 200 and len(js.content) > 1_000_000


def test_admin_registers_a_tokenizer_by_its_hash(console_stack: ConsoleStack) -> None:
    """Upload, a hash mismatch refused, other roles refused, and a row edited in the
    database decodes nothing (its bytes no longer hash to its name)."""
    import hashlib

    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    content = tok.to_str().encode()
    digest = hashlib.sha256(content).hexdigest()
    c, csrf = signed_in(console_stack, "admin")
    wrong = c.post("/console/tokenizers", data={"csrf_token": csrf, "expected_sha256": "0" * 64},
                   files={"file": ("tokenizer.json", content)})
    assert wrong.status_code == 422 and "tokenizer_hash_mismatch" in wrong.text
    junk = c.post("/console/tokenizers", data={"csrf_token": csrf},
                  files={"file": ("tokenizer.json", b'{"not": "a tokenizer"}')})
    assert junk.status_code == 422 and "invalid_tokenizer" in junk.text
    r = c.post("/console/tokenizers", data={"csrf_token": csrf, "expected_sha256": digest,
                                            "name": "words"},
               files={"file": ("tokenizer.json", content)})
    assert r.status_code == 303
    assert digest in c.get("/console/tokenizers").text
    rc, rcsrf = signed_in(console_stack, "reviewer")
    assert rc.post("/console/tokenizers", data={"csrf_token": rcsrf},
                   files={"file": ("tokenizer.json", content)}).status_code == 403
    with session_scope(console_stack.db) as s:
        actions = [a for a, in s.execute(select(AuditEvent.action).where(
            AuditEvent.target == digest))]
    assert actions == ["tokenizer.register"]

    from ledger.console import tokenizers

    with session_scope(console_stack.db) as s:
        assert tokenizers.decoded(s, digest, [1, 2]).text == "hello world"
        tokenizers._CACHE._items.clear()  # a fresh process
        s.execute(__import__("sqlalchemy").text(
            "UPDATE tokenizers SET content = convert_to(replace(convert_from(content, 'UTF8'), "
            "'hello', 'HACKD'), 'UTF8') "
            "WHERE tokenizer_sha256 = :d"), {"d": digest})
        out = tokenizers.decoded(s, digest, [1, 2])
        assert out.pieces is None and "does not hash to its name" in (out.reason or "")
        unknown = tokenizers.decoded(s, "f" * 64, [1, 2])
        assert unknown.pieces is None and "is not registered" in (unknown.reason or "")
        s.rollback()


def test_sign_out_and_a_revoked_key_end_the_session(console_stack: ConsoleStack) -> None:
    from ledger.services.apikeys import create_api_key, revoke_api_key
    from tests.helpers import TEST_PEPPER

    c, csrf = signed_in(console_stack, "reviewer")
    assert c.post("/console/sign-out", data={"csrf_token": csrf}).status_code == 303
    assert c.get("/console/search").status_code == 303  # back to the sign-in form
    with session_scope(console_stack.db) as s:
        row, key = create_api_key(s, name="console-short-lived", role="auditor",
                                  pepper=TEST_PEPPER)
        key_id = str(row.id)
    console_stack.keys["short-lived"] = key
    c, _ = signed_in(console_stack, "short-lived")
    assert c.get("/console/search").status_code == 200
    with session_scope(console_stack.db) as s:
        revoke_api_key(s, key_id)
    assert c.get("/console/search").status_code == 303


def test_request_page_counts_witness_cosignatures(console_stack: ConsoleStack,
                                                  tmp_path: Path) -> None:
    """With witnesses in the trust policy the page checks the checkpoint's cosignatures:
    below quorum it is pending, at quorum it holds, a forged one fails."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from sqlalchemy import text

    from ledger.console import queries
    from ledger.core.cosignature import sign_cosignature, split_note
    from ledger.core.keys import load_private_pem, public_raw
    from ledger.core.trust import WitnessKey, format_trust_policy
    from ledger.log.store import latest_checkpoint

    stack = console_stack
    witness = Ed25519PrivateKey.generate()
    wk = WitnessKey.from_public_key("witness.example", public_raw(witness))
    trust = tmp_path / "trust.toml"
    trust.write_text(format_trust_policy(
        stack.settings.log_name, [public_raw(load_private_pem(
            stack.settings.log_key_file.read_bytes()))], [], [wk], quorum=1))
    settings = stack.settings.model_copy(update={"trust_policy_file": trust})

    def witness_check(session: Any) -> queries.Check:
        view = queries.request_view(session, settings, stack.honest)
        return next(c for c in view.checks if c.name == "witnesses")

    with session_scope(stack.db) as s:
        pending = witness_check(s)
        assert pending.ok is None and "not yet" in pending.detail
        with s.connection().connection.cursor() as cur:
            cp = latest_checkpoint(cur)
        line = sign_cosignature(split_note(cp.note)[0], wk.name, witness, int(time.time()))
        s.execute(text("INSERT INTO checkpoint_cosignatures (tree_size, witness_name, key_id, "
                       "timestamp, signature) VALUES (:n, :w, :k, :t, :l)"),
                  {"n": cp.tree_size, "w": wk.name, "k": wk.key_id, "t": int(time.time()),
                   "l": line})
        held = witness_check(s)
        assert held.ok is True and "witness.example" in held.detail
        s.rollback()
        forged = sign_cosignature(split_note(cp.note)[0] + "x\n", wk.name, witness, 1)
        s.execute(text("INSERT INTO checkpoint_cosignatures (tree_size, witness_name, key_id, "
                       "timestamp, signature) VALUES (:n, :w, :k, 1, :l)"),
                  {"n": cp.tree_size, "w": wk.name, "k": wk.key_id, "l": forged})
        assert witness_check(s).ok is False
        s.rollback()
