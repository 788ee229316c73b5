"""Registry leaves on a real PostgreSQL: every key and API-key change made with the
service key is a signed admin_event leaf, and `vouched_keys` reports every row of the key
tables that its leaves do not account for (the way an insider with the superuser would
change them: triggers off, rows edited directly)."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy import Engine, select

from ledger.core import dsse
from ledger.core.keys import generate_private_key, key_id, private_pem, public_raw
from ledger.core.registry import open_admin_event
from ledger.core.trust import TrustPolicy
from ledger.db.models import AdminEvent, LogEntry
from ledger.db.session import session_scope
from ledger.log.registry import vouched_keys
from ledger.log.signer import LogSigner
from ledger.replay.records import Signer
from ledger.services import apikeys, keys
from tests.conftest import provision
from tests.helpers import REPO, run_server

ORIGIN = "ledger.test/registry"


def policy_for(service: Signer, log: LogSigner) -> TrustPolicy:
    return TrustPolicy(ORIGIN, (log.verifier(),), (public_raw(service.key),))


def superuser(db_url: str, *sql: tuple[str, tuple[object, ...]]) -> None:
    with psycopg.connect(db_url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        conn.execute("SET session_replication_role = replica")
        for statement, params in sql:
            conn.execute(statement, params)


@pytest.fixture
def signers(engine: Engine) -> tuple[Signer, LogSigner]:
    service = Signer(generate_private_key(), "ledger", "ledger-service")
    log = LogSigner(ORIGIN, generate_private_key())
    with session_scope(engine) as s:
        service.ensure_registered(s)  # its own registration: a leaf signed by itself
        log.ensure_registered(s, service)
    return service, log


def test_key_and_api_key_changes_are_signed_leaves(engine: Engine,
                                                   signers: tuple[Signer, LogSigner]) -> None:
    service, log = signers
    producer = generate_private_key()
    with session_scope(engine) as s:
        row, created = keys.register_key(s, public_key=public_raw(producer), purpose="producer",
                                         name="gw-1", signer=service, actor="alice")
        assert created
        keys.revoke_key(s, row.keyid, "rotated", signer=service, actor="alice")
        api, _ = apikeys.create_api_key(s, name="rev", role="reviewer", pepper="",
                                        created_by="alice", signer=service)
        apikeys.change_api_key_role(s, str(api.id), "auditor", signer=service, actor="bob")
        apikeys.revoke_api_key(s, str(api.id), signer=service, actor="bob")
        apikeys.revoke_api_key(s, str(api.id), signer=service, actor="bob")  # no-op: no leaf
    with session_scope(engine) as s:
        events = list(s.scalars(select(AdminEvent).order_by(AdminEvent.log_index)))
        assert [e.kind for e in events] == [
            "signing_key.registered", "signing_key.registered", "signing_key.registered",
            "signing_key.revoked", "api_key.created", "api_key.role_changed",
            "api_key.revoked"]
        assert [e.target for e in events[:3]] == [service.keyid, key_id(log.public_key),
                                                   key_id(public_raw(producer))]
        # each is a log leaf whose entry commits to the signed bytes, signed by the service key
        for e in events:
            entry = s.get(LogEntry, e.log_index)
            assert entry is not None and entry.kind == "admin_event" and entry.ref == e.event_id
            ev = open_admin_event(dsse.envelope_from_json(bytes(e.dsse)),
                                  lambda kid: public_raw(service.key) if kid == service.keyid
                                  else b"")
            assert ev.predicate == e.body
        assert events[5].body["api_key"]["role"] == "auditor"
        assert events[4].body["api_key"]["key_hash"] == api.key_hash.hex()
        vouched, problems = vouched_keys(s, policy_for(service, log))
    assert problems == []
    pk = vouched[key_id(public_raw(producer))]
    assert (pk.purpose, pk.name, pk.status, pk.vouched_by) == ("producer", "gw-1", "revoked",
                                                               "policy")
    assert pk.revoked_index == events[3].log_index
    assert set(vouched) == {service.keyid, key_id(log.public_key), key_id(public_raw(producer))}


def test_rows_the_leaves_do_not_account_for_are_reported(
        engine: Engine, db_url: str, signers: tuple[Signer, LogSigner]) -> None:
    service, log = signers
    policy = policy_for(service, log)
    honest, forged = generate_private_key(), generate_private_key()
    with session_scope(engine) as s:
        row, _ = keys.register_key(s, public_key=public_raw(honest), purpose="producer",
                                   name="gw", signer=service)
        keys.revoke_key(s, row.keyid, "compromised", signer=service)
        api, _ = apikeys.create_api_key(s, name="ing", role="ingester", pepper="",
                                        signer=service)
        revoked_leaf = s.scalar(select(AdminEvent.log_index).where(
            AdminEvent.kind == "signing_key.revoked"))
        created_leaf = s.scalar(select(AdminEvent.log_index).where(
            AdminEvent.kind == "api_key.created"))
        assert problems_of(s, policy) == []
    forged_kid = key_id(public_raw(forged))
    superuser(db_url,
              ("INSERT INTO signing_keys (keyid, public_key, purpose, name) "
               "VALUES (%s, %s, 'producer', 'gw-forged')", (forged_kid, public_raw(forged))),
              ("UPDATE signing_keys SET status = 'active', revoked_at = NULL WHERE keyid = %s",
               (row.keyid,)),
              ("UPDATE api_keys SET role = 'admin' WHERE id = %s", (api.id,)))
    with session_scope(engine) as s:
        vouched, problems = vouched_keys(s, policy)
    text = "\n".join(f"{i}: {m}" for i, m in problems)
    assert forged_kid not in vouched
    assert (None, f"signing key {forged_kid} (producer 'gw-forged') has no registration "
                  "leaf signed by a trusted service key") in problems, text
    assert any(i == revoked_leaf and "status is 'active' in the table, 'revoked'" in m
               for i, m in problems), text
    assert any(i == revoked_leaf and "revoked_at" in m for i, m in problems), text
    assert any(i == created_leaf and "role is 'admin' in the table, 'ingester'" in m
               for i, m in problems), text
    assert vouched[row.keyid].status == "revoked"  # the leaves, not the table, are believed


def problems_of(s: object, policy: TrustPolicy) -> list[tuple[int | None, str]]:
    return vouched_keys(s, policy)[1]  # type: ignore[arg-type]


def test_leaves_signed_by_a_key_outside_the_policy_vouch_for_nothing(
        engine: Engine, signers: tuple[Signer, LogSigner]) -> None:
    """An insider registers their own 'ledger' key in the table and signs leaves with it:
    without a policy those leaves look fine (flagged as database-vouched); with the policy
    they are problems and vouch for nothing."""
    service, log = signers
    rogue = Signer(generate_private_key(), "ledger", "rogue")
    producer = generate_private_key()
    with session_scope(engine) as s:
        rogue.ensure_registered(s)  # self-signed leaf, by a key the policy does not name
        keys.register_key(s, public_key=public_raw(producer), purpose="producer",
                          name="rogue-gw", signer=rogue)
    with session_scope(engine) as s:
        vouched, problems = vouched_keys(s, policy_for(service, log))
        weak, _ = vouched_keys(s, None)
    pkid = key_id(public_raw(producer))
    assert pkid not in vouched and rogue.keyid not in vouched
    assert sum("not a trusted service key" in m for _, m in problems) == 2, problems
    assert weak[pkid].vouched_by == "database"


def test_api_refuses_key_changes_without_the_service_key(db_url: str, tmp_path: Path) -> None:
    api_keys, _ = provision(db_url)
    with run_server(db_url, log_dir=tmp_path) as server:
        r = httpx.post(server.base_url + "/v1/keys", timeout=30,
                       headers={"Authorization": f"Bearer {api_keys['admin']}"},
                       json={"public_key": base64.b64encode(
                           public_raw(generate_private_key())).decode(),
                             "purpose": "producer", "name": "gw"})
        created = httpx.post(server.base_url + "/v1/api-keys", timeout=30,
                             headers={"Authorization": f"Bearer {api_keys['admin']}"},
                             json={"name": "x", "role": "reviewer"})
    assert r.status_code == 503, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert "LEDGER_SERVICE_KEY_FILE" in r.json()["detail"]
    assert created.status_code == 503 and "LEDGER_SERVICE_KEY_FILE" in created.text


def test_api_key_changes_over_the_api_are_leaves(db_url: str, tmp_path: Path,
                                                 engine: Engine) -> None:
    api_keys, _ = provision(db_url)
    service_file = tmp_path / "service.pem"
    service_key = generate_private_key()
    service_file.write_bytes(private_pem(service_key))
    with run_server(db_url, log_dir=tmp_path,
                    extra_env={"LEDGER_SERVICE_KEY_FILE": str(service_file)}) as server:
        h = {"Authorization": f"Bearer {api_keys['admin']}"}
        pub = public_raw(generate_private_key())
        r = httpx.post(server.base_url + "/v1/keys", headers=h, timeout=30,
                       json={"public_key": base64.b64encode(pub).decode(),
                             "purpose": "producer", "name": "gw"})
        assert r.status_code == 201, r.text
        c = httpx.post(server.base_url + "/v1/api-keys", headers=h, timeout=30,
                       json={"name": "x", "role": "reviewer"})
        assert c.status_code == 201, c.text
        ch = httpx.post(server.base_url + f"/v1/api-keys/{c.json()['id']}/role", headers=h,
                        timeout=30, json={"role": "auditor"})
        assert ch.status_code == 200 and ch.json()["role"] == "auditor", ch.text
        rv = httpx.post(server.base_url + f"/v1/keys/{key_id(pub)}/revoke", headers=h,
                        timeout=30, json={"reason": "test"})
        assert rv.status_code == 200, rv.text
    with session_scope(engine) as s:
        kinds = [(e.kind, e.actor) for e in s.scalars(select(AdminEvent).order_by(
            AdminEvent.log_index))]
    assert kinds == [("signing_key.registered", "ledger"),  # the service key, at start-up
                     ("signing_key.registered", "test-admin"),
                     ("api_key.created", "test-admin"), ("api_key.role_changed", "test-admin"),
                     ("signing_key.revoked", "test-admin")]


def test_cli_key_commands_append_leaves(db_url: str, tmp_path: Path, engine: Engine) -> None:
    service_file = tmp_path / "service.pem"
    service_file.write_bytes(private_pem(generate_private_key()))
    pub_file = tmp_path / "gw.pem"
    pub_file.write_bytes(private_pem(generate_private_key()))
    env = {**os.environ, "LEDGER_DATABASE_URL": db_url,
           "LEDGER_SERVICE_KEY_FILE": str(service_file)}
    for args in (["keys", "register", str(pub_file), "--purpose", "producer", "--name", "gw"],
                 ["apikey", "create", "--role", "reviewer", "--name", "rev"]):
        r = subprocess.run([sys.executable, "-m", "ledger.cli.main", *args], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
    with session_scope(engine) as s:
        kinds = [e.kind for e in s.scalars(select(AdminEvent).order_by(AdminEvent.log_index))]
        service = Signer.from_file(service_file, "ledger", "x")
        assert service is not None
        _, problems = vouched_keys(s, TrustPolicy(ORIGIN, (LogSigner(
            ORIGIN, generate_private_key()).verifier(),), (public_raw(service.key),)))
    assert kinds == ["signing_key.registered", "signing_key.registered", "api_key.created"]
    assert problems == []


def test_keys_registered_before_the_registry_are_attested(
        engine: Engine, db_url: str, tmp_path: Path) -> None:
    """The upgrade path: rows without leaves (registered before migration 0006, or with
    signer=None) are reported until `ledger keys attest` vouches for them."""
    old, gone = generate_private_key(), generate_private_key()
    with session_scope(engine) as s:
        keys.register_key(s, public_key=public_raw(old), purpose="producer", name="old")
        row, _ = keys.register_key(s, public_key=public_raw(gone), purpose="producer",
                                   name="gone")
        keys.revoke_key(s, row.keyid, "retired")
    service_key = generate_private_key()
    service_file = tmp_path / "service.pem"
    service_file.write_bytes(private_pem(service_key))
    policy = TrustPolicy(ORIGIN, (LogSigner(ORIGIN, generate_private_key()).verifier(),),
                         (public_raw(service_key),))
    with session_scope(engine) as s:
        assert len(problems_of(s, policy)) == 2
    r = subprocess.run([sys.executable, "-m", "ledger.cli.main", "keys", "attest",
                        key_id(public_raw(old)), key_id(public_raw(gone))], cwd=REPO,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "LEDGER_DATABASE_URL": db_url,
                            "LEDGER_SERVICE_KEY_FILE": str(service_file)})
    assert r.returncode == 0, r.stdout + r.stderr
    with session_scope(engine) as s:
        vouched, problems = vouched_keys(s, policy)
        assert keys.attest_key(s, key_id(public_raw(old)),
                               signer=Signer(service_key, "ledger", "x")) == 0  # idempotent
    assert problems == []
    assert vouched[key_id(public_raw(old))].status == "active"
    assert vouched[key_id(public_raw(gone))].status == "revoked"
