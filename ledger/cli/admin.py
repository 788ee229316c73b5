"""`ledger db upgrade`, `ledger serve`, `ledger keys ...`, `ledger apikey ...`."""

from __future__ import annotations

import atexit
import base64
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Optional

import httpx
import typer

from ledger.cli.common import (
    DatabaseUrlOption,
    console,
    fail,
    out,
    settings_with,
    write_private_file,
)
from ledger.core import keys as corekeys
from ledger.db.session import raw_cursor

db_app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)
keys_app = typer.Typer(help="Ed25519 signing keys: generate locally, register with the ledger.",
                       no_args_is_help=True)
apikey_app = typer.Typer(help="API keys for the REST API.", no_args_is_help=True)

LOCAL_ADMIN = ("local-cli", "local-cli", "admin")


@db_app.command("upgrade")
def db_upgrade(database_url: Optional[str] = DatabaseUrlOption,  # noqa: UP045 - typer
               revision: str = typer.Option("head", help="Target revision.")) -> None:
    """Apply migrations up to REVISION (the only way the schema is made)."""
    from ledger.db.session import database_url as url_with_password
    from ledger.db.session import upgrade

    settings = settings_with(database_url)
    upgrade(url_with_password(settings), revision)
    console.print(f"[green]database at {revision}[/green]")


@db_app.command("create-login")
def db_create_login(
    component: str = typer.Option(..., help="api | beat | worker | auditor"),
    name: str = typer.Option(..., help="The LOGIN user to create (or update)."),
    password_file: Optional[Path] = typer.Option(  # noqa: UP045 - typer
        None, help="Read the password from this file; without it one is generated and "
                   "printed once, in the URL."),
    no_password: bool = typer.Option(False, help="No password (trust/peer/certificate "
                                     "authentication)."),
    database_url: Optional[str] = DatabaseUrlOption,  # noqa: UP045
) -> None:
    """As the schema owner (after `ledger db upgrade`): make NAME a LOGIN user that is a
    member of exactly one component role, and print the LEDGER_DATABASE_URL it uses (alone
    on the last line of standard output)."""
    import secrets

    from psycopg import sql
    from sqlalchemy import make_url

    from ledger.db.grants import COMPONENT_ROLES
    from ledger.db.session import database_url as url_with_password
    from ledger.db.session import make_engine

    group = COMPONENT_ROLES.get(component)
    if group is None:
        raise fail(f"unknown component {component!r}", f"one of {', '.join(COMPONENT_ROLES)}")
    settings = settings_with(database_url)
    if no_password:
        password = None
    elif password_file is not None:
        password = password_file.read_text().strip()
    else:
        password = secrets.token_urlsafe(24)
    engine = make_engine(settings, pool_size=1)
    others = [r for r in COMPONENT_ROLES.values() if r != group]
    with engine.begin() as conn:
        cur = raw_cursor(conn)
        cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (group,))
        if cur.fetchone() is None:
            console.print(f"[red]role {group} does not exist: run `ledger db upgrade` "
                          "first[/red]")
            raise typer.Exit(2)
        cur.execute("SELECT rolsuper, ARRAY(SELECT g.rolname FROM pg_auth_members m JOIN "
                    "pg_roles g ON g.oid = m.roleid WHERE m.member = r.oid) "
                    "FROM pg_roles r WHERE rolname = %s", (name,))
        row = cur.fetchone()
        if row is not None and (row[0] or set(row[1]) & set(others)):
            console.print(f"[red]{name} exists and is a superuser or a member of another "
                          f"component role ({', '.join(row[1])}): choose another name[/red]")
            raise typer.Exit(2)
        ident = sql.Identifier(name)
        verb = sql.SQL("ALTER ROLE" if row is not None else "CREATE ROLE")
        pw = sql.SQL("PASSWORD {}").format(sql.Literal(password)) if password \
            else sql.SQL("PASSWORD NULL")
        cur.execute(sql.SQL("{} {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS "
                            "INHERIT {}").format(verb, ident, pw))
        if group not in (row[1] if row else []):
            cur.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(group), ident))
    engine.dispose()
    # a password from a file is not echoed (logs keep what is printed): the process reads
    # the same file through LEDGER_DATABASE_PASSWORD_FILE; a generated one is shown once
    shown = password if password_file is None else None
    url = make_url(url_with_password(settings)).set(username=name, password=shown)
    hint = {True: " (the password is shown only once)", False: ""}[shown is not None]
    if password_file is not None:
        hint = f" with LEDGER_DATABASE_PASSWORD_FILE={password_file}"
    console.print(f"login {name} (member of {group}); use this LEDGER_DATABASE_URL{hint}:")
    print(url.render_as_string(hide_password=False))


def serve_command(
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    port: int = typer.Option(8000, help="TCP port."),
    workers: int = typer.Option(1, help="Server processes."),
    database_url: Optional[str] = DatabaseUrlOption,  # noqa: UP045
    log_level: str = typer.Option("warning", help="uvicorn log level."),
    insecure_dev: bool = typer.Option(False, "--insecure-dev", help="Development only: "
                                      "start as a superuser or without the pepper/log key."),
) -> None:
    """Run the REST API (uvicorn). Refuses to start as a database superuser or the schema
    owner, or without LEDGER_API_KEY_PEPPER (and LEDGER_LOG_KEY_FILE when it integrates)."""
    import uvicorn

    from ledger.db.privileges import enforce
    from ledger.db.session import make_engine

    settings = settings_with(database_url)
    if insecure_dev:
        settings = settings.model_copy(update={"insecure_dev": True})
    engine = make_engine(settings, pool_size=1)
    try:
        enforce(settings, engine, "api")  # `ledger check serve`
    finally:
        engine.dispose()
    if database_url:
        os.environ["LEDGER_DATABASE_URL"] = database_url
    if workers > 1 and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        metrics_dir = tempfile.mkdtemp(prefix="ledger-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        atexit.register(shutil.rmtree, metrics_dir, ignore_errors=True)
    uvicorn.run("ledger.api.main:app", host=host, port=port, workers=workers,
                log_level=log_level, access_log=False, timeout_graceful_shutdown=10)


@keys_app.command("generate")
def keys_generate(
    out_path: Annotated[Path, typer.Option("--out", help="Private key file (PEM, mode 0600).")],
    force: bool = typer.Option(False, help="Overwrite an existing file."),
) -> None:
    """Make an Ed25519 key pair; the private key goes to a 0600 file, never to stdout."""
    key = corekeys.generate_private_key()
    write_private_file(out_path, corekeys.private_pem(key), force=force)
    pub_path = out_path.with_suffix(out_path.suffix + ".pub")
    pub_path.write_bytes(corekeys.public_pem(key))
    raw = corekeys.public_raw(key)
    console.print(f"private key: {out_path} (0600)\npublic key:  {pub_path}")
    out.print_json(data={"keyid": corekeys.key_id(raw),
                         "public_key": base64.b64encode(raw).decode()})


@keys_app.command("generate-kek")
def keys_generate_kek(
    out_path: Annotated[Path, typer.Option("--out", help="KEK file (64 hex characters, "
                                           "mode 0600).")],
    force: bool = typer.Option(False, help="Overwrite an existing file."),
) -> None:
    """Make a key-encryption key for encryption at rest (LEDGER_KEK_FILE, docs/privacy.md):
    keep it outside the database; losing it makes every encrypted envelope unreadable."""
    import os

    from ledger.core.sealing import LocalKek

    raw = os.urandom(32)
    write_private_file(out_path, raw.hex().encode() + b"\n", force=force)
    console.print(f"key-encryption key: {out_path} (0600), id {LocalKek(raw).kek_id}")


def _public_from_file(path: Path) -> bytes:
    data = path.read_bytes()
    if b"PRIVATE KEY" in data:
        return corekeys.public_raw(corekeys.load_private_pem(data))
    return corekeys.parse_public_key(data.decode())


def _registry_signer(settings: Any) -> Any:
    """The service key (LEDGER_SERVICE_KEY_FILE) that signs registry leaves, or None with a
    warning: a change made without it is reported by `ledger audit`."""
    from ledger.replay.records import Signer

    signer = Signer.from_file(settings.service_key_file, "ledger", "ledger-service")
    if signer is None:
        console.print("[yellow]LEDGER_SERVICE_KEY_FILE is not set: the change is not a "
                      "signed registry leaf, and `ledger audit` will report it[/yellow]")
    return signer


@contextmanager
def _registry_session(settings: Any) -> Iterator[tuple[Any, Any]]:
    """(session, signer) for a local admin change: the registry signer (or None, warned
    about) registered first; the engine disposed of afterwards."""
    from ledger.db.session import make_engine, session_scope

    signer = _registry_signer(settings)
    engine = make_engine(settings, pool_size=1)
    try:
        with session_scope(engine) as session:
            if signer is not None:
                signer.ensure_registered(session)
            yield session, signer
    finally:
        engine.dispose()


@keys_app.command("register")
def keys_register(
    key_file: Annotated[Path, typer.Argument(help="Public key (PEM/base64) or private key PEM.")],
    purpose: str = typer.Option(..., help="producer | worker | log | ledger"),
    name: str = typer.Option(..., help="Who holds the key (e.g. gateway-eu-1)."),
    not_before: Optional[datetime] = typer.Option(None, help="RFC 3339; default now."),  # noqa: UP045
    not_after: Optional[datetime] = typer.Option(None, help="RFC 3339; default open."),  # noqa: UP045
    via_api: bool = typer.Option(False, "--api", help="Use the REST API (LEDGER_API_URL, "
                                 "LEDGER_API_KEY with role admin) instead of the database."),
    database_url: Optional[str] = DatabaseUrlOption,  # noqa: UP045
) -> None:
    """Register a public key with the ledger (admin)."""
    from ledger.core.errors import LedgerError

    try:
        raw = _public_from_file(key_file)
    except LedgerError as exc:  # a key the ledger refuses (small order, not canonical)
        console.print(f"refused: {exc.code}: {exc}", style="red", markup=False,
                      highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise fail(f"unreadable key file: {exc}", "pass a public key (PEM or base64) or a "
                   "private key PEM, e.g. from `ledger keys generate`") from None
    settings = settings_with(database_url)
    if via_api:
        if settings.api_key is None:
            raise fail("--api needs an API key", "set LEDGER_API_KEY to an admin API key")
        body = {"public_key": base64.b64encode(raw).decode(), "purpose": purpose, "name": name,
                "not_before": not_before.isoformat() if not_before else None,
                "not_after": not_after.isoformat() if not_after else None}
        resp = httpx.post(f"{settings.api_url}/v1/keys", json=body, timeout=30,
                          headers={"Authorization":
                                   f"Bearer {settings.api_key.get_secret_value()}"})
        if resp.status_code >= 400:
            console.print(f"[red]{resp.status_code}: {resp.text}[/red]")
            raise typer.Exit(1)
        out.print_json(resp.text)
        return
    from ledger.services import audit
    from ledger.services import keys as key_service
    from ledger.services.apikeys import Principal

    with _registry_session(settings) as (session, signer):
        row, created = key_service.register_key(session, public_key=raw, purpose=purpose,
                                                name=name, not_before=not_before,
                                                not_after=not_after, signer=signer,
                                                actor=LOCAL_ADMIN[1])
        if created:
            audit.record(session, Principal(*LOCAL_ADMIN), "key.register", row.keyid,
                         purpose=purpose, name=name)
        keyid, status = row.keyid, row.status
    out.print_json(data={"keyid": keyid, "purpose": purpose, "name": name, "status": status,
                         "created": created})


@keys_app.command("revoke")
def keys_revoke(keyid: str, reason: str = typer.Option(..., help="Why (kept in the audit)."),
                database_url: Optional[str] = DatabaseUrlOption) -> None:  # noqa: UP045
    """Revoke a signing key (new envelopes signed by it are refused)."""
    from ledger.services import audit
    from ledger.services import keys as key_service
    from ledger.services.apikeys import Principal

    with _registry_session(settings_with(database_url)) as (session, signer):
        key_service.revoke_key(session, keyid, reason, signer=signer, actor=LOCAL_ADMIN[1])
        audit.record(session, Principal(*LOCAL_ADMIN), "key.revoke", keyid, reason=reason)
    console.print(f"[yellow]revoked {keyid}[/yellow]")


@keys_app.command("attest")
def keys_attest(keyids: Annotated[list[str], typer.Argument(help="Key IDs (hex SHA-256).")],
                database_url: Optional[str] = DatabaseUrlOption) -> None:  # noqa: UP045
    """Vouch for existing key rows that have no registry leaf (keys registered before the
    upgrade that added them): appends their registration (and revocation) leaves, signed
    with LEDGER_SERVICE_KEY_FILE. Check each row first: attesting is vouching."""
    from ledger.db.session import make_engine, session_scope
    from ledger.replay.records import Signer
    from ledger.services import audit
    from ledger.services import keys as key_service
    from ledger.services.apikeys import Principal

    settings = settings_with(database_url)
    signer = Signer.from_file(settings.service_key_file, "ledger", "ledger-service")
    if signer is None:
        raise fail("attesting signs registry leaves", "set LEDGER_SERVICE_KEY_FILE")
    engine = make_engine(settings)
    with session_scope(engine) as session:
        signer.ensure_registered(session)
        for keyid in keyids:
            n = key_service.attest_key(session, keyid, signer=signer, actor=LOCAL_ADMIN[1])
            if n:
                audit.record(session, Principal(*LOCAL_ADMIN), "key.attest", keyid, leaves=n)
            console.print(f"{keyid}: {n} registry leaf(s) appended")
    engine.dispose()


@apikey_app.command("create")
def apikey_create(
    role: str = typer.Option(..., help="ingester | reviewer | auditor | worker | admin"),
    name: str = typer.Option(..., help="A unique name for the key."),
    database_url: Optional[str] = DatabaseUrlOption,  # noqa: UP045
) -> None:
    """Create an API key directly in the database; the key is printed once, alone on the
    last line of standard output."""
    from ledger.services import audit
    from ledger.services.apikeys import ROLES, Principal, create_api_key

    if role not in ROLES:
        raise fail(f"unknown role {role!r}", f"one of {', '.join(ROLES)}")
    settings = settings_with(database_url)
    with _registry_session(settings) as (session, signer):
        row, secret = create_api_key(session, name=name, role=role,
                                     pepper=settings.api_key_pepper.get_secret_value(),
                                     created_by="local-cli", signer=signer)
        audit.record(session, Principal(*LOCAL_ADMIN), "api_key.create", str(row.id),
                     name=name, role=role)
    console.print(f"API key {name!r} ({role}); it is shown only once:")
    print(secret)


@apikey_app.command("list")
def apikey_list(database_url: Optional[str] = DatabaseUrlOption) -> None:  # noqa: UP045
    """List API keys (name, role, prefix, created, revoked); never the keys themselves."""
    from rich.table import Table

    from ledger.db.session import make_engine, session_scope
    from ledger.services.apikeys import list_api_keys

    engine = make_engine(settings_with(database_url), pool_size=1)
    table = Table("id", "name", "role", "prefix", "created", "revoked")
    with session_scope(engine) as session:
        for row in list_api_keys(session):
            table.add_row(str(row.id), row.name, row.role, row.prefix,
                          f"{row.created_at:%Y-%m-%d %H:%M}",
                          f"{row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "-")
    engine.dispose()
    out.print(table)


@apikey_app.command("revoke")
def apikey_revoke(key_id: Annotated[str, typer.Argument(help="The key's id (`ledger apikey "
                                                              "list`).")],
                  database_url: Optional[str] = DatabaseUrlOption) -> None:  # noqa: UP045
    """Revoke an API key: it is refused from now on (a signed registry leaf and an audit
    event record who did it)."""
    from ledger.errors import NotFound
    from ledger.services import audit
    from ledger.services.apikeys import Principal, revoke_api_key

    try:
        with _registry_session(settings_with(database_url)) as (session, signer):
            row = revoke_api_key(session, key_id, signer=signer, actor=LOCAL_ADMIN[1])
            audit.record(session, Principal(*LOCAL_ADMIN), "api_key.revoke", key_id)
            name = row.name
    except NotFound as exc:
        raise fail(exc.message, "`ledger apikey list` shows the ids") from None
    console.print(f"[yellow]revoked API key {name!r} ({key_id})[/yellow]")


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
    app.add_typer(keys_app, name="keys")
    app.add_typer(apikey_app, name="apikey")
    app.command("serve")(serve_command)
