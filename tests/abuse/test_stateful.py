"""Stateful abuse run: schemathesis' state machine drives the live API along the OpenAPI links
(``ledger/api/links.py``): a stored envelope leads to its proof, a dispute, comments and
resolve attempts; keys to revocation; checkpoints to consistency proofs.

POST bodies are made able to succeed: envelope bodies are real signed envelopes (fresh ones,
verbatim repeats, other bytes under a stored request_id, a stored signature over a changed
request_id) or, sometimes, what schemathesis generated; key bodies carry fresh Ed25519
keys. At least :data:`MIN_CALLS` calls; no 5xx; every response conforms to the schema; every
4xx is problem+json; and the database holds exactly what the API said it created.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import time
from collections import Counter
from typing import Any

import psycopg
import pytest
import requests
import schemathesis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, precondition, rule
from schemathesis.models import Case
from schemathesis.specs.openapi.checks import ensure_resource_availability, use_after_free
from schemathesis.specs.openapi.links import get_all_links
from schemathesis.stateful.state_machine import StepResult

from ledger.core.keys import public_raw
from tests.api.test_roles import _routes
from tests.api.test_schemathesis import _role_for
from tests.helpers import MODEL_SHA, ApiServer, signed, statement

schemathesis.experimental.OPEN_API_3_1.enable()  # FastAPI emits OpenAPI 3.1

MIN_CALLS = 2000
TIME_BUDGET_S = 200          # the run stops adding batches after this; the count is asserted
RUNS_PER_BATCH = 10
STEPS_PER_RUN = 30
INGESTS_PER_RUN = 4         # envelopes a run may add besides its entry point
ENVELOPE_KINDS = ("fresh", "fresh", "fresh", "repeat", "conflict", "rebound", "generated")


def _problem_json_for_4xx(ctx: Any, response: Any, case: Case) -> None:
    if 400 <= response.status_code < 500:
        ctype = response.headers.get("content-type", "")
        assert ctype.startswith("application/problem+json"), (case.operation.verbose_name, ctype)
        body = response.json()
        assert body["status"] == response.status_code and body["code"], body


class Tally:
    """What the run did: calls per (operation, status), envelopes and disputes created."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, int]] = Counter()
        self.stored: list[dict[str, Any]] = []     # envelopes the API accepted, as sent
        self.created_envelopes = 0
        self.created_disputes = 0
        self.dispute_ids: list[str] = []            # disputes the API returned (201 or 200)
        self.key_ids: list[str] = []                # signing keys the API registered (201)

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def status(self, operation: str, *statuses: int) -> int:
        return sum(n for (op, s), n in self.calls.items()
                   if op == operation and (not statuses or s in statuses))


def _payload(env: dict[str, Any]) -> dict[str, Any]:
    return json.loads(base64.b64decode(env["payload"]))


def envelope_strategy(producer: Ed25519PrivateKey, tally: Tally) -> st.SearchStrategy[Any]:
    """A DSSE body for POST /v1/envelopes, or None for "keep the generated one"."""

    def build(kind: str, pick: int, prompt_len: int, output_len: int, channel: str,
              model: str) -> dict[str, Any] | None:
        if kind == "generated":
            return None
        if kind == "fresh" or not tally.stored:
            return signed(statement(f"sm-{secrets.token_hex(8)}", prompt_len=prompt_len,
                                    output_len=output_len, channel=channel,
                                    model_sha256=model), producer)
        old = tally.stored[pick % len(tally.stored)]
        if kind == "repeat":
            return old
        st_ = _payload(old)
        if kind == "conflict":  # other bytes, same request_id, properly signed: 409
            st_["predicate"]["output"]["finish_reason"] = "stop"
            return signed(st_, producer)
        # "rebound": the same envelope under another request_id, old signature kept: 422
        st_["predicate"]["request_id"] = f"sm-{secrets.token_hex(8)}"
        payload = json.dumps(st_, separators=(",", ":"), sort_keys=True).encode()
        return {**old, "payload": base64.b64encode(payload).decode()}

    return st.builds(build, st.sampled_from(ENVELOPE_KINDS), st.integers(0, 2**16),
                     st.integers(1, 12), st.integers(1, 6),
                     st.sampled_from(("deterministic", "performance")),
                     st.sampled_from((MODEL_SHA, "cd" * 32)))


def install_body_hooks(schema: Any, producer: Ed25519PrivateKey, tally: Tally) -> None:
    envelopes = envelope_strategy(producer, tally)

    def with_body(case: Case, body: Any) -> Case:
        if body is not None:
            case.body = body
        return case

    def flatmap_case(context: Any, case: Case) -> st.SearchStrategy[Case]:
        if case.data_generation_method is not None and case.data_generation_method.is_negative:
            return st.just(case)
        op = f"{case.method.upper()} {case.path}"
        if op == "POST /v1/envelopes":
            return envelopes.map(lambda body: with_body(case, body))
        if op == "POST /v1/envelopes/batch":
            items = st.lists(envelopes.filter(lambda b: b is not None), min_size=1, max_size=4)
            return st.one_of(st.just(case), items.map(
                lambda envs: with_body(case, {"envelopes": envs})))
        if op == "POST /v1/keys" and isinstance(case.body, dict):
            fresh = st.builds(lambda: base64.b64encode(
                public_raw(Ed25519PrivateKey.generate())).decode())
            return st.one_of(st.just(case), fresh.map(
                lambda key: with_body(case, {**case.body, "public_key": key})))
        return st.just(case)

    schema.hooks.register(flatmap_case)


def _counts(api: ApiServer) -> tuple[int, int]:
    url = api.db_url.replace("postgresql+psycopg://", "postgresql://")  # type: ignore[attr-defined]
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT (SELECT count(*) FROM envelopes), "
                           "(SELECT count(*) FROM disputes)").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def make_workflow(api: ApiServer, tally: Tally) -> type[RuleBasedStateMachine]:
    schema = schemathesis.from_uri(api.base_url + "/openapi.json", base_url=api.base_url)
    install_body_hooks(schema, api.producer, tally)  # type: ignore[attr-defined]
    routes = _routes()
    auth: dict[str, dict[str, str]] = {}
    for method, path, _ in routes:
        role = _role_for(method, path, routes)
        if role:
            auth[f"{method} {path}"] = {"Authorization": f"Bearer {api.keys[role]}"}
    session = requests.Session()

    ingest_case = schema["/v1/envelopes"]["POST"].as_strategy()
    dispute_case = schema["/v1/disputes"]["POST"].as_strategy()
    comment_case = schema["/v1/disputes/{dispute_id}/comments"]["POST"].as_strategy()
    revoke_case = schema["/v1/keys/{keyid}/revoke"]["POST"].as_strategy()

    class Workflow(schema.as_state_machine()):  # type: ignore[misc]
        ingested = 0
        disputed = 0
        commented = 0
        revoked = 0

        @precondition(lambda self: self.ingested < INGESTS_PER_RUN)
        @rule(target=Bundle("catch_all"), case=ingest_case)
        def ingest_signed_envelope(self, case: Case) -> StepResult | None:
            """Available in any state (schemathesis calls an entry point only while no
            response waits to be followed): envelopes, and so proofs and disputes, come in
            every run, whatever the run started with."""
            self.ingested += 1
            return self.step(case)

        @precondition(lambda self: bool(tally.stored) and self.disputed < 2)
        @rule(target=Bundle("catch_all"), case=dispute_case, pick=st.integers(0, 10**6))
        def dispute_a_stored_envelope(self, case: Case, pick: int) -> StepResult | None:
            """Links reach disputes only when a generated body names a stored request;
            this rule makes sure every run can go deep (dispute -> comment -> resolve)."""
            self.disputed += 1
            stored = tally.stored[pick % len(tally.stored)]
            case.body = {"request_id": _payload(stored)["predicate"]["request_id"],
                         "reason": "stateful run", "priority": "normal"}
            return self.step(case)

        @precondition(lambda self: bool(tally.dispute_ids) and self.commented < 2)
        @rule(target=Bundle("catch_all"), case=comment_case, pick=st.integers(0, 10**6))
        def comment_on_a_dispute(self, case: Case, pick: int) -> StepResult | None:
            self.commented += 1
            case.path_parameters = {
                "dispute_id": tally.dispute_ids[pick % len(tally.dispute_ids)]}
            case.body = {"text": "stateful run comment"}
            return self.step(case)

        @precondition(lambda self: bool(tally.key_ids) and self.revoked < 1)
        @rule(target=Bundle("catch_all"), case=revoke_case, pick=st.integers(0, 10**6))
        def revoke_a_registered_key(self, case: Case, pick: int) -> StepResult | None:
            """The link from a registered key to its revocation is one of many a run may
            follow; a full-suite CI run once made 23 registrations and no revocation."""
            self.revoked += 1
            case.path_parameters = {"keyid": tally.key_ids[pick % len(tally.key_ids)]}
            case.body = {"reason": "stateful run"}
            return self.step(case)

        def _add_results_to_targets(self, targets: Any, results: Any) -> None:
            # schemathesis 3.39 routes a step's result to the bundle of the links its
            # response status matches by overriding `_add_result_to_targets`, a name the
            # installed Hypothesis no longer calls (it calls this one): without this every
            # result lands in "catch_all", no link is ever followed, and the run stops with
            # "No progress can be made".
            for result in results:
                target = (self._get_target_for_result(result)
                          if isinstance(result, StepResult) else None)
                if target is not None:
                    RuleBasedStateMachine._add_results_to_targets(self, (target,), [result])

        def before_call(self, case: Case) -> None:
            case.headers = {**(case.headers or {}), **auth.get(case.operation.verbose_name, {})}

        def get_call_kwargs(self, case: Case) -> dict[str, Any]:
            return {"session": session, "timeout": 60}

        def call(self, case: Case, **kwargs: Any) -> Any:
            response = case.call(**kwargs)
            operation, status = case.operation.verbose_name, response.status_code
            tally.calls[(operation, status)] += 1
            assert status < 500, (operation, response.text[:500])
            if operation == "POST /v1/envelopes" and status == 201:
                tally.created_envelopes += 1
                tally.stored.append(case.body)
            elif operation == "POST /v1/envelopes/batch" and status == 200:
                tally.created_envelopes += response.json()["created"]
            elif operation == "POST /v1/disputes" and status in (200, 201):
                tally.created_disputes += status == 201
                tally.dispute_ids.append(response.json()["id"])
            elif operation == "POST /v1/keys" and status == 201:
                tally.key_ids.append(response.json()["keyid"])
            return response

        def validate_response(self, response: Any, case: Case,
                              additional_checks: tuple[Any, ...] = ()) -> None:
            # every default check (no 5xx, status, content type, headers and body conform;
            # auth is enforced), plus: a resource just created is there, 4xx is problem+json
            case.validate_response(
                response, headers=auth.get(case.operation.verbose_name),
                additional_checks=(use_after_free, ensure_resource_availability,
                                   _problem_json_for_4xx),
                transport_kwargs=self._transport_kwargs)

    return Workflow


#: Operations (and statuses) every stateful run must reach, not just the entry points.
DEEP_STATES: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("POST /v1/envelopes", (201,)), ("POST /v1/envelopes", (200,)),
    ("POST /v1/envelopes", (409,)), ("POST /v1/envelopes", (422,)),
    ("GET /v1/envelopes/{request_id}", (200,)),
    ("GET /v1/envelopes/{request_id}/proof", (200,)),
    ("POST /v1/disputes", (201,)),
    ("POST /v1/disputes/{dispute_id}/comments", (201,)),
    ("POST /v1/disputes/{dispute_id}/resolve", ()),
    ("POST /v1/keys/{keyid}/revoke", (200,)),
    ("POST /v1/api-keys/{key_id}/revoke", (200,)),
    ("GET /v1/log/consistency", (200,)))


def test_stateful_run_has_no_5xx_conforms_and_writes_only_what_it_reports(
        api: ApiServer) -> None:
    tally = Tally()
    before = _counts(api)
    workflow = make_workflow(api, tally)
    run_settings = settings(max_examples=RUNS_PER_BATCH, stateful_step_count=STEPS_PER_RUN,
                            deadline=None, phases=[Phase.generate], database=None,
                            suppress_health_check=list(HealthCheck))
    start = time.monotonic()

    def unreached() -> list[tuple[str, tuple[int, ...]]]:
        return [(op, statuses) for op, statuses in DEEP_STATES
                if not tally.status(op, *statuses)]

    # batches until enough calls AND every deep state was reached (a loaded machine makes
    # fewer calls per batch), within the time budget; both are asserted below
    while (tally.total < MIN_CALLS or unreached()) and time.monotonic() - start < TIME_BUDGET_S:
        workflow.run(settings=run_settings)
    elapsed = time.monotonic() - start
    summary = "\n".join(f"{op} {status}: {n}" for (op, status), n in sorted(tally.calls.items()))
    print(f"\n{tally.total} calls in {elapsed:.0f}s\n{summary}")
    assert tally.total >= MIN_CALLS, (tally.total, elapsed)
    # the deep states were reached, not just the entry points
    for operation, statuses in DEEP_STATES:
        assert tally.status(operation, *statuses), (operation, statuses, summary)
    # rejected requests wrote nothing: the database holds exactly what was reported created
    assert _counts(api) == (before[0] + tally.created_envelopes,
                            before[1] + tally.created_disputes)


def test_every_served_link_names_an_operation_and_its_parameters(api: ApiServer) -> None:
    served = requests.get(api.base_url + "/openapi.json", timeout=30).json()
    by_id = {op["operationId"]: op for ops in served["paths"].values() for op in ops.values()}
    links = [(name, link) for ops in served["paths"].values() for op in ops.values()
             for response in op["responses"].values()
             for name, link in response.get("links", {}).items()]
    assert len(links) >= 25
    expression = re.compile(r"^\$response\.body#(/[A-Za-z0-9_]+)+$")
    for name, link in links:
        target = by_id[link["operationId"]]
        declared = {f"{p['in']}.{p['name']}" for p in target.get("parameters", [])}
        assert set(link.get("parameters", {})) <= declared, (name, link)
        if "requestBody" in link:
            assert "requestBody" in target, name
        values = [*link.get("parameters", {}).values(),
                  *(link.get("requestBody") or {}).values()]
        for value in values:
            assert expression.match(value) or not value.startswith("$"), (name, value)
    # and schemathesis resolves every one of them to an operation of the loaded schema
    schema = schemathesis.from_dict(served, base_url=api.base_url)
    resolved = [link.get_target_operation().verbose_name
                for result in schema.get_all_operations()
                for _, link in get_all_links(result.ok())]
    assert len(resolved) == len(links)


@pytest.mark.parametrize("change", [
    {"target": "GET /v1/nowhere"},
    {"parameters": {"path.request_idd": "$response.body#/request_id"}},
    {"statuses": ("418",)},
    {"target": "GET /v1/envelopes/{request_id}", "request_body": {"x": 1}},
])
def test_a_link_to_something_missing_is_refused(change: dict[str, Any]) -> None:
    from dataclasses import replace

    from ledger.api.app import create_app
    from ledger.api.links import LINKS, _operations, check_link
    from ledger.settings import Settings

    app = create_app(Settings(database_url="postgresql+psycopg://nobody@127.0.0.1:1/none"))
    operations = _operations(app.openapi())
    for link in LINKS:
        check_link(link, operations)
    with pytest.raises(ValueError, match="link GetEnvelope"):
        check_link(replace(LINKS[0], **change), operations)

